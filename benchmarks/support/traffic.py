"""Production traffic for the rollout benchmark: a reproducible arrival trace (a Poisson
process with bursts, prompts and lengths from a fixed mixed distribution) and the
figures computed from replaying it (latency percentiles, the time production left the
engine idle)."""
from __future__ import annotations

import dataclasses
import random

#: Completion lengths of production requests and their weights: mostly short answers, a
#: tail of longer ones.
LENGTHS = ((8, 0.4), (16, 0.3), (32, 0.2), (64, 0.1))


@dataclasses.dataclass(frozen=True)
class TrafficConfig:
    """``requests`` arrivals: Poisson at ``rate_per_s``, and every ``burst_every_s`` a
    burst of ``burst_size`` more within ``burst_spread_s``."""

    requests: int = 300
    rate_per_s: float = 2.0
    burst_every_s: float = 15.0
    burst_size: int = 6
    burst_spread_s: float = 0.2
    seed: int = 0

    def __post_init__(self) -> None:
        if self.requests <= 0 or self.rate_per_s <= 0 or self.burst_every_s <= 0 or self.burst_size < 0 or self.burst_spread_s < 0:
            raise ValueError("requests, rate_per_s and burst_every_s must be positive; burst_size and burst_spread_s >= 0")


@dataclasses.dataclass(frozen=True)
class Arrival:
    at_s: float  # seconds after the phase starts
    prompt: int  # index into the benchmark's prompts
    max_tokens: int


def production_trace(config: TrafficConfig, prompts: int) -> list[Arrival]:
    """The arrivals, sorted by time; the same config gives the same trace."""
    rng = random.Random(config.seed)
    lengths, weights = zip(*LENGTHS)
    times: list[float] = []
    t = 0.0
    next_burst = config.burst_every_s
    while len(times) < config.requests:
        t += rng.expovariate(config.rate_per_s)
        while next_burst <= t and len(times) < config.requests:
            times.extend(next_burst + rng.uniform(0, config.burst_spread_s) for _ in range(config.burst_size))
            next_burst += config.burst_every_s
        times.append(t)
    times = sorted(times)[: config.requests]
    return [Arrival(at, rng.randrange(prompts), rng.choices(lengths, weights)[0]) for at in times]


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (nearest rank) of ``values``."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end] intervals: the time at least one production
    request was in flight."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total
