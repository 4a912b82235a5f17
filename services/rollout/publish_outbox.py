"""Groups that could not be published yet: sampled trajectories survive a stream outage.

Sampling a group costs engine time and sandbox runs; a Redis that is restarting must not
throw that away. A group whose publish fails with ``Unavailable`` is held here, in order,
and published before anything newer once the stream answers again (a retry loop, and
every later publish, try first). Publishing is at-least-once: a group whose XADD landed
but whose reply was lost is sent again, and the trainer drops the second delivery by its
group id.

What bounds the outbox: while it holds groups, callers are told to wait (RunEpisodes
answers UNAVAILABLE before sampling anything, the RL workers back off), so it only grows
by the groups already being sampled when the stream went away. Held groups live in this
process: a rollout killed during an outage loses them, and says how many when stopped.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence

from meridian.errors import Unavailable
from meridian.v1 import common_pb2

log = logging.getLogger(__name__)

Group = list[common_pb2.Trajectory]
Landed = Callable[[Group], None]


class PublishOutbox:
    """Publishes groups through ``send`` in order, holding those the stream refused."""

    def __init__(self, send: Callable[[Group], Awaitable[None]], retry_s: float = 1.0) -> None:
        self._send = send
        self._retry_s = retry_s
        self._held: collections.deque[tuple[Group, Landed | None]] = collections.deque()
        # One publisher at a time, so held groups leave in the order they came.
        self._lock = asyncio.Lock()
        self._retrier: asyncio.Task[None] | None = None
        self.published = 0

    @property
    def held(self) -> int:
        """Groups waiting for the stream."""
        return len(self._held)

    def held_ids(self) -> list[str]:
        """The group ids waiting, oldest first."""
        return [g[0].group_id for g, _ in self._held if g]

    async def publish(self, groups: Sequence[Group], landed: Landed | None = None) -> None:
        """Publishes ``groups`` after every held one, calling ``landed`` with each once it is
        in the stream (now, or after an outage). When the stream is unavailable, this group
        and the rest are held and ``Unavailable`` says how many wait; any other error is
        the group's own (it is not held: retrying would fail the same way)."""
        async with self._lock:
            self._held.extend((list(g), landed) for g in groups if g)
            await self._drain()

    async def flush(self) -> None:
        """Publishes the held groups; raises ``Unavailable`` while the stream is down."""
        async with self._lock:
            await self._drain()

    async def _drain(self) -> None:
        while self._held:
            group, landed = self._held[0]
            try:
                await self._send(group)
            except Unavailable as exc:
                raise Unavailable(f"{exc}; {len(self._held)} sampled groups are held and will be published when it answers") from exc
            except Exception:
                self._held.popleft()
                raise
            self._held.popleft()
            self.published += 1
            if landed is not None:
                landed(group)

    def start(self) -> None:
        """Starts the loop that retries held groups every ``retry_s``."""
        self._retrier = asyncio.create_task(self._retry_loop())

    async def _retry_loop(self) -> None:
        while True:
            await asyncio.sleep(self._retry_s)
            if not self._held:
                continue
            try:
                await self.flush()
                log.info("published the groups held during the stream outage")
            except Unavailable:
                continue
            except Exception:  # noqa: BLE001 - a bad group must not end the retries of the others
                log.exception("a held group could not be published; dropped")

    async def stop(self) -> None:
        """Stops retrying after one last try; logs the groups that are lost with us."""
        if self._retrier is not None:
            self._retrier.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._retrier
        if not self._held:
            return
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.flush(), timeout=self._retry_s)
        if self._held:
            log.error("stopping with %d sampled groups never published (stream unavailable): %s", self.held, ", ".join(self.held_ids()))
