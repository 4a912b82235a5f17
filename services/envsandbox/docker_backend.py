"""The Docker backend: one container per sandbox through the Docker SDK.

Each container: no network, read-only root, tmpfs workspace and /tmp (the disk cap) and
/dev/shm, memory (no swap; the sandbox's memory plus the tmpfs mounts' room, which their
pages take from the container's cgroup: see memory_limit), pids and CPU limits, every
capability dropped, no-new-privileges, the seccomp policy of seccomp_policy.py (as a
Docker profile), an unprivileged uid of its own from a pool (no per-uid kernel state
shared between sandboxes) for every command, another one (KEEPER_UID, the same for every
container on the host) for the container's init and keep-alive, which sandbox code can
then neither trace, write nor signal, and a label naming this service instance. A
restarted service removes every container labelled by an instance that no longer runs.
When an exec ends (and before RunTests) every process in the container but its init and
keep-alive is killed, and the sweep checks that none is left. Every command starts through
EXEC_LIMITS_MAIN, which gives it (and only it and its descendants) the process backend's
per-process limits (CPU time, file size, open files, address space).

The workspace is a tmpfs, which ``docker cp`` cannot reach, so file operations run
``workspace_files`` inside the container (python3 is in the image) over an exec's stdin,
as the sandbox's user with no capability: they hold the workspace folder by an ``O_PATH``
descriptor (no permission needed on it), and where the sandbox took away an owner
permission bit an operation needs, workspace_files gives it back for that step and
restores the mode after: they do what the process backend's do as root, whatever the
modes (see workspace_files' docstring).
Fork copies a workspace the same way the process backend does, as a stream:
``workspace_files.send_tree`` in the source container, ``receive_tree`` in the new one,
and the host relaying one piece at a time between them (``docker_stream``).
The SDK is synchronous: blocking calls run in worker threads.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import signal
import socket
import struct
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import NamedTuple

from meridian.errors import FailedPrecondition, NotFound, ResourceExhausted, Unavailable
from services.envsandbox import docker_stream, seccomp_policy, workspace_files
from services.envsandbox.cgroups import instance_name, oom_kill_count, process_start_time
from services.envsandbox.config import UID_POOL
from services.envsandbox.sandbox import (
    COPY_WALL_S, SANDBOX_UID, SHM_BYTES, Backend, Drained, ExecItem, ExecResult, Limits, collect, copy_error, drain, exec_rlimits, tmpfs_charge,
    tmpfs_inodes,
)

#: The uid of every container's init and keep-alive, which kill_all spares: never one of a
#: sandbox's (SANDBOX_UID .. SANDBOX_UID + UID_POOL - 1). See DockerBackend.create.
KEEPER_UID = SANDBOX_UID - 1

log = logging.getLogger(__name__)

LABEL = "meridian.envsandbox.instance"
SANDBOX_LABEL = "meridian.envsandbox.sandbox"
FILES_SOURCE = (Path(__file__).parent / "workspace_files.py").read_text()
#: A file operation's helper is killed past this many seconds...
FILES_OP_S = 30.0
#: ...and stops itself this long before (its request says when): the owner bits it gave
#: entries for a step are taken back on the way out, where a kill would leave them.
FILES_UNWIND_S = 5.0
#: The most a file operation's helper may print: a ReadFiles answer's contents in base64
#: (4/3 of at most MAX_READ_TOTAL_BYTES) and its JSON.
FILES_REPLY_BYTES = 2 * workspace_files.MAX_READ_TOTAL_BYTES
FILES_MAIN = r'''
import base64 as _b64, json as _json, signal as _signal, sys as _sys


class _Overdue(BaseException):
    """The helper's time is up: raised wherever it is, so each step gives back the modes it changed."""


def _overdue(_signum, _frame):
    raise _Overdue()


_req = _json.loads(_sys.stdin.buffer.read())
_signal.signal(_signal.SIGALRM, _overdue)
_signal.setitimer(_signal.ITIMER_REAL, _req["deadline_s"])
try:
    _root = os.open("/workspace", os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if _req["op"] == "write":
            for _f in _req["files"]:
                write_file(_root, _f["path"], _b64.b64decode(_f["content"]), _f.get("mode", 0o644))
            _out = {}
        elif _req["op"] == "read":
            _read = read_files(_root, _req["paths"], _req["max_bytes"], _req["total"])
            _out = {"files": {p: _b64.b64encode(c).decode() for p, c in _read.items()}}
        elif _req["op"] == "remove":
            remove_tree(_root, _req["path"])
            _out = {}
        elif _req["op"] == "folder":
            check_folder(_root, _req["path"])
            _out = {}
        else:
            _out = {"error": ["invalid", "unknown op"]}
    except (PathError, OSError) as _exc:
        _out = {"error": describe_error(_exc)}
    finally:
        _signal.setitimer(_signal.ITIMER_REAL, 0)
except _Overdue:
    _out = {"overdue": True}
_sys.stdout.write(_json.dumps(_out))
'''
#: Fork's two halves (argv[1]): "send" streams the workspace to stdout, stopping when stdin
#: closes; "receive" builds the stream from stdin and answers like FILES_MAIN.
COPY_MAIN = r'''
import json as _json, sys as _sys
_root = os.open("/workspace", os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
if _sys.argv[1] == "send":
    send_tree(_root, 1, 0)
else:
    try:
        receive_tree(_root, 0)
        _out = {}
    except (PathError, OSError) as _exc:
        _out = {"error": describe_error(_exc)}
    _sys.stdout.write(_json.dumps(_out))
'''

#: Every command an Exec or RunTests runs starts as this, in the container as the sandbox's
#: user (argv[1]: its rlimits as ``name=value,...``, sandbox.exec_rlimits; then the
#: command): it sets them, soft and hard, and core dumps off, as the process backend's
#: launcher does, and execs the command in its own process, so the limits are the
#: command's and its descendants' alone. Docker has no per-exec limits, and container-wide
#: ones (HostConfig.Ulimits, which every exec inherits) would also bind the container's
#: init, which reaps every orphan (a sandbox making orphans in a loop spent 70 ms of its
#: CPU per 3000) and whose death ends the container, and the file helpers, whose CPU and
#: file sizes grow with the files they move (a Fork copies up to disk_bytes). The command
#: gets what the exec got and nothing of Python's: the environment as it came
#: (/proc/self/environ: Python itself adds LC_CTYPE where LANG is C), SIGPIPE and SIGXFSZ
#: back to their defaults (Python ignores them, and an ignored signal stays ignored across
#: exec). The interpreter's start (about 10 ms of CPU) counts towards the CPU limit. A
#: command that cannot be run ends 127 (not found) or 126 with the process backend's
#: launcher's message. Another process of the same sandbox could write this one's memory
#: before the limits are set, and gain little by it: every new process starts a CPU count
#: of its own anyway, and what the others bound per process the container bounds as a
#: whole (memory, disk, pids).
EXEC_LIMITS_MAIN = r'''
import errno, os, resource, signal, sys
try:
    _limits = dict(_p.split("=") for _p in sys.argv[1].split(","))
    _limits["core"] = "0"
    for _name, _value in _limits.items():
        _which = getattr(resource, "RLIMIT_" + _name.upper())
        _value, _hard = int(_value), resource.getrlimit(_which)[1]
        if _hard != resource.RLIM_INFINITY:
            _value = min(_value, _hard)
        resource.setrlimit(_which, (_value, _value))
    for _sig in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(_sig, signal.SIG_DFL)
    with open("/proc/self/environ", "rb") as _fh:
        _env = dict(_e.partition(b"=")[::2] for _e in _fh.read().split(b"\0") if _e)
except BaseException as _exc:
    os.write(2, f"sandbox-exec: {_exc!r}\n".encode())
    os._exit(125)
try:
    os.execvpe(sys.argv[2], sys.argv[2:], _env)
except OSError as _exc:
    os.write(2, f"sandbox-exec: {sys.argv[2]}: {os.strerror(_exc.errno or 0)}\n".encode(errors="surrogateescape"))
    os._exit(127 if _exc.errno == errno.ENOENT else 126)
'''


def tmp_bytes(limits: Limits) -> int:
    """The size of a sandbox container's /tmp, a tmpfs beside its workspace's."""
    return max(16 << 20, limits.disk_bytes // 4)


def memory_limit(limits: Limits) -> int:
    """A sandbox container's memory limit (and memory + swap limit: no swap): ``memory_bytes``
    for its processes plus the room of its three tmpfs mounts (workspace, /tmp, /dev/shm).
    Their pages and inodes are charged to the container's cgroup as the sandbox writes
    them, so without that room a full disk (or a full /dev/shm) left its commands no
    memory: they, and the file helper that serves ReadFiles, WriteFiles and RunTests from
    inside the container, were OOM-killed."""
    return limits.memory_bytes + tmpfs_charge(limits.disk_bytes) + tmpfs_charge(tmp_bytes(limits)) + tmpfs_charge(SHM_BYTES)


def _instance_alive(name: str) -> bool:
    pid, _, start = name.partition("-")
    return pid.isdigit() and process_start_time(int(pid)) == start


#: How long an exec waits for its reader thread after waking it (it ends at once).
READER_JOIN_S = 10.0


class _Started(NamedTuple):
    """An exec :meth:`DockerBackend._start_exec` started."""

    exec_id: str
    sock: socket.socket  # its raw, multiplexed stream
    # The start of that stream already read off the socket with the response's head
    # (docker_stream.read_past_head): it comes before anything read from the socket.
    early: bytes


class DockerBackend(Backend):
    name = "docker"

    def __init__(self, root: Path, base_url: str = "", image: str = "") -> None:
        self.root = Path(root)
        self.base_url = base_url
        self.image = image
        self.instance = instance_name()
        self._client = None
        self._containers: dict[str, str] = {}
        self._keep: dict[str, set[int]] = {}
        self._active: dict[str, int] = {}
        self._free_uids = list(range(SANDBOX_UID + UID_POOL - 1, SANDBOX_UID - 1, -1))
        self._uid: dict[str, int] = {}
        self._seccomp = seccomp_policy.docker_profile()
        #: The image's python3, found once in a fresh container (see _find_python).
        self._python = ""

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        try:
            import docker
        except ImportError as exc:
            raise FailedPrecondition("the docker backend needs the Docker SDK (pip package docker)") from exc
        try:
            self._client = await asyncio.to_thread(
                lambda: docker.DockerClient(base_url=self.base_url, timeout=60) if self.base_url else docker.from_env(timeout=60)
            )
            await asyncio.to_thread(self._client.ping)
        except Exception as exc:
            raise Unavailable(f"cannot reach the Docker daemon at {self.base_url or 'the default address'}: {exc}") from exc
        removed = await asyncio.to_thread(self._remove_stale)
        if removed:
            log.info("removed %d containers of stale service instances", removed)
        if not self.image:
            from services.envsandbox.docker_image import ensure_image

            self.image = await asyncio.to_thread(ensure_image, self._client)

    def _remove_stale(self) -> int:
        removed = 0
        for container in self._client.containers.list(all=True, filters={"label": LABEL}):
            owner = container.labels.get(LABEL, "")
            if owner != self.instance and not _instance_alive(owner):
                with contextlib.suppress(Exception):
                    container.remove(force=True, v=True)
                    removed += 1
        return removed

    async def stop(self) -> None:
        for sandbox_id in list(self._containers):
            await self.destroy(sandbox_id)
        if self._client is not None:
            await asyncio.to_thread(self._client.close)
            self._client = None

    async def create(self, sandbox_id: str, limits: Limits) -> None:
        tmp_size, memory = tmp_bytes(limits), memory_limit(limits)
        if not self._free_uids:
            raise ResourceExhausted(f"all {UID_POOL} sandbox uids are in use")
        uid = self._uid[sandbox_id] = self._free_uids.pop()

        def run() -> str:
            container = self._client.containers.run(
                self.image,
                ["/bin/busybox", "sleep", "2147483647"],
                detach=True,
                name=f"meridian-{sandbox_id}",
                hostname="sandbox",
                network_mode="none",
                read_only=True,
                tmpfs={
                    # exec: Docker mounts a tmpfs noexec unless asked, and a program an agent
                    # built there (a compiler's output, a script) ended 126 where the process
                    # backend ran it. Still nosuid and nodev, Docker's other defaults.
                    "/workspace": f"exec,size={limits.disk_bytes},nr_inodes={tmpfs_inodes(limits.disk_bytes)},mode=0755,uid={uid},gid={uid}",
                    "/tmp": f"exec,size={tmp_size},nr_inodes={tmpfs_inodes(tmp_size)},mode=1777",
                    # Instead of Docker's own /dev/shm (64 MiB, no inode cap, outside the
                    # memory limit's room): filled with bytes and empty files it took the
                    # whole limit, and every later command and file operation was killed.
                    "/dev/shm": f"size={SHM_BYTES},nr_inodes={tmpfs_inodes(SHM_BYTES)},mode=1777",
                },
                # The container keeps one IPC namespace for all its execs: without this a
                # System V segment outlives the command that made it (and kill_all), its
                # pages still charged to the container, so one exec could take the memory
                # of every later one. With it a segment goes when no process holds it.
                sysctls={"kernel.shm_rmid_forced": "1"},
                mem_limit=memory,
                memswap_limit=memory,
                pids_limit=limits.max_pids,
                nano_cpus=int(limits.cpus * 1e9),
                cap_drop=["ALL"],
                security_opt=["no-new-privileges", f"seccomp={self._seccomp}"],
                # Not the sandbox's uid: the init and the keep-alive outlive kill_all, and
                # under the sandbox's uid its commands could open their /proc/<pid>/mem
                # read-write (nothing but a host-wide Yama setting forbids it), stop them,
                # read their environ and set their limits, priority and affinity, so code
                # planted in them could run beside RunTests' harness. A uid of their own
                # puts them out of reach of every sandbox uid. Not root in the container:
                # even with no capability, uid 0 is the host's root wherever it meets host
                # objects, and they need no privilege at all. Making them non-dumpable would
                # still leave them open to signals. Every exec names the sandbox's uid itself
                # (_start_exec), so nothing else runs as this one.
                user=f"{KEEPER_UID}:{KEEPER_UID}",
                working_dir="/workspace",
                labels={LABEL: self.instance, SANDBOX_LABEL: sandbox_id},
                stop_signal="SIGKILL",
                # tini as pid 1 reaps orphans: zombies would otherwise hold pids.max slots.
                init=True,
            )
            container.reload()
            init = int(container.attrs["State"]["Pid"])
            keep = {init}
            for _ in range(200):
                keep = set(_descendants(init))
                if len(keep) > 1:
                    break
                time.sleep(0.005)
            self._keep[sandbox_id] = keep
            if not self._python:
                self._python = _find_python(container, uid)
            return container.id

        self._containers[sandbox_id] = ""
        making = asyncio.ensure_future(asyncio.to_thread(run))
        try:
            self._containers[sandbox_id] = await asyncio.shield(making)
        except BaseException:
            # Cancelled (the Create's client went away), the thread still makes the
            # container: removed before it exists, it was left running for good.
            with contextlib.suppress(BaseException):
                await making
            self._containers.pop(sandbox_id, None)
            self._keep.pop(sandbox_id, None)
            await asyncio.to_thread(self._remove_by_name, sandbox_id)
            self._free_uids.append(self._uid.pop(sandbox_id))
            raise

    def _remove_by_name(self, sandbox_id: str) -> None:
        with contextlib.suppress(Exception):
            self._client.api.remove_container(f"meridian-{sandbox_id}", force=True, v=True)

    async def destroy(self, sandbox_id: str) -> None:
        self._containers.pop(sandbox_id, None)
        self._keep.pop(sandbox_id, None)
        if self._client is not None:
            await asyncio.to_thread(self._remove_by_name, sandbox_id)
        uid = self._uid.pop(sandbox_id, None)
        if uid is not None:
            self._free_uids.append(uid)

    async def kill_all(self, sandbox_id: str) -> None:
        self._container(sandbox_id)
        if not await asyncio.to_thread(self._sweep, sandbox_id):
            raise Unavailable(f"sandbox {sandbox_id}: processes are left after SIGKILL")

    async def leftovers(self) -> list[str]:
        found = await asyncio.to_thread(lambda: self._client.containers.list(all=True, filters={"label": f"{LABEL}={self.instance}"}))
        return [f"container:{c.labels.get(SANDBOX_LABEL)}" for c in found if c.labels.get(SANDBOX_LABEL) not in self._containers]

    def _container(self, sandbox_id: str) -> str:
        cid = self._containers.get(sandbox_id)
        if not cid:
            raise NotFound(f"no live sandbox {sandbox_id!r}")
        return cid

    # ------------------------------------------------------------ files

    async def _files_op(self, sandbox_id: str, request: dict) -> dict:
        source = FILES_SOURCE + FILES_MAIN
        deadline = max(0.1, FILES_OP_S - FILES_UNWIND_S)
        stdin = json.dumps({**request, "deadline_s": deadline}).encode()
        out, err, result = await self._run_collect(sandbox_id, ["python3", "-I", "-S", "-c", source], stdin, FILES_OP_S, FILES_REPLY_BYTES)
        if result.exit_code != 0 or result.timed_out:
            raise Unavailable(f"file operation in sandbox {sandbox_id} failed (exit {result.exit_code}): {err[-300:].decode(errors='replace')}")
        reply = json.loads(out or b"{}")
        if reply.get("overdue"):
            raise Unavailable(f"file operation in sandbox {sandbox_id} took more than {deadline:.0f} s; it stopped and gave back the modes it changed")
        if "error" in reply:
            # With its kind, or its errno and file name: the caller's status depends on them.
            raise workspace_files.error_from(reply["error"])
        return reply

    async def write_files(self, sandbox_id: str, files: dict[str, bytes], mode: int = 0o644) -> None:
        encoded = [{"path": p, "content": base64.b64encode(c).decode(), "mode": mode} for p, c in files.items()]
        await self._files_op(sandbox_id, {"op": "write", "files": encoded})

    async def read_files(self, sandbox_id: str, paths: list[str], max_bytes: int) -> dict[str, bytes]:
        reply = await self._files_op(sandbox_id, {"op": "read", "paths": paths, "max_bytes": max_bytes, "total": workspace_files.MAX_READ_TOTAL_BYTES})
        return {p: base64.b64decode(c) for p, c in reply["files"].items()}

    async def remove(self, sandbox_id: str, path: str) -> None:
        await self._files_op(sandbox_id, {"op": "remove", "path": path})

    async def check_folder(self, sandbox_id: str, path: str) -> None:
        # In the container, as the sandbox's user: Docker's working folder follows symlinks.
        await self._files_op(sandbox_id, {"op": "folder", "path": path})

    async def copy_workspace(self, src_id: str, dst_id: str) -> None:
        """Copies as the process backend does (workspace_files' walk and builder, so the same
        tree whatever the sandbox made of it), streamed between the two containers through
        the host, which holds one piece of it at a time; within COPY_WALL_S."""
        argv = ["python3", "-I", "-S", "-c", FILES_SOURCE + COPY_MAIN]
        # A sender is told to stop (its stdin closed) and given time to end before it is
        # killed: it gives back the modes it changed in the source as it ends.
        grace = docker_stream.GRACE_S
        sender = await self._start_exec(src_id, [*argv, "send"])
        try:
            receiver = await self._start_exec(dst_id, [*argv, "receive"])
        except BaseException:
            await self._end_exec(src_id, sender, kill=True, grace_s=grace)
            raise
        try:
            relayed = await _relay_to_the_end(sender, receiver, time.monotonic() + COPY_WALL_S)
        except BaseException:
            await self._end_exec(dst_id, receiver, kill=True)
            await self._end_exec(src_id, sender, kill=True, grace_s=grace)
            raise
        # Both have ended unless the relay gave up waiting for them: then they are killed.
        await self._end_exec(dst_id, receiver, kill=not relayed.ended)
        await self._end_exec(src_id, sender, kill=not relayed.ended)
        _check_copy(src_id, relayed)

    async def _run_collect(self, sandbox_id: str, argv: list[str], stdin: bytes, wall_s: float, max_output: int) -> tuple[bytes, bytes, ExecResult]:
        return await collect(self._exec(sandbox_id, argv, stdin, {}, "", wall_s, max_output))

    async def _start_exec(self, sandbox_id: str, argv: list[str], env: dict[str, str] | None = None, cwd: str = "") -> _Started:
        """Starts ``argv`` in the sandbox as its user. The exec counts as active (the sweep
        that ends an exec spares it) until :meth:`_end_exec`."""
        cid = self._container(sandbox_id)
        workdir = "/workspace/" + "/".join(workspace_files.split_relative(cwd)) if cwd else "/workspace"
        api = self._client.api
        user = f"{self._uid[sandbox_id]}:{self._uid[sandbox_id]}"
        sock = None
        try:
            exec_id = (await asyncio.to_thread(api.exec_create, cid, argv, stdin=True, environment=env or {}, workdir=workdir, user=user))["Id"]
            sock = await asyncio.to_thread(api.exec_start, exec_id, socket=True)
            raw = getattr(sock, "_sock", sock)
            early = docker_stream.read_past_head(sock, raw)
        except Exception as exc:
            if sock is not None:
                with contextlib.suppress(OSError):
                    getattr(sock, "_sock", sock).close()  # ends the exec's input
            if sandbox_id not in self._containers:
                raise NotFound(f"no live sandbox {sandbox_id!r}") from None
            raise Unavailable(f"docker exec in sandbox {sandbox_id} failed: {exc}") from exc
        self._active[sandbox_id] = self._active.get(sandbox_id, 0) + 1
        return _Started(exec_id, raw, early)

    async def _end_exec(self, sandbox_id: str, started: _Started, kill: bool, grace_s: float = 0.0) -> None:
        """Ends an exec :meth:`_start_exec` started: kills its processes when asked (after
        closing its stdin and waiting up to ``grace_s`` for it to end by itself), closes its
        socket, and, when no other exec runs in the sandbox, sweeps every process of it but
        the container's init and keep-alive (as in the process backend, nothing an exec
        started outlives it)."""
        if kill and grace_s > 0:
            with contextlib.suppress(OSError):
                started.sock.shutdown(socket.SHUT_WR)
            kill = await asyncio.to_thread(self._still_running, started.exec_id, grace_s)
        if kill:
            await asyncio.to_thread(self._kill_exec, started.exec_id)
        with contextlib.suppress(OSError):
            started.sock.close()
        self._active[sandbox_id] -= 1
        if not self._active[sandbox_id]:
            del self._active[sandbox_id]
            await asyncio.to_thread(self._sweep, sandbox_id)

    # ------------------------------------------------------------ exec

    def exec(
        self, sandbox_id: str, argv: list[str], stdin: bytes, env: dict[str, str], cwd: str, wall_s: float, limits: Limits
    ) -> AsyncIterator[ExecItem]:
        # By its path: the caller's PATH must not choose what sets the limit.
        rlimits = ",".join(f"{name}={value}" for name, value in exec_rlimits(limits, memory_limit(limits)).items())
        wrapped = [self._python, "-I", "-S", "-c", EXEC_LIMITS_MAIN, rlimits, *argv]
        return self._exec(sandbox_id, wrapped, stdin, env, cwd, wall_s, limits.max_output_bytes)

    async def _exec(
        self, sandbox_id: str, argv: list[str], stdin: bytes, env: dict[str, str], cwd: str, wall_s: float, max_output: int
    ) -> AsyncIterator[ExecItem]:
        start = time.monotonic()
        oom_before = self._oom_kills(sandbox_id)
        started = await self._start_exec(sandbox_id, argv, env, cwd)
        exec_id, raw, early = started
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[str, bytes] | None] = asyncio.Queue()
        budget = {"stdout": max_output, "stderr": max_output}
        truncated = {"stdout": False, "stderr": False}
        stop = threading.Event()

        def reader() -> None:
            try:
                if stdin:
                    raw.sendall(stdin)
                with contextlib.suppress(OSError):
                    raw.shutdown(socket.SHUT_WR)
                buf = early
                while True:
                    while len(buf) >= 8:
                        kind, size = buf[0], struct.unpack(">I", buf[4:8])[0]
                        if len(buf) < 8 + size:
                            break
                        payload, buf = buf[8:8 + size], buf[8 + size:]
                        name = "stderr" if kind == 2 else "stdout"
                        keep = payload[: max(0, budget[name])]
                        budget[name] -= len(payload)
                        if len(keep) < len(payload):
                            truncated[name] = True
                        if keep:
                            loop.call_soon_threadsafe(queue.put_nowait, (name, keep))
                    if stop.is_set():
                        break
                    chunk = raw.recv(65536)
                    if not chunk:
                        break
                    buf += chunk
            except OSError:
                pass
            finally:
                loop.call_soon_threadsafe(queue.put_nowait, None)

        thread = threading.Thread(target=reader, daemon=True, name=f"exec-{sandbox_id}")
        timed_out = False
        deadline = start + wall_s
        drained = Drained()
        try:
            thread.start()
            async for item in drain(queue, 1, deadline, drained):
                yield item
            timed_out = drained.timed_out
        finally:
            stop.set()
            kill = timed_out or thread.is_alive()
            # The reader must be gone before _end_exec closes the socket: a recv already
            # past its descriptor check would read whatever socket reuses the number next
            # (another exec's output). Shutting the socket down wakes a blocked recv or send.
            with contextlib.suppress(OSError):
                raw.shutdown(socket.SHUT_RDWR)
            if thread.ident is not None:
                await asyncio.to_thread(thread.join, READER_JOIN_S)
            if thread.is_alive():
                log.warning("exec reader of sandbox %s did not end within %.0f s; closing its socket anyway", sandbox_id, READER_JOIN_S)
            await self._end_exec(sandbox_id, started, kill=kill)
        info = await asyncio.to_thread(self._wait_exec, exec_id)
        code = info.get("ExitCode")
        code = -1 if code is None else int(code)
        killed = timed_out or code > 128
        # Killed by SIGKILL while the container's OOM counter rose: the memory limit's OOM
        # killer (Docker reports an exec's death by signal N as exit 128 + N).
        oom = code == 128 + signal.SIGKILL and not timed_out and self._oom_kills(sandbox_id) > oom_before
        yield ExecResult(
            exit_code=-1 if killed and code > 128 else code,
            signal=code - 128 if code > 128 else (signal.SIGKILL if timed_out else 0),
            timed_out=timed_out,
            stdout_truncated=truncated["stdout"],
            stderr_truncated=truncated["stderr"],
            wall_seconds=time.monotonic() - start,
            oom_killed=oom,
        )

    def _oom_kills(self, sandbox_id: str) -> int:
        """How many processes the OOM killer has killed in the container's memory cgroup
        (its ``oom_kill`` counter; 0 where it cannot be read)."""
        keep = self._keep.get(sandbox_id)
        found = _cgroup_folder(min(keep), "memory") if keep else None
        return 0 if found is None else oom_kill_count(*found)

    def _sweep(self, sandbox_id: str) -> bool:
        """Kills every process of the container but its init and keep-alive; True once none is left."""
        keep = self._keep.get(sandbox_id)
        if not keep:
            return True
        procs = _cgroup_procs_file(min(keep))
        if procs is None:
            return True
        for attempt in range(200):
            try:
                pids = [int(p) for p in procs.read_text().split() if int(p) not in keep]
            except OSError:
                return True
            if not pids:
                return True
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.005 if attempt < 20 else 0.05)
        return False

    def _kill_exec(self, exec_id: str) -> None:
        """Kills the exec's process tree on the host (the daemon is local; Docker has no
        API to kill an exec). Processes that daemonised away live until Close."""
        with contextlib.suppress(Exception):
            pid = self._client.api.exec_inspect(exec_id).get("Pid") or 0
            if pid > 0:
                for victim in _descendants(pid):
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(victim, signal.SIGKILL)

    def _still_running(self, exec_id: str, within_s: float) -> bool:
        """Whether the exec still runs after waiting up to ``within_s`` for it to end."""
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                if not self._client.api.exec_inspect(exec_id).get("Running"):
                    return False
            time.sleep(0.05)
        return True

    def _wait_exec(self, exec_id: str) -> dict:
        for _ in range(200):
            info = self._client.api.exec_inspect(exec_id)
            if not info.get("Running"):
                return info
            time.sleep(0.01)
        return self._client.api.exec_inspect(exec_id)


async def _relay_to_the_end(sender: _Started, receiver: _Started, deadline: float) -> docker_stream.Relayed:
    """docker_stream.relay in a thread of its own (a copy can take minutes; the default
    executor's few workers serve every other call). A caller that goes away stops the
    relay (so the sender gives back what it changed in the source) and still waits for its
    end: the sockets must not be closed, and their descriptors reused, under the thread."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[docker_stream.Relayed] = loop.create_future()
    stop = threading.Event()

    def settle(result: docker_stream.Relayed | None, exc: BaseException | None) -> None:
        if done.done():
            return
        if exc is not None:
            done.set_exception(exc)
        elif result is not None:
            done.set_result(result)

    def run() -> None:
        try:
            result = docker_stream.relay(sender.sock, receiver.sock, deadline, stop, early=(sender.early, receiver.early))
        except BaseException as exc:  # handed to the awaiting caller
            loop.call_soon_threadsafe(settle, None, exc)
        else:
            loop.call_soon_threadsafe(settle, result, None)

    threading.Thread(target=run, daemon=True, name="fork-relay").start()
    cancelled = False
    while not done.done():
        try:
            await asyncio.shield(done)
        except asyncio.CancelledError:
            cancelled = True
            stop.set()
        except BaseException:
            break  # the relay's own error, raised below
    error = done.exception()
    if cancelled:
        raise asyncio.CancelledError()
    if error is not None:
        raise error
    return done.result()


def _find_python(container, uid: int) -> str:  # type: ignore[no-untyped-def]
    """The path of the image's python3 (on the image's PATH, as the file helpers find it),
    asked in a container no sandbox code has run in yet; the root is read-only, so it stays."""
    code, out = container.exec_run(["/bin/busybox", "which", "python3"], user=f"{uid}:{uid}")
    path = out.decode(errors="replace").strip()
    if code != 0 or not path.startswith("/"):
        raise FailedPrecondition(f"the sandbox image {container.image.tags or container.image.id} has no python3 on its PATH: {path[-200:]}")
    return path


def _check_copy(src_id: str, relayed: docker_stream.Relayed) -> None:
    """Raises what a copy's relay says went wrong: the receiver's reply, or why there is none."""
    if relayed.timed_out:
        raise Unavailable(f"copying the workspace of sandbox {src_id} took more than {COPY_WALL_S:.0f} s")
    try:
        reply = json.loads(relayed.reply)
    except ValueError:
        reply = None
    if not isinstance(reply, dict):
        stderr = (relayed.receiver_stderr or relayed.sender_stderr)[-300:].decode(errors="replace")
        raise Unavailable(f"copying the workspace of sandbox {src_id} failed: {stderr or 'no reply from the copy'}")
    if "error" in reply:
        exc = workspace_files.error_from(reply["error"])
        if isinstance(exc, workspace_files.PathError) and exc.kind == "truncated":
            stderr = relayed.sender_stderr[-300:].decode(errors="replace")
            raise Unavailable(f"copying the workspace of sandbox {src_id} failed: {exc}: {stderr or 'the sending side ended early'}")
        raise copy_error(src_id, exc)


def _cgroup_folder(pid: int, controller: str) -> tuple[Path, int] | None:
    """The folder of ``pid``'s ``controller`` cgroup (v1) or unified cgroup (v2), and
    the cgroup version it is of."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, names, path = line.split(":", 2)
        if controller in names.split(","):
            return Path("/sys/fs/cgroup") / controller / path.lstrip("/"), 1
    for line in lines:
        if line.startswith("0::"):
            return Path("/sys/fs/cgroup") / line[3:].lstrip("/"), 2
    return None


def _cgroup_procs_file(pid: int) -> Path | None:
    """The cgroup.procs file of ``pid``'s pids cgroup (v1) or unified cgroup (v2)."""
    found = _cgroup_folder(pid, "pids")
    return None if found is None else found[0] / "cgroup.procs"


def _descendants(pid: int) -> list[int]:
    """``pid`` and every process below it, from /proc's children lists."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children") as fh:
                    todo += [int(c) for c in fh.read().split()]
    return found
