"""The trainer under ``torchrun``: data-parallel training over several processes.

    python -m torch.distributed.run --nproc-per-node 2 -m services.trainer.distributed [trainer flags]

Rank 0 is the ordinary trainer service (consumer group, checkpoints, weightsync,
``Status`` over gRPC); it broadcasts every batch of complete groups to the other
ranks, and each rank trains on its shard of the trajectories (gloo on CPU, NCCL on
GPU). A step that fails on any rank is abandoned by every rank alike
(:class:`~services.trainer.learner_protocol.StepFailed`, see
:meth:`services.trainer.learner.Learner.step`): rank 0's loop retries or dead-letters
its batch, and the other ranks follow it into the next command. So is any other command
(a collective read, a part of a version) that failed on some rank: every rank takes part
in an agreement after it (:meth:`~services.trainer.learner.Learner.agreed`), so rank 0
hears of a follower's failure, names it, and handles it (a follower does not just die).
Where the ranks cannot go on together (a failure inside a collective under FSDP, a
restore or an optimizer step that failed on some ranks only, a rank gone) every rank
raises :class:`~services.trainer.learner_protocol.GroupFailed` within about twice
``--collective-timeout-s`` (the training group's collectives time out after it; rank 0's
commands travel in a group of their own without a short timeout, as followers wait there
for as long as the stream is empty): rank 0's service stops (health NOT_SERVING, exit 1)
with the error, the followers exit 1 with it, and a restarted job resumes from the
newest checkpoint. ``--data-parallel ddp``
(the default): every rank holds a full replica, the gradients are all-reduced after the
backward pass, and rank 0 alone checkpoints and publishes. ``--data-parallel fsdp``:
FSDP2 shards parameters, gradients and optimiser state, so reading the training state is
a gather every rank joins: rank 0 broadcasts those reads as commands too. Each version
is published in parts, one per rank, and no rank gathers the whole model for it: rank 0
broadcasts a ``publish`` command (version, trace context, metrics); every rank gathers the
tensors it owns and joins the canary's forward pass through the sharded model and the
signing of the version header (:func:`services.trainer.shard_publish.prepare_part`,
collectives, so done right there, in order with the steps); then each rank sends its part
in the background while the next step runs (rank 0 in the Committer's publish task, the others in a
:class:`~services.trainer.shard_publish.PartSender` thread), and the origin assembles one
version (``--part-log DIR``: each rank appends a line per part it sent). ``--replay FILE
--out DIR`` runs saved batches instead of the stream (tests and benchmarks use it).

``meridian serve trainer`` stays the single-process path; this entry only adds the
process group and the broadcast.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from meridian.config import add_config_args, config_from_args
from meridian.tensors import RawTensor
from meridian.v1 import common_pb2, weightsync_pb2
from services.trainer.config import TrainerConfig
from services.trainer.learner_protocol import GroupFailed, RankFailed, StepResult

if TYPE_CHECKING:  # torch is imported only by the ranks that train
    from services.trainer.learner import Learner
    from services.trainer.shard_publish import PartSender, PreparedPart
    from services.weightsync.signing import Signer

log = logging.getLogger(__name__)


#: How long a follower waits for rank 0's next command: as long as the stream is empty.
COMMAND_TIMEOUT = datetime.timedelta(days=7)

_commands: Any = None  # the process group rank 0's commands go out in (see command_group)


def command_group() -> Any:
    """The process group rank 0's commands go out in: a group of its own (gloo), whose
    timeout is :data:`COMMAND_TIMEOUT` (followers wait there while the stream is empty),
    where the training group's collectives time out after ``collective_timeout_s``.
    Created once; every rank calls this at the same point (rank 0 builds its
    :class:`BroadcastLearner`, the others start :func:`follow`), as it is a collective."""
    global _commands
    if _commands is None:
        import torch.distributed as dist

        _commands = dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)
    return _commands


def _init(config: TrainerConfig) -> tuple[int, int, str]:
    """Joins the process group torchrun describes, over NCCL where this rank computes on a
    GPU (``config.device``: the one of its LOCAL_RANK), gloo on the CPU; returns (rank,
    world, device). Its collectives (the steps', FSDP's, a publish's) time out after
    ``collective_timeout_s``, so a rank a failed rank left waiting in one fails instead
    of hanging."""
    import torch
    import torch.distributed as dist

    from services.trainer.learner import resolve_device

    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(config.device, local)
    on_gpu = device != "cpu"
    if on_gpu:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if on_gpu else "gloo", timeout=datetime.timedelta(seconds=config.collective_timeout_s))
    return dist.get_rank(), dist.get_world_size(), device


def _serialize(groups: list[list[Any]]) -> list[list[bytes]]:
    return [[t.SerializeToString() for t in g] for g in groups]


def _parse(groups: list[list[bytes]]) -> list[list[Any]]:
    return [[common_pb2.Trajectory.FromString(b) for b in g] for g in groups]


class BroadcastLearner:
    """Rank 0's learner (a :class:`PolicyLearner`): every state-changing call is first
    broadcast to the followers. Reads of the policy and the state are local when the
    ranks hold equal replicas (DDP) and broadcast when they are gathers (FSDP). Under FSDP
    with several ranks it publishes in parts (:meth:`prepare_part`); the DDP canary is
    rank 0's alone."""

    def __init__(self, learner: Learner, part_log: Path | None = None) -> None:
        self.inner = learner
        self.part_log = part_log
        # Set once the ranks could not go on together (GroupFailed): no command goes out after it.
        self.failed: GroupFailed | None = None
        self._group = command_group() if learner.world > 1 else None

    @property
    def publishes_in_parts(self) -> bool:
        """Sharded over several ranks: each version goes out in parts, one per rank."""
        return self.inner.sharded and self.inner.world > 1

    @property
    def version(self) -> int:
        return self.inner.version

    @property
    def step_count(self) -> int:
        return self.inner.step_count

    def _send(self, command: str, payload: Any) -> None:
        """Broadcasts a command to the followers (none after a :class:`GroupFailed`: they
        have exited, or are about to)."""
        import torch.distributed as dist

        if self.failed is not None:
            raise GroupFailed(f"rank 0 sends no {command!r} command: the ranks stopped ({self.failed})") from self.failed
        try:
            dist.broadcast_object_list([command, payload], src=0, group=self._group)
        except RuntimeError as exc:  # a follower is gone (its connection closed)
            self.failed = GroupFailed(f"rank 0 could not send the {command!r} command to the other ranks ({exc}): a rank is gone, every rank stops")
            raise self.failed from exc

    def _all(self, command: str, payload: Any, work: Any) -> Any:
        """``command`` broadcast, then rank 0's share (``work()``) and the agreement every
        rank joins after it (:func:`_agree`, as the followers do): a follower's failure
        raises here, named (:class:`RankFailed`, or :class:`GroupFailed` that also stops
        every later command)."""
        self._send(command, payload)
        return self._agreed(lambda: _agree(self.inner, command, payload, work))

    def _agreed(self, call: Any) -> Any:
        try:
            return call()
        except GroupFailed as exc:
            self.failed = exc
            raise

    def step(self, groups: list[list[common_pb2.Trajectory]]) -> StepResult:
        self._send("step", _serialize(groups))
        return self._agreed(lambda: self.inner.step(groups))  # type: ignore[no-any-return]

    def check_group(self, trajectories: Sequence[common_pb2.Trajectory]) -> str:
        # Local: every rank runs the same model, and a group refused here never reaches a step.
        return self.inner.check_group(trajectories)

    def load_state(self, state: dict[str, Any]) -> None:
        """Every rank restores ``state``; one that failed on any rank stops every rank
        (:class:`GroupFailed`: the learners may differ)."""
        self._all("load_state", state, lambda: self.inner.load_state(state))

    def load_policy_weights(self, weights: dict[str, RawTensor], version: int) -> None:
        """Every rank starts from ``weights``; as :meth:`load_state`, a failure anywhere stops every rank."""
        self._all("load_policy_weights", (weights, version), lambda: self.inner.load_policy_weights(weights, version))

    def _read(self, command: str) -> Any:
        if self.inner.sharded:
            return self._all(command, None, getattr(self.inner, command))
        return getattr(self.inner, command)()

    def policy_weights(self) -> dict[str, RawTensor]:
        return self._read("policy_weights")  # type: ignore[no-any-return]

    def canary(self, weights: dict[str, RawTensor]) -> weightsync_pb2.Canary:
        return self.inner.canary(weights)

    def prepare_part(
        self, version: int, trace_context: dict[str, str], metrics: dict[str, float], signer: Signer | None, send: bool
    ) -> PreparedPart:
        """Rank 0's part of ``version``: the followers are told to prepare theirs (and,
        with ``send``, to send it in the background), then every rank gathers its own
        tensors and joins the canary and the header's signing."""
        from services.trainer.shard_publish import prepare_part, record_part

        def prepare() -> PreparedPart:
            part = prepare_part(self.inner, version, signer=signer, trace_context=trace_context, metrics=metrics)
            if send:
                record_part(self.part_log, part)
            return part

        return self._all("publish", (version, dict(trace_context), dict(metrics), send), prepare)  # type: ignore[no-any-return]

    def master_hash(self) -> str:
        return self._read("master_hash")  # type: ignore[no-any-return]

    def state(self) -> dict[str, Any]:
        return self._read("state")  # type: ignore[no-any-return]

    def close(self) -> None:
        """Tells the followers to stop (unless the ranks already stopped: :attr:`failed`)."""
        if self.failed is None and self.inner.world > 1:
            self._send("stop", None)


#: Rank 0's reads a follower joins (gathers under FSDP) and whose result it drops.
COLLECTIVE_READS = ("policy_weights", "master_hash", "state")


def follow(learner: Any, sender: PartSender | None = None, part_log: Path | None = None) -> None:
    """A follower rank: applies rank 0's commands until it says stop. ``sender`` sends the
    parts of the versions rank 0 publishes (under FSDP); at stop it finishes what it holds.

    Every command but ``step`` (whose phases agree themselves) ends in an agreement with
    the other ranks (:meth:`Learner.agreed`): a failure here is reported to rank 0, which
    names it. When the command failed on some rank and the ranks can go on
    (:class:`RankFailed`), this rank waits for rank 0's next command, as rank 0 does;
    when they cannot, :class:`GroupFailed` is raised here: the caller exits with it."""
    import torch.distributed as dist

    group = command_group()
    while True:
        box: list[Any] = [None, None]
        try:
            dist.broadcast_object_list(box, src=0, group=group)
        except RuntimeError as exc:  # rank 0 is gone (its connection closed)
            raise GroupFailed(f"rank {learner.rank} lost rank 0 while waiting for its next command ({exc}): every rank stops") from exc
        command, payload = box
        if command == "stop":
            if sender is not None:
                sender.close()
            return
        try:
            _follow(learner, command, payload, sender, part_log)
        except RankFailed as exc:
            log.warning("rank %d: %s; waiting for rank 0's next command", learner.rank, exc, exc_info=exc)


#: Commands that change the learner: one that failed on some ranks leaves the learners different.
FATAL_COMMANDS = ("load_state", "load_policy_weights")


def _agree(learner: Any, command: str, payload: Any, work: Any) -> Any:
    """``work()``, this rank's share of one of rank 0's commands, and the agreement every
    rank joins after it (:meth:`Learner.agreed`). Rank 0 and the followers both come
    here, so they judge a failure alike: fatal for a command in FATAL_COMMANDS."""
    phase = f"preparing the parts of version {payload[0]}" if command == "publish" else ""
    return learner.agreed(work, f"rank 0's command {command!r}", phase, fatal=command in FATAL_COMMANDS)


def _follow(learner: Any, command: str, payload: Any, sender: PartSender | None, part_log: Path | None) -> None:
    """This rank's share of one of rank 0's commands, and the agreement after it."""
    if command == "step":
        learner.step(_parse(payload))  # a step's phases agree themselves
        return
    work: Any
    if command == "publish":
        work = lambda: _prepare_and_send(learner, payload, sender, part_log)  # noqa: E731
    elif command == "load_state":
        work = lambda: learner.load_state(payload)  # noqa: E731
    elif command == "load_policy_weights":
        work = lambda: learner.load_policy_weights(*payload)  # noqa: E731
    elif command in COLLECTIVE_READS:
        work = getattr(learner, command)
    else:
        # Rank 0 waits in the agreement after its command: it hears of this one too.
        def work() -> None:
            raise RuntimeError(f"unknown command from rank 0: {command!r}")

    _agree(learner, command, payload, work)


def _prepare_and_send(learner: Any, payload: tuple[int, dict[str, str], dict[str, float], bool], sender: PartSender | None, part_log: Path | None) -> None:
    """A follower's share of rank 0's publish: the collective preparation now, in order
    with the steps; the sending queued for the background."""
    from services.trainer.shard_publish import prepare_part, record_part

    version, trace_context, metrics, send = payload
    part = prepare_part(learner, version, trace_context=trace_context, metrics=metrics)
    if not send:
        return
    if sender is None:
        raise RuntimeError(f"rank 0 publishes version {version} in parts, but this rank has no part sender")
    record_part(part_log, part)
    sender.submit(part)


def save_batches(path: Path, batches: list[list[list[Any]]]) -> None:
    """Writes batches of groups for ``--replay``."""
    import torch

    torch.save([_serialize(b) for b in batches], path)


def replay(learner: Any, path: Path, out: Path, rank: int, publish_to: str = "", signing_key: str = "") -> None:
    """Steps through saved batches the way the service does: rank 0 drives a
    :class:`BroadcastLearner`, the others follow. Every rank then writes its
    master-weight hash and how many parameter elements it holds, rank 0 the whole
    weights and the losses.

    Before the last batch rank 0 takes a checkpoint, trains on that batch, restores the
    checkpoint and trains on it again, so a restore that loses anything (a rank's shard,
    the optimiser's moments, the step count) shows in the final weights.

    With ``publish_to`` (a weightsync origin) every rank also publishes the starting
    weights as version 0 and the final ones as version 1, each rank its own part
    (:func:`services.trainer.shard_publish.publish_sharded`), and records the tensor bytes
    it gathered for that."""
    import torch

    out.mkdir(parents=True, exist_ok=True)
    from services.weightsync.parts import PartEncoder

    losses: list[float] = []
    published: list[int] = []
    encoded: list[bool] = []  # whether this rank's part of each version went encoded
    encoder = PartEncoder()
    if publish_to:
        published.append(_publish_part_of(learner, publish_to, 0, rank, signing_key, encoder))
        encoded.append(encoder.last_encoded)
    if rank == 0:
        batches = [_parse(b) for b in torch.load(path, weights_only=False)]
        lead = BroadcastLearner(learner)
        for batch in batches[:-1]:
            losses.append(lead.step(batch).loss)
        state = copy.deepcopy(lead.state())  # as the service's checkpoints do: the state is live
        lead.step(batches[-1])
        lead.load_state(state)
        losses.append(lead.step(batches[-1]).loss)
        lead.close()
    else:
        follow(learner)
    if publish_to:
        published.append(_publish_part_of(learner, publish_to, 1, rank, signing_key, encoder))
        encoded.append(encoder.last_encoded)
    summary = {"master_hash": learner.master_hash(), "local_elements": learner.local_elements(), "published_bytes": published, "published_encoded": encoded}
    (out / f"rank-{rank}.json").write_text(json.dumps(summary))
    weights = learner.master_weights()
    if rank == 0:
        torch.save({"weights": weights, "losses": losses}, out / "result.pt")


def _publish_part_of(learner: Any, address: str, version: int, rank: int, signing_key: str, encoder: Any) -> int:
    """Every rank publishes its part of ``version`` (encoded by ``encoder`` when it can);
    returns the bytes of the tensors this rank gathered."""
    from services.trainer.shard_publish import publish_sharded
    from services.weightsync.signing import load_signer

    signer = load_signer(signing_key) if rank == 0 else None
    _, sent = publish_sharded(learner.module, address, version, signer=signer, encoder=encoder)
    return sent


def main(argv: list[str] | None = None) -> int:
    from meridian.grpc_runtime import ServerConfig

    parser = argparse.ArgumentParser(prog="python -m services.trainer.distributed", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(parser, ServerConfig, "trainer")
    add_config_args(parser, TrainerConfig, "trainer")
    parser.add_argument("--replay", type=Path, help="train on batches saved with save_batches instead of the stream")
    parser.add_argument("--out", type=Path, help="with --replay: folder for hashes and final weights")
    parser.add_argument("--publish-to", default="", help="with --replay: weightsync origin every rank publishes its part of versions 0 (start) and 1 (end) to")
    parser.add_argument("--part-log", type=Path, help="fsdp: folder where each rank appends a JSON line per version part it sends (tensors, gathered bytes)")
    ns = parser.parse_args(argv)
    try:
        server_config = config_from_args(ServerConfig, ns, "trainer")
        config = config_from_args(TrainerConfig, ns, "trainer")
    except ValueError as exc:
        parser.error(str(exc))
    if ns.replay and not ns.out:
        parser.error("--replay needs --out")

    import torch.distributed as dist

    from meridian.model_store import resolve_model
    from services.trainer.learner import Learner

    rank, world, device = _init(config)
    try:
        learner = Learner(resolve_model(config.model), config, device=device)
        if ns.replay:
            replay(learner, ns.replay, ns.out, rank, ns.publish_to, config.signing_key)
        elif rank != 0:
            try:
                follow(learner, _part_sender(config) if learner.sharded and world > 1 else None, ns.part_log)
            except GroupFailed as exc:
                # Rank 0 stops too, with the same error (its service reports it), and torchrun
                # or the supervisor restarts the job from the checkpoint. No barrier: the
                # group may be unusable.
                log.error("rank %d stops: %s", rank, exc, exc_info=exc)
                exit_unusable_group(1)
        else:
            from meridian.grpc_runtime import serve_forever
            from services.trainer.server import TrainerService

            lead = BroadcastLearner(learner, ns.part_log)
            try:
                serve_forever("trainer", lambda: TrainerService(config, learner=lead), server_config)
            finally:
                lead.close()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def exit_unusable_group(code: int) -> NoReturn:
    """Ends this rank at once with ``code``, its process group left as it is. After a
    GroupFailed the group is unusable: destroying it, or the interpreter's exit with
    gloo's threads still waiting in it, can abort the process ("terminate called without
    an active exception", SIGABRT) instead of exiting with ``code`` (seen on a follower
    whose peer had timed out sending to it). Logs and stdio are flushed first."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken: nothing more can be said there
            pass
    os._exit(code)


def _part_sender(config: TrainerConfig) -> PartSender:
    """A follower's background sender, retrying as rank 0's Committer does."""
    from services.trainer.commit import PUBLISH_RETRY_S, REFUSALS
    from services.trainer.shard_publish import PartSender

    return PartSender(config.weightsync, PUBLISH_RETRY_S, REFUSALS)


if __name__ == "__main__":
    sys.exit(main())
