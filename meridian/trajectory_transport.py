"""The trajectory transport: rollouts publish whole GRPO groups, trainers consume them
through a consumer group, with at-least-once delivery that the trainer turns into
exactly-once (it acks a group only once a checkpoint holds its effect).

One entry is one group (``meridian.v1.TrajectoryGroup``): a consumer never holds half a
group, and a rollout that dies while publishing leaves none behind. Entries that cannot be
decoded -- including entries of the earlier one-trajectory-per-entry format -- carry their
error and go to a dead-letter stream.

:class:`GroupTransport` is the small interface both sides use, built by
:func:`open_transport` from :class:`TransportConfig` (the one place naming the stream, the
consumer group and the URL); :class:`RedisGroupTransport` is the real one (Redis streams:
XADD with a length cap, XREADGROUP, XACK, XAUTOCLAIM), :class:`InMemoryGroupTransport` its
twin with the same semantics, for unit tests of the logic above it.
"""
from __future__ import annotations

import abc
import asyncio
import dataclasses
import functools
import math
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from google.protobuf.message import DecodeError

from meridian.errors import Unavailable
from meridian.v1 import common_pb2

_T = TypeVar("_T")

DEFAULT_URL = "redis://127.0.0.1:6390/0"
DEFAULT_STREAM = "meridian:trajectories"
DEFAULT_CONSUMER_GROUP = "trainer"
DEFAULT_MAXLEN = 100_000
#: Seconds a Redis command may go unanswered before the stream counts as unavailable.
DEFAULT_TIMEOUT_S = 10.0
DEAD_LETTER_SUFFIX = ":dead"


@dataclasses.dataclass(frozen=True)
class TransportConfig:
    """Where trajectory groups travel: shared by every rollout and trainer of one job.
    ``timeout_s``: how long a command (or a connection attempt) may go unanswered before
    the call raises Unavailable; a hung Redis must not hang the RPC waiting on it. A
    read's block time must stay below it."""

    url: str = DEFAULT_URL
    stream: str = DEFAULT_STREAM
    consumer_group: str = DEFAULT_CONSUMER_GROUP
    maxlen: int = DEFAULT_MAXLEN
    timeout_s: float = DEFAULT_TIMEOUT_S


@dataclasses.dataclass(frozen=True)
class GroupEntry:
    """One delivered entry; ``group`` is None when it failed to decode (``error`` says why)."""

    entry_id: str
    group: common_pb2.TrajectoryGroup | None
    error: str = ""
    fields: dict[bytes, bytes] = dataclasses.field(default_factory=dict)


# ------------------------------------------------------------------ the pure part


def validate(traj: common_pb2.Trajectory) -> str:
    """Why a trajectory cannot be trained on, or '' when it can."""
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


def validate_group(group: common_pb2.TrajectoryGroup) -> str:
    """Why a group cannot be trained on, or '' when it can: every member valid, all of
    one group, as many as the group's size, no trajectory twice."""
    if not group.group_id or not group.trajectories:
        return "a group needs a group_id and trajectories"
    for traj in group.trajectories:
        if problem := validate(traj):
            return f"trajectory {traj.trajectory_id or '?'}: {problem}"
        if traj.group_id != group.group_id or traj.group_size != len(group.trajectories):
            return f"trajectory {traj.trajectory_id} says group {traj.group_id!r} of {traj.group_size}, the entry holds {group.group_id!r} of {len(group.trajectories)}"
    if len({t.trajectory_id for t in group.trajectories}) != len(group.trajectories):
        return "a trajectory appears twice in the group"
    return ""


def make_group(trajectories: Sequence[common_pb2.Trajectory]) -> common_pb2.TrajectoryGroup:
    """The entry for one complete group (raises ValueError when it is not one)."""
    group = common_pb2.TrajectoryGroup(group_id=trajectories[0].group_id if trajectories else "", trajectories=list(trajectories))
    if problem := validate_group(group):
        raise ValueError(f"not a complete group: {problem}")
    return group


def encode_fields(group: common_pb2.TrajectoryGroup) -> dict[str, bytes | str]:
    """A stream entry's fields: the group, plus plain fields for humans and tools."""
    rewards = [t.reward for t in group.trajectories]
    return {
        "group": group.SerializeToString(),
        "group_id": group.group_id,
        "task_id": group.trajectories[0].task_id,
        "size": str(len(group.trajectories)),
        "reward_mean": repr(sum(rewards) / len(rewards)),
    }


def decode_entry(entry_id: bytes | str, fields: dict[bytes, bytes]) -> GroupEntry:
    """Parses a raw entry without raising: a bad one carries its error."""
    eid = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    payload = fields.get(b"group")
    if payload is None:
        if b"trajectory" in fields:
            return GroupEntry(eid, None, "entry holds one trajectory (the format before groups travelled whole); republish its group", fields)
        return GroupEntry(eid, None, "entry has no 'group' field", fields)
    group = common_pb2.TrajectoryGroup()
    try:
        group.ParseFromString(payload)
    except DecodeError as exc:
        return GroupEntry(eid, None, f"group does not parse: {exc}", fields)
    if problem := validate_group(group):
        return GroupEntry(eid, None, problem, fields)
    return GroupEntry(eid, group, "", fields)


# ------------------------------------------------------------------ the interface


class GroupTransport(abc.ABC):
    """Publishing and consuming trajectory groups (see the module docstring)."""

    def __init__(self, config: TransportConfig) -> None:
        self.config = config

    async def publish_group(self, trajectories: Sequence[common_pb2.Trajectory]) -> str:
        """Appends one complete group; returns its entry id."""
        return await self._append(self.config.stream, encode_fields(make_group(trajectories)))

    @abc.abstractmethod
    async def _append(self, stream: str, fields: dict[str, bytes | str]) -> str: ...

    @abc.abstractmethod
    async def ensure_consumer_group(self) -> None:
        """Creates the consumer group at the stream's start if it does not exist."""

    @abc.abstractmethod
    async def read(self, consumer: str, count: int, block_ms: int) -> list[GroupEntry]:
        """New entries for ``consumer`` (pending until acked), waiting up to ``block_ms``."""

    @abc.abstractmethod
    async def read_own_pending(self, consumer: str, count: int) -> list[GroupEntry]:
        """Entries already delivered to ``consumer`` and not acked (after a restart)."""

    @abc.abstractmethod
    async def claim_stale(self, consumer: str, min_idle_ms: int, count: int = 100) -> list[GroupEntry]:
        """Takes over up to ``count`` entries other consumers left pending ``min_idle_ms``."""

    @abc.abstractmethod
    async def ack(self, entry_ids: list[str]) -> int:
        """Marks entries consumed; returns how many were pending."""

    async def dead_letter(self, entry: GroupEntry) -> None:
        """Copies a poison entry to the dead-letter stream with its reason, then acks it."""
        fields: dict[str, bytes | str] = {k.decode(): v for k, v in entry.fields.items()}
        fields["reason"] = entry.error
        fields["source_id"] = entry.entry_id
        await self._append(self.config.stream + DEAD_LETTER_SUFFIX, fields)
        await self.ack([entry.entry_id])

    @abc.abstractmethod
    async def length(self) -> int:
        """Entries in the stream."""

    @abc.abstractmethod
    async def pending(self) -> int:
        """Entries delivered to the consumer group and not acked (0 when it is absent)."""

    @abc.abstractmethod
    async def backlog(self) -> int:
        """Entries the consumer group has not consumed: undelivered plus pending."""

    async def close(self) -> None:  # noqa: B027 - optional: only some transports hold connections
        """Releases connections."""


def open_transport(config: TransportConfig) -> GroupTransport:
    """The transport for ``config.url`` (``redis://`` or ``rediss://``)."""
    if config.url.startswith(("redis://", "rediss://", "unix://")):
        return RedisGroupTransport(config)
    raise ValueError(f"no trajectory transport for {config.url!r} (redis:// URLs are supported)")


# ------------------------------------------------------------------ Redis


def _redis_down_is_unavailable(method: Callable[..., Awaitable[_T]]) -> Callable[..., Awaitable[_T]]:
    """Raises :class:`~meridian.errors.Unavailable` for a Redis that cannot be reached or is
    still loading after a restart, so the caller reads UNAVAILABLE (retry later), not an
    INTERNAL error. Wrong credentials are a configuration fault and pass as they are."""

    @functools.wraps(method)
    async def call(self: RedisGroupTransport, *args: Any, **kwargs: Any) -> _T:
        try:
            return await method(self, *args, **kwargs)
        except self._down as exc:
            if isinstance(exc, self._auth):
                raise
            raise Unavailable(
                f"trajectory stream {self.config.stream!r}: Redis at {self._where} is unreachable or restarting "
                f"({type(exc).__name__}: {exc}); retry later"
            ) from exc

    return call


class RedisGroupTransport(GroupTransport):
    """Redis streams: XADD (capped), a consumer group, XACK, XAUTOCLAIM."""

    def __init__(self, config: TransportConfig) -> None:
        import redis.asyncio as aioredis
        from redis import exceptions

        from meridian.credentials import redis_login, redis_tls

        super().__init__(config)
        # Logs in as the caller's role's Redis user (meridian up's Redis has no other),
        # over TLS with the deployment's client certificate for a rediss:// URL.
        options = {**redis_login(config.url), **redis_tls(config.url)}
        self.redis = aioredis.from_url(config.url, socket_timeout=config.timeout_s, socket_connect_timeout=config.timeout_s, **options)
        self._errors = aioredis.ResponseError
        self._down = (exceptions.ConnectionError, exceptions.TimeoutError)
        self._auth = (exceptions.AuthenticationError, exceptions.AuthorizationError)
        url = urllib.parse.urlsplit(config.url)
        self._where = f"{url.hostname}:{url.port or 6379}"  # never the password

    @_redis_down_is_unavailable
    async def _append(self, stream: str, fields: dict[str, bytes | str]) -> str:
        entry_id = await self.redis.xadd(stream, fields, maxlen=self.config.maxlen, approximate=True)
        return entry_id.decode() if isinstance(entry_id, bytes) else entry_id

    @_redis_down_is_unavailable
    async def ensure_consumer_group(self) -> None:
        try:
            await self.redis.xgroup_create(self.config.stream, self.config.consumer_group, id="0", mkstream=True)
        except self._errors as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    @_redis_down_is_unavailable
    async def read(self, consumer: str, count: int, block_ms: int) -> list[GroupEntry]:
        if block_ms >= self.config.timeout_s * 1000:
            raise ValueError(f"block_ms={block_ms} would outlast the transport's timeout_s={self.config.timeout_s}")
        # BLOCK 0 is "wait for ever" to Redis; 0 here means "do not wait", as in the twin.
        reply = await self.redis.xreadgroup(self.config.consumer_group, consumer, {self.config.stream: ">"}, count=count, block=block_ms if block_ms > 0 else None)
        return [decode_entry(eid, fields) for _, entries in reply or [] for eid, fields in entries]

    @_redis_down_is_unavailable
    async def read_own_pending(self, consumer: str, count: int) -> list[GroupEntry]:
        reply = await self.redis.xreadgroup(self.config.consumer_group, consumer, {self.config.stream: "0"}, count=count)
        return [decode_entry(eid, fields) for _, entries in reply or [] for eid, fields in entries if fields]

    @_redis_down_is_unavailable
    async def claim_stale(self, consumer: str, min_idle_ms: int, count: int = 100) -> list[GroupEntry]:
        # XAUTOCLAIM's cursor is walked through the whole pending list.
        claimed: list[GroupEntry] = []
        cursor: str | bytes = "0-0"
        while len(claimed) < count:
            reply = await self.redis.xautoclaim(
                self.config.stream, self.config.consumer_group, consumer, min_idle_ms, start_id=cursor, count=count - len(claimed)
            )
            if not reply:
                break
            cursor, entries = reply[0], reply[1]
            claimed += [decode_entry(eid, fields) for eid, fields in entries if fields]
            if cursor in (b"0-0", "0-0"):
                break
        return claimed

    @_redis_down_is_unavailable
    async def ack(self, entry_ids: list[str]) -> int:
        if not entry_ids:
            return 0
        return int(await self.redis.xack(self.config.stream, self.config.consumer_group, *entry_ids))

    @_redis_down_is_unavailable
    async def length(self) -> int:
        return int(await self.redis.xlen(self.config.stream))

    @_redis_down_is_unavailable
    async def pending(self) -> int:
        try:
            info = await self.redis.xpending(self.config.stream, self.config.consumer_group)
        except self._errors:
            return 0
        return int(info["pending"]) if info else 0

    @_redis_down_is_unavailable
    async def backlog(self) -> int:
        try:
            groups = await self.redis.xinfo_groups(self.config.stream)
        except self._errors:
            return 0  # no stream yet
        for info in groups:
            name = info["name"].decode() if isinstance(info["name"], bytes) else info["name"]
            if name == self.config.consumer_group:
                lag = info.get("lag")
                return int(info["pending"]) + (int(lag) if lag is not None else await self.length())
        return await self.length()

    async def close(self) -> None:
        await self.redis.aclose()


# ------------------------------------------------------------------ in memory


@dataclasses.dataclass
class _Delivery:
    consumer: str
    at: float


class MemoryStreams:
    """The in-memory twin's shared state (one per test): streams of entries, and per
    stream and consumer group the delivered position and the pending entries."""

    def __init__(self) -> None:
        self.entries: dict[str, list[tuple[str, dict[bytes, bytes]]]] = {}
        self.delivered: dict[tuple[str, str], int] = {}
        self.pending: dict[tuple[str, str], dict[str, _Delivery]] = {}
        self.changed = asyncio.Event()
        self._seq = 0

    def append(self, stream: str, fields: dict[str, bytes | str], maxlen: int) -> str:
        self._seq += 1
        entry_id = f"{int(time.time() * 1000)}-{self._seq}"
        raw = {k.encode(): v if isinstance(v, bytes) else v.encode() for k, v in fields.items()}
        entries = self.entries.setdefault(stream, [])
        entries.append((entry_id, raw))
        if len(entries) > maxlen:  # trimmed from the oldest, as XADD MAXLEN does
            dropped = len(entries) - maxlen
            del entries[:dropped]
            for (name, group), position in list(self.delivered.items()):
                if name == stream:
                    self.delivered[(name, group)] = max(0, position - dropped)
        self.changed.set()
        return entry_id

    def fields_of(self, stream: str, entry_id: str) -> dict[bytes, bytes] | None:
        return next((f for eid, f in self.entries.get(stream, []) if eid == entry_id), None)


class InMemoryGroupTransport(GroupTransport):
    """The same semantics as Redis streams with a consumer group, in this process."""

    def __init__(self, config: TransportConfig, streams: MemoryStreams) -> None:
        super().__init__(config)
        self.streams = streams
        self._key = (config.stream, config.consumer_group)

    async def _append(self, stream: str, fields: dict[str, bytes | str]) -> str:
        return self.streams.append(stream, fields, self.config.maxlen)

    async def ensure_consumer_group(self) -> None:
        self.streams.entries.setdefault(self.config.stream, [])
        self.streams.delivered.setdefault(self._key, 0)
        self.streams.pending.setdefault(self._key, {})

    async def read(self, consumer: str, count: int, block_ms: int) -> list[GroupEntry]:
        deadline = time.monotonic() + block_ms / 1000
        while True:
            entries = self.streams.entries.get(self.config.stream, [])
            start = self.streams.delivered[self._key]
            fresh = entries[start : start + count]
            if fresh or time.monotonic() >= deadline:
                break
            self.streams.changed.clear()
            try:
                await asyncio.wait_for(self.streams.changed.wait(), deadline - time.monotonic())
            except TimeoutError:
                pass
        self.streams.delivered[self._key] = start + len(fresh)
        pending = self.streams.pending[self._key]
        for entry_id, _ in fresh:
            pending[entry_id] = _Delivery(consumer, time.monotonic())
        return [decode_entry(eid, fields) for eid, fields in fresh]

    async def read_own_pending(self, consumer: str, count: int) -> list[GroupEntry]:
        own = [eid for eid, d in self.streams.pending.get(self._key, {}).items() if d.consumer == consumer][:count]
        return self._decoded(own)

    async def claim_stale(self, consumer: str, min_idle_ms: int, count: int = 100) -> list[GroupEntry]:
        now = time.monotonic()
        pending = self.streams.pending.get(self._key, {})
        taken = [eid for eid, d in pending.items() if (now - d.at) * 1000 >= min_idle_ms][:count]
        for eid in taken:
            pending[eid] = _Delivery(consumer, now)
        return self._decoded(taken)

    def _decoded(self, entry_ids: list[str]) -> list[GroupEntry]:
        out = []
        for eid in entry_ids:
            fields = self.streams.fields_of(self.config.stream, eid)
            if fields is not None:  # trimmed away: nothing left to deliver
                out.append(decode_entry(eid, fields))
        return out

    async def ack(self, entry_ids: list[str]) -> int:
        pending = self.streams.pending.get(self._key, {})
        return sum(pending.pop(eid, None) is not None for eid in entry_ids)

    async def length(self) -> int:
        return len(self.streams.entries.get(self.config.stream, []))

    async def pending(self) -> int:
        return len(self.streams.pending.get(self._key, {}))

    async def backlog(self) -> int:
        if self._key not in self.streams.delivered:
            return await self.length()
        return len(self.streams.pending[self._key]) + await self.length() - self.streams.delivered[self._key]
