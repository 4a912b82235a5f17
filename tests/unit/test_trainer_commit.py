"""The commit step against a real weightsync (in-process, loopback) and the in-memory
transport: versions go out before their checkpoint, groups are acked only once a
checkpoint covers them, and a replay after a crash republishes the same bytes while
other weights under a held version stop the trainer."""
from __future__ import annotations

import asyncio
import collections
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from opentelemetry import trace

from meridian.tensors import RawTensor
from meridian.trajectory_transport import InMemoryGroupTransport, MemoryStreams, TransportConfig
from meridian.v1 import common_pb2, trainer_pb2, weightsync_pb2
from services.trainer import checkpoint as ckpt
from services.trainer.commit import CommitConfig, CommitRefused, Committer, Progress
from services.trainer.consumer import ConsumerConfig, GroupConsumer
from services.trainer.learner_protocol import StepResult
from services.weightsync import client as weightsync
from services.weightsync.config import WeightSyncConfig
from services.weightsync.server import WeightSyncService
from tests.conftest import serving

TRANSPORT = TransportConfig(url="memory://", stream="test:trajectories")


class CountingLearner:
    """A PolicyLearner whose weights are a function of its version (and a skew, to
    stand for a learner that does not replay deterministically)."""

    def __init__(self, skew: int = 0) -> None:
        self.version = 0
        self.step_count = 0
        self.skew = skew

    def step(self, groups: list[list[common_pb2.Trajectory]]) -> StepResult:
        self.version += 1
        self.step_count += 1
        return StepResult(self.step_count, 0.0, trajectories=sum(len(g) for g in groups), groups=len(groups), grad_norm=0.0, seconds=0.0, stats={}, reward_mean=0.0, dropped_stale=0)

    def policy_weights(self) -> dict[str, RawTensor]:
        bits = np.arange(64, dtype=np.uint16) + np.uint16(self.version * 7 + self.skew)
        return {"w": RawTensor("bf16", (64,), bits)}

    def canary(self, weights: dict[str, RawTensor]) -> weightsync_pb2.Canary:
        return weightsync_pb2.Canary()

    def load_policy_weights(self, weights: dict[str, RawTensor], version: int) -> None:
        self.version = version

    def master_hash(self) -> str:
        return f"master-{self.version}-{self.skew}"

    def state(self) -> dict[str, Any]:
        return {"version": self.version, "step": self.step_count}

    def load_state(self, state: dict[str, Any]) -> None:
        self.version, self.step_count = state["version"], state["step"]


def _group(name: str) -> list[common_pb2.Trajectory]:
    return [
        common_pb2.Trajectory(
            trajectory_id=f"{name}-{k}", task_id="t", group_id=name, group_size=2, prompt_token_ids=[1], completion_token_ids=[2],
            logprobs=[-0.5], loss_mask=[1], policy_versions=[0], reward=float(k),
        )
        for k in range(2)
    ]


class Trainer:
    """The trainer's components over shared streams, a weightsync and a checkpoint folder."""

    def __init__(self, streams: MemoryStreams, address: str, ckpt_dir: Path, learner: CountingLearner, checkpoint_every: int) -> None:
        self.learner = learner
        self.progress = Progress()
        self.transport = InMemoryGroupTransport(TRANSPORT, streams)
        self.consumer = GroupConsumer(self.transport, ConsumerConfig("trainer-0", 100, 60_000, 3600), self.progress.counters)
        config = CommitConfig(address, str(ckpt_dir), keep_checkpoints=10, checkpoint_every=checkpoint_every, checkpoint_idle_s=3600)
        self.committer = Committer(config, learner, self.consumer, self.progress)

    async def start(self) -> None:
        resumed = self.committer.resume()
        await self.consumer.start()
        await self.committer.sync_initial_version(resumed)
        await self.consumer.recover()

    async def train_one(self) -> None:
        await self.consumer.poll(10, 0)
        taken = self.consumer.take(1)
        assert taken, "a group should be ready"
        result = self.learner.step([list(g.trajectories) for _, g in taken])
        self.consumer.trained_on(taken)
        metrics = trainer_pb2.StepMetrics(step=result.step, policy_version=self.learner.version)
        await self.committer.commit(metrics, trace.INVALID_SPAN)
        await self.committer.flush()  # the test looks at the outcome, not the overlap


def test_acks_follow_checkpoints_and_a_replay_republishes_the_same_versions(tmp_path: Path) -> None:
    async def body() -> None:
        streams = MemoryStreams()
        ckpt_dir = tmp_path / "ckpt"
        async with serving(WeightSyncService(WeightSyncConfig(role="origin", data_dir=str(tmp_path / "ws")))) as address:
            first = Trainer(streams, address, ckpt_dir, CountingLearner(), checkpoint_every=2)
            for name in ("g1", "g2", "g3"):
                await first.transport.publish_group(_group(name))
            await first.start()
            await first.train_one()
            # Version 1 is out, but no checkpoint holds it: its group stays pending
            # (with the two delivered and not trained yet).
            assert await weightsync.latest_version(address) == 1
            assert await first.transport.pending() == 3 and list(first.consumer.unacked()) == ["g1"]
            await first.train_one()
            # The checkpoint of step 2 is on disk: both trained groups are acked.
            assert ckpt.read_meta(ckpt.latest_checkpoint(ckpt_dir))["step"] == 2  # type: ignore[arg-type]
            assert await first.transport.pending() == 1 and first.consumer.unacked() == {}
            await first.train_one()
            assert await weightsync.latest_version(address) == 3 and list(first.consumer.unacked()) == ["g3"]
            assert await first.transport.pending() == 1
            held = (await weightsync.manifest(address, 3)).weights_hash

            # The trainer dies here. Its successor resumes at step 2, gets g3 again and
            # publishes version 3 again: the same bytes, accepted.
            second = Trainer(streams, address, ckpt_dir, CountingLearner(), checkpoint_every=2)
            await second.start()
            assert second.learner.version == 2
            await second.train_one()
            assert (await weightsync.manifest(address, 3)).weights_hash == held
            assert await weightsync.latest_version(address) == 3

            # A trainer whose replay differs is refused, and says why.
            third = Trainer(streams, address, ckpt_dir, CountingLearner(skew=1), checkpoint_every=2)
            await third.transport.publish_group(_group("g4"))
            await third.start()
            await third.consumer.poll(10, 0)
            taken = third.consumer.take(1)
            third.learner.step([list(g.trajectories) for _, g in taken])
            third.consumer.trained_on(taken)
            await third.committer.commit(trainer_pb2.StepMetrics(step=3), trace.INVALID_SPAN)
            with pytest.raises(CommitRefused, match="version 3 is held with weights hash"):
                await third.committer.flush()

    asyncio.run(body())


def test_a_checkpoint_that_fails_acks_nothing_and_its_groups_come_back_after_a_crash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint write that fails (a full disk) covers nothing: the groups of its
    step stay pending, a trainer that dies then gets them again, and the next checkpoint
    that is written acks them."""

    def disk_full(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    async def body() -> None:
        streams = MemoryStreams()
        ckpt_dir = tmp_path / "ckpt"
        async with serving(WeightSyncService(WeightSyncConfig(role="origin", data_dir=str(tmp_path / "ws")))) as address:
            first = Trainer(streams, address, ckpt_dir, CountingLearner(), checkpoint_every=1)
            for name in ("g1", "g2"):
                await first.transport.publish_group(_group(name))
            await first.start()
            with monkeypatch.context() as patch:
                patch.setattr(ckpt, "save_checkpoint", disk_full)
                await first.train_one()
            assert ckpt.read_meta(ckpt.latest_checkpoint(ckpt_dir))["step"] == 0  # type: ignore[arg-type]
            assert list(first.consumer.unacked()) == ["g1"] and await first.transport.pending() == 2

            # The trainer dies here: its successor resumes at step 0 and gets g1 back first.
            second = Trainer(streams, address, ckpt_dir, CountingLearner(), checkpoint_every=1)
            await second.start()
            assert [g.group_id for _, g in second.consumer.take(2)] == ["g1", "g2"]

            # Without the crash, the next checkpoint written covers and acks both steps.
            await first.train_one()
            assert ckpt.read_meta(ckpt.latest_checkpoint(ckpt_dir))["step"] == 2  # type: ignore[arg-type]
            assert first.consumer.unacked() == {} and await first.transport.pending() == 0

    asyncio.run(body())


def test_checkpoints_copy_the_state_the_next_step_changes(tmp_path: Path) -> None:
    """The background write must not see the step that follows it."""

    class MutableLearner(CountingLearner):
        def __init__(self) -> None:
            super().__init__()
            self.buffer = np.zeros(4)

        def state(self) -> dict[str, Any]:
            return {**super().state(), "buffer": self.buffer}  # a reference, as torch's state_dict

    async def body() -> None:
        learner = MutableLearner()
        progress = Progress(counters=collections.Counter())
        consumer = GroupConsumer(InMemoryGroupTransport(TRANSPORT, MemoryStreams()), ConsumerConfig("c", 10, 60_000, 3600), progress.counters)
        committer = Committer(CommitConfig("unused:1", str(tmp_path), 5, checkpoint_every=1), learner, consumer, progress)
        committer._since_checkpoint = 1
        learner.step_count = learner.version = 1
        await committer.checkpoint()
        learner.buffer += 1.0  # the next step, while the checkpoint is being written
        await committer.flush()
        state, _ = ckpt.load_checkpoint(ckpt.latest_checkpoint(tmp_path))  # type: ignore[arg-type]
        assert np.array_equal(state["buffer"], np.zeros(4))
        assert state["step"] == 1

    asyncio.run(body())


def test_a_checkpoint_acks_only_the_groups_its_state_holds(tmp_path: Path) -> None:
    """The groups a checkpoint acks are those trained on when its state was copied: a
    step that runs while the checkpoint is written is not in it, so its groups stay
    pending for the next checkpoint (acked now, a crash would lose them)."""

    async def body() -> None:
        learner = CountingLearner()
        progress = Progress(counters=collections.Counter())
        consumer = GroupConsumer(InMemoryGroupTransport(TRANSPORT, MemoryStreams()), ConsumerConfig("c", 10, 60_000, 3600), progress.counters)
        committer = Committer(CommitConfig("unused:1", str(tmp_path), 5, checkpoint_every=1), learner, consumer, progress)
        await consumer.start()
        for name in ("g1", "g2"):
            await consumer.transport.publish_group(_group(name))
        await consumer.poll(10, 0)
        consumer.trained_on(consumer.take(1))
        learner.step([])
        committer._since_checkpoint = 1
        await committer.checkpoint()
        consumer.trained_on(consumer.take(1))  # the next step, while the checkpoint is being written
        learner.step([])
        await committer.flush()
        assert ckpt.read_meta(ckpt.latest_checkpoint(tmp_path))["trained_groups"] == ["g1"]  # type: ignore[arg-type]
        assert list(consumer.unacked()) == ["g2"] and await consumer.transport.pending() == 1

    asyncio.run(body())


def test_resume_takes_back_a_checkpoint_a_crashed_same_step_rewrite_moved_aside(tmp_path: Path) -> None:
    """A trainer killed inside a same-step rewrite leaves that step's checkpoint moved
    aside: the restarted trainer resumes from it (its groups may be acked), never from
    the older step, and knows its groups as trained."""
    for step in (2, 3):
        meta = {"step": step, "version": step, "trained_groups": [f"g{k}" for k in range(1, step + 1)]}
        ckpt.save_checkpoint(tmp_path, step, {"version": step, "step": step}, meta, 10)
    (tmp_path / "step-000000003").rename(tmp_path / ".tmp-replaced-step-000000003-4242")  # the state the crash leaves
    learner = CountingLearner()
    consumer = GroupConsumer(InMemoryGroupTransport(TRANSPORT, MemoryStreams()), ConsumerConfig("c", 10, 60_000, 3600))
    committer = Committer(CommitConfig("unused:1", str(tmp_path), 5), learner, consumer, Progress())
    assert committer.resume()
    assert learner.version == 3 and learner.step_count == 3
    assert "g3" in consumer.trained and committer.progress.resumed_from_step == 3


def test_an_idle_trainer_publishes_again_a_version_whose_publish_gave_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Weightsync down for every retry of the last step's publish: without a next step
    nothing would ever send that version, so the idle trainer does."""
    import dataclasses

    from meridian.stack import free_port
    from meridian.tensors import weights_hash
    from services.trainer import commit

    monkeypatch.setattr(commit, "PUBLISH_RETRY_S", (0.05,))

    async def body() -> None:
        streams = MemoryStreams()
        async with serving(WeightSyncService(WeightSyncConfig(role="origin", data_dir=str(tmp_path / "ws")))) as address:
            t = Trainer(streams, address, tmp_path / "ckpt", CountingLearner(), checkpoint_every=1)
            await t.transport.publish_group(_group("g1"))
            await t.start()
            live = t.committer.config
            t.committer.config = dataclasses.replace(live, weightsync=f"127.0.0.1:{free_port()}")  # down
            await t.train_one()  # its publish gives up; the trainer goes on
            assert await weightsync.latest_version(address) == 0
            t.committer.config = dataclasses.replace(live, checkpoint_idle_s=0.0)  # back up
            await t.committer.idle()
            await t.committer.flush()
            assert await weightsync.latest_version(address) == 1
            assert (await weightsync.manifest(address, 1)).weights_hash == weights_hash(t.learner.policy_weights())
            await t.committer.idle()  # once out, not sent again
            assert t.committer._publishing is not None and t.committer._publishing.done()

    asyncio.run(body())


class FailingOnceLearner(CountingLearner):
    """Its weights cannot be taken once, at version ``fail_at`` (a rank's gather or a
    canary that raised), and can again afterwards: the learner itself is unchanged."""

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.fail_at = fail_at

    def policy_weights(self) -> dict[str, RawTensor]:
        if self.version == self.fail_at:
            self.fail_at = -1
            raise RuntimeError("gathering the weights failed on rank 1")
        return super().policy_weights()


@pytest.mark.parametrize("checkpoints", [True, False], ids=["checkpoints", "no-checkpoints"])
def test_a_version_whose_preparation_failed_is_published_when_the_trainer_goes_idle(tmp_path: Path, checkpoints: bool) -> None:
    """The last step's weights could not be taken for its publish: the commit does not
    raise (the step is trained and counted for a checkpoint), and the idle trainer
    publishes that version; without checkpoints that publish acks the step's group."""
    import dataclasses

    from meridian.tensors import weights_hash

    async def body() -> None:
        streams = MemoryStreams()
        async with serving(WeightSyncService(WeightSyncConfig(role="origin", data_dir=str(tmp_path / "ws")))) as address:
            t = Trainer(streams, address, tmp_path / "ckpt", FailingOnceLearner(fail_at=1), checkpoint_every=1)
            if not checkpoints:
                t.committer.config = dataclasses.replace(t.committer.config, checkpoint_dir="")
            await t.transport.publish_group(_group("g1"))
            await t.start()
            await t.train_one()  # its version's weights cannot be taken: nothing sent
            assert await weightsync.latest_version(address) == 0
            assert t.progress.counters["publishes_given_up"] == 1  # what Status and the metrics report
            if not checkpoints:
                assert t.consumer.unacked()  # a publish acks them: none went out
            t.committer.config = dataclasses.replace(t.committer.config, checkpoint_idle_s=0.0)
            await t.committer.idle()
            await t.committer.flush()
            assert await weightsync.latest_version(address) == 1
            assert (await weightsync.manifest(address, 1)).weights_hash == weights_hash(t.learner.policy_weights())
            assert not t.consumer.unacked()  # acked by the publish, or by the checkpoint that covers the step
            if checkpoints:
                assert ckpt.load_checkpoint(ckpt.latest_checkpoint(tmp_path / "ckpt"))[1]["step"] == 1  # type: ignore[arg-type]

    asyncio.run(body())


def test_an_older_publish_failing_later_does_not_hide_a_newer_unpublished_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Version 1's publish is still retrying (weightsync down) when version 2's weights
    cannot be taken; version 1's publish then gives up. The idle trainer must still send
    version 2, the one it holds: the later failure of the older publish must not replace
    the newer version as the one to send again."""
    import dataclasses

    from meridian.stack import free_port
    from meridian.tensors import weights_hash
    from services.trainer import commit

    monkeypatch.setattr(commit, "PUBLISH_RETRY_S", (1.5,))  # long enough to still be retrying at version 2

    async def body() -> None:
        streams = MemoryStreams()
        async with serving(WeightSyncService(WeightSyncConfig(role="origin", data_dir=str(tmp_path / "ws")))) as address:
            t = Trainer(streams, address, tmp_path / "ckpt", FailingOnceLearner(fail_at=2), checkpoint_every=100)
            for name in ("g1", "g2"):
                await t.transport.publish_group(_group(name))
            await t.start()
            live = t.committer.config
            t.committer.config = dataclasses.replace(live, weightsync=f"127.0.0.1:{free_port()}")  # down
            for _ in range(2):  # no flush: version 1's publish is still retrying during version 2's commit
                await t.consumer.poll(10, 0)
                taken = t.consumer.take(1)
                result = t.learner.step([list(g.trajectories) for _, g in taken])
                t.consumer.trained_on(taken)
                await t.committer.commit(trainer_pb2.StepMetrics(step=result.step, policy_version=t.learner.version), trace.INVALID_SPAN)
            assert t.committer._publishing is not None and not t.committer._publishing.done(), "version 1's publish should still be retrying"
            await t.committer.flush()  # version 1's publish gives up now, after version 2 was marked
            assert t.progress.counters["publishes_given_up"] == 2
            t.committer.config = dataclasses.replace(live, checkpoint_idle_s=0.0)  # back up
            await t.committer.idle()
            await t.committer.flush()
            assert await weightsync.latest_version(address) == 2
            assert (await weightsync.manifest(address, 2)).weights_hash == weights_hash(t.learner.policy_weights())

    asyncio.run(body())
