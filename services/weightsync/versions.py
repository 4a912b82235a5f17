"""What travels between weightsync peers: one version as a manifest and its chunk
payloads, the codec name manifests carry, and how a version is encoded against the one
before it. Shared by the origin's store and every receiver."""
from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
from collections.abc import Callable, Mapping
from typing import TypeVar

import numpy as np

from meridian import elementhash
from meridian.errors import InvalidArgument
from meridian.tensors import RawTensor, Weights, hash_of_sums
from meridian.v1 import weightsync_pb2 as pb
from services.weightsync import codec

#: Chunk codec and weights-hash scheme of the manifests this code writes.
CODEC_NAME = "meridian-idx-rice-v3+ehash2"
#: Names a receiver reads: the chunk decoder reads every payload format, so versions of an
#: origin that wrote format 1 still decode. Versions under any other name (e.g. the older
#: sha256 weights hash) are not recovered, and subscribers refuse them.
READABLE_CODECS = (CODEC_NAME, "meridian-ctx-rice-v1+ehash2")
#: Payload format of delta chunks: 3 codes changed positions over a per-chunk *position
#: index* of the base (see codec/format.py), which sender and receiver each keep current
#: from the change lists, so applying a version costs in proportion to its changes. It is
#: coded without the previous delta as context: that context would depend on the path a
#: receiver took (a keyframe or compacted delta gives none), the index does not.
CHUNK_FORMAT = 3

_T = TypeVar("_T")

#: Per tensor, the position index of each chunk of one version's weights (None where none
#: is kept: rebuilt, a pass over that chunk, when a delta needs it).
Indexes = dict[str, list[codec.ChunkIndex | None]]


@dataclasses.dataclass
class Carried:
    """What encoding a version leaves for encoding the next one against it, so that the
    origin passes over the model once per version (the codec's diff) and not three times:
    each chunk's position index, and each tensor's element-hash sums (the weights hash of
    the next version is these sums moved by its changes). Missing entries are computed."""

    indexes: Indexes = dataclasses.field(default_factory=dict)
    sums: dict[str, elementhash.Sums] = dataclasses.field(default_factory=dict)


def chunk_ranges(numel: int, itemsize: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """(start, element count) of each chunk a tensor of ``numel`` elements of ``itemsize``
    bytes is cut into with chunks of ``chunk_bytes`` raw bytes, as :func:`encode_tensors`
    cuts it (an empty tensor is one empty chunk)."""
    per_chunk = max(1, chunk_bytes // itemsize)
    return [(start, min(per_chunk, numel - start)) for start in range(0, max(numel, 1), per_chunk)]


def carried_for(weights: Weights, chunk_bytes: int) -> Carried:
    """What encoding a delta against ``weights`` needs first, built ahead (a pass over the
    model): each chunk's position index, cut as :func:`encode_tensors` cuts the tensors
    into chunks of ``chunk_bytes``, with the codec's threshold rule, and each tensor's
    element-hash sums. An origin builds it while it waits for a version after a keyframe
    or a restart, instead of in the next publish."""
    indexes: Indexes = {
        name: [codec.build_index(t.bits, t.dtype, start, count) for start, count in chunk_ranges(t.bits.shape[0], t.bits.itemsize, chunk_bytes)]
        for name, t in weights.items()
    }
    names = sorted(weights)
    sums = dict(zip(names, elementhash.many_tensor_sums([np.ascontiguousarray(weights[n].bits) for n in names])))
    return Carried(indexes, sums)


@dataclasses.dataclass
class Encoded:
    """One version as sent: a manifest and its chunk payloads (index-aligned)."""

    manifest: pb.Manifest
    chunks: list[bytes]
    #: What the encoding left for coding the next delta against this version's weights.
    #: Kept by the origin's store for its latest version only.
    carried: Carried = dataclasses.field(default_factory=Carried, repr=False, compare=False)

    @property
    def size(self) -> int:
        return sum(len(c) for c in self.chunks)

    @property
    def is_keyframe(self) -> bool:
        return self.manifest.base_version < 0


def encode_version(
    version: int,
    weights: Weights,
    base: Weights | None,
    base_version: int,
    chunk_bytes: int,
    trace_context: Mapping[str, str] | None = None,
    canary: pb.Canary | None = None,
    signature: pb.VersionSignature | None = None,
    carried: Carried | None = None,
    threads: int = 1,
) -> Encoded:
    """Encodes ``weights`` as a delta against ``base`` (or a keyframe when base is None);
    ``trace_context``, ``canary`` and the publisher's ``signature`` describe the version
    and go into its manifest as given (the signature covers no part of the encoding).
    ``carried``: what the encoding that produced ``base`` left (see :class:`Carried`);
    the result's ``carried`` is the same for ``weights``. ``threads``: tensors encoded at
    once (see :func:`encode_tensors`)."""
    check_tensor_set(version, weights, base)
    tensors = encode_tensors(weights, base, chunk_bytes, carried, threads)
    sums = tensors.carried.sums
    missing = sorted(n for n in weights if n not in sums)
    sums.update(zip(missing, elementhash.many_tensor_sums([np.ascontiguousarray(weights[n].bits) for n in missing])))
    digest = hash_of_sums([(n, t.dtype, tuple(t.shape), sums[n]) for n, t in weights.items()])
    enc = assemble_version(
        version, weights, tensors.payloads, base_version if base is not None else -1, digest, trace_context, canary, signature, tensors.sha256
    )
    enc.carried = tensors.carried
    return enc


def check_tensor_set(version: int, weights: Weights, base: Weights | None) -> None:
    """Refuses a version whose tensor names differ from its base's (INVALID_ARGUMENT)."""
    if base is not None and set(base) != set(weights):
        missing, extra = sorted(set(base) - set(weights)), sorted(set(weights) - set(base))
        raise InvalidArgument(f"version {version} changes the tensor set (missing {missing[:3]}, new {extra[:3]})")


@dataclasses.dataclass
class EncodedTensors:
    """The chunk payloads of some tensors of a version, and what they leave for the next
    (indexes of every delta-coded tensor; sums of those whose base sums were carried and
    whose chunks are all deltas: the others are left out, to be computed)."""

    payloads: dict[str, list[bytes]]
    carried: Carried
    #: Each payload's sha256 (hex), computed beside its encoding on the same thread.
    sha256: dict[str, list[str]] = dataclasses.field(default_factory=dict)


def encode_tensors(weights: Weights, base: Weights | None, chunk_bytes: int, carried: Carried | None = None, threads: int = 1) -> EncodedTensors:
    """The chunk payloads of each tensor of ``weights`` (a delta against ``base``'s tensor
    of the same name, or a keyframe when base is None), with ``carried`` as in
    :func:`encode_version`. A tensor's payloads depend only on the tensor, its base (and
    its index, itself a function of the base and the threshold it was built with) and
    ``chunk_bytes``, so disjoint subsets of a version can be encoded apart (one worker per
    sharded-publish part) and assembled into the same version (:func:`assemble_version`).
    ``threads`` > 1 encodes tensors on that many threads at once (the kernels release the
    GIL); the result is the same bytes in any case."""
    for name, t in weights.items():
        old = base.get(name) if base is not None else None
        if base is not None and old is None:
            raise InvalidArgument(f"tensor {name!r} is not in the base version")
        if old is not None and (old.dtype, old.shape) != (t.dtype, t.shape):
            raise InvalidArgument(f"tensor {name}: {old.dtype}{list(old.shape)} became {t.dtype}{list(t.shape)}")
    held_indexes = carried.indexes if carried is not None else None
    held_sums = carried.sums if carried is not None else {}

    def one(name: str) -> _EncodedTensor:
        return _encode_tensor(name, weights[name], base[name] if base is not None else None, chunk_bytes, held_indexes, held_sums)

    return _collect(_per_tensor(one, {n: t.nbytes for n, t in weights.items()}, threads, "ws-encode"))


def _per_tensor(work: Callable[[str], _T], sizes: Mapping[str, int], threads: int, prefix: str) -> dict[str, _T]:
    """``work(name)`` for each tensor, on up to ``threads`` threads (the kernels release
    the GIL), largest first so that no thread is left with a big tensor at the end."""
    names = sorted(sizes, key=lambda n: -sizes[n])
    if threads > 1 and len(names) > 1:
        with concurrent.futures.ThreadPoolExecutor(min(threads, len(names)), thread_name_prefix=prefix) as pool:
            return dict(zip(names, pool.map(work, names)))
    return {n: work(n) for n in names}


def _collect(done: Mapping[str, _EncodedTensor]) -> EncodedTensors:
    out = EncodedTensors({}, Carried())
    for name, result in sorted(done.items()):
        out.payloads[name] = result.payloads
        out.sha256[name] = result.sha256
        if result.index is not None:
            out.carried.indexes[name] = result.index
        if result.sums is not None:
            out.carried.sums[name] = result.sums
    return out


#: Per tensor, the changes of each chunk of one delta (None: a chunk went as a keyframe).
Changes = dict[str, list[codec.ChunkChanges] | None]


@dataclasses.dataclass
class Spare:
    """Buffers to decode the next version into instead of fresh copies of its base: the
    tensors of the version before the base, which no one reads any more, and the base's
    changes against them (``Changes``). Replaying those changes makes a buffer the base in
    O(changes), where a copy costs a pass over the model (and, into fresh memory, its page
    faults): decoding a version then costs in proportion to two deltas."""

    weights: dict[str, RawTensor]
    changes: Changes

    def buffer(self, name: str, base: RawTensor) -> np.ndarray | None:
        """Tensor ``name``'s buffer holding ``base``'s values, or None when it cannot (no
        spare or no changes for it, or another dtype or shape). Each buffer is given once."""
        spare, changes = self.weights.pop(name, None), self.changes.pop(name, None)
        if spare is None or changes is None or (spare.dtype, tuple(spare.shape)) != (base.dtype, tuple(base.shape)) or spare.bits is base.bits:
            return None
        for ch in changes:
            spare.bits[ch.positions] = ch.new
        return spare.bits


@dataclasses.dataclass
class DecodedTensors:
    """Tensors decoded from chunk payloads another process encoded (a trainer rank's
    part), and those payloads as :func:`encode_tensors` would have returned them here:
    their digests and what they leave for the next version (the indexes after their
    changes; the sums moved by them where the base's were carried), and the changes."""

    weights: dict[str, RawTensor]
    encoded: EncodedTensors
    changes: Changes = dataclasses.field(default_factory=dict)


def decode_tensors(
    payloads: Mapping[str, list[bytes]], base: Weights, chunk_bytes: int, carried: Carried | None = None, threads: int = 1, spare: Spare | None = None
) -> DecodedTensors:
    """The tensors that ``payloads`` (per tensor, its chunks in order, each a delta or
    keyframe chunk against ``base``'s tensor of the same name, as :func:`encode_tensors`
    makes them with ``chunk_bytes``) describe, each decoded onto a copy of its base tensor
    (``spare``'s buffer where it has one) over ``carried``'s position indexes (built where
    missing or not the ones a payload names). ``base`` is not changed. Raises CodecError
    when a tensor is not in ``base``, or its chunks are not the ``chunk_bytes`` chunking of
    it, or do not decode."""
    held_indexes = carried.indexes if carried is not None else None
    held_sums = carried.sums if carried is not None else {}
    for name in payloads:
        if name not in base:
            raise codec.CodecError(f"tensor {name!r} is not in the base version")
    decoded: dict[str, RawTensor] = {}
    changes: Changes = {}
    # Taken before the threads start: each tensor's buffer, given once.
    buffers = {name: spare.buffer(name, base[name]) if spare is not None else None for name in payloads}

    def one(name: str) -> _EncodedTensor:
        decoded[name], changes[name], result = _decode_tensor(
            name, payloads[name], base[name], chunk_bytes, held_indexes, held_sums, buffers[name]
        )  # fmt: skip
        return result

    done = _per_tensor(one, {n: base[n].nbytes for n in payloads}, threads, "ws-decode-part")
    return DecodedTensors(dict(sorted(decoded.items())), _collect(done), changes)


def _decode_tensor(
    name: str, payloads: list[bytes], old: RawTensor, chunk_bytes: int, held_indexes: Indexes | None, held_sums: Mapping[str, elementhash.Sums],
    buffer: np.ndarray | None = None,
) -> tuple[RawTensor, list[codec.ChunkChanges] | None, _EncodedTensor]:
    """One tensor of :func:`decode_tensors`: decoded in place on a copy of ``old`` (or on
    ``buffer``, which holds ``old``'s values)."""
    per_chunk = max(1, chunk_bytes // old.bits.itemsize)
    numel = old.bits.shape[0]
    ranges = chunk_ranges(numel, old.bits.itemsize, chunk_bytes)
    if len(payloads) != len(ranges):
        raise codec.CodecError(f"tensor {name!r}: {len(payloads)} chunks, but its {numel} elements in chunks of {per_chunk} make {len(ranges)}")
    held = _chunk_indexes(held_indexes, name, numel, per_chunk)
    out = old.bits.copy() if buffer is None else buffer
    indexes: list[codec.ChunkIndex | None] = []
    changed: list[codec.ChunkChanges] | None = []
    sums = held_sums.get(name)
    for j, ((start, count), payload) in enumerate(zip(ranges, payloads)):
        hdr = codec.parse_header(payload)
        if (hdr.dtype, hdr.start, hdr.count, hdr.total) != (old.dtype, start, count, numel):
            raise codec.CodecError(
                f"tensor {name!r} chunk {j}: covers {hdr.dtype} [{hdr.start}, {hdr.start + hdr.count}) of {hdr.total} elements, "
                f"expected {old.dtype} [{start}, {start + count}) of {numel}"
            )
        if hdr.mode == codec.MODE_KEYFRAME:
            codec.decode_chunk_into(payload, out, None, header=hdr)
            indexes.append(None)  # no changes listed: built from the values when next needed
            sums = changed = None
            continue
        index = codec.ensure_index(payload, out, held[j] if held is not None else None, header=hdr)
        changes = codec.decode_chunk_into(payload, out, out, index=index, header=hdr)
        assert changes is not None  # a delta chunk lists its changes
        indexes.append(codec.next_index(index, changes))
        if sums is not None:
            sums = elementhash.add(sums, elementhash.change_sums(changes.positions, changes.old, changes.new))
        if changed is not None:
            changed.append(changes)
    return RawTensor(old.dtype, old.shape, out), changed, _EncodedTensor(payloads, indexes, sums, _sha256s(payloads))


@dataclasses.dataclass
class _EncodedTensor:
    payloads: list[bytes]
    index: list[codec.ChunkIndex | None] | None
    sums: elementhash.Sums | None
    sha256: list[str]


def _encode_tensor(
    name: str, t: RawTensor, old: RawTensor | None, chunk_bytes: int, held_indexes: Indexes | None, held_sums: Mapping[str, elementhash.Sums]
) -> _EncodedTensor:
    """One tensor's chunk payloads, its chunks' position indexes and its moved element-hash
    sums (see :func:`encode_tensors`)."""
    per_chunk = max(1, chunk_bytes // t.bits.itemsize)
    if old is None:
        # A keyframe's body is the same in every format; format 1 builds no index
        # (a pass) that only the next delta, if any, would need.
        payloads = [p.payload for p in codec.encode_tensor(name, t.bits, None, t.dtype, chunk_elems=per_chunk)]
        return _EncodedTensor(payloads, None, None, _sha256s(payloads))
    held = _chunk_indexes(held_indexes, name, t.bits.shape[0], per_chunk)
    pieces = codec.encode_tensor(name, t.bits, old.bits, t.dtype, chunk_elems=per_chunk, index=held, format_version=CHUNK_FORMAT)
    payloads = [_smaller_payload(piece, t.bits, old.bits, t.dtype) for piece in pieces]
    return _EncodedTensor(payloads, [piece.index for piece in pieces], _moved_sums(held_sums.get(name), pieces), _sha256s(payloads))


def _sha256s(payloads: list[bytes]) -> list[str]:
    return [hashlib.sha256(p).hexdigest() for p in payloads]


#: Above this many bits per changed element, a format-3 delta chunk is also coded in
#: format 1 and the smaller sent. Format 3 spends ~3 bits per change on the recorded RL
#: steps; where many changes fall just outside the index (a late step, a compacted
#: delta over many versions) format 1's plain gaps can be 20 % smaller, and below ~5
#: bits it never was: the second encoding is paid only where it can win.
FORMAT_1_TRIAL_BITS = 5.0


def _smaller_payload(piece: codec.EncodedChunk, new: np.ndarray, old: np.ndarray, dtype: str) -> bytes:
    """``piece``'s payload, or the same chunk coded in format 1 when that is smaller. The
    index a receiver keeps is the same either way (it follows the changes, not the bytes)."""
    if piece.changes is None or 8 * len(piece.payload) <= FORMAT_1_TRIAL_BITS * max(1, piece.changes.positions.shape[0]):
        return piece.payload
    plain = codec.encode_chunk(new, old, dtype, piece.start, piece.count).payload
    return plain if len(plain) < len(piece.payload) else piece.payload


def _moved_sums(sums: elementhash.Sums | None, pieces: list[codec.EncodedChunk]) -> elementhash.Sums | None:
    """A tensor's element-hash sums after its delta chunks' changes (None when its base's
    sums are not known or a chunk went out as a keyframe, which lists no changes)."""
    if sums is None or any(piece.changes is None for piece in pieces):
        return None
    for piece in pieces:
        ch = piece.changes
        assert ch is not None
        sums = elementhash.add(sums, elementhash.change_sums(ch.positions, ch.old, ch.new))
    return sums


def _chunk_indexes(indexes: Indexes | None, name: str, numel: int, per_chunk: int) -> list[codec.ChunkIndex | None] | None:
    """The held indexes of tensor ``name`` if they fit its chunking now, else None (built anew)."""
    held = (indexes or {}).get(name)
    chunks = max(1, -(-numel // per_chunk))
    if held is None or len(held) != chunks or any(i is not None and i.start != j * per_chunk for j, i in enumerate(held)):
        return None
    return held


def stream_order(raw_bytes: Mapping[str, int], encoded_bytes: Mapping[str, int]) -> list[str]:
    """The order tensors' chunks travel in a version: fewest encoded bytes per raw byte
    first, ties by name. A receiver's decoding costs per element as well as per byte
    (the position-index walk, per-chunk work), so a sparse delta is the most decoding per
    byte on the link: sent first, it is decoded while the dense tensors' bytes are still
    on their way, instead of all arriving with the last bytes (the built-in model's
    embedding is 21 % of its elements and 75 % of a delta's bytes, and sorts first by
    name). Any order decodes the same; the manifest's chunk indexes carry this one."""
    return sorted(raw_bytes, key=lambda name: (encoded_bytes[name] / max(1, raw_bytes[name]), name))


def assemble_version(
    version: int,
    weights: Weights,
    payloads: Mapping[str, list[bytes]],
    base_version: int,
    digest: str,
    trace_context: Mapping[str, str] | None = None,
    canary: pb.Canary | None = None,
    signature: pb.VersionSignature | None = None,
    sha256: Mapping[str, list[str]] | None = None,
) -> Encoded:
    """One version's manifest and chunks from each tensor's payloads: tensors listed in
    name order, chunks indexed in :func:`stream_order` (each tensor's together, in order),
    ``digest`` as its weights hash (the caller's :func:`weights_hash` of ``weights``, or
    the same hash combined from per-part sums). ``sha256``: the payloads' digests where
    the encoder computed them already."""
    manifest = pb.Manifest(
        version=version,
        base_version=base_version,
        weights_hash=digest,
        codec=CODEC_NAME,
        trace_context=dict(trace_context or {}),
        canary=canary,
        signature=signature,
    )
    chunks: list[bytes] = []
    for name in sorted(weights):
        t = weights[name]
        manifest.tensors.append(t.meta(name))
        manifest.raw_bytes += t.nbytes
    encoded = {name: sum(len(p) for p in payloads[name]) for name in weights}
    for name in stream_order({name: t.nbytes for name, t in weights.items()}, encoded):
        known = (sha256 or {}).get(name)
        for payload, hexdigest in zip(payloads[name], known if known is not None else _sha256s(payloads[name]), strict=True):
            manifest.chunks.append(pb.ChunkRef(index=len(chunks), tensor=name, size=len(payload), sha256=hexdigest))
            chunks.append(payload)
    manifest.encoded_bytes = sum(encoded.values())
    return Encoded(manifest, chunks)
