"""Docker's multiplexed exec streams, read as they arrive, and a relay that pipes one exec's
standard output into another exec's standard input a piece at a time.

The Docker backend copies a workspace by running ``workspace_files.send_tree`` in the source
container and ``receive_tree`` in the destination's; :func:`relay` joins the two through
the host, which holds at most one socket read of the stream at a time, never the workspace.
Standard library only; the sockets are the raw ones of two ``exec_start(socket=True)``.
"""
from __future__ import annotations

import dataclasses
import select
import socket
import struct
import threading
import time
from collections.abc import Iterator

STDOUT, STDERR = 1, 2
#: How much one socket read takes: the most of the stream the host holds at a time.
READ_BYTES = 64 * 1024
#: How much of a receiver's standard output (its JSON reply) and of each standard error is kept.
KEEP_BYTES = 64 * 1024
#: How long the two sides get to end by themselves once told to stop (the sender then gives
#: back the modes it changed in the source) before the caller kills them.
GRACE_S = 10.0


class Demux:
    """Splits Docker's multiplexed stream (frames of an 8-byte header: the stream, three
    zero bytes, a big-endian size; then the payload) as it arrives: payload bytes are
    handed on as they come, nothing waits for a whole frame."""

    def __init__(self) -> None:
        self._header = bytearray()
        self._stream = 0
        self._left = 0

    def feed(self, data: bytes) -> Iterator[tuple[int, bytes]]:
        """(stream, payload piece) for everything in ``data``."""
        view = memoryview(data)
        while view:
            if self._left == 0:
                take = 8 - len(self._header)
                self._header += view[:take]
                view = view[take:]
                if len(self._header) == 8:
                    self._stream, self._left = self._header[0], struct.unpack(">I", self._header[4:8])[0]
                    self._header.clear()
                continue
            piece = view[: self._left]
            view = view[len(piece):]
            self._left -= len(piece)
            yield self._stream, bytes(piece)


@dataclasses.dataclass
class Relayed:
    """How a :func:`relay` ended."""

    reply: bytes = b""
    sender_stderr: bytes = b""
    receiver_stderr: bytes = b""
    timed_out: bool = False
    ended: bool = False  # both sides closed their output (they exited)


def _keep(buffer: bytearray, piece: bytes, tail: bool) -> None:
    """Appends ``piece`` to ``buffer`` within KEEP_BYTES: the first bytes, or the last ones."""
    buffer += piece
    if len(buffer) > KEEP_BYTES:
        if tail:
            del buffer[: len(buffer) - KEEP_BYTES]
        else:
            del buffer[KEEP_BYTES:]


def read_past_head(sock: object, raw: socket.socket) -> bytes:
    """What the HTTP client of ``exec_start(socket=True)`` read off ``raw`` beyond the
    response's head: the start of the exec's stream when the exec wrote before the client
    had parsed the head (a busy host). The client reads the head through a buffered
    reader, and the socket it hands back is the one under that reader: those bytes are
    in no read of the socket, and were lost with the exec's first output. Taken without
    waiting: the socket is non-blocking meanwhile, so an empty buffer reads nothing."""
    response = getattr(sock, "_response", None)
    reader = getattr(getattr(getattr(response, "raw", None), "_fp", None), "fp", None)
    if reader is None or not hasattr(reader, "peek"):
        raise RuntimeError("docker's exec socket no longer comes with its HTTP response: cannot tell what it read past the head")
    timeout = raw.gettimeout()
    raw.setblocking(False)
    try:
        return bytes(reader.peek())
    except BlockingIOError:
        return b""
    finally:
        raw.settimeout(timeout)


class _Relay:
    """The state of one relay; see :func:`relay`."""

    def __init__(self, sender: socket.socket, receiver: socket.socket, early: tuple[bytes, bytes]) -> None:
        self.sender, self.receiver = sender, receiver
        self.from_sender, self.from_receiver = Demux(), Demux()
        self.pending = b""  # sender output not yet passed on: at most one read's worth
        self.sender_open = self.receiver_open = self.receiver_takes = True
        self.sender_told = False
        self.out = Relayed()
        self.reply, self.sender_err, self.receiver_err = bytearray(), bytearray(), bytearray()
        self.take_sender(early[0])
        self.take_receiver(early[1])

    def stop_sender(self) -> None:
        """Closes the sender's standard input: send_tree stops at its next write."""
        if not self.sender_told:
            self.sender_told = True
            _shut_write(self.sender)

    def end_input(self) -> None:
        """Closes the receiver's standard input (after all it was sent, or to cut it off)."""
        if self.receiver_takes:
            self.receiver_takes = False
            self.pending = b""
            _shut_write(self.receiver)

    def read_sender(self) -> None:
        data = _recv(self.sender)
        if data is None:
            return
        if not data:
            self.sender_open = False
            return
        self.take_sender(data)

    def take_sender(self, data: bytes) -> None:
        for stream, piece in self.from_sender.feed(data):
            if stream == STDERR:
                _keep(self.sender_err, piece, tail=True)
            elif self.receiver_takes:
                self.pending += piece

    def write_receiver(self) -> None:
        try:
            sent = self.receiver.send(self.pending)
        except BlockingIOError:
            return
        except OSError:
            # The receiver is gone (it failed: no room, say); its reply says why.
            self.end_input()
            self.stop_sender()
            return
        self.pending = self.pending[sent:]

    def read_receiver(self) -> None:
        data = _recv(self.receiver)
        if data is None:
            return
        if not data:
            self.receiver_open = False
            self.end_input()
            self.stop_sender()  # it ended (done, or failed): nothing more to send
            return
        self.take_receiver(data)

    def take_receiver(self, data: bytes) -> None:
        for stream, piece in self.from_receiver.feed(data):
            _keep(self.receiver_err if stream == STDERR else self.reply, piece, tail=stream == STDERR)

    def step(self, timeout: float) -> None:
        """One wait for the sockets, and what they are ready for."""
        if not self.sender_open and not self.pending:
            self.end_input()
        reads = [s for s, wanted in ((self.sender, self.sender_open and not self.pending), (self.receiver, self.receiver_open)) if wanted]
        writes = [self.receiver] if self.pending and self.receiver_takes else []
        readable, writable, _ = select.select(reads, writes, [], max(0.0, timeout))
        if self.receiver in writable:
            self.write_receiver()
        if self.sender in readable:
            self.read_sender()
        if self.receiver in readable:
            self.read_receiver()

    def result(self) -> Relayed:
        self.out.reply, self.out.sender_stderr, self.out.receiver_stderr = bytes(self.reply), bytes(self.sender_err), bytes(self.receiver_err)
        self.out.ended = not self.sender_open and not self.receiver_open
        return self.out


def relay(
    sender: socket.socket, receiver: socket.socket, deadline: float, stop: threading.Event | None = None, poll_s: float = 0.25, early: tuple[bytes, bytes] = (b"", b"")
) -> Relayed:
    """Pipes the sender exec's standard output into the receiver exec's standard input until
    both have ended; returns the receiver's standard output (its reply) and both standard
    errors. When the receiver ends first (it failed) the sender is told to stop; at
    ``deadline`` (time.monotonic), or once ``stop`` is set, both are. Told, they get GRACE_S
    to end by themselves. Blocking (run it in a thread); the sockets are left open.
    ``early``: the start of each one's stream read before (:func:`read_past_head`)."""
    state = _Relay(sender, receiver, early)
    sender.setblocking(False)
    receiver.setblocking(False)
    told_at: float | None = None
    while state.sender_open or state.receiver_open:
        now = time.monotonic()
        if told_at is None and (now >= deadline or stop is not None and stop.is_set()):
            state.out.timed_out = now >= deadline
            state.stop_sender()
            state.end_input()
            told_at = now
        elif told_at is None and not state.receiver_open:
            told_at = now  # the receiver is done, and has told the sender to stop
        limit = deadline if told_at is None else told_at + GRACE_S
        if now >= limit and told_at is not None:
            break
        state.step(min(poll_s, max(0.0, limit - now)))
    return state.result()


def _recv(sock: socket.socket) -> bytes | None:
    """What ``sock`` has: b"" at its end (or when it failed), None when nothing is there yet."""
    try:
        return sock.recv(READ_BYTES)
    except BlockingIOError:
        return None
    except OSError:
        return b""


def _shut_write(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass  # already closed by the other end: nothing to tell it
