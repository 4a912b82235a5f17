"""Versions of the policy weights, encoded and kept for subscribers.

Each published version is stored as a delta against the version before it; a
keyframe (decodable alone) is written every ``keyframe_every`` versions so a restarted
origin can rebuild its latest weights, and built on demand for late joiners. Every
stored version lives on disk as ``<data_dir>/<version>/<kind>/`` with a manifest,
its chunks and a ``COMPLETE`` marker, written into a temporary folder and renamed into
place, so a crash never leaves a version that looks whole but is not. Every file, the
temporary folder, and the folders that hold the rename and the version's folder are
fsynced before :meth:`VersionStore.publish` returns, so a version the origin
acknowledged survives a host crash (a trainer that acked its trajectories after the
publish relies on that).

This is the service's pure core: no gRPC, no asyncio.
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from google.protobuf.message import DecodeError

from meridian.errors import Aborted, AlreadyExists, DataLoss, FailedPrecondition, InvalidArgument, NotFound
from meridian.tensors import RawTensor, Weights, weights_hash
from meridian.v1 import weightsync_pb2 as pb
from services.weightsync.receiver import decode_all
from services.weightsync.versions import (
    CODEC_NAME, READABLE_CODECS, Carried, Changes, Encoded, Spare, assemble_version, check_tensor_set, encode_version,
)

log = logging.getLogger(__name__)

#: Compacted deltas kept for late joiners.
MAX_COMPACTED = 4
COMPLETE = "COMPLETE"

__all__ = ["CODEC_NAME", "COMPLETE", "Encoded", "VersionStore", "encode_version"]


def _write_durably(path: Path, data: bytes) -> None:
    """Writes ``path`` and fsyncs it (its directory entry is its folder's fsync)."""
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def _fsync_dir(path: Path) -> None:
    """Makes the entries of folder ``path`` (files created, renamed or removed) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _version_meta(manifest: pb.Manifest) -> tuple[dict[str, str], pb.Canary, pb.VersionSignature]:
    """What describes a version rather than its encoding: every encoding of it carries the
    same (the publisher's signature included, so keyframes and compacted deltas verify)."""
    return dict(manifest.trace_context), manifest.canary, manifest.signature


def _same_tensor(held: RawTensor | None, sent: RawTensor) -> bool:
    """Whether ``sent`` is ``held`` byte for byte (dtype, shape and bits)."""
    return held is not None and (held.dtype, tuple(held.shape)) == (sent.dtype, tuple(sent.shape)) and bool(np.array_equal(held.bits, sent.bits))


class VersionStore:
    """The versions an origin or relay holds, in memory and on disk."""

    def __init__(
        self, data_dir: Path, keep: int = 16, chunk_bytes: int = 4 << 20, keyframe_every: int = 8, *, live_weights: bool = False, encode_threads: int = 1
    ) -> None:
        """``encode_threads``: tensors of a version encoded at once (the same bytes for any
        count; a frontier model's version is terabytes, one thread would take 20-40 minutes).
        ``live_weights``: the latest weights are buffers a decoder updates in place (a
        relay), which may hold half of the next version while a late joiner's compacted
        delta or keyframe is encoded; the store then rebuilds the latest weights from its
        own keyframe and deltas for those instead of reading the buffers."""
        self.data_dir = Path(data_dir)
        self.live_weights = live_weights
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self.chunk_bytes = chunk_bytes
        self.keyframe_every = keyframe_every
        self.encode_threads = max(1, encode_threads)
        self.deltas: dict[int, Encoded] = {}
        self.keyframes: dict[int, Encoded] = {}
        self.latest = -1
        self.weights: dict[str, RawTensor] = {}
        # What the last encoding left for coding the next delta against ``weights``
        # (position indexes, element-hash sums): no extra pass over the model per version.
        # Empty after a restart or a version received already encoded (a relay).
        self.carried = Carried()
        # (version, base) -> compacted delta for late joiners; memory only, a few at most.
        self.compacted: dict[tuple[int, int], Encoded] = {}
        self.compacted_built = 0
        # The previous weights' buffers, for decoding the next rank-encoded version into
        # (see take_spare). Keeping them costs a second copy of the model between versions,
        # which a version being decoded needs anyway.
        self.spare: Spare | None = None
        self._recover()

    # ------------------------------------------------------------ publishing

    def publish(
        self,
        version: int,
        weights: Weights,
        expected_hash: str = "",
        trace_context: Mapping[str, str] | None = None,
        canary: pb.Canary | None = None,
        signature: pb.VersionSignature | None = None,
    ) -> Encoded:
        """Stores ``version`` (a delta on the latest, or a keyframe for the first), with the
        publisher's ``signature`` in its manifest as given (checked by the caller, if at all).

        A version already held may be published again with the same weights (a trainer
        replaying from its checkpoint after a crash): that returns the stored encoding
        and changes nothing. Other weights under a held version are refused."""
        if not weights:
            raise InvalidArgument(f"version {version} has no tensors")
        if version <= self.latest:
            return self._republished(version, weights)
        base = self.weights if self.latest >= 0 else None
        enc = encode_version(version, weights, base, self.latest, self.chunk_bytes, trace_context, canary, signature, self.carried, self.encode_threads)
        if expected_hash and expected_hash != enc.manifest.weights_hash:
            raise DataLoss(f"version {version}: received weights hash {enc.manifest.weights_hash[:12]} != publisher's {expected_hash[:12]}")
        return self.add_encoded(enc, weights)

    def publish_assembled(
        self,
        version: int,
        weights: Weights,
        payloads: Mapping[str, list[bytes]],
        base_version: int,
        digest: str,
        expected_hash: str = "",
        trace_context: Mapping[str, str] | None = None,
        canary: pb.Canary | None = None,
        signature: pb.VersionSignature | None = None,
        carried: Carried | None = None,
        sha256: Mapping[str, list[str]] | None = None,
        changes: Changes | None = None,
    ) -> Encoded:
        """:meth:`publish` for a version whose tensors were encoded apart (a sharded
        publish's parts, each against the weights of ``base_version`` and over
        :attr:`carried`) and whose weights hash ``digest`` was combined from the parts: the
        same checks, the same manifest and chunks as :meth:`publish` of the whole
        ``weights``; ``carried`` is what the parts left after it, ``sha256`` the payloads'
        digests the parts' encoders computed, ``changes`` those of the tensors decoded from
        rank-encoded parts (the base's buffers of those tensors then become the spare the
        next version decodes into, see :meth:`take_spare`). Refuses (ABORTED)
        when the latest version moved past ``base_version`` while the parts were encoding."""
        if not weights:
            raise InvalidArgument(f"version {version} has no tensors")
        if version <= self.latest:
            return self._republished(version, weights)
        if base_version != self.latest:
            raise Aborted(f"version {version} was encoded against version {base_version}, but the latest is now {self.latest}; publish it again")
        check_tensor_set(version, weights, self.weights if self.latest >= 0 else None)
        if expected_hash and expected_hash != digest:
            raise DataLoss(f"version {version}: received weights hash {digest[:12]} != publisher's {expected_hash[:12]}")
        enc = assemble_version(version, weights, payloads, base_version, digest, trace_context, canary, signature, sha256)
        enc.carried = carried or Carried()
        previous = self.weights
        stored = self.add_encoded(enc, weights)
        if changes:
            self.spare = Spare({n: previous[n] for n in changes if n in previous}, dict(changes))
        return stored

    def take_spare(self) -> Spare | None:
        """Buffers the next version's rank-encoded parts can be decoded into instead of
        fresh copies of the latest weights (see :class:`~services.weightsync.versions.Spare`):
        the tensors of the version before the latest, which nothing reads any more, and the
        latest's changes against them. Given once (the caller writes into them), and only
        while the latest version is the one they lead to."""
        spare, self.spare = self.spare, None
        return spare

    def _republished(self, version: int, weights: Weights) -> Encoded:
        held = self.deltas.get(version) or self.keyframes.get(version)
        if held is None:
            raise FailedPrecondition(f"version {version} is older than the latest ({self.latest}) and no longer held: a republish cannot be checked")
        received = weights_hash(weights)
        if received != held.manifest.weights_hash:
            raise AlreadyExists(
                f"version {version} is held with weights hash {held.manifest.weights_hash[:12]}; the republished weights hash to {received[:12]} "
                "(a trainer that did not replay deterministically, or another job publishing to this origin)"
            )
        log.info("version %d republished with identical weights; nothing changes", version)
        return held

    def republished_part(self, version: int, tensors: Weights, weights_hash: str = "") -> Encoded:
        """:meth:`_republished` for one part of a sharded publish of a held ``version`` (a
        rank's retry after the version was stored, or a republish): ``tensors`` must be
        the held version's tensors of those names byte for byte, and ``weights_hash`` (the
        version's, which every part carries; empty: not checked) the held one. Returns the
        held encoding; FAILED_PRECONDITION when the version can no longer be checked,
        ALREADY_EXISTS when the part differs from it."""
        held = self.deltas.get(version) or self.keyframes.get(version)
        reference = self.weights_at(version) if held is not None else None
        if held is None or reference is None:
            raise FailedPrecondition(f"version {version} is older than the latest ({self.latest}) and no longer held: a republished part cannot be checked")
        if weights_hash and weights_hash != held.manifest.weights_hash:
            raise AlreadyExists(
                f"version {version} is held with weights hash {held.manifest.weights_hash[:12]}; the republished part says {weights_hash[:12]} "
                "(a trainer that did not replay deterministically, or another job publishing to this origin)"
            )
        differ = sorted(n for n, t in tensors.items() if not _same_tensor(reference.get(n), t))
        if differ:
            raise AlreadyExists(f"version {version} is held with other contents in tensors {differ[:5]} than the republished part sends")
        return held

    def add_encoded(self, enc: Encoded, weights: Weights) -> Encoded:
        """Records an encoded version whose decoded ``weights`` the caller already holds
        (they must not change during the call: a keyframe may be encoded from them).

        All or nothing: everything the version needs is written to disk first (its keyframe
        too, when one is due), and only then recorded; a step that fails removes what this
        call wrote, so a version never acknowledged is neither served nor recovered."""
        version = enc.manifest.version
        self.spare = None  # it led to the version before this one
        keyframe = self._write_version(enc, weights)
        (self.keyframes if enc.is_keyframe else self.deltas)[version] = enc
        if keyframe is not None:
            self.keyframes[version] = keyframe
        self.weights, self.latest = dict(weights), version
        # Kept for the latest version only (the indexes are ~10 % of the model's size).
        self.carried, enc.carried = enc.carried, Carried()
        self.compacted = {k: e for k, e in self.compacted.items() if k[0] == version}
        self._retain()
        return enc

    def _write_version(self, enc: Encoded, weights: Weights) -> Encoded | None:
        """Persists ``enc`` and, when one is due, a keyframe of ``weights`` (returned), or
        nothing: on any failure the folders written here are removed again."""
        version = enc.manifest.version
        written: list[Path] = []
        try:
            self._persist(enc, written)
            if version % self.keyframe_every != 0 or enc.is_keyframe:
                return None
            keyframe = encode_version(version, weights, None, -1, self.chunk_bytes, *_version_meta(enc.manifest), threads=self.encode_threads)
            return self._persist(keyframe, written)
        except BaseException:
            self._unpersist(written)
            raise

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
            compacted = encode_version(
                self.latest, self._latest_weights(), base, from_version, self.chunk_bytes, *_version_meta(self.manifest(self.latest)), threads=self.encode_threads
            )
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
        if version == self.latest and not self.live_weights:
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
            latest = self._latest_weights()
            self.keyframes[self.latest] = encode_version(
                self.latest, latest, None, -1, self.chunk_bytes, *_version_meta(self.manifest(self.latest)), threads=self.encode_threads
            )
        return self.keyframes[self.latest]

    def _latest_weights(self) -> Mapping[str, RawTensor]:
        """The latest weights, safe to encode from (see ``live_weights``)."""
        if not self.live_weights:
            return self.weights
        rebuilt = self.weights_at(self.latest)
        if rebuilt is None:
            raise FailedPrecondition(f"version {self.latest} cannot be rebuilt from the versions held")
        return rebuilt

    def versions(self) -> list[int]:
        return sorted(set(self.deltas) | set(self.keyframes))

    def stored_bytes(self) -> int:
        return sum(e.size for e in (*self.deltas.values(), *self.keyframes.values()))

    # ------------------------------------------------------------ disk

    def _dir(self, version: int, keyframe: bool) -> Path:
        return self.data_dir / f"{version:010d}" / ("keyframe" if keyframe else "delta")

    def _persist(self, enc: Encoded, written: list[Path] | None = None) -> Encoded:
        """Writes ``enc`` durably into its folder (see the module's docstring), unless the
        folder holds it already; adds the folder to ``written`` when it wrote it."""
        final = self._dir(enc.manifest.version, enc.is_keyframe)
        if self._holds(final, enc):
            return enc
        tmp = final.with_name(final.name + ".tmp")
        try:
            self._write_folder(tmp, enc)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        # A complete folder of other bytes (left by a crash, never acknowledged) goes.
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        if written is not None:
            written.append(final)
        # The rename itself lives in the version's folder, and a new version's folder in
        # the data folder: both are synced before the version counts as stored.
        _fsync_dir(final.parent)
        _fsync_dir(self.data_dir)
        return enc

    @staticmethod
    def _holds(folder: Path, enc: Encoded) -> bool:
        """Whether ``folder`` is complete and holds ``enc`` (its manifest names every
        chunk's size and sha256; the chunks file must have their total size)."""
        if not (folder / COMPLETE).exists():
            return False
        try:
            manifest = pb.Manifest.FromString((folder / "manifest.pb").read_bytes())
            size = (folder / "chunks.bin").stat().st_size
        except (OSError, DecodeError):
            return False
        return manifest == enc.manifest and size == sum(len(c) for c in enc.chunks)

    @staticmethod
    def _write_folder(tmp: Path, enc: Encoded) -> None:
        """``enc``'s files, fsynced, in the new folder ``tmp`` (to be renamed into place)."""
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        _write_durably(tmp / "manifest.pb", enc.manifest.SerializeToString())
        with open(tmp / "chunks.bin", "wb") as fh:
            for payload in enc.chunks:
                fh.write(payload)
            fh.flush()
            os.fsync(fh.fileno())
        _write_durably(tmp / COMPLETE, b"ok\n")
        # The folder's entries before the rename: a renamed folder whose files were
        # never recorded in it would come back empty after a crash.
        _fsync_dir(tmp)

    def _unpersist(self, folders: list[Path]) -> None:
        """Removes version folders a failed add wrote (and their version's folder when
        that is left empty), durably: a restart must not recover them."""
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
            version_dir = folder.parent
            with contextlib.suppress(OSError):  # not empty: the other kind is held
                version_dir.rmdir()
            if version_dir.exists():
                _fsync_dir(version_dir)
        if folders:
            _fsync_dir(self.data_dir)

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
            if folder.name.endswith(".tmp"):
                # Written before a rename that never happened (a crash): never a version,
                # whatever it holds.
                log.warning("removing %s: a version folder never renamed into place", folder)
                shutil.rmtree(folder, ignore_errors=True)
                continue
            enc = self._load(folder)
            if enc is None:
                continue
            if enc.manifest.codec not in READABLE_CODECS:
                log.warning("skipping %s: codec %r, this store reads %r", folder, enc.manifest.codec, READABLE_CODECS)
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
