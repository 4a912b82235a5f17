"""The process backend: Linux namespaces, a private root filesystem and cgroups; no daemon.

Every command runs through a chain of exec'd tools (no Python between fork and exec in
this multi-threaded server):

``setpriv --pdeathsig KILL`` (dies with the service) → ``sh`` (joins the sandbox's
cgroups with a builtin ``echo $$``) → ``nsenter --mount=<helper ns>`` (where the sandbox
roots are mounted) → ``unshare --pid --fork --kill-child --mount --net --ipc --uts
--mount-proc --root=<sandbox root> --wd=/workspace`` (fresh namespaces; the network one
has only a downed loopback) → ``prlimit`` (rlimits) → ``setpriv --reuid/--regid
--clear-groups --no-new-privs`` with every capability dropped → the command.

The command is pid 1 of its own pid namespace: when it ends, or when the service kills
``unshare`` on a timeout, the kernel kills everything it started. The sandbox root (see
mount_helper.py) lives in the mount helper's private namespace, and the service reaches
its workspace through ``/proc/<helper>/root``, one ``O_NOFOLLOW`` component at a time.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

from meridian.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from services.envsandbox import workspace_files
from services.envsandbox.cgroups import CgroupLimits, Cgroups
from services.envsandbox.sandbox import SANDBOX_UID, Backend, ExecItem, ExecResult, Limits, PumpDone, pump_process
from services.envsandbox.spawn import SpawnedProcess, spawn

log = logging.getLogger(__name__)

TOOLS = ("setpriv", "unshare", "nsenter", "prlimit", "sh")
JOIN_CGROUPS = 'n=$1; shift; while [ "$n" -gt 0 ]; do echo 0 > "$1" || exit 125; shift; n=$((n-1)); done; exec "$@"'
INODES_PER_MIB = 256


class ProcessBackend(Backend):
    name = "process"

    def __init__(self, root: Path, uid: int = SANDBOX_UID) -> None:
        self.root = Path(root)
        self.uid = uid
        self.mount_dir = self.root / "mnt"
        self._tools: dict[str, str] = {}
        self._helper: SpawnedProcess | None = None
        self._helper_lock = asyncio.Lock()
        self._cgroups: Cgroups | None = None
        self._procs: dict[str, list[str]] = {}
        self._running: dict[str, set[SpawnedProcess]] = {}

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
        self._cgroups = Cgroups()
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
                sys.executable, "-I", "-S", str(Path(__file__).parent / "mount_helper.py"), str(self.mount_dir), str(self.uid),
            ],
            env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"},
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
        async with self._helper_lock:
            if self._helper is None or self._helper.returncode is not None:
                raise Unavailable("the sandbox mount helper is not running")
            assert self._helper.stdin is not None
            self._helper.stdin.write(json.dumps({"op": op, **args}).encode() + b"\n")
            await self._helper.stdin.drain()
            reply = await self._read_reply()
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
        if self._cgroups is not None:
            self._cgroups.remove_instance()
        shutil.rmtree(self.mount_dir, ignore_errors=True)

    async def create(self, sandbox_id: str, limits: Limits) -> None:
        assert self._cgroups is not None
        inodes = max(1024, limits.disk_bytes // (1 << 20) * INODES_PER_MIB)
        self._procs[sandbox_id] = []
        self._running[sandbox_id] = set()
        await self._helper_call("create", sandbox_id=sandbox_id, disk_bytes=limits.disk_bytes, inodes=inodes)
        procs = self._cgroups.create(sandbox_id, CgroupLimits(limits.memory_bytes, limits.max_pids, limits.cpus))
        self._procs[sandbox_id] = procs

    async def destroy(self, sandbox_id: str) -> None:
        for proc in list(self._running.pop(sandbox_id, ())):
            _kill(proc)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(proc.wait(), 5)
        self._procs.pop(sandbox_id, None)
        if self._cgroups is not None:
            self._cgroups.remove(sandbox_id)
        if self._helper is not None and self._helper.returncode is None:
            await self._helper_call("destroy", sandbox_id=sandbox_id)

    async def leftovers(self) -> list[str]:
        found = []
        if self._helper is not None and self._helper.returncode is None:
            found += [f"mount:{s}" for s in (await self._helper_call("list"))["sandboxes"] if s not in self._procs]
        if self._cgroups is not None:
            found += [f"cgroup:{s}" for s in self._cgroups.live_sandboxes() if s not in self._procs]
        return found

    # ------------------------------------------------------------ files

    def _sandbox_root(self, sandbox_id: str) -> str:
        if sandbox_id not in self._procs or self._helper is None:
            raise NotFound(f"no live sandbox {sandbox_id!r}")
        return f"/proc/{self._helper.pid}/root{self.mount_dir}/{sandbox_id}"

    def _workspace_fd(self, sandbox_id: str) -> int:
        root = self._sandbox_root(sandbox_id)
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            return os.open("workspace", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=root_fd)
        finally:
            os.close(root_fd)

    async def write_files(self, sandbox_id: str, files: dict[str, bytes], mode: int = 0o644) -> None:
        fd = self._workspace_fd(sandbox_id)
        try:
            for rel, content in files.items():
                workspace_files.write_file(fd, rel, content, mode, owner=(self.uid, self.uid))
        finally:
            os.close(fd)

    async def read_files(self, sandbox_id: str, paths: list[str], max_bytes: int) -> dict[str, bytes]:
        fd = self._workspace_fd(sandbox_id)
        try:
            return {rel: workspace_files.read_file(fd, rel, max_bytes) for rel in paths}
        finally:
            os.close(fd)

    async def remove(self, sandbox_id: str, path: str) -> None:
        fd = self._workspace_fd(sandbox_id)
        try:
            workspace_files.remove_tree(fd, path)
        finally:
            os.close(fd)

    async def copy_workspace(self, src_id: str, dst_id: str) -> None:
        src, dst = self._workspace_fd(src_id), self._workspace_fd(dst_id)
        try:
            workspace_files.copy_tree(src, dst, owner=(self.uid, self.uid))
        finally:
            os.close(src)
            os.close(dst)

    # ------------------------------------------------------------ exec

    def command(self, sandbox_id: str, argv: list[str], cwd: str, limits: Limits) -> list[str]:
        """The full exec chain for ``argv`` in the sandbox (see the module docstring)."""
        assert self._helper is not None
        procs = self._procs[sandbox_id]
        cpu = max(1, int(limits.cpu_seconds))
        t = self._tools
        workdir = "/workspace/" + "/".join(workspace_files.split_relative(cwd)) if cwd else "/workspace"
        return [
            t["setpriv"], "--pdeathsig", "KILL", "--",
            t["sh"], "-c", JOIN_CGROUPS, "sh", str(len(procs)), *procs,
            t["nsenter"], f"--mount=/proc/{self._helper.pid}/ns/mnt", "--",
            t["unshare"], "--pid", "--fork", "--kill-child", "--mount", "--net", "--ipc", "--uts", "--mount-proc",
            f"--root={self.mount_dir}/{sandbox_id}", f"--wd={workdir}", "--",
            "/usr/bin/prlimit", f"--as={limits.memory_bytes * 2}", f"--cpu={cpu}:{cpu + 1}", f"--fsize={limits.max_file_bytes}",
            "--core=0", "--nofile=1024", "--",
            "/usr/bin/setpriv", f"--reuid={self.uid}", f"--regid={self.uid}", "--clear-groups", "--no-new-privs",
            "--inh-caps=-all", "--bounding-set=-all", "--",
            *argv,
        ]

    async def exec(
        self, sandbox_id: str, argv: list[str], stdin: bytes, env: dict[str, str], cwd: str, wall_s: float, limits: Limits
    ) -> AsyncIterator[ExecItem]:
        self._sandbox_root(sandbox_id)
        if cwd:
            fd = self._workspace_fd(sandbox_id)
            try:
                os.close(workspace_files._walk_dirs(fd, workspace_files.split_relative(cwd), cwd, create=False, owner=None))
            except workspace_files.PathError as exc:
                raise InvalidArgument(f"cwd {cwd!r} is not a folder in the sandbox: {exc}") from None
            finally:
                os.close(fd)
        start = time.monotonic()
        proc = await spawn(self.command(sandbox_id, argv, cwd, limits), env=env)
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
        assert done is not None
        code = proc.returncode if proc.returncode is not None else -signal.SIGKILL
        oom = self._cgroups.oom_killed(sandbox_id) if self._cgroups and code == -signal.SIGKILL and not done.timed_out else False
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


def _kill(proc: SpawnedProcess) -> None:
    """SIGKILL to the chain's process group; ``unshare --kill-child`` takes the namespace down."""
    if proc.returncode is None:
        for kill in (lambda: os.killpg(proc.pid, signal.SIGKILL), lambda: os.kill(proc.pid, signal.SIGKILL)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                kill()
