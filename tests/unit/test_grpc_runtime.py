"""The server that meridian.grpc_runtime.run_server builds, as `meridian serve` runs it."""
from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meridian import grpc_runtime
from meridian.grpc_runtime import ServerConfig, check_health

T = TypeVar("T")
Serving = Callable[..., Any]
SERVICE = "test.Lifecycle"


def run(coro: Awaitable[T]) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coro, 60.0)

    return asyncio.run(bounded())


async def _until(probe: Callable[[], Awaitable[bool]]) -> None:
    """Polls ``probe`` until it holds (the caller's wait_for bounds the wait)."""
    while not await probe():
        await asyncio.sleep(0.02)


class LifecycleService:
    """A service whose warm-up and one call (Slow) wait for the test to release them."""

    service_names = (SERVICE,)

    def __init__(self) -> None:
        self.warmed = asyncio.Event()
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        self.stopped = False

    def register(self, server: grpc.aio.Server) -> None:
        async def slow(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            self.entered.set()
            await self.release.wait()
            # What a handler needs (an engine, a store) is still there: stop() has not run.
            return b"stopped too early" if self.stopped else b"done"

        handlers = {"Slow": grpc.unary_unary_rpc_method_handler(slow)}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))

    async def start(self) -> None:
        await self.warmed.wait()

    async def stop(self) -> None:
        self.stopped = True


def _sigterm_fallback() -> threading.Timer:
    """Should run_server never act on the test's own SIGTERM, this one (much later) still
    ends it, so the test fails instead of hanging."""
    timer = threading.Timer(50, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    return timer


async def _is_serving(address: str) -> bool:
    return await check_health(address, auth=None) == "SERVING"


def test_health_watch_streams_on_a_server_run_server_builds(pick_port: Callable[[], int]) -> None:
    """run_server puts OpenTelemetry's interceptor outside the error boundary; grpcio's
    health Watch (a coroutine that writes with context.write) must still stream its
    statuses through it, as gRPC's client-side health checking and watchers expect,
    instead of ending in UNKNOWN with a TypeError."""
    service = LifecycleService()
    service.warmed.set()
    config = ServerConfig(host="127.0.0.1", port=pick_port(), insecure=True, grace_s=1.0)
    address = f"127.0.0.1:{config.port}"

    async def main() -> None:
        server = asyncio.create_task(grpc_runtime.run_server("toy", service, config))
        await _until(lambda: _is_serving(address))
        async with grpc.aio.insecure_channel(address) as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=SERVICE))
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            watch.cancel()
        os.kill(os.getpid(), signal.SIGTERM)
        await server

    fallback = _sigterm_fallback()
    try:
        run(main())
    finally:
        fallback.cancel()
