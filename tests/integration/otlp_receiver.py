"""An in-process OTLP/gRPC trace receiver, standing in for Jaeger in tests (Jaeger is
not installable here): services export to it exactly as they would to a collector."""
from __future__ import annotations

import dataclasses
import threading
import time
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2


@dataclasses.dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    links: tuple[tuple[str, str], ...]  # (trace_id, span_id)
    kind: str = ""  # the OTLP span kind without its prefix: SERVER, CLIENT, PRODUCER, CONSUMER, INTERNAL
    start_unix_ns: int = 0
    end_unix_ns: int = 0


class _Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.lock = threading.Lock()

    def Export(self, request, context):  # type: ignore[no-untyped-def]
        received = []
        for rs in request.resource_spans:
            service = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), "")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    received.append(
                        ReceivedSpan(
                            service=service,
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_span_id=s.parent_span_id.hex(),
                            links=tuple((l.trace_id.hex(), l.span_id.hex()) for l in s.links),
                            kind=trace_pb2.Span.SpanKind.Name(s.kind).removeprefix("SPAN_KIND_").replace("UNSPECIFIED", ""),
                            start_unix_ns=s.start_time_unix_nano,
                            end_unix_ns=s.end_time_unix_nano,
                        )
                    )
        with self.lock:
            self.spans.extend(received)
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    """Listens on a free loopback port; ``endpoint`` goes into OTEL_EXPORTER_OTLP_ENDPOINT."""

    def __init__(self) -> None:
        self._collector = _Collector()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self._collector, self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{port}"

    def __enter__(self) -> "OtlpReceiver":
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop(grace=None)

    def spans(self, name: str | None = None) -> list[ReceivedSpan]:
        with self._collector.lock:
            return [s for s in self._collector.spans if name is None or s.name == name]

    def wait_for(self, predicate, timeout_s: float = 30.0) -> bool:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate(self):
                return True
            time.sleep(0.2)
        return predicate(self)
