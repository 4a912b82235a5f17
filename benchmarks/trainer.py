"""``meridian bench trainer [--json]``: the trainer's cost over a bare PyTorch loop, and
asynchronous versus synchronous RL on the local stack.

1. Step overhead: on the same batch (prompts shaped like an episode's: the chat template
   with the agent's system prompt, unless ``--plain-prompt``), a step through
   ``Learner.step`` (group filtering, batch building, loss, clipping, AdamW, schedule)
   versus a bare loop with the same model, the same prebuilt padded tensors, the same
   loss and optimiser; and the learner with padded rows instead of shared-prefix packing
   (``packing_speedup``). The kinds alternate so machine load hits them alike; medians;
   ``overhead_pct`` (negative: faster than the bare padded loop).
2. ``async_vs_sync_speedup``: wall time for the trainer to make ``--stack-steps`` steps
   when rollout samples and the trainer trains one after the other (sync), versus two
   sampling loops that never wait for the trainer (async; stale samples are bounded by
   the trainer's max_policy_lag). The stack runs the tiny random model by default
   (the built-in model makes this part take many minutes on a CPU); ``--stack-model``
   changes it, ``--stack-steps 0`` skips it.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import sys
import shutil
import tempfile
import time
from typing import Any


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def bench_step(model: str, steps: int, groups: int, group_size: int, tokens: int, threads: int, autocast: bool, agent_prompt: bool, attention: str) -> dict[str, Any]:
    import torch

    from meridian.model_store import resolve_model
    from services.trainer.batch import build_batch, token_logprobs
    from services.trainer.config import TrainerConfig
    from services.trainer.learner import Learner
    from services.trainer.loss import clipped_pg_loss
    from benchmarks.support.synthetic import fixed_groups

    from services.rollout.agent import SYSTEM_PROMPT

    model_dir = resolve_model(model)
    system = SYSTEM_PROMPT.replace("{answer_path}", "solution.py") if agent_prompt else None
    batch_groups = fixed_groups(model_dir, groups, group_size, completion_tokens=tokens, system_prompt=system)
    # Lag bound and equal-reward rule must keep every sample (the bare loop has neither).
    config = TrainerConfig(model=model, lr=1e-6, threads=threads, groups_per_step=groups, max_policy_lag=10**6, autocast_bf16=autocast, attention=attention)
    learner = Learner(model_dir, config)
    padded = Learner(model_dir, dataclasses.replace(config, pack_prefix=False))
    bare_model = type(learner.module).from_pretrained(model_dir, dtype=torch.float32)
    bare_model.train()
    bare_opt = torch.optim.AdamW(bare_model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    batch = build_batch(batch_groups, learner.pad_id, learner.loss_config)

    def bare_step() -> float:
        start = time.perf_counter()
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
        with ctx:
            out = bare_model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
        logprobs = token_logprobs(out.logits, batch.input_ids)
        loss, _ = clipped_pg_loss(logprobs, batch.behaviour_logprobs, batch.advantages, batch.target_mask, learner.loss_config, batch.token_weights, scale=batch.token_scale)
        bare_opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(bare_model.parameters(), config.max_grad_norm)
        bare_opt.step()
        return time.perf_counter() - start

    def trainer_step(which: Any = learner) -> float:
        start = time.perf_counter()
        result = which.step(batch_groups)
        assert result.stepped
        return time.perf_counter() - start

    kinds = {"trainer": trainer_step, "padded": lambda: trainer_step(padded), "bare": bare_step}
    for run in kinds.values():
        run()  # warm-up: allocator, kernels, optimiser state
    times: dict[str, list[float]] = {name: [] for name in kinds}
    for i in range(steps):
        # Rotate the order so machine load hits each kind alike.
        order = list(kinds)[i % len(kinds) :] + list(kinds)[: i % len(kinds)]
        for name in order:
            times[name].append(kinds[name]())
        _log(f"step {i + 1}/{steps}: " + " ".join(f"{name} {t[-1]:.3f}s" for name, t in times.items()))
    step_s, padded_s, bare_s = (statistics.median(times[name]) for name in kinds)
    return {
        "step_s": round(step_s, 4),
        "bare_torch_step_s": round(bare_s, 4),
        "overhead_pct": round(100 * (step_s - bare_s) / bare_s, 2),
        # The same learner with padded rows instead of the shared-prefix packing.
        "padded_step_s": round(padded_s, 4),
        "packing_speedup": round(padded_s / step_s, 3),
        "agent_prompt": agent_prompt,
        "attention": attention,
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "step_model": model,
        "batch_trajectories": groups * group_size,
        "batch_tokens": int(batch.attention_mask.sum()),
        "autocast_bf16": autocast,
        "threads": threads,
        "repeats": steps,
    }


async def _stack_mode(stack: Any, mode: str, steps: int, task: str, group_size: int, max_tokens: int) -> dict[str, Any]:
    from meridian.grpc_runtime import open_channel
    from meridian.v1 import rollout_pb2, rollout_pb2_grpc, trainer_pb2, trainer_pb2_grpc

    async def trainer_status() -> Any:
        async with open_channel(stack.addresses["trainer"]) as ch:
            return await trainer_pb2_grpc.TrainerStub(ch).Status(trainer_pb2.TrainerStatusRequest(), timeout=10)

    request = rollout_pb2.RunEpisodesRequest(task_ids=[task], group_size=group_size, publish=True, sampling=rollout_pb2.SamplingParams(max_tokens=max_tokens))
    start_step = (await trainer_status()).step
    target = start_step + steps
    started = time.monotonic()
    sampled = 0
    async with open_channel(stack.addresses["rollout"]) as ch:
        rollout = rollout_pb2_grpc.RolloutStub(ch)
        if mode == "sync":
            while (await trainer_status()).step < target:
                before = (await trainer_status()).trajectories_consumed
                sampled += len((await rollout.RunEpisodes(request)).trajectories)
                # The trainer consumes this group (a step, or a skipped flat group) before the next sample.
                while (await trainer_status()).trajectories_consumed < before + group_size:
                    await asyncio.sleep(0.05)
        else:
            done = asyncio.Event()

            async def sampler() -> None:
                nonlocal sampled
                while not done.is_set():
                    sampled += len((await rollout.RunEpisodes(request)).trajectories)

            tasks = [asyncio.create_task(sampler()) for _ in range(2)]
            while (await trainer_status()).step < target:
                await asyncio.sleep(0.05)
            done.set()
            await asyncio.gather(*tasks)
    seconds = time.monotonic() - started
    status = await trainer_status()
    return {"seconds": round(seconds, 2), "trajectories_sampled": sampled, "dropped_stale_total": status.dropped_stale_total}


def bench_stack(model: str, steps: int, task: str, group_size: int, max_tokens: int) -> dict[str, Any]:
    from meridian import stack as stack_mod

    run_dir = tempfile.mkdtemp(prefix="meridian-bench-trainer-")
    config = stack_mod.StackConfig(run_dir=run_dir, model=model, ports="auto")
    _log(f"starting the local stack ({model}) in {run_dir} ...")
    extra = {"trainer": ["--lr", "1e-4", "--max-policy-lag", "2", "--threads", "1"]}
    stack = stack_mod.start(config, extra_args=extra)
    try:
        sync = asyncio.run(_stack_mode(stack, "sync", steps, task, group_size, max_tokens))
        _log(f"sync: {sync}")
        asynchronous = asyncio.run(_stack_mode(stack, "async", steps, task, group_size, max_tokens))
        _log(f"async: {asynchronous}")
    finally:
        stack.stop(config.stop_timeout_s)
        shutil.rmtree(run_dir, ignore_errors=True)
    return {
        "async_vs_sync_speedup": round(sync["seconds"] / asynchronous["seconds"], 3),
        "sync_s": sync["seconds"],
        "async_s": asynchronous["seconds"],
        "stack_steps": steps,
        "stack_model": model,
        "stack_task": task,
        "async_trajectories_sampled": asynchronous["trajectories_sampled"],
        "sync_trajectories_sampled": sync["trajectories_sampled"],
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="meridian bench trainer", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object (the default output is the same object, indented)")
    parser.add_argument("--model", default="builtin", help="model for the step comparison")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps of each kind (medians)")
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64, help="completion tokens per trajectory")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--autocast-bf16", action="store_true", help="both loops under bf16 autocast")
    parser.add_argument("--attention", default="sdpa", choices=("sdpa", "eager"), help="the learner's attention kernel (the bare loop keeps the model's default)")
    parser.add_argument("--plain-prompt", action="store_true", help="bare instructions as prompts instead of the episodes' chat prompt (system prompt with the tool protocol)")
    parser.add_argument("--stack-model", default="tiny", help="'tiny' (a tiny random model), 'builtin' or a model folder")
    parser.add_argument("--stack-steps", type=int, default=4, help="trainer steps per mode on the stack (0: skip)")
    parser.add_argument("--stack-task", default="text/shout", help="task sampled on the stack (graded reward, so groups differ)")
    parser.add_argument("--group-size-stack", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    ns = parser.parse_args(argv)
    result = bench_step(ns.model, ns.repeats, ns.groups, ns.group_size, ns.tokens, ns.threads, ns.autocast_bf16, not ns.plain_prompt, ns.attention)
    if ns.stack_steps > 0:
        stack_model = ns.stack_model
        if stack_model == "tiny":
            from meridian.model_store import cache_dir, make_tiny_model

            stack_model = str(make_tiny_model(cache_dir() / "models" / "tiny-llama-bench"))
        result.update(bench_stack(stack_model, ns.stack_steps, ns.stack_task, ns.group_size_stack, ns.max_tokens))
        result["stack_model"] = ns.stack_model
    print(json.dumps(result) if ns.json else json.dumps(result, indent=2))
    return 0
