"""The trainer's exactly-once ledger (GroupConsumer) on the in-memory transport:
redelivery, claims, poison entries, and crashes at each point of the commit order.
The same cases run against redis-server in tests/integration/test_trainer_recovery.py;
a dead-letter stream that cannot be written is made on a real redis-server here."""
from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest
from redis import exceptions as redis_errors

from meridian.trajectory_transport import (
    DEAD_LETTER_SUFFIX,
    GroupEntry,
    InMemoryGroupTransport,
    MemoryStreams,
    RedisGroupTransport,
    TransportConfig,
    encode_fields,
    make_group,
)
from meridian.v1 import common_pb2
from services.trainer.consumer import ConsumerConfig, GroupConsumer, TrainedIds

T = TypeVar("T")
CONFIG = TransportConfig(url="memory://", stream="test:trajectories")


def run(body: Callable[[], Awaitable[T]]) -> T:
    return asyncio.run(body())  # type: ignore[arg-type]


def _group(name: str, size: int = 2) -> list[common_pb2.Trajectory]:
    return [
        common_pb2.Trajectory(
            trajectory_id=f"{name}-{k}",
            task_id="python/add",
            group_id=name,
            group_size=size,
            prompt_token_ids=[1],
            completion_token_ids=[2],
            logprobs=[-0.5],
            loss_mask=[1],
            policy_versions=[0],
            reward=float(k),
        )
        for k in range(size)
    ]


def _consumer(
    streams: MemoryStreams, name: str = "trainer-0", claim_idle_ms: int = 60_000, counters: collections.Counter[str] | None = None, claim_every_s: float = 3600
) -> GroupConsumer:
    transport = InMemoryGroupTransport(CONFIG, streams)
    return GroupConsumer(transport, ConsumerConfig(name, dedupe_window=100, claim_idle_ms=claim_idle_ms, claim_every_s=claim_every_s), counters)


def _entry(entry_id: str, name: str) -> GroupEntry:
    return GroupEntry(entry_id, make_group(_group(name)), "", {})


def _ids(taken: list[tuple[str, common_pb2.TrajectoryGroup]]) -> list[str]:
    return [group.group_id for _, group in taken]


# ---------------------------------------------------------------- the ledger


def test_redelivery_under_a_new_entry_id_is_skipped_and_acked() -> None:
    async def body() -> None:
        streams = MemoryStreams()
        c = _consumer(streams)
        await c.start()
        first = await c.transport.publish_group(_group("g"))
        second = await c.transport.publish_group(_group("g"))  # the same group written twice
        await c.poll(10, 0)
        assert c.ready_trajectories() == 2 and c.counters["duplicates_skipped"] == 1
        assert await c.transport.pending() == 1  # the copy was acked, the held one waits
        assert [eid for eid, _ in c.take(1)] == [first] and first != second

    run(body)


def test_the_held_entry_delivered_again_is_neither_acked_nor_counted() -> None:
    async def body() -> None:
        c = _consumer(MemoryStreams())
        await c.start()
        assert await c.accept(_entry("1-0", "g")) is True
        assert await c.accept(_entry("1-0", "g")) is False  # our own claim brought it back
        assert c.counters["duplicates_skipped"] == 0 and c.ready_trajectories() == 2
        c.trained_on(c.take(1))
        assert await c.accept(_entry("1-0", "g")) is False
        assert c.counters["duplicates_skipped"] == 0

    run(body)


def test_a_redelivery_after_training_does_not_start_the_group_again() -> None:
    async def body() -> None:
        c = _consumer(MemoryStreams())
        await c.start()
        await c.accept(_entry("1-0", "g"))
        c.trained_on(c.take(1))
        assert await c.accept(_entry("2-0", "g")) is False
        assert c.take(1) == [] and c.counters["duplicates_skipped"] == 1

    run(body)


def test_take_gives_exactly_n_oldest_first_or_nothing() -> None:
    async def body() -> None:
        c = _consumer(MemoryStreams())
        await c.start()
        await c.accept(_entry("1", "A"))
        assert c.take(2) == []  # one ready group is not a batch of two
        assert c.ready_trajectories() == 2  # and nothing was removed
        await c.accept(_entry("2", "B"))
        await c.accept(_entry("3", "C"))
        assert _ids(c.take(2)) == ["A", "B"]
        assert _ids(c.take(1)) == ["C"]
        assert c.take(1) == []

    run(body)


def test_poison_entries_are_dead_lettered_and_acked() -> None:
    async def body() -> None:
        streams = MemoryStreams()
        c = _consumer(streams)
        await c.start()
        half = make_group(_group("g", size=3))
        del half.trajectories[2]  # a group missing a member
        await c.transport._append(CONFIG.stream, encode_fields(half))
        await c.transport._append(CONFIG.stream, {"trajectory": _group("old")[0].SerializeToString()})  # the format before groups
        await c.poll(10, 0)
        assert c.counters["dead_lettered"] == 2 and c.ready_trajectories() == 0
        assert await c.transport.pending() == 0
        dead = streams.entries[CONFIG.stream + ":dead"]
        reasons = [fields[b"reason"].decode() for _, fields in dead]
        assert "3" in reasons[0] and "before groups" in reasons[1]

    run(body)


def test_a_batch_whose_dead_lettering_fails_goes_back_to_the_front_unacked(redis_url: str) -> None:
    """Dead-lettering a failing batch on a real redis-server whose dead-letter stream
    cannot be written: the error is raised, nothing is acked, and the groups are back at
    the front of the ready queue in their order, to be tried again, never lost."""

    async def body() -> None:
        transport = RedisGroupTransport(TransportConfig(url=redis_url, stream=CONFIG.stream))
        c = GroupConsumer(transport, ConsumerConfig("trainer-0", dedupe_window=100, claim_idle_ms=60_000, claim_every_s=3600))
        try:
            await c.start()
            for name in ("g0", "g1", "g2"):
                await transport.publish_group(_group(name))
            await c.poll(10, 0)
            taken = c.take(2)
            await transport.redis.set(CONFIG.stream + DEAD_LETTER_SUFFIX, "not a stream")  # XADD there fails
            with pytest.raises(redis_errors.ResponseError, match="WRONGTYPE"):
                await c.dead_letter_taken(taken, "the step kept failing")
            assert await transport.pending() == 3 and c.counters["dead_lettered"] == 0
            again = c.take(2)
            assert again == taken
            await transport.redis.delete(CONFIG.stream + DEAD_LETTER_SUFFIX)
            await c.dead_letter_taken(again, "the step kept failing")
            assert await transport.pending() == 1 and c.counters["dead_lettered"] == 2
            assert _ids(c.take(1)) == ["g2"]
        finally:
            await transport.close()

    run(body)


def test_trained_ids_are_bounded_oldest_out() -> None:
    ids = TrainedIds(2, ["a", "b", "c"])
    assert "a" not in ids and ids.as_list() == ["b", "c"]
    ids.add("d")
    assert ids.as_list() == ["c", "d"]


# ---------------------------------------------------------------- crashes in the commit order


async def _trained_by_a_crashed_consumer(streams: MemoryStreams, names: list[str]) -> tuple[GroupConsumer, list[str]]:
    """Consumer A reads and trains on ``names``, then dies before acking anything."""
    a = _consumer(streams, "trainer-a")
    await a.start()
    for name in names:
        await a.transport.publish_group(_group(name))
    await a.poll(10, 0)
    taken = a.take(len(names))
    a.trained_on(taken)
    return a, _ids(taken)


def test_crash_after_checkpoint_before_ack_recognises_every_redelivery() -> None:
    async def body() -> None:
        streams = MemoryStreams()
        a, trained = await _trained_by_a_crashed_consumer(streams, ["g0", "g1"])
        checkpoint = a.trained.as_list()  # what the checkpoint written before the crash holds
        b = _consumer(streams, "trainer-a")  # the same consumer, restarted
        b.restore(checkpoint)
        await b.start()
        await b.recover()
        assert b.take(1) == [] and b.counters["duplicates_skipped"] == 2
        assert await b.transport.pending() == 0  # acked without training
        assert trained == ["g0", "g1"]

    run(body)


def test_crash_before_checkpoint_replays_the_same_groups_in_order() -> None:
    async def body() -> None:
        streams = MemoryStreams()
        _, trained = await _trained_by_a_crashed_consumer(streams, ["g0", "g1"])
        b = _consumer(streams, "trainer-a")
        b.restore([])  # no checkpoint covers the step: it must run again, on the same groups
        await b.start()
        await b.recover()
        assert _ids(b.take(2)) == trained

    run(body)


def test_a_dead_consumers_groups_are_claimed_once_and_acked_only_after_commit() -> None:
    async def body() -> None:
        streams = MemoryStreams()
        a = _consumer(streams, "trainer-a")
        await a.start()
        await a.transport.publish_group(_group("g0"))
        await a.poll(10, 0)  # delivered to A, which dies holding it
        b = _consumer(streams, "trainer-b", claim_idle_ms=1)
        await b.start()
        await asyncio.sleep(0.01)
        await b.recover()
        assert b.counters["claimed"] == 1
        taken = b.take(1)
        assert _ids(taken) == ["g0"]
        await b.claim()  # B's own pending entry comes back: not a new group, not acked
        assert b.counters["claimed"] == 1 and await b.transport.pending() == 1
        b.trained_on(taken)
        assert await b.transport.pending() == 1  # not acked until the commit
        await b.ack(b.unacked())
        assert await b.transport.pending() == 0

    run(body)


def test_a_running_consumer_claims_what_a_consumer_dying_later_left_pending() -> None:
    """Not only at start-up: B is already polling when A takes a group and dies."""

    async def body() -> None:
        streams = MemoryStreams()
        b = _consumer(streams, "trainer-b", claim_idle_ms=20, claim_every_s=0.01)
        await b.start()
        await b.recover()  # nothing to take back yet
        a = _consumer(streams, "trainer-a")
        await a.transport.publish_group(_group("g0"))
        await a.poll(10, 0)  # A holds g0 and dies
        assert b.take(1) == []
        for _ in range(100):  # B's ordinary polls, as its loop makes them
            await b.poll(10, 0)
            if taken := b.take(1):
                break
            await asyncio.sleep(0.01)
        assert _ids(taken) == ["g0"] and b.counters["claimed"] == 1

    run(body)
