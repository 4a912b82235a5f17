"""Bad requests to the rollout's gRPC API (a real in-process server on the stand-in engine
of ``test_server_bounds``): each answers INVALID_ARGUMENT with a message naming what is
wrong, before the engine is asked anything, and the server answers the next call."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import pytest

from meridian.v1 import rollout_pb2 as ro
from meridian.v1 import rollout_pb2_grpc as ro_grpc
from services.rollout.engine import Engine
from tests.unit.test_grpc_services import expect_code
from tests.unit.test_server_bounds import FakeEngine, rollout, run  # noqa: F401 - rollout is a fixture

MAX_MODEL_LEN = 2048  # RolloutConfig's default, which the fixture keeps
VOCAB = 256  # the stand-in tokenizer's


class CheckingEngine(FakeEngine):
    """The stand-in engine with the real engine's prompt check (it needs only the lengths)."""

    max_model_len = MAX_MODEL_LEN
    vocab_size = VOCAB
    prompt_problem = Engine.prompt_problem
    calls = 0

    async def generate(self, *args: Any, **kwargs: Any) -> Any:
        CheckingEngine.calls += 1
        async for delta in super().generate(*args, **kwargs):
            yield delta

    async def score(self, *args: Any, **kwargs: Any) -> list[float]:
        CheckingEngine.calls += 1
        return await super().score(*args, **kwargs)


def _generate(sampling: ro.SamplingParams | None = None, prompt: str = "x", ids: list[int] | None = None) -> Callable[[Any], Any]:
    async def call(stub: Any) -> Any:
        request = ro.GenerateRequest(prompt=prompt, prompt_token_ids=ids or [], sampling=sampling)
        return [chunk async for chunk in stub.Generate(request)]

    return call


BAD = {
    "top_p above 1": (_generate(ro.SamplingParams(top_p=1.5)), "top_p in [0, 1]"),
    "top_p negative": (_generate(ro.SamplingParams(top_p=-0.1)), "top_p in [0, 1]"),
    "max_tokens the whole context": (_generate(ro.SamplingParams(max_tokens=MAX_MODEL_LEN)), f"max_tokens must be in 0..{MAX_MODEL_LEN - 1}"),
    "max_tokens negative": (_generate(ro.SamplingParams(max_tokens=-1)), "max_tokens must be in"),
    "an empty stop sequence": (_generate(ro.SamplingParams(stop=["end", ""])), "non-empty stop sequences"),
    "seventeen stop sequences": (_generate(ro.SamplingParams(stop=[f"s{i}" for i in range(17)])), "at most 16"),
    "min_tokens above max_tokens": (_generate(ro.SamplingParams(max_tokens=4, min_tokens=5)), "min_tokens must be in 0..max_tokens"),
    "min_tokens negative": (_generate(ro.SamplingParams(min_tokens=-1)), "min_tokens must be in 0..max_tokens"),
    "prompt and token ids both": (_generate(prompt="x", ids=[5, 6]), "exactly one of prompt or prompt_token_ids"),
    "neither prompt nor token ids": (_generate(prompt=""), "exactly one of prompt or prompt_token_ids"),
    "a token id outside the vocabulary": (_generate(prompt="", ids=[5, VOCAB]), f"outside the vocabulary (size {VOCAB}): [{VOCAB}]"),
    "a prompt as long as the context": (_generate(prompt="", ids=[5] * MAX_MODEL_LEN), f"at most {MAX_MODEL_LEN - 1}"),
    "a score of one token": (lambda stub: stub.Score(ro.ScoreRequest(token_ids=[5])), "at least two tokens"),
    "a score outside the vocabulary": (lambda stub: stub.Score(ro.ScoreRequest(token_ids=[5, -1])), "outside the vocabulary"),
    "a group of one": (lambda stub: stub.RunEpisodes(ro.RunEpisodesRequest(group_size=1)), "group_size must be in 2..64"),
    "a group of 65": (lambda stub: stub.RunEpisodes(ro.RunEpisodesRequest(group_size=65)), "group_size must be in 2..64"),
    "65 task ids": (lambda stub: stub.RunEpisodes(ro.RunEpisodesRequest(group_size=2, task_ids=[f"t{i}" for i in range(65)])), "at most 64 tasks"),
    "num_tasks 65": (lambda stub: stub.RunEpisodes(ro.RunEpisodesRequest(group_size=2, num_tasks=65)), "at most 64 tasks"),
    "num_tasks negative": (lambda stub: stub.RunEpisodes(ro.RunEpisodesRequest(group_size=2, num_tasks=-1)), "at most 64 tasks"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_request_is_invalid_argument_naming_the_problem(case: str, rollout: Callable[[], Any], grpc_serving: Any, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    from services.rollout import server

    monkeypatch.setattr(server, "Engine", CheckingEngine)
    call, message = BAD[case]

    async def main() -> None:
        async with grpc_serving(rollout()) as address, grpc.aio.insecure_channel(address) as channel:
            stub = ro_grpc.RolloutStub(channel)
            before = CheckingEngine.calls
            details = await expect_code(grpc.StatusCode.INVALID_ARGUMENT, call(stub))
            assert message in details
            assert CheckingEngine.calls == before, "the engine was asked before the request was checked"
            chunks = await _generate()(stub)  # the next call is served
            assert chunks[-1].finished

    run(main())


class RejectsFirstEpisode(FakeEngine):
    """The stand-in engine, whose first RL generation is labelled with a version that was
    then rejected (what the engine reports for tokens a rolled-back candidate sampled)."""

    rl_calls = 0

    async def generate(self, prompt_ids: list[int], sampling: Any, priority: int, request_id: str = "") -> Any:
        from services.rollout.engine import PRIORITY_RL, REJECTED_VERSION, Delta

        if priority != PRIORITY_RL:
            async for delta in super().generate(prompt_ids, sampling, priority, request_id):
                yield delta
            return
        RejectsFirstEpisode.rl_calls += 1
        version = REJECTED_VERSION if RejectsFirstEpisode.rl_calls == 1 else 0
        yield Delta([7, 8], [-0.5, -0.5], 0, "```python\nx = 1\n```", True, "stop", [version, version])


def test_run_episodes_drops_a_group_with_tokens_of_a_rejected_version(rollout: Callable[..., Any], grpc_serving: Any, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """Two groups; one episode of the first was sampled (in part) by a candidate that was
    then rolled back. No policy produced those samples: that whole group is dropped, the
    other is returned, and only the kept episodes count as completed."""
    from services.rollout import server
    from tests.unit.test_rollout_episodes import Boxes

    class Tasks(Boxes):
        async def GetTask(self, request: Any, context: object) -> Any:
            from meridian.v1 import envsandbox_pb2 as sbx

            return sbx.Task(id=request.task_id, instruction="add", answer_path="answer.py")

    monkeypatch.setattr(server, "Engine", RejectsFirstEpisode)
    RejectsFirstEpisode.rl_calls = 0

    async def main() -> tuple[Any, Any]:
        from meridian.v1 import envsandbox_pb2_grpc as sbx_grpc

        boxes = grpc.aio.server()
        sbx_grpc.add_EnvSandboxServicer_to_server(Tasks(), boxes)
        port = boxes.add_insecure_port("127.0.0.1:0")
        await boxes.start()
        try:
            service = rollout(envsandbox=f"127.0.0.1:{port}")
            async with grpc_serving(service) as address, grpc.aio.insecure_channel(address) as channel:
                stub = ro_grpc.RolloutStub(channel)
                reply = await stub.RunEpisodes(ro.RunEpisodesRequest(task_ids=["first", "second"], group_size=2, sampling=ro.SamplingParams(seed=1)))
                return reply, service
        finally:
            await boxes.stop(grace=None)

    reply, service = run(main())
    assert len(reply.trajectories) == 2 and len({t.group_id for t in reply.trajectories}) == 1
    assert all(-2 not in t.policy_versions for t in reply.trajectories)
    assert (service.episodes_completed, service.episodes_discarded) == (2, 2)
