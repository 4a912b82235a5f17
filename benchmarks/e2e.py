"""``meridian bench e2e``: the whole RL loop on the local stack, the same job run
synchronously (sample, then train) and as the pipeline (sampling beside training), in
one run on one stack.

Reports trained samples per wall second of each mode (from the job's start to the last
version served), their ratio ``async_vs_sync_speedup``, median step figures (the
learner's step, the rollout's last weight apply), the trainer's peak RSS, and each
service's peak RSS (its process group's high-water marks, summed) and CPU seconds per
trained sample (``cpu_s_per_sample``: on a machine whose cores the services share, the
sum bounds throughput more than any one stage's time), with the load average.
The defaults follow the single-process comparison in the project's issue: the built-in
model, GRPO groups of 8, at most 64 tokens, lr 1e-6, four easy function tasks.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import shutil
import tempfile
from pathlib import Path
from typing import Any

FOUR_EASY_TASKS = "python/add,python/square,python/multiply,python/is_even"


def _log(message: str) -> None:
    print(f"[bench e2e] {message}", file=sys.stderr, flush=True)


def peak_rss_mb(pgid: int) -> float:
    """Sum of VmHWM (peak resident set) over the live members of a process group."""
    from meridian import stack as stack_mod

    total_kb = 0
    for pid in stack_mod.group_members(pgid):
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        total_kb += int(line.split()[1])
        except OSError:
            continue  # exited meanwhile
    return round(total_kb / 1024, 1)


def cpu_seconds(pgid: int) -> float:
    """CPU seconds (user + system, with reaped children's) of the live members of a process
    group: where a step's CPU goes on a machine whose cores every service shares."""
    from meridian import stack as stack_mod

    ticks = 0
    for pid in stack_mod.group_members(pgid):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue  # exited meanwhile
        fields = stat[stat.rindex(")") + 2 :].split()
        ticks += sum(int(f) for f in fields[11:15])  # utime, stime, cutime, cstime
    return ticks / os.sysconf("SC_CLK_TCK")


def _cpu_per_sample(before: dict[str, float], after: dict[str, float], samples: int) -> dict[str, float]:
    return {name: round((after[name] - before[name]) / max(1, samples), 3) for name in after}


async def _mode(addresses: dict[str, str], mode: str, ns: argparse.Namespace) -> dict[str, Any]:
    from meridian.train import Job, TrainConfig, service_status

    config = TrainConfig(
        steps=ns.steps, mode=mode, tasks_per_step=ns.tasks_per_step, group_size=ns.group_size, max_tokens=ns.max_tokens,
        lr=ns.lr, train_tasks=ns.tasks, temperature=ns.temperature, in_flight=ns.in_flight,
    )
    summary = await Job(addresses, config, progress=True).run()
    rollout = await service_status(addresses["rollout"], "rollout")
    steps = summary["trainer_steps"]

    def median(values: list[float]) -> float:
        return round(statistics.median(values), 3) if values else 0.0

    return {
        "samples_per_s": summary["samples_per_s"],
        "seconds": summary["seconds"],
        "trained_samples": summary["trained_samples"],
        "steps": summary["steps"],
        "dropped_stale": summary["dropped_stale_total"],
        "policy_lag_mean": round(statistics.mean(s["policy_lag_mean"] for s in steps), 3) if steps else 0.0,
        "learn_s_median": median([s["step_seconds"] for s in steps]),
        # Medians of each stage of a step. sample: one group's RunEpisodes request; learn:
        # the learner's step; commit: the loop's wait before the next step (weights
        # copied, canary, a due checkpoint's state copy); publish: the background publish;
        # apply: rollout's last in-place apply (checkpoints are written in the background).
        "step_breakdown_s": {
            "sample": median(summary["sample_seconds"]),
            "learn": median([s["step_seconds"] for s in steps]),
            "commit": median([s["commit_seconds"] for s in steps]),
            "publish": median([s["publish_seconds"] for s in steps if s["publish_seconds"]]),
            "apply": round(rollout.last_apply_ms / 1000, 3),
        },
        "wall_s_per_step": round(summary["seconds"] / max(1, summary["steps"]), 3),
        "last_apply_ms": round(rollout.last_apply_ms, 1),
        "trainer_peak_rss_mb": max((s["peak_rss_mb"] for s in steps), default=0.0),
    }


def run(ns: argparse.Namespace) -> dict[str, Any]:
    from meridian.train import TrainConfig, start_stack

    run_dir = tempfile.mkdtemp(prefix="meridian-bench-e2e-")
    job = TrainConfig(model=ns.model, tasks_per_step=ns.tasks_per_step, lr=ns.lr, max_policy_lag=ns.max_policy_lag, trainer_flags=ns.trainer_flags)
    stack, stack_config = start_stack(job, run_dir)

    def cpu() -> dict[str, float]:
        return {name: cpu_seconds(pid) for name, pid in stack.pids.items()}

    try:
        cpu_start = cpu()
        sync = asyncio.run(_mode(stack.addresses, "sync", ns))
        cpu_sync = cpu()
        sync["cpu_s_per_sample"] = _cpu_per_sample(cpu_start, cpu_sync, sync["trained_samples"])
        _log(f"sync: {sync}")
        asynchronous = asyncio.run(_mode(stack.addresses, "async", ns))
        asynchronous["cpu_s_per_sample"] = _cpu_per_sample(cpu_sync, cpu(), asynchronous["trained_samples"])
        _log(f"async: {asynchronous}")
        services = {name: peak_rss_mb(pid) for name, pid in stack.pids.items()}
    finally:
        stack.stop(stack_config.stop_timeout_s)
        # The run folder holds checkpoints and every version (~3.6 GB on the built-in model).
        shutil.rmtree(run_dir, ignore_errors=True)
    return {
        "async_samples_per_s": asynchronous["samples_per_s"],
        "sync_samples_per_s": sync["samples_per_s"],
        "async_vs_sync_speedup": round(asynchronous["samples_per_s"] / sync["samples_per_s"], 3) if sync["samples_per_s"] else None,
        "async": asynchronous,
        "sync": sync,
        "peak_rss_mb": services,
        "model": ns.model,
        "group_size": ns.group_size,
        "tasks_per_step": ns.tasks_per_step,
        "max_tokens": ns.max_tokens,
        "lr": ns.lr,
        "steps_per_mode": ns.steps,
        "trainer_flags": ns.trainer_flags,
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "cpus": os.cpu_count(),
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="meridian bench e2e", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object (the default output is the same object, indented)")
    parser.add_argument("--model", default="builtin", help="'builtin' or a model folder")
    parser.add_argument("--steps", type=int, default=6, help="trainer steps per mode (the pipeline fills and drains once per mode)")
    parser.add_argument("--tasks-per-step", type=int, default=1, help="GRPO groups per trainer step")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--max-policy-lag", type=int, default=4, help="the trainer's default (a bound of 2 dropped one group of every five in the pipeline)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--in-flight", type=int, default=2, help="async: RunEpisodes requests kept running")
    parser.add_argument("--tasks", default=FOUR_EASY_TASKS, help="comma-separated task ids, cycled through")
    parser.add_argument("--trainer-flags", default="", help="more trainer flags, e.g. '--autocast-bf16 true --attention eager --threads 1'")
    ns = parser.parse_args(argv)
    result = run(ns)
    print(json.dumps(result) if ns.json else json.dumps(result, indent=2))
    return 0
