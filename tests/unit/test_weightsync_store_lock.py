"""The origin's store lock covers a store thread from its start to its end, even when the
call that started it goes away meanwhile: a Subscribe whose client leaves while its plan
(a compacted delta or keyframe being built) runs on a thread must not let a Publish write
the store beside that thread."""
from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np

from meridian.grpc_runtime import open_channel
from meridian.tensors import RawTensor
from meridian.v1 import weightsync_pb2 as pb
from meridian.v1 import weightsync_pb2_grpc as pb_grpc
from services.weightsync import client as weightsync
from services.weightsync.config import WeightSyncConfig
from services.weightsync.server import WeightSyncService
from tests.conftest import serving

#: Bounds every wait, so that a broken origin fails the test instead of hanging it.
WAIT_S = 30.0


def _weights(seed: int) -> dict[str, RawTensor]:
    rng = np.random.default_rng(seed)
    return {"w": RawTensor("bf16", (64, 32), rng.integers(0x3C00, 0x3F00, size=64 * 32, dtype=np.uint16))}


def _config(root: Path) -> WeightSyncConfig:
    return WeightSyncConfig(role="origin", data_dir=str(root), chunk_mb=0.002)


class _BlockingPlan:
    """Wraps ``store.plan_compacted``: the first call blocks on its thread until released,
    and every ``store.publish`` notes whether such a plan was running beside it."""

    def __init__(self, service: WeightSyncService) -> None:
        self.planning = threading.Event()
        self.release = threading.Event()
        self.overlaps: list[int] = []
        self._running = False
        self._plan, self._publish = service.store.plan_compacted, service.store.publish
        service.store.plan_compacted = self.plan  # type: ignore[method-assign]
        service.store.publish = self.publish  # type: ignore[method-assign]

    def plan(self, held: int) -> Any:
        self._running = True
        self.planning.set()
        try:
            self.release.wait(WAIT_S)
            return self._plan(held)
        finally:
            self._running = False

    def publish(self, version: int, *args: Any, **kw: Any) -> Any:
        if self._running:
            self.overlaps.append(version)
        return self._publish(version, *args, **kw)


def _watch_subscribe_ends(service: WeightSyncService) -> asyncio.Event:
    """An event set once each Subscribe handler has ended (set before ``register``)."""
    ended = asyncio.Event()
    subscribe = service.Subscribe

    async def watched(request: pb.SubscribeRequest, context: Any) -> AsyncIterator[Any]:
        try:
            async for item in subscribe(request, context):
                yield item
        finally:
            ended.set()

    service.Subscribe = watched  # type: ignore[method-assign]
    return ended


def test_a_subscriber_leaving_mid_plan_keeps_the_store_locked_until_the_plan_thread_ends(tmp_path: Path) -> None:
    async def body() -> None:
        service = WeightSyncService(_config(tmp_path / "o"))
        ended = _watch_subscribe_ends(service)
        async with serving(service) as address:
            await weightsync.publish(address, 0, _weights(0))
            blocking = _BlockingPlan(service)
            try:
                async with open_channel(address) as channel:
                    call = pb_grpc.WeightSyncStub(channel).Subscribe(pb.SubscribeRequest(from_version=-1))
                    assert await asyncio.to_thread(blocking.planning.wait, WAIT_S), "the Subscribe never planned"
                    call.cancel()
                    await asyncio.wait_for(ended.wait(), WAIT_S)
                # The handler is gone, its plan thread is not: the store stays locked.
                assert service._store_lock.locked(), "the store lock was released while the plan thread still reads the store"
                publishing = asyncio.create_task(weightsync.publish(address, 1, _weights(1)))
                await asyncio.sleep(0)
            finally:
                blocking.release.set()  # a failed check must not leave the thread blocked
            reply = await asyncio.wait_for(publishing, WAIT_S)
            assert reply.version == 1 and blocking.overlaps == []
            assert not service._store_lock.locked()

    asyncio.run(body())
