"""Every expected span edge (meridian/trace_edges.py) shows in the spans the real stack
exports over OTLP after one trajectory's life: an RL group sampled and written to Redis,
the trainer's step on it and its publish, rollout applying the new version, and a relay
following the origin meanwhile. The trajectory's trace is printed as a tree (``-s``)."""
from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from meridian import stack as stack_mod
from meridian.grpc_runtime import open_channel
from meridian.trace_edges import check_edges, render_trajectory
from meridian.v1 import rollout_pb2 as pb
from meridian.v1 import rollout_pb2_grpc as pb_grpc
from services.weightsync import client as weightsync
from tests.integration.otlp_receiver import OtlpReceiver

TASK = "text/shout"  # graded reward: a random model's samples differ, so the group trains
GROUP = 4

pytestmark = [pytest.mark.stack, pytest.mark.engine]


class Relay:
    """A weightsync relay process following the stack's origin, exporting to the test's receiver."""

    def __init__(self, run_dir: Path, upstream: str, otlp: OtlpReceiver, credentials: str) -> None:
        # The stack's credentials: the relay subscribes as role relay, the test calls it as the operator.
        env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": otlp.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "200", "MERIDIAN_CREDENTIALS": credentials}
        args = ["--role", "relay", "--upstream", upstream, "--data-dir", str(run_dir / "relay-data")]
        proc, self.address, self.log = stack_mod.spawn_service("weightsync", args, run_dir, env)
        self._holder = stack_mod.Stack(run_dir, {"weightsync": proc.pid}, {"weightsync": self.address}, {"weightsync": str(self.log)}, "", credentials=credentials)
        self._holder.use_credentials()
        try:
            stack_mod.wait_serving({"weightsync": self.address}, {"weightsync": proc}, self._holder.logs, 60)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """SIGTERM (its spans are flushed on the way out), then whatever the group still holds; once."""
        if self._holder.pids:
            self._holder.stop(15)
            self._holder.pids.clear()


@pytest.fixture
def relay(stack: stack_mod.Stack, otlp: OtlpReceiver, tmp_path: Path) -> Iterator[Relay]:
    r = Relay(tmp_path, stack.addresses["weightsync"], otlp, stack.credentials)
    try:
        yield r
    finally:
        r.stop()


def _wait(what: str, done: Callable[[], bool], timeout_s: float, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            tail = f"; the end of {log.name}:\n{log.read_text(errors='replace')[-3000:]}" if log else ""
            raise AssertionError(f"timed out waiting for {what}{tail}")
        time.sleep(0.5)


async def _rollout_version(address: str) -> int:
    async with open_channel(address) as channel:
        return (await pb_grpc.RolloutStub(channel).Status(pb.RolloutStatusRequest())).policy_version


async def _episodes(address: str) -> pb.RunEpisodesResponse:
    async with open_channel(address) as channel:
        request = pb.RunEpisodesRequest(task_ids=[TASK], group_size=GROUP, publish=True, sampling=pb.SamplingParams(max_tokens=24))
        return await pb_grpc.RolloutStub(channel).RunEpisodes(request)


def test_every_expected_edge_shows_in_one_trajectorys_life(stack: stack_mod.Stack, otlp: OtlpReceiver, relay: Relay) -> None:
    rollout, origin = stack.addresses["rollout"], stack.addresses["weightsync"]
    v0 = asyncio.run(_rollout_version(rollout))
    _wait("the relay to hold the origin's versions", lambda: asyncio.run(weightsync.latest_version(relay.address)) >= asyncio.run(weightsync.latest_version(origin)), 120, relay.log)

    trajs = list(asyncio.run(_episodes(rollout)).trajectories)
    assert len(trajs) == GROUP and len({t.reward for t in trajs}) > 1, "the group must train (rewards differ) for a version to follow"
    _, trace_id, episode_id, _ = trajs[0].trace_context["traceparent"].split("-")
    _wait("rollout to serve the version trained on the group", lambda: asyncio.run(_rollout_version(rollout)) > v0, 300, Path(stack.logs["rollout"]))
    _wait("the relay to hold that version", lambda: asyncio.run(weightsync.latest_version(relay.address)) > v0, 120, relay.log)
    # The relay's upstream stream is one span pair that ends, and is exported, when the stream does.
    relay.stop()

    ok = otlp.wait_for(lambda r: not check_edges(r.spans(), trace_id).missing, timeout_s=120)
    spans = otlp.spans()
    report = check_edges(spans, trace_id)
    tree = render_trajectory(spans, trace_id, episode_id)
    print(f"\n{tree}\n")
    assert ok and not report.missing, f"edges missing: {report.missing}; the trajectory's spans:\n{tree}"

    # The evidence is this trajectory's: the group's own episodes went to Redis and into the step.
    episode_ids = {t.trace_context["traceparent"].split("-")[2] for t in trajs}
    for label in ("rollout → Redis", "trainer → Redis"):
        assert {ev.callee.span_id for ev in report.evidence[label]} <= episode_ids, label
    assert episode_id in {ev.callee.span_id for ev in report.evidence["trainer → Redis"]}
    steps = {ev.caller.span_id for ev in report.evidence["trainer → Redis"]}
    assert {ev.caller.parent_span_id for ev in report.evidence["trainer → weightsync"]} <= steps
    assert {ev.callee.span_id for ev in report.evidence["rollout → weightsync"]} <= steps
