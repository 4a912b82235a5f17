"""The metrics endpoints under ``meridian up`` (the shared stack): after one RL group
through rollout and the trainer's step on it, every service's endpoint answers with its
key metrics at sensible values, every metric the Grafana dashboard selects appears in a
scrape, and ``meridian status --watch`` draws a frame from the live stack."""
from __future__ import annotations

import asyncio
import io
import time
from collections.abc import Callable

import pytest

from meridian import metrics, stack as stack_mod, status_view
from meridian.grpc_runtime import open_channel
from meridian.v1 import rollout_pb2 as pb
from meridian.v1 import rollout_pb2_grpc as pb_grpc
from tests import dashboard

TASK = "text/shout"  # graded reward: a random model's samples differ, so the group trains
GROUP = 4

pytestmark = [pytest.mark.stack, pytest.mark.engine]

Samples = status_view.Samples


def value(scrape: Samples, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels`` (fails when there is none)."""
    found = [v for (n, ls), v in scrape.items() if n == name and set(labels.items()) <= set(ls)]
    assert found, f"no {name} {labels} in the scrape: {sorted({n for n, _ in scrape})}"
    return sum(found)


def has(scrape: Samples, name: str, **labels: str) -> bool:
    return any(n == name and set(labels.items()) <= set(ls) for n, ls in scrape)


def _wait(what: str, done: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


async def _episodes(address: str) -> pb.RunEpisodesResponse:
    async with open_channel(address) as channel:
        request = pb.RunEpisodesRequest(task_ids=[TASK], group_size=GROUP, publish=True, sampling=pb.SamplingParams(max_tokens=24))
        return await pb_grpc.RolloutStub(channel).RunEpisodes(request)


def test_every_service_exports_its_metrics_after_real_traffic(stack: stack_mod.Stack) -> None:
    services = set(stack_mod.SERVICE_ORDER)
    assert services <= set(stack.metrics), f"metrics endpoints recorded: {stack.metrics}"
    for name in services:
        assert stack.metrics[name].startswith("http://127.0.0.1:"), "the endpoints listen on loopback"
    before = status_view.scrape(stack.metrics["trainer"])
    steps_before = value(before, "meridian_trainer_steps_total")

    trajs = list(asyncio.run(_episodes(stack.addresses["rollout"])).trajectories)
    assert len(trajs) == GROUP
    # The trainer steps on the group once it is complete (its rewards differ, so it trains).
    _wait("the trainer's step", lambda: value(status_view.scrape(stack.metrics["trainer"]), "meridian_trainer_steps_total") > steps_before, 300)
    _wait("the step's publish", lambda: has(status_view.scrape(stack.metrics["trainer"]), "meridian_trainer_step_seconds_count", phase="publish"), 120)
    scrapes = {name: status_view.scrape(stack.metrics[name]) for name in services}

    for name, scrape in scrapes.items():
        assert value(scrape, "meridian_service_up", service=name) == 1
        assert value(scrape, "meridian_metrics_source_errors_total") == 0, f"{name}: its figures did not reach a scrape"
        for metric, labels in scrape:
            assert dict(labels)["service"] == name and dict(labels)["region"], (metric, labels)
            assert metric in metrics.series_names(), f"{name} exports {metric}, which is not in meridian.metrics.METRICS"

    rollout, sandbox, sync, trainer = (scrapes[n] for n in ("rollout", "envsandbox", "weightsync", "trainer"))
    assert value(rollout, "meridian_rollout_tokens_total", priority="rl") >= GROUP  # every sample has tokens
    assert value(rollout, "meridian_rollout_episodes_total") >= GROUP
    assert value(rollout, "meridian_rollout_policy_lag_versions") >= 0
    assert value(rollout, "meridian_rollout_requests_in_flight", priority="rl") >= 0
    assert value(sandbox, "meridian_envsandbox_exec_seconds_count", kind="tests") >= GROUP  # each episode is graded
    assert value(sandbox, "meridian_envsandbox_exec_seconds_sum", kind="tests") > 0
    assert value(sandbox, "meridian_envsandbox_live_sandboxes") >= 0 and value(sandbox, "meridian_envsandbox_max_sandboxes") > 0
    assert value(sync, "meridian_weightsync_latest_version") >= 1  # version 0 at start, then the step's
    assert value(sync, "meridian_weightsync_propagation_seconds_count") >= 2
    assert value(sync, "meridian_weightsync_stored_bytes") > 0
    assert value(sync, "meridian_weightsync_sent_bytes_total") > 0  # rollout follows the origin
    assert value(trainer, "meridian_trainer_trajectories_consumed_total") >= GROUP
    assert value(trainer, "meridian_trainer_step_seconds_count", phase="learn") >= 1
    assert value(trainer, "meridian_trainer_step_seconds_sum", phase="learn") > 0
    assert 0 <= value(trainer, "meridian_trainer_pass_ratio") <= 1
    assert value(trainer, "meridian_trainer_stream_entries") >= 1

    # The dashboard loads against these endpoints: every metric it selects is scraped.
    scraped = {n for scrape in scrapes.values() for n, _ in scrape}
    missing = {name: sorted(where) for name, where in dashboard.referenced(dashboard.load()).items() if name not in scraped}
    assert not missing, f"dashboard queries select metrics no endpoint serves: {missing}"


def test_status_watch_draws_the_live_stack(stack: stack_mod.Stack) -> None:
    out = io.StringIO()
    status_view.watch(lambda: stack_mod.gather_status(stack), stack.metrics, 0.5, out, frames=2)
    last = out.getvalue().split(status_view.HOME)[-1]
    for name in stack_mod.SERVICE_ORDER:
        assert f"{name:<14}SERVING" in last, last
    assert "tokens/s" in last and "sandboxes" in last and "stream" in last, last
