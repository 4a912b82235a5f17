"""Versions of the policy weights, encoded and kept for subscribers.

Each published version is stored as a delta against the version before it; a
keyframe (decodable alone) is written every ``keyframe_every`` versions so a restarted
origin can rebuild its latest weights, and built on demand for late joiners. Every
stored version lives on disk as ``<data_dir>/<version>/<kind>/`` with a manifest,
its chunks and a ``COMPLETE`` marker written last, so a crash never leaves a version
that looks whole but is not.

This is the service's pure core: no gRPC, no asyncio.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from meridian.errors import DataLoss, FailedPrecondition, InvalidArgument, NotFound
from meridian.v1 import weightsync_pb2 as pb
from services.weightsync import codec, elementhash
from services.weightsync.tensors import PB_DTYPE_NAMES, RAW_DTYPES, RawTensor, Weights, element_count, hash_of_sums, weights_hash

log = logging.getLogger(__name__)

#: Chunk codec and weights-hash scheme of a manifest; versions stored under another
#: name (e.g. by an older origin) are not recovered, and subscribers refuse them.
CODEC_NAME = "meridian-ctx-rice-v1+ehash2"
MAX_COMPACTED = 4
COMPLETE = "COMPLETE"
_MASK64 = (1 << 64) - 1


@dataclasses.dataclass
class Encoded:
    """One version as sent: a manifest and its chunk payloads (index-aligned)."""

    manifest: pb.Manifest
    chunks: list[bytes]

    @property
    def size(self) -> int:
        return sum(len(c) for c in self.chunks)

    @property
    def is_keyframe(self) -> bool:
        return self.manifest.base_version < 0


class ChunkChecksumError(DataLoss):
    """A chunk's bytes differ from its manifest entry (re-fetching it can help)."""


def encode_version(
    version: int,
    weights: Weights,
    base: Weights | None,
    base_version: int,
    chunk_bytes: int,
    trace_context: Mapping[str, str] | None = None,
    canary: pb.Canary | None = None,
) -> Encoded:
    """Encodes ``weights`` as a delta against ``base`` (or a keyframe when base is None);
    ``trace_context`` and ``canary`` describe the version and go into its manifest as given."""
    if base is not None and set(base) != set(weights):
        missing, extra = sorted(set(base) - set(weights)), sorted(set(weights) - set(base))
        raise InvalidArgument(f"version {version} changes the tensor set (missing {missing[:3]}, new {extra[:3]})")
    manifest = pb.Manifest(
        version=version,
        base_version=base_version if base is not None else -1,
        weights_hash=weights_hash(weights),
        codec=CODEC_NAME,
        trace_context=dict(trace_context or {}),
        canary=canary,
    )
    chunks: list[bytes] = []
    for name in sorted(weights):
        t = weights[name]
        old = base[name] if base is not None else None
        if old is not None and (old.dtype, old.shape) != (t.dtype, t.shape):
            raise InvalidArgument(f"tensor {name}: {old.dtype}{list(old.shape)} became {t.dtype}{list(t.shape)}")
        manifest.tensors.append(t.meta(name))
        manifest.raw_bytes += t.nbytes
        per_chunk = max(1, chunk_bytes // t.bits.itemsize)
        for piece in codec.encode_tensor(name, t.bits, old.bits if old is not None else None, t.dtype, chunk_elems=per_chunk):
            manifest.chunks.append(
                pb.ChunkRef(index=len(chunks), tensor=name, size=len(piece.payload), sha256=hashlib.sha256(piece.payload).hexdigest())
            )
            chunks.append(piece.payload)
    manifest.encoded_bytes = sum(len(c) for c in chunks)
    return Encoded(manifest, chunks)


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
    """

    def __init__(self, weights: Weights | None, version: int, *, in_place: bool = False) -> None:
        self.weights: dict[str, RawTensor] = dict(weights or {})
        self.version = version
        self.in_place = in_place
        self.last_undo: UndoLog | None = None
        self._base_state: tuple[int, dict[str, elementhash.Sums] | None] | None = None
        self._sums: dict[str, elementhash.Sums] | None = None
        self._pending: dict[str, RawTensor] = {}
        self._manifest: pb.Manifest | None = None
        self._seen: set[int] = set()
        self._moves: list[tuple[str, elementhash.Sums]] = []
        self._undo: UndoLog | None = None

    def begin(self, manifest: pb.Manifest) -> None:
        """Starts a version; a delta must be based on the version held now."""
        if manifest.base_version >= 0 and manifest.base_version != self.version:
            raise FailedPrecondition(f"version {manifest.version} is a delta on {manifest.base_version}, but {self.version} is held")
        if manifest.codec != CODEC_NAME:
            raise FailedPrecondition(f"version {manifest.version} uses codec {manifest.codec!r}; this decoder reads {CODEC_NAME!r}")
        self.abort()
        delta = manifest.base_version >= 0
        if delta:
            self.prepare()
        undo = UndoLog(manifest.version, manifest.base_version) if self.in_place else None
        pending: dict[str, RawTensor] = {}
        for meta in manifest.tensors:
            dtype = PB_DTYPE_NAMES.get(meta.dtype)
            if dtype is None:
                raise InvalidArgument(f"tensor {meta.name}: unknown dtype {meta.dtype}")
            try:
                numel = element_count(tuple(meta.shape))
            except ValueError as exc:
                raise InvalidArgument(f"tensor {meta.name}: {exc}") from None
            base = self._base(meta.name, dtype, tuple(meta.shape)) if delta else None
            if undo is not None and base is not None:
                pending[meta.name] = base  # updated in place
                continue
            pending[meta.name] = RawTensor(dtype, tuple(meta.shape), np.empty(numel, dtype=RAW_DTYPES[dtype]))
            if undo is not None:
                undo.replaced[meta.name] = self.weights.get(meta.name)
        if undo is not None:
            undo.replaced.update({n: t for n, t in self.weights.items() if n not in pending})
        self._manifest, self._pending, self._undo = manifest, pending, undo
        self._seen, self._moves = set(), []

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
        ref = manifest.chunks[index]
        if ref.tensor not in self._pending:
            raise DataLoss(f"chunk {index} of version {manifest.version} is for {ref.tensor!r}, not in its manifest")
        out = self._pending[ref.tensor]
        base = self._base(ref.tensor, out.dtype, out.shape) if manifest.base_version >= 0 else None
        try:
            hdr = codec.parse_header(payload)
            lo, hi = hdr.start, hdr.start + hdr.count
            rewrite = hdr.mode == codec.MODE_KEYFRAME and hi <= out.bits.shape[0]
            before: elementhash.Sums = (0, 0)
            if rewrite and base is not None:
                before = elementhash.range_sums(base.bits, lo, hi)
                if self._undo is not None and out is base:
                    self._undo.ranges.append((ref.tensor, lo, base.bits[lo:hi].copy()))
            changes = codec.decode_chunk_into(payload, out.bits, base.bits if base is not None else None)
        except codec.CodecError as exc:
            raise DataLoss(f"chunk {index} of version {manifest.version} ({ref.tensor}): {exc}") from exc
        if changes is not None:
            move = elementhash.change_sums(changes.positions, changes.old, changes.new)
            if self._undo is not None and out is base:
                self._undo.changes.append((ref.tensor, changes.positions, changes.old))
        else:
            after = elementhash.range_sums(out.bits, lo, hi)
            move = ((after[0] - before[0]) & _MASK64, (after[1] - before[1]) & _MASK64)
        self._moves.append((ref.tensor, move))  # list.append is atomic: safe from decode threads
        self._seen.add(index)

    def finish(self) -> int:
        """Checks completeness and the full-weights hash, then makes the version current.
        A hash mismatch reverts an in-place update before raising."""
        manifest = self._require_manifest()
        missing = len(manifest.chunks) - len(self._seen)
        if missing:
            raise DataLoss(f"version {manifest.version} ended with {missing} chunks missing")
        delta = manifest.base_version >= 0
        sums: dict[str, elementhash.Sums] = {}
        for name, t in self._pending.items():
            held = (self._sums or {}).get(name) if delta and self._base(name, t.dtype, t.shape) is not None else None
            sums[name] = held or (0, 0)
        for name, move in self._moves:
            sums[name] = elementhash.add(sums[name], move)
        got = hash_of_sums([(n, t.dtype, tuple(t.shape), sums[n]) for n, t in self._pending.items()])
        if got != manifest.weights_hash:
            self.abort()
            raise DataLoss(f"version {manifest.version}: decoded weights hash {got[:12]} != manifest {manifest.weights_hash[:12]}")
        self._base_state = (self.version, self._sums) if self._undo is not None else None
        self.weights, self.version, self._sums = self._pending, manifest.version, sums
        self.last_undo = self._undo
        self._pending, self._manifest, self._undo, self._moves = {}, None, None, []
        return self.version

    def revert_last(self) -> int:
        """Undoes the last in-place version: the buffers hold the version before it again
        (O(changed elements)), and so does the decoder. Returns that version."""
        if self.last_undo is None or self._base_state is None or self._manifest is not None:
            raise FailedPrecondition("no finished in-place version to revert")
        version, sums = self._base_state
        self.last_undo.revert(self.weights)
        self.version, self._sums = version, sums
        self.last_undo, self._base_state = None, None
        return version

    def abort(self) -> None:
        """Drops a version being received; an in-place one is reverted, so the held
        weights are the held version again. Call only when no decode is in flight."""
        if self._undo is not None:
            self._undo.revert(self._pending)
        self._pending, self._manifest, self._undo, self._moves = {}, None, None, []
        self._seen = set()

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


def _version_meta(manifest: pb.Manifest) -> tuple[dict[str, str], pb.Canary]:
    """What describes a version rather than its encoding: every encoding of it carries the same."""
    return dict(manifest.trace_context), manifest.canary


class VersionStore:
    """The versions an origin or relay holds, in memory and on disk."""

    def __init__(self, data_dir: Path, keep: int = 16, chunk_bytes: int = 4 << 20, keyframe_every: int = 8) -> None:
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self.chunk_bytes = chunk_bytes
        self.keyframe_every = keyframe_every
        self.deltas: dict[int, Encoded] = {}
        self.keyframes: dict[int, Encoded] = {}
        self.latest = -1
        self.weights: dict[str, RawTensor] = {}
        # (version, base) -> compacted delta for late joiners; memory only, a few at most.
        self.compacted: dict[tuple[int, int], Encoded] = {}
        self.compacted_built = 0
        self._recover()

    # ------------------------------------------------------------ publishing

    def publish(
        self,
        version: int,
        weights: Weights,
        expected_hash: str = "",
        trace_context: Mapping[str, str] | None = None,
        canary: pb.Canary | None = None,
    ) -> Encoded:
        """Stores ``version`` (a delta on the latest, or a keyframe for the first)."""
        if version <= self.latest:
            raise FailedPrecondition(f"version {version} is not newer than the latest, {self.latest}")
        if not weights:
            raise InvalidArgument(f"version {version} has no tensors")
        base = self.weights if self.latest >= 0 else None
        enc = encode_version(version, weights, base, self.latest, self.chunk_bytes, trace_context, canary)
        if expected_hash and expected_hash != enc.manifest.weights_hash:
            raise DataLoss(f"version {version}: received weights hash {enc.manifest.weights_hash[:12]} != publisher's {expected_hash[:12]}")
        return self.add_encoded(enc, weights)

    def add_encoded(self, enc: Encoded, weights: Weights) -> Encoded:
        """Records an encoded version whose decoded ``weights`` the caller already holds."""
        version = enc.manifest.version
        self._persist(enc)
        if enc.is_keyframe:
            self.keyframes[version] = enc
        else:
            self.deltas[version] = enc
        if version % self.keyframe_every == 0 and not enc.is_keyframe:
            self.keyframes[version] = self._persist(encode_version(version, weights, None, -1, self.chunk_bytes, *_version_meta(enc.manifest)))
        self.weights, self.latest = dict(weights), version
        self.compacted = {k: e for k, e in self.compacted.items() if k[0] == version}
        self._retain()
        return enc

    # ------------------------------------------------------------ serving

    def manifest(self, version: int) -> pb.Manifest:
        version = self.latest if version < 0 else version
        enc = self.deltas.get(version) or self.keyframes.get(version)
        if enc is None:
            raise NotFound(f"version {version} is not held (latest {self.latest})")
        return enc.manifest

    def plan(self, from_version: int) -> list[Encoded]:
        """What to send a subscriber holding ``from_version`` to bring it to the latest:
        the chain of deltas, or a keyframe of the latest when that is smaller or the
        chain is not held."""
        if self.latest < 0 or from_version >= self.latest:
            return []
        chain: list[Encoded] = []
        v = self.latest
        while v != from_version and v in self.deltas:
            chain.append(self.deltas[v])
            v = self.deltas[v].manifest.base_version
        if v == from_version and from_version >= 0:
            chain.reverse()
            if self.latest not in self.keyframes or sum(e.size for e in chain) <= self.keyframes[self.latest].size:
                return chain
        return [self.keyframe_of_latest()]

    def plan_compacted(self, from_version: int) -> list[Encoded]:
        """Like :meth:`plan`, but also considers one *compacted* delta (the latest encoded
        directly against ``from_version``) and returns whichever of chain, keyframe and
        compacted delta is smallest. The compacted delta is built on demand when the chain
        has two or more links and ``from_version``'s weights can be rebuilt from a held
        keyframe and deltas; it is cached (a few at most) for other late joiners."""
        plan = self.plan(from_version)
        if len(plan) < 2 or plan[0].is_keyframe:
            return plan
        key = (self.latest, from_version)
        compacted = self.compacted.get(key)
        if compacted is None:
            base = self.weights_at(from_version)
            if base is None:
                return plan
            compacted = encode_version(self.latest, self.weights, base, from_version, self.chunk_bytes, *_version_meta(self.manifest(self.latest)))
            self.compacted[key] = compacted
            self.compacted_built += 1
            while len(self.compacted) > MAX_COMPACTED:
                self.compacted.pop(next(iter(self.compacted)))
        if compacted.size < sum(e.size for e in plan):
            return [compacted]
        return plan

    def find(self, version: int, base_version: int) -> Encoded | None:
        """The held encoding of ``version`` against ``base_version`` (-1: keyframe), if any."""
        for enc in (self.deltas.get(version), self.keyframes.get(version), self.compacted.get((version, base_version))):
            if enc is not None and enc.manifest.base_version == base_version:
                return enc
        return None

    def weights_at(self, version: int) -> dict[str, RawTensor] | None:
        """Rebuilds the weights of a held ``version`` from the newest keyframe at or before it
        and the deltas after that keyframe; None when the store cannot."""
        if version == self.latest:
            return dict(self.weights)
        starts = [k for k in self.keyframes if k <= version]
        for start in sorted(starts, reverse=True):
            chain, v = [], version
            while v != start and v in self.deltas:
                chain.append(self.deltas[v])
                v = self.deltas[v].manifest.base_version
            if v == start:
                return decode_all([self.keyframes[start], *reversed(chain)]).weights
        return None

    def keyframe_of_latest(self) -> Encoded:
        if self.latest not in self.keyframes:
            self.keyframes[self.latest] = encode_version(self.latest, self.weights, None, -1, self.chunk_bytes, *_version_meta(self.manifest(self.latest)))
        return self.keyframes[self.latest]

    def versions(self) -> list[int]:
        return sorted(set(self.deltas) | set(self.keyframes))

    def stored_bytes(self) -> int:
        return sum(e.size for e in (*self.deltas.values(), *self.keyframes.values()))

    # ------------------------------------------------------------ disk

    def _dir(self, version: int, keyframe: bool) -> Path:
        return self.data_dir / f"{version:010d}" / ("keyframe" if keyframe else "delta")

    def _persist(self, enc: Encoded) -> Encoded:
        final = self._dir(enc.manifest.version, enc.is_keyframe)
        if (final / COMPLETE).exists():
            return enc
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        (tmp / "manifest.pb").write_bytes(enc.manifest.SerializeToString())
        with open(tmp / "chunks.bin", "wb") as fh:
            for payload in enc.chunks:
                fh.write(payload)
            fh.flush()
            os.fsync(fh.fileno())
        (tmp / COMPLETE).write_text("ok\n")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        return enc

    @staticmethod
    def _load(folder: Path) -> Encoded | None:
        if not (folder / COMPLETE).exists():
            return None
        manifest = pb.Manifest.FromString((folder / "manifest.pb").read_bytes())
        blob = (folder / "chunks.bin").read_bytes()
        chunks, pos = [], 0
        for ref in manifest.chunks:
            chunks.append(blob[pos : pos + ref.size])
            pos += ref.size
        return Encoded(manifest, chunks)

    def _recover(self) -> None:
        """Rebuilds the latest weights from the newest keyframe and the deltas after it."""
        for folder in sorted(self.data_dir.glob("*/*")):
            enc = self._load(folder)
            if enc is None:
                continue
            if enc.manifest.codec != CODEC_NAME:
                log.warning("skipping %s: codec %r, this store reads %r", folder, enc.manifest.codec, CODEC_NAME)
                continue
            (self.keyframes if enc.is_keyframe else self.deltas)[enc.manifest.version] = enc
        if not self.keyframes:
            self.deltas.clear()
            return
        start = max(self.keyframes)
        decoder = decode_all([self.keyframes[start]])
        v = start
        while (nxt := next((d for d in sorted(self.deltas) if d > v and self.deltas[d].manifest.base_version == v), None)) is not None:
            decoder = decode_all([self.deltas[nxt]], decoder.weights, v)
            v = nxt
        self.weights, self.latest = decoder.weights, v
        log.info("recovered versions up to %d from %s", v, self.data_dir)

    def _retain(self) -> None:
        """Keeps the newest ``keep`` versions, plus the newest keyframe recovery needs."""
        floor = self.latest - self.keep
        persisted = [k for k in self.keyframes if (self._dir(k, True) / COMPLETE).exists()]
        anchor = max(persisted, default=-1)
        for version in [v for v in self.deltas if v <= min(floor, anchor)]:
            del self.deltas[version]
            shutil.rmtree(self._dir(version, False), ignore_errors=True)
        for version in [k for k in self.keyframes if k not in (anchor, self.latest) and k <= floor]:
            del self.keyframes[version]
            shutil.rmtree(self._dir(version, True), ignore_errors=True)
        for folder in self.data_dir.iterdir():
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()
