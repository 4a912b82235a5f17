"""``meridian bench rollout --json``: the rollout service against bare vLLM on the same
model and prompts; production latency with and without RL backfill; and real trainer
updates reaching the engine: how long applying each took, by which path, and how far
the served log-probs are from a transformers forward pass on the published weights
(before any update, as the baseline of two bf16 implementations, and after).

Production latency: one production trace (Poisson arrivals with bursts, mixed prompt
lengths; ``benchmarks.support.traffic``) is replayed with RL off and with RL backfill
on, alternating ``--rounds`` times; each round's p99 ratio (on / off) and the median
over rounds with its spread. ``rl_share_of_idle`` is the RL tokens per second of the
mixed phases over what bare vLLM produces in the time production left the engine idle.
The production latency targets of rollout's admission controller are ``--slo-factor``
times bare vLLM's own single-request TTFT and inter-token latency, unless
``--rollout-args`` sets them. Prints one JSON object."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shutil
import shlex
import statistics
import sys
import tempfile
import time
from typing import Any

from benchmarks.support.traffic import Arrival, TrafficConfig, busy_seconds, percentile, production_trace

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


async def _bare_vllm(model_dir: str, prompt_ids: list[list[int]], max_tokens: int, concurrency: int, kv_gib: float, cpus: str) -> dict[str, float]:
    """vLLM's own AsyncLLM in this process, no Meridian code on the path: throughput at
    ``concurrency``, and one request's median TTFT and time per later token. Its worker
    is bound as the stack's rollout is (``cpus``, see --engine-cpus), or the two would
    differ by their binding, not by Meridian."""
    import os

    from services.rollout.engine import cpu_binding_env, engine_environment

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(kv_gib))))
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    # Set only while its processes start: the stack started later must not inherit it.
    with engine_environment(cpu_binding_env(cpus)):
        llm = AsyncLLM.from_engine_args(AsyncEngineArgs(model=model_dir, dtype="bfloat16", max_model_len=2048, enforce_eager=True, disable_log_stats=True, seed=0))
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0)

        async def one(i: int, ids: list[int]) -> int:
            last = None
            async for out in llm.generate({"prompt_token_ids": ids}, params, request_id=f"bench-{i}-{time.monotonic_ns()}"):
                last = out
            return len(last.outputs[0].token_ids) if last else 0

        async def alone(i: int, ids: list[int]) -> tuple[float, float]:
            t0 = time.perf_counter()
            first = end = 0.0
            tokens = 0
            async for out in llm.generate({"prompt_token_ids": ids}, params, request_id=f"alone-{i}-{time.monotonic_ns()}"):
                end = time.perf_counter()
                first = first or end
                tokens = len(out.outputs[0].token_ids)
            return first - t0, (end - first) / max(1, tokens - 1)

        await one(-1, prompt_ids[0])  # warm-up
        singles = [await alone(i, ids) for i, ids in enumerate(prompt_ids[:8])]
        return {
            "tokens_per_s": await _throughput(one, prompt_ids, concurrency),
            "ttft_s": statistics.median(t for t, _ in singles),
            "itl_s": statistics.median(i for _, i in singles),
        }
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


async def _service_throughput(stub, prompt_ids: list[list[int]], max_tokens: int, concurrency: int) -> float:  # type: ignore[no-untyped-def]
    from meridian.v1 import rollout_pb2 as pb

    async def generate(i: int, ids: list[int]) -> int:
        n = 0
        request = pb.GenerateRequest(prompt_token_ids=ids, sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens))
        async for chunk in stub.Generate(request):
            n += len(chunk.token_ids)
        return n

    await generate(-1, prompt_ids[0])
    return await _throughput(generate, prompt_ids, concurrency)


async def _replay(stub, trace: list[Arrival], prompt_ids: list[list[int]]) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """Sends every arrival of ``trace`` at its time; per request TTFT and end-to-end
    latency, and the time production kept the engine busy."""
    from meridian.v1 import rollout_pb2 as pb

    t0 = time.perf_counter()
    ttft, total, intervals = [], [], []

    async def send(arrival: Arrival) -> None:
        await asyncio.sleep(max(0.0, t0 + arrival.at_s - time.perf_counter()))
        start = time.perf_counter()
        first = 0.0
        request = pb.GenerateRequest(prompt_token_ids=prompt_ids[arrival.prompt], sampling=pb.SamplingParams(temperature=0.0, max_tokens=arrival.max_tokens))
        async for chunk in stub.Generate(request):
            if chunk.token_ids and not first:
                first = time.perf_counter()
        end = time.perf_counter()
        ttft.append((first or end) - start)
        total.append(end - start)
        intervals.append((start, end))

    await asyncio.gather(*(send(a) for a in trace))
    return {"ttft": ttft, "latency": total, "seconds": time.perf_counter() - t0, "busy_s": busy_seconds(intervals)}


async def _rl_backfill(stub, stop: asyncio.Event, concurrency: int) -> None:  # type: ignore[no-untyped-def]
    """RL episodes (groups of 4, not published) until ``stop``, ``concurrency`` groups at once."""
    from meridian.v1 import rollout_pb2 as pb

    async def loop() -> None:
        while not stop.is_set():
            await stub.RunEpisodes(pb.RunEpisodesRequest(num_tasks=1, group_size=4, publish=False, sampling=pb.SamplingParams(max_tokens=64)))

    await asyncio.gather(*(loop() for _ in range(concurrency)))


async def _production_latency(stack, prompt_ids: list[list[int]], traffic: TrafficConfig, rounds: int, rl_groups: int, bare_tps: float, max_tokens: int, concurrency: int) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """The trace replayed alone and beside RL backfill, ``rounds`` times each, alternating."""
    from meridian.grpc_runtime import open_channel
    from meridian.v1 import rollout_pb2 as pb
    from meridian.v1 import rollout_pb2_grpc as pb_grpc

    trace = production_trace(traffic, len(prompt_ids))
    phases: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    async with open_channel(stack.addresses["rollout"]) as channel:
        stub = pb_grpc.RolloutStub(channel)
        service_tps = await _service_throughput(stub, prompt_ids, max_tokens, concurrency)
        for _ in range(rounds):
            phases["off"].append(await _replay(stub, trace, prompt_ids))
            stop = asyncio.Event()
            backfill = asyncio.create_task(_rl_backfill(stub, stop, rl_groups))
            await asyncio.sleep(2.0)  # RL occupies the engine before production starts
            start = await stub.Status(pb.RolloutStatusRequest())
            phase = await _replay(stub, trace, prompt_ids)
            end = await stub.Status(pb.RolloutStatusRequest())
            stop.set()
            await backfill
            phase["rl_tokens"] = end.rl_tokens - start.rl_tokens
            phase["preemptions"] = end.rl_preemptions - start.rl_preemptions
            phase["slo_attainment"] = end.slo_attainment
            phases["on"].append(phase)
    return _latency_figures(phases, bare_tps) | {"service_tokens_per_s": service_tps, "production_requests_per_phase": len(trace)}


def _latency_figures(phases: dict[str, list[dict[str, Any]]], bare_tps: float) -> dict[str, Any]:
    """Percentiles per phase, p99 ratios per round (median and spread), RL's share of idle."""
    def ms(values: list[float], q: float) -> float:
        return round(1000 * percentile(values, q), 1)

    off, on = phases["off"], phases["on"]
    ratios = [percentile(b["latency"], 0.99) / percentile(a["latency"], 0.99) for a, b in zip(off, on)]
    ttft_ratios = [percentile(b["ttft"], 0.99) / percentile(a["ttft"], 0.99) for a, b in zip(off, on)]
    shares = [p["rl_tokens"] / (bare_tps * max(1e-9, p["seconds"] - p["busy_s"])) for p in on]
    return {
        "prod_p99_ratio": round(statistics.median(ratios), 3),
        "prod_p99_ratio_each": [round(r, 3) for r in ratios],
        "prod_ttft_p99_ratio": round(statistics.median(ttft_ratios), 3),
        "prod_p50_ms": statistics.median(ms(p["latency"], 0.5) for p in off),
        "prod_p99_ms": statistics.median(ms(p["latency"], 0.99) for p in off),
        "prod_p50_ms_with_rl": statistics.median(ms(p["latency"], 0.5) for p in on),
        "prod_p99_ms_with_rl": statistics.median(ms(p["latency"], 0.99) for p in on),
        "prod_ttft_p99_ms": statistics.median(ms(p["ttft"], 0.99) for p in off),
        "prod_ttft_p99_ms_with_rl": statistics.median(ms(p["ttft"], 0.99) for p in on),
        "rl_share_of_idle": round(statistics.median(shares), 3),
        "rl_share_of_idle_each": [round(x, 3) for x in shares],
        "rl_tokens_per_s_backfill": round(statistics.median(p["rl_tokens"] / p["seconds"] for p in on), 2),
        "production_idle_fraction": round(statistics.median(1 - p["busy_s"] / p["seconds"] for p in on), 3),
        "preemptions": sum(p["preemptions"] for p in on),
        "slo_attainment_with_rl": round(min(p["slo_attainment"] for p in on), 4),
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
        "weight_apply_ms": round(statistics.median(applies), 1) if applies else None,  # --trainer-steps 0: none
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
    parser = argparse.ArgumentParser(prog="meridian bench rollout", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin", help="model folder or 'builtin'")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per request of the throughput comparison")
    parser.add_argument("--concurrency", type=int, default=8, help="requests at once in the throughput comparison")
    parser.add_argument("--repeat-prompts", type=int, default=2, help="each prompt is sent this many times in the throughput comparison")
    parser.add_argument("--requests", type=int, default=300, help="production requests per phase of the latency comparison")
    parser.add_argument("--rate", type=float, default=2.0, help="production arrivals per second (Poisson)")
    parser.add_argument("--burst-every", type=float, default=15.0, help="seconds between production bursts")
    parser.add_argument("--burst-size", type=int, default=6, help="requests per burst")
    parser.add_argument("--rounds", type=int, default=3, help="alternations of the RL-off and RL-on phases")
    parser.add_argument("--rl-groups", type=int, default=2, help="RL groups of 4 sampled at once during the RL-on phases")
    parser.add_argument("--slo-factor", type=float, default=1.25, help="rollout's latency targets: this times bare vLLM's single-request TTFT and ITL")
    parser.add_argument("--rollout-args", default="", help="extra rollout flags (e.g. '--rl-preempt false'); they win over the derived targets")
    parser.add_argument("--trainer-steps", type=int, default=3, help="real trainer updates whose arrival is measured")
    parser.add_argument("--weight-apply", choices=("delta", "full"), default="delta", help="rollout's apply path")
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    ns = parser.parse_args(argv)
    traffic = TrafficConfig(requests=ns.requests, rate_per_s=ns.rate, burst_every_s=ns.burst_every, burst_size=ns.burst_size)
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

    config = stack_mod.StackConfig(run_dir=tempfile.mkdtemp(prefix="meridian-bench-rollout-"), model=str(model_dir), ports="auto")
    log("measuring bare vLLM ...")
    extra = shlex.split(ns.rollout_args)
    # The rollout's binding: the stack's, or the last --engine-cpus of --rollout-args (argparse's rule).
    cpus = next((extra[i + 1] for i in range(len(extra) - 2, -1, -1) if extra[i] == "--engine-cpus"), config.engine_cpus)
    bare = asyncio.run(_bare_vllm(str(model_dir), prompt_ids, ns.max_tokens, ns.concurrency, 1.0, cpus))
    targets = ["--slo-ttft-ms", f"{1000 * ns.slo_factor * bare['ttft_s']:.1f}", "--slo-itl-ms", f"{1000 * ns.slo_factor * bare['itl_s']:.1f}"]
    rollout_args = ["--weight-apply", ns.weight_apply, *targets, *extra]
    log(f"starting the stack (rollout {' '.join(rollout_args)}) ...")
    stack = stack_mod.start(config, extra_args={"rollout": rollout_args})
    try:
        log(f"production latency: {ns.rounds} rounds of {ns.requests} requests with RL off, then on ...")
        measured = asyncio.run(_production_latency(stack, prompt_ids, traffic, ns.rounds, ns.rl_groups, bare["tokens_per_s"], ns.max_tokens, ns.concurrency))
        log("measuring trainer updates ...")
        updates = asyncio.run(_served_weights(stack, model_dir, tokenizer, ns.trainer_steps))
    finally:
        stack.stop(config.stop_timeout_s)
        shutil.rmtree(config.run_dir, ignore_errors=True)
    result = {
        "model": ns.model,
        "bare_vllm_tokens_per_s": round(bare["tokens_per_s"], 2),
        "bare_vllm_ttft_ms": round(1000 * bare["ttft_s"], 1),
        "bare_vllm_itl_ms": round(1000 * bare["itl_s"], 2),
        **measured,
        "service_tokens_per_s": round(measured["service_tokens_per_s"], 2),
        "overhead_pct": round(100.0 * (1.0 - measured["service_tokens_per_s"] / bare["tokens_per_s"]), 2),
        **updates,
        "rollout_args": rollout_args,
        "traffic": dataclasses.asdict(traffic),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "concurrency": ns.concurrency,
        "max_tokens": ns.max_tokens,
    }
    print(json.dumps(result), file=json_out, flush=True)
    return 0
