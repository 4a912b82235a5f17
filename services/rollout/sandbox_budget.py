"""How many envsandbox sandboxes this rollout's episodes hold at once.

envsandbox refuses a sandbox past its ``--max-sandboxes`` (RESOURCE_EXHAUSTED), and one
RunEpisodes within its own bounds (64 tasks of groups of 64) asks for far more than that
at once: without a budget the whole call failed. With one, groups wait their turn and a
large call runs in waves. A group takes ``group_size + 1`` (its base sandbox and the
forks) from its Create to its last Close. The budget is the configured one, or
envsandbox's own limit where that is lower (:meth:`SandboxBudget.limit_to`): a rollout
left at the default in front of a smaller envsandbox still keeps within it.

Waiters are served in order: a large group is not passed over for ever by small ones.
Pure asyncio; no gRPC.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator


class SandboxBudget:
    """A counting semaphore over sandboxes, acquired a group at a time, first come first served."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a sandbox budget must be at least 1, got {capacity}")
        self.configured = capacity
        self.capacity = capacity
        self.envsandbox_limit = 0  # 0: not known
        self.held = 0
        self._waiters: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    @property
    def waiting(self) -> int:
        """Groups waiting for their sandboxes."""
        return len(self._waiters)

    def limit_to(self, envsandbox_limit: int) -> None:
        """Keeps the budget within envsandbox's limit (0: not known, the configured budget
        stands). Lowered below what is held, nobody new gets sandboxes until enough come
        back; raised, the waiters that now fit go."""
        self.envsandbox_limit = envsandbox_limit
        self.capacity = min(self.configured, envsandbox_limit) if envsandbox_limit > 0 else self.configured
        self._grant()

    def problem(self, count: int) -> str:
        """Why a group of ``count`` sandboxes can never run under this budget ('' if it can)."""
        if count <= self.capacity:
            return ""
        which = f"envsandbox holds {self.capacity} sandboxes at most" if self.capacity < self.configured else f"this rollout's sandbox budget is {self.capacity}"
        return f"a group needs {count} sandboxes at once (group size + its base) but {which}"

    async def acquire(self, count: int) -> None:
        """Waits until ``count`` sandboxes fit, behind every earlier waiter."""
        if problem := self.problem(count):
            raise ValueError(problem)
        if not self._waiters and self.held + count <= self.capacity:
            self.held += count
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
        """Gives back ``count`` sandboxes and lets the waiters that now fit go, in order."""
        if count > self.held:
            raise ValueError(f"releasing {count} sandboxes but only {self.held} are held")
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

    @contextlib.asynccontextmanager
    async def hold(self, count: int) -> AsyncIterator[None]:
        """``count`` sandboxes for the duration of the block."""
        await self.acquire(count)
        try:
            yield
        finally:
            self.release(count)
