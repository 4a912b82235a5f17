"""Making training steps visible and durable without waiting on either.

After a publishing step the loop hands the step to the :class:`Committer`, which
publishes the version in the background (the next step runs meanwhile; one publish in
flight, in version order) and, every ``checkpoint_every`` publishing steps or when the
trainer goes idle, writes a checkpoint in the background from a copy of the learner's
state. Acks follow checkpoints: a group is acked only once a checkpoint on disk holds
its effect (with no checkpoint folder, once its version is published).

- A crash before the checkpoint that covers a step leaves that step's groups pending:
  the restarted trainer replays them from the checkpoint, in the same order, to
  bit-identical weights (the learner is deterministic), so every version it publishes
  again is the same bytes; weightsync accepts an identical republish and refuses
  different weights under a version it holds (:class:`CommitRefused`).
- A crash between a checkpoint and the publish of its version is repaired at start
  (:meth:`Committer.sync_initial_version` publishes the checkpoint's version).
- A crash between a checkpoint and its acks redelivers groups the checkpoint already
  lists: the consumer recognises and acks them without training.

A sharded trainer's rank 0 (a learner with ``publishes_in_parts``, see
:class:`PartsLearner`) publishes each version in parts, one per rank: preparing the parts
is a collective (every rank gathers only its own tensors, the canary runs through the
sharded model, rank 0 signs) done in :meth:`Committer.commit`, before the next step;
sending rank 0's part is the background publish, with the same order, retries and refusals.
"""
from __future__ import annotations

import asyncio
import collections
import copy
import dataclasses
import logging
import time
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

import grpc

from meridian import telemetry
from meridian.tensors import RawTensor, weights_hash
from meridian.v1 import trainer_pb2 as pb
from meridian.v1 import weightsync_pb2
from services.trainer import checkpoint as ckpt
from services.trainer.consumer import GroupConsumer
from services.trainer.learner_protocol import LearnerBroken, PolicyLearner
from services.weightsync import client as weightsync
from services.weightsync.parts import PartEncoder, rank_encode_threads
from services.weightsync.signing import Signer, load_signer

if TYPE_CHECKING:  # torch: imported only where a sharded learner runs
    from services.trainer.shard_publish import PreparedPart

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Progress:
    """What the trainer has done, kept in every checkpoint alongside the learner's state."""

    consumed: int = 0
    counters: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    history: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    checkpoint_step: int = -1
    resumed_from_step: int = -1


@dataclasses.dataclass(frozen=True)
class CommitConfig:
    weightsync: str  # the origin's address
    checkpoint_dir: str  # empty: no checkpoints
    keep_checkpoints: int
    checkpoint_every: int = 1  # publishing steps per checkpoint
    checkpoint_idle_s: float = 5.0  # checkpoint uncovered steps after this long without a step
    signing_key: str = ""  # private key file versions are signed with (empty: unsigned)


class CommitRefused(RuntimeError):
    """Weightsync refused a version (other weights under a version it holds): this
    trainer's history is not the one weightsync serves. Retrying cannot help."""


#: Weightsync's answers that mean "not this version, ever" (PERMISSION_DENIED: an origin
#: that trusts another signing key than this trainer's).
REFUSALS = frozenset(
    {grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED}
)
# About half a minute: an origin restarting after a crash (`meridian chaos` kills it) is back by then.
# The other ranks of a sharded trainer retry their parts on the same schedule.
PUBLISH_RETRY_S = (0.5, 1.0, 2.0, 5.0, 10.0, 15.0)
#: In the checkpoint folder: one JSON line per group acked as trained (see GroupConsumer.open_trained_log).
TRAINED_LOG = "trained-ids.jsonl"


class PartsLearner(PolicyLearner, Protocol):
    """A learner whose versions go out in parts, one per rank (rank 0 of a sharded trainer)."""

    publishes_in_parts: bool

    def prepare_part(
        self, version: int, trace_context: dict[str, str], metrics: dict[str, float], signer: Signer | None, send: bool
    ) -> PreparedPart:
        """Rank 0's part of ``version`` (the current weights): a collective every rank joins,
        after which each other rank sends its own part in the background (unless not ``send``)."""
        ...


#: What publishing one version sends: the whole weights, or this rank's part of them.
Outgoing: TypeAlias = "dict[str, RawTensor] | PreparedPart"


class Committer:
    """Resumes from the newest checkpoint, keeps weightsync in step with it, and commits
    steps: publishes and checkpoints in the background, acks what checkpoints cover."""

    def __init__(self, config: CommitConfig, learner: PolicyLearner, consumer: GroupConsumer, progress: Progress) -> None:
        self.config = config
        self.learner = learner
        self.consumer = consumer
        self.progress = progress
        # Loaded here: a missing or malformed key stops the trainer at start, not at its first publish.
        self.signer = load_signer(config.signing_key)
        self._publishing: asyncio.Task[None] | None = None
        # The version whose publish gave up (weightsync down for every retry), and when: an
        # idle trainer sends it again, or nothing would ever serve it.
        self._unpublished: tuple[int, float] | None = None
        self._checkpointing: asyncio.Task[None] | None = None
        self._since_checkpoint = 0  # publishing steps not covered by a checkpoint
        self.last_step_at = time.monotonic()
        self._in_parts = bool(getattr(learner, "publishes_in_parts", False))
        # Rank 0's part of the last version published, so that it encodes its next part itself.
        self._part_encoder = PartEncoder(rank_encode_threads()) if self._in_parts else None

    def _root(self) -> Path | None:
        return Path(self.config.checkpoint_dir) if self.config.checkpoint_dir else None

    def resume(self) -> bool:
        """Loads the newest complete checkpoint, if any; True when it did."""
        root = self._root()
        if root:
            ckpt.restore_replaced(root)
        path = ckpt.latest_checkpoint(root) if root else None
        if root:
            root.mkdir(parents=True, exist_ok=True)
            ckpt.prune(root, self.config.keep_checkpoints)
            self.consumer.open_trained_log(root / TRAINED_LOG)
        if path is None:
            return False
        state, meta = ckpt.load_checkpoint(path)
        self.learner.load_state(state)
        if "trained_groups" not in meta:
            log.warning("checkpoint %s predates whole-group entries: its trained ids are not group ids, redeliveries are not recognised", path)
        self.consumer.restore(meta.get("trained_groups", []))
        p = self.progress
        p.history = list(meta.get("history", []))
        p.consumed = int(meta.get("consumed", 0))
        p.counters.update(meta.get("counters", {}))
        p.checkpoint_step = p.resumed_from_step = int(meta["step"])
        log.info("resumed from %s (step %d, version %d, %d trained groups)", path, meta["step"], meta["version"], len(self.consumer.trained.as_list()))
        return True

    async def sync_initial_version(self, resumed: bool) -> None:
        """Makes weightsync hold the trainer's version.

        Fresh start: publish version 0, or start from weightsync's latest if it holds other
        weights. Resumed: publish the checkpoint's version when a crash came before its
        publish; when weightsync holds newer versions (published after the checkpoint),
        the replay publishes them again, and weightsync checks they are the same.
        """
        learner = self.learner
        latest = await weightsync.latest_version(self.config.weightsync)
        if resumed:
            if latest < learner.version:
                outgoing = await self._outgoing(learner.version, {}, {})
                await self._publish_now(learner.version, outgoing, {}, {})
                log.info("published version %d from the checkpoint", learner.version)
            elif latest > learner.version:
                log.info("weightsync holds versions up to %d, the checkpoint is at %d: replaying publishes them again", latest, learner.version)
            return
        await self._fresh_start(latest)
        # A checkpoint of the start: what a crash before the first periodic one replays from.
        self._since_checkpoint = 1
        await self.checkpoint()
        await self.flush()

    async def _fresh_start(self, latest: int) -> None:
        learner = self.learner
        # Parts are sent only when version 0 is published; otherwise only the hash is compared.
        outgoing = await self._outgoing(0, {}, {}, send=latest < 0)
        if latest < 0:
            await self._publish_now(0, outgoing, {}, {})
            log.info("published initial version 0")
            return
        manifest = await weightsync.manifest(self.config.weightsync, latest)
        if latest == 0 and manifest.weights_hash == _hash_of(outgoing):
            return
        log.info("weightsync holds version %d; starting from it", latest)
        subscriber = weightsync.WeightSubscriber(self.config.weightsync, None, -1)
        try:
            async for update in subscriber.updates(follow=False):
                await asyncio.to_thread(learner.load_policy_weights, update.weights, update.version)
        finally:
            await subscriber.close()

    async def _outgoing(self, version: int, trace_context: dict[str, str], metrics: dict[str, float], send: bool = True) -> Outgoing:
        """What publishing the learner's current weights as ``version`` sends: the whole
        weights, or for a learner that publishes in parts rank 0's part (a collective: every
        rank gathers its own tensors now, in order with the steps; the header, signed
        now, carries ``trace_context``, ``metrics`` and the canary)."""
        if self._in_parts:
            parts_learner = typing.cast(PartsLearner, self.learner)
            return await asyncio.to_thread(parts_learner.prepare_part, version, trace_context, metrics, self.signer, send)
        return await asyncio.to_thread(self.learner.policy_weights)

    async def _canary(self, outgoing: Outgoing) -> weightsync_pb2.Canary:
        """The canary of ``outgoing`` (a part's header already carries it)."""
        if isinstance(outgoing, dict):
            return await asyncio.to_thread(self.learner.canary, outgoing)
        return outgoing.header.canary

    async def _send(
        self, version: int, outgoing: Outgoing, trace_context: dict[str, str], metrics: dict[str, float], probe: weightsync_pb2.Canary
    ) -> weightsync_pb2.PublishResponse:
        """One attempt: the whole version in one stream, or this rank's part (answered once
        the origin stored the whole version)."""
        if isinstance(outgoing, dict):
            return await weightsync.publish(self.config.weightsync, version, outgoing, trace_context, metrics, probe, self.signer)
        return await weightsync.publish_part(
            self.config.weightsync, outgoing.header, outgoing.index, outgoing.count, outgoing.weights, self._part_encoder
        )

    async def _publish_now(
        self, version: int, outgoing: Outgoing, trace_context: dict[str, str], metrics: dict[str, float], probe: weightsync_pb2.Canary | None = None
    ) -> weightsync_pb2.PublishResponse:
        """Publishes ``version`` with its canary; transient failures are retried, a refusal is final."""
        if probe is None:
            probe = await self._canary(outgoing)
        for attempt, pause in enumerate((*PUBLISH_RETRY_S, None)):
            try:
                return await self._send(version, outgoing, trace_context, metrics, probe)
            except grpc.aio.AioRpcError as exc:
                if exc.code() in REFUSALS:
                    raise CommitRefused(f"weightsync refused version {version}: {exc.details()}") from exc
                if pause is None:
                    raise
                log.warning("publishing version %d failed (%s, attempt %d); retrying in %.1f s", version, exc.code().name, attempt + 1, pause)
                await asyncio.sleep(pause)
        raise AssertionError("unreachable")

    async def commit(self, metrics: pb.StepMetrics, span: Any) -> None:
        """Starts publishing the learner's new version, and a checkpoint when one is due.

        Waits only for the weights to be copied (and for the previous publish or
        checkpoint, if it is still running: at most one of each is in flight)."""
        learner = self.learner
        p = self.progress
        self.last_step_at = started = time.monotonic()
        if self._root() is not None:
            p.history.append({"step": learner.step_count, "version": learner.version, "master_hash": await asyncio.to_thread(learner.master_hash)})
        values = {"loss": metrics.loss, "reward_mean": metrics.reward_mean, "grad_norm": metrics.grad_norm, "pass_rate": metrics.pass_rate}
        trace = telemetry.inject(span)
        prepared = await self._prepare(learner.version, trace, values)
        if prepared is not None:
            acks = self._publish_acks()
            await _finished(self._publishing)
            self._publishing = asyncio.create_task(self._publish(learner.version, *prepared, trace, values, metrics, acks))
        # Counted either way: the step changed the weights, and a checkpoint must cover it.
        self._since_checkpoint += 1
        if self._root() is not None and self._since_checkpoint >= self.config.checkpoint_every:
            await self.checkpoint()
        metrics.commit_seconds = time.monotonic() - started

    async def _prepare(self, version: int, trace: dict[str, str], values: dict[str, float]) -> tuple[Outgoing, weightsync_pb2.Canary] | None:
        """What publishing ``version`` sends, and its canary; None when making them failed
        (a rank's gather or the canary raised, the learner unchanged by it): logged, and the
        version marked unpublished, so that the next step's publish or, with none coming,
        the idle trainer (:meth:`_republish`) sends it. Raised out of the commit instead,
        the step's version would be served by nothing until a later step, and a trainer at
        the end of its data would serve the previous one for good."""
        try:
            # Gathers (and, in parts, every rank's collectives) here, before the next step.
            outgoing = await self._outgoing(version, trace, values)
            # The canary runs the learner's model: here, not beside the next step.
            return outgoing, await self._canary(outgoing)
        except (LearnerBroken, CommitRefused):
            raise
        except Exception:
            log.exception("preparing version %d for publishing failed; it goes out with the next publish", version)
            self._gave_up(version)
            return None

    def _publish_acks(self) -> dict[str, str] | None:
        """What a publish acks once it is stored: without checkpoints a publish is the only
        durable record, so the groups unacked now; with them, nothing (a checkpoint acks)."""
        return self.consumer.unacked() if self._root() is None else None

    def _gave_up(self, version: int) -> None:
        """Marks ``version`` unpublished; an older version's publish failing later (it runs
        in the background) must not hide a newer one that :meth:`_republish` would send.
        Counted: a failure that repeats shows only as a served version lagging the trainer's."""
        self.progress.counters["publishes_given_up"] += 1
        if self._unpublished is None or self._unpublished[0] <= version:
            self._unpublished = (version, time.monotonic())

    async def _publish(
        self, version: int, outgoing: Outgoing, probe: weightsync_pb2.Canary, trace: dict[str, str], values: dict[str, float],
        metrics: pb.StepMetrics, acks: dict[str, str] | None,
    ) -> None:
        started = time.monotonic()
        try:
            reply = await self._publish_now(version, outgoing, trace, values, probe)
        except CommitRefused:
            raise
        except Exception:
            # Weightsync unreachable for every retry: the next version goes out as a delta
            # on what it holds; without checkpoints these groups stay pending and replay.
            log.exception("version %d was not published", version)
            self._gave_up(version)
            return
        if self._unpublished is not None and self._unpublished[0] <= version:
            self._unpublished = None
        metrics.published = True
        metrics.publish_seconds = time.monotonic() - started
        metrics.weightsync_raw_bytes = reply.raw_bytes
        metrics.weightsync_encoded_bytes = reply.encoded_bytes
        if acks is not None:
            await self._ack(acks, f"version {version}")

    async def checkpoint(self) -> None:
        """Starts writing a checkpoint of the learner as it is now; its acks follow it."""
        root = self._root()
        if root is None or self._since_checkpoint == 0:
            return
        learner = self.learner
        p = self.progress
        await _finished(self._checkpointing)
        # A copy: the next step changes the weights and the optimiser state in place.
        state = await asyncio.to_thread(lambda: copy.deepcopy(learner.state()))
        meta = {
            "step": learner.step_count,
            "version": learner.version,
            "trained_groups": self.consumer.trained.as_list(),
            "history": list(p.history),
            "consumed": p.consumed,
            "counters": dict(p.counters),
        }
        acks = self.consumer.unacked()
        self._since_checkpoint = 0
        self._checkpointing = asyncio.create_task(self._write_checkpoint(root, state, meta, acks))

    async def _write_checkpoint(self, root: Path, state: dict[str, Any], meta: dict[str, Any], acks: dict[str, str]) -> None:
        try:
            await asyncio.to_thread(ckpt.save_checkpoint, root, meta["step"], state, meta, self.config.keep_checkpoints)
        except Exception:
            # Nothing is acked, so nothing is lost; the next checkpoint covers these steps.
            log.exception("checkpoint of step %d failed", meta["step"])
            self._since_checkpoint += 1
            return
        self.progress.checkpoint_step = meta["step"]
        await self._ack(acks, f"checkpoint {meta['step']}")
        if self.consumer.unacked():
            self._since_checkpoint += 1  # an idle trainer checkpoints again, and acks then

    async def _ack(self, acks: dict[str, str], what: str) -> None:
        """Acks what ``what`` covers. A failure (Redis restarting) leaves the groups unacked
        for the next checkpoint or publish to ack: raised here, it would stay in this
        commit's task and fail every later one, which waits for it."""
        try:
            await self.consumer.ack(acks)
        except Exception:
            log.exception("acking the groups %s covers failed; the next one acks them", what)

    @property
    def checkpoints(self) -> bool:
        """Whether this trainer writes checkpoints (and acks only what one covers)."""
        return self._root() is not None

    def uncovered(self) -> None:
        """A step took groups without changing the weights (every sample stale or flat): it
        publishes nothing, so the next checkpoint (the idle one at the latest) must cover
        and ack its groups."""
        self._since_checkpoint += 1

    async def idle(self) -> None:
        """Called when no batch is ready: checkpoints uncovered steps after ``checkpoint_idle_s``
        so that a quiet trainer leaves nothing to replay; raises a refused publish."""
        if self._publishing is not None and self._publishing.done():
            self._publishing.result()
        # None: no publish since the start (the first step's preparation may have failed).
        if self._publishing is None or self._publishing.done():
            await self._republish()
        if self._since_checkpoint and time.monotonic() - self.last_step_at >= self.config.checkpoint_idle_s:
            await self.checkpoint()

    async def _republish(self) -> None:
        """Sends the learner's version again when its publish gave up and no newer step came
        (a later step's publish carries it otherwise), at most every ``checkpoint_idle_s``."""
        if self._unpublished is None:
            return
        version, failed_at = self._unpublished
        if version != self.learner.version or time.monotonic() - failed_at < self.config.checkpoint_idle_s:
            return
        self._unpublished = None
        log.info("publishing version %d again (its publish gave up)", version)
        # Prepared here, in order with the steps, like a commit's (a collective in parts).
        prepared = await self._prepare(version, {}, {})
        if prepared is None:
            return
        self._publishing = asyncio.create_task(self._publish(version, *prepared, {}, {}, pb.StepMetrics(), self._publish_acks()))

    async def flush(self) -> None:
        """Waits for the publish and the checkpoint in flight (ordered shutdown)."""
        await _finished(self._publishing)
        await _finished(self._checkpointing)


def _hash_of(outgoing: Outgoing) -> str:
    """The weights hash of the whole version ``outgoing`` publishes (or is part of)."""
    return weights_hash(outgoing) if isinstance(outgoing, dict) else outgoing.header.weights_hash


async def _finished(task: asyncio.Task[None] | None) -> None:
    """Waits for ``task``; only a refusal escapes it (see :class:`CommitRefused`)."""
    if task is not None:
        await task
