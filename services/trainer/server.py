"""gRPC adapter of the trainer: builds the components in order and reports ``Status``.

The components: a learner (:mod:`services.trainer.learner_protocol`), the group consumer
with its exactly-once ledger (:mod:`services.trainer.consumer`), the committer that
makes steps durable in the safe order (:mod:`services.trainer.commit`), and the loop
that drives them (:mod:`services.trainer.loop`).

Exactly-once effect on the weights:
- every group id the trainer has trained on is part of the checkpoint, so a
  redelivered entry (a crash before its ack, an XAUTOCLAIM, a duplicate XADD) is
  recognised after a restart and acked without training;
- entries are acked only after the checkpoint that contains their effect is on disk,
  so a crash before that replays them, from that checkpoint, into the same step;
- versions are published before the checkpoint that covers them (nothing waits on
  disk); the replay publishes them again with the same bytes, and weightsync refuses
  different weights under a version it holds, which stops the trainer.
"""
from __future__ import annotations

import asyncio
import contextlib

import grpc

from meridian import metrics
from meridian.grpc_runtime import failure_of
from meridian.model_store import resolve_model
from meridian.trajectory_transport import GroupTransport, open_transport
from meridian.v1 import trainer_pb2 as pb
from meridian.v1 import trainer_pb2_grpc as pb_grpc
from services.trainer.commit import CommitConfig, CommitRefused, Committer, Progress
from services.trainer.config import TrainerConfig
from services.trainer.consumer import ConsumerConfig, GroupConsumer
from services.trainer.learner_protocol import PolicyLearner
from services.trainer.loop import TrainingLoop


class TrainerService(pb_grpc.TrainerServicer):
    """Asynchronous GRPO over the trajectory transport."""

    service_names = (pb.DESCRIPTOR.services_by_name["Trainer"].full_name,)

    def __init__(self, config: TrainerConfig, learner: PolicyLearner | None = None, transport: GroupTransport | None = None) -> None:
        self.config = config
        self.transport = transport if transport is not None else open_transport(config.transport_config())
        self.learner = learner  # loaded in start() unless given: torch and the model are heavy
        self.progress = Progress()
        consumer_config = ConsumerConfig(config.consumer, config.dedupe_window, config.claim_idle_ms, config.claim_every_s)
        self.consumer = GroupConsumer(self.transport, consumer_config, self.progress.counters)
        self.loop: TrainingLoop | None = None
        self.committer: Committer | None = None
        self._task: asyncio.Task[None] | None = None
        self.metrics = metrics.ServiceMetrics("trainer", self._metric_values)
        self._steps_observed = metrics.StepObserver(self.metrics)

    def register(self, server: grpc.aio.Server) -> None:
        pb_grpc.add_TrainerServicer_to_server(self, server)

    async def start(self) -> None:
        """Learner, then the newest checkpoint, then weightsync brought in step, then the loop."""
        if self.learner is None:
            from services.trainer.learner import Learner, resolve_device

            model_dir = await asyncio.to_thread(resolve_model, self.config.model)
            self.learner = await asyncio.to_thread(lambda: Learner(model_dir, self.config, resolve_device(self.config.device)))
        cfg = self.config
        commit_config = CommitConfig(cfg.weightsync, cfg.checkpoint_dir, cfg.keep_checkpoints, cfg.checkpoint_every, cfg.checkpoint_idle_s, cfg.signing_key)
        committer = self.committer = Committer(commit_config, self.learner, self.consumer, self.progress)
        resumed = await asyncio.to_thread(committer.resume)
        # Groups this model cannot take are dead-lettered on arrival (the consumer was
        # built before the learner was loaded).
        self.consumer.check = self.learner.check_group
        await self.consumer.start()
        await committer.sync_initial_version(resumed)
        self.loop = TrainingLoop(self.learner, self.consumer, committer, self.progress, cfg.groups_per_step, cfg.publish_every)
        self._task = asyncio.create_task(self.loop.run())

    async def failure(self) -> str:
        """Returns once the training loop has ended, which it does only when weightsync
        refused a version (:class:`CommitRefused`: what this trainer would publish differs
        from what weightsync holds) or the learner cannot go on
        (:class:`~services.trainer.learner_protocol.LearnerBroken`: an optimizer step that
        raised part-way, or a distributed learner's ranks that cannot go on together,
        naming each rank's error and the phase): training cannot go on, so the service stops."""
        return await failure_of(self._task, "the training loop")

    async def stop(self) -> None:
        """The loop first, then the publish and checkpoint in flight, then the transport."""
        if self._task:
            self._task.cancel()
            await asyncio.wait({self._task})  # its error, if it died of one, is failure()'s to report
        if self.committer is not None:
            with contextlib.suppress(CommitRefused):
                await self.committer.flush()
        await self.transport.close()

    async def _metric_values(self) -> list[metrics.Value]:
        """What the metrics endpoint exports: the Status figures (new steps into the step-time
        histogram) and the stream's length and pending entries."""
        status = await self.Status(pb.TrainerStatusRequest(), None)  # type: ignore[arg-type]
        self._steps_observed.update(status.recent_steps)
        return metrics.trainer_values(status, await self.transport.length(), await self.transport.pending())

    async def Status(self, request: pb.TrainerStatusRequest, context: grpc.aio.ServicerContext) -> pb.TrainerStatus:
        learner = self.learner
        p = self.progress
        c = p.counters
        return pb.TrainerStatus(
            step=learner.step_count if learner else 0,
            policy_version=learner.version if learner else 0,
            trajectories_consumed=p.consumed,
            trajectories_pending=self.consumer.ready_trajectories(),
            recent_steps=self.loop.recent_steps() if self.loop else [],
            model=self.config.model,
            dropped_stale_total=c["dropped_stale"],
            downweighted_stale_total=c["downweighted_stale"],
            dead_lettered=c["dead_lettered"],
            duplicates_skipped=c["duplicates_skipped"],
            claimed=c["claimed"],
            checkpoint_step=p.checkpoint_step,
            resumed_from_step=p.resumed_from_step,
            dropped_groups_total=c["dropped_groups"],
            skipped_steps_total=c["skipped_steps"],
            publishes_given_up_total=c["publishes_given_up"],
        )
