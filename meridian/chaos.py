"""``meridian chaos``: an RL job on the two-region local stack while a seeded schedule
injects faults, then an audit that can fail.

The schedule (:func:`plan`) is pure and seeded: every fault kind at least once (kill -9
of each service in each region at a chosen moment, a Redis restart, an inter-region
link cut and restore, a corrupted weight chunk), then random kinds up to ``--faults``,
shuffled, each with a random pause before it and a random down time. Faults run one at
a time: the injector waits for the fault's moment by watching the services' Status
(trainer mid-step: a new step just appeared; before its checkpoint: ``checkpoint_step``
lags ``step``; rollout mid-episode: a RunEpisodes call in flight; mid-update: its
weightsync holds a newer version than it serves; origin or relay mid-transfer: a version
is on its way to a region; envsandbox: sandboxes alive), injects, restarts the process
on the same port after the down time (:meth:`meridian.stack.Stack.restart`), and times
the recovery: until the service is SERVING again and the job made progress (a new
trainer step or a newer served version).

Meanwhile the job runs in sync mode, one trainer step per round, retrying calls while
services restart. Once every fault is injected and ``--steps`` steps are done, the
trainer drains the stream (one group per step, so no group waits for a partner), and
the audit compares:

- produced: ids of the trajectories published to the stream (the RunEpisodes replies,
  and an XRANGE over the whole stream, so groups a rollout published just before it
  was killed count too);
- trained: ids in the trainer's trained-ids log (one line per group it acked once a
  checkpoint covered it; groups dropped by design, flat rewards or stale, are acked
  and logged too); an id logged twice is trained twice;
- lost: produced and never trained;
- every region's rollout serves the trainer's final version: its weights hash equals the
  origin manifest's, and its canary agreed within tolerance;
- leaks after ``down``: live sandboxes (envsandbox ``List`` before stopping), sandbox
  mount folders and cgroups left by any envsandbox instance, processes left in any
  process group the run started.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import os
import random
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from meridian import stack as stack_mod
from meridian.config import add_config_args, config_from_args, opt

# ---------------------------------------------------------------- the schedule

#: Fault kind -> (min, max) down time in seconds: a killed process is restarted after
#: it, a cut link restored. The origin's is short: the trainer retries a publish for
#: about 8 s before it leaves the version to the next step.
DOWN_S: dict[str, tuple[float, float]] = {
    "trainer_mid_step": (0.5, 3.0),
    "trainer_before_checkpoint": (0.5, 3.0),
    "rollout_mid_episode": (0.5, 3.0),
    "rollout_mid_update": (0.5, 3.0),
    "origin_mid_transfer": (0.5, 2.0),
    "relay_mid_transfer": (0.5, 3.0),
    "envsandbox_live_sandboxes": (0.5, 3.0),
    "redis_restart": (0.5, 2.0),
    "link_cut": (2.0, 8.0),
    "corrupt_chunk": (0.0, 0.0),
}
FAULT_KINDS = tuple(DOWN_S)
KILLS = frozenset(FAULT_KINDS) - {"link_cut", "corrupt_chunk"}


@dataclasses.dataclass(frozen=True)
class Fault:
    """One planned fault: what, on which process (its name in the stack), when."""

    index: int
    kind: str
    target: str
    pause_s: float  # before the injector starts watching for the fault's moment
    down_s: float  # until the restart (kills) or the restore (link cut)


def base_faults(remote: list[str]) -> list[tuple[str, str]]:
    """(kind, target) pairs that cover every fault kind on every service of every region."""
    pairs = [
        ("trainer_mid_step", "trainer"),
        ("trainer_before_checkpoint", "trainer"),
        ("rollout_mid_episode", "rollout"),
        ("rollout_mid_update", "rollout"),
        ("origin_mid_transfer", "weightsync"),
        ("envsandbox_live_sandboxes", "envsandbox"),
        ("redis_restart", "redis"),
    ]
    for region in remote:
        pairs += [
            ("rollout_mid_episode", f"rollout-{region}"),
            ("rollout_mid_update", f"rollout-{region}"),
            ("relay_mid_transfer", f"weightsync-{region}"),
            ("envsandbox_live_sandboxes", f"envsandbox-{region}"),
            ("link_cut", f"link-{region}"),
            ("corrupt_chunk", f"link-{region}"),
        ]
    return pairs


def plan(seed: int, faults: int, remote: list[str]) -> list[Fault]:
    """The fault schedule: the same seed gives the same schedule. Every pair of
    :func:`base_faults` once, then random pairs up to ``faults``, in a random order."""
    if not remote:
        raise ValueError("a chaos run needs at least one remote region (link cuts, relays)")
    rng = random.Random(seed)
    base = base_faults(remote)
    if faults < len(base):
        raise ValueError(f"at least {len(base)} faults are needed to cover every kind on every service, got {faults}")
    chosen = [*base, *(rng.choice(base) for _ in range(faults - len(base)))]
    rng.shuffle(chosen)
    return [
        Fault(i, kind, target, round(rng.uniform(0.0, 3.0), 2), round(rng.uniform(*DOWN_S[kind]), 2))
        for i, (kind, target) in enumerate(chosen)
    ]


# ---------------------------------------------------------------- the audit (pure)


@dataclasses.dataclass
class Audit:
    """What was produced and trained, by trajectory id."""

    produced: set[str]
    trained: collections.Counter[str]  # id -> times a group holding it was acked as trained

    @property
    def lost(self) -> set[str]:
        return self.produced - set(self.trained)

    @property
    def trained_twice(self) -> set[str]:
        return {t for t, n in self.trained.items() if n > 1}

    @property
    def unexplained(self) -> set[str]:
        """Trained but never seen produced: a hole in the accounting itself."""
        return set(self.trained) - self.produced


def read_trained_log(path: Path, in_checkpoint: set[str] | None = None) -> tuple[collections.Counter[str], int, list[str]]:
    """(times each trajectory id was logged as trained, groups logged as flat, groups
    logged but absent from ``in_checkpoint``). With ``in_checkpoint`` (the group ids the
    final checkpoint says its weights hold), a logged group the weights do not hold, as
    a trainer that acked before its checkpoint and then crashed leaves, is not trained."""
    trained: collections.Counter[str] = collections.Counter()
    flat = 0
    missing: list[str] = []
    if not path.exists():
        return trained, 0, missing
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        # A group dropped whole (every sample stale or flat) changed no weights: no
        # checkpoint covers it, the trainer acked it at its (empty) step.
        if in_checkpoint is not None and record["group_id"] not in in_checkpoint and record.get("how") != "dropped":
            missing.append(record["group_id"])
            continue
        trained.update(record["trajectory_ids"])
        flat += bool(record.get("flat"))
    return trained, flat, missing


def checkpointed_groups(root: Path) -> set[str] | None:
    """Group ids the newest complete checkpoint under ``root`` lists as trained (None: no checkpoint)."""
    from services.trainer import checkpoint as ckpt

    path = ckpt.latest_checkpoint(root) if root.is_dir() else None
    if path is None:
        return None
    return set(json.loads((path / ckpt.META_FILE).read_text()).get("trained_groups", []))


# ---------------------------------------------------------------- watching the stack


@dataclasses.dataclass
class Snapshot:
    """The services' state as the injector sees it (None: no answer)."""

    trainer: Any = None
    rollouts: dict[str, Any] = dataclasses.field(default_factory=dict)
    weightsync: dict[str, int] = dataclasses.field(default_factory=dict)  # name -> latest version
    sandboxes: dict[str, int] = dataclasses.field(default_factory=dict)  # envsandbox name -> live sandboxes
    corruptions_fired: int = 0  # by the faulted link, so far (its stats file)

    def served(self) -> int:
        """The lowest version any region serves (-1 while one does not answer)."""
        versions = [r.policy_version if r is not None else -1 for r in self.rollouts.values()]
        return min(versions) if versions else -1


async def _quiet(call: Any, timeout_s: float = 5.0) -> Any:
    """``await call`` or None on any failure (a service being killed does not answer)."""
    try:
        return await asyncio.wait_for(call, timeout_s)
    except Exception:  # noqa: BLE001 - a dead service is what chaos expects to see
        return None


async def _rpc(address: str, service: str, method: str, request: Any) -> Any:
    from meridian.grpc_runtime import open_channel
    from meridian.v1 import envsandbox_pb2_grpc, rollout_pb2_grpc, trainer_pb2_grpc, weightsync_pb2_grpc

    stubs = {
        "rollout": rollout_pb2_grpc.RolloutStub, "trainer": trainer_pb2_grpc.TrainerStub,
        "weightsync": weightsync_pb2_grpc.WeightSyncStub, "envsandbox": envsandbox_pb2_grpc.EnvSandboxStub,
    }
    async with open_channel(address) as channel:
        return await getattr(stubs[service](channel), method)(request, timeout=5)


def service_of(name: str) -> str:
    """``rollout-b`` -> ``rollout``."""
    return name.split("-", 1)[0]


async def snapshot(stack: stack_mod.Stack) -> Snapshot:
    """Status of every trainer, rollout and weightsync, and the envsandboxes' sandboxes."""
    from meridian.v1 import envsandbox_pb2, rollout_pb2, trainer_pb2, weightsync_pb2

    snap = Snapshot()
    names = list(stack.addresses)
    snap.trainer = await _quiet(_rpc(stack.addresses["trainer"], "trainer", "Status", trainer_pb2.TrainerStatusRequest()))
    for name in names:
        service = service_of(name)
        if service == "rollout" and name != "rollout_http":
            snap.rollouts[name] = await _quiet(_rpc(stack.addresses[name], "rollout", "Status", rollout_pb2.RolloutStatusRequest()))
        elif service == "weightsync":
            reply = await _quiet(_rpc(stack.addresses[name], "weightsync", "Status", weightsync_pb2.WeightSyncStatusRequest()))
            snap.weightsync[name] = reply.latest_version if reply is not None else -1
        elif service == "envsandbox":
            reply = await _quiet(_rpc(stack.addresses[name], "envsandbox", "List", envsandbox_pb2.ListRequest()))
            snap.sandboxes[name] = len(reply.sandboxes) if reply is not None else -1
    return snap


def _region_of(target: str) -> str:
    return target.split("-", 1)[1] if "-" in target else ""


def moment(fault: Fault, snap: Snapshot, armed: Snapshot, in_flight: collections.Counter[str], stack: stack_mod.Stack) -> bool:
    """Whether now is the fault's moment (``armed``: the snapshot when watching began)."""
    kind, target = fault.kind, fault.target
    region = _region_of(target)
    relays = [n for n in snap.weightsync if n != "weightsync"]
    origin = snap.weightsync.get("weightsync", -1)
    t = snap.trainer
    if kind == "trainer_mid_step":
        # A step just appeared: with one group per step and a group per region per round,
        # the round's next step is running now.
        return t is not None and armed.trainer is not None and t.step > armed.trainer.step
    if kind == "trainer_before_checkpoint":
        return t is not None and t.step > t.checkpoint_step
    if kind == "rollout_mid_episode":
        return in_flight[stack.addresses[target]] > 0
    if kind == "rollout_mid_update":
        source = f"weightsync-{region}" if region else "weightsync"
        served = snap.rollouts.get(target)
        return served is not None and snap.weightsync.get(source, -1) > served.policy_version
    if kind in ("origin_mid_transfer", "link_cut"):
        return any(0 <= snap.weightsync[r] < origin for r in relays) or (0 <= snap.served() < origin)
    if kind == "relay_mid_transfer":
        served = snap.rollouts.get(f"rollout-{region}")
        return 0 <= snap.weightsync.get(target, -1) < origin or (served is not None and served.policy_version < snap.weightsync.get(target, -1))
    if kind == "envsandbox_live_sandboxes":
        return snap.sandboxes.get(target, 0) > 0
    return True  # redis_restart, corrupt_chunk: any time (the corruption waits for the next chunk)


def progressed(fault: Fault, snap: Snapshot, before: Snapshot, link_stats: dict[str, Any] | None) -> bool:
    """Whether the job moved on after the fault: a new trainer step or a newer version
    served everywhere; after a relay, link or chunk fault, a newer version at the relay
    (and for a corrupted chunk, the corruption having fired)."""
    if fault.kind == "corrupt_chunk":
        relay = f"weightsync-{_region_of(fault.target)}"
        fired = bool(link_stats and int(link_stats.get("corruptions_fired", 0)) > before.corruptions_fired)
        return fired and snap.weightsync.get(relay, -1) > before.weightsync.get(relay, -1)
    if fault.kind in ("link_cut", "relay_mid_transfer"):
        relay = f"weightsync-{_region_of(fault.target)}"
        return snap.weightsync.get(relay, -1) > before.weightsync.get(relay, -1) or (
            snap.weightsync.get(relay, -1) >= snap.weightsync.get("weightsync", 0) >= 0 and snap.served() >= snap.weightsync.get("weightsync", 0)
        )
    stepped = snap.trainer is not None and before.trainer is not None and snap.trainer.step > before.trainer.step
    return stepped or snap.served() > before.served()


# ---------------------------------------------------------------- the run


@dataclasses.dataclass
class ChaosConfig:
    faults: int = opt(20, "faults to inject (at least one of each kind on each service)")
    seed: int = opt(0, "seed of the fault schedule")
    steps: int = opt(4, "trainer steps the job runs at least (it runs on until every fault is injected)")
    model: str = opt("builtin", "model folder for rollout and trainer ('builtin': SmolLM2-135M-Instruct)")
    regions: str = opt("a,b", "regions of the stack (the first is home; each other one gets a link, a relay, an envsandbox and a rollout)")
    run_dir: str = opt("", "run folder (empty: a temporary one, emptied but for the logs and the report after a run that passes)")
    train_tasks: str = opt("text/shout", "training task ids, cycled through")
    group_size: int = opt(4, "samples per task")
    max_tokens: int = opt(16, "generated tokens per model turn")
    trigger_timeout_s: float = opt(90.0, "seconds to wait for a fault's moment before injecting it anyway")
    recovery_timeout_s: float = opt(600.0, "seconds to wait for recovery after a fault")
    drain_timeout_s: float = opt(600.0, "seconds to wait at the end for the trainer to consume, train and checkpoint everything produced")

    def __post_init__(self) -> None:
        if self.faults <= 0 or self.steps <= 0:
            raise ValueError("faults and steps must be positive")


#: Sandbox lease of a chaos run's rollouts: a rollout killed mid-episode leaves its
#: group's sandboxes open this long, then envsandbox closes them (their time-to-live,
#: envsandbox's default, is far longer than a run's drain waits: a lease that never
#: lapsed shows as leaked sandboxes).
SANDBOX_LEASE_S = 15
JOB_RETRY_CODES = "UNAVAILABLE,INTERNAL,UNKNOWN,CANCELLED,ABORTED,DEADLINE_EXCEEDED,RESOURCE_EXHAUSTED"


def _log(message: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class Chaos:
    """One chaos run on a started stack."""

    def __init__(self, stack: stack_mod.Stack, config: ChaosConfig, schedule: list[Fault]) -> None:
        self.stack = stack
        self.config = config
        self.schedule = schedule
        self.records: list[dict[str, Any]] = []
        self.published_ids: set[str] = set()
        self.in_flight: collections.Counter[str] = collections.Counter()
        self.all_pids: dict[str, set[int]] = collections.defaultdict(set)
        for name, pid in stack.pids.items():
            self.all_pids[name].add(pid)
        self.faults_done = asyncio.Event()
        self.job_errors = 0

    def _train_config(self) -> Any:
        from meridian.train import TrainConfig

        c = self.config
        return TrainConfig(
            steps=1, mode="sync", tasks_per_step=len(stack_mod.parse_regions(c.regions)), group_size=c.group_size, max_tokens=c.max_tokens,
            train_tasks=c.train_tasks, temperature=1.0, step_timeout_s=240, retry_s=600, retry_codes=JOB_RETRY_CODES,
        )

    async def job(self) -> None:
        """Sync rounds of one step each until every fault is injected and ``steps`` steps are done."""
        from meridian.train import Job

        start = (await snapshot(self.stack)).trainer.step
        while True:
            snap = await snapshot(self.stack)
            done = snap.trainer.step - start if snap.trainer is not None else 0
            if self.faults_done.is_set() and done >= self.config.steps:
                return
            job = Job(self.stack.addresses, self._train_config(), progress=False)
            job.in_flight = self.in_flight
            try:
                await job.run()
            except Exception as exc:  # noqa: BLE001 - a round cut short by a fault; the next one goes on
                self.job_errors += 1
                _log(f"job round failed ({type(exc).__name__}: {exc}); starting another")
                await asyncio.sleep(1.0)
            finally:
                self.published_ids.update(job.published_ids)

    async def inject_all(self) -> None:
        try:
            for fault in self.schedule:
                await asyncio.sleep(fault.pause_s)
                await self.inject(fault)
        finally:
            self.faults_done.set()

    async def _link_stats(self, target: str) -> dict[str, Any] | None:
        from meridian import link_emulator, regions

        return link_emulator.read_stats(regions.stats_path(self.stack.run_dir, _region_of(target)))

    async def inject(self, fault: Fault) -> None:
        """Waits for the fault's moment, injects it, restores, and times the recovery."""
        stack = self.stack
        armed = await snapshot(stack)
        waited = time.monotonic()
        on_time = False
        while time.monotonic() - waited < self.config.trigger_timeout_s:
            snap = await snapshot(stack)
            if moment(fault, snap, armed, self.in_flight, stack):
                on_time = True
                break
            await asyncio.sleep(0.05)
        before = await snapshot(stack)
        stats = await self._link_stats(fault.target) if fault.target.startswith("link-") else None
        before.corruptions_fired = int((stats or {}).get("corruptions_fired", 0))
        t0 = time.monotonic()
        _log(f"fault {fault.index}: {fault.kind} on {fault.target} ({'at its moment' if on_time else 'moment not seen: injected anyway'})")
        if fault.kind in KILLS:
            stack.kill(fault.target, signal.SIGKILL)
            await asyncio.sleep(fault.down_s)
            pid = await asyncio.to_thread(stack.restart, fault.target)
            self.all_pids[fault.target].add(pid)
        elif fault.kind == "link_cut":
            os.kill(stack.pids[fault.target], signal.SIGUSR1)
            await asyncio.sleep(fault.down_s)
            os.kill(stack.pids[fault.target], signal.SIGUSR2)
        elif fault.kind == "corrupt_chunk":
            os.kill(stack.pids[fault.target], signal.SIGHUP)
        serving_s = await self._wait_serving(fault.target, t0)
        recovered_s = None
        while time.monotonic() - t0 < self.config.recovery_timeout_s:
            snap = await snapshot(stack)
            stats = await self._link_stats(fault.target) if fault.target.startswith("link-") else None
            if progressed(fault, snap, before, stats):
                recovered_s = round(time.monotonic() - t0, 2)
                break
            await asyncio.sleep(0.25)
        record = {**dataclasses.asdict(fault), "on_time": on_time, "serving_s": serving_s, "recovery_s": recovered_s}
        _log(f"fault {fault.index}: recovered in {recovered_s} s (serving again after {serving_s} s)")
        self.records.append(record)

    async def _wait_serving(self, target: str, t0: float) -> float | None:
        """Seconds from ``t0`` until ``target`` reports SERVING (links and Redis: listening)."""
        from meridian.grpc_runtime import check_health

        if target == "redis" or target.startswith("link-"):
            return round(time.monotonic() - t0, 2)
        while time.monotonic() - t0 < self.config.recovery_timeout_s:
            if await _quiet(check_health(self.stack.addresses[target])) == "SERVING":
                return round(time.monotonic() - t0, 2)
            await asyncio.sleep(0.2)
        return None

    async def drain(self) -> Snapshot:
        """Until the stream holds nothing unacked or undelivered, the trainer's newest
        step is checkpointed, and every region serves the trainer's version."""
        from meridian.trajectory_transport import TransportConfig, open_transport

        transport = open_transport(TransportConfig(url=self.stack.redis_url))
        deadline = time.monotonic() + self.config.drain_timeout_s
        try:
            while True:
                snap = await snapshot(self.stack)
                backlog = await _quiet(transport.backlog())
                t = snap.trainer
                # Sandboxes of an episode whose rollout was killed are nobody's: the
                # envsandbox closes them when their lease lapses (SANDBOX_LEASE_S).
                sandboxes = sum(max(n, 0) for n in snap.sandboxes.values())
                if t is not None and backlog == 0 and t.trajectories_pending == 0 and t.checkpoint_step >= t.step and snap.served() >= t.policy_version and not sandboxes:
                    return snap
                if time.monotonic() > deadline:
                    _log(f"drain timed out: backlog {backlog}, trainer {t and (t.step, t.checkpoint_step, t.policy_version)}, served {snap.served()}, live sandboxes {snap.sandboxes}")
                    return snap
                await asyncio.sleep(0.5)
        finally:
            await transport.close()

    async def stream_ids(self) -> set[str]:
        """Trajectory ids of every group in the stream (XRANGE, as the operator)."""
        from meridian.trajectory_transport import TransportConfig, decode_entry, open_transport

        transport = open_transport(TransportConfig(url=self.stack.redis_url))
        ids: set[str] = set()
        try:
            start = "-"
            while True:
                entries = await transport.redis.xrange(transport.config.stream, start, "+", count=500)  # type: ignore[attr-defined]
                for entry_id, fields in entries:
                    entry = decode_entry(entry_id, fields)
                    if entry.group is not None:
                        ids.update(t.trajectory_id for t in entry.group.trajectories)
                if len(entries) < 500:
                    return ids
                last = entries[-1][0].decode() if isinstance(entries[-1][0], bytes) else entries[-1][0]
                start = "(" + last
        finally:
            await transport.close()

    async def regions_equal(self, final: Snapshot, tolerance: float) -> tuple[bool, dict[str, Any]]:
        """Every region serves the trainer's final version: the origin manifest's hash, and a canary within tolerance."""
        from services.weightsync import client as weightsync

        version = final.trainer.policy_version
        manifest = await weightsync.manifest(self.stack.addresses["weightsync"], version)
        detail = {}
        ok = True
        for name, status in final.rollouts.items():
            same = status is not None and status.policy_version == version and status.weights_hash == manifest.weights_hash
            canary = status is not None and status.canary_mean_diff <= tolerance
            detail[name] = {
                "policy_version": status.policy_version if status else None, "hash_equal": same,
                "canary_mean_diff": status.canary_mean_diff if status else None, "updates_rejected": status.updates_rejected if status else None,
            }
            ok = ok and same and canary
        return ok, detail


def leftover_sandboxes(stack: stack_mod.Stack, envsandbox_pids: set[int]) -> list[str]:
    """Sandbox mount folders under each region's sandbox root, and cgroups of any
    envsandbox instance this run started, that are still there (after ``down``)."""
    found = []
    for root in stack.run_dir.glob("sandboxes*"):
        mnt = root / "mnt"
        if mnt.is_dir():
            found += [f"folder:{p}" for p in mnt.iterdir()]
    cgroup_root = Path("/sys/fs/cgroup")
    bases = [p for depth in range(4) for p in cgroup_root.glob("/".join(["*"] * depth + ["meridian-envsandbox"]))] if cgroup_root.is_dir() else []
    for base in bases:
        for pid in envsandbox_pids:
            found += [f"cgroup:{p}" for p in base.glob(f"{pid}-*")]
    return found


async def run_chaos(stack: stack_mod.Stack, config: ChaosConfig, stop: Callable[[], None]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Runs the job and the schedule on ``stack``, drains, audits, stops the stack
    (``stop``) and checks for leaks; returns (the summary, details)."""
    from services.trainer.commit import TRAINED_LOG

    remote = stack_mod.parse_regions(config.regions)[1:]
    schedule = plan(config.seed, config.faults, remote)
    chaos = Chaos(stack, config, schedule)
    first = await snapshot(stack)
    version0 = first.trainer.policy_version
    step0 = first.trainer.step
    job = asyncio.create_task(chaos.job())
    try:
        await chaos.inject_all()
        await job
    finally:
        job.cancel()
        await asyncio.gather(job, return_exceptions=True)
    final = await chaos.drain()
    produced = chaos.published_ids | await chaos.stream_ids()
    root = stack.run_dir / "trainer-checkpoints"
    trained, flat_groups, not_in_checkpoint = read_trained_log(root / TRAINED_LOG, checkpointed_groups(root))
    audit = Audit(produced, trained)
    equal, region_detail = await chaos.regions_equal(final, 0.15)
    live_sandboxes = sum(max(n, 0) for n in final.sandboxes.values())
    await asyncio.to_thread(stop)
    leaked_groups = {name: members for name, pids in chaos.all_pids.items() for pid in pids if (members := stack_mod.group_members(pid))}
    envsandbox_pids = {pid for name, pids in chaos.all_pids.items() if service_of(name) == "envsandbox" for pid in pids}
    leftovers = leftover_sandboxes(stack, envsandbox_pids)
    recovery: dict[str, list[float | None]] = collections.defaultdict(list)
    for r in chaos.records:
        recovery[r["kind"]].append(r["recovery_s"])
    summary = {
        "faults_injected": len(chaos.records),
        "steps_completed": final.trainer.step - step0,
        "trajectories_produced": len(audit.produced),
        "trajectories_trained": len(set(audit.trained)),
        "trajectories_lost": len(audit.lost),
        "trajectories_trained_twice": len(audit.trained_twice),
        "versions_published": final.trainer.policy_version - version0,
        "regions_hash_equal": equal,
        "sandboxes_leaked": live_sandboxes + len(leftovers),
        "processes_leaked": sum(len(m) for m in leaked_groups.values()),
        "recovery_s": dict(recovery),
    }
    details = {
        "seed": config.seed, "faults": chaos.records, "regions": region_detail, "job_round_errors": chaos.job_errors,
        "lost_ids": sorted(audit.lost)[:50], "trained_twice_ids": sorted(audit.trained_twice)[:50], "unexplained_ids": sorted(audit.unexplained)[:50],
        "flat_groups_logged": flat_groups, "logged_groups_not_in_final_checkpoint": not_in_checkpoint[:50], "live_sandboxes_at_end": final.sandboxes, "leftover_sandboxes": leftovers,
        "leaked_processes": leaked_groups,
    }
    return summary, details


def start_stack(config: ChaosConfig, run_dir: str) -> tuple[stack_mod.Stack, stack_mod.StackConfig]:
    """The stack a chaos run needs: one group per trainer step (a group never waits for a
    partner that a fault took away), a checkpoint after every step, a quick idle checkpoint."""
    stack_config = stack_mod.StackConfig(run_dir=run_dir, model=config.model, ports="auto", regions=config.regions, link_mbit_s=200, link_latency_ms=20)
    trainer = ["--lr", "1e-4", "--groups-per-step", "1", "--checkpoint-every", "1", "--checkpoint-idle-s", "1", "--threads", "2"]
    rollout = ["--sandbox-lease-s", str(SANDBOX_LEASE_S)]
    return stack_mod.start(stack_config, extra_args={"trainer": trainer, "rollout": rollout}), stack_config


def run(config: ChaosConfig, run_dir: str) -> tuple[dict[str, Any], dict[str, Any], dict[str, int]]:
    """Starts the stack, runs the chaos job on it and stops it, whatever happens; returns the
    summary, the details and the services' PIDs as first started (for leak checks)."""
    stack, stack_config = start_stack(config, run_dir)
    pids = dict(stack.pids)
    stopped = False

    def stop() -> None:  # run_chaos stops the stack itself before its leak checks
        nonlocal stopped
        if not stopped:
            stopped = True
            stack.stop(stack_config.stop_timeout_s)

    try:
        summary, details = asyncio.run(run_chaos(stack, config, stop))
    finally:
        stop()
    return summary, details, pids


def main(argv: list[str]) -> int:
    """Entry point of ``meridian chaos``."""
    parser = argparse.ArgumentParser(prog="meridian chaos", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(parser, ChaosConfig, "chaos")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    ns = parser.parse_args(argv)
    try:
        config = config_from_args(ChaosConfig, ns, "chaos")
        plan(config.seed, config.faults, stack_mod.parse_regions(config.regions)[1:])
    except ValueError as exc:
        parser.error(str(exc))
    run_dir = config.run_dir or tempfile.mkdtemp(prefix="meridian-chaos-")
    started = time.monotonic()
    _log(f"starting the stack in {run_dir} (model {config.model})")
    summary, details, _ = run(config, run_dir)
    lost = summary["trajectories_lost"] or summary["trajectories_trained_twice"] or summary["sandboxes_leaked"] or summary["processes_leaked"]
    ok = summary["regions_hash_equal"] and not lost
    if ok and not config.run_dir:  # a failed run keeps its Redis data, ledger and checkpoints to look into
        stack_mod.empty_temporary_run_dir(Path(run_dir))
    details["wall_s"] = round(time.monotonic() - started, 1)
    (Path(run_dir) / "chaos-report.json").write_text(json.dumps({"summary": summary, "details": details}, indent=2))
    _log(f"details in {Path(run_dir) / 'chaos-report.json'} ({details['wall_s']} s)")
    if ns.json:
        print(json.dumps(summary))
    else:
        for key, value in summary.items():
            print(f"  {key:<28} {value}")
    return 0 if ok else 1
