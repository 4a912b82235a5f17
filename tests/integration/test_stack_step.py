"""One real RL step through all four services on the local stack (real redis-server,
real vLLM, real sandboxes), with traces received over OTLP."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from meridian import stack as stack_mod
from meridian.grpc_runtime import check_health, open_channel
from meridian.trajectory_transport import TransportConfig, open_transport
from meridian.v1 import rollout_pb2 as pb
from meridian.v1 import rollout_pb2_grpc as pb_grpc
from meridian.v1 import envsandbox_pb2 as sbx
from meridian.v1 import envsandbox_pb2_grpc as sbx_grpc
from tests.integration.otlp_receiver import OtlpReceiver

FIXED_PROMPT = "def fibonacci(n):"
TASK = "text/shout"  # graded reward, so a random model's samples differ in reward
GROUP = 4


async def _greedy(address: str) -> tuple[list[int], list[int]]:
    async with open_channel(address) as channel:
        ids: list[int] = []
        versions: list[int] = []
        async for chunk in pb_grpc.RolloutStub(channel).Generate(pb.GenerateRequest(prompt=FIXED_PROMPT, sampling=pb.SamplingParams(max_tokens=12))):
            ids += chunk.token_ids
            versions += chunk.policy_versions
        return ids, versions


async def _score(address: str, token_ids: list[int]) -> pb.ScoreResponse:
    async with open_channel(address) as channel:
        return await pb_grpc.RolloutStub(channel).Score(pb.ScoreRequest(token_ids=token_ids))


async def _rollout_status(address: str) -> pb.RolloutStatus:
    async with open_channel(address) as channel:
        return await pb_grpc.RolloutStub(channel).Status(pb.RolloutStatusRequest())


pytestmark = [pytest.mark.stack, pytest.mark.engine]


def test_every_service_reports_serving(stack: stack_mod.Stack) -> None:
    for name in stack_mod.SERVICE_ORDER:
        assert asyncio.run(check_health(stack.addresses[name])) == "SERVING", name


def test_one_rl_step_end_to_end(stack: stack_mod.Stack, otlp: OtlpReceiver) -> None:
    rollout = stack.addresses["rollout"]
    start = asyncio.run(_rollout_status(rollout))
    v0 = start.policy_version
    before_ids, before_versions = asyncio.run(_greedy(rollout))
    assert before_ids and set(before_versions) == {v0}
    before_score = asyncio.run(_score(rollout, before_ids))

    async def stream_counts() -> tuple[int, int]:
        stream = open_transport(TransportConfig(url=stack.redis_url))
        try:
            return await stream.length(), await stream.pending()
        finally:
            await stream.close()

    length_before, _ = asyncio.run(stream_counts())

    async def episodes() -> pb.RunEpisodesResponse:
        async with open_channel(rollout) as channel:
            request = pb.RunEpisodesRequest(task_ids=[TASK], group_size=GROUP, publish=True, sampling=pb.SamplingParams(max_tokens=24))
            return await pb_grpc.RolloutStub(channel).RunEpisodes(request)

    reply = asyncio.run(episodes())
    trajs = list(reply.trajectories)
    assert len(trajs) == GROUP and len({t.group_id for t in trajs}) == 1
    for t in trajs:
        n = len(t.completion_token_ids)
        assert n > 0 and len(t.logprobs) == len(t.loss_mask) == len(t.policy_versions) == n
        assert set(t.policy_versions) == {v0} and all(lp <= 0 for lp in t.logprobs)
        assert "traceparent" in t.trace_context
    assert len({t.reward for t in trajs}) > 1, "group rewards must differ for GRPO to learn"

    deadline = time.monotonic() + 180
    while (status := asyncio.run(_rollout_status(rollout))).policy_version < v0 + 1:
        assert time.monotonic() < deadline, f"rollout still on version {status.policy_version}"
        time.sleep(0.5)
    assert status.policy_version == v0 + 1 and status.updates_applied == start.updates_applied + 1

    _, after_versions = asyncio.run(_greedy(rollout))
    assert set(after_versions) == {v0 + 1}
    # Greedy tokens of a random model can survive one small step; their log-probs cannot.
    after_score = asyncio.run(_score(rollout, before_ids))
    assert after_score.policy_version == v0 + 1 and before_score.policy_version == v0
    moved = max(abs(a - b) for a, b in zip(after_score.logprobs, before_score.logprobs))
    assert moved > 1e-3, f"the served policy should change with the update (max log-prob change {moved})"
    # One entry for the group, acked once a checkpoint covers its step (the trainer
    # checkpoints when it goes idle, --checkpoint-idle-s after the step).
    while (counts := asyncio.run(stream_counts())) != (length_before + 1, 0):
        assert counts[0] == length_before + 1, "the group travels as one entry"
        assert time.monotonic() < deadline, f"the group's entry is still pending: {counts}"
        time.sleep(0.5)

    episode_spans = {(t.trace_context["traceparent"].split("-")[1], t.trace_context["traceparent"].split("-")[2]) for t in trajs}
    assert otlp.wait_for(lambda r: any(set(s.links) & episode_spans for s in r.spans("trainer.step"))), (
        "the trainer's step span should link to the episodes that produced its batch"
    )
    assert otlp.wait_for(lambda r: {s.span_id for s in r.spans("rollout.episode")} >= {sid for _, sid in episode_spans})


@pytest.mark.parametrize(
    "request_, code",
    [
        (pb.GenerateRequest(prompt="x", prompt_token_ids=[1]), grpc.StatusCode.INVALID_ARGUMENT),
        (pb.GenerateRequest(prompt_token_ids=[10**9]), grpc.StatusCode.INVALID_ARGUMENT),
        (pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(max_tokens=10**6)), grpc.StatusCode.INVALID_ARGUMENT),
    ],
)
def test_bad_generate_requests_get_clear_status(stack: stack_mod.Stack, request_: pb.GenerateRequest, code: grpc.StatusCode) -> None:
    async def call() -> grpc.aio.AioRpcError:
        async with open_channel(stack.addresses["rollout"]) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in pb_grpc.RolloutStub(channel).Generate(request_):
                    pass
            return info.value

    error = asyncio.run(call())
    assert error.code() == code and error.details()
    assert asyncio.run(check_health(stack.addresses["rollout"])) == "SERVING"


def test_bad_requests_to_other_services(stack: stack_mod.Stack) -> None:
    async def calls() -> list[grpc.StatusCode]:
        codes = []
        async with open_channel(stack.addresses["rollout"]) as channel:
            try:
                await pb_grpc.RolloutStub(channel).RunEpisodes(pb.RunEpisodesRequest(task_ids=["no/such-task"]))
            except grpc.aio.AioRpcError as exc:
                codes.append(exc.code())
        async with open_channel(stack.addresses["envsandbox"]) as channel:
            try:
                await sbx_grpc.EnvSandboxStub(channel).Close(sbx.CloseRequest(sandbox_id="sbx-missing"))
            except grpc.aio.AioRpcError as exc:
                codes.append(exc.code())
        return codes

    assert asyncio.run(calls()) == [grpc.StatusCode.NOT_FOUND, grpc.StatusCode.NOT_FOUND]
    for name in stack_mod.SERVICE_ORDER:
        assert asyncio.run(check_health(stack.addresses[name])) == "SERVING"
