"""The Committer of a sharded trainer's rank 0, publishing in parts, against a real
weightsync origin (in-process, loopback): the second rank is simulated in this process, its
part sent by a real :class:`PartSender`. Each version's parts are prepared inside the
commit (before the next step: they are collectives on a real trainer), never by gathering
the whole policy; the origin stores what one process publishing the same weights stores;
groups are acked only once their version is stored; transient failures are retried; a
version with a stale part is never stored; a refusal stops the trainer."""
from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from opentelemetry import trace

from meridian.tensors import RawTensor, weights_hash
from meridian.trajectory_transport import InMemoryGroupTransport, MemoryStreams
from meridian.v1 import common_pb2, trainer_pb2, weightsync_pb2
from services.trainer.commit import PUBLISH_RETRY_S, REFUSALS, CommitConfig, CommitRefused, Committer, Progress
from services.trainer.consumer import ConsumerConfig, GroupConsumer
from services.trainer.learner_protocol import RankFailed, StepResult
from services.trainer.shard_publish import PartSender, PreparedPart
from services.weightsync import client as weightsync
from services.weightsync import parts
from services.weightsync.config import WeightSyncConfig
from services.weightsync.server import WeightSyncService
from services.weightsync.signing import Signer, generate_signing_key
from tests.conftest import free_port, serving
from tests.unit.test_trainer_commit import TRANSPORT, _group

CANARY = weightsync_pb2.Canary(sequences=[weightsync_pb2.CanarySequence(token_ids=[1, 2, 3], logprobs=[0.0, -1.5, -0.25])])
SHAPES = {"embed": (64, 16), "layer.0": (16, 16), "layer.1": (16, 16), "norm": (16,)}


def weights_of(version: int) -> dict[str, RawTensor]:
    """The bf16 policy at ``version``: every tensor changes with each version."""
    out = {}
    for k, (name, shape) in enumerate(sorted(SHAPES.items())):
        n = int(np.prod(shape))
        bits = (np.arange(n, dtype=np.uint32) * (k + 3) + version * 11).astype(np.uint16) & np.uint16(0x3FFF)
        out[name] = RawTensor("bf16", shape, bits)
    return out


class TwoRanks:
    """Rank 0 of a two-rank sharded learner; rank 1 is simulated here, its parts sent by a
    real :class:`PartSender`. ``stale_from``: from that version on, rank 1 sends the
    previous version's tensors under the new version's header."""

    publishes_in_parts = True

    def __init__(self, address: str, stale_from: int = -1, retry_s: tuple[float, ...] = PUBLISH_RETRY_S) -> None:
        self.version = 0
        self.step_count = 0
        self.stale_from = stale_from
        self.sender = PartSender(address, retry_s, REFUSALS)
        self.events: list[tuple[str, int]] = []

    def step(self, groups: list[list[common_pb2.Trajectory]]) -> StepResult:
        self.version += 1
        self.step_count += 1
        self.events.append(("step", self.version))
        return StepResult(self.step_count, 0.0, trajectories=sum(len(g) for g in groups), groups=len(groups), grad_norm=0.0, seconds=0.0, stats={}, reward_mean=0.0, dropped_stale=0)

    def prepare_part(self, version: int, trace_context: dict[str, str], metrics: dict[str, float], signer: Signer | None, send: bool) -> PreparedPart:
        assert version == self.version
        whole = weights_of(version)
        split = parts.partition({n: t.nbytes for n, t in whole.items()}, 2)
        mine = [{n: whole[n] for n in names} for names in split]
        digests = {**parts.tensor_digests(mine[0]), **parts.tensor_digests(mine[1])}
        header = weightsync.version_header_from_digests(version, digests, trace_context, metrics, CANARY, signer)
        if send:
            theirs = mine[1]
            if 0 <= self.stale_from <= version:
                theirs = {n: weights_of(version - 1)[n] for n in split[1]}
            self.sender.submit(PreparedPart(header, 1, 2, theirs))
        self.events.append(("prepare", version))
        return PreparedPart(header, 0, 2, mine[0])

    def policy_weights(self) -> dict[str, RawTensor]:
        raise AssertionError("a learner that publishes in parts must not gather the whole policy")

    def canary(self, weights: dict[str, RawTensor]) -> weightsync_pb2.Canary:
        raise AssertionError("a part's canary comes with its header")

    def load_policy_weights(self, weights: dict[str, RawTensor], version: int) -> None:
        raise AssertionError("not expected")

    def master_hash(self) -> str:
        return f"master-{self.version}"

    def state(self) -> dict[str, Any]:
        return {"version": self.version, "step": self.step_count}

    def load_state(self, state: dict[str, Any]) -> None:
        self.version, self.step_count = state["version"], state["step"]


class Rank0:
    """The trainer's components on rank 0, without checkpoints (a publish acks what it covers)."""

    def __init__(self, address: str, learner: TwoRanks, key: Path | None = None) -> None:
        self.learner = learner
        self.progress = Progress()
        self.transport = InMemoryGroupTransport(TRANSPORT, MemoryStreams())
        self.consumer = GroupConsumer(self.transport, ConsumerConfig("trainer-0", 100, 60_000, 3600), self.progress.counters)
        config = CommitConfig(address, "", keep_checkpoints=1, signing_key=str(key) if key else "")
        self.committer = Committer(config, learner, self.consumer, self.progress)

    async def train_and_commit(self) -> None:
        """One step on the next group and its commit, left publishing in the background."""
        await self.consumer.poll(10, 0)
        taken = self.consumer.take(1)
        assert taken, "a group should be ready"
        result = await asyncio.to_thread(self.learner.step, [list(g.trajectories) for _, g in taken])
        self.consumer.trained_on(taken)
        await self.committer.commit(trainer_pb2.StepMetrics(step=result.step, policy_version=self.learner.version), trace.INVALID_SPAN)
        # The part (a collective on a real trainer) was prepared inside the commit, before the next step.
        assert self.learner.events[-1] == ("prepare", self.learner.version), self.learner.events


def _origin(root: Path, key: Path | None = None) -> WeightSyncService:
    return WeightSyncService(WeightSyncConfig(role="origin", data_dir=str(root), chunk_mb=0.001, verify_key=str(key) if key else "", part_timeout_s=30))


def _store_files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_versions_in_parts_store_like_one_process_and_ack_after_the_publish(tmp_path: Path) -> None:
    generate_signing_key(tmp_path / "key", tmp_path / "key.pub")
    steps = 3

    async def sharded() -> None:
        async with serving(_origin(tmp_path / "sharded", tmp_path / "key.pub")) as address:
            rank0 = Rank0(address, TwoRanks(address), tmp_path / "key")
            try:
                for k in range(steps):
                    await rank0.transport.publish_group(_group(f"g{k}"))
                await rank0.consumer.start()
                await rank0.committer.sync_initial_version(False)
                assert await weightsync.latest_version(address) == 0
                # No flush between commits: one publish in flight, in version order.
                for _ in range(steps):
                    await rank0.train_and_commit()
                await rank0.committer.flush()
            finally:
                await asyncio.to_thread(rank0.learner.sender.close)
            assert await weightsync.latest_version(address) == steps
            assert await rank0.transport.pending() == 0, "every group's version is stored: all acked"
            expected = [("prepare", 0)] + [e for v in range(1, steps + 1) for e in (("step", v), ("prepare", v))]
            assert rank0.learner.events == expected

    asyncio.run(sharded())
    signer = Signer.load(tmp_path / "key")

    async def one_process() -> None:
        async with serving(_origin(tmp_path / "single", tmp_path / "key.pub")) as address:
            for v in range(steps + 1):
                await weightsync.publish(address, v, weights_of(v), canary=CANARY, signer=signer)

    asyncio.run(one_process())
    want, got = _store_files(tmp_path / "single"), _store_files(tmp_path / "sharded")
    assert want.keys() == got.keys()
    for name in sorted(want):
        assert got[name] == want[name], f"{name}: the parts stored other bytes than one process"


def test_a_stale_part_is_never_stored_nor_its_groups_acked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The origin answers DATA_LOSS (the assembled weights do not hash to the header's): what
    # corruption in transit looks like, so both ranks retry; a stale part fails every retry.
    monkeypatch.setattr("services.trainer.commit.PUBLISH_RETRY_S", (0.1, 0.1))

    async def body() -> None:
        async with serving(_origin(tmp_path / "ws")) as address:
            learner = TwoRanks(address, stale_from=2, retry_s=(0.1, 0.1))
            rank0 = Rank0(address, learner)
            try:
                for k in range(2):
                    await rank0.transport.publish_group(_group(f"g{k}"))
                await rank0.consumer.start()
                await rank0.committer.sync_initial_version(False)
                await rank0.train_and_commit()
                await rank0.committer.flush()
                assert await weightsync.latest_version(address) == 1
                await rank0.train_and_commit()
                await rank0.committer.flush()
            finally:
                await asyncio.to_thread(learner.sender.close)
            assert await weightsync.latest_version(address) == 1, "a version with a stale part must not be stored"
            assert list(rank0.consumer.unacked()) == ["g1"], "the unpublished version's group stays pending"

    asyncio.run(body())


def test_parts_are_retried_while_the_origin_restarts(tmp_path: Path) -> None:
    port = free_port()

    async def body() -> None:
        async with serving(_origin(tmp_path / "ws"), port=port) as address:
            rank0 = Rank0(address, TwoRanks(address))
            await rank0.transport.publish_group(_group("g0"))
            await rank0.consumer.start()
            await rank0.committer.sync_initial_version(False)
        try:
            # The origin is down: both ranks' parts fail and are retried on the same schedule.
            await rank0.train_and_commit()
            await asyncio.sleep(0.8)
            assert rank0.committer._publishing is not None and not rank0.committer._publishing.done()
            async with serving(_origin(tmp_path / "ws"), port=port) as again:
                await asyncio.wait_for(rank0.committer.flush(), 30)
                assert await weightsync.latest_version(again) == 1
                assert await rank0.transport.pending() == 0
        finally:
            await asyncio.to_thread(rank0.learner.sender.close)

    asyncio.run(body())


def test_other_weights_under_a_held_version_stop_the_trainer(tmp_path: Path) -> None:
    """A replay whose parts differ from the version the origin holds is refused: CommitRefused."""

    async def body() -> None:
        async with serving(_origin(tmp_path / "ws")) as address:
            await weightsync.publish(address, 0, weights_of(0), canary=CANARY)
            await weightsync.publish(address, 1, weights_of(7), canary=CANARY)  # another history's version 1
            rank0 = Rank0(address, TwoRanks(address))
            try:
                await rank0.transport.publish_group(_group("g0"))
                await rank0.consumer.start()
                await rank0.committer.sync_initial_version(True)  # as after a resume at version 0
                await rank0.train_and_commit()
                with pytest.raises(CommitRefused, match="version 1"):
                    await asyncio.wait_for(rank0.committer.flush(), 30)
            finally:
                await asyncio.to_thread(rank0.learner.sender.close)
            assert (await weightsync.manifest(address, 1)).weights_hash == weights_hash(weights_of(7))
            assert list(rank0.consumer.unacked()) == ["g0"]

    asyncio.run(body())


class FailsOnePreparation(TwoRanks):
    """Preparing version ``fail_at``'s parts fails once on some rank, as every rank hears
    in the agreement after it (:class:`RankFailed`); the learners are unchanged."""

    def __init__(self, address: str, fail_at: int) -> None:
        super().__init__(address)
        self.fail_at = fail_at

    def prepare_part(self, version: int, trace_context: dict[str, str], metrics: dict[str, float], signer: Signer | None, send: bool) -> PreparedPart:
        if version == self.fail_at:
            self.fail_at = -1
            self.events.append(("failed", version))
            raise RankFailed(f"preparing the parts of version {version} failed on rank 1: gather raised")
        return super().prepare_part(version, trace_context, metrics, signer, send)


def test_a_version_whose_parts_could_not_be_prepared_is_published_when_the_trainer_goes_idle(tmp_path: Path) -> None:
    async def body() -> None:
        async with serving(_origin(tmp_path / "ws")) as address:
            learner = FailsOnePreparation(address, fail_at=1)
            rank0 = Rank0(address, learner)
            try:
                await rank0.transport.publish_group(_group("g0"))
                await rank0.consumer.start()
                await rank0.committer.sync_initial_version(False)
                await rank0.consumer.poll(10, 0)
                taken = rank0.consumer.take(1)
                result = await asyncio.to_thread(learner.step, [list(g.trajectories) for _, g in taken])
                rank0.consumer.trained_on(taken)
                await rank0.committer.commit(trainer_pb2.StepMetrics(step=result.step, policy_version=learner.version), trace.INVALID_SPAN)
                assert await weightsync.latest_version(address) == 0
                rank0.committer.config = dataclasses.replace(rank0.committer.config, checkpoint_idle_s=0.0)
                await rank0.committer.idle()  # prepares the parts again, as a collective, and sends them
                await rank0.committer.flush()
            finally:
                await asyncio.to_thread(learner.sender.close)
            assert await weightsync.latest_version(address) == 1
            assert (await weightsync.manifest(address, 1)).weights_hash == weights_hash(weights_of(1))
            assert await rank0.transport.pending() == 0, "the publish acks the step's group"
            assert learner.events == [("prepare", 0), ("step", 1), ("failed", 1), ("prepare", 1)]

    asyncio.run(body())
