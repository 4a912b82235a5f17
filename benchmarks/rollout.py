"""``meridian bench rollout --json``: the rollout service against bare vLLM on the same
model and prompts, production latency with and without RL backfill, and real trainer
updates reaching the engine: how long applying each took, by which path, and how far
the served log-probs are from a transformers forward pass on the published weights
(before any update, as the baseline of two bf16 implementations, and after).
Prints one JSON object."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
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


async def _served_weights(stack, model_dir, tokenizer, steps: int) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """Drives ``steps`` real trainer steps (fixed synthetic groups through the stream, the
    stack's learner at its own learning rate) and measures each update's arrival."""
    from meridian.grpc_runtime import open_channel
    from meridian.trajectory_transport import TransportConfig, open_transport
    from meridian.v1 import rollout_pb2 as pb
    from meridian.v1 import rollout_pb2_grpc as pb_grpc
    from benchmarks.support.synthetic import fixed_groups

    sequences = [list(tokenizer(p + "\n" + c)["input_ids"]) for p, c in zip(PROMPTS, SCORED_COMPLETIONS)]
    out: dict[str, object] = {}
    async with open_channel(stack.addresses["rollout"]) as channel:
        stub = pb_grpc.RolloutStub(channel)
        base = await _served_vs_reference(stub, model_dir, stack.addresses["weightsync"], sequences)
        out["served_logprob_max_diff_v0"], out["served_logprob_mean_diff_v0"] = base
        stream = open_transport(TransportConfig(url=stack.redis_url))
        applies, paths, readback = [], set(), 0
        try:
            for step in range(1, steps + 1):
                status = await stub.Status(pb.RolloutStatusRequest())
                for group in fixed_groups(model_dir, 1, group_size=4, seed=step, versions=[status.policy_version]):
                    await stream.publish_group(group)
                # The report is recorded just after the version switches: wait for it too.
                status = await _wait(stub, lambda s, v=status.policy_version, n=status.updates_applied: s.policy_version > v and s.updates_applied > n)
                applies.append(status.last_apply_ms)
                paths.add(status.apply_path)
                readback = status.readback_elements
                out["canary_mean_diff"], out["canary_max_diff"] = round(status.canary_mean_diff, 4), round(status.canary_max_diff, 4)
        finally:
            await stream.close()
        after = await _served_vs_reference(stub, model_dir, stack.addresses["weightsync"], sequences)
        out["served_logprob_max_diff"], out["served_logprob_mean_diff"] = after
        out["updates_rejected"] = (await stub.Status(pb.RolloutStatusRequest())).updates_rejected
    out.update({
        "weight_apply_ms": round(statistics.median(applies), 1),
        "weight_apply_ms_each": [round(a, 1) for a in applies],
        "apply_path": "/".join(sorted(paths)),
        "readback_elements": readback,
        "trainer_updates": steps,
    })
    return out


SCORED_COMPLETIONS = [
    "def factorial(n):\n    return 1 if n < 2 else n * factorial(n - 1)\n",
    "A hash map stores values under keys and finds them in constant time on average.",
    "find . -name '*.py' | xargs wc -l",
    "It turns a function into a generator that produces values lazily.",
]


async def _wait(stub, done, timeout_s: float = 600):  # type: ignore[no-untyped-def]
    from meridian.v1 import rollout_pb2 as pb

    deadline = time.monotonic() + timeout_s
    while not done(status := await stub.Status(pb.RolloutStatusRequest())):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rollout did not reach the awaited state: {status}")
        await asyncio.sleep(0.2)
    return status


async def _served_vs_reference(stub, model_dir, weightsync_address: str, sequences: list[list[int]]) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """Max and mean |served - transformers| log-prob over ``sequences``, the reference on
    the weights weightsync holds for the version rollout says it serves."""
    import torch
    from transformers import AutoModelForCausalLM

    from meridian.v1 import rollout_pb2 as pb
    from services.trainer.learner import canary_logprobs
    from services.weightsync.client import WeightSubscriber

    served, versions = [], set()
    for ids in sequences:
        reply = await stub.Score(pb.ScoreRequest(token_ids=ids))
        served.append(torch.tensor(list(reply.logprobs)))
        versions.add(reply.policy_version)
    subscriber = WeightSubscriber(weightsync_address, None, -1)
    try:
        async for update in subscriber.updates(follow=False):
            weights, version = update.weights, update.version
    finally:
        await subscriber.close()
    if versions != {version}:
        raise RuntimeError(f"rollout served versions {sorted(versions)} while weightsync holds {version}")
    module = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    reference = [torch.tensor(r) for r in canary_logprobs(module, weights, sequences)]
    diffs = torch.cat([(a - b).abs()[1:] for a, b in zip(served, reference)])
    return round(diffs.max().item(), 4), round(diffs.mean().item(), 4)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="meridian bench rollout", description=__doc__)
    parser.add_argument("--model", default="builtin", help="model folder or 'builtin'")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--repeat-prompts", type=int, default=2, help="each prompt is sent this many times")
    parser.add_argument("--latency-requests", type=int, default=20)
    parser.add_argument("--trainer-steps", type=int, default=3, help="real trainer updates whose arrival is measured")
    parser.add_argument("--weight-apply", choices=("delta", "full"), default="delta", help="rollout's apply path")
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
    stack = stack_mod.start(config, extra_args={"rollout": ["--weight-apply", ns.weight_apply]})
    try:
        measured = asyncio.run(_service_measurements(stack, prompt_ids, ns.max_tokens, ns.concurrency, ns.latency_requests))
        log("measuring trainer updates ...")
        updates = asyncio.run(_served_weights(stack, model_dir, tokenizer, ns.trainer_steps))
    finally:
        stack.stop(config.stop_timeout_s)
        shutil.rmtree(config.run_dir, ignore_errors=True)
    result = {
        "model": ns.model,
        "bare_vllm_tokens_per_s": round(bare, 2),
        **{k: round(v, 2) for k, v in measured.items()},
        "overhead_pct": round(100.0 * (1.0 - measured["service_tokens_per_s"] / bare), 2),
        "prod_p99_ratio": round(measured["prod_p99_ms_with_rl"] / measured["prod_p99_ms"], 3),
        **updates,
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "concurrency": ns.concurrency,
        "max_tokens": ns.max_tokens,
    }
    print(json.dumps(result), file=json_out, flush=True)
    return 0
