"""gRPC adapter of the weightsync service: origin (Publish) or relay (mirrors an
upstream), both serving Subscribe from a :class:`VersionStore`."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any, TypeVar

import grpc
import numpy as np

from meridian import metrics, telemetry
from meridian.errors import (
    Aborted, AlreadyExists, DataLoss, DeadlineExceeded, FailedPrecondition, InvalidArgument, MeridianError, NotFound, ResourceExhausted, Unavailable,
)
from meridian.grpc_runtime import CallLimit, failure_of
from meridian.run_to_end import RunToEnd
from meridian.v1 import weightsync_pb2 as pb
from meridian.v1 import weightsync_pb2_grpc as pb_grpc
from services.weightsync.chunk_messages import serialize_response, weight_chunk_message
from services.weightsync.client import WeightSubscriber
from services.weightsync.config import WeightSyncConfig
from services.weightsync.ratelimit import TokenBucket
from services.weightsync.signing import SignatureRefused, Verifier, load_verifier
from services.weightsync.store import VersionStore
from services.weightsync import parts, precompile
from services.weightsync.codec import CodecError
from services.weightsync.versions import Carried, Changes, Encoded, EncodedTensors, Spare, check_tensor_set, decode_tensors, encode_tensors
from meridian.tensors import PB_DTYPE_NAMES, RAW_DTYPES, RawTensor, element_count, hash_of_sums

_T = TypeVar("_T")
log = logging.getLogger(__name__)
tracer = telemetry.tracer(__name__)

MAX_TENSORS = 100_000
GiB = 1 << 30


class PublishBudget:
    """Tensor bytes that Publish streams in flight have declared, against two caps: per
    stream and in total. A tensor's buffer is allocated when its meta arrives, before
    any of its data, so the caps are checked there: a declaration past either one is
    refused before anything is allocated."""

    def __init__(self, per_publish: int, total: int) -> None:
        self.per_publish = per_publish
        self.total = total
        self.in_flight = 0

    def reserve(self, held: int, nbytes: int, name: str) -> None:
        """Adds ``nbytes`` to a stream that already holds ``held``; raises when over a cap."""
        if held + nbytes > self.per_publish:
            raise ResourceExhausted(
                f"tensor {name!r} brings this Publish to {held + nbytes} declared bytes, "
                f"more than one Publish may hold (max_publish_gib={self.per_publish / GiB:g})"
            )
        if self.in_flight + nbytes > self.total:
            raise ResourceExhausted(
                f"tensor {name!r} ({nbytes} bytes) would bring the Publish streams in flight to {self.in_flight + nbytes} declared bytes, "
                f"more than this server holds at once (max_publish_total_gib={self.total / GiB:g}); retry later"
            )
        self.in_flight += nbytes

    def release(self, nbytes: int) -> None:
        self.in_flight -= nbytes


class _PublishStream:
    """What every Publish stream's receiver checks as a tensor starts (each tensor once, at
    most MAX_TENSORS) and the tensor bytes it reserves in ``budget``, before the buffer
    they need exists; :meth:`release` returns them."""

    def __init__(self, budget: PublishBudget | None = None) -> None:
        self.budget = budget
        self.declared = 0
        self._started: set[str] = set()
        # Steps still holding this stream's tensors (a store step, a thread): the
        # reservation outlives the handler until they end (see hold_until).
        self._holders: list[asyncio.Future[Any]] = []
        self._releasing = False

    def _admit(self, name: str) -> None:
        if name in self._started:
            raise InvalidArgument(f"tensor {name!r} started twice")
        if len(self._started) >= MAX_TENSORS:
            raise InvalidArgument(f"more than {MAX_TENSORS} tensors")

    def _reserve(self, name: str, nbytes: int) -> None:
        if self.budget is not None:
            self.budget.reserve(self.declared, nbytes, name)
        self.declared += nbytes
        self._started.add(name)

    def hold_until(self, step: asyncio.Future[Any]) -> None:
        """Keeps the reservation at least until ``step`` ends: ``step`` holds this stream's
        tensors, and runs on when the publisher goes away (a shielded store step, a
        thread), so the bytes are in memory until then whatever the handler does."""
        self._holders.append(step)
        step.add_done_callback(self._step_ended)

    def _step_ended(self, step: asyncio.Future[Any]) -> None:
        if not step.cancelled():
            step.exception()  # retrieved: its caller, if it did not go away, got it too
        if self._releasing:
            self._return()

    def release(self) -> None:
        """Returns this stream's reservation once its tensors are no longer needed: now,
        or when the last step holding them (see :meth:`hold_until`) ends."""
        self._releasing = True
        self._return()

    def _return(self) -> None:
        if any(not step.done() for step in self._holders):
            return
        self._holders = []
        if self.budget is not None:
            self.budget.release(self.declared)
        self.declared = 0


class _Assembly(_PublishStream):
    """Collects one Publish stream's pieces into whole tensors, checking every offset;
    each tensor's bytes are reserved in ``budget`` before its buffer exists."""

    def __init__(self, budget: PublishBudget | None = None) -> None:
        super().__init__(budget)
        self.tensors: dict[str, RawTensor] = {}
        self._filled: dict[str, int] = {}

    def add(self, piece: pb.TensorPiece, current: str) -> str:
        name = piece.meta.name or current
        if piece.meta.name:
            self._admit(name)
            dtype = PB_DTYPE_NAMES.get(piece.meta.dtype)
            if dtype is None:
                raise InvalidArgument(f"tensor {name!r}: dtype must be BF16, FP16 or FP32")
            try:
                numel = element_count(tuple(piece.meta.shape))
            except ValueError as exc:
                raise InvalidArgument(f"tensor {name!r}: {exc}") from None
            self._reserve(name, numel * np.dtype(RAW_DTYPES[dtype]).itemsize)
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


class _EncodedPart(_PublishStream):
    """Collects a rank-encoded part's chunk payloads (PartChunks messages), each tensor's
    in order, checking each tensor's meta against the base it is coded on and its chunk
    count and sizes against the origin's chunking. Decoding makes a buffer as large as the
    base tensor, so that is what is reserved in ``budget`` when the tensor starts."""

    def __init__(self, base: Mapping[str, RawTensor], chunk_bytes: int, budget: PublishBudget | None = None) -> None:
        super().__init__(budget)
        self.payloads: dict[str, list[bytes]] = {}
        self.base = base
        self.chunk_bytes = chunk_bytes
        self._chunks_of: dict[str, int] = {}

    def add(self, chunks: pb.PartChunks, current: str) -> str:
        name = chunks.meta.name or current
        if chunks.meta.name:
            self._start(name, chunks.meta)
        if not name:
            raise InvalidArgument("the first message of a tensor's chunks must carry its meta (name, dtype, shape)")
        held = self.payloads[name]
        if len(held) + len(chunks.payloads) > self._chunks_of[name]:
            raise InvalidArgument(f"tensor {name!r}: more than the {self._chunks_of[name]} chunks of {self.chunk_bytes} raw bytes it is cut into")
        for payload in chunks.payloads:
            # A keyframe chunk is the raw bytes and a header; nothing a codec writes is larger.
            if len(payload) > self.chunk_bytes + (4 << 10):
                raise InvalidArgument(f"tensor {name!r}: a chunk payload of {len(payload)} bytes, more than a chunk of {self.chunk_bytes} raw bytes needs")
        held.extend(chunks.payloads)
        return name

    def _start(self, name: str, meta: pb.TensorMeta) -> None:
        self._admit(name)
        old = self.base.get(name)
        shape = tuple(meta.shape)
        if old is None or (PB_DTYPE_NAMES.get(meta.dtype), shape) != (old.dtype, tuple(old.shape)):
            held = f"{old.dtype}{list(old.shape)}" if old is not None else "no such tensor"
            # The rank's base is not the origin's: not a malformed stream, a reason to send it raw.
            raise _NotTheBase(f"tensor {name!r} is {PB_DTYPE_NAMES.get(meta.dtype)}{list(shape)}; the base holds {held}")
        self._reserve(name, old.nbytes)
        self.payloads[name] = []
        self._chunks_of[name] = max(1, -(-old.bits.shape[0] // max(1, self.chunk_bytes // old.bits.itemsize)))

    def check_complete(self) -> None:
        short = [n for n, p in self.payloads.items() if len(p) != self._chunks_of[n]]
        if short:
            raise InvalidArgument(f"stream ended with tensors missing chunks: {short[:5]}")


class _Handlers:
    """Takes what the generated ``add_WeightSyncServicer_to_server`` registers."""

    def __init__(self) -> None:
        self.service = ""
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass  # the same handlers come to add_registered_method_handlers

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        self.service, self.handlers = service, handlers


class _OriginBusy(Aborted):
    """A part refused because the parts of another version are being assembled: retrying
    the same call can succeed (sent with :data:`parts.BUSY_METADATA`)."""


class _NotTheBase(Exception):
    """A rank-encoded part that does not decode, against the origin's base, to the tensors
    its part hash names: the rank sends it raw (FAILED_PRECONDITION)."""


@dataclasses.dataclass
class _PendingVersion:
    """A sharded publish being assembled: the parts in so far and their encodings, all
    against ``base`` (the origin's latest when the first part came)."""

    version: int
    count: int
    fields: bytes  # the first part's version fields; every part must carry the same
    header: pb.PublishHeader
    base_version: int
    base: dict[str, RawTensor] | None
    base_carried: Carried  # what the store's encoding left for ``base``, coded over by every part
    encode: bool  # False: a republish of a held version, checked, not encoded
    spare: Spare | None = None  # buffers rank-encoded parts are decoded into (store.take_spare)
    names: dict[int, list[str]] = dataclasses.field(default_factory=dict)  # registered parts
    part_hashes: dict[int, str] = dataclasses.field(default_factory=dict)  # each registered part's part_hash
    done: set[int] = dataclasses.field(default_factory=set)  # parts received and encoded
    tensors: dict[str, RawTensor] = dataclasses.field(default_factory=dict)
    payloads: dict[str, list[bytes]] = dataclasses.field(default_factory=dict)
    sha256: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # the payloads', from the encoders
    carried: Carried = dataclasses.field(default_factory=Carried)  # what the parts leave for the next version
    changes: Changes = dataclasses.field(default_factory=dict)  # of the tensors decoded from rank-encoded parts
    items: list[parts.HashItem] = dataclasses.field(default_factory=list)
    timer: asyncio.TimerHandle | None = None
    storing: bool = False  # its store step started: its outcome is that step's (see _begin_store)
    result: asyncio.Future[tuple[Encoded, bool]] = dataclasses.field(default_factory=lambda: asyncio.get_running_loop().create_future())

    def __post_init__(self) -> None:
        # An abort nobody is left to hear must not be logged as "never retrieved".
        self.result.add_done_callback(lambda f: f.cancelled() or f.exception())

    def arrived(
        self, index: int, tensors: dict[str, RawTensor], encoded: EncodedTensors | None, items: list[parts.HashItem], changes: Changes | None = None
    ) -> None:
        self.tensors.update(tensors)
        self.changes.update(changes or {})
        if encoded is not None:
            self.payloads.update(encoded.payloads)
            self.sha256.update(encoded.sha256)
            self.carried.indexes.update(encoded.carried.indexes)
        # The parts' sums were computed in full to check their part hashes.
        self.carried.sums.update((name, sums) for name, _, _, sums in items)
        self.items.extend(items)
        self.done.add(index)

    def withdraw(self, index: int) -> None:
        """Takes a part that was refused back out (its rank sends it again, raw)."""
        self.names.pop(index, None)
        self.part_hashes.pop(index, None)

    @property
    def complete(self) -> bool:
        return len(self.done) == self.count and not self.result.done()


class WeightSyncService(pb_grpc.WeightSyncServicer):
    """Versions in, versions out.

    An origin encodes what the trainer publishes; a relay mirrors its upstream with one
    subscription and re-serves the same encoded chunks, passing each chunk on to its own
    subscribers as soon as it arrived and passed its checksum (cut-through), so a fan-out
    tree adds little more than one hop of latency per level.
    """

    service_names = (pb.DESCRIPTOR.services_by_name["WeightSync"].full_name,)

    def __init__(self, config: WeightSyncConfig) -> None:
        self.config = config
        self._tmp = None if config.data_dir else tempfile.TemporaryDirectory(prefix="meridian-weightsync-")
        data_dir = Path(config.data_dir or self._tmp.name)  # type: ignore[union-attr]
        self.store = VersionStore(
            data_dir, keep=config.keep_versions, chunk_bytes=int(config.chunk_mb * (1 << 20)), keyframe_every=config.keyframe_every,
            live_weights=config.role == "relay", encode_threads=config.encode_threads or len(os.sched_getaffinity(0)),
        )
        self._changed = asyncio.Condition()
        # The store is mutated in worker threads (encoding is CPU-bound); every store
        # step on a thread holds this lock from before the thread starts until it ends
        # (see _store_step), whatever happens to the call that started it. Readers on the
        # loop do not take it (it is held for as long as a version encodes): they read
        # the store's state snapshot, which a step replaces whole (VersionStore.held),
        # taking it once where they combine fields of it.
        self._store_lock = asyncio.Lock()
        self._mirror: asyncio.Task[None] | None = None
        self._preparing: asyncio.Future[bool] | None = None  # see _prepare_next
        # Store-and-announce steps running on after their publisher went away (see _to_completion).
        self._completing = RunToEnd("a store step", log)
        # The sharded publish being assembled (parts of one version at a time).
        self._pending: _PendingVersion | None = None
        # Sharded versions whose store step runs (it took them out of _pending): version -> result.
        self._storing: dict[int, asyncio.Future[tuple[Encoded, bool]]] = {}
        self._send = TokenBucket.mib_per_s(config.send_mib_s)
        # Relay: the version arriving from upstream, re-served chunk by chunk as it comes.
        self._incoming: Encoded | None = None
        self._notify_pending = False
        # When each version became available here (monotonic): stored by Publish, or its
        # manifest arrived from upstream. Benches measure propagation from it.
        self.available_at: dict[int, float] = {}
        # Versions must carry the trainer's signature (None: any version is taken).
        self.verifier: Verifier | None = load_verifier(config.verify_key)
        self.publish_budget = PublishBudget(int(config.max_publish_gib * GiB), int(config.max_publish_total_gib * GiB))
        # Open Subscribe streams each hold a slot until they end (ErrorBoundary counts them).
        self.call_limits = {
            f"/{self.service_names[0]}/Subscribe": CallLimit(config.max_subscribe_streams, "max_subscribe_streams"),
        }
        self.counters = dict.fromkeys(
            ("chunks_sent", "chunk_bytes_sent", "resumed_streams", "chunk_fetches", "upstream_versions", "upstream_bytes", "encoded_parts", "encoded_parts_refused"), 0
        )
        self.metrics = metrics.ServiceMetrics("weightsync", self._metric_values)

    def register(self, server: grpc.aio.Server) -> None:
        """The generated handlers, Subscribe's with a serialiser that passes the chunk
        messages it serialised itself (see :mod:`~services.weightsync.chunk_messages`)."""
        generated = _Handlers()
        pb_grpc.add_WeightSyncServicer_to_server(self, generated)
        if "Subscribe" not in generated.handlers:  # stubs from a grpcio-tools that registers otherwise
            raise RuntimeError("the generated weightsync stubs registered no Subscribe handler (run `make protos`)")
        handlers = dict(generated.handlers)
        handlers["Subscribe"] = handlers["Subscribe"]._replace(response_serializer=serialize_response)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(generated.service, handlers),))
        server.add_registered_method_handlers(generated.service, handlers)

    async def start(self) -> None:
        # NOT_SERVING until the codec's kernels are loaded (numba loads each from its cache
        # at its first call): without this an origin's first publish pays 0.12 s for them
        # and each receiver's first delta about 15 ms at every hop.
        took = await asyncio.to_thread(precompile.warm)
        log.info("weightsync: codec kernels loaded in %.2f s", took)
        self._prepare_next()  # a restarted origin's recovered version
        if self.config.role == "relay":
            self._mirror = asyncio.create_task(self._mirror_upstream())

    async def failure(self) -> str:
        """A relay: returns once its upstream mirror has ended, which it does only on an
        error it does not know to recover from (storing a version failed, say): the
        weights it decodes into may then hold part of a version, and a restart
        recovers from the stored versions instead."""
        return await failure_of(self._mirror, "the upstream mirror")  # an origin has none

    async def stop(self) -> None:
        if self._preparing is not None:
            self._preparing.cancel()  # one still waiting for the store lock starts nothing
        # A version being stored for a publisher that went away is finished, not cut off.
        await self._completing.wait()
        if self._mirror:
            self._mirror.cancel()
            await asyncio.wait({self._mirror})  # its error, if it died of one, is failure()'s to report
        # A store thread outlives the call that started it (see _store_step): the folder
        # it writes is removed only once it ended.
        async with self._store_lock:
            if self._tmp is not None:
                self._tmp.cleanup()

    async def _announce(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    # ------------------------------------------------------------ relay

    def _stamp(self, version: int) -> None:
        self.available_at[version] = time.monotonic()
        while len(self.available_at) > 64:
            self.available_at.pop(next(iter(self.available_at)))

    def _upstream_manifest(self, manifest: pb.Manifest) -> None:
        self._stamp(manifest.version)
        self._incoming = Encoded(manifest, [])
        self._notify_soon()

    def _upstream_chunk(self, manifest: pb.Manifest, index: int, payload: bytes) -> None:
        # A verifying relay withholds a version's last chunk until the whole version passed
        # the signature's content check and is stored (its subscribers then continue from
        # the stored copy): no subscriber can complete a version this relay refuses.
        held_back = self.verifier is not None and index == len(manifest.chunks) - 1
        if self._incoming is not None and self._incoming.manifest.version == manifest.version and index == len(self._incoming.chunks) and not held_back:
            self._incoming.chunks.append(payload)
        self.counters["upstream_bytes"] += len(payload)
        self._notify_soon()

    def _notify_soon(self) -> None:
        # One wake-up per burst of chunks: a task per chunk costs more than the chunk.
        if not self._notify_pending:
            self._notify_pending = True
            asyncio.get_running_loop().create_task(self._announce_pending())

    async def _announce_pending(self) -> None:
        self._notify_pending = False
        await self._announce()

    async def _mirror_upstream(self) -> None:
        """Relay: one subscription upstream, re-serving the same encoded chunks locally."""
        while True:
            held = self.store.held  # the latest version and its weights, of one state
            subscriber = WeightSubscriber(
                self.config.upstream,
                held.weights,
                held.latest,
                max_mib_s=self.config.upstream_mib_s,
                on_manifest=self._upstream_manifest,
                on_chunk=self._upstream_chunk,
                # Chunks are passed on before they are decoded; decoding only feeds
                # this relay's store, so it yields the CPU to forwarding and to others.
                decode_nice=10,
                # Only the changed elements are written (O(changes) per version, not a
                # copy of the model); the store never encodes from these buffers while
                # they may hold half a version (live_weights).
                in_place=True,
                window_bytes=int(self.config.window_mib * (1 << 20)),
                verifier=self.verifier,
                # Relays are deployed with their origin's chunk size.
                origin_chunk_bytes=int(self.config.chunk_mb * (1 << 20)),
            )
            try:
                async for update in subscriber.updates(follow=True, keep_encoded=True):
                    assert update.encoded is not None
                    await self._store_step(self.store.add_encoded, update.encoded, update.weights)
                    self._incoming = None
                    self.counters["upstream_versions"] += 1
                    self.metrics.observe(metrics.WEIGHTSYNC_PROPAGATION, time.monotonic() - self.available_at.get(update.version, time.monotonic()))
                    await self._announce()
            except SignatureRefused as exc:
                # Nothing of it was stored or announced; subscribers keep the versions held.
                log.error("upstream %s: %s; still serving version %d", self.config.upstream, exc, self.store.latest)
            except (grpc.aio.AioRpcError, DataLoss, FailedPrecondition, InvalidArgument) as exc:
                # InvalidArgument: the decoder refused what upstream sent (a dtype this
                # build does not know, a chunk its manifest does not list).
                log.warning("upstream %s: %s; retrying", self.config.upstream, exc)
            finally:
                if self._incoming is not None:
                    self._incoming = None
                    self._notify_soon()  # streams re-serving it end now, not at the next version
                await subscriber.close()
            await asyncio.sleep(1.0)

    # ------------------------------------------------------------ RPCs

    async def Publish(self, request_iterator: AsyncIterator[pb.PublishRequest], context: grpc.aio.ServicerContext) -> pb.PublishResponse:
        if self.config.role != "origin":
            raise FailedPrecondition("this weightsync is a relay; publish to the origin")
        started = time.monotonic()
        first = await anext(aiter(request_iterator), None)
        if first is None:
            raise InvalidArgument("Publish stream had no header")
        if not first.HasField("header"):
            raise InvalidArgument("the header must come before any tensor piece")
        header = first.header
        if header.part_count > 1:
            try:
                enc, republish = await self._publish_part(header, request_iterator)
            except _OriginBusy:
                # Marks the ABORTED answer as "this very call, later" for the publisher's client.
                context.set_trailing_metadata((parts.BUSY_METADATA,))
                raise
        else:
            if header.part_index or header.part_tensors or header.part_hash or header.part_encoded:
                raise InvalidArgument(f"version {header.version}: part fields set on a whole-version Publish (part_count {header.part_count})")
            assembly = _Assembly(self.publish_budget)
            try:
                enc, republish = await self._receive_and_store(header, request_iterator, assembly, started)
            finally:
                assembly.release()
        return pb.PublishResponse(version=header.version, raw_bytes=enc.manifest.raw_bytes, encoded_bytes=enc.size)

    async def _stored(self, version: int, enc: Encoded, started: float) -> None:
        """A new version is in the store: stamp, measure and announce it."""
        self._stamp(version)
        self.metrics.observe(metrics.WEIGHTSYNC_PROPAGATION, time.monotonic() - started)
        await self._announce()
        log.info("version %d stored: %d raw bytes -> %d encoded", version, enc.manifest.raw_bytes, enc.size)
        self._prepare_next()

    def _prepare_next(self) -> None:
        """An origin whose latest version has nothing carried for the next delta (it
        published only a keyframe so far, or restarted) builds it now, while it waits for
        that delta (VersionStore.prepare_next): a store step in the background. A Publish
        arriving meanwhile waits for it under the store lock, as it would otherwise have
        built the same itself."""
        if not self.store.unprepared or (self._preparing is not None and not self._preparing.done()):
            return
        self._preparing = asyncio.ensure_future(self._store_step(self.store.prepare_next))
        self._preparing.add_done_callback(_prepared)

    @staticmethod
    async def _receive_pieces(request_iterator: AsyncIterator[pb.PublishRequest], assembly: _Assembly) -> None:
        """The rest of a Publish stream after its header: tensor pieces only."""
        current = ""
        async for item in request_iterator:
            if item.HasField("header"):
                raise InvalidArgument("a Publish stream carries one header")
            if not item.HasField("piece"):
                raise InvalidArgument("empty PublishRequest")
            current = assembly.add(item.piece, current)
        assembly.check_complete()

    async def _receive_and_store(
        self, header: pb.PublishHeader, request_iterator: AsyncIterator[pb.PublishRequest], assembly: _Assembly, started: float
    ) -> tuple[Encoded, bool]:
        await self._receive_pieces(request_iterator, assembly)
        if self.verifier is not None:
            await self._holding(assembly, asyncio.to_thread(self._check_signed, header, assembly.tensors))

        async def store() -> tuple[Encoded, bool]:
            with tracer.start_as_current_span("weightsync.encode", context=telemetry.extract(dict(header.trace_context))) as span:
                span.set_attribute("meridian.version", header.version)
                enc, republish = await self._store_step(self._write_whole, header, assembly.tensors)
                span.set_attribute("meridian.encoded_bytes", enc.size)
            if not republish:
                await self._stored(header.version, enc, started)
            return enc, republish

        return await self._to_completion(store(), assembly)

    def _write_whole(self, header: pb.PublishHeader, tensors: dict[str, RawTensor]) -> tuple[Encoded, bool]:
        """A whole-version Publish's store step (on a thread, under the store lock): the
        encoding and whether the version was held already (a republish)."""
        republish = header.version <= self.store.latest
        enc = self.store.publish(
            header.version, tensors, header.weights_hash, dict(header.trace_context), header.canary,
            header.signature if header.HasField("signature") else None,
        )
        return enc, republish

    async def _store_step(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Runs ``fn(*args)``, which reads or changes the store, on a thread under the store
        lock. The lock is taken before the thread starts and released when the thread
        ends, not when the caller stops waiting: a caller cancelled meanwhile (a subscriber
        that left, a publisher that went away) gets its cancellation at once, but a thread
        cannot be stopped, and releasing the lock under it would let another store step
        (a publish, a prune) run beside it. A caller cancelled while it waits for the lock
        starts nothing."""
        await self._store_lock.acquire()
        try:
            job = asyncio.ensure_future(asyncio.to_thread(fn, *args))
        except BaseException:
            self._store_lock.release()
            raise
        job.add_done_callback(self._store_step_ended)
        return await asyncio.shield(job)

    def _store_step_ended(self, job: asyncio.Future[Any]) -> None:
        self._store_lock.release()
        if not job.cancelled():
            job.exception()  # retrieved: a caller still waiting got it too

    @staticmethod
    async def _holding(stream: _PublishStream, step: Coroutine[Any, Any, _T]) -> _T:
        """Runs ``step``, which holds ``stream``'s tensors (a thread, say), and keeps the
        stream's reservation until it ends: a publisher that goes away meanwhile gets its
        cancellation at once, but the step runs on with the tensors (a thread cannot be
        stopped), and a retry must not reserve a second copy beside them."""
        job = asyncio.ensure_future(step)
        stream.hold_until(job)
        return await asyncio.shield(job)

    async def _to_completion(self, step: Coroutine[Any, Any, _T], holding: _PublishStream | None = None) -> _T:
        """Runs ``step`` (storing a version and announcing it) to its end even if the
        publisher goes away meanwhile: its store thread would finish anyway, and a version
        stored but never announced leaves every subscriber waiting for it (a killed trainer
        republishes it as already held, which announces nothing), while the store lock
        released under a running store thread would let the next version in beside it."""
        # The step holds the stream's tensors to its end.
        return await self._completing.run(step, holding.hold_until if holding is not None else None)

    # ------------------------------------------------------------ sharded publish

    async def _publish_part(self, header: pb.PublishHeader, request_iterator: AsyncIterator[pb.PublishRequest]) -> tuple[Encoded, bool]:
        """One part of a sharded publish (see :mod:`services.weightsync.parts`): received,
        checked against its part hash and encoded as soon as it is in; the part that
        completes the version assembles and stores it; every part answers with the result
        (or the error that aborted the version)."""
        parts.check_part_header(header)
        await self._after_store_of(header.version)
        # Before the encoded part's checks: those compare with a base that storing the
        # other version changes, and a refusal there would send the part raw for nothing.
        self._refuse_while_assembling_another(header)
        if header.part_encoded:
            self._check_encoded_part(header)
        if self._is_stored_part(header):
            return await self._stored_part(header, request_iterator)
        pending = self._join_part(header)
        index = header.part_index
        if index in pending.done:
            # The same part again, already in (its sender's stream broke while it waited for
            # the version): the bytes were checked against this part hash the first time.
            async for _ in request_iterator:
                pass
            return await asyncio.shield(pending.result)
        receiving = _EncodedPart(pending.base or {}, self.store.chunk_bytes, self.publish_budget) if header.part_encoded else _Assembly(self.publish_budget)
        # Parts are taken in at once, so each takes its share of the threads.
        threads = max(1, self.store.encode_threads // pending.count)
        try:
            try:
                changes: Changes | None = None
                if isinstance(receiving, _EncodedPart):
                    await self._receive_chunks(request_iterator, receiving)
                    tensors, encoded, items, changes = await self._decode_part(header, pending, receiving, threads)
                else:
                    await self._receive_pieces(request_iterator, receiving)
                    tensors = receiving.tensors
                    items = await self._holding(receiving, asyncio.to_thread(parts.check_part_tensors, header, tensors))
                    encoded = None
                    if pending.encode:
                        with tracer.start_as_current_span("weightsync.encode_part", context=telemetry.extract(dict(header.trace_context))) as span:
                            span.set_attribute("meridian.version", header.version)
                            span.set_attribute("meridian.part", index)
                            encoded = await self._holding(
                                receiving, asyncio.to_thread(encode_tensors, tensors, pending.base, self.store.chunk_bytes, pending.base_carried, threads)
                            )
            except _NotTheBase as exc:
                # Not a broken part: the rank's copy of the base is not the origin's. The part
                # leaves the version (the others stay) and its rank sends it raw.
                pending.withdraw(index)
                self.counters["encoded_parts_refused"] += 1
                raise FailedPrecondition(f"version {header.version} part {index}: its rank-encoded chunks refused: {exc}; send the part raw") from None
            except BaseException as exc:
                # One bad or broken part spoils the version: the other parts learn why.
                self._abort(pending, Aborted(f"version {header.version} aborted: part {index} of {pending.count} failed: {exc or type(exc).__name__}"))
                raise
            pending.arrived(index, tensors, encoded, items, changes)
            # The version holds the part's tensors now, until it is stored or aborted.
            receiving.hold_until(pending.result)
            if pending.complete:
                self._begin_store(pending)
                await self._to_completion(self._store_parts(pending))
            return await asyncio.shield(pending.result)
        finally:
            receiving.release()

    async def _after_store_of(self, version: int) -> None:
        """Waits for the store step of ``version``'s parts if one is running: a part that
        arrives meanwhile (a rank's retry after its stream broke) is then answered from
        the store, instead of opening a version of its own that waits for parts which
        never come (and refuses every part of the next version meanwhile)."""
        storing = self._storing.get(version)
        if storing is not None:
            await asyncio.wait({storing})

    def _is_stored_part(self, header: pb.PublishHeader) -> bool:
        """Whether a part is of a version the store holds already (or older): answered
        from the store alone. A version being assembled when it was stored by a whole
        Publish still takes its parts, which it then checks as a republish."""
        pending = self._pending
        return header.version <= self.store.latest and (pending is None or pending.version != header.version)

    async def _stored_part(self, header: pb.PublishHeader, request_iterator: AsyncIterator[pb.PublishRequest]) -> tuple[Encoded, bool]:
        """A part of a held version: checked against its part hash and against the held
        version, alone, and answered as a republish of the whole version is (the held
        encoding; ALREADY_EXISTS for other contents). No version is opened for it: a
        late retry of one part must not wait for the others, nor hold the next version up."""
        v, i = header.version, header.part_index
        assembly = _Assembly(self.publish_budget)
        try:
            await self._receive_pieces(request_iterator, assembly)
            await self._holding(assembly, asyncio.to_thread(parts.check_part_tensors, header, assembly.tensors))
            held = await self._holding(assembly, self._compare_stored(v, assembly.tensors, header.weights_hash))
        finally:
            assembly.release()
        if self.verifier is not None and header.signature != held.manifest.signature:
            # Ed25519 is deterministic: the held version's own signature is the only one
            # its (identical) contents can carry.
            raise SignatureRefused(f"version {v} part {i}: its signature is not the held version's")
        log.info("version %d part %d: held already with identical tensors; answered from the store", v, i)
        return held, True

    async def _compare_stored(self, version: int, tensors: dict[str, RawTensor], weights_hash: str) -> Encoded:
        """VersionStore.republished_part, a store step (see _store_step)."""
        return await self._store_step(self.store.republished_part, version, tensors, weights_hash)

    def _check_encoded_part(self, header: pb.PublishHeader) -> None:
        """Refuses (FAILED_PRECONDITION, before the part joins its version) a rank-encoded
        part this origin cannot take as it is: coded against another version than the one
        the parts are coded against, or in other chunks than this origin's, or a version
        held already (a republish is checked against the held one: raw)."""
        v, i = header.version, header.part_index
        pending = self._pending
        latest = self.store.latest
        base = pending.base_version if pending is not None and pending.version == v else latest
        problem = ""
        if v <= latest:
            problem = f"version {v} is held already (latest {latest}): a republished part comes raw, to be checked against it"
        elif header.part_base_version != base:
            problem = f"it is coded against version {header.part_base_version}, the parts of version {v} against {base}"
        elif header.part_chunk_bytes != self.store.chunk_bytes:
            problem = f"it is cut into chunks of {header.part_chunk_bytes} raw bytes, this origin's are {self.store.chunk_bytes} (--chunk-mb)"
        if problem:
            self.counters["encoded_parts_refused"] += 1
            raise FailedPrecondition(f"version {v} part {i}: its rank-encoded chunks refused: {problem}; send the part raw")

    @staticmethod
    async def _receive_chunks(request_iterator: AsyncIterator[pb.PublishRequest], receiving: _EncodedPart) -> None:
        """The rest of a rank-encoded part's stream after its header: chunk payloads only."""
        current = ""
        async for item in request_iterator:
            if not item.HasField("chunks"):
                raise InvalidArgument("a rank-encoded part's stream carries one header, then chunks only")
            current = receiving.add(item.chunks, current)
        receiving.check_complete()

    async def _decode_part(
        self, header: pb.PublishHeader, pending: _PendingVersion, receiving: _EncodedPart, threads: int
    ) -> tuple[dict[str, RawTensor], EncodedTensors, list[parts.HashItem], Changes]:
        """A rank-encoded part decoded onto the base (into the spare buffers where there
        are some) and checked against its part hash (the element-hash sums moved by the
        changes where the base's are known: no pass)."""
        assert pending.base is not None  # _check_encoded_part: encoded parts have a base
        with tracer.start_as_current_span("weightsync.decode_part", context=telemetry.extract(dict(header.trace_context))) as span:
            span.set_attribute("meridian.version", header.version)
            span.set_attribute("meridian.part", header.part_index)
            try:
                decoded = await self._holding(receiving, asyncio.to_thread(
                    decode_tensors, receiving.payloads, pending.base, self.store.chunk_bytes, pending.base_carried, threads, pending.spare
                ))
                items = await self._holding(receiving, asyncio.to_thread(parts.check_part_tensors, header, decoded.weights, decoded.encoded.carried.sums))
            except (CodecError, InvalidArgument) as exc:
                raise _NotTheBase(str(exc)) from None
        self.counters["encoded_parts"] += 1
        return decoded.weights, decoded.encoded, items, decoded.changes

    def _refuse_while_assembling_another(self, header: pb.PublishHeader) -> None:
        """Refuses (ABORTED, marked busy) a part of another version than the one being
        assembled, unless the store holds its version (such a part is answered from the
        store): the origin takes one version's parts at a time. Nothing of the part is
        taken, and the same call can succeed once that version is stored or aborted, at
        most part_timeout_s after its first part: not FAILED_PRECONDITION, which the
        publisher takes as final."""
        pending = self._pending
        v, i = header.version, header.part_index
        if pending is None or pending.version == v or v <= self.store.latest:
            return
        left = max(0.0, pending.timer.when() - asyncio.get_running_loop().time()) if pending.timer is not None else 0.0
        raise _OriginBusy(
            f"version {v} part {i} refused for now: version {pending.version} is being assembled ({len(pending.done)} of {pending.count} parts in, "
            f"aborted unless complete within {left:.0f} s); the origin takes the parts of one version at a time: send this part again"
        )

    def _join_part(self, header: pb.PublishHeader) -> _PendingVersion:
        """Registers a part's header with the version being assembled (starting one, and its
        timeout, at the first part); refuses a part of another version while one is pending
        (ABORTED, see _refuse_while_assembling_another), a part index seen already unless it
        is the same part, in already (ALREADY_EXISTS), and a part that disagrees with the
        others (INVALID_ARGUMENT; the version is aborted)."""
        self._refuse_while_assembling_another(header)
        v, i, n = header.version, header.part_index, header.part_count
        pending = self._pending
        if pending is None:
            # One state of the store: a store step running on its thread meanwhile (the
            # previous version's) must not give the parts its new weights with the old
            # version's indexes, which the encoder refuses as stale.
            held = self.store.held
            latest = held.latest
            pending = _PendingVersion(
                version=v, count=n, fields=parts.version_fields(header), header=header, base_version=latest,
                base=held.weights if latest >= 0 else None, base_carried=held.carried, encode=v > latest,
                spare=self.store.take_spare(latest) if v > latest else None,
            )
            pending.timer = asyncio.get_running_loop().call_later(self.config.part_timeout_s, self._expire, pending)
            self._pending = pending
        if i in pending.names:
            same = i in pending.done and header.part_hash == pending.part_hashes[i] and parts.version_fields(header) == pending.fields
            if same:
                return pending
            state = "is still arriving" if i not in pending.done else "is in with other contents"
            raise AlreadyExists(f"version {v} part {i} arrived twice (the first {state})")
        problem = ""
        if n != pending.count:
            problem = f"part {i} says {n} parts, the first part said {pending.count}"
        elif parts.version_fields(header) != pending.fields:
            problem = f"part {i}'s version fields (weights_hash, signature, canary, trace, metrics) differ from the first part's"
        else:
            try:
                parts.check_disjoint(v, [*pending.names.values(), list(header.part_tensors)])
            except InvalidArgument as exc:
                problem = str(exc)
        if problem:
            error = InvalidArgument(f"version {v}: {problem}")
            self._abort(pending, Aborted(f"version {v} aborted: {problem}"))
            raise error
        pending.names[i] = list(header.part_tensors)
        pending.part_hashes[i] = header.part_hash
        return pending

    def _abort(self, pending: _PendingVersion, error: MeridianError) -> None:
        """Ends a pending version with ``error`` for every part still waiting on it, unless
        its store step started: that step cannot be taken back, and sets the outcome."""
        if pending.storing:
            log.warning("%s; ignored: the version's store step has started", error)
            return
        if self._pending is pending:
            self._pending = None
        if pending.timer is not None:
            pending.timer.cancel()
        if not pending.result.done():
            log.warning("%s", error)
            pending.result.set_exception(error)

    def _expire(self, pending: _PendingVersion) -> None:
        if self._pending is not pending:
            return  # a callback already queued when the version was stored or aborted
        missing = sorted(set(range(pending.count)) - set(pending.done))
        self._abort(pending, DeadlineExceeded(
            f"version {pending.version}: parts {missing[:8]} of {pending.count} were not in (received and encoded) within "
            f"part_timeout_s={self.config.part_timeout_s:g} of the first; "
            "the version is aborted (publish all its parts again)"
        ))

    def _begin_store(self, pending: _PendingVersion) -> None:
        """All parts are in: from here on the version is stored, not expired nor aborted.
        Done in the same step as the last part's arrival, before the store task first
        runs: a part timeout falling due in this loop turn has its callback queued
        already, and would otherwise abort a version whose store step then runs anyway
        (its parts told DEADLINE_EXCEEDED, the version stored)."""
        pending.storing = True
        if pending.timer is not None:
            pending.timer.cancel()  # a handle the loop queued already is skipped, cancelled
        if self._pending is pending:
            self._pending = None
        # Until the store step ends, a part of the version that comes again waits for it (see _after_store_of).
        self._storing[pending.version] = pending.result

    async def _store_parts(self, pending: _PendingVersion) -> None:
        """One manifest of the parts (see _begin_store), checked and stored like a
        whole-version Publish."""
        v = pending.version
        try:
            await self._store_assembled(pending)
        finally:
            if self._storing.get(v) is pending.result:
                del self._storing[v]

    async def _store_assembled(self, pending: _PendingVersion) -> None:
        """_store_parts' store step: sets the version's result (or error) for every part."""
        header, v = pending.header, pending.version
        started = time.monotonic()
        try:
            tensors = dict(pending.tensors)
            if pending.base is not None and pending.encode:
                check_tensor_set(v, tensors, pending.base)
            if self.verifier is not None:
                await asyncio.to_thread(self._check_signed, header, tensors)
            enc, republish = await self._store_step(self._write_assembled, pending, tensors)
        except BaseException as exc:
            error = exc if isinstance(exc, MeridianError) else Aborted(f"version {v} aborted while storing: {exc}")
            if not pending.result.done():
                pending.result.set_exception(error)
            raise
        if not republish:
            await self._stored(v, enc, started)
        pending.result.set_result((enc, republish))

    def _write_assembled(self, pending: _PendingVersion, tensors: dict[str, RawTensor]) -> tuple[Encoded, bool]:
        """_store_assembled's store step (on a thread, under the store lock): the encoding
        and whether the version was held already (a republish)."""
        header, v = pending.header, pending.version
        republish = v <= self.store.latest
        enc = self.store.publish_assembled(
            v, tensors, pending.payloads, pending.base_version, hash_of_sums(pending.items),
            header.weights_hash, dict(header.trace_context), header.canary, header.signature if header.HasField("signature") else None,
            pending.carried, pending.sha256, pending.changes,
        )
        return enc, republish

    def _check_signed(self, header: pb.PublishHeader, tensors: dict[str, RawTensor]) -> None:
        """Refuses (PERMISSION_DENIED) a Publish the trusted key did not sign, or whose
        tensors are not the signed ones, before anything is stored."""
        assert self.verifier is not None
        self.verifier.check(header.version, header.weights_hash, [t.meta(n) for n, t in tensors.items()], header.canary, header.signature)
        if not header.weights_hash:  # the manifest's own hash would differ from the signed one
            raise SignatureRefused(f"version {header.version}: a signed Publish must carry its weights hash")
        self.verifier.check_content(header.version, header.signature, tensors)

    def _find(self, version: int, base: int) -> Encoded | None:
        incoming = self._incoming
        if incoming is not None and (incoming.manifest.version, incoming.manifest.base_version) == (version, base):
            return incoming
        return self.store.find(version, base)

    async def _send_chunks(self, enc: Encoded, start: int) -> AsyncIterator[bytes]:
        """Chunks ``start..`` of ``enc``, consecutive ones that are already here coalesced
        into messages of up to ``message_kib``, each a serialised ``WeightChunk`` (see
        :mod:`~services.weightsync.chunk_messages`); for a version still arriving from
        upstream, each as soon as it is here (a relay never waits to fill a message). Ends
        early (Unavailable) if the arrival was abandoned."""
        total = len(enc.manifest.chunks)
        version, base = enc.manifest.version, enc.manifest.base_version
        limit = self.config.message_kib << 10
        index = start
        while index < total:
            while index >= len(enc.chunks):
                async with self._changed:
                    await self._changed.wait_for(lambda i=index, e=enc: i < len(e.chunks) or self._find(version, base) is not e)
                if index >= len(enc.chunks):
                    # Upstream restarted this version (same bytes: encoding is deterministic),
                    # or it is now stored whole; continue from whichever copy is held.
                    replacement = self._find(version, base)
                    if replacement is None:
                        raise Unavailable(f"version {version} was abandoned mid-transfer upstream; subscribe again")
                    enc = replacement
            first = index
            size = 0
            # A relay's chunks list only grows with chunks that passed their checksum.
            while index < min(total, len(enc.chunks)) and (index == first or size + len(enc.chunks[index]) <= limit):
                size += len(enc.chunks[index])
                index += 1
            await self._send.take(size)
            self.counters["chunks_sent"] += index - first
            self.counters["chunk_bytes_sent"] += size
            yield weight_chunk_message(version, first, enc.chunks[first:index])

    async def _plan(self, held: int) -> list[Encoded]:
        """What to send a subscriber holding ``held``; the plan may build a compacted delta
        or a keyframe, a store step (see _store_step) that runs on if the subscriber leaves."""
        plan = await self._store_step(self.store.plan_compacted, held)
        incoming = self._incoming
        if not plan and incoming is not None and incoming.manifest.base_version == held and held >= 0:
            return [incoming]
        if not plan and incoming is not None and held < 0 and self.store.latest < 0 and incoming.is_keyframe:
            return [incoming]
        return plan

    async def Subscribe(self, request: pb.SubscribeRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.WeightChunk | bytes]:
        held = request.from_version
        if held < -1:
            raise InvalidArgument(f"from_version must be >= -1, got {held}")
        # Manifests travel gzipped: a sha256 and a tensor name per chunk are 13 % of a
        # built-in-model delta's bytes and gzip to a third, on every hop ahead of the
        # chunks. The chunks are compressed already and go as they are.
        context.set_compression(grpc.Compression.Gzip)
        if request.resume:
            enc = self._find(request.resume_version, request.resume_base)
            if enc is not None and request.resume_chunk <= len(enc.manifest.chunks) and request.resume_base in (held, -1):
                # Continue the version the subscriber was receiving: no manifest, the next chunk.
                self.counters["resumed_streams"] += 1
                async for item in self._send_chunks(enc, request.resume_chunk):
                    context.disable_next_message_compression()
                    yield item
                held = request.resume_version
        while True:
            for enc in await self._plan(held):
                yield pb.WeightChunk(manifest=enc.manifest)
                async for item in self._send_chunks(enc, 0):
                    context.disable_next_message_compression()
                    yield item
                held = enc.manifest.version
            if not request.follow:
                return
            async with self._changed:
                await self._changed.wait_for(lambda h=held: self._has_news(h))

    def _has_news(self, held: int) -> bool:
        incoming = self._incoming
        return self.store.latest > held or (incoming is not None and incoming.manifest.base_version == held and incoming.manifest.version > held)

    async def FetchChunk(self, request: pb.FetchChunkRequest, context: grpc.aio.ServicerContext) -> pb.ChunkData:
        enc = self._find(request.version, request.base_version)
        if enc is None:
            raise NotFound(f"version {request.version} on base {request.base_version} is not held (latest {self.store.latest})")
        if not 0 <= request.index < len(enc.manifest.chunks):
            raise InvalidArgument(f"chunk {request.index} is outside version {request.version}'s {len(enc.manifest.chunks)} chunks")
        if request.index >= len(enc.chunks):
            raise NotFound(f"chunk {request.index} of version {request.version} has not arrived here yet")
        payload = enc.chunks[request.index]
        await self._send.take(len(payload))
        self.counters["chunk_fetches"] += 1
        self.counters["chunk_bytes_sent"] += len(payload)
        return pb.ChunkData(version=request.version, index=request.index, data=payload)

    async def GetManifest(self, request: pb.GetManifestRequest, context: grpc.aio.ServicerContext) -> pb.Manifest:
        return self.store.manifest(request.version)

    async def _metric_values(self) -> list[metrics.Value]:
        """What the metrics endpoint exports: the Status figures."""
        return metrics.weightsync_values(await self.Status(pb.WeightSyncStatusRequest(), None))  # type: ignore[arg-type]

    async def Status(self, request: pb.WeightSyncStatusRequest, context: grpc.aio.ServicerContext) -> pb.WeightSyncStatus:
        held = self.store.held  # every figure from one state, whatever a store thread does meanwhile
        return pb.WeightSyncStatus(
            latest_version=held.latest,
            versions=held.versions(),
            stored_bytes=held.stored_bytes(),
            role=self.config.role,
            compacted_built=held.compacted_built,
            chunk_bytes=self.store.chunk_bytes,
            **self.counters,
        )


def _prepared(job: asyncio.Future[bool]) -> None:
    """Logs an origin's build ahead that failed: the next publish builds what it lacks."""
    if not job.cancelled() and job.exception() is not None:
        log.warning("weightsync: building the next delta's indexes ahead failed: %s", job.exception())
