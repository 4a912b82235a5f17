"""The Publish memory budget (max_publish_total_gib) counts tensors for as long as the
origin holds them: a publisher that goes away mid-store (a killed trainer, a timed-out
rank) leaves its store step running on with its tensors, so its reservation stays until
that step ends, and a retry cannot reserve a second copy beside them."""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from meridian.tensors import RawTensor
from meridian.v1 import weightsync_pb2 as pb
from meridian.v1 import weightsync_pb2_grpc as pb_grpc
from services.weightsync import client as weightsync
from services.weightsync import parts
from services.weightsync.config import WeightSyncConfig
from services.weightsync.server import WeightSyncService
from tests.conftest import serving

Weights = dict[str, RawTensor]


def _weights(seed: int) -> Weights:
    rng = np.random.default_rng(seed)
    return {f"t{i}": RawTensor("bf16", (32, 32), rng.integers(0x3C00, 0x3F00, size=32 * 32, dtype=np.uint16)) for i in range(4)}


def _nbytes(weights: Weights) -> int:
    return sum(t.nbytes for t in weights.values())


class Gate:
    """Makes a store method wait, on its thread, until the test opens the gate."""

    def __init__(self) -> None:
        self.entered, self.opened = threading.Event(), threading.Event()

    def wrap(self, method: Callable[..., Any]) -> Callable[..., Any]:
        def slow(*args: Any, **kw: Any) -> Any:
            self.entered.set()
            assert self.opened.wait(20), "the test never opened the gate"
            return method(*args, **kw)

        return slow


async def _publish_raw(address: str, header: pb.PublishHeader, weights: Weights) -> pb.PublishResponse:
    """One Publish stream on a bare channel, whose call a cancellation cuts at once (like
    a publisher that is killed): the client's instrumented channel lets the call run on."""
    async with grpc.aio.insecure_channel(address) as channel:
        return await pb_grpc.WeightSyncStub(channel).Publish(weightsync.publish_requests(header.version, weights, header=header))


async def _until(condition: Callable[[], bool]) -> None:
    async with asyncio.timeout(10):
        while not condition():
            await asyncio.sleep(0.02)


async def _cancel_mid_store(service: WeightSyncService, gate: Gate, publishers: list[asyncio.Task[Any]], declared: int) -> None:
    """Waits for the store step, cancels every publisher, and checks that the reservation
    stays until the store step ends and is then returned in full."""
    budget = service.publish_budget
    try:
        assert await asyncio.to_thread(gate.entered.wait, 10), "the store step never started"
        assert budget.in_flight == declared
        for task in publishers:
            task.cancel()
        await asyncio.gather(*publishers, return_exceptions=True)
        await asyncio.sleep(0.5)  # the handlers see their cancellation (ms on loopback)
        assert budget.in_flight == declared, "returned while the store step still holds the tensors"
    finally:
        gate.opened.set()
    await _until(lambda: service.store.latest == 0)
    await _until(lambda: budget.in_flight == 0)


def test_a_publisher_cancelled_mid_store_keeps_its_reservation_until_the_store_ends(tmp_path: Path) -> None:
    weights = _weights(0)

    async def body() -> None:
        service = WeightSyncService(WeightSyncConfig(role="origin", data_dir=str(tmp_path), chunk_mb=0.002))
        gate = Gate()
        service.store.publish = gate.wrap(service.store.publish)  # type: ignore[method-assign]
        async with serving(service) as address:
            publisher = asyncio.create_task(_publish_raw(address, weightsync.publish_header(0, weights), weights))
            await _cancel_mid_store(service, gate, [publisher], _nbytes(weights))

    asyncio.run(body())


def test_sharded_parts_cancelled_mid_store_keep_their_reservations_until_the_store_ends(tmp_path: Path) -> None:
    weights = _weights(1)

    async def body() -> None:
        service = WeightSyncService(WeightSyncConfig(role="origin", data_dir=str(tmp_path), chunk_mb=0.002))
        gate = Gate()
        service.store.publish_assembled = gate.wrap(service.store.publish_assembled)  # type: ignore[method-assign]
        names = parts.partition({n: t.nbytes for n, t in weights.items()}, 2)
        digests = parts.tensor_digests(weights)
        header = weightsync.version_header_from_digests(0, digests, {}, {}, None, None)
        async with serving(service) as address:
            split = [{n: weights[n] for n in names[i]} for i in range(2)]
            publishers = [asyncio.create_task(_publish_raw(address, parts.part_header(header, i, 2, split[i]), split[i])) for i in range(2)]
            await _cancel_mid_store(service, gate, publishers, _nbytes(weights))

    asyncio.run(body())
