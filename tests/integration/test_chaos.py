"""``meridian chaos`` on the two-region local stack with the tiny model: one fault of
each kind on each service of each region (13, seeded), while a sync RL job runs. Nothing
produced is lost, nothing is trained twice, every region serves the trainer's final
version (weights hash and canary), and nothing is left behind after the stack stops."""
from __future__ import annotations

from pathlib import Path

import pytest

from meridian import chaos
from meridian import stack as stack_mod

pytestmark = [pytest.mark.stack, pytest.mark.engine]


def test_a_chaos_run_loses_nothing_trains_nothing_twice_and_leaks_nothing(tmp_path: Path, tiny_model: Path) -> None:
    remote = ["b"]
    faults = len(chaos.base_faults(remote))
    # The drain's bound is well under envsandbox's default time-to-live (600 s): sandboxes
    # a killed rollout held close only if their lease lapses (chaos.SANDBOX_LEASE_S).
    config = chaos.ChaosConfig(faults=faults, seed=11, steps=3, model=str(tiny_model), run_dir=str(tmp_path / "run"), trigger_timeout_s=60, drain_timeout_s=240)
    summary, details, pids = chaos.run(config, config.run_dir)
    assert set(summary) == {
        "faults_injected", "steps_completed", "trajectories_produced", "trajectories_trained", "trajectories_lost",
        "trajectories_trained_twice", "versions_published", "regions_hash_equal", "sandboxes_leaked", "processes_leaked", "recovery_s",
    }
    assert summary["faults_injected"] == faults
    assert set(summary["recovery_s"]) == set(chaos.FAULT_KINDS)
    # Every fault was followed by a recovery (the service SERVING again and the job moving on).
    assert all(r["recovery_s"] is not None for r in details["faults"]), details["faults"]
    assert summary["steps_completed"] >= 3 and summary["versions_published"] >= 1
    assert summary["trajectories_produced"] > 0
    assert summary["trajectories_lost"] == 0, details["lost_ids"]
    assert summary["trajectories_trained_twice"] == 0, details["trained_twice_ids"]
    assert details["unexplained_ids"] == []
    assert summary["trajectories_trained"] == summary["trajectories_produced"]
    assert summary["regions_hash_equal"], details["regions"]
    assert summary["sandboxes_leaked"] == 0, details["leftover_sandboxes"]
    assert summary["processes_leaked"] == 0, details["leaked_processes"]
    assert all(stack_mod.group_members(pid) == [] for pid in pids.values())
