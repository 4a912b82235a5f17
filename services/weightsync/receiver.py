"""The receiving side of weightsync: decoding versions chunk by chunk onto the weights a
subscriber holds (a rollout, a relay, a restarted origin), in place when asked, with the
undo log that takes an in-place version back. Pure core: no gRPC, no asyncio."""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import threading
from collections.abc import Mapping

import numpy as np

from meridian import elementhash
from meridian.errors import DataLoss, FailedPrecondition, InvalidArgument
from meridian.tensors import PB_DTYPE_NAMES, RAW_DTYPES, RawTensor, Weights, element_count, hash_of_sums
from meridian.v1 import weightsync_pb2 as pb
from services.weightsync import codec
from services.weightsync.signing import SignatureRefused, Verifier, tensor_sha256
from services.weightsync.versions import READABLE_CODECS, Encoded, chunk_ranges

_MASK64 = (1 << 64) - 1


class ChunkChecksumError(DataLoss):
    """A chunk's bytes differ from its manifest entry (re-fetching it can help)."""


@dataclasses.dataclass
class UndoLog:
    """How to take weights updated in place from ``version`` back to ``base_version``.

    ``changes`` lists, per delta chunk, the positions it changed and their old bits;
    ``ranges`` holds the old bits of ranges a keyframe chunk rewrote; ``replaced``
    the tensors that got new buffers instead (their old objects, untouched, or None
    for a tensor the base did not have). Its size is O(changed elements)."""

    version: int
    base_version: int
    changes: list[tuple[str, np.ndarray, np.ndarray]] = dataclasses.field(default_factory=list)
    ranges: list[tuple[str, int, np.ndarray]] = dataclasses.field(default_factory=list)
    replaced: dict[str, RawTensor | None] = dataclasses.field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes + o.nbytes for _, p, o in self.changes) + sum(o.nbytes for _, _, o in self.ranges)

    def revert(self, weights: dict[str, RawTensor]) -> None:
        """Turns ``weights`` (as of ``version``) back into ``base_version`` in place."""
        for name, positions, old in reversed(self.changes):
            weights[name].bits[positions] = old
        for name, start, old in reversed(self.ranges):
            weights[name].bits[start : start + old.shape[0]] = old
        for name, tensor in self.replaced.items():
            if tensor is None:
                weights.pop(name, None)
            else:
                weights[name] = tensor

    def previous_weights(self, weights: Mapping[str, RawTensor]) -> dict[str, RawTensor]:
        """A copy of ``base_version`` rebuilt from ``weights`` (as of ``version``), which
        stay untouched: what a rollback needs, built only when it is needed."""
        touched = {n for n, _, _ in self.changes} | {n for n, _, _ in self.ranges}
        copy = {n: (RawTensor(t.dtype, t.shape, t.bits.copy()) if n in touched else t) for n, t in weights.items()}
        self.revert(copy)
        return copy


class Decoder:
    """Applies versions chunk by chunk on top of the weights a receiver holds.

    ``in_place=False``: each version gets fresh buffers; the previous version's dict
    stays valid. ``in_place=True``: delta versions update the held buffers in place
    (only the changed elements are written) and :attr:`last_undo` says how to go back;
    a failed version is reverted before the error leaves.

    The full-weights hash is checked without a full pass: the decoder keeps each
    tensor's additive element-hash sums and moves them by the changed elements only.
    Likewise each chunk's position index (codec format 3), built from the held weights
    the first time a delta needs it and then kept current from the decoded changes.

    With a ``verifier`` each manifest's signature is checked before the version starts,
    and the decoded weights against the signed content digest (one full pass) before the
    version becomes current: a version no relay or link could have forged, whatever
    encoding brought it. Refusals raise :class:`~services.weightsync.signing.SignatureRefused`.
    """

    def __init__(self, weights: Weights | None, version: int, *, in_place: bool = False, verifier: Verifier | None = None) -> None:
        self.weights: dict[str, RawTensor] = dict(weights or {})
        self.version = version
        self.in_place = in_place
        self.verifier = verifier
        self.last_undo: UndoLog | None = None
        # What revert_last restores: the version before the last in-place one, its sums
        # and its position indexes.
        self._base_state: tuple[int, dict[str, elementhash.Sums] | None, dict[tuple[str, int], codec.ChunkIndex]] | None = None
        self._sums: dict[str, elementhash.Sums] | None = None
        # (tensor, chunk start) -> position index of the held weights' chunk; the version
        # being received fills _next_indexes, which replace them when it finishes.
        self._indexes: dict[tuple[str, int], codec.ChunkIndex] = {}
        self._next_indexes: dict[tuple[str, int], codec.ChunkIndex] = {}
        # (tensor, chunk start, element count) of every chunk decoded of the version being
        # received, and of the held version: which chunks have no index (see unindexed).
        self._ranges: list[tuple[str, int, int]] = []
        self._held_ranges: list[tuple[str, int, int]] = []
        self._pending: dict[str, RawTensor] = {}
        self._based: set[str] = set()  # tensors of _pending decoded onto the held base
        self._manifest: pb.Manifest | None = None
        self._seen: set[int] = set()
        self._moves: list[tuple[str, elementhash.Sums]] = []
        self._undo: UndoLog | None = None
        # With a verifier: chunks still to decode per tensor, and the sha256 of each tensor
        # whose last chunk is decoded (taken on the decode thread that finished it, so the
        # signed content check overlaps the version's arrival instead of following it).
        self._chunks_left: collections.Counter[str] = collections.Counter()
        self._tensor_sha256: dict[str, bytes] = {}
        self._count_lock = threading.Lock()

    def begin(self, manifest: pb.Manifest, *, checked: bool = False) -> None:
        """Starts a version; a delta must be based on the version held now. A manifest
        whose signature the verifier refuses is refused here, before anything changes.
        ``checked``: the caller made :meth:`check` of this manifest already and nothing
        changed the decoder since (a signature check is an Ed25519 verification over every
        tensor's name, dtype and shape: not made twice)."""
        if not checked:
            self.check(manifest)
        self.abort()
        delta = manifest.base_version >= 0
        if delta:
            self.prepare()
        undo = UndoLog(manifest.version, manifest.base_version) if self.in_place else None
        pending: dict[str, RawTensor] = {}
        based: set[str] = set()
        for meta in manifest.tensors:
            name, shape = meta.name, tuple(meta.shape)
            dtype = PB_DTYPE_NAMES.get(meta.dtype)
            if dtype is None:
                raise InvalidArgument(f"tensor {name}: unknown dtype {meta.dtype}")
            base = self._base(name, dtype, shape) if delta else None
            if base is not None:
                based.add(name)
                if undo is not None:
                    pending[name] = base  # updated in place (its shape is the held one's)
                    continue
            try:
                numel = element_count(shape)
            except ValueError as exc:
                raise InvalidArgument(f"tensor {name}: {exc}") from None
            pending[name] = RawTensor(dtype, shape, np.empty(numel, dtype=RAW_DTYPES[dtype]))
            if undo is not None:
                undo.replaced[name] = self.weights.get(name)
        if undo is not None:
            undo.replaced.update({n: t for n, t in self.weights.items() if n not in pending})
        self._manifest, self._pending, self._undo, self._based = manifest, pending, undo, based
        self._seen, self._moves, self._next_indexes, self._ranges = set(), [], {}, []
        self._chunks_left = collections.Counter(ref.tensor for ref in manifest.chunks) if self.verifier is not None else collections.Counter()
        self._tensor_sha256 = {}

    def check(self, manifest: pb.Manifest) -> None:
        """The refusals :meth:`begin` makes before anything changes: a signature the
        verifier refuses, a replayed version, a delta on another version than the held
        one, a codec this decoder does not read."""
        if self.verifier is not None:
            self.verifier.check_manifest(manifest)
            # A server only ever sends versions after the one held: an older, genuinely
            # signed version is a replay meant to roll the weights back.
            if 0 <= self.version and manifest.version <= self.version:
                raise SignatureRefused(f"version {manifest.version} refused: not newer than the held version {self.version} (a replayed version)")
        if manifest.base_version >= 0 and manifest.base_version != self.version:
            raise FailedPrecondition(f"version {manifest.version} is a delta on {manifest.base_version}, but {self.version} is held")
        if manifest.codec not in READABLE_CODECS:
            raise FailedPrecondition(f"version {manifest.version} uses codec {manifest.codec!r}; this decoder reads {READABLE_CODECS}")

    def needs_prepare(self, manifest: pb.Manifest) -> bool:
        """Whether :meth:`begin` of ``manifest`` would make the full pass of :meth:`prepare`
        (a delta, and the held weights' sums not known yet): a caller on an event loop
        runs :meth:`prepare` on a thread first."""
        return manifest.base_version >= 0 and self._sums is None

    def prepare(self) -> None:
        """Computes the held weights' element-hash sums if not known yet: one full pass,
        once per decoder handed weights (later versions only move the sums). Called by
        the first delta's :meth:`begin`; call it earlier to keep it off that path."""
        if self._sums is None:
            names = sorted(self.weights)
            sums = elementhash.many_tensor_sums([np.ascontiguousarray(self.weights[n].bits) for n in names])
            self._sums = dict(zip(names, sums))

    def _base(self, name: str, dtype: str, shape: tuple[int, ...]) -> RawTensor | None:
        held = self.weights.get(name)
        return held if held is not None and (held.dtype, tuple(held.shape)) == (dtype, shape) else None

    @property
    def manifest(self) -> pb.Manifest | None:
        """The manifest of the version being received, if any."""
        return self._manifest

    def verify(self, index: int, payload: bytes) -> None:
        """Checks one chunk against the manifest (index, size, sha256) without decoding it.

        Raises :class:`ChunkChecksumError` (a DataLoss) when the bytes are not the ones
        the manifest lists: a transport fault that fetching the chunk again can cure."""
        manifest = self._require_manifest()
        if not 0 <= index < len(manifest.chunks):
            raise InvalidArgument(f"chunk {index} is outside version {manifest.version}'s {len(manifest.chunks)} chunks")
        ref = manifest.chunks[index]
        if len(payload) != ref.size or hashlib.sha256(payload).hexdigest() != ref.sha256:
            raise ChunkChecksumError(f"chunk {index} of version {manifest.version} fails its checksum")

    def add_chunk(self, index: int, payload: bytes, verified: bool = False) -> None:
        """Checks one chunk against the manifest (unless ``verified``) and decodes it.

        Chunks of one version may be decoded concurrently from several threads: each
        writes its own element range, and the codec kernels release the GIL."""
        manifest = self._require_manifest()
        if not verified:
            self.verify(index, payload)
        name = manifest.chunks[index].tensor
        out = self._pending.get(name)
        if out is None:
            raise DataLoss(f"chunk {index} of version {manifest.version} is for {name!r}, not in its manifest")
        base = self.weights[name] if name in self._based else None
        try:
            hdr = codec.parse_header(payload)
            lo, hi = hdr.start, hdr.start + hdr.count
            self._ranges.append((name, lo, hdr.count))  # list.append is atomic: safe from decode threads
            rewrite = hdr.mode == codec.MODE_KEYFRAME and hi <= out.bits.shape[0]
            before: elementhash.Sums = (0, 0)
            if rewrite and base is not None:
                before = elementhash.range_sums(base.bits, lo, hi)
                if self._undo is not None and out is base:
                    self._undo.ranges.append((name, lo, base.bits[lo:hi].copy()))
            key = (name, lo)
            held = self._indexes.get(key) if base is not None else None
            chunk_index = held
            if base is not None and not rewrite:
                chunk_index = codec.ensure_index(payload, base.bits, held, header=hdr)
                if chunk_index is not None and chunk_index is not held:
                    self._indexes[key] = chunk_index  # built from the held weights: kept even if this version aborts
            # The bytes matched the manifest's sha256 (verify, or the caller did): the
            # codec's own CRC would only check them again.
            changes = codec.decode_chunk_into(payload, out.bits, base.bits if base is not None else None, index=chunk_index, header=hdr, checksum=False)
            if changes is not None:
                after = codec.next_index(chunk_index, changes)
                if after is not None:
                    self._next_indexes[key] = after  # one key per chunk: safe from decode threads
        except codec.CodecError as exc:
            raise DataLoss(f"chunk {index} of version {manifest.version} ({name}): {exc}") from exc
        if changes is not None:
            move = elementhash.change_sums(changes.positions, changes.old, changes.new)
            if self._undo is not None and out is base:
                self._undo.changes.append((name, changes.positions, changes.old))
        else:
            after = elementhash.range_sums(out.bits, lo, hi)
            move = ((after[0] - before[0]) & _MASK64, (after[1] - before[1]) & _MASK64)
        self._moves.append((name, move))  # list.append is atomic: safe from decode threads
        if self.verifier is not None and index not in self._seen:
            with self._count_lock:
                self._chunks_left[name] -= 1
                last = self._chunks_left[name] == 0
            if last:  # every chunk of this tensor is written: its bytes are final
                self._tensor_sha256[name] = tensor_sha256(out)
        self._seen.add(index)

    def finish(self) -> int:
        """Checks completeness and the full-weights hash, then makes the version current.
        A hash mismatch reverts an in-place update before raising."""
        manifest = self._require_manifest()
        missing = len(manifest.chunks) - len(self._seen)
        if missing:
            raise DataLoss(f"version {manifest.version} ended with {missing} chunks missing")
        held_sums = self._sums or {}
        # A tensor decoded onto its held base moves that base's sums; any other starts at 0.
        sums = {name: held_sums.get(name, (0, 0)) if name in self._based else (0, 0) for name in self._pending}
        for name, move in self._moves:
            sums[name] = elementhash.add(sums[name], move)
        got = hash_of_sums([(n, t.dtype, tuple(t.shape), sums[n]) for n, t in self._pending.items()])
        if got != manifest.weights_hash:
            self.abort()
            raise DataLoss(f"version {manifest.version}: decoded weights hash {got[:12]} != manifest {manifest.weights_hash[:12]}")
        if self.verifier is not None:
            try:
                # The additive hash above can be steered by a forger; the signed digest cannot.
                self.verifier.check_content(manifest.version, manifest.signature, self._pending, self._tensor_sha256)
            except BaseException:
                self.abort()
                raise
        self._base_state = (self.version, self._sums, self._indexes) if self._undo is not None else None
        self.weights, self.version, self._sums = self._pending, manifest.version, sums
        self._indexes, self._next_indexes = self._next_indexes, {}
        self._held_ranges, self._ranges = self._ranges, []
        self.last_undo = self._undo
        self._pending, self._manifest, self._undo, self._moves = {}, None, None, []
        return self.version

    def revert_last(self) -> int:
        """Undoes the last in-place version: the buffers hold the version before it again
        (O(changed elements)), and so does the decoder. Returns that version."""
        if self.last_undo is None or self._base_state is None or self._manifest is not None:
            raise FailedPrecondition("no finished in-place version to revert")
        version, sums, indexes = self._base_state
        self.last_undo.revert(self.weights)
        self.version, self._sums, self._indexes = version, sums, indexes
        self.last_undo, self._base_state, self._held_ranges = None, None, []
        return version

    def abort(self) -> None:
        """Drops a version being received; an in-place one is reverted, so the held
        weights are the held version again. Call only when no decode is in flight."""
        if self._undo is not None:
            self._undo.revert(self._pending)
        self._pending, self._manifest, self._undo, self._moves = {}, None, None, []
        self._seen, self._next_indexes, self._ranges = set(), {}, []
        self._chunks_left, self._tensor_sha256 = collections.Counter(), {}

    def unindexed(self, chunk_bytes: int = 0) -> list[tuple[str, int, int]]:
        """The chunks (tensor, start, element count) of the held weights whose position
        index the next delta would build first. Without ``chunk_bytes``: those the last
        version decoded rewrote whole (a keyframe's chunks). With it: every chunk of the
        held weights cut as an origin cuts them into chunks of that many raw bytes (its
        ``chunk_mb``), for weights handed to the decoder. Building one is a pass over its
        chunk; see :meth:`build_indexes`."""
        ranges = self._held_ranges if chunk_bytes <= 0 else [
            (name, start, count) for name, t in self.weights.items() for start, count in chunk_ranges(t.bits.shape[0], t.bits.itemsize, chunk_bytes)
        ]
        return [r for r in ranges if (r[0], r[1]) not in self._indexes and r[0] in self.weights]

    def build_indexes(self, chunks: list[tuple[str, int, int]]) -> None:
        """Builds the position indexes of ``chunks`` (from :meth:`unindexed`) from the held
        weights with the codec's threshold rule, the one an origin applies to the same
        values, so that the next delta finds them ready instead of building them while its
        chunks arrive. One whose payload names another index (an origin that built its own
        from other values) is built again then, as without this. Several threads may build
        disjoint chunks at once; call it only while no version is being decoded. It stops
        when another version became current meanwhile."""
        indexes, version = self._indexes, self.version
        for name, start, count in chunks:
            if self._indexes is not indexes or self.version != version:
                return
            held = self.weights.get(name)
            if held is not None and (name, start) not in indexes:
                indexes[(name, start)] = codec.build_index(held.bits, held.dtype, start, count)

    def _require_manifest(self) -> pb.Manifest:
        if self._manifest is None:
            raise FailedPrecondition("chunk before its version's manifest")
        return self._manifest


def decode_all(encoded: list[Encoded], weights: Weights | None = None, version: int = -1) -> Decoder:
    """Applies whole encoded versions in order (used at recovery and in tests)."""
    decoder = Decoder(weights, version)
    for enc in encoded:
        decoder.begin(enc.manifest)
        for i, payload in enumerate(enc.chunks):
            decoder.add_chunk(i, payload)
        decoder.finish()
    return decoder
