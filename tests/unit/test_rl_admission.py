"""The RL admission policy against a simulated clock and simulated production latencies."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import pytest

from services.rollout.admission import AdmissionConfig, AimdController, RlScheduler


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


CONFIG = AdmissionConfig(ttft_s=0.5, itl_s=0.05, window_s=1.0, max_rl=8, increase=1, decrease=0.5, quiet_s=0.2)


def test_additive_increase_while_targets_are_met_and_fast_decrease_on_a_miss() -> None:
    c = AimdController(CONFIG, now=0.0)
    t = 0.0
    for _ in range(6):  # six windows of production within its targets
        for _ in range(5):
            t += 0.2
            c.observe(t, itl_s=0.02)
    assert c.limit == 5 and c.increases == 5
    # A miss halves the limit at once, a second miss in the same window does not.
    assert c.observe(t + 0.1, itl_s=0.2) and c.limit == 2
    assert not c.observe(t + 0.2, ttft_s=0.9) and c.limit == 2
    # The next window saw a miss (none after the decrease yet): a window later, still no increase.
    c.tick(t + 1.15)
    assert c.limit == 2
    c.observe(t + 1.5, itl_s=0.01)
    c.tick(t + 2.2)
    assert c.limit == 3
    assert c.attainment == pytest.approx((30 + 1) / 33)


def test_a_window_without_production_tells_nothing() -> None:
    c = AimdController(CONFIG, now=0.0, initial=2)
    c.tick(5.0)
    assert c.limit == 2 and c.increases == 0


def test_simulated_latency_converges_below_the_rl_concurrency_that_breaks_the_slo() -> None:
    """Production's time per token grows with the RL requests beside it (10 ms + 12 ms
    each, so the 50 ms target holds up to 3): the limit oscillates around 3 and the
    targets are met most of the time."""
    c = AimdController(AdmissionConfig(itl_s=0.05, window_s=1.0, max_rl=16), now=0.0)
    limits = []
    for step in range(1, 601):
        now = step * 0.1
        c.observe(now, itl_s=0.010 + 0.012 * c.limit)
        limits.append(c.limit)
    tail = limits[200:]
    assert max(tail) <= 4 and min(tail) >= 1
    assert c.attainment > 0.9


def test_production_arrival_preempts_the_newest_rl_requests_above_the_limit() -> None:
    async def body() -> None:
        clock = Clock()
        s = RlScheduler(CONFIG, clock)
        tickets = [await s.admit_rl() for _ in range(3)]  # production quiet: up to max_rl
        aborted: list[int] = []
        for t in tickets:
            t.on_preempt(lambda n=t.number: aborted.append(n))
        s.controller.limit = 1
        async with s.production() as latency:
            assert aborted == [3, 2] and s.preemptions == 2 and s.rl_running == 1
            assert [t.preempted for t in tickets] == [False, True, True]
            latency.tokens(1)
            # A new RL request waits while production runs at the limit.
            waiting = asyncio.create_task(s.admit_rl())
            await asyncio.sleep(0)
            assert not waiting.done()
            s.release(tickets[2])  # a preempted ticket's release frees nothing more
            await asyncio.sleep(0)
            assert not waiting.done()
        # Production ended: RL returns to max_rl only after the quiet period.
        clock.now += 0.1
        await asyncio.sleep(0)
        assert not waiting.done()
        clock.now += 0.2
        ticket = await asyncio.wait_for(waiting, timeout=5)
        assert s.rl_running == 2 and ticket.number == 4

    asyncio.run(body())


def test_a_latency_miss_preempts_down_to_the_lowered_limit() -> None:
    async def body() -> None:
        clock = Clock()
        s = RlScheduler(CONFIG, clock)
        s.controller.limit = 4
        tickets = [await s.admit_rl() for _ in range(4)]
        async with s.production() as latency:
            assert s.preemptions == 0
            clock.now += 0.01
            latency.tokens(1)
            clock.now += 0.5
            latency.tokens(2)  # 250 ms per token: a miss, the limit halves
            assert s.controller.limit == 2 and s.preemptions == 2
            assert [t.preempted for t in tickets] == [False, False, True, True]

    asyncio.run(body())


def test_preemption_off_only_stops_admissions() -> None:
    async def body() -> None:
        s = RlScheduler(AdmissionConfig(preempt=False, max_rl=4), Clock())
        tickets = [await s.admit_rl() for _ in range(2)]
        async with s.production():
            assert s.preemptions == 0 and not any(t.preempted for t in tickets)

    asyncio.run(body())


def test_a_ticket_preempted_before_its_callback_is_set_calls_it_at_once() -> None:
    async def body() -> None:
        s = RlScheduler(CONFIG, Clock())
        ticket = await s.admit_rl()
        async with s.production():
            called: list[bool] = []
            ticket.on_preempt(lambda: called.append(True))
            assert called == [True]

    asyncio.run(body())


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="decrease"):
        AdmissionConfig(decrease=1.5)
    with pytest.raises(ValueError, match="positive"):
        AdmissionConfig(itl_s=0)


async def _settle() -> None:
    """Lets every ready task run until none is (a woken admit_rl needs a few turns)."""
    for _ in range(50):
        await asyncio.sleep(0)


# A control window of an hour: an RL request waiting for a slot is admitted only when
# something wakes it, never by its periodic re-check within a test.
PATIENT = AdmissionConfig(ttft_s=0.5, itl_s=0.05, window_s=3600.0, max_rl=4, quiet_s=0.2)


def test_rl_waits_out_the_quiet_period_after_production_ends() -> None:
    """Production just ended: RL stays at the controller's limit until ``quiet_s`` has
    passed (a burst often has a next request), then may use every slot."""

    async def body() -> None:
        clock = Clock()
        s = RlScheduler(CONFIG, clock)
        s.controller.limit = 1
        async with s.production():
            first = await s.admit_rl()
        waiting = asyncio.create_task(s.admit_rl())
        await _settle()
        assert not waiting.done() and s.allowed(clock.now) == 1, "admitted before the quiet period ran out"
        clock.now += 0.25
        assert s.allowed(clock.now) == CONFIG.max_rl
        await asyncio.wait_for(waiting, 30)
        s.release(first)

    asyncio.run(body())


@pytest.mark.parametrize("event", ["release", "raised limit", "production end"])
def test_a_waiting_rl_request_is_woken_by_what_frees_a_slot(event: str) -> None:
    """An RL request waiting for a slot is admitted as soon as one frees: a release, a
    raised limit, production going quiet -- not at its next periodic check."""

    async def body() -> None:
        clock = Clock()
        # Without a quiet period, production's end frees every slot at once.
        s = RlScheduler(dataclasses.replace(PATIENT, quiet_s=0.0) if event == "production end" else PATIENT, clock)
        s.controller.limit = 1
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(s.production())
            held = await s.admit_rl()
            waiting = asyncio.create_task(s.admit_rl())
            await _settle()
            assert not waiting.done()
            if event == "release":
                s.release(held)
            elif event == "raised limit":
                s.observe(clock.now, itl_s=0.01)  # within its targets
                clock.now += PATIENT.window_s
                s.observe(clock.now, itl_s=0.01)  # closes a window that met them: the limit grows
                assert s.controller.limit == 2
            else:
                await stack.aclose()
            await asyncio.wait_for(waiting, 30)

    asyncio.run(body())


def test_an_rl_request_cancelled_as_a_slot_frees_is_cancelled_and_holds_no_slot() -> None:
    """The caller of a waiting admit_rl is cancelled (its client went away, the service
    stops) in the same turn as a release wakes it. The cancellation must win: on Python
    3.11 ``asyncio.wait_for`` returned the woken wait instead, so the cancelled request
    was admitted and ran on, holding a slot for no one."""

    async def body() -> None:
        s = RlScheduler(PATIENT, Clock())
        s.controller.limit = 1
        async with s.production():
            held = await s.admit_rl()
            waiting = asyncio.create_task(s.admit_rl())
            await _settle()
            s.release(held)
            waiting.cancel()
            await asyncio.wait({waiting}, timeout=30)
            assert waiting.cancelled(), "the cancelled request was admitted"
            assert s.rl_running == 0

    asyncio.run(body())


def test_the_limit_stays_within_max_rl_and_a_latency_at_its_target_meets_it() -> None:
    """However long production meets its targets the limit never passes ``max_rl`` (nor
    starts above it); a latency exactly at its target is met, not missed."""
    assert AimdController(CONFIG, now=0.0, initial=100).limit == CONFIG.max_rl
    c = AimdController(dataclasses.replace(CONFIG, increase=3), now=0.0)
    for step in range(1, 201):  # 20 windows, each within the targets
        c.observe(step * 0.1, itl_s=CONFIG.itl_s, ttft_s=CONFIG.ttft_s)
    assert c.limit == CONFIG.max_rl and c.increases == 3, "0, 3, 6, then 8 (not 9), then no more increases"
    assert c.decreases == 0 and c.attainment == 1.0


def test_production_latency_is_per_token_and_an_empty_delta_is_not_a_latency() -> None:
    """A delta of several tokens is measured per token (four tokens in 0.16 s meet a
    50 ms target); a delta with no tokens records nothing (and later divides by nothing)."""

    async def body() -> None:
        clock = Clock()
        s = RlScheduler(CONFIG, clock)
        async with s.production() as latency:
            latency.tokens(1)  # the first token: time to first token, 0 s
            clock.now += 0.16
            latency.tokens(0)
            latency.tokens(4)
        assert (s.controller.observed, s.controller.met) == (2, 2)

    asyncio.run(body())


def test_an_increase_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="increase >= 1"):
        AdmissionConfig(increase=0)
