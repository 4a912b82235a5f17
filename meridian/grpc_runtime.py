"""gRPC bootstrap shared by every service: server lifecycle, the error boundary and
client channels.

Lifecycle (same for every service): bind, register health (NOT_SERVING) and
reflection, start accepting, run the service's warm-up, and only then report
SERVING. On SIGTERM/SIGINT: report NOT_SERVING, stop accepting and drain in-flight
calls for ``grace_s``, then close the service's own resources, bounded in time.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import inspect
import logging
import os
import signal
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from meridian import access, credentials, errors, telemetry
from meridian import metrics
from meridian.config import opt

log = logging.getLogger(__name__)

MiB = 1024 * 1024

#: Calls beyond ``max_concurrent_rpcs`` that only health and reflection may use: gRPC's
#: own limit is set this far above ours, so a server full of work still answers probes.
RESERVED_RPCS = 64
#: Methods no call limit applies to (probes must answer while the server is full).
UNLIMITED_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
#: The streaming ones among them (they need no token): at most PROBE_STREAMS open at
#: once, so open streams cannot take the whole reserve and leave no room for a Check.
PROBE_STREAM_PREFIXES = ("/grpc.health.v1.Health/Watch", "/grpc.reflection.")
PROBE_STREAMS = RESERVED_RPCS // 2


@dataclasses.dataclass
class ServerConfig:
    """Settings every gRPC server shares."""

    host: str = opt("127.0.0.1", "address to listen on")
    port: int = opt(0, "port to listen on (0 picks a free one and prints it)")
    grace_s: float = opt(10.0, "seconds to drain in-flight calls on shutdown")
    max_message_mb: int = opt(64, "largest request or response message, MiB (larger ones answer RESOURCE_EXHAUSTED)")
    max_concurrent_rpcs: int = opt(1024, "calls in flight at once, open streams included (health and reflection apart); more answer RESOURCE_EXHAUSTED")
    metrics_port: int = opt(-1, "Prometheus metrics endpoint port (0: a free port, printed; -1: off); see meridian/metrics.py")
    metrics_host: str = opt("127.0.0.1", "metrics endpoint address; a non-loopback one is refused unless served with TLS")
    metrics_tls_cert: str = opt("", "PEM certificate of the metrics endpoint (with metrics_tls_key: HTTPS)")
    metrics_tls_key: str = opt("", "PEM private key of the metrics endpoint")
    metrics_region: str = opt("", "region label on this service's metrics (empty: the service's own --region where it has one, else 'local')")
    credentials: str = opt("", "credentials folder made by `meridian certs` (mTLS certificates, tokens); empty: the one MERIDIAN_CREDENTIALS names")
    insecure: bool = opt(False, "plaintext without tokens, for local experiments only: refused on any address but loopback")

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.grace_s < 0 or self.max_message_mb <= 0:
            raise ValueError("grace_s must be >= 0 and max_message_mb > 0")
        if self.max_concurrent_rpcs < 1:
            raise ValueError(f"max_concurrent_rpcs must be >= 1, got {self.max_concurrent_rpcs}")
        metrics.check_endpoint(self.metrics_host, self.metrics_port, self.metrics_tls_cert, self.metrics_tls_key)
        if self.insecure and not credentials.is_loopback(self.host):
            raise ValueError(f"insecure (plaintext) serving is refused on {self.host}: only loopback addresses may go without TLS")

    def credentials_folder(self) -> Path | None:
        """The credentials this server uses (None: insecure); raises when neither is set."""
        if self.insecure:
            return None
        folder = Path(self.credentials) if self.credentials else credentials.folder_from_env()
        if folder is None:
            raise ValueError(
                "no credentials: pass --credentials DIR or set MERIDIAN_CREDENTIALS (make them with `meridian certs --out DIR`), "
                "or --insecure true on a loopback address"
            )
        return folder


class Service(Protocol):
    """What a service hands to :func:`serve`.

    A service may also define ``call_limits``, a mapping of full method names
    (``/meridian.v1.WeightSync/Subscribe``) to :class:`CallLimit`: how many calls of
    that method may be in flight at once (read once, when the server is built); and
    ``async def failure(self) -> str``, which returns (why) once the service can no
    longer serve after its warm-up (a background task it depends on died): the server
    then reports NOT_SERVING, shuts down in order and exits 1, for a supervisor to
    restart it, instead of answering with a broken service.
    """

    #: fully qualified gRPC service names, for health and reflection
    service_names: Sequence[str]

    def register(self, server: grpc.aio.Server) -> None: ...

    async def start(self) -> None:
        """Warm-up; the service reports SERVING only after it returns."""

    async def stop(self) -> None:
        """Releases the service's resources after the server stopped accepting calls."""


def channel_options(max_message_mb: int = 64) -> list[tuple[str, Any]]:
    size = max_message_mb * MiB
    return [
        ("grpc.max_send_message_length", size),
        ("grpc.max_receive_message_length", size),
    ]


# ---------------------------------------------------------------- error boundary


#: A dependency's answers that mean the same to our caller (retry later), passed on as they are.
_PASSED_ON = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})


def _status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, errors.MeridianError):
        return grpc.StatusCode[exc.status], str(exc)
    if isinstance(exc, grpc.aio.AioRpcError) and exc.code() in _PASSED_ON:
        # A service this call needs (envsandbox behind rollout, the origin behind a relay) is
        # down, restarting or full: the caller may retry later, so it must not read INTERNAL.
        return exc.code(), f"a service this call depends on answered {exc.code().name}: {exc.details()}"
    ref = uuid.uuid4().hex[:12]
    log.exception("unhandled error (ref=%s)", ref, exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error (ref={ref}); see the service log"


@dataclasses.dataclass(frozen=True)
class CallLimit:
    """At most ``calls`` calls of one method in flight; ``setting`` is the config field
    that sets it, named in the refusal so an operator knows what to raise."""

    calls: int
    setting: str


class CallLimits:
    """Counts calls in flight, in total and per limited method, and refuses the one over
    a limit with RESOURCE_EXHAUSTED before the handler runs. Health and reflection are
    not counted against those: a server busy to its limit must still answer its probes;
    their streams (which need no token) have a cap of their own, within the reserve. One
    event loop runs every handler, so plain counters suffice."""

    def __init__(self, total: int, per_method: Mapping[str, CallLimit] | None = None) -> None:
        self.total = total
        self.per_method = dict(per_method or {})
        self.active = 0
        self.by_method: collections.Counter[str] = collections.Counter()
        self.probe_streams = 0

    @contextlib.contextmanager
    def hold(self, method: str) -> Iterator[None]:
        if method.startswith(PROBE_STREAM_PREFIXES):
            if self.probe_streams >= PROBE_STREAMS:
                raise errors.ResourceExhausted(f"{self.probe_streams} health watch or reflection streams are open, this server's limit; retry later")
            self.probe_streams += 1
            try:
                yield
            finally:
                self.probe_streams -= 1
            return
        if method.startswith(UNLIMITED_PREFIXES):
            yield
            return
        if self.active >= self.total:
            raise errors.ResourceExhausted(f"{self.active} calls are in flight, this server's limit (max_concurrent_rpcs={self.total}); retry later")
        limit = self.per_method.get(method)
        if limit is not None and self.by_method[method] >= limit.calls:
            name = method.rsplit("/", 1)[-1]
            raise errors.ResourceExhausted(f"{self.by_method[method]} {name} calls are in flight, this server's limit ({limit.setting}={limit.calls}); retry later")
        self.active += 1
        self.by_method[method] += 1
        try:
            yield
        finally:
            self.active -= 1
            self.by_method[method] -= 1


class _Malformed:
    """What the lenient deserializer hands on in place of a request it could not parse."""

    def __init__(self, type_name: str) -> None:
        self.message = f"malformed request: the bytes are not a valid {type_name} message"


def _lenient(deserialize: Callable[[bytes], Any], method: str) -> Callable[[bytes], Any]:
    """Wraps a request deserializer so that bad bytes reach the boundary as a value.

    grpc.aio parses a request outside the handler: a parse error of a unary request
    answers UNKNOWN with the parser's own text, and one of a streamed request surfaces
    in the middle of the handler. Returning a marker instead lets the boundary answer
    INVALID_ARGUMENT with a short message of its own, the parser's details only logged."""
    owner = getattr(deserialize, "__self__", None)
    descriptor = getattr(owner, "DESCRIPTOR", None)
    type_name = getattr(descriptor, "full_name", "request")

    def parse(raw: bytes) -> Any:
        try:
            return deserialize(raw)
        except Exception as exc:  # noqa: BLE001 - any parse failure is the caller's bad bytes
            log.info("%s: malformed %s (%d bytes): %s", method, type_name, len(raw), exc)
            return _Malformed(type_name)

    return parse


def _checked(request: Any) -> Any:
    if isinstance(request, _Malformed):
        raise errors.InvalidArgument(request.message)
    return request


async def _checked_stream(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for request in requests:
        yield _checked(request)


def _wrap_unary(fn: Callable[..., Awaitable[Any]], hold: Callable[[], contextlib.AbstractContextManager[None]], streamed: bool) -> Callable[..., Awaitable[Any]]:
    async def handler(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            with hold():
                request = _checked_stream(request_or_iterator) if streamed else _checked(request_or_iterator)
                return await fn(request, context)
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as exc:  # noqa: BLE001 - this is the boundary
            code, message = _status_of(exc)
            await context.abort(code, message)

    return handler


def _wrap_stream(fn: Callable[..., Any], hold: Callable[[], contextlib.AbstractContextManager[None]], streamed: bool) -> Callable[..., Any]:
    if not inspect.isasyncgenfunction(fn):
        # A streaming handler that writes with context.write (grpcio's own health Watch
        # does) is a coroutine: wrapped as one, or every call would end in a TypeError.
        return _wrap_unary(fn, hold, streamed)

    async def handler(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            with hold():
                request = _checked_stream(request_or_iterator) if streamed else _checked(request_or_iterator)
                async for item in fn(request, context):
                    yield item
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as exc:  # noqa: BLE001 - this is the boundary
            code, message = _status_of(exc)
            await context.abort(code, message)

    return handler


class ErrorBoundary(grpc.aio.ServerInterceptor):
    """The one place where a call meets its bounds and its errors: malformed request
    bytes answer INVALID_ARGUMENT, a call over a :class:`CallLimits` limit answers
    RESOURCE_EXHAUSTED, and exceptions escaping any handler become a gRPC status."""

    def __init__(self, limits: CallLimits | None = None) -> None:
        self.limits = limits

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        limits = self.limits
        hold = (lambda: limits.hold(method)) if limits is not None else contextlib.nullcontext
        streamed = bool(handler.request_streaming)
        if handler.request_deserializer is not None:
            handler = handler._replace(request_deserializer=_lenient(handler.request_deserializer, method))
        if handler.unary_unary:
            return handler._replace(unary_unary=_wrap_unary(handler.unary_unary, hold, streamed))
        if handler.stream_unary:
            return handler._replace(stream_unary=_wrap_unary(handler.stream_unary, hold, streamed))
        if handler.unary_stream:
            return handler._replace(unary_stream=_wrap_stream(handler.unary_stream, hold, streamed))
        if handler.stream_stream:
            return handler._replace(stream_stream=_wrap_stream(handler.stream_stream, hold, streamed))
        return handler


# ---------------------------------------------------------------- authentication


def _refuser(code: grpc.StatusCode, message: str, stream_response: bool) -> Callable[..., Any]:
    """A handler that answers ``code`` before reading a request or running anything."""
    if stream_response:

        async def refuse_stream(_request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            await context.abort(code, message)
            yield  # pragma: no cover - makes this an async generator

        return refuse_stream

    async def refuse(_request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, message)

    return refuse


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Maps each call's bearer token to a role and refuses a call its role may not make
    (:func:`meridian.access.decide`): a missing or unknown token answers UNAUTHENTICATED,
    a known one without the method PERMISSION_DENIED, before the handler or the error
    boundary runs. Health and reflection pass without a token."""

    def __init__(self, digest_roles: Mapping[str, str]) -> None:
        self.digest_roles = dict(digest_roles)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method
        values = [v for k, v in (handler_call_details.invocation_metadata or ()) if k == "authorization"]
        refusal = access.decide(method, [v.decode() if isinstance(v, bytes) else v for v in values], self.digest_roles)
        handler = await continuation(handler_call_details)
        if refusal is None or handler is None:
            return handler
        log.info("refused %s: %s", method, refusal.message)
        refuse = _refuser(grpc.StatusCode[refusal.code], refusal.message, bool(handler.response_streaming))
        kind = ("stream_" if handler.request_streaming else "unary_") + ("stream" if handler.response_streaming else "unary")
        return handler._replace(**{kind: refuse})


# ---------------------------------------------------------------- server


def create_server(
    service: Service,
    config: ServerConfig,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    options: Sequence[tuple[str, Any]] | None = None,
    digest_roles: Mapping[str, str] | None = None,
) -> grpc.aio.Server:
    """A grpc.aio server with the error boundary innermost and the call limits of
    ``config`` and ``service.call_limits``; ``options`` default to the message size of
    ``config``. gRPC's own limit sits :data:`RESERVED_RPCS` above ours, as a backstop
    that leaves room for health checks. With ``digest_roles`` (token digest -> role, see
    :func:`meridian.access.token_digest`) every call passes the :class:`AuthInterceptor`
    just outside the error boundary; a service may add callers of its own as
    ``caller_roles`` (token digest -> role, read once, here)."""
    limits = CallLimits(config.max_concurrent_rpcs, getattr(service, "call_limits", None))
    auth = [] if digest_roles is None else [AuthInterceptor({**getattr(service, "caller_roles", {}), **digest_roles})]
    return grpc.aio.server(
        interceptors=[*interceptors, *auth, ErrorBoundary(limits)],
        options=list(channel_options(config.max_message_mb) if options is None else options),
        maximum_concurrent_rpcs=config.max_concurrent_rpcs + RESERVED_RPCS,
    )


async def run_server(name: str, service: Service, config: ServerConfig) -> None:
    """Runs ``service`` until SIGTERM/SIGINT, with the lifecycle in the module docstring."""
    folder = config.credentials_folder()
    server = create_server(service, config, telemetry.server_interceptors(), digest_roles=None if folder is None else credentials.token_digests(folder))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    service.register(server)
    names = [*service.service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name]
    reflection.enable_server_reflection([*names, reflection.SERVICE_NAME], server)
    for svc in ("", *service.service_names):
        await health_servicer.set(svc, health_pb2.HealthCheckResponse.NOT_SERVING)

    port = bind(server, config.host, config.port, name, folder)
    if port == 0:
        raise RuntimeError(f"{name}: cannot listen on {config.host}:{config.port}")
    await server.start()
    # The stack launcher reads this line to learn the port; keep its shape stable.
    print(f"meridian {name} listening on {config.host}:{port}", flush=True)
    metrics_endpoint = metrics.start_endpoint(name, service, config, asyncio.get_running_loop())

    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)

    warmup = asyncio.create_task(service.start())
    done, _ = await asyncio.wait({warmup, asyncio.create_task(stopping.wait())}, return_when=asyncio.FIRST_COMPLETED)
    failed = False
    if warmup in done and warmup.exception() is None:
        for svc in ("", *service.service_names):
            await health_servicer.set(svc, health_pb2.HealthCheckResponse.SERVING)
        log.info("%s: SERVING on %s:%d", name, config.host, port)
        print(f"meridian {name} serving", flush=True)
        reason = await _serve_until(stopping, service)
        if reason is not None:
            failed = True
            log.error("%s: cannot serve any longer: %s", name, reason)
            print(f"meridian {name} failed: {reason}", flush=True)
    elif warmup in done:
        # The type and the message (an OSError's errno, strerror and path; a Redis reply):
        # repr() of some exceptions shows only their arguments.
        reason = describe_error(warmup.exception())
        log.error("%s: warm-up failed: %s", name, reason)
        print(f"meridian {name} warm-up failed: {reason}", flush=True)
    else:
        warmup.cancel()

    log.info("%s: shutting down (grace %.1fs)", name, config.grace_s)
    await health_servicer.enter_graceful_shutdown()
    await server.stop(config.grace_s)
    if metrics_endpoint is not None:
        metrics_endpoint.close()
    try:
        await asyncio.wait_for(service.stop(), timeout=max(config.grace_s, 5.0))
    except TimeoutError:
        log.warning("%s: service stop timed out", name)
    telemetry.shutdown()
    if failed or (warmup.done() and not warmup.cancelled() and warmup.exception() is not None):
        raise SystemExit(1)


async def failure_of(task: asyncio.Task[Any] | None, what: str) -> str:
    """For a service's ``failure``: waits until ``task``, a background task the service
    cannot serve without, has ended, and says why (``what`` names it); never returns
    for None (no such task)."""
    if task is None:
        await asyncio.Event().wait()
    assert task is not None
    await asyncio.wait({task})
    if task.cancelled():
        return f"{what} was cancelled"
    return f"{what} stopped: {describe_error(task.exception())}"


async def _serve_until(stopping: asyncio.Event, service: Service) -> str | None:
    """Waits for a stop signal (None) or the service's ``failure`` (its reason)."""
    failure = getattr(service, "failure", None)
    if failure is None:
        await stopping.wait()
        return None
    failed = asyncio.create_task(failure())
    stop = asyncio.create_task(stopping.wait())
    try:
        await asyncio.wait({failed, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (failed, stop):
            task.cancel()
    if not failed.done() or failed.cancelled():
        return None
    exc = failed.exception()
    return failed.result() if exc is None else f"its failure check raised {describe_error(exc)}"


#: What grpcio's asyncio client answers, in place of the server's status, when the server
#: ended a client-streaming call while a request message was still being written (grpc/grpc
#: issue 36066, pull request 43486): the server's code and details are lost, its INTERNAL
#: is the client's own, not the service's (whose INTERNAL says "internal error (ref=...)").
CLIENT_WRITE_RACE = "Internal error from Core"


def ended_while_sending(exc: grpc.aio.AioRpcError) -> bool:
    """Whether a client-streaming call failed only because the server ended it (refused
    it, most often) before the client had sent every message: what the server said is
    lost, so the call may be made again to hear it."""
    return exc.code() == grpc.StatusCode.INTERNAL and exc.details() == CLIENT_WRITE_RACE


def describe_error(exc: BaseException | None) -> str:
    """``Type: message`` of ``exc``, with the causes it was raised from, for a log line."""
    parts = []
    while exc is not None and len(parts) < 4:
        message = str(exc) or repr(exc)
        parts.append(f"{type(exc).__name__}: {message}")
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    return " (from) ".join(parts) if parts else "unknown error"


def bind(server: grpc.aio.Server, host: str, port: int, name: str, folder: Path | None) -> int:
    """Listens on ``host:port``: mTLS with ``name``'s certificate from ``folder`` (client
    certificates signed by its CA required), or plaintext when ``folder`` is None, which
    only a loopback host may do. Returns the bound port."""
    if folder is None:
        if not credentials.is_loopback(host):
            raise ValueError(f"{name}: plaintext is refused on {host}; serve with credentials")
        return server.add_insecure_port(f"{host}:{port}")
    ca, cert, key = credentials.server_pem(folder, name)
    creds = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)
    return server.add_secure_port(f"{host}:{port}", creds)


def serve_forever(name: str, make_service: Callable[[], Service], config: ServerConfig) -> None:
    """Entry point for ``meridian serve``: uvloop, logging, tracing, the process's own
    client credentials (its role: ``MERIDIAN_ROLE`` or the service's, see
    :data:`meridian.credentials.SERVICE_ROLES`), then :func:`run_server`."""
    import uvloop

    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s")
    telemetry.setup_tracing(f"meridian-{name}")
    folder = config.credentials_folder()
    role = os.environ.get(credentials.ENV_ROLE) or credentials.SERVICE_ROLES.get(name, "operator")
    credentials.use(None if folder is None else credentials.Identity(folder, role))

    async def main() -> None:
        await run_server(name, make_service(), config)

    uvloop.run(main())


# ---------------------------------------------------------------- clients


@dataclasses.dataclass(frozen=True)
class ClientAuth:
    """What a client presents: TLS trusting the deployment's CA with the client
    certificate (mTLS), and its role's bearer token on every call."""

    folder: Path
    role: str
    token: str
    tls: grpc.ChannelCredentials

    @classmethod
    def load(cls, folder: Path, role: str, token: str | None = None) -> ClientAuth:
        """``role``'s credentials from ``folder``; ``token`` overrides the role's own (a
        caller key of rollout's caller-classes file, say)."""
        tls = client_tls(folder)
        return cls(Path(folder), role, token if token is not None else credentials.role_token(Path(folder), role), tls)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """TLS plus the token as ``authorization: Bearer <token>`` on every call."""
        return grpc.composite_channel_credentials(self.tls, grpc.access_token_call_credentials(self.token))


def client_tls(folder: Path | str) -> grpc.ChannelCredentials:
    """TLS trusting the deployment's CA with the client certificate, and no token: what
    a health probe presents (health answers without one, so a probe needs no role)."""
    ca, cert, key = credentials.client_pem(Path(folder))
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


class _Default:
    """Marks an ``auth`` left to :func:`meridian.credentials.identity_for`."""


DEFAULT = _Default()


@functools.lru_cache(maxsize=64)
def _loaded(identity: credentials.Identity) -> ClientAuth:
    return ClientAuth.load(identity.folder, identity.role)


def client_auth(address: str) -> ClientAuth | None:
    """What a call to ``address`` presents by default (see
    :func:`meridian.credentials.identity_for`); None: plaintext."""
    identity = credentials.identity_for(address)
    return None if identity is None else _loaded(identity)


def _host_of(address: str) -> str:
    target = address.split("///", 1)[-1]
    return target.rpartition(":")[0] if ":" in target else target


def _channel(address: str, auth: ClientAuth | None | _Default, with_token: bool, options: list[tuple[str, Any]], interceptors: Sequence[Any] | None) -> grpc.aio.Channel:
    resolved = client_auth(address) if isinstance(auth, _Default) else auth
    if resolved is None:
        if not credentials.is_loopback(_host_of(address)):
            raise ValueError(f"plaintext to {address} is refused: only loopback addresses may go without TLS; set credentials (MERIDIAN_CREDENTIALS)")
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    creds = resolved.channel_credentials() if with_token else resolved.tls
    return grpc.aio.secure_channel(address, creds, options=options, interceptors=interceptors)


def open_channel(
    address: str, max_message_mb: int = 64, options: Sequence[tuple[str, Any]] = (), auth: ClientAuth | None | _Default = DEFAULT
) -> grpc.aio.Channel:
    """An instrumented asyncio channel to another Meridian service; ``options`` are added
    to the message-size ones (e.g. flow-control windows for a bulk stream). ``auth``
    defaults to the process's :func:`client_auth`; None opens plaintext (loopback only)."""
    return _channel(address, auth, True, [*channel_options(max_message_mb), *options], telemetry.client_interceptors())


async def check_health(address: str, service: str = "", timeout_s: float = 2.0, auth: ClientAuth | None | _Default = DEFAULT) -> str:
    """The standard health status of ``service`` at ``address`` (or UNREACHABLE). Over
    TLS when the process has credentials; health needs no token."""
    async with _channel(address, auth, False, [], None) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            return "UNREACHABLE" if exc.code() == grpc.StatusCode.UNAVAILABLE else exc.code().name
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
