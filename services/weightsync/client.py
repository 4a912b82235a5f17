"""Weightsync clients: the publisher (trainer side) and the subscriber (rollout and
relay side), which verifies and decodes every version before handing it over."""
from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Iterator, Mapping

from meridian.grpc_runtime import open_channel
from meridian.v1 import weightsync_pb2 as pb
from meridian.v1 import weightsync_pb2_grpc as pb_grpc
from services.weightsync.store import Decoder, Encoded
from services.weightsync.tensors import RawTensor, Weights, weights_hash

PIECE_BYTES = 2 << 20


def publish_requests(
    version: int, weights: Weights, trace_context: Mapping[str, str] | None = None, metrics: Mapping[str, float] | None = None
) -> Iterator[pb.PublishRequest]:
    """The Publish stream for one version: header, then each tensor in pieces."""
    yield pb.PublishRequest(
        header=pb.PublishHeader(
            version=version, weights_hash=weights_hash(weights), trace_context=dict(trace_context or {}), metrics=dict(metrics or {})
        )
    )
    for name in sorted(weights):
        t = weights[name]
        raw = memoryview(t.bits).cast("B")
        offset = 0
        first = True
        while first or offset < len(raw):
            data = bytes(raw[offset : offset + PIECE_BYTES])
            yield pb.PublishRequest(piece=pb.TensorPiece(meta=t.meta(name) if first else None, offset=offset, data=data))
            offset += len(data)
            first = False


async def publish(
    address: str, version: int, weights: Weights, trace_context: Mapping[str, str] | None = None, metrics: Mapping[str, float] | None = None
) -> pb.PublishResponse:
    """Publishes one version to a weightsync origin."""
    async with open_channel(address) as channel:
        stub = pb_grpc.WeightSyncStub(channel)
        return await stub.Publish(publish_requests(version, weights, trace_context, metrics))


async def latest_version(address: str, timeout_s: float = 10.0) -> int:
    async with open_channel(address) as channel:
        reply = await pb_grpc.WeightSyncStub(channel).Status(pb.WeightSyncStatusRequest(), timeout=timeout_s)
        return reply.latest_version


@dataclasses.dataclass
class VersionUpdate:
    """A verified version: the full weights, and the encoded form when asked for."""

    version: int
    weights: dict[str, RawTensor]
    manifest: pb.Manifest
    encoded: Encoded | None = None


class WeightSubscriber:
    """Follows a weightsync from the version it holds, yielding verified full versions."""

    def __init__(self, address: str, weights: Weights | None, version: int) -> None:
        self.address = address
        self.decoder = Decoder(weights, version if weights else -1)
        self._channel = open_channel(address)

    async def close(self) -> None:
        await self._channel.close()

    async def updates(self, follow: bool = True, keep_encoded: bool = False) -> AsyncIterator[VersionUpdate]:
        stub = pb_grpc.WeightSyncStub(self._channel)
        call = stub.Subscribe(pb.SubscribeRequest(from_version=self.decoder.version, follow=follow))
        encoded: Encoded | None = None
        async for item in call:
            if item.HasField("manifest"):
                self.decoder.begin(item.manifest)
                encoded = Encoded(item.manifest, [])
            else:
                # Decoding is CPU-bound; keep the event loop (and the server it hosts) responsive.
                await asyncio.to_thread(self.decoder.add_chunk, item.chunk.index, item.chunk.data)
                assert encoded is not None
                if keep_encoded:
                    encoded.chunks.append(item.chunk.data)
                if item.chunk.index == len(encoded.manifest.chunks) - 1:
                    version = await asyncio.to_thread(self.decoder.finish)
                    yield VersionUpdate(version, self.decoder.weights, encoded.manifest, encoded if keep_encoded else None)
