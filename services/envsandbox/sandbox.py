"""Sandboxes behind one interface: the backend-independent manager and the backend contract.

The manager owns ids, time-to-live, leases, the live-sandbox limit, create idempotency,
Fork and RunTests; a :class:`Backend` owns isolation (where files live, how commands run). Two
backends exist: ``process`` (namespaces + cgroups, no daemon; the default) and ``docker``.

This module is the service's pure core: it knows nothing of gRPC.
"""
from __future__ import annotations

import abc
import asyncio
import contextlib
import dataclasses
import errno
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from meridian.errors import Aborted, FailedPrecondition, InvalidArgument, MeridianError, NotFound, ResourceExhausted, Unavailable
from meridian.fifo_slots import FifoSlots
from meridian.run_to_end import RunToEnd
from services.envsandbox import swebench, workspace_files
from services.envsandbox.tasks import TESTS_DIR, Task, TestOutcome, score_output

log = logging.getLogger(__name__)

SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
HARNESS_PATH = f"{TESTS_DIR}/_harness.py"
HARNESS_SOURCE = (Path(__file__).parent / "harness.py").read_text()
SWEBENCH_RUNNER_ARGS = [f"{TESTS_DIR}/{swebench.RUNNER_PATH}", f"{TESTS_DIR}/{swebench.TEST_LIST_PATH}"]
SANDBOX_UID = 61000
MAX_FORK = 64
#: Files and folders a sandbox's tmpfs may hold per MiB of its size cap. Without a cap a
#: tmpfs takes millions: empty files whose kernel memory, charged to the sandbox, starves
#: every later command of it (the tests included) before the size cap is reached.
INODES_PER_MIB = 256


def tmpfs_inodes(size_bytes: int) -> int:
    """The inode cap of a sandbox tmpfs of ``size_bytes``."""
    return max(1024, size_bytes // (1 << 20) * INODES_PER_MIB)


#: Kernel memory one tmpfs inode may take at most (its inode, dentry and name, or the user
#: extended attributes tmpfs lets take an inode's room): measured on kernel 6.18, 1.5 KiB
#: for files, folders and symlinks with 255-byte names, 1.2 KiB per inode's room of xattrs;
#: the rest is margin for kernels whose inodes carry more (security modules).
TMPFS_INODE_BYTES = 2048


def tmpfs_charge(size_bytes: int) -> int:
    """The most a sandbox tmpfs of ``size_bytes`` can charge to a memory cgroup when full:
    its pages and its inodes' kernel memory.

    Both are charged to the memory cgroup of the process that writes them and stay charged
    while the files exist, so a backend sets its sandbox's memory limit to the sandbox's
    ``memory_bytes`` plus this for every tmpfs the sandbox can write: a full disk then
    leaves the sandbox's processes their whole ``memory_bytes`` (without it, filling the
    disk got every later command of the sandbox, the tests and Docker's file helper
    included, OOM-killed)."""
    return size_bytes + tmpfs_inodes(size_bytes) * TMPFS_INODE_BYTES


#: The size of a sandbox's /dev/shm, a tmpfs of its own on both backends (POSIX shared
#: memory and semaphores: Python's multiprocessing locks live there). Its room, like every
#: writable tmpfs's, comes on top of memory_bytes (tmpfs_charge): filled, it would otherwise
#: leave the sandbox's commands and the service's helpers no memory.
SHM_BYTES = 16 << 20


#: The longest one workspace copy of a Fork may take, on either backend (a workspace holds
#: at most LimitCaps.disk_bytes).
COPY_WALL_S = 300.0

#: How often RunTests kills the processes of its sandbox again while an exec that began
#: before it is still at work (see SandboxManager._settle).
SETTLE_POLL_S = 0.05

#: Bounds on one exec request (Linux takes at most 128 KiB per argument or variable).
MAX_ARG_BYTES = 64 * 1024
MAX_ARGV_ENTRIES = 4096
MAX_ENV_ENTRIES = 256
MAX_ARGS_TOTAL_BYTES = 512 * 1024
#: Variables that steer the dynamic loader or libc's file lookups: never passed on.
LOADER_VARIABLES = ("GCONV_PATH", "GETCONF_DIR", "GLIBC_TUNABLES", "HOSTALIASES", "LOCALDOMAIN", "LOCPATH",
                    "NIS_PATH", "NLSPATH", "RESOLV_HOST_CONF", "RES_OPTIONS", "TZDIR")
LOADER_PREFIXES = ("LD_", "MALLOC_")
#: errno values of a write that found no room: the workspace's size cap (bytes or inodes),
#: a quota, a file size limit. Only these are RESOURCE_EXHAUSTED.
NO_ROOM_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
#: errno values of a host short of something for now (descriptors, memory): a retry can work.
HOST_SHORT_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN, errno.EBUSY, errno.EINTR})


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one sandbox may use.

    ``memory_bytes`` is the memory its processes may use together and ``disk_bytes`` the
    size of its workspace and /tmp; neither eats the other. Files in a sandbox live in
    memory (tmpfs) and the kernel charges them to the sandbox's memory cgroup, so each
    backend sets that cgroup's limit to ``memory_bytes`` plus the most its tmpfs mounts
    can hold (:func:`tmpfs_charge`): a full disk leaves the processes their
    ``memory_bytes``, and a sandbox whose disk is not full may use up to that much more
    memory. The Docker backend's /tmp is a tmpfs of its own beside the workspace
    (``docker_backend.tmp_bytes``); the process backend's workspace and /tmp share one.
    Both backends' /dev/shm is one more (:data:`SHM_BYTES`), counted the same way.
    """

    memory_bytes: int = 512 * 1024 * 1024
    max_pids: int = 128
    cpus: float = 1.0
    cpu_seconds: float = 30.0
    wall_seconds: float = 20.0
    max_output_bytes: int = 1024 * 1024
    max_file_bytes: int = 64 * 1024 * 1024
    disk_bytes: int = 128 * 1024 * 1024

    def exec_wall(self, timeout_s: float) -> float:
        """An exec's wall limit: its own ``timeout_s`` (0: none) within ``wall_seconds``."""
        return min(timeout_s, self.wall_seconds) if timeout_s > 0 else self.wall_seconds

    def merged(self, **overrides: float | int) -> "Limits":
        """These limits with every positive override applied."""
        return dataclasses.replace(self, **{k: v for k, v in overrides.items() if v and v > 0})


def cpu_limit_seconds(limits: Limits) -> int:
    """The RLIMIT_CPU of every process an exec starts, on both backends: ``cpu_seconds``
    rounded down, at least 1, as both the soft and the hard limit. RLIMIT_CPU counts per
    process (its threads together, not its children), so each process of the exec's tree
    is killed by SIGKILL once it has used that much CPU time itself; sandbox code, with no
    capability, cannot raise it. Soft and hard are one: with a soft limit below the hard
    one the kernel sends SIGXCPU at the soft limit, but never to a pid namespace's process
    1 (the process backend's command), which ran on to the hard limit and died by SIGKILL
    while the same command on Docker died by SIGXCPU a second earlier. Now a CPU-limit kill
    is signal 9, neither timed out nor OOM-killed, on both backends, whichever process of
    the tree it ends. What bounds a sandbox's CPU as a whole is ``cpus`` over the exec's
    wall time: every new process starts its own count."""
    return max(1, int(limits.cpu_seconds))


#: Open files per process of an exec, on both backends.
EXEC_NOFILE = 1024


def exec_rlimits(limits: Limits, memory_limit: int) -> dict[str, int]:
    """The rlimits, soft and hard alike, of every process an exec starts, on both backends
    (the process backend's launcher options, Docker's exec wrapper): ``as``, twice the
    sandbox's ``memory_limit`` (its cgroup's: the memory and its tmpfs room; address space,
    not memory, which runtimes reserve beyond what they touch, so that a command that
    takes too much meets the cgroup's OOM killer on both backends, not a failed allocation
    on one), ``cpu`` (:func:`cpu_limit_seconds`), ``fsize``, ``max_file_bytes`` (a write
    past it fails with EFBIG, and the writer dies of SIGXFSZ unless it handles it) and
    ``nofile``, :data:`EXEC_NOFILE`. Both also turn core dumps off."""
    return {"as": 2 * memory_limit, "cpu": cpu_limit_seconds(limits), "fsize": limits.max_file_bytes, "nofile": EXEC_NOFILE}


@dataclasses.dataclass(frozen=True)
class LimitCaps:
    """The most a client may ask for: limits, time-to-live and exec timeouts above these
    answer INVALID_ARGUMENT, so one request cannot take the machine. A sandbox's memory
    cgroup limit is its memory plus what its tmpfs mounts can hold (see :class:`Limits`),
    so these caps bound it too: at most ``memory_bytes`` plus :func:`tmpfs_charge` of
    ``disk_bytes`` and of :data:`SHM_BYTES` (and, on Docker, of its /tmp)."""

    memory_bytes: int = 4 << 30
    max_pids: int = 1024
    cpus: float = 4.0
    cpu_seconds: float = 600.0
    wall_seconds: float = 600.0
    max_output_bytes: int = 16 << 20
    max_file_bytes: int = 256 << 20
    disk_bytes: int = 4 << 30
    ttl_seconds: float = 24 * 3600.0
    wait_seconds: float = 600.0  # a Create waiting in line for room (--max-create-wait-s)

    def check(self, limits: Limits) -> None:
        """Raises InvalidArgument naming the first limit that is not finite, positive and capped."""
        for field in dataclasses.fields(Limits):
            value, cap = getattr(limits, field.name), getattr(self, field.name)
            if not (math.isfinite(value) and 0 < value <= cap):
                raise InvalidArgument(f"limit {field.name} must be in (0, {cap}], got {value}")

    def check_ttl(self, ttl_s: float) -> None:
        """0 (the default) or a finite positive number of seconds up to the cap."""
        self._check_seconds("ttl_seconds", ttl_s, "the default")

    def check_lease(self, lease_s: float) -> None:
        """0 (no lease) or a finite positive number of seconds up to the time-to-live cap."""
        self._check_seconds("lease_seconds", lease_s, "no lease")

    def capped_wait(self, wait_s: float) -> float:
        """A Create's time in line: 0 (refused at once when full) or finite positive
        seconds, cut to the cap (a client that asks for more still gets its turn or a
        RESOURCE_EXHAUSTED in time, so it need not know this server's cap)."""
        if not (math.isfinite(wait_s) and wait_s >= 0):
            raise InvalidArgument(f"wait_seconds must be finite and >= 0 (0: no waiting), got {wait_s}")
        return min(wait_s, self.wait_seconds)

    def _check_seconds(self, name: str, value: float, zero: str) -> None:
        if not (math.isfinite(value) and 0 <= value <= self.ttl_seconds):
            raise InvalidArgument(f"{name} must be in [0, {self.ttl_seconds}] (0: {zero}), got {value}")


@dataclasses.dataclass(frozen=True)
class ExecResult:
    exit_code: int
    signal: int
    timed_out: bool
    stdout_truncated: bool
    stderr_truncated: bool
    wall_seconds: float
    oom_killed: bool = False


ExecItem = tuple[str, bytes] | ExecResult


@dataclasses.dataclass
class Sandbox:
    sandbox_id: str
    task: Task | None
    limits: Limits
    created: float
    expires: float
    client_request_id: str = ""
    ready: bool = False
    #: 0: no lease. Otherwise the sandbox is closed once no call has used it and no renewal
    #: has named it for this long: its client is gone (a rollout killed mid-episode).
    lease_s: float = 0.0
    renewed: float = 0.0  # the manager's clock (monotonic) at the last call or renewal
    in_use: int = 0  # calls running on it: a lease never lapses under one (a long test run)
    #: RunTests runs on it: every call that could run code in it, change its files or read
    #: or copy them (the hidden tests may be among them) is refused until RunTests returns.
    testing: bool = False
    #: Calls at work on it that RunTests must see end before its tests start: file
    #: operations, a Fork's copies of it, and execs while the manager waits on the backend
    #: (an exec whose process may not have started yet); ``execs`` counts those execs.
    work: int = 0
    execs: int = 0
    #: Set while ``work`` is 0.
    settled: asyncio.Event = dataclasses.field(default_factory=asyncio.Event, repr=False, compare=False)
    #: Set once the call making it is over, made or failed: a retry of its Create waits here.
    made: asyncio.Event = dataclasses.field(default_factory=asyncio.Event, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.settled.set()

    def lease_lapsed(self, now: float) -> bool:
        """Whether the lease ran out by ``now`` (the manager's clock)."""
        return self.lease_s > 0 and self.in_use == 0 and now - self.renewed > self.lease_s

    def refuse_while_testing(self) -> None:
        """FAILED_PRECONDITION while RunTests runs on this sandbox."""
        if self.testing:
            raise FailedPrecondition(f"sandbox {self.sandbox_id}: its tests are running (RunTests); try again once they have returned")

    def begin_work(self, is_exec: bool = False) -> None:
        """A call begins work RunTests must wait for (refused while RunTests runs): checked
        and counted in one step, with no await between."""
        self.refuse_while_testing()
        self.resume_work(is_exec)

    def resume_work(self, is_exec: bool = False) -> None:
        """Counts work again, without the check: an exec whose process already started."""
        self.work += 1
        self.execs += is_exec
        self.settled.clear()

    def end_work(self, is_exec: bool = False) -> None:
        self.work -= 1
        self.execs -= is_exec
        if not self.work:
            self.settled.set()


class Backend(abc.ABC):
    """Where sandboxes live and how their commands run."""

    name: str = ""

    @abc.abstractmethod
    async def start(self) -> None:
        """Prepares the backend and removes what a previous (killed) run left behind."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """Releases everything the backend holds."""

    @abc.abstractmethod
    async def create(self, sandbox_id: str, limits: Limits) -> None:
        """An empty workspace, limited by ``limits``."""

    @abc.abstractmethod
    async def destroy(self, sandbox_id: str) -> None:
        """Kills every process of the sandbox and removes all its resources."""

    @abc.abstractmethod
    async def write_files(self, sandbox_id: str, files: dict[str, bytes], mode: int = 0o644) -> None:
        """Writes files below the workspace; raises workspace_files.PathError on bad paths."""

    @abc.abstractmethod
    async def read_files(self, sandbox_id: str, paths: list[str], max_bytes: int) -> dict[str, bytes]:
        """Reads regular files below the workspace without following symlinks."""

    @abc.abstractmethod
    async def remove(self, sandbox_id: str, path: str) -> None:
        """Removes a file or folder below the workspace (no error if absent)."""

    @abc.abstractmethod
    async def check_folder(self, sandbox_id: str, path: str) -> None:
        """Raises workspace_files.PathError unless ``path`` is a folder below the workspace
        reached without a symlink (:func:`workspace_files.check_folder`)."""

    @abc.abstractmethod
    async def copy_workspace(self, src_id: str, dst_id: str) -> None:
        """Copies one sandbox's workspace into another's (empty) one."""

    @abc.abstractmethod
    def exec(
        self, sandbox_id: str, argv: list[str], stdin: bytes, env: dict[str, str], cwd: str, wall_s: float, limits: Limits
    ) -> AsyncIterator[ExecItem]:
        """Runs ``argv``; yields ``("stdout"|"stderr", bytes)`` chunks, then one ExecResult."""

    @abc.abstractmethod
    async def kill_all(self, sandbox_id: str) -> None:
        """Kills every process of the sandbox and returns once none is left (raises otherwise)."""

    @abc.abstractmethod
    async def leftovers(self) -> list[str]:
        """Resources of this backend that no live sandbox accounts for (should be none)."""


class HostFault(MeridianError):
    """A fault of the host's (an I/O error, a read-only file system), not of the request
    nor of the sandbox: INTERNAL, with a message that says what failed."""

    status = "INTERNAL"


def path_error(exc: workspace_files.PathError) -> Exception:
    return NotFound(str(exc)) if exc.kind == "not_found" else InvalidArgument(str(exc))


def write_error(sandbox_id: str, exc: OSError) -> MeridianError:
    """The status of an ``OSError`` that writing files in a sandbox raised (bad paths are
    PathErrors before they get here, see workspace_files): RESOURCE_EXHAUSTED only when
    there was no room, UNAVAILABLE when the host is short of descriptors or memory, and
    INTERNAL (logged) for anything else; each message names the file when it is known."""
    what = f"cannot write {exc.filename!r} in sandbox {sandbox_id}" if exc.filename else f"cannot write files in sandbox {sandbox_id}"
    return _os_error(what, exc, "the sandbox's workspace has no room for it")


def copy_error(src_id: str, exc: workspace_files.PathError | OSError) -> MeridianError:
    """The status of an error that copying sandbox ``src_id``'s workspace (Fork) raised, the
    same on every backend: ABORTED when the tree changed under the copy (a retry can work),
    RESOURCE_EXHAUSTED when the copy does not fit, UNAVAILABLE when the host is short of
    descriptors or memory, INTERNAL (logged) for a host fault."""
    if isinstance(exc, workspace_files.PathError):
        return Aborted(f"cannot copy the workspace of sandbox {src_id}: {exc}")
    return _os_error(f"cannot copy the workspace of sandbox {src_id}", exc, "it does not fit in a copy")


def _os_error(what: str, exc: OSError, no_room: str) -> MeridianError:
    """An OSError of the service's file work as a status: RESOURCE_EXHAUSTED for no room
    (``no_room`` says of what), UNAVAILABLE for a host short of descriptors or memory,
    INTERNAL (logged) for a host fault."""
    reason = f"{exc.strerror or exc} ({errno.errorcode.get(exc.errno, exc.errno)})" if exc.errno else str(exc)
    if exc.errno in NO_ROOM_ERRNOS:
        return ResourceExhausted(f"{what}: {reason}; {no_room}")
    if exc.errno in HOST_SHORT_ERRNOS:
        return Unavailable(f"{what}: {reason}; the host is short of it for now, retry later")
    log.error("%s: %s", what, reason)
    return HostFault(f"{what}: {reason}; a fault of the host, not of the request")


def sandbox_env(env: dict[str, str] | None) -> dict[str, str]:
    """The environment of a sandboxed command: a fixed base plus what the caller asked for.
    Loader variables (``LD_*``, ``GCONV_PATH``, ...) are refused: they steer code that a
    backend may run before the command, and nothing legitimate needs them."""
    full = {"PATH": SAFE_PATH, "HOME": "/workspace", "TMPDIR": "/tmp", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
    if len(env or {}) > MAX_ENV_ENTRIES:
        raise InvalidArgument(f"env has {len(env or {})} variables, more than {MAX_ENV_ENTRIES}")
    for key, value in (env or {}).items():
        if not key or "=" in key or "\x00" in key or "\x00" in value:
            raise InvalidArgument(f"bad environment variable {key!r}")
        if key in LOADER_VARIABLES or key.startswith(LOADER_PREFIXES):
            raise InvalidArgument(f"environment variable {key} is not allowed (it steers the dynamic loader or libc)")
        if len(key) + len(value) + 1 > MAX_ARG_BYTES:
            raise InvalidArgument(f"environment variable {key} is {len(value)} bytes long, more than {MAX_ARG_BYTES}")
        full[key] = value
    return full


def check_argv(argv: list[str], env: dict[str, str]) -> None:
    """Bounds an exec's command line: INVALID_ARGUMENT instead of a failed exec later."""
    if not argv or not argv[0] or any("\x00" in a for a in argv):
        raise InvalidArgument("argv must name a command (and hold no NUL bytes)")
    if len(argv) > MAX_ARGV_ENTRIES:
        raise InvalidArgument(f"argv has {len(argv)} entries, more than {MAX_ARGV_ENTRIES}")
    longest = max(len(a.encode()) for a in argv)
    if longest > MAX_ARG_BYTES:
        raise InvalidArgument(f"an argv entry is {longest} bytes long, more than {MAX_ARG_BYTES}")
    total = sum(len(a.encode()) + 1 for a in argv) + sum(len(k) + len(v.encode()) + 2 for k, v in env.items())
    if total > MAX_ARGS_TOTAL_BYTES:
        raise InvalidArgument(f"argv and env come to {total} bytes, more than {MAX_ARGS_TOTAL_BYTES}")


def tests_invocation(task: Task) -> tuple[list[str], bytes, dict[str, bytes]]:
    """How RunTests runs a task's tests: (argv, stdin, hidden files to write first).

    A test command of the harness's shape (``python3 ... .tests/_harness.py .tests/<m>``)
    runs the harness from its source in memory with the test module on stdin; one of the
    SWE-bench runner's (``python3 ... .tests/_swebench_runner.py .tests/_swebench_tests.json``)
    runs this service's runner from memory with the test ids and hidden files on stdin:
    neither is ever on the sandbox's disk. Any other test command gets its files under
    ``.tests/``."""
    argv = task.test_command
    if HARNESS_PATH in argv:
        at = argv.index(HARNESS_PATH)
        rest = argv[at + 1 :]
        module = rest[0] if len(rest) == 1 else ""
        name = module.removeprefix(f"{TESTS_DIR}/")
        if module.startswith(f"{TESTS_DIR}/") and name in task.tests:
            return [*argv[:at], "-c", HARNESS_SOURCE, "--stdin", module], task.tests[name].encode(), {}
    if SWEBENCH_RUNNER_ARGS == argv[-2:] and swebench.TEST_LIST_PATH in task.tests:
        files = {p: c for p, c in task.tests.items() if p not in (swebench.RUNNER_PATH, swebench.TEST_LIST_PATH)}
        request = {"tests": json.loads(task.tests[swebench.TEST_LIST_PATH]), "files": files}
        # The runner is this service's own, whatever the task's copy says.
        return [*argv[:-2], "-c", swebench.RUNNER_SOURCE, "--stdin"], json.dumps(request).encode(), {}
    hidden = {f"{TESTS_DIR}/{p}": c.encode() for p, c in task.tests.items()}
    return list(argv), b"", hidden


class SandboxManager:
    """Owns every live sandbox of one service process.

    The live sandbox limit counts slots (:class:`~meridian.fifo_slots.FifoSlots`): one
    per sandbox, plus what a Create reserved for its forks and they have not used yet.
    Every client shares them, so a Create that may wait takes its place in one line, and
    one that reserved for its forks cannot lose their room to another client between its
    Create and its Fork (several rollouts in front of one envsandbox)."""

    def __init__(
        self,
        backend: Backend,
        default_limits: Limits = Limits(),
        default_ttl_s: float = 600.0,
        max_sandboxes: int = 256,
        caps: LimitCaps = LimitCaps(),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.backend = backend
        self.clock = clock  # leases run on it: a wall-clock jump must not end them
        self.caps = caps
        caps.check(default_limits)
        self.default_limits = default_limits
        self.default_ttl_s = default_ttl_s
        self.slots = FifoSlots(max_sandboxes)
        # Steps a caller that goes away must not cut short: teardowns, test runs.
        self._to_end = RunToEnd("a sandbox teardown or test run", log)
        self._boxes: dict[str, Sandbox] = {}
        #: Slots a live sandbox holds for its forks, beyond its own (CreateRequest.fork_reserve).
        self._reserved: dict[str, int] = {}
        self._by_request: dict[str, str] = {}
        #: Sandboxes the reaper closed, by reason: "lease" (unrenewed) or "ttl".
        self.expired: dict[str, int] = {"lease": 0, "ttl": 0}
        self._started = False
        self._start_lock = asyncio.Lock()

    async def start(self) -> None:
        """Starts the backend once (concurrent callers wait for the first)."""
        async with self._start_lock:
            if not self._started:
                await self.backend.start()
                self._started = True

    # ------------------------------------------------------------ lifecycle

    def limits_for(self, task: Task | None) -> Limits:
        if task is None:
            return self.default_limits
        return self.default_limits.merged(**dataclasses.asdict(task.limits))

    async def create(
        self,
        task: Task | None = None,
        files: dict[str, bytes] | None = None,
        limits: Limits | None = None,
        ttl_s: float = 0.0,
        client_request_id: str = "",
        lease_s: float = 0.0,
        fork_reserve: int = 0,
        wait_s: float = 0.0,
    ) -> Sandbox:
        """A new sandbox holding the task's files then ``files``; idempotent per request id.
        ``fork_reserve`` more slots are held for its forks; with ``wait_s`` the Create
        waits in line that long for room instead of being refused at once."""
        await self.start()
        existing = await self._existing(client_request_id)
        if existing is not None:
            return existing
        self.caps.check_ttl(ttl_s)
        self.caps.check_lease(lease_s)
        wait_s = self.caps.capped_wait(wait_s)
        limits = limits or self.limits_for(task)
        self.caps.check(limits)
        if not 0 <= fork_reserve <= MAX_FORK or 1 + fork_reserve > self.max_sandboxes:
            raise InvalidArgument(
                f"fork_reserve must be in 0..{min(MAX_FORK, self.max_sandboxes - 1)} (the sandbox and its reserve within the "
                f"live sandbox limit of {self.max_sandboxes}, forks up to {MAX_FORK}), got {fork_reserve}"
            )
        await self._take_slots(1 + fork_reserve, wait_s)
        while client_request_id in self._by_request:
            # Another call with this id got in while this one waited in line: one sandbox
            # per id, so that call's outcome answers; if it failed, this one makes it.
            self.slots.release(1 + fork_reserve)
            existing = await self._existing(client_request_id)
            if existing is not None:
                return existing
            await self._take_slots(1 + fork_reserve, wait_s)
        box = self._register(task, limits, ttl_s or self.default_ttl_s, lease_s, client_request_id, fork_reserve)
        await self._materialize(box, {**({p: c.encode() for p, c in task.files.items()} if task is not None else {}), **(files or {})})
        return box

    async def _existing(self, client_request_id: str) -> Sandbox | None:
        """The live sandbox an earlier Create with this request id made, if any (renewed).
        One still being made is waited for: a retry must not answer with a sandbox whose
        files are not all there yet, or that its first call then fails to make."""
        while client_request_id:
            existing = self._boxes.get(self._by_request.get(client_request_id, ""))
            if existing is None:
                return None
            if existing.made.is_set():
                existing.renewed = self.clock()
                return existing
            await existing.made.wait()  # then look again: made, or removed with its id
        return None

    async def _take_slots(self, count: int, wait_s: float) -> None:
        """Takes ``count`` slots: at once if they fit and nobody waits ahead, else in line for
        up to ``wait_s`` (0: refused at once); RESOURCE_EXHAUSTED saying why otherwise."""
        if self.slots.try_acquire(count):
            return
        ahead = f"; {self.slots.waiting} Creates wait in line ahead" if self.slots.waiting else ""
        if wait_s <= 0:
            raise ResourceExhausted(f"live sandbox limit reached ({self.max_sandboxes}, {self.slots.held} held){ahead}; close some first, or wait (wait_seconds)")
        try:
            async with asyncio.timeout(wait_s):
                await self.slots.acquire(count)
        except TimeoutError:
            raise ResourceExhausted(
                f"no room for {count} sandboxes within {wait_s:g} s: the live sandbox limit ({self.max_sandboxes}) stayed full{ahead}"
            ) from None

    def _register(self, task: Task | None, limits: Limits, ttl_s: float, lease_s: float, client_request_id: str = "", reserve: int = 0) -> Sandbox:
        """A sandbox's record, registered at once (the caller holds its slot and ``reserve``):
        from here on its slots come back only through :meth:`_remove`."""
        now = time.time()
        box = Sandbox(
            sandbox_id="sbx-" + uuid.uuid4().hex[:16],
            task=task,
            limits=limits,
            created=now,
            expires=now + ttl_s,
            client_request_id=client_request_id,
            lease_s=lease_s,
        )
        self._boxes[box.sandbox_id] = box
        if reserve:
            self._reserved[box.sandbox_id] = reserve
        if client_request_id:
            self._by_request[client_request_id] = box.sandbox_id
        return box

    async def _materialize(self, box: Sandbox, files: dict[str, bytes]) -> None:
        """Makes a registered sandbox in the backend and writes ``files``; on any failure
        (cancellation included) the sandbox is removed and its slots given back."""
        try:
            with self._using(box):
                await self.backend.create(box.sandbox_id, box.limits)
                box.ready = True
                if files:
                    await self._write(box, files)
        except BaseException:
            await self._remove(box)
            raise
        finally:
            box.made.set()

    def get(self, sandbox_id: str) -> Sandbox:
        box = self._boxes.get(sandbox_id)
        if box is None or not box.ready:
            raise NotFound(f"no live sandbox {sandbox_id!r}")
        return box

    def list(self) -> list[Sandbox]:
        return [b for b in self._boxes.values() if b.ready]

    @property
    def max_sandboxes(self) -> int:
        """The live sandbox limit: the slots' capacity."""
        return self.slots.capacity

    @property
    def reserved(self) -> int:
        """Slots live sandboxes hold for forks not made yet."""
        return sum(self._reserved.values())

    @contextlib.contextmanager
    def _using(self, box: Sandbox) -> Iterator[None]:
        """A call runs on ``box``: its lease is renewed and cannot lapse until the call ends."""
        box.in_use += 1
        box.renewed = self.clock()
        try:
            yield
        finally:
            box.in_use -= 1
            box.renewed = self.clock()

    @contextlib.contextmanager
    def _working(self, box: Sandbox) -> Iterator[None]:
        """A call works on ``box``'s files: refused while its tests run, and RunTests waits
        for it to end before the tests start."""
        box.begin_work()
        try:
            with self._using(box):
                yield
        finally:
            box.end_work()

    def renew(self, sandbox_ids: Iterable[str]) -> list[str]:
        """Renews the leases of ``sandbox_ids``; returns those that are no live sandbox."""
        now = self.clock()
        gone = []
        for sandbox_id in dict.fromkeys(sandbox_ids):
            box = self._boxes.get(sandbox_id)
            if box is None:
                gone.append(sandbox_id)
            else:
                box.renewed = now
        return gone

    async def close(self, sandbox_id: str) -> None:
        """Kills whatever still runs in the sandbox and removes all its resources.

        Also while RunTests runs on it: Close does not wait for the tests (they may take
        the task's whole wall time, and the reaper closes expired sandboxes this way); the
        RunTests call then answers NOT_FOUND."""
        await self._remove(self.get(sandbox_id))

    async def _remove_all(self, boxes: list[Sandbox]) -> None:
        for box in boxes:
            await self._remove(box)

    async def _remove(self, box: Sandbox) -> None:
        """Unregisters ``box``, destroys it and gives back its slots; a box already
        removed is left alone (its remover destroys it). Its own slot comes back once the
        backend let go of it (its processes, mounts, cgroups and uid), so the limit bounds
        what the host holds, sandboxes being torn down included; its unused reserve, which
        holds nothing, at once."""
        box.ready = False
        if self._boxes.pop(box.sandbox_id, None) is None:
            return
        reserve = self._reserved.pop(box.sandbox_id, 0)
        if reserve:
            self.slots.release(reserve)
        if box.client_request_id and self._by_request.get(box.client_request_id) == box.sandbox_id:
            self._by_request.pop(box.client_request_id, None)
        # A Close whose caller goes away (its deadline) must not cut the teardown short:
        # it would leave processes, mounts or a uid behind that no sandbox accounts for.
        await self._to_end.run(self._teardown(box.sandbox_id))

    async def _teardown(self, sandbox_id: str) -> None:
        try:
            await self.backend.destroy(sandbox_id)
        finally:
            self.slots.release(1)

    async def reap_expired(self, now: float | None = None) -> list[str]:
        """Closes sandboxes past their time-to-live (``now``: wall clock) or whose lease
        lapsed; returns their ids."""
        now = time.time() if now is None else now
        lease_now = self.clock()
        expired = {b.sandbox_id: "ttl" if b.expires <= now else "lease" for b in self.list() if b.expires <= now or b.lease_lapsed(lease_now)}
        for sandbox_id, reason in expired.items():
            if sandbox_id in self._boxes:
                await self.close(sandbox_id)
                self.expired[reason] += 1
        return list(expired)

    async def close_all(self) -> None:
        """Closes every sandbox and stops the backend."""
        for box in list(self._boxes.values()):
            await self._remove(box)
        await self._to_end.wait()  # those whose callers went away
        if self._started:
            await self.backend.stop()
            self._started = False

    async def fork(self, sandbox_id: str, count: int) -> list[Sandbox]:
        """``count`` new sandboxes, each with a copy of the source's workspace. Slots the
        source's Create reserved are used first; the rest must fit now."""
        if count <= 0 or count > MAX_FORK:
            raise InvalidArgument(f"fork count must be in 1..{MAX_FORK}, got {count}")
        src = self.get(sandbox_id)
        with self._working(src):  # refused while its tests run
            self._take_fork_slots(src, count)
            ttl = max(1.0, src.expires - time.time())
            # Registered before the first await: each holds one of the slots just taken.
            boxes = [self._register(src.task, src.limits, ttl, src.lease_s) for _ in range(count)]
            tasks = [asyncio.ensure_future(self._fork_one(src, box)) for box in boxes]
            try:
                results = await asyncio.gather(*tasks, return_exceptions=True)
            except BaseException:  # cancelled: each copy stops and removes its sandbox
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                await self._remove_all(boxes)  # copies cancelled before they began
                raise
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            await self._remove_all(boxes)
            raise failed[0]
        return boxes

    def _take_fork_slots(self, src: Sandbox, count: int) -> None:
        """Takes the slots of ``count`` forks of ``src``: its reserve first, the rest if
        it fits now (RESOURCE_EXHAUSTED otherwise, with nothing taken)."""
        reserved = self._reserved.get(src.sandbox_id, 0)
        from_reserve = min(count, reserved)
        if count > from_reserve and not self.slots.try_acquire(count - from_reserve):
            kept = f" ({reserved} reserved by its Create)" if reserved else ""
            raise ResourceExhausted(f"forking {count}{kept} would exceed the live sandbox limit ({self.max_sandboxes}, {self.slots.held} held)")
        if reserved > from_reserve:
            self._reserved[src.sandbox_id] = reserved - from_reserve
        else:
            self._reserved.pop(src.sandbox_id, None)

    async def _fork_one(self, src: Sandbox, box: Sandbox) -> None:
        await self._materialize(box, {})
        try:
            with self._using(box):
                await self.backend.copy_workspace(src.sandbox_id, box.sandbox_id)
        except BaseException:
            await self._remove(box)
            raise

    # ------------------------------------------------------------ files

    async def _write(self, box: Sandbox, files: dict[str, bytes]) -> None:
        for rel, content in files.items():
            if len(content) > box.limits.max_file_bytes:
                raise InvalidArgument(f"file {rel!r} is {len(content)} bytes, over the {box.limits.max_file_bytes} limit")
            try:
                workspace_files.split_relative(rel)
            except workspace_files.PathError as exc:
                raise path_error(exc) from None
        try:
            await self.backend.write_files(box.sandbox_id, files)
        except workspace_files.PathError as exc:
            raise path_error(exc) from None
        except OSError as exc:
            raise write_error(box.sandbox_id, exc) from None

    async def write_files(self, sandbox_id: str, files: dict[str, bytes]) -> None:
        box = self.get(sandbox_id)
        with self._working(box):
            await self._write(box, files)

    async def read_files(self, sandbox_id: str, paths: list[str]) -> dict[str, bytes]:
        box = self.get(sandbox_id)
        box.refuse_while_testing()
        for rel in paths:
            try:
                workspace_files.split_relative(rel)
            except workspace_files.PathError as exc:
                raise path_error(exc) from None
        try:
            with self._working(box):
                return await self.backend.read_files(sandbox_id, paths, box.limits.max_output_bytes)
        except workspace_files.PathError as exc:
            raise path_error(exc) from None

    # ------------------------------------------------------------ exec

    async def exec(
        self,
        sandbox_id: str,
        argv: list[str],
        stdin: bytes = b"",
        env: dict[str, str] | None = None,
        cwd: str = "",
        timeout_s: float = 0.0,
    ) -> AsyncIterator[ExecItem]:
        """Runs ``argv``; yields ``("stdout"|"stderr", bytes)`` chunks, then an ExecResult."""
        box = self.get(sandbox_id)
        box.refuse_while_testing()
        full_env = sandbox_env(env)
        check_argv(argv, full_env)
        if cwd:
            try:
                workspace_files.split_relative(cwd)
            except workspace_files.PathError as exc:
                raise path_error(exc) from None
        if not (math.isfinite(timeout_s) and timeout_s >= 0):
            raise InvalidArgument(f"timeout_seconds must be a finite number >= 0, got {timeout_s}")
        async for item in self._exec(box, argv, stdin, full_env, cwd, box.limits.exec_wall(timeout_s), counted=True):
            yield item

    async def _exec(
        self, box: Sandbox, argv: list[str], stdin: bytes, env: dict[str, str], cwd: str, wall: float, counted: bool
    ) -> AsyncIterator[ExecItem]:
        """The backend's exec on ``box``. ``counted`` (every exec but RunTests' own): the
        exec is refused while RunTests runs, and counts as work RunTests waits for while
        the manager waits on the backend, from before the first await (its process may not
        have started yet) to each item: the backend yields one only once the command runs
        in the sandbox (output) or has ended (its result), so while that item is with the
        caller (who may be slow to take the next) the command is where RunTests' kill_all
        reaches it, and RunTests need not wait for the caller."""
        at_work = False
        if counted:
            box.begin_work(is_exec=True)
            at_work = True
        try:
            with self._using(box):
                if cwd:
                    # The same rule on every backend: never through a symlink the sandbox planted.
                    try:
                        await self.backend.check_folder(box.sandbox_id, cwd)
                    except workspace_files.PathError as exc:
                        raise InvalidArgument(f"cwd {cwd!r} is not a folder in the sandbox: {exc}") from None
                async for item in self.backend.exec(box.sandbox_id, argv, stdin, env, cwd, wall, box.limits):
                    if at_work:
                        box.end_work(is_exec=True)
                        at_work = False
                    yield item
                    if counted:
                        box.resume_work(is_exec=True)
                        at_work = True
        finally:
            if at_work:
                box.end_work(is_exec=True)

    async def _settle(self, box: Sandbox) -> None:
        """Waits until no other call works on ``box`` (RunTests has set ``box.testing``, so
        none can begin): file operations and a Fork's copies are waited for, and while an
        exec is still at work every process of the sandbox is killed, again and again, so
        that one whose process started after a kill ends too."""
        while box.work:
            if box.execs:
                await self.backend.kill_all(box.sandbox_id)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(box.settled.wait(), SETTLE_POLL_S)

    async def run_tests(self, sandbox_id: str) -> tuple[TestOutcome, ExecResult, bytes]:
        """Runs the task's hidden tests and scores the test command's standard output.

        The sandbox is the tests' alone while they run: Exec, WriteFiles, ReadFiles, Fork
        and RunTests on it are refused (FAILED_PRECONDITION), calls already at work on it
        are waited for and their commands killed (:meth:`_settle`), and every process the
        solution left running is killed, so nothing of it can touch what the tests read or
        write; built-in tasks run the trusted harness from memory with their tests on stdin
        (see harness.py and :func:`tests_invocation`). Close still closes it (see :meth:`close`)."""
        box = self.get(sandbox_id)
        if box.task is None:
            raise FailedPrecondition(f"sandbox {sandbox_id} was not created from a task")
        box.refuse_while_testing()
        box.testing = True
        try:
            # A caller that goes away does not stop the run halfway: from their write to
            # their removal the tests are on the sandbox's disk, and the sandbox is the
            # tests' alone until the run is over (bounded by the task's wall time).
            answer = await self._to_end.run(self._tests_alone(box, box.task))
        except Exception:
            if self._boxes.get(sandbox_id) is not box:
                raise NotFound(f"sandbox {sandbox_id} was closed while its tests ran") from None
            raise
        if self._boxes.get(sandbox_id) is not box:
            raise NotFound(f"sandbox {sandbox_id} was closed while its tests ran")
        return answer

    async def _tests_alone(self, box: Sandbox, task: Task) -> tuple[TestOutcome, ExecResult, bytes]:
        try:
            return await self._run_tests(box, task)
        finally:
            box.testing = False

    async def _run_tests(self, box: Sandbox, task: Task) -> tuple[TestOutcome, ExecResult, bytes]:
        sandbox_id = box.sandbox_id
        with self._using(box):
            await self._settle(box)
            await self.backend.kill_all(sandbox_id)
            argv, stdin, hidden = tests_invocation(task)
            await self.backend.remove(sandbox_id, TESTS_DIR)
            try:
                try:
                    if hidden:
                        await self._write(box, hidden)
                except ResourceExhausted as exc:
                    # The sandbox filled its own workspace: its tests cannot run, and it
                    # scores 0 (an error would drop its episode, and with it the failure,
                    # from its group).
                    return _no_room_for_tests(str(exc))
                stdout, stderr, result = await collect(self._harness(box, argv, stdin, task.limits.wall_seconds))
            finally:
                try:
                    await self.backend.kill_all(sandbox_id)
                finally:
                    await self.backend.remove(sandbox_id, TESTS_DIR)
        outcome = score_output(task.reward, stdout.decode(errors="replace"), result.exit_code)
        return outcome, result, stdout + stderr

    def _harness(self, box: Sandbox, argv: list[str], stdin: bytes, timeout_s: float) -> AsyncIterator[ExecItem]:
        """RunTests' own exec of the test command: checked as any exec's, never refused."""
        full_env = sandbox_env(None)
        check_argv(argv, full_env)
        return self._exec(box, argv, stdin, full_env, "", box.limits.exec_wall(timeout_s), counted=False)



def _no_room_for_tests(why: str) -> tuple[TestOutcome, ExecResult, bytes]:
    """RunTests' answer when the task's tests could not be written into a full workspace."""
    detail = f"no room in the workspace for the task's tests: {why}"
    return TestOutcome(0.0, [("tests", False, detail)]), ExecResult(1, 0, False, False, False, 0.0), detail.encode()

# ------------------------------------------------------------------ shared exec plumbing


async def collect(items: AsyncIterator[ExecItem]) -> tuple[bytes, bytes, ExecResult]:
    """Gathers an exec stream into (stdout, stderr, result)."""
    out, err = bytearray(), bytearray()
    result: ExecResult | None = None
    async for item in items:
        if isinstance(item, ExecResult):
            result = item
        elif item[0] == "stdout":
            out += item[1]
        else:
            err += item[1]
    if result is None:
        raise RuntimeError("exec stream ended without a result")
    return bytes(out), bytes(err), result


@dataclasses.dataclass
class Drained:
    """How a :func:`drain` ended."""

    timed_out: bool = False


async def drain(queue: asyncio.Queue, ends: int, deadline: float, outcome: Drained) -> AsyncIterator[tuple[str, bytes]]:  # type: ignore[type-arg]
    """Output chunks from ``queue`` until ``ends`` end markers (None) have arrived, or until
    ``deadline`` (time.monotonic) passes, which sets ``outcome.timed_out``."""
    while ends:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            outcome.timed_out = True
            return
        try:
            item = await asyncio.wait_for(queue.get(), timeout=remaining)
        except TimeoutError:
            outcome.timed_out = True
            return
        if item is None:
            ends -= 1
        else:
            yield item


@dataclasses.dataclass(frozen=True)
class PumpDone:
    timed_out: bool
    stdout_truncated: bool
    stderr_truncated: bool


async def pump_process(
    proc: Any, stdin: bytes, wall_s: float, max_output: int, kill: Callable[[], None]
) -> AsyncIterator[tuple[str, bytes] | PumpDone]:
    """Streams a started process's output within ``wall_s`` and ``max_output`` bytes per stream.

    Yields output chunks, then one PumpDone. ``kill`` ends the process and all it started.
    """
    queue: asyncio.Queue[tuple[str, bytes] | None] = asyncio.Queue()
    budget = {"stdout": max_output, "stderr": max_output}
    truncated = {"stdout": False, "stderr": False}

    async def pump(name: str, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(64 * 1024):
            keep = chunk[: max(0, budget[name])]
            budget[name] -= len(chunk)
            if len(keep) < len(chunk):
                truncated[name] = True
            if keep:
                await queue.put((name, keep))
        await queue.put(None)

    async def feed() -> None:
        assert proc.stdin is not None
        try:
            if stdin:
                proc.stdin.write(stdin)
                await proc.stdin.drain()
            proc.stdin.close()
        except (BrokenPipeError, ConnectionResetError):
            pass

    assert proc.stdout is not None and proc.stderr is not None
    start = time.monotonic()
    tasks = [asyncio.create_task(pump("stdout", proc.stdout)), asyncio.create_task(pump("stderr", proc.stderr)), asyncio.create_task(feed())]
    timed_out = False
    deadline = start + wall_s
    try:
        drained = Drained()
        async for item in drain(queue, 2, deadline, drained):
            yield item
        timed_out = drained.timed_out
        if timed_out:
            kill()
        try:
            await asyncio.wait_for(proc.wait(), timeout=max(0.1, deadline - time.monotonic()) if not timed_out else 5)
        except TimeoutError:
            timed_out = True
            kill()
            await proc.wait()
    finally:
        # Whatever the outcome (also a cancelled client), nothing of this exec survives it.
        kill()
        for t in tasks:
            t.cancel()
    yield PumpDone(timed_out, truncated["stdout"], truncated["stderr"])
