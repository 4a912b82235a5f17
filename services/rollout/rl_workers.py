"""Background RL episode workers: fill the engine's spare capacity with GRPO groups
(at lower priority than production requests) and back off while the trainer is behind
(stream backlog above a high-water mark) or while this rollout's policy lags the newest
published version by more than the bound."""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from meridian.errors import Unavailable

log = logging.getLogger(__name__)

BACKOFF_S = 1.0


class RLWorkers:
    """``count`` loops, each: check back-pressure, else run one group (which counts what
    it publishes in :attr:`published` as it lands)."""

    def __init__(self, count: int, run_group: Callable[[], Awaitable[None]], backpressure: Callable[[], Awaitable[str]]) -> None:
        self.count = count
        self._run_group = run_group
        self._backpressure = backpressure
        self._tasks: list[asyncio.Task[None]] = []
        self.state = "off" if count == 0 else "starting"
        #: trajectories of the workers' groups in the stream (counted as they land, which
        #: for a group held through an outage is later than its run)
        self.published = 0

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._loop(i)) for i in range(self.count)]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _loop(self, index: int) -> None:
        while True:
            try:
                reason = await self._backpressure()
                if reason:
                    self.state = f"backoff: {reason}"
                    await asyncio.sleep(BACKOFF_S)
                    continue
                self.state = "running"
                await self._run_group()
                # Yield every round, even when a group finished without awaiting anything,
                # so one worker can never monopolise the event loop the servers share.
                await asyncio.sleep(0)
            except asyncio.CancelledError:
                raise
            except Unavailable as exc:  # the group is held and published later (publish_outbox)
                log.warning("RL worker %d: %s", index, exc)
                self.state = "backoff: trajectory stream unavailable"
                await asyncio.sleep(BACKOFF_S)
            except Exception:  # noqa: BLE001 - a failed group must not end the worker
                log.exception("RL worker %d: group failed; retrying", index)
                self.state = "backoff: error"
                await asyncio.sleep(BACKOFF_S)
