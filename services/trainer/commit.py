"""Making a training step durable, in the one order that makes every ack safe:
checkpoint (the learner's state, the trained group ids, the progress) → publish the
version to weightsync → ack the groups the step consumed.

- A crash before the checkpoint replays the groups (still pending) into the same step.
- A crash between checkpoint and publish is repaired at start (:meth:`Committer.sync_initial_version`
  publishes the checkpoint's version), so weightsync never holds weights no checkpoint has.
- A crash between publish and ack redelivers groups the checkpoint already lists: the
  consumer recognises and acks them without training.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
from pathlib import Path
from typing import Any

from meridian import telemetry
from meridian.tensors import RawTensor, weights_hash
from meridian.v1 import trainer_pb2 as pb
from meridian.v1 import weightsync_pb2
from services.trainer import checkpoint as ckpt
from services.trainer.consumer import GroupConsumer
from services.trainer.learner_protocol import PolicyLearner
from services.weightsync import client as weightsync

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


class Committer:
    """Resumes from the newest checkpoint, keeps weightsync in step with it, and commits steps."""

    def __init__(self, config: CommitConfig, learner: PolicyLearner, consumer: GroupConsumer, progress: Progress) -> None:
        self.config = config
        self.learner = learner
        self.consumer = consumer
        self.progress = progress

    def _root(self) -> Path | None:
        return Path(self.config.checkpoint_dir) if self.config.checkpoint_dir else None

    def resume(self) -> bool:
        """Loads the newest complete checkpoint, if any; True when it did."""
        root = self._root()
        path = ckpt.latest_checkpoint(root) if root else None
        if root:
            root.mkdir(parents=True, exist_ok=True)
            ckpt.prune(root, self.config.keep_checkpoints)
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
        weights. Resumed: publish the checkpoint's version when a crash came between the
        checkpoint and its publish; weightsync never holds a newer one (it is written second).
        """
        learner = self.learner
        latest = await weightsync.latest_version(self.config.weightsync)
        if resumed:
            if latest < learner.version:
                weights = await asyncio.to_thread(learner.policy_weights)
                await self.publish(learner.version, weights)
                log.info("published version %d from the checkpoint", learner.version)
            elif latest > learner.version:
                raise RuntimeError(
                    f"weightsync holds version {latest}, newer than the newest checkpoint's {learner.version}: "
                    f"the checkpoint folder {self.config.checkpoint_dir!r} is not this job's, or lost checkpoints"
                )
            return
        weights = await asyncio.to_thread(learner.policy_weights)
        if latest < 0:
            await self.publish(0, weights)
            log.info("published initial version 0")
            return
        manifest = await weightsync.manifest(self.config.weightsync, latest)
        if latest == 0 and manifest.weights_hash == weights_hash(weights):
            return
        log.info("weightsync holds version %d; starting from it", latest)
        subscriber = weightsync.WeightSubscriber(self.config.weightsync, None, -1)
        try:
            async for update in subscriber.updates(follow=False):
                await asyncio.to_thread(learner.load_policy_weights, update.weights, update.version)
        finally:
            await subscriber.close()

    async def publish(
        self, version: int, weights: dict[str, RawTensor], trace_context: dict[str, str] | None = None, metrics: dict[str, float] | None = None
    ) -> weightsync_pb2.PublishResponse:
        """Publishes ``version`` with its canary (what the learner computes with exactly these weights)."""
        probe = await asyncio.to_thread(self.learner.canary, weights)
        return await weightsync.publish(self.config.weightsync, version, weights, trace_context, metrics, probe)

    async def commit(self, metrics: pb.StepMetrics, span: Any) -> None:
        """Checkpoint, then publish, then ack; fills the publish figures into ``metrics``."""
        learner = self.learner
        root = self._root()
        p = self.progress
        if root is not None:
            p.history.append({"step": learner.step_count, "version": learner.version, "master_hash": await asyncio.to_thread(learner.master_hash)})
            state = await asyncio.to_thread(learner.state)
            meta = {
                "step": learner.step_count,
                "version": learner.version,
                "trained_groups": self.consumer.trained.as_list(),
                "history": p.history,
                "consumed": p.consumed,
                "counters": dict(p.counters),
            }
            await asyncio.to_thread(ckpt.save_checkpoint, root, learner.step_count, state, meta, self.config.keep_checkpoints)
            p.checkpoint_step = learner.step_count
        weights = await asyncio.to_thread(learner.policy_weights)
        values = {"loss": metrics.loss, "reward_mean": metrics.reward_mean, "grad_norm": metrics.grad_norm, "pass_rate": metrics.pass_rate}
        reply = await self.publish(learner.version, weights, telemetry.inject(span), values)
        span.set_attribute("meridian.version", reply.version)
        span.set_attribute("meridian.encoded_bytes", reply.encoded_bytes)
        metrics.published = True
        metrics.weightsync_raw_bytes = reply.raw_bytes
        metrics.weightsync_encoded_bytes = reply.encoded_bytes
        await self.consumer.ack_trained()
