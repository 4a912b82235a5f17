"""meridian.fifo_slots on its own; its order, hand-on and capacity changes are also
exercised through envsandbox's live-sandbox limit (test_envsandbox_slots) and the
rollout's sandbox budget (test_sandbox_budget)."""
from __future__ import annotations

import asyncio

import pytest

from meridian.fifo_slots import FifoSlots


def test_a_release_right_after_the_head_waiter_is_cancelled_goes_to_the_next() -> None:
    """Cancelling a waiting task cancels its future at once, but the task cleans up only
    when it next runs: a release in between (in the same step of the loop: a timeout and
    a finished sandbox together) must pass over the cancelled head, not fail in the
    releaser's hands and lose the slot."""
    async def main() -> None:
        slots = FifoSlots(1)
        assert slots.try_acquire(1)
        first = asyncio.create_task(slots.acquire(1))
        await asyncio.sleep(0)  # queued
        second = asyncio.create_task(slots.acquire(1))
        await asyncio.sleep(0)
        assert slots.waiting == 2
        first.cancel()
        slots.release(1)
        await asyncio.wait_for(second, 10)
        with pytest.raises(asyncio.CancelledError):
            await first
        assert slots.held == 1 and slots.waiting == 0
        slots.release(1)
        assert slots.held == 0

    asyncio.run(main())
