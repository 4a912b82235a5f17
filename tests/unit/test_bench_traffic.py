"""The rollout benchmark's production trace and its figures, against hand values."""
from __future__ import annotations

import pytest

from benchmarks.support.traffic import TrafficConfig, busy_seconds, percentile, production_trace


def test_trace_is_reproducible_poisson_with_bursts() -> None:
    config = TrafficConfig(requests=3000, rate_per_s=4.0, burst_every_s=10.0, burst_size=5, burst_spread_s=0.1, seed=1)
    trace = production_trace(config, prompts=8)
    assert trace == production_trace(config, prompts=8) and len(trace) == 3000
    times = [a.at_s for a in trace]
    assert times == sorted(times)
    span = times[-1]
    bursts = int(span // 10.0)
    # Poisson arrivals at 4/s plus 5 per burst: the count over the span matches.
    assert len(trace) == pytest.approx(4.0 * span + 5 * bursts, rel=0.05)
    # Each burst lands within its spread: 10.0 .. 10.1 s holds at least its 5 arrivals.
    assert sum(1 for t in times if 10.0 <= t <= 10.1) >= 5
    lengths = [a.max_tokens for a in trace]
    assert lengths.count(8) / len(lengths) == pytest.approx(0.4, abs=0.03)
    assert {a.prompt for a in trace} == set(range(8))


def test_busy_time_is_the_union_of_request_intervals() -> None:
    assert busy_seconds([(0, 1), (0.5, 2), (3, 4), (3.2, 3.5)]) == pytest.approx(3.0)
    assert busy_seconds([]) == 0.0


def test_percentile_nearest_rank() -> None:
    values = list(range(1, 301))
    assert percentile(values, 0.99) == 297 and percentile(values, 0.5) == 151
