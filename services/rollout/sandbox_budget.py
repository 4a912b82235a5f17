"""How many envsandbox sandboxes this rollout's episodes hold at once.

envsandbox refuses a sandbox past its ``--max-sandboxes`` (RESOURCE_EXHAUSTED), and one
RunEpisodes within its own bounds (64 tasks of groups of 64) asks for far more than that
at once: without a budget the whole call failed. With one, groups wait their turn and a
large call runs in waves. A group takes ``group_size + 1`` (its base sandbox and the
forks) from its Create to its last Close. The budget is the configured one, or
envsandbox's own limit where that is lower (:meth:`SandboxBudget.limit_to`): a rollout
left at the default in front of a smaller envsandbox still keeps within it. The budget
bounds this rollout alone: rollouts sharing an envsandbox meet in envsandbox's own line
(see ``run_group``'s ``sandbox_wait_s``).

Waiters are served in order: a large group is not passed over for ever by small ones.
Pure asyncio; no gRPC.
"""
from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from meridian.fifo_slots import FifoSlots


class SandboxBudget(FifoSlots):
    """The rollout's sandboxes as slots (:class:`~meridian.fifo_slots.FifoSlots`),
    acquired a group at a time, first come first served."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a sandbox budget must be at least 1, got {capacity}")
        super().__init__(capacity)
        self.configured = capacity
        self.envsandbox_limit = 0  # 0: not known

    def limit_to(self, envsandbox_limit: int) -> None:
        """Keeps the budget within envsandbox's limit (0: not known, the configured budget
        stands). Lowered below what is held, nobody new gets sandboxes until enough come
        back; raised, the waiters that now fit go."""
        self.envsandbox_limit = envsandbox_limit
        self.set_capacity(min(self.configured, envsandbox_limit) if envsandbox_limit > 0 else self.configured)

    def problem(self, count: int) -> str:
        """Why a group of ``count`` sandboxes can never run under this budget ('' if it can)."""
        if count <= self.capacity:
            return ""
        which = f"envsandbox holds {self.capacity} sandboxes at most" if self.capacity < self.configured else f"this rollout's sandbox budget is {self.capacity}"
        return f"a group needs {count} sandboxes at once (group size + its base) but {which}"

    async def acquire(self, count: int) -> None:
        """Waits until ``count`` sandboxes fit, behind every earlier waiter; a group that
        could never fit is refused (ValueError) instead of waiting for ever."""
        if problem := self.problem(count):
            raise ValueError(problem)
        await super().acquire(count)

    @contextlib.asynccontextmanager
    async def hold(self, count: int) -> AsyncIterator[None]:
        """``count`` sandboxes for the duration of the block."""
        await self.acquire(count)
        try:
            yield
        finally:
            self.release(count)
