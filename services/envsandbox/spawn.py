"""Starting child processes from a multi-threaded gRPC server without fork().

``asyncio.create_subprocess_exec`` may fall back to fork(), and then gRPC's at-fork
handlers run in the child of a process whose other threads hold gRPC locks: the child
crashes (SIGSEGV) before it reaches exec. ``os.posix_spawn`` uses clone(CLONE_VFORK) in
glibc, runs no at-fork handler and no Python in the child. This module wraps it with
asyncio pipes and a pidfd to wait on, exposing what :func:`sandbox.pump_process` needs.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal

_DEFAULT_SIGNALS = [s for s in signal.Signals if s not in (signal.SIGKILL, signal.SIGSTOP)]


class SpawnedProcess:
    """A child started by :func:`spawn`: ``pid``, ``stdin``/``stdout``/``stderr`` streams,
    ``returncode`` (negative: killed by that signal) and ``wait()``."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self.stdin: asyncio.StreamWriter | None = None
        self.stdout: asyncio.StreamReader | None = None
        self.stderr: asyncio.StreamReader | None = None
        self._exited = asyncio.get_running_loop().create_future()
        self._pidfd = os.pidfd_open(pid)
        asyncio.get_running_loop().add_reader(self._pidfd, self._reap)

    def _reap(self) -> None:
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            pid, status = self.pid, 0
        if pid == 0:
            return
        self.returncode = os.waitstatus_to_exitcode(status)
        loop = asyncio.get_running_loop()
        loop.remove_reader(self._pidfd)
        os.close(self._pidfd)
        if not self._exited.done():
            self._exited.set_result(self.returncode)

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)

    def kill(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


async def spawn(
    argv: list[str], env: dict[str, str], stderr: bool = True, new_session: bool = True, pass_fds: dict[int, int] | None = None
) -> SpawnedProcess:
    """Starts ``argv`` (absolute path first) with piped stdin, stdout and (optionally) stderr;
    ``pass_fds`` maps a descriptor number in the child to one of ours to put there."""
    loop = asyncio.get_running_loop()
    in_r, in_w = os.pipe2(os.O_CLOEXEC)
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    err_r, err_w = os.pipe2(os.O_CLOEXEC) if stderr else (-1, -1)
    actions = [(os.POSIX_SPAWN_DUP2, in_r, 0), (os.POSIX_SPAWN_DUP2, out_w, 1)]
    actions.append((os.POSIX_SPAWN_DUP2, err_w, 2) if stderr else (os.POSIX_SPAWN_OPEN, 2, os.devnull, os.O_WRONLY, 0))
    actions += [(os.POSIX_SPAWN_DUP2, ours, theirs) for theirs, ours in (pass_fds or {}).items()]
    try:
        pid = os.posix_spawn(
            argv[0], argv, env, file_actions=actions, setsid=new_session, setsigmask=(), setsigdef=_DEFAULT_SIGNALS
        )
    finally:
        for fd in (in_r, out_w, err_w):
            if fd >= 0:
                os.close(fd)
    proc = SpawnedProcess(pid)
    try:
        transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin, os.fdopen(in_w, "wb", 0))
        proc.stdin = asyncio.StreamWriter(transport, protocol, None, loop)
        proc.stdout = await _reader(loop, out_r)
        if stderr:
            proc.stderr = await _reader(loop, err_r)
    except BaseException:
        proc.kill()
        raise
    return proc


async def _reader(loop: asyncio.AbstractEventLoop, fd: int) -> asyncio.StreamReader:
    reader = asyncio.StreamReader(limit=1 << 20)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", 0))
    return reader
