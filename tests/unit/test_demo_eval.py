"""The demo's held-out statistics and the job's configuration, against hand values."""
from __future__ import annotations

import pytest

from meridian.demo import DemoConfig, paired_bootstrap, summarise_eval
from meridian.train import TrainConfig


def test_pass_at_1_and_pass_at_k_per_task() -> None:
    per_task = {"a": [1.0, 0.0, 0.0, 0.0], "b": [0.0, 0.0, 0.5, 0.0], "c": [1.0, 1.0, 1.0, 1.0]}
    out = summarise_eval(per_task)
    assert out["pass_at_1"] == pytest.approx((0.25 + 0.0 + 1.0) / 3)
    assert out["pass_at_k"] == pytest.approx(2 / 3) and out["k"] == 4  # a partial reward is no pass
    assert out["samples"] == 12 and out["reward_mean"] == pytest.approx((1.0 + 0.5 + 4.0) / 12)


def test_paired_bootstrap_centres_on_the_mean_change() -> None:
    before = {"a": 0.0, "b": 0.5, "c": 0.25, "d": 0.25}
    # Every task gains exactly 0.25: no spread to resample.
    assert paired_bootstrap(before, {t: p + 0.25 for t, p in before.items()}) == pytest.approx((0.25, 0.25, 0.25))
    mean, low, high = paired_bootstrap(before, {"a": 0.5, "b": 0.5, "c": 0.25, "d": 0.0})
    assert mean == pytest.approx((0.5 + 0.0 + 0.0 - 0.25) / 4)
    # The interval lies within the extremes of the per-task changes and contains the mean.
    assert -0.25 <= low <= mean <= high <= 0.5 and low < high


def test_job_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="mode"):
        TrainConfig(mode="fast")
    with pytest.raises(ValueError, match="--rollout and --trainer"):
        TrainConfig(rollout="127.0.0.1:1")
    with pytest.raises(ValueError, match="eval_samples"):
        DemoConfig(eval_samples=1)
    assert DemoConfig().mode == "async" and DemoConfig().eval_samples * len(DemoConfig().eval_tasks.split(",")) >= 128
