"""The rollout's sandbox budget: groups take their sandboxes in the order they asked, a
waiter that goes away gives up its place (or what it was just granted), and a group that
could never fit is refused at once."""
from __future__ import annotations

import asyncio

import pytest

from services.rollout.sandbox_budget import SandboxBudget


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_groups_get_their_sandboxes_first_come_first_served() -> None:
    async def scenario() -> list[str]:
        budget = SandboxBudget(6)
        order: list[str] = []

        async def group(name: str, count: int) -> None:
            async with budget.hold(count):
                order.append(name)
                await asyncio.sleep(0.01)

        await budget.acquire(5)
        # The big group asked first: the small ones behind it wait though one would fit now.
        waiting = [asyncio.create_task(group("big", 6)), asyncio.create_task(group("small-1", 1)), asyncio.create_task(group("small-2", 1))]
        await _settle()
        assert (budget.held, budget.waiting, order) == (5, 3, [])
        budget.release(5)
        await asyncio.gather(*waiting)
        assert (budget.held, budget.waiting) == (0, 0)
        return order

    assert asyncio.run(scenario()) == ["big", "small-1", "small-2"]


def test_a_waiter_that_goes_away_lets_those_behind_it_go() -> None:
    async def scenario() -> None:
        budget = SandboxBudget(4)
        await budget.acquire(3)
        blocked = asyncio.create_task(budget.acquire(4))
        behind = asyncio.create_task(budget.acquire(1))
        await _settle()
        assert budget.waiting == 2 and not behind.done()
        blocked.cancel()
        await asyncio.wait_for(behind, 1)  # it fits beside the 3 once the head left
        assert (budget.held, budget.waiting) == (4, 0)

    asyncio.run(scenario())


def test_sandboxes_granted_to_a_waiter_as_it_goes_away_are_handed_on() -> None:
    async def scenario() -> None:
        budget = SandboxBudget(2)
        await budget.acquire(2)
        first = asyncio.create_task(budget.acquire(2))
        second = asyncio.create_task(budget.acquire(2))
        await _settle()
        budget.release(2)  # granted to the first waiter, which is cancelled before it runs
        first.cancel()
        await asyncio.wait_for(second, 1)
        with pytest.raises(asyncio.CancelledError):
            await first
        assert (budget.held, budget.waiting) == (2, 0)

    asyncio.run(scenario())


def test_a_group_larger_than_the_budget_is_refused_and_bad_releases_are_errors() -> None:
    budget = SandboxBudget(4)
    assert budget.problem(4) == "" and "budget is 4" in budget.problem(5)
    with pytest.raises(ValueError, match="needs 5 sandboxes"):
        asyncio.run(budget.acquire(5))
    with pytest.raises(ValueError, match="only 0 are held"):
        budget.release(1)
    with pytest.raises(ValueError, match="at least 1"):
        SandboxBudget(0)


def test_envsandboxs_lower_limit_is_the_budget_and_a_raised_one_lets_waiters_go() -> None:
    async def main() -> None:
        budget = SandboxBudget(8)
        budget.limit_to(4)
        assert budget.capacity == 4 and "envsandbox holds 4 sandboxes at most" in budget.problem(5)
        await budget.acquire(3)
        waiter = asyncio.ensure_future(budget.acquire(3))
        await asyncio.sleep(0)
        assert not waiter.done() and budget.waiting == 1
        budget.limit_to(16)  # envsandbox restarted larger: the configured 8 is the budget again
        await asyncio.wait_for(waiter, 1)
        assert (budget.capacity, budget.held, budget.problem(8)) == (8, 6, "")
        budget.limit_to(2)  # lowered below what is held: nobody new until enough come back
        late = asyncio.ensure_future(budget.acquire(1))
        await asyncio.sleep(0)
        budget.release(3)
        await asyncio.sleep(0)
        assert not late.done()
        budget.release(3)
        await asyncio.wait_for(late, 1)
        budget.limit_to(0)  # a server too old to say: the configured budget stands
        assert budget.capacity == 8 and "this rollout's sandbox budget is 8" in budget.problem(9)

    asyncio.run(main())
