"""The process backend: Linux namespaces, a private root filesystem, cgroups and seccomp;
no daemon.

Every command runs through a chain of exec'd tools (no Python between fork and exec in
this multi-threaded server), all of them started with a fixed environment:

``setpriv --pdeathsig KILL`` (dies with the service) → ``sh`` (joins the sandbox's limit
cgroups and the exec's own cgroup with a builtin ``echo``) → ``nsenter --mount=<helper
ns>`` (where the sandbox roots are mounted) → ``unshare --pid --mount --net --ipc --uts
--root=<sandbox root> --wd=/workspace`` (fresh namespaces, no fork; the network one has only
a downed loopback) → ``/.meridian/sandbox-exec`` (launcher/: it forks; the child, process 1
of the new pid namespace, mounts its /proc and sets the host name,
``kernel.shm_rmid_forced`` (a System V segment goes with its last holder), rlimits
(:func:`~services.envsandbox.sandbox.exec_rlimits`), every
capability dropped, the sandbox's own uid, no_new_privs, the seccomp filter of
seccomp_policy.py, and the caller's environment, in that order, then execs the command;
the parent, outside the namespace, waits for it and ends as it ended, so the chain's status
is the command's, a death by SIGKILL included).

A command killed by SIGKILL while the sandbox's memory cgroup counted an OOM kill
(``oom_kill``, read before and after) is reported as OOM-killed.

Each live sandbox has a uid of its own from a pool, so no per-uid kernel state (keyrings,
RLIMIT_NPROC, signal permissions) is shared between sandboxes. Each exec has a cgroup of
its own: when the exec returns, times out or its caller goes away, ``cgroup.kill`` takes
down everything it started, including what left its session or process group, and the
exec returns only once the cgroup is empty. The sandbox root (see mount_helper.py) lives
in the mount helper's private namespace, and the service reaches its workspace through
``/proc/<helper>/root``, one ``O_NOFOLLOW`` component at a time.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TypeVar

from meridian.errors import FailedPrecondition, NotFound, ResourceExhausted, Unavailable
from services.envsandbox import launcher, seccomp_policy, workspace_files
from services.envsandbox.cgroups import CgroupLimits, Cgroups
from services.envsandbox.config import UID_POOL
from services.envsandbox.sandbox import (
    COPY_WALL_S, SANDBOX_UID, SHM_BYTES, Backend, ExecItem, ExecResult, Limits, PumpDone, copy_error, exec_rlimits, pump_process, tmpfs_charge,
    tmpfs_inodes,
)
from services.envsandbox.spawn import SpawnedProcess, spawn

log = logging.getLogger(__name__)

TOOLS = ("setpriv", "unshare", "nsenter", "sh")
JOIN_CGROUPS = 'n=$1; shift; while [ "$n" -gt 0 ]; do echo 0 > "$1" || exit 125; shift; n=$((n-1)); done; exec "$@"'
#: The environment of the root half of the chain: nothing of the caller's.
ROOT_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
LAUNCHER = "/.meridian/sandbox-exec"
#: Fork's copies run on threads of their own, this many at once: a GRPO group's copies
#: then never fill the default executor, which file operations, exec kills and cgroup
#: removal need.
COPY_THREADS = 4
SECCOMP_FD = 3

T = TypeVar("T")


def memory_limit(limits: Limits) -> int:
    """A sandbox's memory cgroup limit: ``memory_bytes`` for its processes plus the room of
    its tmpfs mounts (the root, holding the workspace and /tmp, and /dev/shm). Their pages
    and inodes are charged to the cgroup as the sandbox fills them, so without that room a
    full disk would leave its commands (the tests included) no memory at all."""
    return limits.memory_bytes + tmpfs_charge(limits.disk_bytes) + tmpfs_charge(SHM_BYTES)


class ProcessBackend(Backend):
    name = "process"

    def __init__(self, root: Path, first_uid: int = SANDBOX_UID, uid_pool: int = UID_POOL) -> None:
        self.root = Path(root)
        self.first_uid = first_uid
        self.uid_pool = uid_pool
        self._free_uids = list(range(first_uid + uid_pool - 1, first_uid - 1, -1))
        self._uid: dict[str, int] = {}
        self.mount_dir = self.root / "mnt"
        self._seccomp_path = self.root / "seccomp.bpf"
        self._launcher: Path | None = None
        self._tools: dict[str, str] = {}
        self._helper: SpawnedProcess | None = None
        self._helper_lock = asyncio.Lock()
        self._helper_seq = 0  # the number of the last request to the mount helper
        self._cgroups: Cgroups | None = None
        self._procs: dict[str, list[str]] = {}
        self._running: dict[str, set[SpawnedProcess]] = {}
        self._copies: concurrent.futures.ThreadPoolExecutor | None = None

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if os.geteuid() != 0:
            raise FailedPrecondition("the process backend needs root (namespaces, mounts, cgroups)")
        for tool in TOOLS:
            path = shutil.which(tool)
            if path is None:
                raise FailedPrecondition(f"the process backend needs {tool!r} (util-linux) on PATH")
            self._tools[tool] = path
        self.root.mkdir(parents=True, exist_ok=True)
        self._cleanup_root()
        self.mount_dir.mkdir(mode=0o711)
        self._launcher = await asyncio.to_thread(launcher.build, self.root / "bin")
        names = [*seccomp_policy.DENIED, *seccomp_policy.NO_SYS, *seccomp_policy.ARGUMENT_RULES]
        numbers, arch = await asyncio.to_thread(launcher.syscall_numbers, self._launcher, names)
        # Every ABI has these: a number the launcher does not know would drop its rule silently.
        unknown = [name for name in seccomp_policy.ARGUMENT_RULES if numbers.get(name, -1) < 0]
        if unknown:
            raise FailedPrecondition(f"the sandbox launcher does not know the system call numbers of {unknown}: their seccomp rules would be missing")
        fd = os.open(self._seccomp_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(seccomp_policy.bpf_program(numbers, arch))
        self._copies = concurrent.futures.ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="workspace-copy")
        self._cgroups = _make_cgroups()
        stale = self._cgroups.cleanup_stale()
        if stale:
            log.info("removed the cgroups of %d stale service instances", len(stale))
        await self._start_helper()

    def _cleanup_root(self) -> None:
        """Removes what a previous run under this root left (its mounts died with its helper)."""
        if self.mount_dir.exists():
            if os.path.ismount(self.mount_dir):
                os.system(f"umount -l '{self.mount_dir}' >/dev/null 2>&1")  # a host-side mount is never made; belt and braces
            shutil.rmtree(self.mount_dir, ignore_errors=True)

    async def _start_helper(self) -> None:
        self._helper = await spawn(
            [
                self._tools["setpriv"], "--pdeathsig", "KILL", "--",
                self._tools["unshare"], "--mount", "--propagation", "private", "--",
                sys.executable, "-I", "-S", str(Path(__file__).parent / "mount_helper.py"), str(self.mount_dir),
                str(self.first_uid), str(self.uid_pool), str(self._launcher),
            ],
            env=ROOT_ENV,
            stderr=False,
        )
        ready = await self._read_reply()
        if not ready.get("ready"):
            raise FailedPrecondition(f"the sandbox mount helper did not start: {ready.get('error', ready)}")

    async def _read_reply(self) -> dict:
        assert self._helper is not None and self._helper.stdout is not None
        line = await self._helper.stdout.readline()
        if not line:
            raise Unavailable("the sandbox mount helper exited")
        return json.loads(line)

    async def _helper_call(self, op: str, **args: object) -> dict:
        """One request to the mount helper and its reply. The helper answers in order, each
        reply with its request's number: a caller cancelled before it read its reply (its
        client went away) leaves that reply behind, and the next caller drops it instead of
        taking it for its own (a ``list`` was handed a ``create``'s reply). The helper's
        work for the cancelled request is done before any later request's, so the caller's
        cleanup, which comes later, finds it in place."""
        async with self._helper_lock:
            if self._helper is None or self._helper.returncode is not None:
                raise Unavailable("the sandbox mount helper is not running")
            assert self._helper.stdin is not None
            self._helper_seq += 1
            seq = self._helper_seq
            self._helper.stdin.write(json.dumps({"op": op, "seq": seq, **args}).encode() + b"\n")
            await self._helper.stdin.drain()
            while (reply := await self._read_reply()).get("seq") != seq:
                log.debug("mount helper: dropped the reply to request %s, whose caller went away", reply.get("seq"))
        if "error" in reply:
            raise OSError(f"mount helper {op}: {reply['error']}")
        return reply

    async def stop(self) -> None:
        for sandbox_id in list(self._procs):
            await self.destroy(sandbox_id)
        if self._helper is not None and self._helper.returncode is None:
            assert self._helper.stdin is not None
            self._helper.stdin.close()
            try:
                await asyncio.wait_for(self._helper.wait(), 5)
            except TimeoutError:
                self._helper.kill()
                await self._helper.wait()
        self._helper = None
        if self._copies is not None:
            self._copies.shutdown(wait=False, cancel_futures=True)
            self._copies = None
        if self._cgroups is not None:
            self._cgroups.remove_instance()
        shutil.rmtree(self.mount_dir, ignore_errors=True)
        shutil.rmtree(self.root / "bin", ignore_errors=True)
        self._seccomp_path.unlink(missing_ok=True)

    async def create(self, sandbox_id: str, limits: Limits) -> None:
        assert self._cgroups is not None
        if not self._free_uids:
            raise ResourceExhausted(f"all {self.uid_pool} sandbox uids are in use")
        inodes = tmpfs_inodes(limits.disk_bytes)
        self._uid[sandbox_id] = self._free_uids.pop()
        self._procs[sandbox_id] = []
        self._running[sandbox_id] = set()
        await self._helper_call(
            "create", sandbox_id=sandbox_id, disk_bytes=limits.disk_bytes, inodes=inodes, uid=self._uid[sandbox_id],
            shm_bytes=SHM_BYTES, shm_inodes=tmpfs_inodes(SHM_BYTES),
        )
        procs = self._cgroups.create(sandbox_id, CgroupLimits(memory_limit(limits), limits.max_pids, limits.cpus))
        self._procs[sandbox_id] = procs

    async def destroy(self, sandbox_id: str) -> None:
        for proc in list(self._running.pop(sandbox_id, ())):
            _kill(proc)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(proc.wait(), 5)
        self._procs.pop(sandbox_id, None)
        if self._cgroups is not None:
            await asyncio.to_thread(self._cgroups.remove, sandbox_id)
        if self._helper is not None and self._helper.returncode is None:
            await self._helper_call("destroy", sandbox_id=sandbox_id)
        # Only now, with nothing of it left, may another sandbox have its uid.
        uid = self._uid.pop(sandbox_id, None)
        if uid is not None:
            self._free_uids.append(uid)

    async def kill_all(self, sandbox_id: str) -> None:
        self._sandbox_root(sandbox_id)
        assert self._cgroups is not None
        try:
            await asyncio.to_thread(self._cgroups.kill_sandbox, sandbox_id)
        except RuntimeError as exc:
            raise Unavailable(f"sandbox {sandbox_id}: {exc}") from None

    async def leftovers(self) -> list[str]:
        found = []
        if self._helper is not None and self._helper.returncode is None:
            found += [f"mount:{s}" for s in (await self._helper_call("list"))["sandboxes"] if s not in self._procs]
        if self._cgroups is not None:
            found += [f"cgroup:{s}" for s in self._cgroups.live_sandboxes() if s not in self._procs]
        return found + [f"uid:{s}" for s in self._uid if s not in self._procs]

    # ------------------------------------------------------------ files

    def _sandbox_root(self, sandbox_id: str) -> str:
        if sandbox_id not in self._procs or self._helper is None:
            raise NotFound(f"no live sandbox {sandbox_id!r}")
        return f"/proc/{self._helper.pid}/root{self.mount_dir}/{sandbox_id}"

    async def _in_workspace(self, sandbox_id: str, op: Callable[[int], T]) -> T:
        """``op(workspace descriptor)`` in a worker thread (a deep tree or a big file must not
        stall the event loop). The descriptor is opened and closed in that thread: a caller
        that goes away cancels the await, not the walk, and must not close it under the walk."""
        root = self._sandbox_root(sandbox_id)

        def run() -> T:
            fd = _open_workspace(root)
            try:
                return op(fd)
            finally:
                os.close(fd)

        return await asyncio.to_thread(run)

    async def write_files(self, sandbox_id: str, files: dict[str, bytes], mode: int = 0o644) -> None:
        self._sandbox_root(sandbox_id)
        owner = (self._uid[sandbox_id], self._uid[sandbox_id])

        def write(fd: int) -> None:
            for rel, content in files.items():
                workspace_files.write_file(fd, rel, content, mode, owner=owner)

        await self._in_workspace(sandbox_id, write)

    async def read_files(self, sandbox_id: str, paths: list[str], max_bytes: int) -> dict[str, bytes]:
        total = workspace_files.MAX_READ_TOTAL_BYTES
        return await self._in_workspace(sandbox_id, lambda fd: workspace_files.read_files(fd, paths, max_bytes, total))

    async def remove(self, sandbox_id: str, path: str) -> None:
        await self._in_workspace(sandbox_id, lambda fd: workspace_files.remove_tree(fd, path))

    async def check_folder(self, sandbox_id: str, path: str) -> None:
        await self._in_workspace(sandbox_id, lambda fd: workspace_files.check_folder(fd, path))

    async def copy_workspace(self, src_id: str, dst_id: str) -> None:
        """Copies on a copy thread within COPY_WALL_S. A cancelled copy (its Fork's caller
        went away) is stopped and waited for, so nothing writes into the copy once the
        manager removes it."""
        src_root, dst_root = self._sandbox_root(src_id), self._sandbox_root(dst_id)
        owner = (self._uid[dst_id], self._uid[dst_id])
        assert self._copies is not None
        deadline = time.monotonic() + COPY_WALL_S
        cancelled = threading.Event()

        def check() -> None:
            if cancelled.is_set():
                raise _CopyCancelled
            if time.monotonic() > deadline:
                raise Unavailable(f"copying the workspace of sandbox {src_id} took more than {COPY_WALL_S:.0f} s")

        def copy() -> None:
            check()  # a copy that waited for a thread past its time (or its caller) never starts
            src = _open_workspace(src_root)
            try:
                dst = _open_workspace(dst_root)
                try:
                    workspace_files.copy_tree(src, dst, owner=owner, check=check)
                finally:
                    os.close(dst)
            finally:
                os.close(src)

        done = asyncio.get_running_loop().run_in_executor(self._copies, copy)
        try:
            await asyncio.shield(done)
        except asyncio.CancelledError:
            cancelled.set()
            with contextlib.suppress(BaseException):
                await done  # the copy stops at its next entry: a piece of a file at most
            raise
        except (workspace_files.PathError, OSError) as exc:
            raise copy_error(src_id, exc) from None

    # ------------------------------------------------------------ exec

    def command(self, sandbox_id: str, argv: list[str], env: dict[str, str], cwd: str, limits: Limits, group: Path | None) -> list[str]:
        """The full exec chain for ``argv`` in the sandbox (see the module docstring)."""
        assert self._helper is not None
        joins = [*self._procs[sandbox_id], *([str(group / "cgroup.procs")] if group is not None else [])]
        uid = self._uid[sandbox_id]
        t = self._tools
        workdir = "/workspace/" + "/".join(workspace_files.split_relative(cwd)) if cwd else "/workspace"
        return [
            t["setpriv"], "--pdeathsig", "KILL", "--",
            t["sh"], "-c", JOIN_CGROUPS, "sh", str(len(joins)), *joins,
            t["nsenter"], f"--mount=/proc/{self._helper.pid}/ns/mnt", "--",
            t["unshare"], "--pid", "--mount", "--net", "--ipc", "--uts",
            f"--root={self.mount_dir}/{sandbox_id}", f"--wd={workdir}", "--",
            LAUNCHER, "--uid", str(uid), "--gid", str(uid), "--hostname", "sandbox",
            *[arg for name, value in exec_rlimits(limits, memory_limit(limits)).items() for arg in (f"--{name}", str(value))],
            *[arg for key, value in env.items() for arg in ("--env", f"{key}={value}")],
            "--", *argv,
        ]

    async def exec(
        self, sandbox_id: str, argv: list[str], stdin: bytes, env: dict[str, str], cwd: str, wall_s: float, limits: Limits
    ) -> AsyncIterator[ExecItem]:
        self._sandbox_root(sandbox_id)
        assert self._cgroups is not None
        start = time.monotonic()
        group = self._cgroups.exec_group(sandbox_id)
        oom_before = self._cgroups.oom_kills(sandbox_id)
        policy = os.open(self._seccomp_path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            proc = await spawn(self.command(sandbox_id, argv, env, cwd, limits, group), env=ROOT_ENV, pass_fds={SECCOMP_FD: policy})
        except BaseException:
            self._cgroups.kill_exec(group)
            raise
        finally:
            os.close(policy)
        running = self._running.setdefault(sandbox_id, set())
        running.add(proc)
        done: PumpDone | None = None
        try:
            async for item in pump_process(proc, stdin, wall_s, limits.max_output_bytes, lambda: _kill(proc)):
                if isinstance(item, PumpDone):
                    done = item
                else:
                    yield item
        finally:
            running.discard(proc)
            # Whatever the exec started, wherever it went, ends with it (also when the
            # caller went away): the exec's cgroup is killed and emptied.
            try:
                await asyncio.shield(asyncio.to_thread(self._cgroups.kill_exec, group))
            except RuntimeError as exc:
                raise Unavailable(f"sandbox {sandbox_id}: {exc}") from None
        assert done is not None
        code = proc.returncode if proc.returncode is not None else -signal.SIGKILL
        # Killed by SIGKILL while the sandbox's OOM counter rose: the memory limit's OOM
        # killer (a command that exits by itself, maybe after a child of its was killed
        # for memory, is never reported as OOM-killed).
        oom = code == -signal.SIGKILL and not done.timed_out and self._cgroups.oom_kills(sandbox_id) > oom_before
        if code == 125 and not done.timed_out:
            log.warning("sandbox %s: the exec chain failed before the command started", sandbox_id)
        yield ExecResult(
            exit_code=code if code >= 0 else -1,
            signal=-code if code < 0 else 0,
            timed_out=done.timed_out,
            stdout_truncated=done.stdout_truncated,
            stderr_truncated=done.stderr_truncated,
            wall_seconds=time.monotonic() - start,
            oom_killed=oom,
        )


class _CopyCancelled(Exception):
    """Stops a copy whose Fork was cancelled."""


def _open_workspace(root: str) -> int:
    """A descriptor of the ``workspace`` folder of the sandbox root ``root`` (never a symlink)."""
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return os.open("workspace", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=root_fd)
    finally:
        os.close(root_fd)


def _make_cgroups() -> Cgroups:
    """This instance's cgroups, or a FailedPrecondition that says why there can be none:
    without them a sandbox has no memory, process or CPU limit, so the service must not
    start (in a container, the cgroup mounts are read-only unless remounted, see
    deploy/envsandbox-entrypoint.sh)."""
    try:
        return Cgroups()
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename else ""
        hint = (
            "; the cgroup file system is mounted read-only: in a container, remount it read-write with CAP_SYS_ADMIN "
            "(the envsandbox image's entry point does)"
            if exc.errno == errno.EROFS
            else ""
        )
        raise FailedPrecondition(f"the process backend cannot create its cgroups{where}: {exc.strerror or exc}{hint}") from exc


def _kill(proc: SpawnedProcess) -> None:
    """SIGKILL to the chain's process group: the launcher and its child, the namespace's
    process 1, whose death takes the namespace down."""
    if proc.returncode is None:
        for kill in (lambda: os.killpg(proc.pid, signal.SIGKILL), lambda: os.kill(proc.pid, signal.SIGKILL)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                kill()
