"""The trajectory transport: one contract suite run over both implementations, a real
redis-server (conftest ``redis_url``) and the in-memory twin; plus the pure checks."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

import pytest

from meridian.errors import Unavailable
from meridian.trajectory_transport import (
    DEAD_LETTER_SUFFIX,
    GroupTransport,
    InMemoryGroupTransport,
    MemoryStreams,
    RedisGroupTransport,
    TransportConfig,
    decode_entry,
    encode_fields,
    make_group,
    validate,
    validate_group,
)
from meridian.v1 import common_pb2

T = TypeVar("T")
NAME = "test:trajectories"


def _traj(i: int, group: int | None = None, size: int = 2, n_tokens: int = 3) -> common_pb2.Trajectory:
    g = i // size if group is None else group
    return common_pb2.Trajectory(
        trajectory_id=f"traj-{i}",
        task_id="python/add",
        group_id=f"group-{g}",
        group_size=size,
        prompt_token_ids=[1, 2],
        completion_token_ids=list(range(n_tokens)),
        logprobs=[-0.5] * n_tokens,
        loss_mask=[1] * n_tokens,
        policy_versions=[0] * n_tokens,
        reward=float(i % 2),
        trace_context={"traceparent": f"00-{i:032x}-{i:016x}-01"},
    )


def _group(g: int, size: int = 2) -> list[common_pb2.Trajectory]:
    return [_traj(g * size + k, group=g, size=size) for k in range(size)]


# ---------------------------------------------------------------- pure checks


def test_validate_accepts_a_good_trajectory() -> None:
    assert validate(_traj(0)) == ""


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda t: t.ClearField("trajectory_id"), "required"),
        (lambda t: t.ClearField("group_id"), "required"),
        (lambda t: t.logprobs.pop(), "per-token"),
        (lambda t: t.loss_mask.append(1), "per-token"),
        (lambda t: t.policy_versions.pop(), "per-token"),
        (lambda t: setattr(t, "group_size", 0), "group_size"),
    ],
)
def test_validate_rejects(mutate: Callable[[common_pb2.Trajectory], object], needle: str) -> None:
    traj = _traj(0)
    mutate(traj)
    assert needle in validate(traj)


def test_a_group_must_be_whole_and_consistent() -> None:
    assert validate_group(make_group(_group(0))) == ""
    with pytest.raises(ValueError, match="not a complete group"):
        make_group(_group(0)[:1])  # one of two
    mixed = common_pb2.TrajectoryGroup(group_id="group-0", trajectories=[_traj(0), _traj(2, group=1)])
    assert "says group" in validate_group(mixed)
    twice = common_pb2.TrajectoryGroup(group_id="group-0", trajectories=[_traj(0), _traj(0)])
    assert "twice" in validate_group(twice)


def test_decode_entry_good_and_bad_never_raise() -> None:
    good = decode_entry(b"1-0", {k.encode(): v if isinstance(v, bytes) else v.encode() for k, v in encode_fields(make_group(_group(0))).items()})
    assert good.entry_id == "1-0" and good.error == "" and list(good.group.trajectories) == _group(0)
    missing = decode_entry("2-0", {b"other": b"x"})
    assert missing.group is None and "no 'group'" in missing.error
    garbage = decode_entry("3-0", {b"group": b"\x0a\x7fshort"})
    assert garbage.group is None and "does not parse" in garbage.error
    old_format = decode_entry("4-0", {b"trajectory": _traj(0).SerializeToString()})
    assert old_format.group is None and "format before groups" in old_format.error


# ---------------------------------------------------------------- one contract, two transports


@pytest.fixture(params=["redis", "memory"])
def make_transport(request: pytest.FixtureRequest) -> Iterator[Callable[..., GroupTransport]]:
    """A factory of transports onto one stream: several clients (rollout, trainers, a
    restarted process) share it, as they share a Redis stream."""
    streams = MemoryStreams()
    url = request.getfixturevalue("redis_url") if request.param == "redis" else "memory://"

    def make(maxlen: int = 1000, group: str = "trainer") -> GroupTransport:
        config = TransportConfig(url=url, stream=NAME, consumer_group=group, maxlen=maxlen)
        return RedisGroupTransport(config) if request.param == "redis" else InMemoryGroupTransport(config, streams)

    yield make


def run(body: Callable[[], Awaitable[T]]) -> T:
    return asyncio.run(body())


def test_publish_read_ack(make_transport: Callable[..., GroupTransport]) -> None:
    async def body() -> None:
        t = make_transport()
        try:
            await t.ensure_consumer_group()
            await t.ensure_consumer_group()  # idempotent
            ids = [await t.publish_group(_group(g)) for g in range(3)]
            assert await t.length() == 3 and await t.backlog() == 3
            entries = await t.read("c1", count=10, block_ms=100)
            assert [e.entry_id for e in entries] == ids
            assert [list(e.group.trajectories) for e in entries] == [_group(g) for g in range(3)]
            assert all(e.error == "" for e in entries)
            # Plain fields for humans ride along.
            assert entries[0].fields[b"group_id"] == b"group-0" and entries[1].fields[b"size"] == b"2"
            assert await t.pending() == 3 and await t.backlog() == 3
            assert await t.ack(ids) == 3
            assert await t.pending() == 0 and await t.backlog() == 0
            assert await t.ack([]) == 0
            assert await t.read("c1", count=10, block_ms=10) == []
        finally:
            await t.close()

    run(body)


def test_a_partial_group_is_never_published(make_transport: Callable[..., GroupTransport]) -> None:
    async def body() -> None:
        t = make_transport()
        try:
            with pytest.raises(ValueError):
                await t.publish_group(_group(0)[:1])
            assert await t.length() == 0
        finally:
            await t.close()

    run(body)


def test_group_created_before_publish_sees_entries(make_transport: Callable[..., GroupTransport]) -> None:
    async def body() -> None:
        trainer, rollout = make_transport(), make_transport()
        try:
            await trainer.ensure_consumer_group()
            assert await trainer.length() == 0 and await trainer.pending() == 0
            reading = asyncio.create_task(trainer.read("c1", count=10, block_ms=2000))
            await asyncio.sleep(0.05)
            await rollout.publish_group(_group(0))
            (entry,) = await reading
            assert entry.group is not None and entry.group.group_id == "group-0"
        finally:
            await trainer.close()
            await rollout.close()

    run(body)


def test_backlog_without_a_consumer_group_is_the_stream(make_transport: Callable[..., GroupTransport]) -> None:
    async def body() -> None:
        t = make_transport(group="nobody")
        try:
            assert await t.pending() == 0
            await t.publish_group(_group(0))
            assert await t.pending() == 0 and await t.backlog() == 1
        finally:
            await t.close()

    run(body)


def test_read_own_pending_after_restart(make_transport: Callable[..., GroupTransport]) -> None:
    async def body() -> None:
        first = make_transport()
        await first.ensure_consumer_group()
        ids = [await first.publish_group(_group(g)) for g in range(4)]
        assert len(await first.read("trainer-0", count=10, block_ms=100)) == 4
        await first.ack([ids[1]])
        await first.close()
        # A new process (new client), same consumer name: its unacked entries come back.
        second = make_transport()
        try:
            again = await second.read_own_pending("trainer-0", count=100)
            assert [e.entry_id for e in again] == [ids[0], ids[2], ids[3]]
            assert [e.group.group_id for e in again if e.group] == ["group-0", "group-2", "group-3"]
            assert await second.read("trainer-0", count=10, block_ms=10) == []
            assert await second.read_own_pending("trainer-1", count=100) == []
            await second.ack([e.entry_id for e in again])
            assert await second.read_own_pending("trainer-0", count=100) == [] and await second.pending() == 0
        finally:
            await second.close()

    run(body)


def test_claim_stale_moves_entries_to_another_consumer(make_transport: Callable[..., GroupTransport]) -> None:
    async def body() -> None:
        t = make_transport()
        try:
            await t.ensure_consumer_group()
            ids = [await t.publish_group(_group(g)) for g in range(3)]
            await t.read("dead-consumer", count=10, block_ms=100)
            assert await t.claim_stale("survivor", min_idle_ms=3_600_000) == []
            claimed = await t.claim_stale("survivor", min_idle_ms=0)
            assert [e.entry_id for e in claimed] == ids
            assert [list(e.group.trajectories) for e in claimed] == [_group(g) for g in range(3)]
            assert [e.entry_id for e in await t.read_own_pending("survivor", 10)] == ids
            assert await t.read_own_pending("dead-consumer", 10) == []
            await t.ack(ids)
            assert await t.pending() == 0
        finally:
            await t.close()

    run(body)


def test_claim_stale_respects_count(make_transport: Callable[..., GroupTransport]) -> None:
    async def body() -> None:
        t = make_transport()
        try:
            await t.ensure_consumer_group()
            ids = [await t.publish_group(_group(g)) for g in range(5)]
            await t.read("a", count=10, block_ms=100)
            first = await t.claim_stale("b", min_idle_ms=0, count=2)
            assert [e.entry_id for e in first] == ids[:2]
        finally:
            await t.close()

    run(body)


def test_claim_stale_finds_a_stale_entry_behind_many_fresh_ones(make_transport: Callable[..., GroupTransport]) -> None:
    """A dead consumer's entry is claimed however many recently delivered entries sit
    before it in the pending list: XAUTOCLAIM examines at most ten times COUNT entries a
    call, so claim_stale must follow its cursor through the whole list, or the entry
    stays pending, never trained, for as long as the fresh ones keep coming first."""

    async def body() -> None:
        t = make_transport()
        try:
            await t.ensure_consumer_group()
            ids = [await t.publish_group(_group(g)) for g in range(12)]
            await t.read("dead-consumer", count=12, block_ms=100)
            await asyncio.sleep(2.5)
            # A live consumer took the first eleven just now: only the last one is stale (the
            # margin: the next call comes well within 2 s even on a busy machine).
            assert [e.entry_id for e in await t.claim_stale("live", min_idle_ms=0, count=11)] == ids[:11]
            claimed = await t.claim_stale("survivor", min_idle_ms=2000, count=1)
            assert [e.entry_id for e in claimed] == ids[11:]
            assert [e.entry_id for e in await t.read_own_pending("survivor", 10)] == ids[11:]
        finally:
            await t.close()

    run(body)


def _bad_fields() -> dict[str, dict[str, bytes]]:
    mismatch = make_group(_group(9))
    mismatch.trajectories[0].logprobs.pop()  # 3 tokens, 2 logprobs
    half = common_pb2.TrajectoryGroup(group_id="group-0", trajectories=_group(0)[:1])
    return {
        "no 'group' field": {"group_id": b"x"},
        "does not parse": {"group": b"\x0a\x7fshort"},
        "per-token fields disagree": {"group": mismatch.SerializeToString()},
        "says group": {"group": half.SerializeToString()},
        "format before groups": {"trajectory": _traj(0).SerializeToString()},
    }


def test_poison_entries_carry_their_error_and_go_to_dead_letter(make_transport: Callable[..., GroupTransport]) -> None:
    async def body() -> None:
        t = make_transport()
        try:
            await t.ensure_consumer_group()
            good_id = await t.publish_group(_group(0))
            bad_ids = {reason: await t._append(NAME, dict(fields)) for reason, fields in _bad_fields().items()}
            entries = {e.entry_id: e for e in await t.read("c1", count=10, block_ms=100)}
            assert entries[good_id].error == "" and entries[good_id].group is not None
            for reason, eid in bad_ids.items():
                assert entries[eid].group is None and reason in entries[eid].error
                await t.dead_letter(entries[eid])
            # Only the good entry is still pending; the poison ones were acked.
            assert await t.pending() == 1
            dead = await _dead_entries(t)
            assert len(dead) == len(bad_ids)
            for fields, (reason, eid) in zip(dead, bad_ids.items()):
                assert reason in fields[b"reason"].decode() and fields[b"source_id"].decode() == eid
                for key, value in _bad_fields()[reason].items():
                    assert fields[key.encode()] == value  # the original fields are kept
        finally:
            await t.close()

    run(body)


async def _dead_entries(t: GroupTransport) -> list[dict[bytes, bytes]]:
    if isinstance(t, RedisGroupTransport):
        return [fields for _, fields in await t.redis.xrange(NAME + DEAD_LETTER_SUFFIX)]
    assert isinstance(t, InMemoryGroupTransport)
    return [fields for _, fields in t.streams.entries.get(NAME + DEAD_LETTER_SUFFIX, [])]


def test_poison_entries_decode_on_every_read_path(make_transport: Callable[..., GroupTransport]) -> None:
    async def body() -> None:
        t = make_transport()
        try:
            await t.ensure_consumer_group()
            await t._append(NAME, {"group": b"\xff\xff\xff"})
            await t.read("a", count=10, block_ms=100)
            (own,) = await t.read_own_pending("a", 10)
            assert own.group is None and own.error
            (claimed,) = await t.claim_stale("b", min_idle_ms=0)
            assert claimed.group is None and claimed.error
        finally:
            await t.close()

    run(body)


def test_maxlen_caps_the_stream(make_transport: Callable[..., GroupTransport]) -> None:
    async def body() -> None:
        t = make_transport(maxlen=10)
        try:
            if isinstance(t, RedisGroupTransport):
                # Approximate trimming removes whole stream nodes; tiny nodes make the cap tight.
                await t.redis.config_set("stream-node-max-entries", 4)
            for g in range(60):
                await t.publish_group(_group(g))
            assert 10 <= await t.length() <= 10 + 4
        finally:
            await t.close()

    run(body)


def test_a_redis_that_is_down_answers_unavailable_naming_it(pick_port: Callable[[], int]) -> None:
    """Nothing listens on the port (Redis down or restarting): every call the services make
    raises Unavailable (the gRPC boundary's UNAVAILABLE: retry later), naming the stream
    and the address, never the password; not a redis-py error read as INTERNAL."""
    port = pick_port()
    config = TransportConfig(url=f"redis://rollout:s3cret@127.0.0.1:{port}/0", stream=NAME, consumer_group="trainer")

    async def body() -> None:
        t = RedisGroupTransport(config)
        calls: dict[str, Callable[[], Awaitable[object]]] = {
            "publish_group": lambda: t.publish_group(_group(0)),
            "ensure_consumer_group": t.ensure_consumer_group,
            "read": lambda: t.read("c", 10, 0),
            "read_own_pending": lambda: t.read_own_pending("c", 10),
            "claim_stale": lambda: t.claim_stale("c", 0),
            "ack": lambda: t.ack(["1-0"]),
            "length": t.length,
            "pending": t.pending,
            "backlog": t.backlog,
        }
        try:
            for name, call in calls.items():
                with pytest.raises(Unavailable) as caught:
                    await call()
                message = str(caught.value)
                assert f"127.0.0.1:{port}" in message and repr(NAME) in message and "s3cret" not in message, (name, message)
        finally:
            await t.close()

    run(body)


def test_a_redis_that_accepts_but_never_answers_is_unavailable_not_a_stall() -> None:
    """A hung Redis (stopped, or a partition that drops replies): the kernel completes the
    connection, no reply ever comes. Every call gives up after the transport's timeout
    with Unavailable instead of hanging the RPC that made it."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(16)  # never accepted, never answered
        port = hung.getsockname()[1]
        config = TransportConfig(url=f"redis://127.0.0.1:{port}/0", stream=NAME, consumer_group="trainer", timeout_s=0.3)

        async def body() -> None:
            t = RedisGroupTransport(config)
            try:
                for call in (lambda: t.publish_group(_group(0)), lambda: t.read("c", 10, 100), t.backlog):
                    with pytest.raises(Unavailable, match=f"127.0.0.1:{port}"):
                        # 10x the timeout given, and below redis-py's own default (5 s in
                        # recent versions, none in older ones): ours must be the one acting.
                        await asyncio.wait_for(call(), 3)
            finally:
                await t.close()

        run(body)


def test_a_read_with_no_wait_returns_at_once_on_every_transport(make_transport: Callable[..., GroupTransport]) -> None:
    """block_ms=0 is "do not wait" on both transports (Redis reads BLOCK 0 as "for ever":
    sent as such, the read hung until the socket timeout and then raised Unavailable)."""

    async def body() -> None:
        t = make_transport()
        try:
            await t.ensure_consumer_group()
            assert await asyncio.wait_for(t.read("c1", count=10, block_ms=0), 5) == []
            await t.publish_group(_group(0))
            assert len(await asyncio.wait_for(t.read("c1", count=10, block_ms=0), 5)) == 1
        finally:
            await t.close()

    run(body)


def test_a_read_may_not_block_longer_than_the_timeout() -> None:
    t = RedisGroupTransport(TransportConfig(url="redis://127.0.0.1:1/0", stream=NAME, timeout_s=1.0))

    async def body() -> None:
        try:
            with pytest.raises(ValueError, match="block_ms"):
                await t.read("c", 10, 1000)
        finally:
            await t.close()

    run(body)
