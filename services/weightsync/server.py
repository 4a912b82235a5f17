"""gRPC adapter of the weightsync service: origin (Publish) or relay (mirrors an
upstream), both serving Subscribe from a :class:`VersionStore`."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import numpy as np

from meridian import telemetry
from meridian.errors import FailedPrecondition, InvalidArgument
from meridian.v1 import weightsync_pb2 as pb
from meridian.v1 import weightsync_pb2_grpc as pb_grpc
from services.weightsync.client import WeightSubscriber
from services.weightsync.config import WeightSyncConfig
from services.weightsync.store import Encoded, VersionStore
from services.weightsync.tensors import PB_DTYPE_NAMES, RAW_DTYPES, RawTensor, element_count

log = logging.getLogger(__name__)
tracer = telemetry.tracer(__name__)

MAX_TENSORS = 100_000


class _Assembly:
    """Collects one Publish stream's pieces into whole tensors, checking every offset."""

    def __init__(self) -> None:
        self.tensors: dict[str, RawTensor] = {}
        self._filled: dict[str, int] = {}

    def add(self, piece: pb.TensorPiece, current: str) -> str:
        name = piece.meta.name or current
        if piece.meta.name:
            if name in self.tensors:
                raise InvalidArgument(f"tensor {name!r} started twice")
            if len(self.tensors) >= MAX_TENSORS:
                raise InvalidArgument(f"more than {MAX_TENSORS} tensors")
            dtype = PB_DTYPE_NAMES.get(piece.meta.dtype)
            if dtype is None:
                raise InvalidArgument(f"tensor {name!r}: dtype must be BF16, FP16 or FP32")
            try:
                numel = element_count(tuple(piece.meta.shape))
            except ValueError as exc:
                raise InvalidArgument(f"tensor {name!r}: {exc}") from None
            self.tensors[name] = RawTensor(dtype, tuple(piece.meta.shape), np.zeros(numel, dtype=RAW_DTYPES[dtype]))
            self._filled[name] = 0
        if not name:
            raise InvalidArgument("the first piece of a tensor must carry its meta (name, dtype, shape)")
        t = self.tensors[name]
        raw = t.bits.view(np.uint8)
        if piece.offset != self._filled[name]:
            raise InvalidArgument(f"tensor {name!r}: piece at byte {piece.offset}, expected {self._filled[name]}")
        end = piece.offset + len(piece.data)
        if end > raw.shape[0]:
            raise InvalidArgument(f"tensor {name!r}: {end} bytes sent, tensor holds {raw.shape[0]}")
        raw[piece.offset : end] = np.frombuffer(piece.data, dtype=np.uint8)
        self._filled[name] = end
        return name

    def check_complete(self) -> None:
        short = [n for n, t in self.tensors.items() if self._filled[n] != t.nbytes]
        if short:
            raise InvalidArgument(f"stream ended with incomplete tensors: {short[:5]}")


class WeightSyncService(pb_grpc.WeightSyncServicer):
    """Versions in, versions out."""

    service_names = (pb.DESCRIPTOR.services_by_name["WeightSync"].full_name,)

    def __init__(self, config: WeightSyncConfig) -> None:
        self.config = config
        self._tmp = None if config.data_dir else tempfile.TemporaryDirectory(prefix="meridian-weightsync-")
        data_dir = Path(config.data_dir or self._tmp.name)  # type: ignore[union-attr]
        self.store = VersionStore(data_dir, keep=config.keep_versions, chunk_bytes=int(config.chunk_mb * (1 << 20)))
        self._changed = asyncio.Condition()
        # The store is mutated in worker threads (encoding is CPU-bound); every access
        # that reads or changes its state goes through this lock.
        self._store_lock = asyncio.Lock()
        self._mirror: asyncio.Task[None] | None = None

    def register(self, server: grpc.aio.Server) -> None:
        pb_grpc.add_WeightSyncServicer_to_server(self, server)

    async def start(self) -> None:
        if self.config.role == "relay":
            self._mirror = asyncio.create_task(self._mirror_upstream())

    async def stop(self) -> None:
        if self._mirror:
            self._mirror.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._mirror
        if self._tmp is not None:
            self._tmp.cleanup()

    async def _announce(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def _mirror_upstream(self) -> None:
        """Relay: one subscription upstream, re-serving the same encoded chunks locally."""
        while True:
            subscriber = WeightSubscriber(self.config.upstream, self.store.weights, self.store.latest)
            try:
                async for update in subscriber.updates(follow=True, keep_encoded=True):
                    assert update.encoded is not None
                    async with self._store_lock:
                        await asyncio.to_thread(self.store.add_encoded, update.encoded, update.weights)
                    await self._announce()
            except grpc.aio.AioRpcError as exc:
                log.warning("upstream %s: %s; retrying", self.config.upstream, exc.code().name)
            finally:
                await subscriber.close()
            await asyncio.sleep(1.0)

    # ------------------------------------------------------------ RPCs

    async def Publish(self, request_iterator: AsyncIterator[pb.PublishRequest], context: grpc.aio.ServicerContext) -> pb.PublishResponse:
        if self.config.role != "origin":
            raise FailedPrecondition("this weightsync is a relay; publish to the origin")
        header: pb.PublishHeader | None = None
        assembly = _Assembly()
        current = ""
        async for item in request_iterator:
            if item.HasField("header"):
                if header is not None:
                    raise InvalidArgument("a Publish stream carries one header")
                header = item.header
            elif item.HasField("piece"):
                if header is None:
                    raise InvalidArgument("the header must come before any tensor piece")
                current = assembly.add(item.piece, current)
            else:
                raise InvalidArgument("empty PublishRequest")
        if header is None:
            raise InvalidArgument("Publish stream had no header")
        assembly.check_complete()
        async with self._store_lock:
            with tracer.start_as_current_span("weightsync.encode", context=telemetry.extract(dict(header.trace_context))) as span:
                span.set_attribute("meridian.version", header.version)
                enc: Encoded = await asyncio.to_thread(
                    self.store.publish, header.version, assembly.tensors, header.weights_hash, dict(header.trace_context)
                )
                span.set_attribute("meridian.encoded_bytes", enc.size)
        await self._announce()
        log.info("version %d stored: %d raw bytes -> %d encoded", header.version, enc.manifest.raw_bytes, enc.size)
        return pb.PublishResponse(version=header.version, raw_bytes=enc.manifest.raw_bytes, encoded_bytes=enc.size)

    async def Subscribe(self, request: pb.SubscribeRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.WeightChunk]:
        held = request.from_version
        if held < -1:
            raise InvalidArgument(f"from_version must be >= -1, got {held}")
        while True:
            async with self._store_lock:
                plan = await asyncio.to_thread(self.store.plan, held)
            for enc in plan:
                yield pb.WeightChunk(manifest=enc.manifest)
                for index, payload in enumerate(enc.chunks):
                    yield pb.WeightChunk(chunk=pb.ChunkData(version=enc.manifest.version, index=index, data=payload))
                held = enc.manifest.version
            if not request.follow:
                return
            async with self._changed:
                await self._changed.wait_for(lambda: self.store.latest > held)

    async def GetManifest(self, request: pb.GetManifestRequest, context: grpc.aio.ServicerContext) -> pb.Manifest:
        return self.store.manifest(request.version)

    async def Status(self, request: pb.WeightSyncStatusRequest, context: grpc.aio.ServicerContext) -> pb.WeightSyncStatus:
        return pb.WeightSyncStatus(
            latest_version=self.store.latest,
            versions=self.store.versions(),
            stored_bytes=self.store.stored_bytes(),
            role=self.config.role,
        )
