"""The rollout's publish outbox: groups sampled while the trajectory stream is down are
held in order and published once it answers, over the in-memory twin and over a real
redis-server stopped and started again."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any, TypeVar

import pytest

from meridian.errors import Unavailable
from meridian.trajectory_transport import GroupTransport, InMemoryGroupTransport, MemoryStreams, RedisGroupTransport, TransportConfig, decode_entry
from meridian.v1 import common_pb2
from services.rollout.publish_outbox import Group, PublishOutbox

T = TypeVar("T")
STREAM = "test:outbox"


def run(coro: Awaitable[T]) -> T:
    return asyncio.run(coro)  # type: ignore[arg-type]


def _group(g: int, size: int = 2) -> Group:
    return [
        common_pb2.Trajectory(
            trajectory_id=f"traj-{g}-{k}", task_id="python/add", group_id=f"group-{g}", group_size=size,
            prompt_token_ids=[1], completion_token_ids=[2], logprobs=[-0.5], loss_mask=[1], policy_versions=[0],
        )
        for k in range(size)
    ]


class Outage:
    """A transport whose stream answers only while ``up`` (what a restarting Redis does
    through RedisGroupTransport); ``block`` holds sends until set."""

    def __init__(self, transport: GroupTransport) -> None:
        self.transport = transport
        self.up = True
        self.block: asyncio.Event | None = None
        self.sent: list[str] = []

    async def send(self, group: Group) -> None:
        if self.block is not None:
            await self.block.wait()
        if not self.up:
            raise Unavailable(f"trajectory stream {STREAM!r}: Redis at 127.0.0.1:1 is unreachable or restarting; retry later")
        await self.transport.publish_group(group)
        self.sent.append(group[0].group_id)


def _memory() -> tuple[Outage, MemoryStreams]:
    streams = MemoryStreams()
    return Outage(InMemoryGroupTransport(TransportConfig(url="memory://", stream=STREAM), streams)), streams


def _stream_ids(streams: MemoryStreams) -> list[str]:
    return [decode_entry(eid, f).group.group_id for eid, f in streams.entries.get(STREAM, [])]


def test_groups_refused_by_a_down_stream_are_held_and_published_first_in_order() -> None:
    async def body() -> None:
        link, streams = _memory()
        outbox = PublishOutbox(link.send)
        await outbox.publish([_group(0)])
        link.up = False
        with pytest.raises(Unavailable, match="2 sampled groups are held"):
            await outbox.publish([_group(1), _group(2)])
        with pytest.raises(Unavailable, match="3 sampled groups are held"):
            await outbox.publish([_group(3)])
        with pytest.raises(Unavailable):
            await outbox.flush()
        assert outbox.held == 3 and outbox.held_ids() == ["group-1", "group-2", "group-3"]
        link.up = True
        await outbox.publish([_group(4)])
        assert outbox.held == 0 and outbox.published == 5
        assert _stream_ids(streams) == [f"group-{g}" for g in range(5)]

    run(body())


def test_the_retry_loop_publishes_held_groups_once_the_stream_answers() -> None:
    """... and each group's caller hears when it landed (what the RL workers count)."""

    async def body() -> None:
        link, streams = _memory()
        outbox = PublishOutbox(link.send, retry_s=0.01)
        landed: list[str] = []
        outbox.start()
        try:
            await outbox.publish([_group(0)], landed=lambda g: landed.append(g[0].group_id))
            link.up = False
            with pytest.raises(Unavailable):
                await outbox.publish([_group(1), _group(2)], landed=lambda g: landed.append(g[0].group_id))
            await asyncio.sleep(0.05)
            assert outbox.held == 2 and _stream_ids(streams) == ["group-0"] and landed == ["group-0"]
            link.up = True
            async with asyncio.timeout(5):
                while outbox.held:
                    await asyncio.sleep(0.01)
            assert _stream_ids(streams) == ["group-0", "group-1", "group-2"] == landed
        finally:
            await outbox.stop()

    run(body())


def test_a_group_the_stream_cannot_take_is_refused_not_held() -> None:
    """Any error but Unavailable is the group's own (here: an incomplete group): holding it
    would fail every retry and block every group behind it."""

    async def body() -> None:
        link, streams = _memory()
        outbox = PublishOutbox(link.send)
        with pytest.raises(ValueError, match="not a complete group"):
            await outbox.publish([_group(0)[:1]])
        assert outbox.held == 0
        await outbox.publish([_group(1)])
        assert _stream_ids(streams) == ["group-1"]

    run(body())


def test_an_empty_group_is_neither_held_nor_sent() -> None:
    """An episode batch may yield no trajectories for a group: nothing to publish, and
    nothing to hold in front of the real groups during an outage."""

    async def body() -> None:
        link, streams = _memory()
        outbox = PublishOutbox(link.send)
        link.up = False
        with pytest.raises(Unavailable, match="1 sampled groups are held"):
            await outbox.publish([[], _group(0)])
        assert outbox.held == 1
        link.up = True
        await outbox.flush()
        assert link.sent == ["group-0"] and _stream_ids(streams) == ["group-0"]

    run(body())


def test_the_retry_loop_drops_a_held_group_the_stream_refuses_and_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    """A held group that fails for a reason of its own once the stream is back is dropped
    (and logged); the retries go on, so the groups behind it still land."""

    async def body() -> None:
        link, streams = _memory()
        outbox = PublishOutbox(link.send, retry_s=0.01)
        outbox.start()
        try:
            link.up = False
            with pytest.raises(Unavailable):
                await outbox.publish([_group(0)[:1], _group(1)])  # group 0 is incomplete
            link.up = True
            async with asyncio.timeout(5):
                while outbox.held:
                    await asyncio.sleep(0.01)
            assert _stream_ids(streams) == ["group-1"]
        finally:
            await outbox.stop()

    with caplog.at_level(logging.ERROR, logger="services.rollout.publish_outbox"):
        run(body())
    assert "a held group could not be published; dropped" in caplog.text


def test_a_publish_cancelled_mid_send_keeps_its_groups() -> None:
    """A caller whose deadline passes while its group is being sent does not take the
    group with it."""

    async def body() -> None:
        link, streams = _memory()
        outbox = PublishOutbox(link.send)
        link.block = asyncio.Event()
        task = asyncio.create_task(outbox.publish([_group(0)]))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert outbox.held_ids() == ["group-0"]
        link.block.set()
        await outbox.flush()
        assert _stream_ids(streams) == ["group-0"]

    run(body())


def test_stopping_with_held_groups_tries_once_more_then_names_what_is_lost(caplog: pytest.LogCaptureFixture) -> None:
    async def body() -> PublishOutbox:
        link, _ = _memory()
        outbox = PublishOutbox(link.send, retry_s=0.05)
        outbox.start()
        link.up = False
        with pytest.raises(Unavailable):
            await outbox.publish([_group(7)])
        await outbox.stop()
        return outbox

    with caplog.at_level(logging.ERROR, logger="services.rollout.publish_outbox"):
        outbox = run(body())
    assert outbox.held == 1
    assert "1 sampled groups never published" in caplog.text and "group-7" in caplog.text


def test_groups_sampled_during_a_redis_restart_reach_the_stream(restartable_redis: Any) -> None:
    """Over a real redis-server: stopped, a publish answers Unavailable and holds the
    group; started again (empty, same port), the retry loop publishes it whole."""

    async def body() -> None:
        transport = RedisGroupTransport(TransportConfig(url=restartable_redis.url, stream=STREAM))
        outbox = PublishOutbox(transport.publish_group, retry_s=0.05)  # type: ignore[arg-type]
        outbox.start()
        try:
            restartable_redis.stop()
            with pytest.raises(Unavailable, match=f"127.0.0.1:{restartable_redis.port}.*1 sampled groups are held"):
                await outbox.publish([_group(0)])
            restartable_redis.start()
            async with asyncio.timeout(20):
                while outbox.held:
                    await asyncio.sleep(0.05)
            entries = [decode_entry(eid, fields) for eid, fields in await transport.redis.xrange(STREAM)]
            assert [e.group.group_id for e in entries] == ["group-0"]
            assert [t.trajectory_id for t in entries[0].group.trajectories] == ["traj-0-0", "traj-0-1"]
        finally:
            await outbox.stop()
            await transport.close()

    run(body())
