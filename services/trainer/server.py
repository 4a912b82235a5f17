"""The trainer process: consumes complete GRPO groups from the trajectory stream,
steps the learner, and every ``publish_every`` steps makes the result durable —
checkpoint first, then the new version to weightsync — and only then acks the
entries that went into it. ``Status`` observes it over gRPC.

Exactly-once effect on the weights:
- every trajectory id the trainer has processed is part of the checkpoint, so a
  redelivered entry (a crash before its ack, an XAUTOCLAIM, a duplicate XADD) is
  recognised after a restart and acked without training;
- entries are acked only after the checkpoint that contains their effect is on disk,
  so a crash before that replays them, from that checkpoint, into the same step;
- a published version always has a checkpoint (it is written first), so a restart
  never publishes different weights under a version weightsync already holds.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from pathlib import Path
from typing import Any

import grpc
from opentelemetry.trace import Link

from meridian import telemetry
from meridian.model_store import resolve_model
from meridian.trajectory_transport import GroupEntry, GroupTransport, open_transport
from meridian.v1 import common_pb2
from meridian.v1 import trainer_pb2 as pb
from meridian.v1 import trainer_pb2_grpc as pb_grpc
from meridian.v1 import weightsync_pb2
from services.trainer import checkpoint as ckpt
from services.trainer.config import TrainerConfig
from services.weightsync import client as weightsync
from meridian.tensors import RawTensor, weights_hash

log = logging.getLogger(__name__)
tracer = telemetry.tracer(__name__)

READ_BLOCK_MS = 500
READ_COUNT = 64
RECENT_STEPS = 256


class TrainedIds:
    """Group ids already trained on, oldest first, bounded to ``window`` ids."""

    def __init__(self, window: int, ids: list[str] | None = None) -> None:
        self.window = window
        self._ids: collections.OrderedDict[str, None] = collections.OrderedDict((i, None) for i in (ids or [])[-window:])

    def __contains__(self, tid: str) -> bool:
        return tid in self._ids

    def add(self, tid: str) -> None:
        self._ids[tid] = None
        while len(self._ids) > self.window:
            self._ids.popitem(last=False)

    def as_list(self) -> list[str]:
        return list(self._ids)


class TrainerService(pb_grpc.TrainerServicer):
    """Asynchronous GRPO over the trajectory stream."""

    service_names = (pb.DESCRIPTOR.services_by_name["Trainer"].full_name,)

    def __init__(self, config: TrainerConfig, learner: Any = None, transport: GroupTransport | None = None) -> None:
        self.config = config
        self.transport = transport if transport is not None else open_transport(config.transport_config())
        # Complete groups received and not trained on yet, oldest first: group id -> (entry id, group).
        self.ready: dict[str, tuple[str, common_pb2.TrajectoryGroup]] = {}
        self.learner = learner  # loaded in start() unless given: torch and the model are heavy
        self.trained = TrainedIds(config.dedupe_window)
        # Groups whose effect is in the weights but not yet in a checkpoint: acked at the next commit.
        self._unacked: dict[str, str] = {}  # group id -> entry id
        self._uncommitted: list[pb.StepMetrics] = []
        self.history: list[dict[str, Any]] = []
        self.counters = collections.Counter[str]()
        self.consumed = 0
        self.checkpoint_step = -1
        self.resumed_from_step = -1
        self.recent: collections.deque[pb.StepMetrics] = collections.deque(maxlen=RECENT_STEPS)
        self._loop: asyncio.Task[None] | None = None
        self._next_claim = 0.0

    def register(self, server: grpc.aio.Server) -> None:
        pb_grpc.add_TrainerServicer_to_server(self, server)

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self.learner is None:
            from services.trainer.learner import Learner

            model_dir = await asyncio.to_thread(resolve_model, self.config.model)
            self.learner = await asyncio.to_thread(Learner, model_dir, self.config)
        resumed = await asyncio.to_thread(self._resume)
        await self.transport.ensure_consumer_group()
        await self._sync_initial_version(resumed)
        self._loop = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._loop:
            self._loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop
        await self.transport.close()

    def _checkpoint_root(self) -> Path | None:
        return Path(self.config.checkpoint_dir) if self.config.checkpoint_dir else None

    def _resume(self) -> bool:
        """Loads the newest complete checkpoint, if any; True when it did."""
        root = self._checkpoint_root()
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
        self.trained = TrainedIds(self.config.dedupe_window, meta.get("trained_groups", []))
        self.history = list(meta.get("history", []))
        self.consumed = int(meta.get("consumed", 0))
        self.counters.update(meta.get("counters", {}))
        self.checkpoint_step = self.resumed_from_step = int(meta["step"])
        log.info("resumed from %s (step %d, version %d, %d trained groups)", path, meta["step"], meta["version"], len(self.trained.as_list()))
        return True

    async def _sync_initial_version(self, resumed: bool) -> None:
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
                await self._publish(learner.version, weights)
                log.info("published version %d from the checkpoint", learner.version)
            elif latest > learner.version:
                raise RuntimeError(
                    f"weightsync holds version {latest}, newer than the newest checkpoint's {learner.version}: "
                    f"the checkpoint folder {self.config.checkpoint_dir!r} is not this job's, or lost checkpoints"
                )
            return
        weights = await asyncio.to_thread(learner.policy_weights)
        if latest < 0:
            await self._publish(0, weights)
            log.info("published initial version 0")
            return
        manifest_hash = (await self._manifest(latest)).weights_hash
        if latest == 0 and manifest_hash == weights_hash(weights):
            return
        log.info("weightsync holds version %d; starting from it", latest)
        subscriber = weightsync.WeightSubscriber(self.config.weightsync, None, -1)
        try:
            async for update in subscriber.updates(follow=False):
                await asyncio.to_thread(learner.load_policy_weights, update.weights, update.version)
        finally:
            await subscriber.close()

    async def _publish(
        self, version: int, weights: dict[str, RawTensor], trace_context: dict[str, str] | None = None, metrics: dict[str, float] | None = None
    ) -> weightsync_pb2.PublishResponse:
        """Publishes ``version`` with its canary (what this trainer's forward pass computes with it)."""
        probe = await asyncio.to_thread(self.learner.canary, weights)
        return await weightsync.publish(self.config.weightsync, version, weights, trace_context, metrics, probe)

    async def _manifest(self, version: int):  # type: ignore[no-untyped-def]
        from meridian.grpc_runtime import open_channel
        from meridian.v1 import weightsync_pb2, weightsync_pb2_grpc

        async with open_channel(self.config.weightsync) as channel:
            return await weightsync_pb2_grpc.WeightSyncStub(channel).GetManifest(weightsync_pb2.GetManifestRequest(version=version))

    # ------------------------------------------------------------ consumption

    async def _run(self) -> None:
        cfg = self.config
        # Entries delivered to this consumer before a restart come first, then those a
        # dead consumer left behind, then new ones: stream order is kept where it can be.
        for entry in await self.transport.read_own_pending(cfg.consumer, 10_000):
            await self._accept(entry)
        await self._claim()
        while True:
            try:
                if time.monotonic() >= self._next_claim:
                    await self._claim()
                for entry in await self.transport.read(cfg.consumer, READ_COUNT, READ_BLOCK_MS):
                    await self._accept(entry)
                while len(self.ready) >= cfg.groups_per_step:
                    taken = [self.ready.pop(gid) for gid in list(self.ready)[: cfg.groups_per_step]]
                    await self._train(taken)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("trainer loop error; retrying")
                await asyncio.sleep(1.0)

    async def _claim(self) -> None:
        """Takes over entries another (dead) consumer left pending for ``claim_idle_ms``."""
        self._next_claim = time.monotonic() + self.config.claim_every_s
        while True:
            entries = await self.transport.claim_stale(self.config.consumer, self.config.claim_idle_ms)
            fresh = 0
            for entry in entries:
                fresh += await self._accept(entry)
            self.counters["claimed"] += fresh
            if fresh:
                log.info("claimed %d entries left pending by another consumer", fresh)
            # Entries this consumer already holds come back too; stop once a page brings nothing new.
            if not fresh or len(entries) < 100:
                return

    async def _accept(self, entry: GroupEntry) -> bool:
        """Routes one delivered entry; True when its group is new to this trainer."""
        if entry.group is None:
            log.warning("dead-lettering entry %s: %s", entry.entry_id, entry.error)
            await self.transport.dead_letter(entry)
            self.counters["dead_lettered"] += 1
            return False
        gid = entry.group.group_id
        held = self.ready[gid][0] if gid in self.ready else self._unacked.get(gid)
        if held == entry.entry_id:
            return False  # the same entry again (a claim of our own): it will be acked with its step
        if held is not None or gid in self.trained:
            # A second copy, or a redelivery of something a checkpoint already holds. The
            # copy we hold (if any) keeps its entry pending until its own commit.
            self.counters["duplicates_skipped"] += 1
            await self.transport.ack([entry.entry_id])
            return False
        self.ready[gid] = (entry.entry_id, entry.group)
        return True

    # ------------------------------------------------------------ training

    async def _train(self, taken: list[tuple[str, common_pb2.TrajectoryGroup]]) -> None:
        learner = self.learner
        trajs = [list(group.trajectories) for _, group in taken]
        links = [Link(ctx) for g in trajs for t in g if (ctx := telemetry.span_context_of(dict(t.trace_context)))]
        with tracer.start_as_current_span("trainer.step", links=links) as span:
            result = await asyncio.to_thread(learner.step, trajs)
            span.set_attribute("meridian.step", result.step)
            span.set_attribute("meridian.trajectories", result.trajectories)
            for eid, group in taken:
                self.trained.add(group.group_id)
                self._unacked[group.group_id] = eid
            self.consumed += sum(len(g) for g in trajs)
            self.counters["dropped_stale"] += result.dropped_stale
            self.counters["downweighted_stale"] += result.downweighted_stale
            self.counters["dropped_groups"] += result.dropped_groups
            metrics = pb.StepMetrics(
                step=result.step,
                policy_version=learner.version,
                loss=result.loss,
                reward_mean=result.reward_mean,
                trajectories=result.trajectories,
                groups=result.groups,
                step_seconds=result.seconds,
                grad_norm=result.grad_norm,
                dropped_stale=result.dropped_stale,
                downweighted_stale=result.downweighted_stale,
                dropped_groups=result.dropped_groups,
                pass_rate=result.pass_rate,
                policy_lag_mean=result.lag_mean,
                policy_lag_max=result.lag_max,
                lr=result.lr,
                stepped=result.stepped,
                tis_weight_mean=result.stats.get("is_weight_mean", 0.0),
                kl=result.stats.get("kl", 0.0),
            )
            self._uncommitted.append(metrics)
            if result.stepped and learner.step_count % self.config.publish_every == 0:
                await self._commit(metrics, span)
        log.info(
            "step %d -> version %d: loss %.4f reward %.3f (%d trajectories, %d stale dropped, %d down-weighted, %d flat groups)",
            result.step, learner.version, result.loss, result.reward_mean, result.trajectories,
            result.dropped_stale, result.downweighted_stale, result.dropped_groups,
        )

    async def _commit(self, metrics: pb.StepMetrics, span: Any) -> None:
        """Checkpoint, then publish, then ack: the order that makes every ack safe."""
        learner = self.learner
        root = self._checkpoint_root()
        if root is not None:
            self.history.append({"step": learner.step_count, "version": learner.version, "master_hash": await asyncio.to_thread(learner.master_hash)})
            state = await asyncio.to_thread(learner.state)
            meta = {
                "step": learner.step_count,
                "version": learner.version,
                "trained_groups": self.trained.as_list(),
                "history": self.history,
                "consumed": self.consumed,
                "counters": dict(self.counters),
            }
            await asyncio.to_thread(ckpt.save_checkpoint, root, learner.step_count, state, meta, self.config.keep_checkpoints)
            self.checkpoint_step = learner.step_count
        weights = await asyncio.to_thread(learner.policy_weights)
        values = {"loss": metrics.loss, "reward_mean": metrics.reward_mean, "grad_norm": metrics.grad_norm, "pass_rate": metrics.pass_rate}
        reply = await self._publish(learner.version, weights, telemetry.inject(span), values)
        span.set_attribute("meridian.version", reply.version)
        span.set_attribute("meridian.encoded_bytes", reply.encoded_bytes)
        metrics.published = True
        metrics.weightsync_raw_bytes = reply.raw_bytes
        metrics.weightsync_encoded_bytes = reply.encoded_bytes
        await self.transport.ack(list(self._unacked.values()))
        self._unacked.clear()
        self.recent.extend(self._uncommitted)
        self._uncommitted.clear()

    # ------------------------------------------------------------ status

    async def Status(self, request: pb.TrainerStatusRequest, context: grpc.aio.ServicerContext) -> pb.TrainerStatus:
        learner = self.learner
        c = self.counters
        return pb.TrainerStatus(
            step=learner.step_count if learner else 0,
            policy_version=learner.version if learner else 0,
            trajectories_consumed=self.consumed,
            trajectories_pending=sum(len(group.trajectories) for _, group in self.ready.values()),
            recent_steps=[*self.recent, *self._uncommitted],
            model=self.config.model,
            dropped_stale_total=c["dropped_stale"],
            downweighted_stale_total=c["downweighted_stale"],
            dead_lettered=c["dead_lettered"],
            duplicates_skipped=c["duplicates_skipped"],
            claimed=c["claimed"],
            checkpoint_step=self.checkpoint_step,
            resumed_from_step=self.resumed_from_step,
            dropped_groups_total=c["dropped_groups"],
        )
