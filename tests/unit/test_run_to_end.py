"""meridian.run_to_end on its own: what envsandbox's teardowns and weightsync's announce
steps rely on when the call waiting on them is cancelled."""
from __future__ import annotations

import asyncio
import logging

import pytest

from meridian.run_to_end import RunToEnd


def test_a_step_runs_to_its_end_after_its_caller_is_cancelled_and_wait_waits_for_it() -> None:
    """A client that leaves (a deadline, a dropped connection) cancels the handler at
    once; the teardown it started must still finish, and shutdown's wait() must see it
    finish, or processes and mounts stay behind while the count says they are free."""
    async def main() -> None:
        steps = RunToEnd("teardown", logging.getLogger(__name__))
        release = asyncio.Event()
        finished: list[str] = []
        seen: list[asyncio.Future[str]] = []

        async def teardown() -> str:
            await release.wait()
            finished.append("teardown")
            return "closed"

        caller = asyncio.create_task(steps.run(teardown(), started=seen.append))
        await asyncio.sleep(0)
        assert len(seen) == 1 and not seen[0].done()  # handed over before the caller waits
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller  # the caller is released at once, the step still waiting
        assert finished == [] and not seen[0].cancelled()
        waiting = asyncio.create_task(steps.wait())
        await asyncio.sleep(0)
        assert not waiting.done()  # the step has not ended
        release.set()
        await asyncio.wait_for(waiting, 10)
        assert finished == ["teardown"] and seen[0].result() == "closed"

    asyncio.run(main())


def test_a_caller_gets_the_steps_result_or_error_and_wait_raises_none() -> None:
    async def main() -> None:
        steps = RunToEnd("announce", logging.getLogger(__name__))

        async def ok() -> int:
            return 7

        async def broken() -> int:
            raise OSError("disk full")

        assert await steps.run(ok()) == 7
        with pytest.raises(OSError, match="disk full"):
            await steps.run(broken())

        # A step that fails after its caller left: its error is nobody's to raise, not
        # shutdown's (wait() must return, so the service still stops in order).
        release = asyncio.Event()

        async def fails_later() -> int:
            await release.wait()
            raise OSError("unmount failed")

        caller = asyncio.create_task(steps.run(fails_later()))
        await asyncio.sleep(0)
        caller.cancel()
        waiting = asyncio.create_task(steps.wait())
        release.set()
        await asyncio.wait_for(waiting, 10)

    asyncio.run(main())
