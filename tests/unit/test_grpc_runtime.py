"""The server lifecycle of meridian.grpc_runtime.run_server (NOT_SERVING until the
warm-up returns; on SIGTERM NOT_SERVING, in-flight calls drained, then the service's own
stop), the error boundary's mapping of what a dependency answers and of bidi streams, and
the roles of callers a service adds. The boundary's other cases are in
test_grpc_services, warm-up and later failures in test_container_startup and
test_service_failure."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meridian import errors, grpc_runtime
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


def run_serving(body: Callable[[LifecycleService, str, asyncio.Task[None]], Awaitable[None]], service: LifecycleService, config: ServerConfig, capsys: pytest.CaptureFixture[str]) -> None:
    """Runs ``body`` beside run_server (in one event loop, as `meridian serve` does); a
    server the body left running is stopped as a deployment stops it, with SIGTERM."""
    async def main() -> None:
        server = asyncio.create_task(grpc_runtime.run_server("toy", service, config))
        try:
            await body(service, await _listening(capsys), server)
        finally:
            if not server.done():
                service.warmed.set()
                service.release.set()
                os.kill(os.getpid(), signal.SIGTERM)
                with contextlib.suppress(SystemExit, Exception):
                    await server

    fallback = _sigterm_fallback()
    try:
        run(main())
    finally:
        fallback.cancel()


async def _listening(capsys: pytest.CaptureFixture[str]) -> str:
    """The address run_server announces (it listens on port 0: the OS picks a free one,
    so no other process can take it between choosing and binding)."""
    printed = ""
    while (found := re.search(r"meridian toy listening on (\S+)", printed)) is None:
        printed += capsys.readouterr().out
        await asyncio.sleep(0.01)
    return found.group(1)


async def _is_serving(address: str) -> bool:
    return await check_health(address, auth=None) == "SERVING"


async def _refuses(address: str) -> bool:
    return await check_health(address, auth=None) == "UNREACHABLE"


async def _watch_serving(address: str, channel: grpc.aio.Channel) -> Any:
    """A health Watch on the toy service, once it serves, past its first (SERVING) update."""
    await _until(lambda: _is_serving(address))
    watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=SERVICE))
    assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
    return watch


def test_health_watch_streams_on_a_server_run_server_builds(capsys: pytest.CaptureFixture[str]) -> None:
    """run_server puts OpenTelemetry's interceptor outside the error boundary; grpcio's
    health Watch (a coroutine that writes with context.write) must still stream its
    statuses through it, as gRPC's client-side health checking and watchers expect,
    instead of ending in UNKNOWN with a TypeError."""
    service = LifecycleService()
    service.warmed.set()

    async def body(service: LifecycleService, address: str, server: asyncio.Task[None]) -> None:
        async with grpc.aio.insecure_channel(address) as channel:
            watch = await _watch_serving(address, channel)
            watch.cancel()

    run_serving(body, service, ServerConfig(host="127.0.0.1", port=0, insecure=True, grace_s=1.0), capsys)


def test_health_is_not_serving_until_the_warm_up_returns(capsys: pytest.CaptureFixture[str]) -> None:
    """Load balancers and `meridian up` route traffic on health: a service still loading
    its model must not be sent calls it cannot answer."""
    service = LifecycleService()

    async def body(service: LifecycleService, address: str, server: asyncio.Task[None]) -> None:
        assert await check_health(address, auth=None) == "NOT_SERVING"
        assert await check_health(address, SERVICE, auth=None) == "NOT_SERVING"
        service.warmed.set()
        await _until(lambda: _is_serving(address))
        assert await check_health(address, SERVICE, auth=None) == "SERVING"

    run_serving(body, service, ServerConfig(host="127.0.0.1", port=0, insecure=True, grace_s=1.0), capsys)
    assert service.stopped


class FailingWarmUp(LifecycleService):
    async def start(self) -> None:
        await self.warmed.wait()
        raise RuntimeError("cannot load the model")


def test_a_failed_warm_up_never_reports_serving_and_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    """A service that could not warm up stays NOT_SERVING to the end and exits 1, for its
    supervisor to restart it; it must not take traffic in between."""
    service = FailingWarmUp()
    config = ServerConfig(host="127.0.0.1", port=0, insecure=True, grace_s=0.5)
    statuses: list[int] = []

    async def watch_then_fail_the_warm_up() -> None:
        address = await _listening(capsys)
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
                statuses.append((await watch.read()).status)
                service.warmed.set()
                with contextlib.suppress(grpc.aio.AioRpcError):  # the stream ends with the server
                    while statuses[-1] != health_pb2.HealthCheckResponse.SERVING and (message := await watch.read()) != grpc.aio.EOF:
                        statuses.append(message.status)
        finally:
            service.warmed.set()  # a watch that failed must not leave the warm-up waiting for ever
        if statuses[-1] == health_pb2.HealthCheckResponse.SERVING:
            os.kill(os.getpid(), signal.SIGTERM)  # it serves: stop it, the assertion below says why

    async def main() -> None:
        watcher = asyncio.create_task(watch_then_fail_the_warm_up())
        try:
            await grpc_runtime.run_server("toy", service, config)
        except SystemExit as exc:  # caught in the task: one escaping it left pytest unable to parse a module later (CPython 3.11)
            exits.append(exc.code)
        finally:
            await asyncio.wait({watcher}, timeout=10)

    exits: list[object] = []
    fallback = _sigterm_fallback()
    try:
        run(main())
    finally:
        fallback.cancel()
    assert statuses[:1] == [health_pb2.HealthCheckResponse.NOT_SERVING], statuses
    assert health_pb2.HealthCheckResponse.SERVING not in statuses, statuses
    assert exits == [1] and service.stopped


def test_sigterm_reports_not_serving_drains_calls_then_stops_the_service(capsys: pytest.CaptureFixture[str]) -> None:
    """The order of a shutdown: health watchers hear NOT_SERVING first (so traffic moves
    away), the server stops taking calls, a call already in flight still completes with
    the service's resources intact, and only then does the service's own stop run."""
    service = LifecycleService()
    service.warmed.set()

    async def body(service: LifecycleService, address: str, server: asyncio.Task[None]) -> None:
        async with grpc.aio.insecure_channel(address) as channel:
            watch = await _watch_serving(address, channel)
            slow = asyncio.ensure_future(channel.unary_unary(f"/{SERVICE}/Slow")(b"", timeout=50))
            await service.entered.wait()
            os.kill(os.getpid(), signal.SIGTERM)
            update = await watch.read()
            assert update != grpc.aio.EOF and update.status == health_pb2.HealthCheckResponse.NOT_SERVING
            watch.cancel()  # a watcher that heard it goes away; the drain waits for the rest
            # Released only once the server has refused new calls a few times over: a
            # server that cut its calls short instead of draining them has cut this one
            # by then (no clock involved: each refusal is a round trip through its loop).
            for _ in range(3):
                await _until(lambda: _refuses(address))
            assert not service.stopped
            service.release.set()
            assert await slow == b"done"
        await server

    run_serving(body, service, ServerConfig(host="127.0.0.1", port=0, insecure=True, grace_s=20.0), capsys)
    assert service.stopped


class BrokenFailureCheck(LifecycleService):
    """A service whose failure check itself raises once it serves."""

    async def failure(self) -> str:
        raise RuntimeError("status poll broke")


def test_a_failure_check_that_raises_is_a_failure_with_an_orderly_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    """The check that watches a service's background task can break too: that is a service
    that can no longer tell whether it serves, so it stops as any failed one does (health
    NOT_SERVING, the server stopped, the service's own stop run, exit 1), not with the
    check's exception escaping past the shutdown."""
    service = BrokenFailureCheck()
    service.warmed.set()
    config = ServerConfig(host="127.0.0.1", port=0, insecure=True, grace_s=0.5)
    exits: list[object] = []

    async def main() -> None:
        try:
            await grpc_runtime.run_server("toy", service, config)
        except SystemExit as exc:  # caught in the task: one escaping it left pytest unable to parse a module later (CPython 3.11)
            exits.append(exc.code)

    fallback = _sigterm_fallback()
    try:
        run(main())
    finally:
        fallback.cancel()
    assert exits == [1] and service.stopped
    assert "meridian toy failed: its failure check raised RuntimeError: status poll broke" in capsys.readouterr().out


def test_failure_of_says_why_the_task_ended() -> None:
    """A cancelled background task is a failure like a crashed one: the reason must say so
    rather than the check raising CancelledError, which reads as a plain stop (exit 0)."""
    async def main() -> None:
        async def crash() -> None:
            raise OSError(28, "No space left on device")

        crashed = asyncio.create_task(crash())
        assert await grpc_runtime.failure_of(crashed, "the loop") == "the loop stopped: OSError: [Errno 28] No space left on device"
        cancelled = asyncio.create_task(asyncio.Event().wait())
        await asyncio.sleep(0)
        cancelled.cancel()
        assert await grpc_runtime.failure_of(cancelled, "the loop") == "the loop was cancelled"

    run(main())


# ---------------------------------------------------------------- error boundary


class Upstream:
    """A dependency that answers each method with one status."""

    service_names = ("test.Upstream",)

    def register(self, server: grpc.aio.Server) -> None:
        def failing(exc: Exception) -> Any:
            async def handler(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
                raise exc

            return grpc.unary_unary_rpc_method_handler(handler)

        handlers = {"Full": failing(errors.ResourceExhausted("the upstream is full")), "Bad": failing(errors.InvalidArgument("field x is bad"))}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Upstream", handlers),))

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass


class Front:
    """A service that forwards Call to the upstream's method named in the request, and a
    bidi stream that fails after its first answer."""

    service_names = ("test.Front",)
    secret = "secret-detail-must-not-leak"

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream

    def register(self, server: grpc.aio.Server) -> None:
        async def call(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            async with grpc.aio.insecure_channel(self.upstream) as channel:
                return await channel.unary_unary(f"/test.Upstream/{request.decode()}")(b"", timeout=10)  # type: ignore[no-any-return]

        async def chat(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
            async for request in requests:
                yield request
                raise RuntimeError(self.secret)

        handlers = {"Call": grpc.unary_unary_rpc_method_handler(call), "Chat": grpc.stream_stream_rpc_method_handler(chat)}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Front", handlers),))

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass


async def _code(call: Awaitable[Any]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value.code(), info.value.details() or ""


def test_a_full_dependency_is_resource_exhausted_and_its_other_answers_internal(grpc_serving: Serving) -> None:
    """A dependency's RESOURCE_EXHAUSTED means "retry later" to our caller too, so it is
    passed on; its INVALID_ARGUMENT is about our request to it, not the caller's, so the
    caller must not read it as its own mistake: INTERNAL, with a reference."""
    async def main() -> None:
        async with grpc_serving(Upstream()) as upstream, grpc_serving(Front(upstream)) as front:
            async with grpc.aio.insecure_channel(front) as channel:
                code, details = await _code(channel.unary_unary("/test.Front/Call")(b"Full", timeout=10))
                assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert details.startswith("a service this call depends on answered RESOURCE_EXHAUSTED") and "the upstream is full" in details
                code, details = await _code(channel.unary_unary("/test.Front/Call")(b"Bad", timeout=10))
                assert code == grpc.StatusCode.INTERNAL and "ref=" in details and "field x" not in details

    run(main())


def test_a_bidi_stream_that_raises_is_internal_without_the_exception(grpc_serving: Serving) -> None:
    """grpcio's own answer to an escaping exception is UNKNOWN with the exception's text:
    a stream-stream method must pass the boundary like every other kind."""
    async def main() -> None:
        async with grpc_serving(Front("unused")) as front:
            async with grpc.aio.insecure_channel(front) as channel:
                call = channel.stream_stream("/test.Front/Chat")(iter([b"a", b"b"]), timeout=10)
                got: list[bytes] = []

                async def drain() -> None:
                    async for item in call:
                        got.append(item)

                code, details = await _code(drain())
                assert got == [b"a"]
                assert code == grpc.StatusCode.INTERNAL and "ref=" in details and Front.secret not in details

    run(main())


def test_the_reference_in_an_internal_answer_finds_its_traceback_in_the_log(grpc_serving: Serving, caplog: pytest.LogCaptureFixture) -> None:
    """The caller sees only "internal error (ref=...); see the service log": that reference
    must lead an operator to the one log record holding the exception."""
    async def main() -> str:
        async with grpc_serving(Front("unused")) as front, grpc.aio.insecure_channel(front) as channel:
            call = channel.stream_stream("/test.Front/Chat")(iter([b"a"]), timeout=10)

            async def drain() -> None:
                async for _ in call:
                    pass

            return (await _code(drain()))[1]

    with caplog.at_level(logging.ERROR, logger="meridian.grpc_runtime"):
        details = run(main())
    match = re.search(r"ref=([0-9a-f]{12})", details)
    assert match is not None, details
    [record] = [r for r in caplog.records if match.group(1) in r.getMessage()]
    assert record.exc_info is not None and Front.secret in str(record.exc_info[1])


ERRORS = sorted(
    (obj for obj in vars(errors).values() if isinstance(obj, type) and issubclass(obj, errors.MeridianError) and obj is not errors.MeridianError),
    key=lambda cls: cls.__name__,
)


class Raiser:
    """Raises the meridian.errors class named in the request, with a message of its own."""

    service_names = ("test.Raiser",)

    def register(self, server: grpc.aio.Server) -> None:
        async def raise_named(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            raise getattr(errors, request.decode())(f"{request.decode()} on purpose")

        handlers = {"Raise": grpc.unary_unary_rpc_method_handler(raise_named)}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Raiser", handlers),))

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass


def test_each_meridian_error_answers_the_status_its_name_says(grpc_serving: Serving) -> None:
    """Callers act on the code (retry on UNAVAILABLE or ABORTED, give up on
    INVALID_ARGUMENT, re-authenticate on UNAUTHENTICATED): every error class must reach
    them as the gRPC status it is named after, with its message."""
    assert len(ERRORS) >= 10

    async def main() -> None:
        async with grpc_serving(Raiser()) as address, grpc.aio.insecure_channel(address) as channel:
            for cls in ERRORS:
                want = re.sub(r"(?<!^)(?=[A-Z])", "_", cls.__name__).upper()  # DeadlineExceeded -> DEADLINE_EXCEEDED
                code, details = await _code(channel.unary_unary("/test.Raiser/Raise")(cls.__name__.encode(), timeout=10))
                assert (code.name, details) == (want, f"{cls.__name__} on purpose"), cls

    run(main())


# ---------------------------------------------------------------- callers a service adds


class RolloutLike:
    """Two rollout methods (RunEpisodes: the operator's alone; Status: production's too)
    and callers of the service's own, as rollout adds its API keys' holders."""

    service_names = ("meridian.v1.Rollout",)

    def __init__(self, caller_roles: dict[str, str]) -> None:
        self.caller_roles = caller_roles

    def register(self, server: grpc.aio.Server) -> None:
        async def reached(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            return b"reached"

        handlers = {name: grpc.unary_unary_rpc_method_handler(reached) for name in ("RunEpisodes", "Status")}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("meridian.v1.Rollout", handlers),))

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass


def test_a_services_own_callers_cannot_change_a_deployment_tokens_role(grpc_serving: Serving, credentials_dir: Path) -> None:
    """`meridian certs` lists the operator's token among rollout's production API keys
    (api-keys.json), so rollout's callers map it to production: the deployment's role
    for the same token must win, or the operator could no longer start episodes."""
    from meridian import access, credentials

    tokens = credentials.load_tokens(credentials_dir)
    service = RolloutLike({access.token_digest(tokens["operator"]): "production", access.token_digest("batch-eval-key"): "production"})
    ca, cert, key = credentials.client_pem(credentials_dir)
    tls = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    async def main() -> None:
        async with grpc_serving(service, secure=("rollout", credentials_dir)) as address, grpc.aio.secure_channel(address, tls) as channel:
            async def call(method: str, token: str) -> grpc.StatusCode:
                try:
                    await channel.unary_unary(f"/meridian.v1.Rollout/{method}")(b"", metadata=(("authorization", f"Bearer {token}"),), timeout=10)
                except grpc.aio.AioRpcError as exc:
                    return exc.code()
                return grpc.StatusCode.OK

            assert await call("RunEpisodes", tokens["operator"]) == grpc.StatusCode.OK
            assert await call("Status", "batch-eval-key") == grpc.StatusCode.OK  # the service's own caller
            assert await call("RunEpisodes", "batch-eval-key") == grpc.StatusCode.PERMISSION_DENIED

    run(main())


# ---------------------------------------------------------------- plaintext clients


@pytest.mark.parametrize("address", ["127.0.0.1:5", "[::1]:5", "localhost:5", "dns:///localhost:5", "ipv6:///[::1]:5"])
def test_plaintext_goes_to_every_spelling_of_loopback(address: str) -> None:
    """A local stack without credentials is reached by whatever target form the caller
    uses (gRPC resolver prefixes, IPv6 in brackets)."""
    async def main() -> None:
        await grpc_runtime.open_channel(address, auth=None).close()

    run(main())


@pytest.mark.parametrize("address", ["10.0.0.7:5", "dns:///10.0.0.7:5", "[2001:db8::1]:5", "meridian.internal:5", "dns:///localhost.example.com:5"])
def test_plaintext_is_refused_to_anything_else(address: str) -> None:
    with pytest.raises(ValueError, match="only loopback"):
        grpc_runtime.open_channel(address, auth=None)
