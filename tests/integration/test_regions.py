"""Two regions for real (tiny model): ``meridian up --regions a,b`` starts region b's
envsandbox, a relay behind an emulated link to the origin and a rollout; an RL job
samples in both regions, region b's trajectories are trained on, and region b serves
every new version through its relay. Stopping leaves no process behind."""
from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from meridian import stack as stack_mod
from meridian.train import Job, TrainConfig
from tests.integration.conftest import started_stack

pytestmark = [pytest.mark.stack, pytest.mark.engine]


@pytest.fixture(scope="module")
def two_regions(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[stack_mod.Stack]:
    config = stack_mod.StackConfig(
        run_dir=str(tmp_path_factory.mktemp("regions")), model=str(tiny_model), ports="auto", ready_timeout_s=600,
        regions="a,b", link_mbit_s=200, link_latency_ms=20,
    )
    with started_stack(config, {"trainer": ["--lr", "1e-4"]}) as running:
        yield running


def test_region_b_is_a_remote_region_behind_its_own_link(two_regions: stack_mod.Stack) -> None:
    for name in ("link-b", "envsandbox-b", "weightsync-b", "rollout-b"):
        assert name in two_regions.pids, f"{name} not started: {sorted(two_regions.pids)}"
    assert two_regions.home_region == "a"
    assert two_regions.addresses["weightsync-b"] != two_regions.addresses["weightsync"]
    # Region b's services label their metrics with their region.
    for name in ("weightsync-b", "envsandbox-b", "rollout-b"):
        with urllib.request.urlopen(two_regions.metrics[name], timeout=10) as reply:
            assert 'region="b"' in reply.read().decode(), name


def test_a_job_trains_on_both_regions_and_region_b_serves_each_version(two_regions: stack_mod.Stack) -> None:
    config = TrainConfig(steps=2, mode="sync", tasks_per_step=2, group_size=4, max_tokens=16, train_tasks="text/shout", temperature=1.0, step_timeout_s=300)
    summary = asyncio.run(Job(two_regions.addresses, config, progress=False).run())
    assert summary["steps"] >= 2
    # Each sync step samples one group in each region; both regions' samples are trained.
    assert summary["trained_by_region"].get("b", 0) > 0, summary["trained_by_region"]
    assert summary["trained_by_region"].get("a", 0) > 0, summary["trained_by_region"]
    # The job ends only once every region serves the trainer's version.
    assert summary["served_by_region"]["b"] == summary["served_by_region"]["a"] == summary["policy_version_end"]
    assert summary["policy_version_end"] >= summary["policy_version_start"] + 2

    status = asyncio.run(stack_mod.gather_status(two_regions))
    region_b = status["regions"]["b"]  # type: ignore[index]
    assert region_b["served_version"] == summary["policy_version_end"]
    assert region_b["weightsync_version"] >= summary["policy_version_end"] and region_b["lag_versions"] == 0
    # Region b's versions came through its link (not around it).
    assert region_b["link"]["bytes_down"] > 0 and region_b["link"]["connections"] >= 1
