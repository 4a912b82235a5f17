"""A counting semaphore whose callers take several slots at once, served in order.

asyncio.Semaphore takes one at a time and lets a small request pass a large one that
waits, so a caller wanting many slots can wait for ever behind a stream of small ones.
Here a request waits behind every earlier one, and cancelling a wait (a timeout, a
caller gone) gives back whatever it was granted. Pure asyncio: the rollout's sandbox
budget and envsandbox's live-sandbox limit both count with it.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib


class FifoSlots:
    """``capacity`` slots, taken ``count`` at a time, first come first served."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.held = 0
        self._waiters: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    @property
    def waiting(self) -> int:
        """Requests waiting for their slots."""
        return len(self._waiters)

    def set_capacity(self, capacity: int) -> None:
        """Changes the capacity. Lowered below what is held, nobody new gets slots until
        enough come back; raised, the waiters that now fit go."""
        self.capacity = capacity
        self._grant()

    def try_acquire(self, count: int) -> bool:
        """Takes ``count`` slots if they fit now and nobody waits ahead; False otherwise."""
        if self._waiters or self.held + count > self.capacity:
            return False
        self.held += count
        return True

    async def acquire(self, count: int) -> None:
        """Waits until ``count`` slots fit, behind every earlier waiter. A request larger
        than the capacity waits until the capacity grows."""
        if self.try_acquire(count):
            return
        entry = (count, asyncio.get_running_loop().create_future())
        self._waiters.append(entry)
        try:
            await entry[1]
        except asyncio.CancelledError:
            if entry[1].done() and not entry[1].cancelled():
                self.release(count)  # granted as the caller went away: hand them on
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(entry)
                self._grant()  # the head may have left: those behind it may fit now
            raise

    def release(self, count: int) -> None:
        """Gives back ``count`` slots and lets the waiters that now fit go, in order."""
        if count > self.held:
            raise ValueError(f"releasing {count} slots but only {self.held} are held")
        self.held -= count
        self._grant()

    def _grant(self) -> None:
        while self._waiters:
            count, future = self._waiters[0]
            if future.done():  # cancelled while queued; its owner removes nothing then
                self._waiters.popleft()
                continue
            if self.held + count > self.capacity:
                return
            self._waiters.popleft()
            self.held += count
            future.set_result(None)
