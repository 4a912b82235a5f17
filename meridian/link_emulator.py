"""A WAN link on loopback: a user-space TCP proxy with bandwidth, latency and cuts.

``tc netem`` is not available everywhere, so tests and benches put this proxy between
two weightsync servers (or a server and a subscriber), and a multi-region ``meridian up``
puts one between each remote region's relay and the origin. In tests it runs inside the
caller's asyncio loop and is controlled in-process; as a process (``meridian link``,
:func:`main`) it is controlled by signals: SIGUSR1 cuts the link (open connections reset,
new ones refused) until SIGUSR2 restores it, SIGHUP corrupts the next bytes it carries
down (see :func:`run_link`), and its counters are written to a JSON file once a second.

Model of one direction of the link: bytes are *serialised* onto the link at
``bandwidth`` bytes/s (one link per direction, shared by every connection through the
proxy, like a real inter-region pipe), then *arrive* ``latency_s`` later. The proxy
reads a piece, books its serialisation slot ``[start, end)`` on the link clock, and
queues it with the arrival time ``end + latency_s``; a writer per connection delivers
queued pieces in order at their time. The reader waits until the link is free again
(less one piece's time) before reading more, so the sender feels back-pressure (its
socket buffer fills) and at most one bandwidth-delay product and a piece sit in the queue. Bytes pass through unchanged,
so HTTP/2 (gRPC) works through it.

Faults: :meth:`LinkEmulator.cut` closes every open connection at once;
``cut(refuse_s=T)`` also refuses new connections for T seconds;
:meth:`LinkEmulator.corrupt_once` flips one byte of the server-to-client stream at a
given distance after the first occurrence of a byte pattern (e.g. a chunk's header).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import signal
import time
from pathlib import Path

from meridian.config import add_config_args, config_from_args, opt

log = logging.getLogger(__name__)

READ_BYTES = 64 * 1024
#: The start of every weightsync chunk payload (magic ``MW``, format version 1).
CHUNK_MAGIC = b"MW\x01"
#: SIGHUP flips the byte this far into the next bytes the link carries down.
SIGHUP_AFTER = 1000


@dataclasses.dataclass
class _Corruption:
    pattern: bytes
    after: int              # distance of the flipped byte from the end of the pattern
    armed: bool = True
    fired: bool = False


class _Direction:
    """The link clock and byte counter of one direction (shared by all connections)."""

    def __init__(self, bandwidth: float, latency_s: float) -> None:
        self.bandwidth = bandwidth
        self.latency_s = latency_s
        self.free_at = 0.0  # monotonic time the link finishes serialising what it has
        self.bytes = 0

    def book(self, n: int) -> float:
        """Books ``n`` bytes on the link; returns their arrival time at the far end."""
        now = time.monotonic()
        start = max(now, self.free_at)
        end = start + (n / self.bandwidth if self.bandwidth > 0 else 0.0)
        self.free_at = end
        self.bytes += n
        return end + self.latency_s


class _Pump:
    """Moves one connection's bytes in one direction through a :class:`_Direction`."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: _Direction, corruption: list[_Corruption]) -> None:
        self.reader = reader
        self.writer = writer
        self.link = link
        self.corruption = corruption  # rules to apply in this direction
        self.queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        self._tail = b""  # last bytes seen, so a pattern split across reads still matches
        self._pending_flip: list[tuple[_Corruption, int]] = []  # (rule, bytes still to skip)
        self._seen = 0

    def _corrupt(self, data: bytes) -> bytes:
        if not self.corruption and not self._pending_flip:
            return data
        buf = bytearray(data)
        for rule in self.corruption:
            if not rule.armed:
                continue
            if not rule.pattern:  # the next bytes carried, whatever they are
                rule.armed = False
                self._pending_flip.append((rule, rule.after))
                continue
            window = self._tail + data
            at = window.find(rule.pattern)
            if at >= 0:
                rule.armed = False
                # Offset of the target byte inside ``data`` (may lie in a later read).
                target = at + len(rule.pattern) + rule.after - len(self._tail)
                self._pending_flip.append((rule, target))
        keep = []
        for rule, target in self._pending_flip:
            if target < len(buf):
                buf[target] ^= 0xFF
                rule.fired = True
            else:
                keep.append((rule, target - len(buf)))
        self._pending_flip = keep
        longest = max((len(r.pattern) for r in self.corruption), default=1)
        self._tail = (self._tail + data)[-(longest - 1) :] if longest > 1 else b""
        return bytes(buf)

    async def read_loop(self) -> None:
        try:
            while True:
                # Pieces of about 5 ms of link time keep the timing smooth at any bandwidth.
                size = READ_BYTES if self.link.bandwidth <= 0 else max(1024, min(READ_BYTES, int(self.link.bandwidth * 0.005)))
                # Wake one piece early: a piece read by the time the link comes free is
                # booked from that moment. Waking exactly then, a loop busy with other work
                # wakes late, and the link would idle while bytes wait for it, which a real
                # link does not (that made the emulated link up to 40 % slower than set).
                ahead = size / self.link.bandwidth if self.link.bandwidth > 0 else 0.0
                wait = self.link.free_at - ahead - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                data = await self.reader.read(size)
                if not data:
                    break
                data = self._corrupt(data)
                self.queue.put_nowait((self.link.book(len(data)), data))
        finally:
            self.queue.put_nowait((0.0, b""))

    async def write_loop(self) -> None:
        while True:
            due, data = await self.queue.get()
            if not data:
                with contextlib.suppress(Exception):
                    if self.writer.can_write_eof():
                        self.writer.write_eof()
                return
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            self.writer.write(data)
            await self.writer.drain()


class LinkEmulator:
    """A TCP proxy ``127.0.0.1:<port>`` -> ``target`` that behaves like a WAN link.

    ``bandwidth`` is in bytes/s per direction (0: unlimited), ``latency_s`` one way.
    Use as ``async with LinkEmulator(...) as link: link.address``.
    """

    def __init__(self, target: str, bandwidth: float = 0.0, latency_s: float = 0.0, host: str = "127.0.0.1", listen_port: int = 0) -> None:
        self.target_host, _, port = target.rpartition(":")
        self.target_port = int(port)
        self.host = host
        self.listen_port = listen_port
        self.up = _Direction(bandwidth, latency_s)    # client -> server
        self.down = _Direction(bandwidth, latency_s)  # server -> client
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter, asyncio.Task[None]]] = set()
        self._refuse_until = 0.0
        self._corruption: list[_Corruption] = []
        self.connections = 0
        self.cuts = 0
        self.port = 0

    # ------------------------------------------------------------ control

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def bytes_down(self) -> int:
        """Bytes carried server -> client so far."""
        return self.down.bytes

    @property
    def bytes_up(self) -> int:
        return self.up.bytes

    def set_link(self, bandwidth: float | None = None, latency_s: float | None = None) -> None:
        for d in (self.up, self.down):
            if bandwidth is not None:
                d.bandwidth = bandwidth
            if latency_s is not None:
                d.latency_s = latency_s

    def cut(self, refuse_s: float = 0.0) -> int:
        """Closes every open connection now (RST); refuses new ones for ``refuse_s``.
        Returns how many connections were cut."""
        self.cuts += 1
        self._refuse_until = time.monotonic() + refuse_s
        n = 0
        for client_w, upstream_w, task in list(self._conns):
            n += 1
            for w in (client_w, upstream_w):
                transport = w.transport
                if transport is not None:
                    transport.abort()
            task.cancel()
        return n

    def restore(self) -> None:
        """Accepts connections again after a :meth:`cut` with a refusal period."""
        self._refuse_until = 0.0

    @property
    def refusing(self) -> bool:
        return time.monotonic() < self._refuse_until

    def counters(self) -> dict[str, object]:
        """What the link has carried so far, for status views."""
        return {
            "target": f"{self.target_host}:{self.target_port}", "address": self.address,
            "bandwidth_bytes_s": self.down.bandwidth, "latency_s": self.down.latency_s,
            "bytes_down": self.bytes_down, "bytes_up": self.bytes_up,
            "connections": self.connections, "open_connections": len(self._conns), "cuts": self.cuts, "cut_now": self.refusing,
            "corruptions_armed": sum(1 for r in self._corruption if r.armed),
            "corruptions_fired": sum(1 for r in self._corruption if r.fired),
        }

    def corrupt_once(self, pattern: bytes, after: int = 0) -> _Corruption:
        """Flips (XOR 0xFF) the byte ``after`` bytes past the end of the next occurrence of
        ``pattern`` in the server-to-client stream (empty ``pattern``: ``after`` bytes into
        the next bytes carried down); the returned rule's ``fired`` tells whether it happened."""
        rule = _Corruption(pattern, after)
        self._corruption.append(rule)
        return rule

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> LinkEmulator:
        self._server = await asyncio.start_server(self._handle, self.host, self.listen_port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        self.cut()
        tasks = [t for _, _, t in self._conns]
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)

    async def __aenter__(self) -> LinkEmulator:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------ connections

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        if time.monotonic() < self._refuse_until:
            client_w.transport.abort()
            return
        try:
            upstream_r, upstream_w = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError as exc:
            log.info("link emulator: target %s:%d unreachable (%s)", self.target_host, self.target_port, exc)
            client_w.transport.abort()
            return
        self.connections += 1
        task = asyncio.current_task()
        assert task is not None
        entry = (client_w, upstream_w, task)
        self._conns.add(entry)
        up = _Pump(client_r, upstream_w, self.up, [])
        down = _Pump(upstream_r, client_w, self.down, self._corruption)
        pumps = [asyncio.create_task(c) for c in (up.read_loop(), up.write_loop(), down.read_loop(), down.write_loop())]
        try:
            # Either side closing (or a cut) ends the connection as a whole.
            await asyncio.wait(pumps, return_when=asyncio.FIRST_EXCEPTION)
        except asyncio.CancelledError:
            pass
        finally:
            for p in pumps:
                p.cancel()
            for p in pumps:
                with contextlib.suppress(BaseException):
                    await p
            for w in (client_w, upstream_w):
                with contextlib.suppress(Exception):
                    w.transport.abort()
            self._conns.discard(entry)


# ---------------------------------------------------------------- as a process


@dataclasses.dataclass
class LinkConfig:
    """``meridian link``: the emulated link between two regions as its own process."""

    target: str = opt("", "address the link leads to (host:port), e.g. the origin weightsync")
    host: str = opt("127.0.0.1", "address the link listens on")
    port: int = opt(0, "port the link listens on (0: a free one)")
    mbit_s: float = opt(100.0, "bandwidth per direction, Mbit/s (0: unlimited)")
    latency_ms: float = opt(50.0, "one-way latency, ms")
    stats_file: str = opt("", "JSON file the link's counters are written to once a second (empty: none)")

    def __post_init__(self) -> None:
        if not self.target or ":" not in self.target:
            raise ValueError(f"link target must be host:port, got {self.target!r}")
        if self.mbit_s < 0 or self.latency_ms < 0:
            raise ValueError("mbit_s and latency_ms must be >= 0")


async def run_link(config: LinkConfig) -> None:
    """Serves the link until SIGTERM/SIGINT; SIGUSR1 cuts it, SIGUSR2 restores it."""
    link = LinkEmulator(config.target, config.mbit_s * 1e6 / 8, config.latency_ms / 1000, config.host, config.port)
    await link.start()
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    # A cut lasts until it is restored: a refusal period longer than any run.
    loop.add_signal_handler(signal.SIGUSR1, lambda: log.warning("link cut: %d connection(s) reset", link.cut(refuse_s=1e9)))
    loop.add_signal_handler(signal.SIGUSR2, link.restore)
    # SIGHUP: corrupt the next bytes carried down (a new version's chunks, the next time
    # one crosses). The link cannot find a chunk inside TLS (meridian up's services speak
    # mTLS), so it flips a byte of whatever comes: the TLS record's MAC catches it there
    # (the connection fails, the relay resumes the version); on a plaintext link the
    # chunk's checksum does (the relay fetches the chunk again; tests pick the chunk with
    # corrupt_once(CHUNK_MAGIC)).
    loop.add_signal_handler(signal.SIGHUP, lambda: link.corrupt_once(b"", after=SIGHUP_AFTER))
    # Announced once the controls are in place: a signal sent on seeing this line is handled.
    print(f"meridian link listening on {link.address}", flush=True)
    try:
        while not stopping.is_set():
            if config.stats_file:
                _write_stats(Path(config.stats_file), link.counters())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), 1.0)
    finally:
        await link.close()
        if config.stats_file:
            _write_stats(Path(config.stats_file), link.counters())


def _write_stats(path: Path, counters: dict[str, object]) -> None:
    # Written whole and renamed, so a reader never sees half a file.
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(counters))
    tmp.replace(path)


def read_stats(path: Path) -> dict[str, object] | None:
    """The counters a link process wrote last (None: none yet, or unreadable)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def main(argv: list[str]) -> int:
    """Entry point of ``meridian link``."""
    import argparse

    parser = argparse.ArgumentParser(prog="meridian link", description=LinkConfig.__doc__)
    add_config_args(parser, LinkConfig, "link")
    try:
        config = config_from_args(LinkConfig, parser.parse_args(argv), "link")
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s link %(levelname)s %(name)s: %(message)s")
    asyncio.run(run_link(config))
    return 0
