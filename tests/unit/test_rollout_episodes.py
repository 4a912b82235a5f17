"""The agent loop of an RL episode and its group, against a stand-in envsandbox on a real
gRPC server and a scripted engine: how an episode ends, what it writes as the answer,
and the seeds a group's episodes sample with (the real loop against a real envsandbox
and vLLM: tests/integration/test_agent_episode.py)."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest

from meridian.v1 import envsandbox_pb2 as sbx
from meridian.v1 import envsandbox_pb2_grpc as sbx_grpc
from services.rollout import episodes
from services.rollout.engine import Delta, Sampling
from tests.unit.test_rollout_agent import TASK, StandInTokenizer, envsandbox_serving


def _call(name: str, **arguments: str) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


class Tokenizer(StandInTokenizer):
    eos_token = ""
    eos_token_id = -1


class Engine:
    """Answers each model turn with the next of ``turns`` (the last one repeats), as three
    tokens; records the seed each turn sampled with."""

    tokenizer = Tokenizer()

    def __init__(self, turns: Callable[[int], str]) -> None:
        self.turns = turns
        self.seeds: list[int | None] = []
        self._turn: dict[int | None, int] = {}

    async def generate(self, prompt_ids: list[int], sampling: Sampling, priority: int, request_id: str = "") -> AsyncIterator[Delta]:
        self.seeds.append(sampling.seed)
        turn = self._turn.get(sampling.seed, 0)
        self._turn[sampling.seed] = turn + 1
        yield Delta([7, 8, 9], [-0.5, -0.5, -0.5], 3, self.turns(turn), True, "stop")


class Boxes(sbx_grpc.EnvSandboxServicer):
    """A stand-in envsandbox: records what the episode wrote and ran; ``refuse_write``
    answers every WriteFiles with that status."""

    def __init__(self, refuse_write: grpc.StatusCode | None = None) -> None:
        self.refuse_write = refuse_write
        self.writes: list[tuple[str, bytes]] = []
        self.execs: list[str] = []
        self.tests_run = 0

    async def Create(self, request: sbx.CreateRequest, context: object) -> sbx.SandboxInfo:
        return sbx.SandboxInfo(sandbox_id="base", task_id=request.task_id)

    async def Fork(self, request: sbx.ForkRequest, context: object) -> sbx.ForkResponse:
        return sbx.ForkResponse(sandboxes=[sbx.SandboxInfo(sandbox_id=f"f{i}") for i in range(request.count)])

    async def Close(self, request: sbx.CloseRequest, context: object) -> sbx.CloseResponse:
        return sbx.CloseResponse()

    async def Exec(self, request: sbx.ExecRequest, context: object) -> AsyncIterator[sbx.ExecChunk]:
        self.execs.append(request.argv[-1])
        yield sbx.ExecChunk(stdout=b"ok")
        yield sbx.ExecChunk(result=sbx.ExecResult(exit_code=0))

    async def WriteFiles(self, request: sbx.WriteFilesRequest, context: grpc.aio.ServicerContext) -> sbx.WriteFilesResponse:
        if self.refuse_write is not None:
            await context.abort(self.refuse_write, "refused")
        self.writes.extend((f.path, f.content) for f in request.files)
        return sbx.WriteFilesResponse()

    async def RunTests(self, request: sbx.RunTestsRequest, context: object) -> sbx.RunTestsResponse:
        self.tests_run += 1
        return sbx.RunTestsResponse(reward=1.0)


def _episode(boxes: Boxes, engine: Engine, limits: episodes.EpisodeLimits | None = None) -> episodes.EpisodeResult:
    async def main() -> episodes.EpisodeResult:
        async with envsandbox_serving(boxes) as stub:
            run = episodes.run_episode(engine, stub, "f0", TASK, [1, 2, 3], Sampling(), limits or episodes.EpisodeLimits())  # type: ignore[arg-type]
            return await asyncio.wait_for(run, 30)  # type: ignore[arg-type]

    return asyncio.run(main())


def test_a_reply_without_a_tool_call_is_the_answer_written_where_the_tests_look() -> None:
    """The final reply's code block becomes the task's answer file, then the tests run."""
    boxes = Boxes()
    result = _episode(boxes, Engine(lambda turn: "here:\n```python\ndef add(a, b):\n    return a + b\n```"))
    assert boxes.writes == [("answer.py", b"def add(a, b):\n    return a + b\n")]
    assert (result.turns, result.reward, boxes.tests_run) == (1, 1.0, 1)


def test_files_the_policy_wrote_are_not_overwritten_by_its_last_reply() -> None:
    """A policy that wrote its solution with write_file and then replied in prose is tested
    on the file it wrote: the prose is not saved over it."""
    boxes = Boxes()
    turns = [_call("write_file", path="answer.py", content="def add(a, b):\n    return a + b\n"), "done, see answer.py"]
    result = _episode(boxes, Engine(lambda turn: turns[min(turn, 1)]))
    assert boxes.writes == [("answer.py", b"def add(a, b):\n    return a + b\n")]
    assert result.turns == 2 and boxes.tests_run == 1


def test_a_policy_that_never_stops_calling_tools_ends_at_the_turn_limit_truncated() -> None:
    """Every turn a tool call: the episode ends after ``max_turns`` turns as
    ``turn_limit``, its tests still run, and the tool output is in the ledger masked out."""
    boxes = Boxes()
    result = _episode(boxes, Engine(lambda turn: _call("bash", command=f"echo {turn}")), episodes.EpisodeLimits(max_turns=3))
    assert (result.turns, result.finish_reason) == (3, "turn_limit")
    assert boxes.execs == ["echo 0", "echo 1", "echo 2"] and boxes.tests_run == 1 and boxes.writes == []
    assert result.ledger.loss_mask.count(1) == 9, "three model turns of three tokens each are trained on"


def test_an_episode_out_of_context_room_ends_as_token_limit() -> None:
    """No room left in the model's context for another turn: ``token_limit``, not a turn
    limit or a timeout (the trainer reads truncation from it)."""
    boxes = Boxes()
    result = _episode(boxes, Engine(lambda turn: _call("bash", command="ls")), episodes.EpisodeLimits(max_turns=50, max_model_len=12))
    assert result.finish_reason == "token_limit" and result.turns < 50


@pytest.mark.parametrize(("code", "scored"), [(grpc.StatusCode.INVALID_ARGUMENT, True), (grpc.StatusCode.RESOURCE_EXHAUSTED, True), (grpc.StatusCode.UNAVAILABLE, False)])
def test_an_answer_write_the_policy_made_fail_is_scored_and_any_other_failure_raises(code: grpc.StatusCode, scored: bool) -> None:
    """A write the sandbox's state refuses (the policy put a folder where the answer goes,
    or filled the disk) is the policy's doing: the tests run on what is there. An
    envsandbox that is not answering is not: the episode fails (its group is retried)."""
    boxes = Boxes(refuse_write=code)
    engine = Engine(lambda turn: "```python\nx = 1\n```")
    if scored:
        assert _episode(boxes, engine).reward == 1.0 and boxes.tests_run == 1
        return
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        _episode(boxes, engine)
    assert caught.value.code() == code and boxes.tests_run == 0


def test_a_groups_episodes_sample_with_distinct_seeds() -> None:
    """A seeded group gives episode i the seed ``seed + i``: with one seed for all, every
    episode of the group would sample the same completion and GRPO would learn nothing."""
    engine = Engine(lambda turn: "```python\nx = 1\n```")

    async def main() -> list[Any]:
        async with envsandbox_serving(Boxes()) as stub:
            return await asyncio.wait_for(episodes.run_group(engine, stub, TASK, 3, Sampling(seed=40), "m"), 30)  # type: ignore[arg-type]

    trajectories = asyncio.run(main())
    assert sorted(engine.seeds) == [40, 41, 42]  # type: ignore[type-var]
    assert len(trajectories) == 3 and len({t.trajectory_id for t in trajectories}) == 3
    assert all(t.group_size == 3 and t.group_id == trajectories[0].group_id and not t.truncated for t in trajectories)
