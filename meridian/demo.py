"""``meridian demo``: start the local stack, evaluate the model on the held-out split,
run a short RL job through all four services on a training subset of the built-in
tasks, evaluate again, write a report folder (a PNG plot of reward, pass rate, policy
lag and weight-sync bytes per step, and ``summary.json``), print a summary (or one
JSON object), and stop the stack. The plot needs matplotlib."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

from meridian import stack as stack_mod
from meridian.config import add_config_args, config_from_args, opt


# Easy python_function tasks of the training split: the built-in 135M model solves them
# some of the time, so GRPO groups have reward variance to learn from.
TRAIN_TASKS = (
    "python/add,python/square,python/multiply,python/is_even,python/last_element,python/max_of_list,"
    "python/factorial,python/sum_of_squares,python/count_vowels,python/reverse_words,python/clamp,python/gcd"
)
# The held-out split (tasks marked "eval") of the same kind.
EVAL_TASKS = (
    "python/reverse_string,python/is_palindrome,python/fibonacci,python/celsius_to_fahrenheit,"
    "python/is_prime,python/is_anagram,python/second_largest,python/balanced_brackets"
)


@dataclasses.dataclass
class DemoConfig:
    steps: int = opt(8, "RL steps (sample, then train one version)")
    model: str = opt("builtin", "model folder, or 'builtin' for SmolLM2-135M-Instruct")
    tasks_per_step: int = opt(2, "tasks (GRPO groups) sampled per step")
    group_size: int = opt(6, "samples per task")
    max_tokens: int = opt(128, "generated tokens per sample")
    lr: float = opt(1e-5, "trainer learning rate")
    train_tasks: str = opt(TRAIN_TASKS, "comma-separated training task ids (cycled through; empty: the server picks)")
    eval_tasks: str = opt(EVAL_TASKS, "comma-separated held-out task ids (split eval) evaluated before and after (empty: skip)")
    temperature: float = opt(0.6, "sampling temperature of the training episodes (the rollout's RL default, 1.0, makes the 135M model fail nearly every task)")
    eval_samples: int = opt(2, "samples per held-out task")
    eval_temperature: float = opt(0.2, "sampling temperature of the evaluation (low: close to greedy)")
    step_timeout_s: float = opt(600.0, "seconds to wait for each new version to reach rollout")
    run_dir: str = opt("", "stack run folder (empty: a temporary one)")
    report_dir: str = opt("", "report folder (empty: <run_dir>/report)")

    def __post_init__(self) -> None:
        if self.steps <= 0 or self.tasks_per_step <= 0 or self.group_size < 2:
            raise ValueError("steps and tasks_per_step must be positive, group_size >= 2")
        if self.eval_samples < 2 or self.eval_temperature < 0 or self.temperature < 0:
            raise ValueError("eval_samples must be >= 2 (one group) and eval_temperature >= 0")


async def _status(address: str, kind: str):  # type: ignore[no-untyped-def]
    from meridian.grpc_runtime import open_channel
    from meridian.v1 import rollout_pb2, rollout_pb2_grpc, trainer_pb2, trainer_pb2_grpc

    async with open_channel(address) as channel:
        if kind == "rollout":
            return await rollout_pb2_grpc.RolloutStub(channel).Status(rollout_pb2.RolloutStatusRequest(), timeout=10)
        return await trainer_pb2_grpc.TrainerStub(channel).Status(trainer_pb2.TrainerStatusRequest(), timeout=10)


def _ids(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


async def evaluate(stack: stack_mod.Stack, config: DemoConfig) -> dict[str, object]:
    """Pass rate (reward 1: every test passed) and mean reward on the held-out tasks; not trained on."""
    from meridian.grpc_runtime import open_channel
    from meridian.v1 import rollout_pb2, rollout_pb2_grpc

    tasks = _ids(config.eval_tasks)
    async with open_channel(stack.addresses["rollout"]) as channel:
        reply = await rollout_pb2_grpc.RolloutStub(channel).RunEpisodes(
            rollout_pb2.RunEpisodesRequest(
                task_ids=tasks,
                group_size=config.eval_samples,
                publish=False,
                sampling=rollout_pb2.SamplingParams(max_tokens=config.max_tokens, temperature=config.eval_temperature),
            )
        )
    rewards = [t.reward for t in reply.trajectories]
    per_task: dict[str, list[float]] = {}
    for t in reply.trajectories:
        per_task.setdefault(t.task_id, []).append(t.reward)
    return {
        "pass_rate": sum(1 for r in rewards if r >= 1.0) / len(rewards),
        "reward_mean": sum(rewards) / len(rewards),
        "samples": len(rewards),
        "per_task_reward": {k: sum(v) / len(v) for k, v in sorted(per_task.items())},
    }


async def run_job(stack: stack_mod.Stack, config: DemoConfig, progress: bool = True) -> dict[str, object]:
    """Runs ``config.steps`` synchronous RL steps on a running stack; returns the summary.

    Each step samples, then waits until the trainer has consumed those samples and the
    rollout serves the trainer's version (a batch of groups with equal rewards makes no
    new version, and the step moves on without one).
    """
    from meridian.grpc_runtime import open_channel
    from meridian.v1 import rollout_pb2, rollout_pb2_grpc

    start_version = (await _status(stack.addresses["rollout"], "rollout")).policy_version
    rewards: list[float] = []
    pass_rates: list[float] = []
    produced = 0
    started = time.monotonic()
    train = _ids(config.train_tasks)
    consumed0 = (await _status(stack.addresses["trainer"], "trainer")).trajectories_consumed
    async with open_channel(stack.addresses["rollout"]) as channel:
        rollout = rollout_pb2_grpc.RolloutStub(channel)
        for step in range(1, config.steps + 1):
            t0 = time.monotonic()
            picked = [train[((step - 1) * config.tasks_per_step + i) % len(train)] for i in range(config.tasks_per_step)] if train else []
            reply = await rollout.RunEpisodes(
                rollout_pb2.RunEpisodesRequest(
                    task_ids=picked,
                    num_tasks=0 if picked else config.tasks_per_step,
                    group_size=config.group_size,
                    publish=True,
                    sampling=rollout_pb2.SamplingParams(max_tokens=config.max_tokens, temperature=config.temperature),
                )
            )
            produced += len(reply.trajectories)
            step_rewards = [t.reward for t in reply.trajectories]
            rewards.append(sum(step_rewards) / len(step_rewards))
            pass_rates.append(sum(1 for r in step_rewards if r >= 1.0) / len(step_rewards))
            deadline = time.monotonic() + config.step_timeout_s
            while True:
                trainer = await _status(stack.addresses["trainer"], "trainer")
                version = (await _status(stack.addresses["rollout"], "rollout")).policy_version
                if trainer.trajectories_consumed - consumed0 >= produced and version >= trainer.policy_version:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rollout still serves version {version} {config.step_timeout_s:.0f}s after step {step}")
                await asyncio.sleep(0.5)
            if progress:
                print(
                    f"step {step}/{config.steps}: reward {rewards[-1]:.3f}, pass rate {pass_rates[-1]:.2f} over {len(step_rewards)} samples of {picked}, "
                    f"rollout now serves version {version} ({time.monotonic() - t0:.1f}s)",
                    file=sys.stderr,
                    flush=True,
                )
    trainer = await _status(stack.addresses["trainer"], "trainer")
    end_version = (await _status(stack.addresses["rollout"], "rollout")).policy_version
    return {
        "steps": config.steps,
        "reward_mean": rewards,
        "pass_rate": pass_rates,
        "policy_version_start": start_version,
        "policy_version_end": end_version,
        "trajectories_produced": produced,
        "trajectories_consumed": trainer.trajectories_consumed,
        "model": config.model,
        "seconds": round(time.monotonic() - started, 1),
        "trainer_steps": [
            {
                "step": m.step,
                "policy_version": m.policy_version,
                "stepped": m.stepped,
                "reward_mean": m.reward_mean,
                "pass_rate": m.pass_rate,
                "policy_lag_mean": m.policy_lag_mean,
                "weightsync_encoded_bytes": m.weightsync_encoded_bytes,
                "weightsync_raw_bytes": m.weightsync_raw_bytes,
                "loss": m.loss,
                "grad_norm": m.grad_norm,
                "dropped_groups": m.dropped_groups,
                "dropped_stale": m.dropped_stale,
            }
            for m in trainer.recent_steps
        ],
    }


def write_report(report_dir: Path, summary: dict[str, object]) -> Path:
    """Writes summary.json and training.png (reward, pass rate, policy lag, weight-sync bytes per step)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report_dir.mkdir(parents=True, exist_ok=True)
    (report_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    steps = summary["trainer_steps"]  # type: ignore[assignment]
    x = list(range(1, len(steps) + 1))  # type: ignore[arg-type]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    panels = [
        ("reward (mean of the batch)", [s["reward_mean"] for s in steps], axes[0][0]),  # type: ignore[index,union-attr]
        ("pass rate (reward 1)", [s["pass_rate"] for s in steps], axes[0][1]),  # type: ignore[index,union-attr]
        ("policy lag (versions, mean)", [s["policy_lag_mean"] for s in steps], axes[1][0]),  # type: ignore[index,union-attr]
        ("weight-sync bytes (encoded)", [s["weightsync_encoded_bytes"] for s in steps], axes[1][1]),  # type: ignore[index,union-attr]
    ]
    for title, values, ax in panels:
        ax.plot(x, values, marker="o")
        ax.set_title(title)
        ax.set_xlabel("trainer batch")
        ax.grid(alpha=0.3)
    before, after = summary.get("eval_pass_rate_before"), summary.get("eval_pass_rate_after")
    fig.suptitle(f"Meridian demo ({summary['model']}): held-out pass rate {before} -> {after}")
    fig.tight_layout()
    path = report_dir / "training.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


async def run_demo(stack: stack_mod.Stack, config: DemoConfig, progress: bool = True) -> dict[str, object]:
    """Held-out evaluation, the RL job, held-out evaluation again."""
    before = await evaluate(stack, config) if config.eval_tasks else None
    if progress and before:
        print(f"held-out before: pass rate {before['pass_rate']:.3f}, reward {before['reward_mean']:.3f}", file=sys.stderr, flush=True)
    summary = await run_job(stack, config, progress)
    after = await evaluate(stack, config) if config.eval_tasks else None
    if progress and after:
        print(f"held-out after: pass rate {after['pass_rate']:.3f}, reward {after['reward_mean']:.3f}", file=sys.stderr, flush=True)
    summary["eval_pass_rate_before"] = before["pass_rate"] if before else None
    summary["eval_pass_rate_after"] = after["pass_rate"] if after else None
    summary["eval_before"] = before
    summary["eval_after"] = after
    summary["train_tasks"] = _ids(config.train_tasks)
    summary["eval_tasks"] = _ids(config.eval_tasks)
    return summary


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="meridian demo", description=__doc__)
    add_config_args(parser, DemoConfig, "demo")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a summary")
    ns = parser.parse_args(argv)
    try:
        config = config_from_args(DemoConfig, ns, "demo")
    except ValueError as exc:
        parser.error(str(exc))
    run_dir = config.run_dir or tempfile.mkdtemp(prefix="meridian-demo-")
    stack_config = stack_mod.StackConfig(run_dir=run_dir, model=config.model, ports="auto")
    print(f"starting the local stack in {run_dir} (model {config.model}) ...", file=sys.stderr, flush=True)
    extra = {"trainer": ["--lr", repr(config.lr), "--groups-per-step", str(config.tasks_per_step), "--threads", "2"]}
    stack = stack_mod.start(stack_config, extra_args=extra)
    try:
        summary = asyncio.run(run_demo(stack, config, progress=True))
    finally:
        stack.stop(stack_config.stop_timeout_s)
    report_dir = Path(config.report_dir or Path(run_dir) / "report")
    summary["report_dir"] = str(report_dir)
    plot = write_report(report_dir, summary)
    print(f"report: {plot} and {report_dir / 'summary.json'}", file=sys.stderr, flush=True)
    if ns.json:
        print(json.dumps(summary))
    else:
        print("\nMeridian demo summary")
        for key, value in summary.items():
            if key != "trainer_steps":
                print(f"  {key:<22} {value}")
    return 0 if summary["policy_version_end"] > summary["policy_version_start"] else 1  # type: ignore[operator]
