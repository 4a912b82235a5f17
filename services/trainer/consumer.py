"""The trainer's side of the trajectory transport: accepts each GRPO group once.

One ledger answers every de-duplication question (``GroupConsumer.accept``): a group
is either ready (received, not trained on), trained but unacked (its effect is in the
weights, not yet in a checkpoint), or trained and acked (remembered by id, in
checkpoints, for ``dedupe_window`` groups). A delivery of a group in any of those
states is a duplicate: acked at once unless it is the very entry held, which is acked
with its commit. Poison entries go to the dead letters: those that do not decode, groups
the model cannot take (``check``, the learner's :meth:`check_group`), and batches whose
step kept failing (:meth:`GroupConsumer.dead_letter_taken`).
"""
from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from meridian.trajectory_transport import GroupEntry, GroupTransport, encode_fields
from meridian.v1 import common_pb2

log = logging.getLogger(__name__)

#: How many entries a restarted consumer takes back from its own pending list at once.
OWN_PENDING_MAX = 10_000
#: Entries per claim call; claiming continues while full batches of new groups come back.
CLAIM_BATCH = 100


class TrainedIds:
    """Group ids already trained on, oldest first, bounded to ``window`` ids."""

    def __init__(self, window: int, ids: list[str] | None = None) -> None:
        self.window = window
        self._ids: collections.OrderedDict[str, None] = collections.OrderedDict((i, None) for i in (ids or [])[-window:])

    def __contains__(self, gid: str) -> bool:
        return gid in self._ids

    def add(self, gid: str) -> None:
        self._ids[gid] = None
        while len(self._ids) > self.window:
            self._ids.popitem(last=False)

    def as_list(self) -> list[str]:
        return list(self._ids)


@dataclasses.dataclass(frozen=True)
class ConsumerConfig:
    """Who this consumer is and how it treats entries other consumers left behind."""

    consumer: str
    dedupe_window: int
    claim_idle_ms: int
    claim_every_s: float


Taken = tuple[str, common_pb2.TrajectoryGroup]  # (entry id, group)
#: Why the model cannot train on a group's trajectories, or '' (see PolicyLearner.check_group).
GroupCheck = Callable[[Sequence[common_pb2.Trajectory]], str]


class GroupConsumer:
    """Reads groups from ``transport`` and keeps the exactly-once ledger.

    Usage: :meth:`start` and :meth:`recover`, then :meth:`poll` in a loop, :meth:`take` batches, report them
    with :meth:`trained_on` once the learner stepped on them, and :meth:`ack` what
    :meth:`unacked` listed once a checkpoint holds that step. ``counters`` may be shared with the caller.
    ``check`` (settable until :meth:`recover`: the learner is loaded after the consumer is
    built) says why the model cannot train on a group; such groups are dead-lettered on
    arrival instead of failing every step that takes them.
    """

    def __init__(
        self, transport: GroupTransport, config: ConsumerConfig, counters: collections.Counter[str] | None = None, check: GroupCheck | None = None
    ) -> None:
        self.transport = transport
        self.config = config
        self.counters = counters if counters is not None else collections.Counter[str]()
        self.check = check
        self.trained = TrainedIds(config.dedupe_window)
        # Received and not trained on yet, oldest first: group id -> (entry id, group).
        self._ready: dict[str, Taken] = {}
        # Trained on, not yet covered by a checkpoint: group id -> entry id, acked at commit.
        self._unacked: dict[str, str] = {}
        # Trajectory ids of each unacked group, for the trained-ids log.
        self._unacked_groups: dict[str, common_pb2.TrajectoryGroup] = {}
        self._next_claim = 0.0
        self._trained_log: Path | None = None
        self._logged: set[str] = set()  # group ids the trained-ids log holds

    def open_trained_log(self, path: Path) -> None:
        """Keeps an append-only, fsynced record of every group this trainer acked as
        trained (one JSON line per group, written before its XACK): what an outside
        audit (``meridian chaos``) compares with what was published. Groups the log
        already holds (from before a restart) are not written again."""
        self._trained_log = path
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    self._logged.add(json.loads(line)["group_id"])
                except (ValueError, KeyError):
                    continue  # a line torn by a crash mid-write: its group is written again

    def _log_trained(self, groups: list[tuple[str, common_pb2.TrajectoryGroup]], how: str) -> None:
        """Appends (and fsyncs) the groups the log does not hold yet; ``how`` says why
        they are acked: ``checkpoint`` (a checkpoint covers their step) or ``covered``
        (a redelivery of a group the restored checkpoint already holds)."""
        if self._trained_log is None:
            return
        lines = []
        for entry_id, group in groups:
            if group.group_id in self._logged:
                continue
            rewards = {t.reward for t in group.trajectories}
            lines.append(json.dumps({
                "group_id": group.group_id, "entry_id": entry_id, "how": how,
                "trajectory_ids": [t.trajectory_id for t in group.trajectories],
                # Flat rewards: the learner drops the group by design (no advantage).
                "flat": len(rewards) <= 1,
            }))
        if not lines:
            return
        fd = os.open(self._trained_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, ("\n".join(lines) + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        self._logged.update(json.loads(line)["group_id"] for line in lines)

    def restore(self, trained_ids: list[str]) -> None:
        """Remembers the group ids a checkpoint says were trained on."""
        self.trained = TrainedIds(self.config.dedupe_window, trained_ids)

    async def start(self) -> None:
        """Joins the consumer group (created at the stream's start when new)."""
        await self.transport.ensure_consumer_group()

    async def recover(self) -> None:
        """Takes back what this consumer held before a restart, then what dead consumers
        left behind, before any new entry: stream order is kept where it can be."""
        for entry in await self.transport.read_own_pending(self.config.consumer, OWN_PENDING_MAX):
            await self.accept(entry)
        await self.claim()

    async def poll(self, count: int, block_ms: int) -> None:
        """Claims stale entries when due, then reads new ones (waiting up to ``block_ms``)."""
        if time.monotonic() >= self._next_claim:
            await self.claim()
        for entry in await self.transport.read(self.config.consumer, count, block_ms):
            await self.accept(entry)

    async def claim(self) -> None:
        """Takes over entries another (dead) consumer left pending for ``claim_idle_ms``."""
        self._next_claim = time.monotonic() + self.config.claim_every_s
        while True:
            entries = await self.transport.claim_stale(self.config.consumer, self.config.claim_idle_ms, CLAIM_BATCH)
            fresh = 0
            for entry in entries:
                fresh += await self.accept(entry)
            if entries:
                self.counters["claimed"] += fresh
                log.info("claimed %d stale entries (%d new groups)", len(entries), fresh)
            # Our own pending entries come back too: stop once a batch brings nothing new.
            if not fresh or len(entries) < CLAIM_BATCH:
                return

    async def accept(self, entry: GroupEntry) -> bool:
        """Routes one delivered entry; True when its group is new to this trainer."""
        if entry.group is None:
            await self._dead_letter(entry)
            return False
        gid = entry.group.group_id
        held = self._ready[gid][0] if gid in self._ready else self._unacked.get(gid)
        if held == entry.entry_id:
            return False  # the same entry again (a claim of our own): acked with its step
        if held is not None or gid in self.trained:
            # A second copy, or a redelivery of something a checkpoint already holds. The
            # copy we hold (if any) keeps its entry pending until its own commit.
            self.counters["duplicates_skipped"] += 1
            if held is None:
                # Trained before a restart and covered by the checkpoint we resumed from;
                # a crash may have come before its log line.
                self._log_trained([(entry.entry_id, entry.group)], "covered")
            await self.transport.ack([entry.entry_id])
            return False
        if self.check is not None and (problem := self.check(entry.group.trajectories)):
            # Checked here, not in the step: a step on it would raise (an embedding index
            # out of range) with every good group of its batch, and the entry, never acked,
            # would come back by claim and raise again, for ever.
            await self._dead_letter(dataclasses.replace(entry, error=f"the model cannot train on group {gid}: {problem}"))
            return False
        self._ready[gid] = (entry.entry_id, entry.group)
        return True

    async def _dead_letter(self, entry: GroupEntry) -> None:
        """Copies ``entry`` (its ``error`` the reason) to the dead-letter stream and acks it."""
        log.warning("dead-lettering entry %s: %s", entry.entry_id, entry.error)
        await self.transport.dead_letter(entry)
        self.counters["dead_lettered"] += 1

    def take(self, n: int) -> list[Taken]:
        """The ``n`` oldest ready groups, or nothing while fewer are ready."""
        if len(self._ready) < n:
            return []
        return [self._ready.pop(gid) for gid in list(self._ready)[:n]]

    def put_back(self, taken: list[Taken]) -> None:
        """Returns groups a failed step took to the front of the ready queue, in their
        order, so the next :meth:`take` gives the same batch again (a replay after a crash
        then forms the same batches as this run did)."""
        rest = self._ready
        self._ready = {group.group_id: (entry_id, group) for entry_id, group in taken}
        for gid, held in rest.items():
            self._ready.setdefault(gid, held)

    async def dead_letter_taken(self, taken: list[Taken], reason: str) -> None:
        """Dead-letters groups taken from the ready queue (a batch whose step kept
        failing) with ``reason``: each is copied whole to the dead-letter stream, for an
        operator, and acked. Should the transport fail part way, the groups not yet
        dead-lettered go back to the front of the queue, and the error is raised."""
        for i, (entry_id, group) in enumerate(taken):
            fields = {k.encode(): v if isinstance(v, bytes) else v.encode() for k, v in encode_fields(group).items()}
            try:
                await self._dead_letter(GroupEntry(entry_id, group, reason, fields))
            except BaseException:
                self.put_back(taken[i:])
                raise

    def trained_on(self, taken: list[Taken]) -> None:
        """Records that the learner stepped on ``taken``: their acks wait for a checkpoint."""
        for entry_id, group in taken:
            self.trained.add(group.group_id)
            self._unacked[group.group_id] = entry_id
            self._unacked_groups[group.group_id] = group

    async def ack_dropped(self, taken: list[Taken]) -> None:
        """Acks groups of a step that trained nothing (every sample stale or flat): they
        changed no weights, so no checkpoint needs to cover them, and none would (a step
        that trains nothing is not committed); logged as ``dropped``."""
        groups = {group.group_id: entry_id for entry_id, group in taken if self._unacked.get(group.group_id) == entry_id}
        if not groups:
            return
        self._log_trained([(e, self._unacked_groups[g]) for g, e in groups.items()], "dropped")
        await self.transport.ack(list(groups.values()))
        for gid in groups:
            del self._unacked[gid]
            self._unacked_groups.pop(gid, None)

    def unacked(self) -> dict[str, str]:
        """The groups trained on and not acked yet (group id -> entry id), as of now."""
        return dict(self._unacked)

    async def ack(self, groups: dict[str, str]) -> None:
        """Acks ``groups`` (from :meth:`unacked`) once a checkpoint or a publish holds them."""
        if not groups:
            return
        # Logged before the XACK: a crash between the two leaves a logged group that the
        # restarted trainer finds in its checkpoint and acks without logging it again.
        self._log_trained([(e, self._unacked_groups[g]) for g, e in groups.items() if g in self._unacked_groups], "checkpoint")
        await self.transport.ack(list(groups.values()))
        for gid, entry_id in groups.items():
            if self._unacked.get(gid) == entry_id:
                del self._unacked[gid]
                self._unacked_groups.pop(gid, None)

    def ready_trajectories(self) -> int:
        """Trajectories received and waiting for a step."""
        return sum(len(group.trajectories) for _, group in self._ready.values())
