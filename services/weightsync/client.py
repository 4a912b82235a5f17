"""Weightsync clients: the publisher (trainer side) and the subscriber (rollout and
relay side), which verifies and decodes every version before handing it over."""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence

import grpc

from meridian.errors import DataLoss
from meridian.grpc_runtime import ended_while_sending, open_channel
from meridian.v1 import weightsync_pb2 as pb
from meridian.v1 import weightsync_pb2_grpc as pb_grpc
from services.weightsync import parts
from services.weightsync.parts import TensorDigest
from services.weightsync.ratelimit import TokenBucket
from services.weightsync.receiver import ChunkChecksumError, Decoder, UndoLog
from services.weightsync.signing import Signer, Verifier
from services.weightsync.versions import Encoded, EncodedTensors
from meridian.tensors import PB_DTYPES, RawTensor, Weights, weights_hash

log = logging.getLogger(__name__)

#: Transport failures worth reconnecting for (a cut link, a restarting peer).
RETRYABLE = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN,
     grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL, grpc.StatusCode.RESOURCE_EXHAUSTED}
)

PIECE_BYTES = 2 << 20

#: How long :func:`publish_part` keeps sending a part again that the origin refused as busy
#: with another version's parts: longer than the origin's default part_timeout_s (120 s),
#: the longest such a version holds it before it is stored or aborted.
BUSY_TIMEOUT_S = 150.0
#: The first and the longest pause between those tries (doubling in between).
BUSY_PAUSE_S = (0.1, 2.0)

#: Chunks up to this size are checked on the event loop: handing one to a thread costs
#: more than hashing it (sha256 runs at about 1 GB/s: 64 KiB is ~60 µs).
VERIFY_INLINE_BYTES = 64 << 10


def window_options(window_bytes: int) -> list[tuple[str, int]]:
    """Channel options that fix a receiver's HTTP/2 flow-control window at ``window_bytes``
    (0: gRPC's adaptive window, which starts at 64 KiB and grows by probing the
    bandwidth-delay product over several round trips; a window below the BDP caps a stream
    at window / RTT). gRPC honours the lookahead only with BDP probing off."""
    if window_bytes <= 0:
        return []
    return [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", int(window_bytes))]


def publish_header(
    version: int,
    weights: Weights,
    trace_context: Mapping[str, str] | None = None,
    metrics: Mapping[str, float] | None = None,
    canary: pb.Canary | None = None,
    signer: Signer | None = None,
) -> pb.PublishHeader:
    """The header of one version's Publish stream, signed by ``signer`` when given
    (full passes over the weights: call it off the event loop for large ones)."""
    digest = weights_hash(weights)
    return pb.PublishHeader(
        version=version,
        weights_hash=digest,
        trace_context=dict(trace_context or {}),
        metrics=dict(metrics or {}),
        canary=canary,
        signature=signer.sign(version, digest, weights, canary) if signer is not None else None,
    )


def publish_requests(
    version: int,
    weights: Weights,
    trace_context: Mapping[str, str] | None = None,
    metrics: Mapping[str, float] | None = None,
    canary: pb.Canary | None = None,
    *,
    signer: Signer | None = None,
    header: pb.PublishHeader | None = None,
) -> Iterator[pb.PublishRequest]:
    """The Publish stream for one version: header (``header`` when given, else made
    here and signed by ``signer``), then each tensor in pieces."""
    if header is None:
        header = publish_header(version, weights, trace_context, metrics, canary, signer)
    yield pb.PublishRequest(header=header)
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
    address: str,
    version: int,
    weights: Weights,
    trace_context: Mapping[str, str] | None = None,
    metrics: Mapping[str, float] | None = None,
    canary: pb.Canary | None = None,
    signer: Signer | None = None,
) -> pb.PublishResponse:
    """Publishes one version to a weightsync origin (``canary``: see :mod:`meridian.canary`),
    signed by ``signer`` when given (see :mod:`services.weightsync.signing`)."""
    header = await asyncio.to_thread(publish_header, version, weights, trace_context, metrics, canary, signer)
    async with open_channel(address) as channel:
        stub = pb_grpc.WeightSyncStub(channel)
        return await stub.Publish(publish_requests(version, weights, header=header))


def version_header_from_digests(
    version: int,
    digests: Mapping[str, TensorDigest],
    trace_context: Mapping[str, str] | None = None,
    metrics: Mapping[str, float] | None = None,
    canary: pb.Canary | None = None,
    signer: Signer | None = None,
) -> pb.PublishHeader:
    """The version fields every part of a sharded publish carries, made from every
    tensor's digests (:func:`parts.tensor_digests` on each rank, gathered): the same
    ``weights_hash`` and signature :func:`publish_header` gives over the whole weights."""
    digest, content = parts.combine(digests)
    metas = [pb.TensorMeta(name=n, dtype=PB_DTYPES[d.dtype], shape=d.shape) for n, d in digests.items()]
    return pb.PublishHeader(
        version=version,
        weights_hash=digest,
        trace_context=dict(trace_context or {}),
        metrics=dict(metrics or {}),
        canary=canary,
        signature=signer.sign_digests(version, digest, content, metas, canary) if signer is not None else None,
    )


def origin_busy(exc: grpc.aio.AioRpcError) -> bool:
    """Whether ``exc`` is an origin's refusal of a part while it assembles another
    version's parts (ABORTED with :data:`parts.BUSY_METADATA`): nothing of the part was
    taken, and the same call can succeed later."""
    if exc.code() != grpc.StatusCode.ABORTED:
        return False
    return any((key, value) == parts.BUSY_METADATA for key, value in (exc.trailing_metadata() or ()))


async def publish_part(
    address: str, version_header: pb.PublishHeader, index: int, count: int, weights: Weights, encoder: parts.PartEncoder | None = None,
    *, busy_timeout_s: float = BUSY_TIMEOUT_S,
) -> pb.PublishResponse:
    """Publishes part ``index`` of ``count`` of a sharded version: this rank's tensors
    under the version fields every part shares. Returns once the origin stored the whole
    version (every part gets the same answer) or aborted it.

    With an ``encoder`` (kept by the rank from version to version) the part goes as chunk
    payloads encoded here against the rank's part of the version before, when it holds
    that; when the origin refuses them (FAILED_PRECONDITION: it holds another base or cuts
    other chunks) the part goes raw at once. Either way the encoder then holds this part.

    An origin assembling another version's parts refuses the part (ABORTED, marked busy,
    see :func:`origin_busy`): it is sent again, after pauses growing from 0.1 s to 2 s,
    for up to ``busy_timeout_s``, after which that refusal is raised. So is a part whose
    refusal the client lost (the origin refuses after the part's header, often while the
    client still writes its chunks, and grpcio's client then reports its own INTERNAL:
    :func:`~meridian.grpc_runtime.ended_while_sending`); sent again, it hears the
    refusal. Other errors, and the ABORTED of the part's own version, are raised at once
    (the caller retries them on the schedule every rank follows)."""
    header = await asyncio.to_thread(parts.part_header, version_header, index, count, weights)
    async with open_channel(address) as channel:
        stub = pb_grpc.WeightSyncStub(channel)
        # Encoded once: the payloads depend on the encoder's base and the weights alone.
        encoded = await _encode_part(stub, weights, encoder) if encoder is not None else None
        loop = asyncio.get_running_loop()
        give_up = loop.time() + busy_timeout_s
        pause = BUSY_PAUSE_S[0]
        while True:
            try:
                return await _send_part(stub, header, weights, encoder, encoded)
            except _RefusedEncoded:
                encoded = None  # the part goes raw from now on (see _send_part)
                continue
            except grpc.aio.AioRpcError as exc:
                if not (origin_busy(exc) or ended_while_sending(exc)) or loop.time() + pause > give_up:
                    raise
                log.info("version %d part %d: %s; sending it again in %.1f s", header.version, index, exc.details(), pause)
            await asyncio.sleep(pause)
            pause = min(2 * pause, BUSY_PAUSE_S[1])


class _RefusedEncoded(Exception):
    """The origin refused a part's encoded chunks (FAILED_PRECONDITION): it goes raw."""


async def _send_part(
    stub: pb_grpc.WeightSyncStub, header: pb.PublishHeader, weights: Weights, encoder: parts.PartEncoder | None, encoded: EncodedTensors | None
) -> pb.PublishResponse:
    """One try of a part: as ``encoded`` chunks when given (raises _RefusedEncoded when
    the origin will not take them), else raw; the encoder then holds the part."""
    if encoded is not None:
        assert encoder is not None
        return await _publish_encoded_part(stub, header, weights, encoder, encoded)
    reply = await stub.Publish(publish_requests(header.version, weights, header=header))
    if encoder is not None:
        encoder.advance(header.version, weights, None)
    return reply


async def _encode_part(stub: pb_grpc.WeightSyncStub, weights: Weights, encoder: parts.PartEncoder) -> EncodedTensors | None:
    """The part encoded against the encoder's base; None when it cannot be (no base held)."""
    if encoder.base_version >= 0 and encoder.chunk_bytes <= 0:
        encoder.chunk_bytes = int((await stub.Status(pb.WeightSyncStatusRequest())).chunk_bytes)
    if not encoder.can_encode(weights):
        return None
    return await asyncio.to_thread(encoder.encode, weights)


async def _publish_encoded_part(
    stub: pb_grpc.WeightSyncStub, header: pb.PublishHeader, weights: Weights, encoder: parts.PartEncoder, encoded: EncodedTensors
) -> pb.PublishResponse:
    """The part sent as ``encoded`` chunk payloads; raises _RefusedEncoded when the
    origin refuses them (it holds another base, cuts other chunks): send it raw."""
    coded = pb.PublishHeader()
    coded.CopyFrom(header)
    coded.part_encoded, coded.part_base_version, coded.part_chunk_bytes = True, encoder.base_version, encoder.chunk_bytes
    try:
        reply = await stub.Publish(encoded_part_requests(coded, weights, encoded.payloads))
    except grpc.aio.AioRpcError as exc:
        if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
            raise  # the encoder keeps its base: a retry (a busy origin's too) sends the part encoded again
        # Refused as encoded (or for a reason the raw part meets again, and then raises).
        log.warning("version %d part %d goes raw: %s", header.version, header.part_index, exc.details())
        encoder.forget()
        raise _RefusedEncoded(exc.details()) from None
    encoder.advance(header.version, weights, encoded.carried)
    return reply


def encoded_part_requests(
    header: pb.PublishHeader, weights: Weights, payloads: Mapping[str, list[bytes]], message_bytes: int = PIECE_BYTES
) -> Iterator[pb.PublishRequest]:
    """A rank-encoded part's Publish stream: its header, then each tensor's chunk payloads
    in order, consecutive ones coalesced into messages of up to ``message_bytes`` (one
    larger payload goes alone), the tensor's first message with its meta."""
    yield pb.PublishRequest(header=header)
    for name in sorted(payloads):
        batch: list[bytes] = []
        size = 0
        first = True
        for payload in payloads[name]:
            if batch and size + len(payload) > message_bytes:
                yield pb.PublishRequest(chunks=pb.PartChunks(meta=weights[name].meta(name) if first else None, payloads=batch))
                batch, size, first = [], 0, False
            batch.append(payload)
            size += len(payload)
        yield pb.PublishRequest(chunks=pb.PartChunks(meta=weights[name].meta(name) if first else None, payloads=batch))


async def latest_version(address: str, timeout_s: float = 10.0) -> int:
    """The newest version the weightsync service at ``address`` holds (-1: none)."""
    async with open_channel(address) as channel:
        reply = await pb_grpc.WeightSyncStub(channel).Status(pb.WeightSyncStatusRequest(), timeout=timeout_s)
        return reply.latest_version


async def manifest(address: str, version: int, timeout_s: float = 10.0) -> pb.Manifest:
    """The manifest of one stored version (NOT_FOUND when the origin does not hold it)."""
    async with open_channel(address) as channel:
        return await pb_grpc.WeightSyncStub(channel).GetManifest(pb.GetManifestRequest(version=version), timeout=timeout_s)


@dataclasses.dataclass
class VersionUpdate:
    """A verified version: the full weights, and the encoded form when asked for.

    With an in-place subscriber ``weights`` are the subscriber's own buffers: they
    change when the next version is applied, and ``undo`` (O(changed elements)) is how
    to get the previous version back (``undo.previous_weights(weights)``)."""

    version: int
    weights: dict[str, RawTensor]
    manifest: pb.Manifest
    encoded: Encoded | None = None
    undo: UndoLog | None = None


@dataclasses.dataclass
class SubscriberStats:
    """What a subscriber went through (tests and benches read it)."""

    chunks: int = 0            # chunks received that passed their checksum
    chunk_bytes: int = 0
    reconnects: int = 0        # new Subscribe calls after a failure
    resumed: int = 0           # ...of which continued mid-version
    refetched: int = 0         # chunks fetched again after a checksum failure


ChunkHook = Callable[[pb.Manifest, int, bytes], None]


class WeightSubscriber:
    """Follows a weightsync from the version it holds, yielding verified full versions.

    Robust to the link: a cut stream is reopened with a resume point (the version being
    received, its base and the next chunk), so only the missing chunks travel again; a
    chunk failing its checksum is fetched again with ``FetchChunk``; chunks are decoded on
    a thread pool while the next ones arrive. ``max_attempts`` consecutive failures
    without progress end the iteration with the last gRPC error.

    ``in_place=True`` keeps one buffer per tensor and writes only the changed elements
    of each delta into it (see :class:`Decoder`): the cheapest way to follow, for a
    holder that only needs the latest version (or rolls back with ``update.undo``).
    The default gives every version fresh buffers, so earlier updates stay valid.
    ``decode_threads``: chunks decoded at once (0: one thread per CPU core this process may run on).
    ``decode_nice`` lowers the decode threads' CPU priority (a relay, whose decoding
    is off its forwarding path). ``window_bytes`` fixes the stream's HTTP/2 flow-control
    window (see :func:`window_options`); size it to the link's bandwidth-delay product.
    ``origin_chunk_bytes``: the origin's chunk size (its ``chunk_mb``), when known; a
    subscriber handed weights then prepares them for deltas (their hash sums and position
    indexes) on its decode threads as soon as it follows, not at the first delta.
    With a ``verifier`` only versions signed by its key are taken (see :class:`Decoder`):
    a refused one raises :class:`~services.weightsync.signing.SignatureRefused` out of
    :meth:`updates` before ``on_manifest`` sees its manifest, with the held weights
    unchanged.
    """

    def __init__(
        self,
        address: str,
        weights: Weights | None,
        version: int,
        *,
        max_attempts: int = 8,
        decode_threads: int = 0,
        max_mib_s: float = 0.0,
        on_manifest: Callable[[pb.Manifest], None] | None = None,
        on_chunk: ChunkHook | None = None,
        in_place: bool = False,
        decode_nice: int = 0,
        window_bytes: int = 0,
        verifier: Verifier | None = None,
        origin_chunk_bytes: int = 0,
    ) -> None:
        self.address = address
        self.decoder = Decoder(weights, version if weights else -1, in_place=in_place, verifier=verifier)
        self._channel = open_channel(address, options=window_options(window_bytes))
        self.max_attempts = max_attempts
        self.stats = SubscriberStats()
        self._bucket = TokenBucket.mib_per_s(max_mib_s)
        # Every core by default: a frontier model's version is terabytes of weights, and
        # the decode threads only run while a version arrives.
        self._threads = decode_threads or len(os.sched_getaffinity(0))
        self._pool = concurrent.futures.ThreadPoolExecutor(
            self._threads, thread_name_prefix="ws-decode", initializer=_lower_priority, initargs=(decode_nice,)
        )
        self._on_manifest = on_manifest
        self._on_chunk = on_chunk
        self._warming: list[asyncio.Future[None]] = []  # index builds and sums in flight (see _warm_indexes)
        self._origin_chunk_bytes = origin_chunk_bytes if weights else 0  # cleared once the held weights are warmed

    async def close(self) -> None:
        await self._channel.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def updates(self, follow: bool = True, keep_encoded: bool = False) -> AsyncIterator[VersionUpdate]:
        """Every version after the one held, verified; with ``follow`` new ones as published."""
        receiving = _Receiving(None, keep_encoded)
        self._warm_held()
        try:
            async with contextlib.aclosing(self._follow(receiving, follow, keep_encoded)) as versions:
                async for update in versions:
                    yield update
        finally:
            # A version left half applied (error, or the caller stopped) must not stay
            # in the held buffers: wait for its decodes, then revert it.
            await receiving.settle()
            self.decoder.abort()

    async def _follow(self, receiving: _Receiving, follow: bool, keep_encoded: bool) -> AsyncIterator[VersionUpdate]:
        failures = 0
        while True:
            request = pb.SubscribeRequest(from_version=self.decoder.version, follow=follow)
            if receiving.manifest is not None:
                request.resume = True
                request.resume_version = receiving.manifest.version
                request.resume_base = receiving.manifest.base_version
                request.resume_chunk = receiving.next_chunk
            call = pb_grpc.WeightSyncStub(self._channel).Subscribe(request)
            first = True
            try:
                async for item in call:
                    failures = 0
                    if first and request.resume and not item.HasField("manifest"):
                        self.stats.resumed += 1
                    first = False
                    if item.HasField("manifest"):
                        await receiving.drain()
                        await self._begin(item.manifest)
                        receiving.reset(item.manifest)
                        if self._on_manifest is not None:
                            self._on_manifest(item.manifest)
                        continue
                    chunks = item.batch.chunks if item.HasField("batch") else (item.chunk,)
                    update = await self._take_chunks(receiving, chunks)
                    if update is not None:
                        receiving.reset(None)
                        yield update
                if not follow and receiving.manifest is None:
                    return
                # A follow stream (or a version) that ended early: the server is going away.
                failures += 1
                reason = "stream ended"
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in RETRYABLE or failures + 1 >= self.max_attempts:
                    raise
                failures += 1
                reason = exc.code().name
            finally:
                call.cancel()
            if failures >= self.max_attempts:
                raise DataLoss(f"weightsync {self.address}: subscription keeps ending early ({reason})")
            self.stats.reconnects += 1
            delay = min(2.0, 0.1 * 2 ** (failures - 1))
            log.info("weightsync %s: %s; reconnecting in %.1fs", self.address, reason, delay)
            await asyncio.sleep(delay)

    async def _begin(self, manifest: pb.Manifest) -> None:
        """Starts ``manifest``'s version. The first delta of a decoder needs one full pass
        over the held weights (their element-hash sums): it runs on a thread, or a relay
        would stop forwarding to every subscriber of its own for as long as that pass
        takes, at each reconnect upstream (each builds a new subscriber). The manifest's
        refusals (a signature check among them) are made once, before that pass."""
        self.decoder.check(manifest)
        await self._indexes_built()
        if self.decoder.needs_prepare(manifest):
            job = asyncio.ensure_future(asyncio.to_thread(self.decoder.prepare))
            try:
                await asyncio.shield(job)
            except asyncio.CancelledError:
                # The thread runs on: nothing may touch the weights it reads until it ends.
                await asyncio.wait({job})
                raise
        self.decoder.begin(manifest, checked=True)  # only this subscriber's task changes the decoder

    async def _take_chunks(self, receiving: _Receiving, chunks: Sequence[pb.ChunkData]) -> VersionUpdate | None:
        """Verifies one message's chunks in order, hands each to ``on_chunk`` once it passed
        its checksum (a relay forwards it from there), and decodes them on the pool."""
        manifest = receiving.manifest
        await self._bucket.take(sum(len(c.data) for c in chunks))
        taken: list[tuple[int, bytes]] = []
        try:
            for chunk in chunks:
                if manifest is None or chunk.version != manifest.version:
                    raise DataLoss(f"chunk of version {chunk.version} without its manifest")
                if chunk.index != receiving.next_chunk:
                    raise DataLoss(f"version {manifest.version}: chunk {chunk.index} arrived, {receiving.next_chunk} expected")
                data = chunk.data
                try:
                    if len(data) <= VERIFY_INLINE_BYTES:
                        self.decoder.verify(chunk.index, data)
                    else:
                        await asyncio.to_thread(self.decoder.verify, chunk.index, data)
                except ChunkChecksumError:
                    data = await self._refetch(manifest, chunk.index)
                self.stats.chunks += 1
                self.stats.chunk_bytes += len(data)
                if self._on_chunk is not None:
                    self._on_chunk(manifest, chunk.index, data)
                receiving.add(chunk.index, data)
                taken.append((chunk.index, data))
        finally:
            # Chunks taken count as received (a resumed stream starts after them), so
            # they are decoded even when a later one of the message failed.
            self._decode(receiving, taken)
        assert manifest is not None
        if receiving.next_chunk < len(manifest.chunks):
            if not receiving.keep:
                # Bounds the payloads waiting for a decode thread. Kept chunks are held
                # anyway, and a relay must not slow its forwarding down to its decoding.
                await receiving.bound(2 * self._threads)
            return None
        await receiving.drain()
        encoded = receiving.encoded()
        version = await asyncio.to_thread(self.decoder.finish)
        self._warm_indexes()
        return VersionUpdate(version, self.decoder.weights, manifest, encoded, self.decoder.last_undo)

    def _warm_indexes(self, chunk_bytes: int = 0) -> None:
        """Builds on the decode pool, while the next version is awaited, the position
        indexes its delta would otherwise build as its chunks arrive: those of the chunks
        the version just finished rewrote whole (a keyframe: the first version of a
        subscriber that starts empty, or of a late joiner), or with ``chunk_bytes`` every
        chunk of the held weights (see :meth:`_warm_held`). Without it the first delta after
        a keyframe costs a pass over the model at every hop (about twice the propagation of
        the next ones on the built-in model)."""
        chunks = self.decoder.unindexed(chunk_bytes)
        if not chunks:
            return
        per_job = -(-len(chunks) // self._threads)
        self._warming += [
            asyncio.wrap_future(self._pool.submit(self.decoder.build_indexes, chunks[lo : lo + per_job])) for lo in range(0, len(chunks), per_job)
        ]

    def _warm_held(self) -> None:
        """For a subscriber handed weights with ``origin_chunk_bytes`` (a restarted rollout,
        a relay subscribing again): their element-hash sums and the position indexes of
        their chunks in the origin's chunking, on the decode pool as soon as it follows,
        instead of both passes at its first delta. Chunks cut otherwise are built again
        then, as without this. Once per subscriber."""
        chunk_bytes, self._origin_chunk_bytes = self._origin_chunk_bytes, 0
        if chunk_bytes <= 0 or self.decoder.version < 0 or self.decoder.manifest is not None:
            return
        self._warming.append(asyncio.wrap_future(self._pool.submit(self.decoder.prepare)))
        self._warm_indexes(chunk_bytes)

    async def _indexes_built(self) -> None:
        """Waits for the work of :meth:`_warm_indexes` and :meth:`_warm_held` still running:
        it reads the held weights, which the next version writes. A build that failed leaves
        its chunks (or the sums) to the next delta, which builds what it lacks."""
        warming, self._warming = self._warming, []
        if not warming:
            return
        try:
            results = await asyncio.shield(asyncio.gather(*warming, return_exceptions=True))
        except asyncio.CancelledError:
            await asyncio.wait(warming)  # the threads run on: nothing may write the weights first
            raise
        for exc in results:
            if exc is not None:
                log.warning("weightsync %s: preparing the held weights ahead failed: %s", self.address, exc)

    def _decode(self, receiving: _Receiving, taken: list[tuple[int, bytes]]) -> None:
        """Decodes ``taken`` on the pool in at most one job per thread: a job per small
        chunk would cost more in hand-offs than the decoding itself."""
        if not taken:
            return
        per_job = -(-len(taken) // self._threads)
        for lo in range(0, len(taken), per_job):
            job = taken[lo : lo + per_job]
            receiving.pending.append(asyncio.wrap_future(self._pool.submit(self._decode_job, job)))

    def _decode_job(self, job: list[tuple[int, bytes]]) -> None:
        for index, data in job:
            self.decoder.add_chunk(index, data, True)

    async def _refetch(self, manifest: pb.Manifest, index: int, attempts: int = 3) -> bytes:
        """Fetches chunk ``index`` again until it passes its checksum."""
        stub = pb_grpc.WeightSyncStub(self._channel)
        for attempt in range(attempts):
            self.stats.refetched += 1
            reply = await stub.FetchChunk(pb.FetchChunkRequest(version=manifest.version, base_version=manifest.base_version, index=index))
            await self._bucket.take(len(reply.data))
            try:
                await asyncio.to_thread(self.decoder.verify, index, reply.data)
                return reply.data
            except ChunkChecksumError:
                log.warning("chunk %d of version %d corrupt again (attempt %d)", index, manifest.version, attempt + 1)
        raise DataLoss(f"chunk {index} of version {manifest.version} failed its checksum {attempts + 1} times")


class _Receiving:
    """The version being received: the manifest, chunks taken so far, decodes in flight."""

    def __init__(self, manifest: pb.Manifest | None, keep_encoded: bool) -> None:
        self.keep = keep_encoded
        self.reset(manifest)

    def reset(self, manifest: pb.Manifest | None) -> None:
        """Starts receiving ``manifest``'s version (None: between versions)."""
        self.manifest = manifest
        self.next_chunk = 0
        self.chunks: list[bytes] = []
        self.pending: list[asyncio.Future[None]] = []

    async def settle(self) -> None:
        """Waits for every decode in flight, ignoring their errors."""
        for f in self.pending:
            with contextlib.suppress(BaseException):
                await f
        self.pending = []

    def add(self, index: int, data: bytes) -> None:
        """Records chunk ``index`` as received and verified (its decode is queued apart)."""
        self.next_chunk = index + 1
        if self.keep:
            self.chunks.append(data)

    async def bound(self, limit: int) -> None:
        """Waits while more than ``limit`` decodes are in flight (bounds memory)."""
        self.pending = [f for f in self.pending if not f.done() or f.exception() is not None]
        for f in [f for f in self.pending if f.done()]:
            f.result()  # raises the decode error
        while len(self.pending) > limit:
            await self.pending.pop(0)

    async def drain(self) -> None:
        while self.pending:
            await self.pending.pop(0)

    def encoded(self) -> Encoded | None:
        assert self.manifest is not None
        return Encoded(self.manifest, self.chunks) if self.keep else None


def _lower_priority(nice: int) -> None:
    """Thread initializer: raises this thread's nice value (Linux applies it per thread)."""
    if nice > 0:
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
