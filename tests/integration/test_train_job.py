"""``meridian train``'s job against the real local stack (tiny model): in both modes it
drives the trainer the requested number of steps and rollout ends up serving them."""
from __future__ import annotations

import asyncio

import pytest

from meridian import stack as stack_mod
from meridian.train import Job, TrainConfig

pytestmark = [pytest.mark.stack, pytest.mark.engine]


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_job_runs_its_steps_and_rollout_serves_the_result(stack: stack_mod.Stack, mode: str) -> None:
    # The session stack's trainer steps on one group at a time.
    config = TrainConfig(steps=2, mode=mode, tasks_per_step=1, group_size=4, max_tokens=16, train_tasks="text/shout", temperature=1.0, step_timeout_s=300)
    summary = asyncio.run(Job(stack.addresses, config, progress=False).run())
    assert summary["mode"] == mode and summary["steps"] >= 2
    assert summary["policy_version_end"] >= summary["policy_version_start"] + 2
    assert summary["trained_samples"] >= 2 * 4 and summary["samples_per_s"] > 0
    assert summary["trajectories_sampled"] >= summary["trained_samples"]
    assert [s["step"] for s in summary["trainer_steps"]] == sorted(s["step"] for s in summary["trainer_steps"])
