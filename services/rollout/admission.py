"""Who runs on the engine: production requests always; RL requests up to a limit that
an SLO-driven controller sets while production is in flight.

The fleet that serves production also samples RL episodes in its spare capacity, so
production latency is the constraint and the RL concurrency the control variable:

- while production has been quiet for ``quiet_s``, RL may run up to ``max_rl`` requests;
- while production is in flight (or ended less than ``quiet_s`` ago), RL may run up to
  the :class:`AimdController`'s limit, which grows by ``increase`` after every window in
  which every production request met its time-to-first-token and inter-token targets,
  and is multiplied by ``decrease`` at the first miss (at most once per window, as a
  congestion window is once per round trip);
- a production arrival, or a decrease, that leaves more RL requests running than the
  limit preempts the newest of them at once: the engine aborts them at a token boundary
  and resumes them later from their prefix (:mod:`services.rollout.engine`).

Pure asyncio and a clock: no engine here, so the policy is unit-tested with simulated
latencies.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
from collections.abc import AsyncIterator, Callable


@dataclasses.dataclass(frozen=True)
class AdmissionConfig:
    """Production's latency targets and the RL concurrency bounds (see the module doc)."""

    ttft_s: float = 1.0
    itl_s: float = 0.1
    window_s: float = 1.0
    max_rl: int = 16
    increase: int = 1
    decrease: float = 0.5
    quiet_s: float = 0.2
    preempt: bool = True

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.itl_s <= 0 or self.window_s <= 0:
            raise ValueError("SLO targets and the control window must be positive")
        if self.max_rl < 0 or self.increase < 1 or not 0 <= self.decrease < 1 or self.quiet_s < 0:
            raise ValueError("max_rl >= 0, increase >= 1, 0 <= decrease < 1 and quiet_s >= 0")


class AimdController:
    """RL concurrency allowed beside production: additive increase while production
    meets its targets, multiplicative decrease when it does not."""

    def __init__(self, config: AdmissionConfig, now: float, initial: int = 0) -> None:
        self.config = config
        self.limit = min(initial, config.max_rl)
        self._window_start = now
        self._window_seen = 0
        self._window_missed = 0
        self._last_decrease = -math.inf
        self.observed = 0
        self.met = 0
        self.increases = 0
        self.decreases = 0

    @property
    def attainment(self) -> float:
        """Fraction of production latency observations that met their target (1.0 before any)."""
        return self.met / self.observed if self.observed else 1.0

    def observe(self, now: float, ttft_s: float | None = None, itl_s: float | None = None) -> bool:
        """Records one production latency (a first token's wait, or the time per token
        of a later delta); returns whether the limit fell."""
        met = (ttft_s is None or ttft_s <= self.config.ttft_s) and (itl_s is None or itl_s <= self.config.itl_s)
        self.observed += 1
        self.met += int(met)
        self.tick(now)
        self._window_seen += 1
        if met:
            return False
        self._window_missed += 1
        if now - self._last_decrease < self.config.window_s:
            return False  # one decrease per window: its effect shows only in later latencies
        self._last_decrease = now
        self.decreases += 1
        self.limit = math.floor(self.limit * self.config.decrease)
        self._restart_window(now)
        return True

    def tick(self, now: float) -> None:
        """Closes the windows that ended by ``now``: a window that saw production and no
        miss raises the limit (a window without production tells nothing)."""
        if now - self._window_start < self.config.window_s:
            return
        if self._window_seen and not self._window_missed and self.limit < self.config.max_rl:
            self.limit = min(self.config.max_rl, self.limit + self.config.increase)
            self.increases += 1
        self._restart_window(now)

    def _restart_window(self, now: float) -> None:
        self._window_start = now
        self._window_seen = 0
        self._window_missed = 0


class RlTicket:
    """One admitted RL request (one segment of it, between preemptions)."""

    def __init__(self, number: int) -> None:
        self.number = number
        self.preempted = False
        self._on_preempt: Callable[[], None] | None = None

    def on_preempt(self, callback: Callable[[], None]) -> None:
        """``callback`` runs when this ticket is preempted (at once if it already was)."""
        self._on_preempt = callback
        if self.preempted:
            callback()

    def _preempt(self) -> None:
        self.preempted = True
        if self._on_preempt is not None:
            self._on_preempt()


class ProductionLatency:
    """Reports one production request's latencies to the controller."""

    def __init__(self, scheduler: RlScheduler) -> None:
        self._scheduler = scheduler
        self._start = scheduler.clock()
        self._last: float | None = None

    def tokens(self, count: int) -> None:
        """``count`` tokens just arrived: the first delta measures time to first token,
        later ones the time per token since the previous delta."""
        if count <= 0:
            return
        now = self._scheduler.clock()
        if self._last is None:
            self._scheduler.observe(now, ttft_s=now - self._start)
        else:
            self._scheduler.observe(now, itl_s=(now - self._last) / count)
        self._last = now


class RlScheduler:
    """Admission of RL requests beside production on one engine (see the module doc)."""

    def __init__(self, config: AdmissionConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.controller = AimdController(config, clock())
        self.production_active = 0
        self._production_end = -math.inf
        self._running: dict[int, RlTicket] = {}
        self._admitted = 0
        self.preemptions = 0
        self._changed = asyncio.Event()

    # ------------------------------------------------------------ state

    @property
    def rl_running(self) -> int:
        return len(self._running)

    def production_quiet(self, now: float) -> bool:
        return self.production_active == 0 and now - self._production_end >= self.config.quiet_s

    def allowed(self, now: float) -> int:
        """RL requests that may run now."""
        self.controller.tick(now)
        return self.config.max_rl if self.production_quiet(now) else self.controller.limit

    # ------------------------------------------------------------ production

    @contextlib.asynccontextmanager
    async def production(self) -> AsyncIterator[ProductionLatency]:
        """Around one production request: RL above the limit is preempted as it arrives."""
        self.production_active += 1
        self._enforce()
        try:
            yield ProductionLatency(self)
        finally:
            self.production_active -= 1
            self._production_end = self.clock()
            self._wake()

    def observe(self, now: float, ttft_s: float | None = None, itl_s: float | None = None) -> None:
        limit = self.controller.limit
        if self.controller.observe(now, ttft_s=ttft_s, itl_s=itl_s):
            self._enforce()
        elif self.controller.limit > limit:
            self._wake()

    # ------------------------------------------------------------ RL

    async def admit_rl(self) -> RlTicket:
        """Waits for an RL slot; the caller must :meth:`release` the ticket."""
        while True:
            now = self.clock()
            if self.rl_running < self.allowed(now):
                self._admitted += 1
                ticket = RlTicket(self._admitted)
                self._running[ticket.number] = ticket
                return ticket
            self._changed.clear()
            # Woken by a release, a production end or a raised limit; the timeout covers
            # the quiet period running out and windows closing with no event at all.
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for drops a cancellation
            # that arrives in the turn the event is set, and the cancelled caller is admitted.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._next_check(now)):
                    await self._changed.wait()

    def _next_check(self, now: float) -> float:
        if self.production_active == 0:
            quiet_left = self._production_end + self.config.quiet_s - now
            if quiet_left > 0:
                return min(quiet_left, self.config.window_s)
        return self.config.window_s

    def release(self, ticket: RlTicket) -> None:
        """The RL request ended (finished, failed or preempted)."""
        if self._running.pop(ticket.number, None) is not None:
            self._wake()

    def _enforce(self) -> None:
        """Preempts the newest RL requests above the limit."""
        if not self.config.preempt:
            return
        excess = self.rl_running - self.allowed(self.clock())
        for number in sorted(self._running, reverse=True)[: max(0, excess)]:
            ticket = self._running.pop(number)
            self.preemptions += 1
            ticket._preempt()

    def _wake(self) -> None:
        self._changed.set()
