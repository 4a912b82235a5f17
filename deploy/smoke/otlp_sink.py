"""An OTLP/gRPC trace receiver for deploy/compose-smoke, in place of Jaeger where its image
cannot be pulled: accepts every export and prints one line per (service, region) it has
not seen yet, then a running count, so the smoke run can check that spans from both
regions arrived (``docker-compose logs otlp-sink``)."""
from __future__ import annotations

import argparse
import collections
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

SEEN: collections.Counter[tuple[str, str]] = collections.Counter()


def _attribute(resource: object, key: str) -> str:
    for kv in resource.attributes:  # type: ignore[attr-defined]
        if kv.key == key:
            return kv.value.string_value
    return ""


class Sink(trace_service_pb2_grpc.TraceServiceServicer):
    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext) -> trace_service_pb2.ExportTraceServiceResponse:  # noqa: N802 (gRPC's name)
        for spans in request.resource_spans:
            key = (_attribute(spans.resource, "service.name"), _attribute(spans.resource, "meridian.region"))
            n = sum(len(scope.spans) for scope in spans.scope_spans)
            SEEN[key] += n
            print(f"otlp-sink: spans service={key[0]} region={key[1]} +{n} total={SEEN[key]}", flush=True)
        return trace_service_pb2.ExportTraceServiceResponse()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=4317)
    args = parser.parse_args()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Sink(), server)
    server.add_insecure_port(f"0.0.0.0:{args.port}")
    server.start()
    print(f"otlp-sink: listening on {args.port}", flush=True)
    server.wait_for_termination()


if __name__ == "__main__":
    main()
