"""``meridian train``'s job against the real local stack (tiny model): in both modes it
drives the trainer the requested number of steps and rollout ends up serving them."""
from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from meridian import stack as stack_mod
from meridian.train import Job, TrainConfig, run_job

pytestmark = [pytest.mark.stack, pytest.mark.engine]


@pytest.fixture(scope="module")
def job_stack(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[stack_mod.Stack]:
    """A stack of its own: the shared one trains at lr 1e-2 for other tests, and after
    enough of that the tiny model's samples all earn the same reward (no step to take)."""
    config = stack_mod.StackConfig(run_dir=str(tmp_path_factory.mktemp("job-stack")), model=str(tiny_model), ports="auto", ready_timeout_s=600)
    running = stack_mod.start(config, extra_args={"trainer": ["--lr", "1e-4"]})
    try:
        yield running
    finally:
        running.stop(config.stop_timeout_s)


# sync first: it leaves nothing in the stream, while async jobs end with samples in flight.
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_job_runs_its_steps_and_rollout_serves_the_result(job_stack: stack_mod.Stack, mode: str) -> None:
    # The stack's trainer steps on one group at a time.
    config = TrainConfig(steps=2, mode=mode, tasks_per_step=1, group_size=4, max_tokens=16, train_tasks="text/shout", temperature=1.0, step_timeout_s=300)
    summary = asyncio.run(Job(job_stack.addresses, config, progress=False).run())
    assert summary["mode"] == mode and summary["steps"] >= 2
    assert summary["policy_version_end"] >= summary["policy_version_start"] + 2
    assert summary["trained_samples"] > 0 and summary["samples_per_s"] > 0
    assert summary["trajectories_sampled"] >= 2 * 4
    assert [s["step"] for s in summary["trainer_steps"]] == sorted(s["step"] for s in summary["trainer_steps"])


def test_a_job_on_a_stack_of_its_own_leaves_only_the_logs_in_its_temporary_run_folder(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`meridian train` and `meridian demo` without --run-dir: once the stack stops, its
    checkpoints, version stores, Redis data and credentials are gone from the temporary
    folder (the built-in model's demo left 3.7 GB there per run); the logs stay, and the
    report is written after."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    before: list[str] = []
    remove_state = stack_mod.remove_state

    def listing_first(run_dir: Path, keep: frozenset[str] = frozenset()) -> int:
        before.extend(p.name for p in run_dir.iterdir())
        return remove_state(run_dir, keep)

    monkeypatch.setattr(stack_mod, "remove_state", listing_first)
    config = TrainConfig(
        steps=1, mode="sync", model=str(tiny_model), tasks_per_step=1, group_size=4, max_tokens=16, train_tasks="text/shout",
        temperature=1.0, step_timeout_s=300, trainer_flags="--checkpoint-every 1",
    )  # fmt: skip
    summary, report = run_job(config, lambda addresses: Job(addresses, config, progress=False).run(), "meridian-test-")
    run_dir = report.parent
    assert run_dir.parent == tmp_path and summary["policy_version_end"] >= summary["policy_version_start"] + 1
    assert {"trainer-checkpoints", "weightsync", "redis", "credentials"} <= set(before)
    left = sorted(p.name for p in run_dir.iterdir())
    assert "trainer.log" in left and all(name.endswith(".log") for name in left)
