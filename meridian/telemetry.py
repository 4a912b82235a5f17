"""OpenTelemetry wiring shared by every process.

Spans are exported over OTLP/gRPC only when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set;
otherwise tracing still propagates context (so links and parents stay correct) but
exports nothing. Trace context crosses Redis inside each stream entry as a W3C
``traceparent`` carrier (see :func:`inject` / :func:`extract`).
"""
from __future__ import annotations

import inspect
import os
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

_provider: TracerProvider | None = None


def setup_tracing(service_name: str) -> TracerProvider:
    """Installs the process's tracer provider (idempotent)."""
    global _provider  # one provider per process is OpenTelemetry's own model
    if _provider is not None:
        return _provider
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True)))
    trace.set_tracer_provider(provider)
    _provider = provider
    return provider


def shutdown() -> None:
    """Flushes and stops exporting; called last on service shutdown."""
    if _provider is not None:
        _provider.shutdown()


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def server_interceptors() -> list[Any]:
    """OpenTelemetry's server interceptor, passing by streaming handlers it would break."""
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    return [_SkipCoroutineStreams(aio_server_interceptor())]


class _SkipCoroutineStreams(grpc.aio.ServerInterceptor):
    """Hands every call to ``inner`` except those of a streaming handler written as a
    coroutine (it writes with ``context.write``; grpcio's own health Watch is one):
    OpenTelemetry's wrapper iterates a streaming handler with ``async for``, so such a call
    would end in UNKNOWN with a TypeError instead of streaming. They go untraced."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    async def intercept_service(self, continuation: Any, handler_call_details: Any) -> Any:
        handler = await continuation(handler_call_details)
        if handler is not None and handler.response_streaming:
            behavior = handler.stream_stream if handler.request_streaming else handler.unary_stream
            if not inspect.isasyncgenfunction(behavior):
                return handler

        async def resolved(_details: Any) -> Any:
            return handler

        return await self.inner.intercept_service(resolved, handler_call_details)


def client_interceptors() -> list[Any]:
    from opentelemetry.instrumentation.grpc import aio_client_interceptors

    return list(aio_client_interceptors())


def inject(span: trace.Span | None = None) -> dict[str, str]:
    """A W3C carrier for ``span`` (or the current context), to ride inside a message."""
    carrier: dict[str, str] = {}
    ctx = trace.set_span_in_context(span) if span is not None else None
    propagate.inject(carrier, context=ctx)
    return carrier


def extract(carrier: dict[str, str]) -> otel_context.Context:
    return propagate.extract(carrier)


def span_context_of(carrier: dict[str, str]) -> trace.SpanContext | None:
    """The remote span context a carrier names, for use as a span link."""
    ctx = trace.get_current_span(extract(dict(carrier))).get_span_context()
    return ctx if ctx.is_valid else None
