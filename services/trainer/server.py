"""The trainer process: consumes complete GRPO groups from the trajectory stream,
steps the learner, publishes each new version to weightsync, and only then acks the
entries that went into it. ``Status`` observes it over gRPC."""
from __future__ import annotations

import asyncio
import collections
import contextlib
import logging

import grpc
from opentelemetry.trace import Link

from meridian import telemetry
from meridian.model_store import resolve_model
from meridian.trajectory_stream import TrajectoryStream
from meridian.v1 import common_pb2
from meridian.v1 import trainer_pb2 as pb
from meridian.v1 import trainer_pb2_grpc as pb_grpc
from services.trainer.batch import GroupBuffer
from services.trainer.config import TrainerConfig
from services.weightsync import client as weightsync
from services.weightsync.tensors import weights_hash

log = logging.getLogger(__name__)
tracer = telemetry.tracer(__name__)

READ_BLOCK_MS = 500
READ_COUNT = 64


class TrainerService(pb_grpc.TrainerServicer):
    """Asynchronous GRPO over the trajectory stream."""

    service_names = (pb.DESCRIPTOR.services_by_name["Trainer"].full_name,)

    def __init__(self, config: TrainerConfig) -> None:
        self.config = config
        self.stream = TrajectoryStream.from_url(config.redis_url, config.stream)
        self.buffer = GroupBuffer()
        self.learner = None  # loaded in start(): torch and the model are heavy
        self.consumed = 0
        self.recent: collections.deque[pb.StepMetrics] = collections.deque(maxlen=32)
        self._loop: asyncio.Task[None] | None = None

    def register(self, server: grpc.aio.Server) -> None:
        pb_grpc.add_TrainerServicer_to_server(self, server)

    async def start(self) -> None:
        from services.trainer.learner import Learner

        model_dir = await asyncio.to_thread(resolve_model, self.config.model)
        self.learner = await asyncio.to_thread(Learner, model_dir, self.config)
        await self.stream.ensure_group(self.config.group)
        await self._sync_initial_version()
        self._loop = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._loop:
            self._loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop
        await self.stream.close()

    async def _sync_initial_version(self) -> None:
        """Publishes version 0, or starts from weightsync's latest if it holds other weights."""
        assert self.learner is not None
        latest = await weightsync.latest_version(self.config.weightsync)
        weights = await asyncio.to_thread(self.learner.policy_weights)
        if latest < 0:
            await weightsync.publish(self.config.weightsync, 0, weights)
            log.info("published initial version 0")
            return
        manifest_hash = (await self._manifest(latest)).weights_hash
        if latest == 0 and manifest_hash == weights_hash(weights):
            return
        log.info("weightsync holds version %d; starting from it", latest)
        subscriber = weightsync.WeightSubscriber(self.config.weightsync, None, -1)
        try:
            async for update in subscriber.updates(follow=False):
                await asyncio.to_thread(self.learner.load_policy_weights, update.weights, update.version)
        finally:
            await subscriber.close()

    async def _manifest(self, version: int):  # type: ignore[no-untyped-def]
        from meridian.grpc_runtime import open_channel
        from meridian.v1 import weightsync_pb2, weightsync_pb2_grpc

        async with open_channel(self.config.weightsync) as channel:
            return await weightsync_pb2_grpc.WeightSyncStub(channel).GetManifest(weightsync_pb2.GetManifestRequest(version=version))

    async def _run(self) -> None:
        cfg = self.config
        # Entries delivered to this consumer before a restart come first.
        for entry in await self.stream.read_own_pending(cfg.group, cfg.consumer, 10_000):
            await self._accept(entry)
        while True:
            try:
                for entry in await self.stream.read(cfg.group, cfg.consumer, READ_COUNT, READ_BLOCK_MS):
                    await self._accept(entry)
                groups = self.buffer.pop_complete(cfg.groups_per_step)
                if groups:
                    await self._train(groups)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("trainer loop error; retrying")
                await asyncio.sleep(1.0)

    async def _accept(self, entry) -> None:  # type: ignore[no-untyped-def]
        if entry.trajectory is None:
            log.warning("dead-lettering entry %s: %s", entry.entry_id, entry.error)
            await self.stream.move_to_dead_letter(self.config.group, entry)
            return
        if not self.buffer.add(entry.entry_id, entry.trajectory):
            await self.stream.ack(self.config.group, [entry.entry_id])

    async def _train(self, groups: list[list[tuple[str, common_pb2.Trajectory]]]) -> None:
        assert self.learner is not None
        trajs = [[t for _, t in g] for g in groups]
        entry_ids = [eid for g in groups for eid, _ in g]
        links = [Link(ctx) for g in trajs for t in g if (ctx := telemetry.span_context_of(dict(t.trace_context)))]
        with tracer.start_as_current_span("trainer.step", links=links) as span:
            result = await asyncio.to_thread(self.learner.step, trajs)
            span.set_attribute("meridian.step", result.step)
            span.set_attribute("meridian.trajectories", result.trajectories)
            if result.trajectories:
                weights = await asyncio.to_thread(self.learner.policy_weights)
                metrics = {"loss": result.loss, "reward_mean": result.reward_mean, "grad_norm": result.grad_norm}
                reply = await weightsync.publish(self.config.weightsync, self.learner.version, weights, telemetry.inject(span), metrics)
                span.set_attribute("meridian.version", reply.version)
                span.set_attribute("meridian.encoded_bytes", reply.encoded_bytes)
        # Ack only once the version that used these entries is durable at weightsync.
        await self.stream.ack(self.config.group, entry_ids)
        self.consumed += len(entry_ids)
        self.recent.append(
            pb.StepMetrics(
                step=result.step,
                policy_version=self.learner.version,
                loss=result.loss,
                reward_mean=result.reward_mean,
                trajectories=result.trajectories,
                groups=result.groups,
                step_seconds=result.seconds,
                grad_norm=result.grad_norm,
                dropped_stale=result.dropped_stale,
            )
        )
        log.info("step %d -> version %d: loss %.4f reward %.3f (%d trajectories, %d stale)", result.step, self.learner.version, result.loss, result.reward_mean, result.trajectories, result.dropped_stale)

    async def Status(self, request: pb.TrainerStatusRequest, context: grpc.aio.ServicerContext) -> pb.TrainerStatus:
        learner = self.learner
        return pb.TrainerStatus(
            step=learner.step_count if learner else 0,
            policy_version=learner.version if learner else 0,
            trajectories_consumed=self.consumed,
            trajectories_pending=self.buffer.pending(),
            recent_steps=list(self.recent),
            model=self.config.model,
        )
