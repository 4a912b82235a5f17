"""The trajectory stream: rollouts XADD finished episodes, trainers consume them
through a Redis consumer group.

Each entry holds one serialized ``meridian.v1.Trajectory`` (its trace context rides
inside it) plus a few plain fields for humans and tools (``redis-cli XRANGE``).
Entries that cannot be decoded go to a dead-letter stream with the reason.
"""
from __future__ import annotations

import dataclasses
import math

import redis.asyncio as aioredis
from google.protobuf.message import DecodeError

from meridian.v1 import common_pb2

STREAM = "meridian:trajectories"
DEAD_LETTER_SUFFIX = ":dead"
DEFAULT_MAXLEN = 100_000


@dataclasses.dataclass(frozen=True)
class Entry:
    """One delivered stream entry; ``trajectory`` is None when it failed to decode."""

    entry_id: str
    trajectory: common_pb2.Trajectory | None
    error: str = ""
    fields: dict[bytes, bytes] = dataclasses.field(default_factory=dict)


def decode_entry(entry_id: bytes | str, fields: dict[bytes, bytes]) -> Entry:
    """Parses a raw stream entry without raising: a bad one carries its error."""
    eid = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    payload = fields.get(b"trajectory")
    if payload is None:
        return Entry(eid, None, "entry has no 'trajectory' field", fields)
    traj = common_pb2.Trajectory()
    try:
        traj.ParseFromString(payload)
    except DecodeError as exc:
        return Entry(eid, None, f"trajectory does not parse: {exc}", fields)
    problem = validate(traj)
    if problem:
        return Entry(eid, None, problem, fields)
    return Entry(eid, traj, "", fields)


def validate(traj: common_pb2.Trajectory) -> str:
    """Returns why a trajectory cannot be trained on, or '' when it can."""
    n = len(traj.completion_token_ids)
    if not traj.trajectory_id or not traj.group_id:
        return "trajectory_id and group_id are required"
    if not (len(traj.logprobs) == len(traj.loss_mask) == len(traj.policy_versions) == n):
        return (
            f"per-token fields disagree: {n} tokens, {len(traj.logprobs)} logprobs, "
            f"{len(traj.loss_mask)} mask, {len(traj.policy_versions)} versions"
        )
    if traj.group_size <= 0:
        return f"group_size must be positive, got {traj.group_size}"
    if not traj.prompt_token_ids:
        return "prompt_token_ids is empty (the first completion token needs a prompt to be predicted from)"
    if any(t < 0 for t in traj.prompt_token_ids) or any(t < 0 for t in traj.completion_token_ids):
        return "negative token id"
    if not math.isfinite(traj.reward) or not all(math.isfinite(lp) for lp in traj.logprobs):
        return "reward and logprobs must be finite"
    if any(m not in (0, 1) for m in traj.loss_mask):
        return "loss_mask values must be 0 or 1"
    return ""


class TrajectoryStream:
    """Typed access to the trajectory stream and its dead-letter stream."""

    def __init__(self, client: aioredis.Redis, name: str = STREAM, maxlen: int = DEFAULT_MAXLEN) -> None:
        self.redis = client
        self.name = name
        self.dead_letter = name + DEAD_LETTER_SUFFIX
        self.maxlen = maxlen

    @classmethod
    def from_url(cls, url: str, name: str = STREAM, maxlen: int = DEFAULT_MAXLEN) -> "TrajectoryStream":
        return cls(aioredis.from_url(url), name, maxlen)

    async def close(self) -> None:
        await self.redis.aclose()

    async def publish(self, traj: common_pb2.Trajectory) -> str:
        """XADDs one trajectory (the stream is capped near ``maxlen`` entries)."""
        fields = {
            "trajectory": traj.SerializeToString(),
            "trajectory_id": traj.trajectory_id,
            "group_id": traj.group_id,
            "task_id": traj.task_id,
            "reward": repr(traj.reward),
        }
        entry_id = await self.redis.xadd(self.name, fields, maxlen=self.maxlen, approximate=True)
        return entry_id.decode() if isinstance(entry_id, bytes) else entry_id

    async def ensure_group(self, group: str) -> None:
        """Creates the consumer group at the stream's start if it does not exist."""
        try:
            await self.redis.xgroup_create(self.name, group, id="0", mkstream=True)
        except aioredis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def read(self, group: str, consumer: str, count: int, block_ms: int) -> list[Entry]:
        """New entries for this consumer (they stay pending until acked)."""
        reply = await self.redis.xreadgroup(group, consumer, {self.name: ">"}, count=count, block=block_ms)
        return [decode_entry(eid, fields) for _, entries in reply or [] for eid, fields in entries]

    async def read_own_pending(self, group: str, consumer: str, count: int) -> list[Entry]:
        """Entries already delivered to this consumer and not acked (after a restart)."""
        reply = await self.redis.xreadgroup(group, consumer, {self.name: "0"}, count=count)
        return [decode_entry(eid, fields) for _, entries in reply or [] for eid, fields in entries if fields]

    async def claim_stale(self, group: str, consumer: str, min_idle_ms: int, count: int = 100) -> list[Entry]:
        """Takes over up to ``count`` entries other consumers left pending for ``min_idle_ms``,
        walking XAUTOCLAIM's cursor through the whole pending list."""
        claimed: list[Entry] = []
        cursor: str | bytes = "0-0"
        while len(claimed) < count:
            reply = await self.redis.xautoclaim(self.name, group, consumer, min_idle_ms, start_id=cursor, count=count - len(claimed))
            if not reply:
                break
            cursor, entries = reply[0], reply[1]
            claimed += [decode_entry(eid, fields) for eid, fields in entries if fields]
            if cursor in (b"0-0", "0-0"):
                break
        return claimed

    async def ack(self, group: str, entry_ids: list[str]) -> int:
        if not entry_ids:
            return 0
        return int(await self.redis.xack(self.name, group, *entry_ids))

    async def move_to_dead_letter(self, group: str, entry: Entry) -> None:
        """Copies a poison entry to the dead-letter stream with its reason, then acks it."""
        fields: dict[str | bytes, bytes | str] = dict(entry.fields)
        fields["reason"] = entry.error
        fields["source_id"] = entry.entry_id
        await self.redis.xadd(self.dead_letter, fields, maxlen=self.maxlen, approximate=True)
        await self.ack(group, [entry.entry_id])

    async def length(self) -> int:
        return int(await self.redis.xlen(self.name))

    async def backlog(self, group: str) -> int:
        """Entries not yet consumed by ``group``: never delivered plus delivered and unacked."""
        try:
            groups = await self.redis.xinfo_groups(self.name)
        except aioredis.ResponseError:
            return 0  # no stream yet
        for info in groups:
            name = info["name"].decode() if isinstance(info["name"], bytes) else info["name"]
            if name == group:
                lag = info.get("lag")
                return int(info["pending"]) + (int(lag) if lag is not None else await self.length())
        return await self.length()

    async def pending(self, group: str) -> int:
        """Entries delivered to ``group`` and not yet acked (0 when the group is absent)."""
        try:
            info = await self.redis.xpending(self.name, group)
        except aioredis.ResponseError:
            return 0
        return int(info["pending"]) if info else 0
