"""The learner on the tiny model, with what used to poison it: a token id past its
vocabulary (an embedding IndexError in every step that took the group, for ever), a
sequence past its positions, finite rewards whose float32 mean overflows, and a batch
whose loss is not finite (NaN written into every weight, and into the next checkpoint)."""
from __future__ import annotations

import asyncio
import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import pytest

from meridian.trajectory_transport import MemoryStreams
from meridian.v1 import common_pb2
from services.trainer.config import TrainerConfig
from tests.unit.test_trainer_loop import build, dead_letters, quick, run_until  # noqa: F401 - quick: an autouse fixture

pytestmark = pytest.mark.engine

F32_MAX = float(np.finfo(np.float32).max)  # 3.4e38: finite, so validate() lets it through


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    """A tiny random Llama (vocabulary 49152, 4096 positions), cached across runs."""
    from meridian.model_store import cache_dir, make_tiny_model

    return make_tiny_model(cache_dir() / "models" / "tiny-llama-test")


def learner(model: Path, **settings: Any) -> Any:
    from services.trainer.learner import Learner

    return Learner(model, TrainerConfig(model=str(model), lr=1e-3, **settings))


def group(name: str, rewards: Sequence[float], completion: Sequence[int] = (40, 41, 42), logprob: float = -1.0) -> list[common_pb2.Trajectory]:
    n = len(completion)
    return [
        common_pb2.Trajectory(
            trajectory_id=f"{name}-{k}", task_id="t", group_id=name, group_size=len(rewards), prompt_token_ids=[10, 11, 12],
            completion_token_ids=list(completion), logprobs=[logprob] * n, loss_mask=[1] * n, policy_versions=[0] * n, reward=r,
        )
        for k, r in enumerate(rewards)
    ]


def weights(lrn: Any) -> dict[str, Any]:
    return {name: p.detach().clone() for name, p in lrn.module.named_parameters()}


def all_finite(lrn: Any) -> bool:
    return all(bool(p.isfinite().all()) for p in lrn.module.parameters())


def test_check_group_names_the_bad_token_id_and_the_models_limits(tiny_model: Path) -> None:
    lrn = learner(tiny_model)
    assert lrn.limits.vocab_size == 49152 and lrn.limits.max_positions == 4096
    assert lrn.check_group(group("ok", [0.0, 1.0], completion=(0, 49151))) == ""
    assert lrn.check_group(group("v", [0.0, 1.0], completion=(5, 49152))) == (
        "trajectory v-0: token id 49152 in completion_token_ids is outside the model's vocabulary of 49152 ids (0..49151)"
    )
    long = group("long", [0.0, 1.0], completion=[7] * 4094)  # 3 prompt + 4094 = 4097 tokens
    assert lrn.check_group(long) == "trajectory long-0: 4097 tokens (3 prompt + 4094 completion) exceed the model's 4096 positions"
    assert lrn.check_group(group("fits", [0.0, 1.0], completion=[7] * 4093)) == ""


def test_an_out_of_vocabulary_group_is_dead_lettered_and_the_good_groups_of_its_poll_train(tiny_model: Path) -> None:
    async def body() -> None:
        lrn = learner(tiny_model)
        streams = MemoryStreams()
        loop = build(streams, lrn, groups_per_step=2)
        await loop.consumer.start()
        publish = loop.consumer.transport.publish_group
        await publish(group("g1", [0.0, 1.0]))
        await publish(group("bad", [0.0, 1.0], completion=(40, 49152, 42)))  # taken with g1, it crashed their step
        await publish(group("g2", [1.0, 0.0]))
        await run_until(loop, lambda: lrn.step_count >= 1, within=60, then=0.2)
        assert lrn.step_count == 1 and set(loop.consumer.unacked()) == {"g1", "g2"}
        dead = dead_letters(streams)
        assert list(dead) == ["bad"]
        reason = dead["bad"][b"reason"].decode()
        assert "token id 49152" in reason and "vocabulary of 49152 ids" in reason, reason
        assert all_finite(lrn)

    asyncio.run(body())


def test_finite_rewards_whose_float32_mean_overflows_train_to_finite_weights(tiny_model: Path) -> None:
    lrn = learner(tiny_model)
    before = weights(lrn)
    huge = group("huge", [F32_MAX, F32_MAX, 0.0])
    for k, traj in enumerate(huge):
        traj.completion_token_ids[0] += k  # different samples (equal ones' gradients cancel)
    result = lrn.step([huge])
    assert result.stepped and result.skipped == "" and np.isfinite(result.loss) and np.isfinite(result.grad_norm)
    assert all_finite(lrn), "NaN advantages wrote NaN into the weights"
    assert any(not bool((p == before[name]).all()) for name, p in lrn.module.named_parameters()), "the step should train"


def test_a_non_finite_loss_skips_the_update_and_leaves_the_learner_as_it_was(tiny_model: Path) -> None:
    # Coupled objective (no truncated IS): the ratio exp(logp + 3e38) is inf, so is the loss.
    lrn = learner(tiny_model, tis_cap=0.0)
    before = weights(lrn)
    lr = lrn.scheduler.get_last_lr()
    result = lrn.step([group("inf", [0.0, 1.0, 2.0], logprob=-3e38)])
    assert not result.stepped and "non-finite" in result.skipped and not np.isfinite(result.loss)
    assert (lrn.step_count, lrn.version) == (0, 0) and result.step == 0
    assert all(bool(p.isfinite().all()) and bool((p == before[name]).all()) for name, p in lrn.module.named_parameters())
    assert lrn.optimizer.state_dict()["state"] == {} and lrn.scheduler.get_last_lr() == lr
    assert all(p.grad is None for p in lrn.module.parameters()), "the inf/NaN gradients are dropped"
    # The learner goes on as if the batch had not come.
    assert lrn.step([group("ok", [0.0, 1.0])]).stepped and lrn.version == 1 and all_finite(lrn)


def test_an_optimizer_step_that_raises_part_way_stops_training_rather_than_update_twice(tiny_model: Path) -> None:
    """The optimizer step updated one tensor, then raised (out of memory, say). Retried, it
    would update that tensor twice: the learner raises LearnerBroken instead, and the loop
    stops with it once, the group neither retried, acked nor dead-lettered (a restart
    resumes from the checkpoint and replays it)."""
    from services.trainer.learner_protocol import LearnerBroken

    async def body() -> None:
        lrn = learner(tiny_model)
        streams = MemoryStreams()
        loop = build(streams, lrn, groups_per_step=1)
        await loop.consumer.start()
        first = next(lrn.module.parameters())
        tries = []

        def half_a_step() -> None:
            tries.append(1)
            with torch.no_grad():
                first.add_(1.0)
            raise RuntimeError("out of memory while updating the second tensor")

        lrn.optimizer.step = half_a_step
        await loop.consumer.transport.publish_group(group("g1", [0.0, 1.0]))
        with pytest.raises(LearnerBroken, match="the step failed in the optimizer step .*out of memory.*restart resumes from the checkpoint"):
            await run_until(loop, lambda: False, within=20)
        assert len(tries) == 1 and (lrn.step_count, lrn.version) == (0, 0)
        assert dead_letters(streams) == {} and loop.consumer.unacked() == {} and await loop.consumer.transport.pending() == 1

    asyncio.run(body())


def test_the_device_setting_is_what_torch_sees_here() -> None:
    from services.trainer.learner import resolve_device

    assert resolve_device("cpu", 3) == "cpu"
    if torch.cuda.is_available():
        assert resolve_device("auto", 1) == resolve_device("cuda", 1) == "cuda:1"
    else:
        # A GPU job on a machine without one stops at start, saying why, instead of training on the CPU.
        assert resolve_device("auto", 1) == "cpu"
        with pytest.raises(ValueError, match="sees no CUDA device"):
            resolve_device("cuda")


def test_a_step_replayed_from_the_same_state_gives_the_same_weights_bit_for_bit(tiny_model: Path) -> None:
    """What a restarted trainer relies on: it replays the steps after its checkpoint and
    publishes their versions again, and weightsync refuses other weights under a version
    it holds, which stops training for good. The packed log-probs gathered the shared
    prompt's last position once per row through a tensor index, whose CPU backward adds
    the rows' gradients with atomics in whatever order the threads come: with two
    threads, replays of one step gave two or more different weights (a chaos run's
    trainer stopped so, its replayed version one bf16 element off)."""
    threads = torch.get_num_threads()
    lrn = learner(tiny_model, threads=2)  # torch's thread count is the process's: put back below
    rows = group("g", [float(k % 3) for k in range(8)], completion=[40, 41, 42, 43, 44, 45])
    for k, traj in enumerate(rows):
        traj.prompt_token_ids[:] = range(10, 34)  # one prompt: the rows share it
        traj.completion_token_ids[::2] = [50 + k, 60 + k, 70 + k]  # each row its own completion
    start = copy.deepcopy(lrn.state())
    hashes = set()
    try:
        for _ in range(8):
            lrn.load_state(copy.deepcopy(start))
            assert lrn.step([rows]).stepped
            hashes.add(lrn.master_hash())
    finally:
        torch.set_num_threads(threads)
    assert len(hashes) == 1, f"{len(hashes)} different weights from 8 replays of one step"
