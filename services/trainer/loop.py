"""The trainer's main loop: poll the consumer, step the learner on every ``groups_per_step``
complete groups, and every ``publish_every`` steps hand the result to the committer,
which publishes and checkpoints in the background while the next step runs.

A step that raises leaves the learner as it was (see ``PolicyLearner.step``): its batch
goes back to the front of the ready queue and is tried again, ``STEP_ATTEMPTS`` times in
all, then dead-lettered with the error, so one poison batch cannot stop training (its
entries, never acked, would otherwise come back by claim and fail again, for ever).

A learner that cannot go on raises :class:`LearnerBroken`: an optimizer step that raised
part-way, or (:class:`GroupFailed`) the ranks of a distributed learner that cannot go on
together (from a step, or from the committer's collective reads). The loop ends with it,
nothing acked, and the service stops; a restart resumes from the checkpoint and replays."""
from __future__ import annotations

import asyncio
import collections
import logging
import resource

from opentelemetry.trace import Link

from meridian import telemetry
from meridian.v1 import trainer_pb2 as pb
from services.trainer.commit import CommitRefused, Committer, Progress
from services.trainer.consumer import GroupConsumer, Taken
from services.trainer.learner_protocol import LearnerBroken, PolicyLearner, StepResult

log = logging.getLogger(__name__)
tracer = telemetry.tracer(__name__)

READ_BLOCK_MS = 500
READ_COUNT = 64
RECENT_STEPS = 256
#: Tries of one batch whose step raises, in a row, before its groups are dead-lettered.
STEP_ATTEMPTS = 3
#: Seconds between tries of a batch whose step raised (a transient fault may clear).
STEP_RETRY_S = 1.0


def peak_rss_mb() -> float:
    """This process's peak resident set size so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def step_metrics(result: StepResult, version: int, last_trained: tuple[float, float] = (0.0, 0.0)) -> pb.StepMetrics:
    """The learner's step as reported over gRPC (publish figures are filled in at commit).

    A step skipped for a non-finite loss or gradient norm reports none of its non-finite
    figures (the loss gauge, meridian_trainer_loss, reads the last step's loss, and any
    average over the steps would turn NaN): it reports as a step that trained nothing
    (``stepped`` false, no trajectories, no importance-weight or KL figures) with the loss
    and gradient norm of ``last_trained`` (the last step that trained: (loss, grad_norm)),
    so the last loss stays the last finite one. The loop counts the skip
    (``skipped_steps``) and logs its values."""
    loss, grad_norm, stats = result.loss, result.grad_norm, result.stats
    if result.skipped:
        (loss, grad_norm), stats = last_trained, {}
    return pb.StepMetrics(
        step=result.step,
        policy_version=version,
        loss=loss,
        reward_mean=result.reward_mean,
        trajectories=result.trajectories,
        groups=result.groups,
        step_seconds=result.seconds,
        grad_norm=grad_norm,
        dropped_stale=result.dropped_stale,
        downweighted_stale=result.downweighted_stale,
        dropped_groups=result.dropped_groups,
        pass_rate=result.pass_rate,
        policy_lag_mean=result.lag_mean,
        policy_lag_max=result.lag_max,
        lr=result.lr,
        stepped=result.stepped,
        tis_weight_mean=stats.get("is_weight_mean", 0.0),
        kl=stats.get("kl", 0.0),
        peak_rss_mb=peak_rss_mb(),
    )


class TrainingLoop:
    """Consumes, steps, commits; ``recent_steps`` is what ``Status`` reports."""

    def __init__(
        self, learner: PolicyLearner, consumer: GroupConsumer, committer: Committer, progress: Progress, groups_per_step: int, publish_every: int
    ) -> None:
        self.learner = learner
        self.consumer = consumer
        self.committer = committer
        self.progress = progress
        self.groups_per_step = groups_per_step
        self.publish_every = publish_every
        self._committed: collections.deque[pb.StepMetrics] = collections.deque(maxlen=RECENT_STEPS)
        self._uncommitted: list[pb.StepMetrics] = []
        # The group ids of the batch whose step last raised, and how many times in a row.
        self._failing: tuple[tuple[str, ...], int] = ((), 0)
        # (loss, grad_norm) of the last step that trained: what a skipped step reports (see step_metrics).
        self._last_trained: tuple[float, float] = (0.0, 0.0)

    def recent_steps(self) -> list[pb.StepMetrics]:
        return [*self._committed, *self._uncommitted]

    async def run(self) -> None:
        """Runs until cancelled, refused (:class:`CommitRefused`) or the learner cannot go on
        (:class:`LearnerBroken`, :class:`GroupFailed` among them); any other failure is
        logged and the loop goes on from the transport."""
        recovered = False
        while True:
            try:
                if not recovered:  # retried like any iteration (Redis may be restarting)
                    await self.consumer.recover()
                    recovered = True
                await self.iteration(READ_BLOCK_MS)
            except (asyncio.CancelledError, CommitRefused, LearnerBroken):
                raise
            except Exception:
                log.exception("training loop iteration failed; retrying")
                await asyncio.sleep(1.0)

    async def iteration(self, block_ms: int) -> None:
        """One poll of the transport (waiting up to ``block_ms``), then every step the
        ready groups allow; the committer's idle work when there was none."""
        await self.consumer.poll(READ_COUNT, block_ms)
        trained = False
        while taken := self.consumer.take(self.groups_per_step):
            await self.train(taken)
            trained = True
        if not trained:
            await self.committer.idle()

    async def _step_failed(self, taken: list[Taken], exc: Exception) -> None:
        """Puts a batch whose step raised back in front of the ready queue, to be tried
        again after ``STEP_RETRY_S``; the ``STEP_ATTEMPTS``-th failure in a row
        dead-letters its groups with the error instead, and the loop moves on."""
        batch = tuple(group.group_id for _, group in taken)
        tries = self._failing[1] + 1 if self._failing[0] == batch else 1
        error = f"{type(exc).__name__}: {exc}"
        if tries < STEP_ATTEMPTS:
            self._failing = (batch, tries)
            log.error("step on groups %s failed (try %d of %d), retrying: %s", list(batch), tries, STEP_ATTEMPTS, error, exc_info=exc)
            self.consumer.put_back(taken)
            await asyncio.sleep(STEP_RETRY_S)
            return
        self._failing = ((), 0)
        log.error("step on groups %s failed %d times in a row; dead-lettering them: %s", list(batch), tries, error, exc_info=exc)
        self.progress.counters["failed_batches"] += 1
        await self.consumer.dead_letter_taken(taken, f"the learner's step on this group's batch failed {tries} times: {error}")

    async def train(self, taken: list[Taken]) -> None:
        """One learner step on ``taken``, committed when it is a publishing step. A step
        that raises is retried, then dead-lettered (see :meth:`_step_failed`)."""
        trajs = [list(group.trajectories) for _, group in taken]
        links = [Link(ctx) for g in trajs for t in g if (ctx := telemetry.span_context_of(dict(t.trace_context)))]
        with tracer.start_as_current_span("trainer.step", links=links) as span:
            try:
                result = await asyncio.to_thread(self.learner.step, trajs)
            except LearnerBroken as exc:
                # Not the batch's fault, and no retry in these processes can help.
                span.record_exception(exc)
                log.error("step on groups %s: the learner cannot go on; the training loop stops: %s", [group.group_id for _, group in taken], exc)
                raise
            except Exception as exc:
                span.record_exception(exc)
                await self._step_failed(taken, exc)
                return
            self._failing = ((), 0)
            if result.skipped:
                # Trained nothing (weights and optimizer untouched): handled below like a
                # step whose samples were all stale or flat.
                self.progress.counters["skipped_steps"] += 1
                log.warning("no optimizer step on groups %s: %s", [group.group_id for _, group in taken], result.skipped)
            span.set_attribute("meridian.step", result.step)
            span.set_attribute("meridian.trajectories", result.trajectories)
            self.consumer.trained_on(taken)
            counters = self.progress.counters
            self.progress.consumed += sum(len(g) for g in trajs)
            counters["dropped_stale"] += result.dropped_stale
            counters["downweighted_stale"] += result.downweighted_stale
            counters["dropped_groups"] += result.dropped_groups
            metrics = step_metrics(result, self.learner.version, self._last_trained)
            if result.stepped:
                self._last_trained = (result.loss, result.grad_norm)
            metrics.trajectories_by_region.update(collections.Counter(t.region or "unnamed" for g in trajs for t in g))
            self._uncommitted.append(metrics)
            if result.stepped and self.learner.step_count % self.publish_every == 0:
                await self.committer.commit(metrics, span)
                self._committed.extend(self._uncommitted)
                self._uncommitted.clear()
            elif not result.stepped:
                # Nothing trained, so no commit will ack these groups (a last batch of
                # stale samples would stay pending for good). With checkpoints the next
                # one (the idle one at the latest) covers them like any group: acked
                # before it, a crash would replay a history without them (other batches,
                # other weights, a consumed count short of them). Without, ack now.
                if self.committer.checkpoints:
                    self.committer.uncovered()
                else:
                    await self.consumer.ack_dropped(taken)
        log.info(
            "step %d -> version %d: loss %.4f reward %.3f (%d trajectories, %d stale dropped, %d down-weighted, %d flat groups), peak RSS %.0f MiB",
            result.step, self.learner.version, result.loss, result.reward_mean, result.trajectories,
            result.dropped_stale, result.downweighted_stale, result.dropped_groups, metrics.peak_rss_mb,
        )
