"""One rank of a two-rank trainer (gloo) whose steps fail or are skipped, run once per rank
by tests/integration/test_trainer_distributed.py:

    python -m tests.integration.trainer_rank_faults --rank R --world 2 --port P --model DIR --out DIR ...

Rank 0 runs the real training loop (in-memory stream, the loop's retries and dead
letters, no checkpoints or publishing) on a :class:`BroadcastLearner`; the other ranks
follow it. Four batches of two groups go through, in this order:

- ``flaky``: rank 0 alone fails its first try (``--flaky-at prepare``: building the batch,
  before any collective; ``forward``: in its first forward pass, while the other ranks
  run theirs), then the retry trains;
- ``poison``: building the batch raises on every rank, every time: dead-lettered after
  the loop's tries;
- ``nonfinite``: behaviour log-probs of -3e38, so the loss is inf: the step is skipped;
- ``good``: rank 1 alone fails its first try (at the same point), then the retry trains.

Each rank writes ``rank-R.json``: its master-weight hash before and after, its step count
and version, and on rank 0 what the loop saw (dead letters, counters, reported steps).
Collectives time out after ``--collective-timeout-s``: a rank left waiting for one fails
instead of hanging.

``--fault F`` runs one of these instead (by tests/integration/test_trainer_rank_failures.py),
rank 1 failing once:

- ``layer`` (FSDP): in the forward pass of the second decoder layer, while rank 0 is in
  the collectives of that pass; rank 0 runs the loop on one batch;
- ``optimizer``: in the optimizer step; rank 0 runs the loop on one batch;
- ``load_state``: restoring rank 0's state (rank 0 takes it after one step);
- ``part_log`` (FSDP): writing the part log after preparing its part of a version (rank 0
  publishes one), then rank 0 steps once more and both ranks read the master hash.

Each rank then writes what it raised (``error``: ``Type: message``, or '' when nothing
did), how long after the fault's step or command (``seconds``), and its master hash,
step count and version when it still could."""
from __future__ import annotations

import argparse
import asyncio
import copy
import datetime
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from meridian.grpc_runtime import failure_of
from meridian.trajectory_transport import MemoryStreams
from meridian.v1 import common_pb2
from services.trainer import learner as learner_mod
from services.trainer import loop as loop_mod
from services.trainer.config import TrainerConfig
from services.trainer import shard_publish
from services.trainer.distributed import BroadcastLearner, exit_unusable_group, follow

KINDS = ("flaky", "poison", "nonfinite", "good")
SETTINGS = {"lr": 1e-3, "groups_per_step": 2, "threads": 1, "max_policy_lag": 8, "micro_batch": 2, "tis_cap": 0.0}


def _groups(model: Path) -> list[list[common_pb2.Trajectory]]:
    """Two groups of each kind, in KINDS order, named ``<kind>-<n>``."""
    from benchmarks.support.synthetic import fixed_groups

    groups = fixed_groups(model, 2 * len(KINDS), group_size=3, seed=3)
    for i, group in enumerate(groups):
        kind = KINDS[i // 2]
        for traj in group:
            traj.group_id = f"{kind}-{i % 2}"
            traj.trajectory_id = f"{traj.group_id}-{traj.trajectory_id}"
            if kind == "nonfinite":
                # Coupled objective (tis_cap 0): the ratio exp(logp + 3e38) is inf, so is the loss.
                traj.logprobs[:] = [-3e38] * len(traj.logprobs)
    return groups


class Faults:
    """Patches the learner module so that building a batch with a ``poison`` group raises
    on every rank, and the first try of the ``flaky`` batch on rank 0, of the ``good`` one
    on rank 1, raises at ``flaky_at``."""

    #: The batch whose first try fails on that rank alone.
    FLAKY = {0: "flaky", 1: "good"}

    def __init__(self, rank: int, flaky_at: str) -> None:
        self.rank = rank
        self.flaky_at = flaky_at
        self.flaky_failed = False
        self.current: set[str] = set()  # the kinds of the groups in the step being built

    def install(self, learner: Any) -> None:
        real_build, real_loss = learner_mod.build_batch, learner._loss

        def build_batch(groups: list[list[common_pb2.Trajectory]], *args: Any, **kwargs: Any) -> Any:
            self.current = {g[0].group_id.split("-")[0] for g in groups}
            if "poison" in self.current:
                raise ValueError(f"rank {self.rank}: a poisoned batch (raises on every rank, every time)")
            if self.flaky_at == "prepare":
                self._flaky()
            return real_build(groups, *args, **kwargs)

        def loss(part: Any) -> Any:
            if self.flaky_at == "forward":
                self._flaky()
            return real_loss(part)

        learner_mod.build_batch = build_batch
        learner._loss = loss

    def _flaky(self) -> None:
        if self.FLAKY.get(self.rank) in self.current and not self.flaky_failed:
            self.flaky_failed = True
            raise RuntimeError(f"a transient fault in rank {self.rank}'s step ({self.flaky_at})")


async def _lead(learner: Any, model: Path) -> dict[str, Any]:
    """Rank 0: the training loop over the four batches until each has been trained,
    skipped or dead-lettered; then the followers are told to stop."""
    from tests.unit.test_trainer_loop import build, dead_letters, run_until

    loop_mod.READ_BLOCK_MS = 5
    loop_mod.STEP_RETRY_S = 0.0
    lead = BroadcastLearner(learner)
    tries: list[str] = []  # the kind of batch of each step the loop asked for, in order
    step = lead.step

    def counted(groups: list[list[common_pb2.Trajectory]]) -> Any:
        tries.append(groups[0][0].group_id.split("-")[0])
        return step(groups)

    lead.step = counted  # type: ignore[method-assign]
    streams = MemoryStreams()
    loop = build(streams, lead, groups_per_step=2)  # type: ignore[arg-type]
    try:
        await loop.consumer.start()
        for group in _groups(model):
            await loop.consumer.transport.publish_group(group)
        # Settled: every batch either reported a step (trained or skipped) or was dead-lettered.
        await run_until(loop, lambda: len(loop.recent_steps()) + len(dead_letters(streams)) // 2 >= len(KINDS), within=600)
    finally:
        lead.close()
    return {
        "tries": tries,
        "dead_lettered": sorted(dead_letters(streams)),
        "counters": dict(loop.progress.counters),
        "steps": [{"step": m.step, "stepped": m.stepped, "loss": m.loss, "trajectories": m.trajectories} for m in loop.recent_steps()],
    }


FAULTS = ("layer", "optimizer", "load_state", "part_log")


def _fail_once(rank: int, what: str) -> Any:
    """A callable that raises on rank 1 the first time it is called (nothing on rank 0)."""
    fired = []

    def fail(*args: Any, **kwargs: Any) -> None:
        if rank == 1 and not fired:
            fired.append(True)
            raise OSError(f"rank {rank}: an injected fault in {what}")

    return fail


def _failing_first(fail: Any, real: Any) -> Any:
    """``real`` with ``fail()`` called before it."""

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        fail()
        return real(*args, **kwargs)

    return wrapped


def install_fault(learner: Any, rank: int, fault: str) -> None:
    """Makes rank 1 fail once at ``fault`` (see the module's docstring)."""
    fail = _fail_once(rank, fault)
    if fault == "layer":
        layer = learner_mod._decoder_layers(learner.module)[1]
        layer.register_forward_pre_hook(lambda module, args: fail())
    elif fault == "optimizer":
        learner.optimizer.step = _failing_first(fail, learner.optimizer.step)
    elif fault == "load_state":
        learner.load_state = _failing_first(fail, learner.load_state)
    elif fault == "part_log":
        shard_publish.record_part = _failing_first(fail, shard_publish.record_part)


class KeptParts:
    """A follower's part sender that keeps the parts instead of sending them."""

    def __init__(self) -> None:
        self.parts: list[Any] = []

    def submit(self, part: Any) -> None:
        self.parts.append(part)

    def close(self) -> None:
        pass


def _described(exc: BaseException | None) -> str:
    return "" if exc is None else f"{type(exc).__name__}: {exc}"


def _close(lead: BroadcastLearner) -> str:
    """Tells the followers to stop; what that raised ('' when nothing did: a follower that
    died leaves nobody to tell)."""
    try:
        lead.close()
    except Exception as exc:
        return _described(exc)
    return ""


async def _lead_loop_once(learner: Any, model: Path, bound_s: float) -> dict[str, Any]:
    """Rank 0 under ``layer`` and ``optimizer``: the training loop on the two ``good``
    groups (rank 1 fails in their step), for at most ``bound_s`` seconds: what ended it."""
    from tests.unit.test_trainer_loop import build

    loop_mod.READ_BLOCK_MS = 5
    loop_mod.STEP_RETRY_S = 0.0
    lead = BroadcastLearner(learner)
    streams = MemoryStreams()
    loop = build(streams, lead, groups_per_step=2)  # type: ignore[arg-type]
    await loop.consumer.start()
    for group in _groups(model)[-2:]:
        await loop.consumer.transport.publish_group(group)
    started = time.monotonic()
    task = asyncio.create_task(loop.run())
    reason = ""  # what the trainer service reports when its loop ends (TrainerService.failure)
    try:
        reason = await asyncio.wait_for(failure_of(task, "the training loop"), bound_s)
    except TimeoutError:
        task.cancel()  # the loop went on: nothing stopped it
    seconds = time.monotonic() - started
    error = task.exception() if task.done() and not task.cancelled() else None
    return {"error": _described(error), "reason": reason, "seconds": seconds, "steps": [m.step for m in loop.recent_steps()], "closed": _close(lead)}


def _lead_fault(learner: Any, model: Path, fault: str, bound_s: float) -> dict[str, Any]:
    """Rank 0's side of ``fault``."""
    if fault in ("layer", "optimizer"):
        return asyncio.run(_lead_loop_once(learner, model, bound_s))
    lead = BroadcastLearner(learner)
    error: BaseException | None = None
    good = _groups(model)[-2:]
    started = time.monotonic()
    try:
        if fault == "load_state":
            lead.step(good)
            state = copy.deepcopy(lead.state())
            started = time.monotonic()
            lead.load_state(state)
        else:  # part_log: rank 1's part fails; the ranks go on training together
            try:
                lead.prepare_part(1, {}, {}, None, send=True)
            except Exception as exc:
                error = exc
            seconds = time.monotonic() - started
            lead.step(good)
            return {"error": _described(error), "seconds": seconds, "closed": _close(lead)}
    except Exception as exc:
        error = exc
    return {"error": _described(error), "seconds": time.monotonic() - started, "closed": _close(lead)}


def _follow_fault(learner: Any, fault: str) -> tuple[dict[str, Any], int]:
    """A follower's side of ``fault``: what ended its following, and its exit code (1 when
    it raised, as services.trainer.distributed exits)."""
    started = time.monotonic()
    try:
        follow(learner, KeptParts() if fault == "part_log" else None)  # type: ignore[arg-type]
    except Exception as exc:
        logging.getLogger(__name__).error("rank %d stops: %s", learner.rank, exc)
        return {"error": _described(exc), "seconds": time.monotonic() - started}, 1
    return {"error": "", "seconds": time.monotonic() - started}, 0


def main() -> None:
    parser = argparse.ArgumentParser()
    for flag in ("--rank", "--world", "--port", "--collective-timeout-s"):
        parser.add_argument(flag, type=int, required=True)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--data-parallel", choices=("ddp", "fsdp"), required=True)
    parser.add_argument("--flaky-at", choices=("prepare", "forward"), default="prepare")
    parser.add_argument("--fault", choices=FAULTS, help="run this fault of rank 1 instead of the four batches")
    parser.add_argument("--bound-s", type=float, default=120.0, help="with --fault: seconds rank 0's loop runs at most")
    ns = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format=f"rank {ns.rank} %(levelname)s %(name)s: %(message)s")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{ns.port}", rank=ns.rank, world_size=ns.world,
        timeout=datetime.timedelta(seconds=ns.collective_timeout_s),
    )
    code = 0
    try:
        config = TrainerConfig(model=str(ns.model), data_parallel=ns.data_parallel, collective_timeout_s=ns.collective_timeout_s, **SETTINGS)  # type: ignore[arg-type]
        learner = learner_mod.Learner(ns.model, config)
        if ns.fault:
            install_fault(learner, ns.rank, ns.fault)
            summary: dict[str, Any]
            if ns.rank == 0:
                summary = _lead_fault(learner, ns.model, ns.fault, ns.bound_s)
            else:
                summary, code = _follow_fault(learner, ns.fault)
            if ns.fault == "part_log" and not code:
                summary["master_hash"] = learner.master_hash()  # a gather: both ranks, after the stop
            summary.update(step_count=learner.step_count, version=learner.version)
            ns.out.mkdir(parents=True, exist_ok=True)
            (ns.out / f"rank-{ns.rank}.json").write_text(json.dumps(summary))
            return
        Faults(ns.rank, ns.flaky_at).install(learner)
        summary = {"initial_hash": learner.master_hash()}
        if ns.rank == 0:
            summary.update(asyncio.run(_lead(learner, ns.model)))
        else:
            follow(learner)
        summary.update(master_hash=learner.master_hash(), step_count=learner.step_count, version=learner.version)
        ns.out.mkdir(parents=True, exist_ok=True)
        (ns.out / f"rank-{ns.rank}.json").write_text(json.dumps(summary))
        dist.barrier()
    finally:
        if code:
            exit_unusable_group(code)  # as services.trainer.distributed ends a failed follower
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
