"""What the trainer's loop needs from a learner, as a typed protocol: the single-process
:class:`services.trainer.learner.Learner`, rank 0 of a distributed job, or a test double.
Kept free of torch so the loop, the consumer and the servicer import it cheaply."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

from meridian.tensors import RawTensor
from meridian.v1 import common_pb2, weightsync_pb2


PASS_REWARD = 1.0  # a trajectory passes when its reward reaches this (every test passed)


class RankFailed(RuntimeError):
    """Something rank 0 asked of every rank of a distributed learner (a step, a read, its
    part of a version) failed on one or more of them (the message names each rank's error
    and the phase). Every rank raises it at the same point, the learners unchanged, equal
    and in step, and the process group still works: the ranks go on with rank 0's next
    command."""


class StepFailed(RankFailed):
    """A step abandoned by every rank of a distributed learner because it failed on one or
    more of them (the message names each rank's error). Every rank raises it at the same
    point, before any update, so the learners stay equal and in step: rank 0's loop retries
    or dead-letters the batch as for any failed step, and the other ranks go on following."""


class LearnerBroken(RuntimeError):
    """The learner cannot go on in these processes: a failure left its state in doubt (an
    optimizer step that raised part-way has updated some weights and optimizer moments and
    not others; retried, it would update those twice). The training loop ends with it,
    nothing acked; the service stops (health NOT_SERVING, exit 1) and a restart resumes from
    the newest checkpoint, replaying what came after it."""


class GroupFailed(LearnerBroken):
    """The ranks of a distributed learner cannot go on together: a failure left the process
    group unusable (a rank failed or timed out inside a collective the others were in, so
    they stopped at different collectives), or the learners may differ (an update or a
    restore that failed on some ranks only), or a rank is gone. Every rank raises it within
    the collective timeout (``--collective-timeout-s``), the message naming each rank's
    error and the phase; none trains on. Rank 0's service stops (health NOT_SERVING, exit
    1), the followers exit 1, and a restarted job resumes from the newest checkpoint.
    Retrying in the same processes cannot help, so the training loop does not."""


@dataclasses.dataclass
class StepResult:
    """What one call of :meth:`PolicyLearner.step` did."""

    step: int
    loss: float
    reward_mean: float
    trajectories: int
    groups: int
    grad_norm: float
    seconds: float
    dropped_stale: int
    stats: dict[str, float]
    stepped: bool = True
    downweighted_stale: int = 0
    dropped_groups: int = 0
    pass_rate: float = 0.0
    lag_mean: float = 0.0
    lag_max: int = 0
    lr: float = 0.0
    # Why no optimizer step was taken though samples were left to train on (a non-finite
    # loss or gradient norm); '' otherwise. Such a step reports ``stepped=False``.
    skipped: str = ""


class PolicyLearner(Protocol):
    """A policy under training: ``version`` is the policy version its weights are,
    ``step_count`` the optimizer steps taken (they differ after a start from a
    published version)."""

    @property
    def version(self) -> int: ...

    @property
    def step_count(self) -> int: ...

    def step(self, groups: list[list[common_pb2.Trajectory]]) -> StepResult:
        """One optimizer step on complete groups (no step when nothing is left to learn).
        When it raises (but for :class:`LearnerBroken`), the learner's state (weights, optimizer, step and version) is as it
        was before the call: the loop retries the batch (a distributed learner raises
        :class:`StepFailed` on every rank when the step failed on any). A distributed
        learner raises :class:`GroupFailed` when its ranks cannot go on together, and any
        learner :class:`LearnerBroken` when the optimizer step itself raised (the one phase
        that changes the learner): the loop ends, and with it the service."""
        ...

    def check_group(self, trajectories: Sequence[common_pb2.Trajectory]) -> str:
        """Why this model cannot train on a group (a token id outside its vocabulary, a
        sequence longer than its positions), or '' when it can. Cheap: the consumer calls
        it on every group it receives, in the event loop."""
        ...

    def policy_weights(self) -> dict[str, RawTensor]:
        """The current policy as published (bf16, checkpoint names)."""
        ...

    def canary(self, weights: dict[str, RawTensor]) -> weightsync_pb2.Canary:
        """The canary log-probs this learner computes with exactly ``weights``."""
        ...

    def load_policy_weights(self, weights: dict[str, RawTensor], version: int) -> None:
        """Starts from a published version."""
        ...

    def master_hash(self) -> str:
        """A hash of the full-precision master weights."""
        ...

    def state(self) -> dict[str, Any]:
        """Everything a resumed run needs to continue bit for bit."""
        ...

    def load_state(self, state: dict[str, Any]) -> None:
        """Restores :meth:`state`."""
        ...
