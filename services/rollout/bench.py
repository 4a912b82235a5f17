"""``meridian bench rollout --json``: the rollout service against bare vLLM on the same
model and prompts, production latency with and without RL backfill, and the time of an
in-place weight update. Prints one JSON object."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time

PROMPTS = [
    "Write a Python function that returns the factorial of n.",
    "Explain what a hash map is in one paragraph.",
    "Write a shell command that counts the lines of every .py file.",
    "What does the `yield` keyword do in Python?",
    "Write a function that reverses a linked list.",
    "List three ways to speed up a slow SQL query.",
    "Write a regular expression that matches an email address.",
    "How do you read a file line by line in Python?",
]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


async def _bare_vllm_tokens_per_s(model_dir: str, prompt_ids: list[list[int]], max_tokens: int, concurrency: int, kv_gib: float) -> float:
    """Throughput of vLLM's own AsyncLLM in this process, no Meridian code on the path."""
    import os

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(kv_gib))))
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(model=model_dir, dtype="bfloat16", max_model_len=2048, enforce_eager=True, disable_log_stats=True, seed=0))
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0)

        async def one(i: int, ids: list[int]) -> int:
            last = None
            async for out in llm.generate({"prompt_token_ids": ids}, params, request_id=f"bench-{i}-{time.monotonic_ns()}"):
                last = out
            return len(last.outputs[0].token_ids) if last else 0

        await one(-1, prompt_ids[0])  # warm-up
        return await _throughput(one, prompt_ids, concurrency)
    finally:
        llm.shutdown()


async def _throughput(one, prompt_ids: list[list[int]], concurrency: int) -> float:  # type: ignore[no-untyped-def]
    sem = asyncio.Semaphore(concurrency)

    async def limited(i: int, ids: list[int]) -> int:
        async with sem:
            return await one(i, ids)

    t0 = time.perf_counter()
    tokens = sum(await asyncio.gather(*(limited(i, ids) for i, ids in enumerate(prompt_ids))))
    return tokens / (time.perf_counter() - t0)


async def _service_measurements(stack, prompt_ids: list[list[int]], max_tokens: int, concurrency: int, latency_requests: int) -> dict[str, float]:  # type: ignore[no-untyped-def]
    from meridian.grpc_runtime import open_channel
    from meridian.v1 import rollout_pb2 as pb
    from meridian.v1 import rollout_pb2_grpc as pb_grpc

    async with open_channel(stack.addresses["rollout"]) as channel:
        stub = pb_grpc.RolloutStub(channel)

        async def generate(i: int, ids: list[int], tokens: int = max_tokens, priority: int = pb.PRIORITY_PRODUCTION) -> int:
            n = 0
            request = pb.GenerateRequest(prompt_token_ids=ids, sampling=pb.SamplingParams(temperature=0.0, max_tokens=tokens), priority=priority)
            async for chunk in stub.Generate(request):
                n += len(chunk.token_ids)
            return n

        await generate(-1, prompt_ids[0])
        service_tps = await _throughput(generate, prompt_ids, concurrency)

        async def latencies() -> list[float]:
            out = []
            for i in range(latency_requests):
                t0 = time.perf_counter()
                await generate(i, prompt_ids[i % len(prompt_ids)], tokens=16)
                out.append((time.perf_counter() - t0) * 1000)
            return out

        alone = await latencies()
        rl_tokens = 0
        stop = asyncio.Event()

        async def backfill() -> None:
            nonlocal rl_tokens
            while not stop.is_set():
                reply = await stub.RunEpisodes(pb.RunEpisodesRequest(num_tasks=1, group_size=4, publish=False, sampling=pb.SamplingParams(max_tokens=64)))
                rl_tokens += sum(sum(t.loss_mask) for t in reply.trajectories)

        worker = asyncio.create_task(backfill())
        await asyncio.sleep(2.0)  # let RL work occupy the engine first
        t0 = time.perf_counter()
        with_rl = await latencies()
        rl_window = time.perf_counter() - t0
        stop.set()
        await worker
        return {
            "service_tokens_per_s": service_tps,
            "prod_p50_ms": statistics.median(alone),
            "prod_p99_ms": _percentile(alone, 0.99),
            "prod_p50_ms_with_rl": statistics.median(with_rl),
            "prod_p99_ms_with_rl": _percentile(with_rl, 0.99),
            "rl_tokens_per_s_backfill": rl_tokens / rl_window,
        }


async def _weight_apply_ms(stack, model_dir) -> float:  # type: ignore[no-untyped-def]
    """Publishes a perturbed copy of the weights and reads how long rollout took to apply it."""
    import numpy as np

    from meridian.grpc_runtime import open_channel
    from meridian.v1 import rollout_pb2 as pb
    from meridian.v1 import rollout_pb2_grpc as pb_grpc
    from services.rollout.server import load_checkpoint_weights
    from services.weightsync import client as weightsync
    from services.weightsync.tensors import RawTensor

    weights = load_checkpoint_weights(model_dir)
    rng = np.random.default_rng(0)
    changed = {}
    for name, t in weights.items():
        bits = t.bits.copy()
        idx = rng.choice(bits.size, size=max(1, bits.size // 300), replace=False)
        bits[idx] ^= 1  # one step on the bf16 grid for ~0.3 % of elements, like an RL step
        changed[name] = RawTensor(t.dtype, t.shape, bits)
    version = await weightsync.latest_version(stack.addresses["weightsync"]) + 1
    async with open_channel(stack.addresses["rollout"]) as channel:
        stub = pb_grpc.RolloutStub(channel)
        applied = (await stub.Status(pb.RolloutStatusRequest())).updates_applied
        await weightsync.publish(stack.addresses["weightsync"], version, changed)
        deadline = time.monotonic() + 300
        # updates_applied moves only after last_apply_ms is recorded (policy_version moves first).
        while (status := await stub.Status(pb.RolloutStatusRequest())).updates_applied <= applied:
            if time.monotonic() > deadline:
                raise TimeoutError("rollout did not apply the bench's version")
            await asyncio.sleep(0.2)
    return status.last_apply_ms


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="meridian bench rollout", description=__doc__)
    parser.add_argument("--model", default="builtin", help="model folder or 'builtin'")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--repeat-prompts", type=int, default=2, help="each prompt is sent this many times")
    parser.add_argument("--latency-requests", type=int, default=20)
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    ns = parser.parse_args(argv)
    # vLLM and its engine processes log to stdout; keep stdout for the one JSON object.
    json_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    from transformers import AutoTokenizer

    from meridian import stack as stack_mod
    from meridian.model_store import resolve_model

    model_dir = resolve_model(ns.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt_ids = [list(tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]) for p in PROMPTS] * ns.repeat_prompts
    log = (lambda msg: None) if ns.json else (lambda msg: print(msg, file=sys.stderr, flush=True))

    log("measuring bare vLLM ...")
    bare = asyncio.run(_bare_vllm_tokens_per_s(str(model_dir), prompt_ids, ns.max_tokens, ns.concurrency, 1.0))
    log("starting the stack ...")
    config = stack_mod.StackConfig(run_dir=tempfile.mkdtemp(prefix="meridian-bench-rollout-"), model=str(model_dir), ports="auto")
    stack = stack_mod.start(config)
    try:
        measured = asyncio.run(_service_measurements(stack, prompt_ids, ns.max_tokens, ns.concurrency, ns.latency_requests))
        apply_ms = asyncio.run(_weight_apply_ms(stack, model_dir))
    finally:
        stack.stop(config.stop_timeout_s)
    result = {
        "model": ns.model,
        "bare_vllm_tokens_per_s": round(bare, 2),
        **{k: round(v, 2) for k, v in measured.items()},
        "overhead_pct": round(100.0 * (1.0 - measured["service_tokens_per_s"] / bare), 2),
        "prod_p99_ratio": round(measured["prod_p99_ms_with_rl"] / measured["prod_p99_ms"], 3),
        "weight_apply_ms": round(apply_ms, 1),
        "concurrency": ns.concurrency,
        "max_tokens": ns.max_tokens,
    }
    print(json.dumps(result), file=json_out, flush=True)
    return 0
