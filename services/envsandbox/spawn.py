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
import io
import os
import signal
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")
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
    pending = [fd for fd in (in_w, out_r, err_r) if fd >= 0]  # ours to close until handed over
    try:
        pending.remove(in_w)
        transport, protocol = await _hand_over(in_w, "wb", lambda pipe: loop.connect_write_pipe(asyncio.streams.FlowControlMixin, pipe))
        proc.stdin = asyncio.StreamWriter(transport, protocol, None, loop)
        pending.remove(out_r)
        proc.stdout = await _reader(loop, out_r)
        if stderr:
            pending.remove(err_r)
            proc.stderr = await _reader(loop, err_r)
    except BaseException:
        proc.kill()
        for fd in pending:
            os.close(fd)
        raise
    return proc


async def _hand_over(fd: int, mode: str, connect: Callable[[io.FileIO], Awaitable[T]]) -> T:
    """``connect`` (a loop's connect_*_pipe) on a duplicate of ``fd``, which this closes
    whatever happens. A connect cancelled while it waits for its transport closes that
    transport, and with it the pipe, a moment later: had it been given ``fd`` itself, the
    caller's cleanup would close the number first, and the transport then whatever took
    the number meanwhile (another sandbox's pipe, a pidfd the loop watches; a full suite
    logged the EBADF of such a second close). The duplicate is the transport's alone."""
    loop = asyncio.get_running_loop()
    try:
        return await connect(_pipe_file(loop, os.dup(fd), mode))
    finally:
        os.close(fd)


def _pipe_file(loop: asyncio.AbstractEventLoop, fd: int, mode: str) -> io.FileIO:
    """The file object a pipe transport takes over, closing ``fd`` exactly once.

    uvloop hands the descriptor itself to libuv, which closes it with the transport, and
    the file object closes the same number again when it is closed or collected
    (MagicStack/uvloop#763): by then the number may belong to another sandbox's pipe or to
    a pidfd the loop watches, whose exec then never ends. Under uvloop the file object
    must not close it; asyncio's own transports close it through the file object."""
    return io.FileIO(fd, mode, closefd=not _is_uvloop(loop))


def _is_uvloop(loop: asyncio.AbstractEventLoop) -> bool:
    return type(loop).__module__.split(".")[0] == "uvloop"


class _PipeReaderProtocol(asyncio.StreamReaderProtocol):
    """asyncio's stream protocol for a pipe, whose transport closes at the pipe's end."""

    def eof_received(self) -> bool:
        """Feeds the end to the stream; False: nothing can follow it on a pipe. asyncio's
        stream protocol answers True (keep the transport open, for a socket's half
        close): uvloop heeds that, and each finished command's pipes then stayed open
        until the garbage collector found their transports (asyncio's own pipe
        transports close at the end whatever the answer)."""
        super().eof_received()
        return False


async def _reader(loop: asyncio.AbstractEventLoop, fd: int) -> asyncio.StreamReader:
    """A stream reading the pipe ``fd`` (handed over: see :func:`_hand_over`)."""
    reader = asyncio.StreamReader(limit=1 << 20)
    await _hand_over(fd, "rb", lambda pipe: loop.connect_read_pipe(lambda: _PipeReaderProtocol(reader), pipe))
    return reader
