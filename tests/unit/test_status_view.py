"""``meridian status --watch`` (meridian/status_view.py): one frame from a status dict,
rates from two scrapes, in-place redraws, and the watch loop over a real endpoint."""
from __future__ import annotations

import io
import itertools

import pytest

from meridian import metrics, status_view
from meridian.status_view import CLEAR_BELOW, CLEAR_LINE, HOME

STATUS = {
    "services": {
        "envsandbox": {"address": "127.0.0.1:50052", "health": "SERVING", "pid": 11},
        "weightsync": {"address": "127.0.0.1:50054", "health": "SERVING", "pid": 12, "policy_version": 7},
        "trainer": {"address": "127.0.0.1:50053", "health": "NOT_SERVING", "pid": 13, "policy_version": 7},
        "rollout": {
            "address": "127.0.0.1:50051", "health": "SERVING", "pid": 14, "policy_version": 5,
            "rl_admission": {"limit": 8, "running": 3, "preemptions": 2, "slo_attainment": 0.975, "rl_token_share": 0.4},
        },
    },
    "stream": {"name": "meridian:trajectories", "groups": 12, "pending": 4},
    "regions": {"b": {"served_version": 4, "weightsync_version": 6, "lag_versions": 3}},
}


def test_one_frame_from_a_status_dict() -> None:
    figs = {"production_tokens_s": 12.5, "rl_tokens_s": 40.0, "max_rollout_lag": 2, "reward": 0.25, "pass_ratio": 0.5,
            "stale_dropped": 3, "trainer_waiting": 1, "sandboxes": 4, "exec_count": 17, "sync_bytes_s": 2.5e6}
    frame = status_view.render(STATUS, figs, title="TITLE")
    lines = frame.split("\n")
    assert lines[0] == "TITLE"
    row = {line.split()[0]: line.split() for line in lines[3:7]}
    assert row["rollout"][1:] == ["SERVING", "127.0.0.1:50051", "5"]
    assert row["trainer"][1] == "NOT_SERVING"
    assert row["envsandbox"][1:] == ["SERVING", "127.0.0.1:50052"]  # no version
    for expected in (
        "RL 3/8 running, 2 preempted, SLO attainment 0.975, RL token share 0.400",
        "tokens/s      production 12.5, rl 40.0",
        "policy lag    2 version(s) behind",
        "last step reward 0.250, pass rate 0.500; 3 stale samples dropped; 1 trajectories waiting",
        "sandboxes     4 live, 17 commands run",
        "weightsync    2.50 MB/s sent",
        "stream        meridian:trajectories: 12 groups, 4 pending",
        "region b      serves version 4, weightsync holds 6, lag 3",
    ):
        assert expected in frame, f"{expected!r} not in\n{frame}"
    full = status_view.render(STATUS, {**figs, "sandboxes_reserved": 6, "creates_waiting": 2})
    assert "sandboxes     4 live, 17 commands run, 6 reserved for forks, 2 Creates waiting for room" in full, full


def test_a_frame_without_metrics_leaves_their_lines_out() -> None:
    frame = status_view.render({**STATUS, "stream": {"error": "connection refused"}})
    for absent in ("tokens/s", "policy lag", "last step reward", "sandboxes     ", "MB/s"):
        assert absent not in frame, absent
    assert "stream        unavailable: connection refused" in frame


def _scrape(tokens_rl: float, tokens_prod: float, sent: float) -> status_view.Samples:
    return {
        ("meridian_rollout_tokens_total", (("priority", "rl"), ("region", "a"), ("service", "rollout"))): tokens_rl,
        ("meridian_rollout_tokens_total", (("priority", "production"), ("region", "a"), ("service", "rollout"))): tokens_prod,
        ("meridian_rollout_policy_lag_versions", (("region", "a"), ("service", "rollout"))): 1,
        ("meridian_weightsync_sent_bytes_total", (("region", "a"), ("service", "weightsync"))): sent,
    }


def test_rates_come_from_two_scrapes() -> None:
    first = {"rollout": _scrape(100, 10, 0)}
    assert "rl_tokens_s" not in status_view.figures(first, None, 0)  # one scrape: no rate yet
    second = {"rollout": _scrape(300, 50, 4e6), "rollout-b": {("meridian_rollout_policy_lag_versions", (("region", "b"),)): 3}}
    figs = status_view.figures(second, first, elapsed_s=2.0)
    assert figs["rl_tokens_s"] == 100 and figs["production_tokens_s"] == 20 and figs["sync_bytes_s"] == 2e6
    assert figs["max_rollout_lag"] == 3  # the worst rollout
    # A restarted rollout starts its counters again: no negative rate.
    assert status_view.figures({"rollout": _scrape(5, 0, 0)}, second, 2.0)["rl_tokens_s"] == 0


def test_two_scrapes_with_no_time_between_give_no_rate() -> None:
    """A clock that has not moved (a coarse one, or --interval 0) must leave the rates out
    rather than end the view with a ZeroDivisionError."""
    figs = status_view.figures({"rollout": _scrape(300, 50, 4e6)}, {"rollout": _scrape(100, 10, 0)}, elapsed_s=0.0)
    assert "rl_tokens_s" not in figs and "sync_bytes_s" not in figs and figs["max_rollout_lag"] == 1


def test_draw_redraws_in_place() -> None:
    out = io.StringIO()
    status_view.draw("a\nbb", out)
    assert out.getvalue() == f"{HOME}a{CLEAR_LINE}\nbb{CLEAR_LINE}\n{CLEAR_BELOW}"


def test_watch_draws_frames_with_rates(monkeypatch: pytest.MonkeyPatch) -> None:
    scrapes = iter([_scrape(0, 0, 0), _scrape(50, 0, 0)])
    monkeypatch.setattr(status_view, "scrape", lambda url: next(scrapes))
    ticks = itertools.count(0, 5.0)
    out = io.StringIO()
    assert status_view.watch(lambda: STATUS, {"rollout": "http://unused"}, 0.01, out, frames=2, clock=lambda: next(ticks)) == 0
    frames = out.getvalue().split(HOME)[1:]
    assert len(frames) == 2
    assert "tokens/s" not in frames[0]
    assert "tokens/s      production 0.0, rl 10.0" in frames[1]  # 50 tokens in 5 s


def test_scrape_reads_a_real_endpoint_and_tolerates_a_dead_one() -> None:
    m = metrics.ServiceMetrics("envsandbox")
    m.observe(metrics.SANDBOX_EXEC_SECONDS, 0.2, kind="exec")
    endpoint = metrics.serve(m, "127.0.0.1", 0)
    try:
        got = status_view.scrape(endpoint.url)
    finally:
        endpoint.close()
    assert status_view.figures({"envsandbox": got}, None, 0)["exec_count"] == 1
    assert "sandboxes_reserved" not in status_view.figures({"envsandbox": got}, None, 0)
    assert status_view.scrape(endpoint.url, timeout_s=0.5) == {}
