"""``meridian demo``: start the local stack, run a short RL job through all four
services, print a summary (or one JSON object), and stop the stack."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import tempfile
import time

from meridian import stack as stack_mod
from meridian.config import add_config_args, config_from_args, opt


@dataclasses.dataclass
class DemoConfig:
    steps: int = opt(3, "RL steps (one policy version each)")
    model: str = opt("builtin", "model folder, or 'builtin' for SmolLM2-135M-Instruct")
    tasks_per_step: int = opt(2, "tasks (GRPO groups) sampled per step")
    group_size: int = opt(4, "samples per task")
    max_tokens: int = opt(128, "generated tokens per sample")
    lr: float = opt(1e-6, "trainer learning rate")
    step_timeout_s: float = opt(600.0, "seconds to wait for each new version to reach rollout")
    run_dir: str = opt("", "stack run folder (empty: a temporary one)")

    def __post_init__(self) -> None:
        if self.steps <= 0 or self.tasks_per_step <= 0 or self.group_size < 2:
            raise ValueError("steps and tasks_per_step must be positive, group_size >= 2")


async def _status(address: str, kind: str):  # type: ignore[no-untyped-def]
    from meridian.grpc_runtime import open_channel
    from meridian.v1 import rollout_pb2, rollout_pb2_grpc, trainer_pb2, trainer_pb2_grpc

    async with open_channel(address) as channel:
        if kind == "rollout":
            return await rollout_pb2_grpc.RolloutStub(channel).Status(rollout_pb2.RolloutStatusRequest(), timeout=10)
        return await trainer_pb2_grpc.TrainerStub(channel).Status(trainer_pb2.TrainerStatusRequest(), timeout=10)


async def run_job(stack: stack_mod.Stack, config: DemoConfig, progress: bool = True) -> dict[str, object]:
    """Runs ``config.steps`` synchronous RL steps on a running stack; returns the summary."""
    from meridian.grpc_runtime import open_channel
    from meridian.v1 import rollout_pb2, rollout_pb2_grpc

    start_version = (await _status(stack.addresses["rollout"], "rollout")).policy_version
    rewards: list[float] = []
    produced = 0
    started = time.monotonic()
    async with open_channel(stack.addresses["rollout"]) as channel:
        rollout = rollout_pb2_grpc.RolloutStub(channel)
        for step in range(1, config.steps + 1):
            t0 = time.monotonic()
            reply = await rollout.RunEpisodes(
                rollout_pb2.RunEpisodesRequest(
                    num_tasks=config.tasks_per_step,
                    group_size=config.group_size,
                    publish=True,
                    sampling=rollout_pb2.SamplingParams(max_tokens=config.max_tokens),
                )
            )
            produced += len(reply.trajectories)
            step_rewards = [t.reward for t in reply.trajectories]
            rewards.append(sum(step_rewards) / len(step_rewards))
            target = start_version + step
            deadline = time.monotonic() + config.step_timeout_s
            while (version := (await _status(stack.addresses["rollout"], "rollout")).policy_version) < target:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rollout still serves version {version} {config.step_timeout_s:.0f}s after step {step}")
                await asyncio.sleep(0.5)
            if progress:
                print(
                    f"step {step}/{config.steps}: reward {rewards[-1]:.3f} over {len(step_rewards)} samples, "
                    f"rollout now serves version {version} ({time.monotonic() - t0:.1f}s)",
                    file=sys.stderr,
                    flush=True,
                )
    trainer = await _status(stack.addresses["trainer"], "trainer")
    end_version = (await _status(stack.addresses["rollout"], "rollout")).policy_version
    return {
        "steps": config.steps,
        "reward_mean": rewards,
        "policy_version_start": start_version,
        "policy_version_end": end_version,
        "trajectories_produced": produced,
        "trajectories_consumed": trainer.trajectories_consumed,
        "model": config.model,
        "seconds": round(time.monotonic() - started, 1),
    }


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
        summary = asyncio.run(run_job(stack, config, progress=True))
    finally:
        stack.stop(stack_config.stop_timeout_s)
    if ns.json:
        print(json.dumps(summary))
    else:
        print("\nMeridian demo summary")
        for key, value in summary.items():
            print(f"  {key:<22} {value}")
    return 0 if summary["policy_version_end"] > summary["policy_version_start"] else 1  # type: ignore[operator]
