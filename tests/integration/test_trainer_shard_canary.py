"""The canary of an FSDP2-sharded learner (a forward pass through a bf16 twin sharded like
the model) is bit for bit the single-process canary on the same bf16 weights, after the
weights moved. One process, a one-rank gloo group: the same code path as several ranks,
with no gather needed to compare (two ranks are checked by
test_trainer_shard_commit.py through the origin's stored canary)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist

from meridian.tensors import weights_hash
from services.trainer.config import TrainerConfig
from benchmarks.support.synthetic import fixed_groups
from tests.conftest import free_port

SETTINGS = {"lr": 1e-2, "groups_per_step": 2, "threads": 1, "max_policy_lag": 8, "micro_batch": 2}

pytestmark = pytest.mark.engine


def test_sharded_canary_is_the_single_process_canary(tiny_model: Path) -> None:
    from services.trainer.learner import Learner

    single = Learner(tiny_model, TrainerConfig(model=str(tiny_model), **SETTINGS))  # type: ignore[arg-type]
    assert not single.sharded
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        sharded = Learner(tiny_model, TrainerConfig(model=str(tiny_model), data_parallel="fsdp", **SETTINGS))  # type: ignore[arg-type]
        assert sharded.sharded
        before = sharded.policy_weights()
        assert sharded.shard_canary() == single.canary(before)
        # After a step: the twin must follow the masters (a canary of stale weights differs).
        assert sharded.step(fixed_groups(tiny_model, 2, group_size=3, seed=3)).stepped
        after = sharded.policy_weights()
        assert weights_hash(after) != weights_hash(before)
        probe = sharded.shard_canary()
        assert probe == single.canary(after)
        assert probe != single.canary(before)
        # Given weights on one rank: its shards are the whole tensors.
        assert sharded.canary(after) == probe
    finally:
        dist.destroy_process_group()
