"""The training loop's handling of groups it cannot train on, on the in-memory transport
with stand-in learners (no torch): groups the learner's check refuses are dead-lettered
on arrival, a step that raises is retried and then its batch dead-lettered (not retried
for ever, nor its groups forgotten), a step that trained nothing acks its groups, and a
step skipped for a non-finite loss reports no NaN in Status (nor in the metrics read from it).
The same cases with the real learner on the tiny model: tests/unit/test_trainer_learner.py."""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from meridian.trajectory_transport import DEAD_LETTER_SUFFIX, InMemoryGroupTransport, MemoryStreams, TransportConfig
from meridian.v1 import common_pb2
from services.trainer import loop as loop_mod
from services.trainer.commit import Progress
from services.trainer.consumer import ConsumerConfig, GroupConsumer
from services.trainer.learner_protocol import StepResult
from services.trainer.loop import TrainingLoop

CONFIG = TransportConfig(url="memory://", stream="test:trajectories")
DEAD = CONFIG.stream + DEAD_LETTER_SUFFIX


def group(name: str, completion: Sequence[int] = (2,), size: int = 2) -> list[common_pb2.Trajectory]:
    """A complete group of ``size`` with distinct rewards (something to learn)."""
    return [
        common_pb2.Trajectory(
            trajectory_id=f"{name}-{k}", task_id="python/add", group_id=name, group_size=size, prompt_token_ids=[1],
            completion_token_ids=list(completion), logprobs=[-0.5] * len(completion), loss_mask=[1] * len(completion),
            policy_versions=[0] * len(completion), reward=float(k),
        )
        for k in range(size)
    ]


class StandInLearner:
    """A PolicyLearner's step and check: records the batches it is given; ``fail(batch)``
    says whether (and with what) that call raises; ``skip`` makes every step train nothing."""

    def __init__(self, fail: Callable[[list[str]], Exception | None] = lambda batch: None, skip: str = "", vocab: int = 1000) -> None:
        self.version = 0
        self.step_count = 0
        self.calls: list[list[str]] = []
        self.trained: list[list[str]] = []
        self.fail = fail
        self.skip = skip
        self.vocab = vocab

    def check_group(self, trajectories: Sequence[common_pb2.Trajectory]) -> str:
        bad = [t for traj in trajectories for t in traj.completion_token_ids if t >= self.vocab]
        return f"token id {bad[0]} is outside the vocabulary of {self.vocab}" if bad else ""

    def step(self, groups: list[list[common_pb2.Trajectory]]) -> StepResult:
        batch = [g[0].group_id for g in groups]
        self.calls.append(batch)
        if (exc := self.fail(batch)) is not None:
            raise exc
        n = sum(len(g) for g in groups)
        if self.skip:
            # As the real learner's: the non-finite figures, and the stats of the forward pass that gave them.
            stats = {"is_weight_mean": float("inf"), "kl": float("nan")}
            return StepResult(self.step_count, float("nan"), 0.5, 0, 0, float("nan"), 0.0, 0, stats, stepped=False, skipped=self.skip)
        self.trained.append(batch)
        self.step_count += 1
        self.version += 1
        return StepResult(self.step_count, 0.1, 0.5, n, len(groups), 1.0, 0.0, 0, {})


class StandInCommitter:
    """The committer's side the loop calls, without checkpoints (a step that trained
    nothing is then acked at once) and without publishing (commits are only counted)."""

    checkpoints = False

    def __init__(self) -> None:
        self.commits = 0

    async def commit(self, metrics: Any, span: Any) -> None:
        self.commits += 1

    async def idle(self) -> None:
        pass

    def uncovered(self) -> None:
        pass


def build(streams: MemoryStreams, learner: StandInLearner, groups_per_step: int) -> TrainingLoop:
    """The loop over ``streams``, with claims of idle pending entries (our own too) every
    few milliseconds: what brought a failed batch back for ever before."""
    progress = Progress()
    consumer = GroupConsumer(
        InMemoryGroupTransport(CONFIG, streams), ConsumerConfig("trainer-0", 100, claim_idle_ms=1, claim_every_s=0.005), progress.counters,
        check=learner.check_group,
    )
    return TrainingLoop(learner, consumer, StandInCommitter(), progress, groups_per_step, publish_every=1)  # type: ignore[arg-type]


async def run_until(loop: TrainingLoop, done: Callable[[], bool], within: float = 10.0, then: float = 0.0) -> None:
    """Runs the loop until ``done()`` holds (failing after ``within`` seconds), and ``then``
    seconds longer (to see that nothing more happens)."""
    task = asyncio.create_task(loop.run())
    try:
        deadline = time.monotonic() + within
        while not done():
            if task.done():
                task.result()
            assert time.monotonic() < deadline, "the loop did not get there in time"
            await asyncio.sleep(0.005)
        await asyncio.sleep(then)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def dead_letters(streams: MemoryStreams) -> dict[str, dict[bytes, bytes]]:
    """The dead-letter stream's entries by the group they hold."""
    out = {}
    for _, fields in streams.entries.get(DEAD, []):
        held = common_pb2.TrajectoryGroup.FromString(fields[b"group"])
        out[held.group_id] = fields
    return out


@pytest.fixture(autouse=True)
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    """Short polls and no pause between the tries of a failed batch."""
    monkeypatch.setattr(loop_mod, "READ_BLOCK_MS", 5)
    monkeypatch.setattr(loop_mod, "STEP_RETRY_S", 0.0, raising=False)


def test_a_batch_whose_step_keeps_raising_is_dead_lettered_after_the_tries_and_training_goes_on() -> None:
    async def body() -> None:
        streams = MemoryStreams()
        learner = StandInLearner(fail=lambda batch: RuntimeError("boom") if "bad" in batch else None)
        loop = build(streams, learner, groups_per_step=1)
        await loop.consumer.start()
        bad_id = await loop.consumer.transport.publish_group(group("bad"))
        await loop.consumer.transport.publish_group(group("good"))
        # Run on a while after the good group trained: claims of our own pending entries
        # come every few ms and must not bring the bad one back.
        await run_until(loop, lambda: learner.trained == [["good"]], then=0.2)
        dead = dead_letters(streams)
        assert list(dead) == ["bad"], "the failing batch is kept whole in the dead-letter stream"
        assert learner.calls.count(["bad"]) == loop_mod.STEP_ATTEMPTS, "tried that many times, then never again"
        reason = dead["bad"][b"reason"].decode()
        assert "RuntimeError: boom" in reason and f"failed {loop_mod.STEP_ATTEMPTS} times" in reason
        assert dead["bad"][b"source_id"].decode() == bad_id
        assert loop.progress.counters["dead_lettered"] == 1 and loop.progress.counters["failed_batches"] == 1
        # Acked: only the good group (trained, waiting for a checkpoint) stays pending.
        assert await loop.consumer.transport.pending() == 1 and list(loop.consumer.unacked()) == ["good"]

    asyncio.run(body())


def test_a_step_that_fails_once_trains_the_same_batch_on_the_retry() -> None:
    async def body() -> None:
        streams = MemoryStreams()
        failures = [OSError("transient")]
        learner = StandInLearner(fail=lambda batch: failures.pop() if failures else None)
        loop = build(streams, learner, groups_per_step=2)
        await loop.consumer.start()
        for name in ("g1", "g2", "g3"):
            await loop.consumer.transport.publish_group(group(name))
        await run_until(loop, lambda: bool(learner.trained), then=0.05)
        # The failed batch came back first and whole, in its order; g3 waits for a partner.
        assert learner.calls == [["g1", "g2"], ["g1", "g2"]] and learner.trained == [["g1", "g2"]]
        assert dead_letters(streams) == {} and loop.consumer.ready_trajectories() == 2

    asyncio.run(body())


def test_groups_the_learner_cannot_take_are_dead_lettered_on_arrival_and_the_rest_of_the_poll_trains() -> None:
    async def body() -> None:
        streams = MemoryStreams()
        learner = StandInLearner(fail=lambda batch: IndexError("index out of range in self") if "bad" in batch else None, vocab=1000)
        loop = build(streams, learner, groups_per_step=2)
        await loop.consumer.start()
        await loop.consumer.transport.publish_group(group("g1"))
        await loop.consumer.transport.publish_group(group("bad", completion=(5, 1000)))
        await loop.consumer.transport.publish_group(group("g2"))
        await run_until(loop, lambda: bool(learner.trained), then=0.05)
        assert learner.calls == [["g1", "g2"]], "the refused group never reaches a step"
        dead = dead_letters(streams)
        assert list(dead) == ["bad"]
        assert dead["bad"][b"reason"].decode() == "the model cannot train on group bad: token id 1000 is outside the vocabulary of 1000"
        assert await loop.consumer.transport.pending() == 2  # g1 and g2, trained, wait for a checkpoint

    asyncio.run(body())


def test_a_step_skipped_for_a_non_finite_loss_is_counted_and_its_groups_acked_like_a_step_that_trained_nothing() -> None:
    async def body() -> None:
        streams = MemoryStreams()
        learner = StandInLearner(skip="non-finite loss nan or gradient norm nan: the optimizer step was skipped")
        loop = build(streams, learner, groups_per_step=1)
        await loop.consumer.start()
        await loop.consumer.transport.publish_group(group("g1"))
        await run_until(loop, lambda: bool(learner.calls), then=0.05)
        assert learner.calls == [["g1"]], "a skipped step is not retried"
        assert loop.progress.counters["skipped_steps"] == 1 and loop.committer.commits == 0  # type: ignore[attr-defined]
        assert await loop.consumer.transport.pending() == 0 and dead_letters(streams) == {}
        assert not loop.recent_steps()[-1].stepped

    asyncio.run(body())


def test_a_skipped_step_reports_no_non_finite_figure_and_the_last_loss_stays_the_last_trained_steps() -> None:
    """A step skipped for a NaN loss and gradient norm is reported in Status as a step that
    trained nothing, with the last trained step's loss and gradient norm: its NaN went into
    recent_steps and from there into the loss gauge (meridian_trainer_loss) before."""
    import math

    from meridian import metrics
    from meridian.v1 import trainer_pb2 as pb

    async def body() -> None:
        streams = MemoryStreams()
        learner = StandInLearner()
        loop = build(streams, learner, groups_per_step=1)
        await loop.consumer.start()
        await loop.consumer.transport.publish_group(group("g1"))
        await run_until(loop, lambda: bool(learner.trained))
        learner.skip = "non-finite loss nan or gradient norm nan: the optimizer step was skipped"
        await loop.consumer.transport.publish_group(group("g2"))
        await run_until(loop, lambda: len(learner.calls) == 2, then=0.05)
        trained, skipped = loop.recent_steps()
        assert (trained.stepped, skipped.stepped, skipped.step) == (True, False, 1)
        assert (skipped.loss, skipped.grad_norm) == (trained.loss, trained.grad_norm) == (0.1, 1.0)
        fields = [f.name for f in pb.StepMetrics.DESCRIPTOR.fields if f.type == f.TYPE_DOUBLE]
        assert all(math.isfinite(getattr(skipped, name)) for name in fields), skipped
        assert (skipped.trajectories, skipped.groups, skipped.reward_mean) == (0, 0, 0.5)
        assert loop.progress.counters["skipped_steps"] == 1
        # The figures the metrics endpoint exports from Status.
        exported = metrics.trainer_values(pb.TrainerStatus(recent_steps=loop.recent_steps()), 0, 0)
        assert all(math.isfinite(v.value) for v in exported), exported
        assert [v.value for v in exported if v.spec is metrics.TRAINER_LOSS] == [0.1]

    asyncio.run(body())


def test_a_transport_failure_at_start_up_is_retried_not_the_end_of_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Redis restarting just as the loop starts (its own pending entries cannot be read):
    the recovery is retried like any iteration, and training starts (it ended the loop
    task, unseen, before)."""
    from meridian.errors import Unavailable

    monkeypatch.setattr(loop_mod.asyncio, "sleep", _no_wait(asyncio.sleep))

    async def body() -> None:
        streams = MemoryStreams()
        learner = StandInLearner()
        loop = build(streams, learner, groups_per_step=1)
        await loop.consumer.start()
        transport = loop.consumer.transport
        real = transport.read_own_pending
        failures = [Unavailable("redis is loading")]

        async def flaky(consumer: str, count: int) -> Any:
            if failures:
                raise failures.pop()
            return await real(consumer, count)

        transport.read_own_pending = flaky  # type: ignore[method-assign]
        await transport.publish_group(group("g1"))
        await run_until(loop, lambda: bool(learner.trained))
        assert failures == [] and learner.trained == [["g1"]]

    asyncio.run(body())


def _no_wait(sleep: Callable[[float], Any]) -> Callable[[float], Any]:
    """asyncio.sleep without the loop's 1 s pause after a failed iteration."""
    return lambda seconds: sleep(min(seconds, 0.01))


def test_a_refused_version_stops_the_trainer_service() -> None:
    """The loop ends on CommitRefused (weightsync holds other bytes under a version): the
    service's failure() says so, so the server stops SERVING and exits 1 (it went on
    answering SERVING with no loop before)."""
    from services.trainer.commit import CommitRefused
    from services.trainer.config import TrainerConfig
    from services.trainer.server import TrainerService

    async def body() -> str:
        service = TrainerService(TrainerConfig(), learner=StandInLearner(), transport=InMemoryGroupTransport(CONFIG, MemoryStreams()))  # type: ignore[arg-type]

        async def refused() -> None:
            raise CommitRefused("weightsync refused version 3: ALREADY_EXISTS")

        service._task = asyncio.create_task(refused())
        try:
            return await asyncio.wait_for(service.failure(), 10)
        finally:
            await service.stop()

    reason = asyncio.run(body())
    assert reason.startswith("the training loop stopped: CommitRefused") and "version 3" in reason
