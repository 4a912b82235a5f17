"""RL episodes: sample a GRPO group for a task, score every sample in its own sandbox,
and build trajectories whose token ids, log-probs and versions come straight from the
engine (nothing is re-tokenised)."""
from __future__ import annotations

import asyncio
import re
import time
import uuid

import grpc

from meridian import telemetry
from meridian.errors import NotFound
from meridian.v1 import common_pb2
from meridian.v1 import envsandbox_pb2 as sbx
from meridian.v1 import envsandbox_pb2_grpc as sbx_grpc
from services.rollout.engine import PRIORITY_RL, Engine, Sampling

tracer = telemetry.tracer(__name__)

_FENCE = re.compile(r"```[a-zA-Z0-9_+-]*\n(.*?)(?:```|$)", re.DOTALL)


def extract_answer(text: str) -> str:
    """The first fenced code block of a reply, or the whole reply when it has none."""
    m = _FENCE.search(text)
    return m.group(1) if m else text


def chat_prompt(engine: Engine, instruction: str) -> list[int]:
    """The prompt's token ids through the model's own chat template."""
    assert engine.tokenizer is not None
    messages = [{"role": "user", "content": instruction}]
    ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


async def _sample(engine: Engine, prompt_ids: list[int], sampling: Sampling) -> tuple[list[int], list[float], list[int], str, str]:
    ids: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    text, reason = "", ""
    async for delta in engine.generate(prompt_ids, sampling, PRIORITY_RL):
        ids += delta.token_ids
        logprobs += delta.logprobs
        versions += [delta.version] * len(delta.token_ids)
        text += delta.text
        reason = delta.finish_reason or reason
    return ids, logprobs, versions, text, reason


async def run_group(
    engine: Engine,
    sandboxes: sbx_grpc.EnvSandboxStub,
    task: sbx.Task,
    group_size: int,
    sampling: Sampling,
    model: str,
) -> list[common_pb2.Trajectory]:
    """One GRPO group for ``task``: ``group_size`` samples, each scored in a forked sandbox."""
    prompt_ids = chat_prompt(engine, task.instruction)
    group_id = uuid.uuid4().hex
    seeds = [None if sampling.seed is None else sampling.seed + i for i in range(group_size)]
    base = await sandboxes.Create(sbx.CreateRequest(task_id=task.id, client_request_id=f"{group_id}-base"))
    try:
        forks = await sandboxes.Fork(sbx.ForkRequest(sandbox_id=base.sandbox_id, count=group_size))
    finally:
        await sandboxes.Close(sbx.CloseRequest(sandbox_id=base.sandbox_id))

    async def episode(index: int, sandbox_id: str) -> common_pb2.Trajectory:
        started = time.time()
        with tracer.start_as_current_span("rollout.episode") as span:
            span.set_attribute("meridian.task_id", task.id)
            span.set_attribute("meridian.group_id", group_id)
            try:
                t0 = time.perf_counter()
                one = Sampling(sampling.temperature, sampling.top_p, sampling.max_tokens, sampling.stop, seeds[index])
                ids, logprobs, versions, text, reason = await _sample(engine, prompt_ids, one)
                generate_s = time.perf_counter() - t0
                t1 = time.perf_counter()
                answer = extract_answer(text).encode()
                await sandboxes.WriteFiles(sbx.WriteFilesRequest(sandbox_id=sandbox_id, files=[sbx.File(path=task.answer_path, content=answer)]))
                result = await sandboxes.RunTests(sbx.RunTestsRequest(sandbox_id=sandbox_id))
                sandbox_s = time.perf_counter() - t1
            finally:
                await sandboxes.Close(sbx.CloseRequest(sandbox_id=sandbox_id))
            span.set_attribute("meridian.reward", result.reward)
            return common_pb2.Trajectory(
                trajectory_id=uuid.uuid4().hex,
                task_id=task.id,
                group_id=group_id,
                group_size=group_size,
                prompt_token_ids=prompt_ids,
                completion_token_ids=ids,
                logprobs=logprobs,
                loss_mask=[1] * len(ids),
                policy_versions=versions,
                reward=result.reward,
                truncated=reason == "length",
                finish_reason=reason,
                timings=common_pb2.Timings(generate_s=generate_s, sandbox_s=sandbox_s, total_s=time.time() - started, created_unix=started),
                trace_context=telemetry.inject(span),
                model=model,
            )

    return list(await asyncio.gather(*(episode(i, box.sandbox_id) for i, box in enumerate(forks.sandboxes))))


async def fetch_task(sandboxes: sbx_grpc.EnvSandboxStub, task_id: str) -> sbx.Task:
    try:
        return await sandboxes.GetTask(sbx.GetTaskRequest(task_id=task_id))
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.NOT_FOUND:
            raise NotFound(f"no task {task_id!r} at envsandbox") from None
        raise
