"""The trajectory stream against a real redis-server (conftest ``redis_url``)."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest

from meridian.trajectory_stream import DEAD_LETTER_SUFFIX, Entry, TrajectoryStream, decode_entry, validate
from meridian.v1 import common_pb2

T = TypeVar("T")
GROUP = "trainer"
NAME = "test:trajectories"


def _traj(i: int, n_tokens: int = 3) -> common_pb2.Trajectory:
    return common_pb2.Trajectory(
        trajectory_id=f"traj-{i}",
        task_id="python/add",
        group_id=f"group-{i // 2}",
        group_size=2,
        prompt_token_ids=[1, 2],
        completion_token_ids=list(range(n_tokens)),
        logprobs=[-0.5] * n_tokens,
        loss_mask=[1] * n_tokens,
        policy_versions=[0] * n_tokens,
        reward=float(i % 2),
        trace_context={"traceparent": f"00-{i:032x}-{i:016x}-01"},
    )


def with_stream(url: str, body: Callable[[TrajectoryStream], Awaitable[T]], maxlen: int = 1000) -> T:
    """Runs ``body`` with a fresh stream client in its own event loop, closing it after."""

    async def main() -> T:
        stream = TrajectoryStream.from_url(url, NAME, maxlen)
        try:
            return await body(stream)
        finally:
            await stream.close()

    return asyncio.run(main())


# ---------------------------------------------------------------- validate / decode_entry (no redis)


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


def test_decode_entry_good_and_bad_never_raise() -> None:
    good = decode_entry(b"1-0", {b"trajectory": _traj(1).SerializeToString()})
    assert good.entry_id == "1-0" and good.error == "" and good.trajectory == _traj(1)
    missing = decode_entry("2-0", {b"other": b"x"})
    assert missing.trajectory is None and "no 'trajectory'" in missing.error
    garbage = decode_entry("3-0", {b"trajectory": b"\x0a\x7fshort"})
    assert garbage.trajectory is None and "does not parse" in garbage.error


# ---------------------------------------------------------------- against redis


def test_publish_read_ack(redis_url: str) -> None:
    async def body(stream: TrajectoryStream) -> None:
        await stream.ensure_group(GROUP)
        await stream.ensure_group(GROUP)  # idempotent (BUSYGROUP is swallowed)
        ids = [await stream.publish(_traj(i)) for i in range(3)]
        assert await stream.length() == 3
        entries = await stream.read(GROUP, "c1", count=10, block_ms=100)
        assert [e.entry_id for e in entries] == ids
        assert [e.trajectory for e in entries] == [_traj(i) for i in range(3)]
        assert all(e.error == "" for e in entries)
        # Plain fields for humans ride along.
        assert entries[0].fields[b"trajectory_id"] == b"traj-0"
        assert entries[1].fields[b"reward"] == b"1.0"
        assert await stream.pending(GROUP) == 3
        assert await stream.ack(GROUP, ids) == 3
        assert await stream.pending(GROUP) == 0
        assert await stream.ack(GROUP, []) == 0
        # Nothing new: a short block returns empty.
        assert await stream.read(GROUP, "c1", count=10, block_ms=10) == []

    with_stream(redis_url, body)


def test_group_created_before_publish_sees_entries(redis_url: str) -> None:
    # ensure_group uses MKSTREAM and id 0, so a trainer may start before any rollout.
    async def body(stream: TrajectoryStream) -> None:
        await stream.ensure_group(GROUP)
        assert await stream.length() == 0
        await stream.publish(_traj(0))
        (entry,) = await stream.read(GROUP, "c1", count=10, block_ms=100)
        assert entry.trajectory is not None and entry.trajectory.trajectory_id == "traj-0"

    with_stream(redis_url, body)


def test_pending_of_missing_group_is_zero(redis_url: str) -> None:
    async def body(stream: TrajectoryStream) -> None:
        assert await stream.pending("nobody") == 0
        await stream.publish(_traj(0))
        assert await stream.pending("nobody") == 0

    with_stream(redis_url, body)


def test_read_own_pending_after_restart(redis_url: str) -> None:
    async def first_life(stream: TrajectoryStream) -> list[str]:
        await stream.ensure_group(GROUP)
        ids = [await stream.publish(_traj(i)) for i in range(4)]
        entries = await stream.read(GROUP, "trainer-0", count=10, block_ms=100)
        assert len(entries) == 4
        await stream.ack(GROUP, [ids[1]])
        return ids

    ids = with_stream(redis_url, first_life)

    async def second_life(stream: TrajectoryStream) -> None:
        # A new process (new client), same consumer name: its unacked entries come back.
        again = await stream.read_own_pending(GROUP, "trainer-0", count=100)
        assert [e.entry_id for e in again] == [ids[0], ids[2], ids[3]]
        assert [e.trajectory.trajectory_id for e in again if e.trajectory] == ["traj-0", "traj-2", "traj-3"]
        # They are not "new" for the group, and another consumer has none of its own.
        assert await stream.read(GROUP, "trainer-0", count=10, block_ms=10) == []
        assert await stream.read_own_pending(GROUP, "trainer-1", count=100) == []
        await stream.ack(GROUP, [e.entry_id for e in again])
        assert await stream.read_own_pending(GROUP, "trainer-0", count=100) == []
        assert await stream.pending(GROUP) == 0

    with_stream(redis_url, second_life)


def test_claim_stale_moves_entries_to_another_consumer(redis_url: str) -> None:
    async def body(stream: TrajectoryStream) -> None:
        await stream.ensure_group(GROUP)
        ids = [await stream.publish(_traj(i)) for i in range(3)]
        await stream.read(GROUP, "dead-consumer", count=10, block_ms=100)
        # Not idle long enough (an hour): nothing is taken over.
        assert await stream.claim_stale(GROUP, "survivor", min_idle_ms=3_600_000) == []
        # Any idle time qualifies with min_idle 0: everything is taken over.
        claimed = await stream.claim_stale(GROUP, "survivor", min_idle_ms=0)
        assert [e.entry_id for e in claimed] == ids
        assert [e.trajectory for e in claimed] == [_traj(i) for i in range(3)]
        # Ownership moved: the survivor's own pending list now holds them.
        assert [e.entry_id for e in await stream.read_own_pending(GROUP, "survivor", 10)] == ids
        assert await stream.read_own_pending(GROUP, "dead-consumer", 10) == []
        await stream.ack(GROUP, ids)
        assert await stream.pending(GROUP) == 0

    with_stream(redis_url, body)


def test_claim_stale_respects_count(redis_url: str) -> None:
    async def body(stream: TrajectoryStream) -> None:
        await stream.ensure_group(GROUP)
        ids = [await stream.publish(_traj(i)) for i in range(5)]
        await stream.read(GROUP, "a", count=10, block_ms=100)
        first = await stream.claim_stale(GROUP, "b", min_idle_ms=0, count=2)
        assert [e.entry_id for e in first] == ids[:2]

    with_stream(redis_url, body)


def _bad_payloads() -> dict[str, dict[str, bytes]]:
    mismatch = _traj(9)
    mismatch.logprobs.pop()  # 3 tokens, 2 logprobs
    return {
        "no 'trajectory' field": {"trajectory_id": b"x"},
        "does not parse": {"trajectory": b"\x0a\x7fshort"},  # length prefix past the end
        "per-token fields disagree": {"trajectory": mismatch.SerializeToString()},
    }


def test_malformed_entries_carry_error_and_go_to_dead_letter(redis_url: str) -> None:
    async def body(stream: TrajectoryStream) -> None:
        await stream.ensure_group(GROUP)
        good_id = await stream.publish(_traj(0))
        bad_ids: dict[str, str] = {}
        for reason, fields in _bad_payloads().items():
            raw = await stream.redis.xadd(NAME, fields)
            bad_ids[reason] = raw.decode()
        entries = await stream.read(GROUP, "c1", count=10, block_ms=100)
        by_id: dict[str, Entry] = {e.entry_id: e for e in entries}
        assert by_id[good_id].error == "" and by_id[good_id].trajectory is not None
        for reason, eid in bad_ids.items():
            entry = by_id[eid]
            assert entry.trajectory is None
            assert reason in entry.error
            await stream.move_to_dead_letter(GROUP, entry)
        # Only the good entry is still pending; the poison ones were acked.
        assert await stream.pending(GROUP) == 1
        dead = await stream.redis.xrange(NAME + DEAD_LETTER_SUFFIX)
        assert len(dead) == 3
        assert stream.dead_letter == NAME + DEAD_LETTER_SUFFIX
        for (_, fields), (reason, eid) in zip(dead, bad_ids.items()):
            assert reason in fields[b"reason"].decode()
            assert fields[b"source_id"].decode() == eid
            # The original fields are kept for inspection.
            for key, value in _bad_payloads()[reason].items():
                assert fields[key.encode()] == value

    with_stream(redis_url, body)


def test_malformed_entry_in_own_pending_and_claim(redis_url: str) -> None:
    # Poison entries are decoded (not raised) on every read path.
    async def body(stream: TrajectoryStream) -> None:
        await stream.ensure_group(GROUP)
        await stream.redis.xadd(NAME, {"trajectory": b"\xff\xff\xff"})
        await stream.read(GROUP, "a", count=10, block_ms=100)
        (own,) = await stream.read_own_pending(GROUP, "a", 10)
        assert own.trajectory is None and own.error
        (claimed,) = await stream.claim_stale(GROUP, "b", min_idle_ms=0)
        assert claimed.trajectory is None and claimed.error

    with_stream(redis_url, body)


def test_maxlen_caps_the_stream(redis_url: str) -> None:
    async def body(stream: TrajectoryStream) -> None:
        # Approximate trimming removes whole stream nodes; tiny nodes make the cap tight.
        await stream.redis.config_set("stream-node-max-entries", 4)
        for i in range(60):
            await stream.publish(_traj(i))
        length = await stream.length()
        assert 10 <= length <= 10 + 4
        # The newest entries are the ones kept.
        (_, fields), = await stream.redis.xrevrange(NAME, count=1)
        assert fields[b"trajectory_id"] == b"traj-59"

    with_stream(redis_url, body, maxlen=10)


def test_dead_letter_stream_is_capped_too(redis_url: str) -> None:
    async def body(stream: TrajectoryStream) -> None:
        await stream.redis.config_set("stream-node-max-entries", 4)
        await stream.ensure_group(GROUP)
        for _ in range(40):
            await stream.redis.xadd(NAME, {"junk": b"1"})
        for entry in await stream.read(GROUP, "c", count=100, block_ms=100):
            await stream.move_to_dead_letter(GROUP, entry)
        assert await stream.redis.xlen(stream.dead_letter) <= 10 + 4
        assert await stream.pending(GROUP) == 0

    with_stream(redis_url, body, maxlen=10)
