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

What the store holds is one :class:`Held` snapshot, never changed once made: a step that
changes the store builds the next snapshot and swaps it in with one assignment, so a
reader on another thread (the server's event loop, while a store step runs on a thread)
that takes :attr:`VersionStore.held` once sees one consistent state.

This is the service's pure core: no gRPC, no asyncio.
"""
from __future__ import annotations

import contextlib
import dataclasses
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
    CODEC_NAME, READABLE_CODECS, Carried, Changes, Encoded, Spare, assemble_version, carried_for, check_tensor_set, encode_version,
)

log = logging.getLogger(__name__)

#: Compacted deltas kept for late joiners.
MAX_COMPACTED = 4
COMPLETE = "COMPLETE"

__all__ = ["CODEC_NAME", "COMPLETE", "Encoded", "Held", "VersionStore", "encode_version"]


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


@dataclasses.dataclass(frozen=True)
class Held:
    """What a store holds at one moment. Neither it nor its dicts change once it is the
    store's :attr:`~VersionStore.held`: the store swaps in a new one instead, so a reader
    on another thread can iterate its dicts and combine its fields (a version's weights
    with the indexes its encoding left) while a store step runs. A version enters a
    state only once its data is in place (a stored version's folder is written and
    fsynced; a keyframe or compacted delta built for late joiners lives in memory), and
    a version's folder is removed only after a state without it was swapped in."""

    #: The newest version (-1: none).
    latest: int = -1
    #: Its weights (a relay's: buffers its decoder updates in place, see ``live_weights``).
    weights: dict[str, RawTensor] = dataclasses.field(default_factory=dict)
    #: What the latest version's encoding left for coding the next delta against
    #: ``weights`` (position indexes, element-hash sums): no extra pass over the model
    #: per version. Empty after a restart or a version received already encoded (a relay).
    carried: Carried = dataclasses.field(default_factory=Carried)
    deltas: Mapping[int, Encoded] = dataclasses.field(default_factory=dict)
    keyframes: Mapping[int, Encoded] = dataclasses.field(default_factory=dict)
    #: (version, base) -> compacted delta for late joiners; memory only, a few at most.
    compacted: Mapping[tuple[int, int], Encoded] = dataclasses.field(default_factory=dict)
    compacted_built: int = 0

    def encoding(self, version: int) -> Encoded | None:
        """The stored encoding of ``version`` (its delta, else its keyframe), if held."""
        return self.deltas.get(version) or self.keyframes.get(version)

    def versions(self) -> list[int]:
        """The versions held, oldest first."""
        return sorted({*self.deltas, *self.keyframes})

    def stored_bytes(self) -> int:
        """The encoded bytes of every stored delta and keyframe."""
        return sum(e.size for e in (*self.deltas.values(), *self.keyframes.values()))


class VersionStore:
    """The versions an origin or relay holds, in memory and on disk.

    One writer at a time (the server runs every step that changes the store under its
    store lock); readers on other threads take :attr:`held` once and read only from it."""

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
        self._held = Held()
        # The previous weights' buffers, for decoding the next rank-encoded version into
        # (see take_spare), with the version they lead to. Keeping them costs a second copy
        # of the model between versions, which a version being decoded needs anyway.
        self._spare: tuple[int, Spare] | None = None
        self._recover()

    # ------------------------------------------------------------ state

    @property
    def held(self) -> Held:
        """What the store holds now, one consistent state: a reader that combines fields
        (the latest version and its weights, the versions and their bytes) takes this once."""
        return self._held

    @property
    def latest(self) -> int:
        return self._held.latest

    @property
    def weights(self) -> dict[str, RawTensor]:
        return self._held.weights

    @property
    def carried(self) -> Carried:
        return self._held.carried

    @property
    def deltas(self) -> Mapping[int, Encoded]:
        return self._held.deltas

    @property
    def keyframes(self) -> Mapping[int, Encoded]:
        return self._held.keyframes

    @property
    def compacted(self) -> Mapping[tuple[int, int], Encoded]:
        return self._held.compacted

    @property
    def compacted_built(self) -> int:
        return self._held.compacted_built

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
        held = self._held
        if version <= held.latest:
            return self._republished(version, weights)
        base = held.weights if held.latest >= 0 else None
        enc = encode_version(version, weights, base, held.latest, self.chunk_bytes, trace_context, canary, signature, held.carried, self.encode_threads)
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
        held = self._held
        if version <= held.latest:
            return self._republished(version, weights)
        if base_version != held.latest:
            raise Aborted(f"version {version} was encoded against version {base_version}, but the latest is now {held.latest}; publish it again")
        check_tensor_set(version, weights, held.weights if held.latest >= 0 else None)
        if expected_hash and expected_hash != digest:
            raise DataLoss(f"version {version}: received weights hash {digest[:12]} != publisher's {expected_hash[:12]}")
        enc = assemble_version(version, weights, payloads, base_version, digest, trace_context, canary, signature, sha256)
        enc.carried = carried or Carried()
        previous = held.weights
        stored = self.add_encoded(enc, weights)
        if changes:
            self._spare = (version, Spare({n: previous[n] for n in changes if n in previous}, dict(changes)))
        return stored

    def take_spare(self, base_version: int) -> Spare | None:
        """Buffers the next version's rank-encoded parts can be decoded into instead of
        fresh copies of the latest weights (see :class:`~services.weightsync.versions.Spare`):
        the tensors of the version before the latest, which nothing reads any more, and the
        latest's changes against them. Given once (the caller writes into them), and only
        when they lead to ``base_version``, the version the caller read as the latest (a
        store step may have stored another meanwhile)."""
        spare, self._spare = self._spare, None  # one step: a store thread may set it too
        return spare[1] if spare is not None and spare[0] == base_version else None

    def _republished(self, version: int, weights: Weights) -> Encoded:
        state = self._held
        held = state.encoding(version)
        if held is None:
            raise FailedPrecondition(f"version {version} is older than the latest ({state.latest}) and no longer held: a republish cannot be checked")
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
        held = self._held.encoding(version)
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

    @property
    def unprepared(self) -> bool:
        """Whether the latest version has nothing carried for encoding the next delta (an
        origin that published only a keyframe so far, or restarted): what
        :meth:`prepare_next` builds. Never for a relay's store, which encodes no deltas."""
        held = self._held
        return held.latest >= 0 and not self.live_weights and not held.carried.indexes

    def prepare_next(self) -> bool:
        """Builds, when :attr:`unprepared`, what encoding the next delta would build first:
        the latest version's chunk position indexes and tensor hash sums
        (:func:`carried_for`), so that the next publish encodes at its usual speed. A store
        step, like a publish. Returns whether it built."""
        if not self.unprepared:
            return False
        held = self._held
        self._held = dataclasses.replace(held, carried=carried_for(held.weights, self.chunk_bytes))
        return True

    def add_encoded(self, enc: Encoded, weights: Weights) -> Encoded:
        """Records an encoded version whose decoded ``weights`` the caller already holds
        (they must not change during the call: a keyframe may be encoded from them).

        All or nothing: everything the version needs is written to disk first (its keyframe
        too, when one is due), and only then recorded; a step that fails removes what this
        call wrote, so a version never acknowledged is neither served nor recovered."""
        version = enc.manifest.version
        self._spare = None  # it led to the version before this one
        keyframe = self._write_version(enc, weights)
        held = self._held
        deltas, keyframes = dict(held.deltas), dict(held.keyframes)
        (keyframes if enc.is_keyframe else deltas)[version] = enc
        if keyframe is not None:
            keyframes[version] = keyframe
        # Kept for the latest version only (the indexes are ~10 % of the model's size).
        carried, enc.carried = enc.carried, Carried()
        dropped = self._retain(version, deltas, keyframes)
        # One assignment: a reader sees the version with its weights and indexes, or none of them.
        self._held = dataclasses.replace(
            held, latest=version, weights=dict(weights), carried=carried, deltas=deltas, keyframes=keyframes,
            compacted={k: e for k, e in held.compacted.items() if k[0] == version},
        )
        self._remove(dropped)
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
        """The manifest of a held ``version`` (-1: the latest); NOT_FOUND if not held."""
        held = self._held
        version = held.latest if version < 0 else version
        enc = held.encoding(version)
        if enc is None:
            raise NotFound(f"version {version} is not held (latest {held.latest})")
        return enc.manifest

    def plan(self, from_version: int) -> list[Encoded]:
        """What to send a subscriber holding ``from_version`` to bring it to the latest:
        the chain of deltas, or a keyframe of the latest when that is smaller or the
        chain is not held."""
        held = self._held
        if held.latest < 0 or from_version >= held.latest:
            return []
        chain: list[Encoded] = []
        v = held.latest
        while v != from_version and v in held.deltas:
            chain.append(held.deltas[v])
            v = held.deltas[v].manifest.base_version
        if v == from_version and from_version >= 0:
            chain.reverse()
            if held.latest not in held.keyframes or sum(e.size for e in chain) <= held.keyframes[held.latest].size:
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
        held = self._held
        key = (held.latest, from_version)
        compacted = held.compacted.get(key)
        if compacted is None:
            base = self.weights_at(from_version)
            if base is None:
                return plan
            compacted = encode_version(
                held.latest, self._latest_weights(), base, from_version, self.chunk_bytes, *_version_meta(self.manifest(held.latest)), threads=self.encode_threads
            )
            self._keep_compacted(key, compacted)
        if compacted.size < sum(e.size for e in plan):
            return [compacted]
        return plan

    def _keep_compacted(self, key: tuple[int, int], compacted: Encoded) -> None:
        """Adds a compacted delta to the few kept, the oldest going first (a new state)."""
        held = self._held
        kept = {**held.compacted, key: compacted}
        while len(kept) > MAX_COMPACTED:
            kept.pop(next(iter(kept)))
        self._held = dataclasses.replace(held, compacted=kept, compacted_built=held.compacted_built + 1)

    def find(self, version: int, base_version: int) -> Encoded | None:
        """The held encoding of ``version`` against ``base_version`` (-1: keyframe), if any."""
        held = self._held
        for enc in (held.deltas.get(version), held.keyframes.get(version), held.compacted.get((version, base_version))):
            if enc is not None and enc.manifest.base_version == base_version:
                return enc
        return None

    def weights_at(self, version: int) -> dict[str, RawTensor] | None:
        """Rebuilds the weights of a held ``version`` from the newest keyframe at or before it
        and the deltas after that keyframe; None when the store cannot."""
        held = self._held
        if version == held.latest and not self.live_weights:
            return dict(held.weights)
        starts = [k for k in held.keyframes if k <= version]
        for start in sorted(starts, reverse=True):
            chain, v = [], version
            while v != start and v in held.deltas:
                chain.append(held.deltas[v])
                v = held.deltas[v].manifest.base_version
            if v == start:
                return decode_all([held.keyframes[start], *reversed(chain)]).weights
        return None

    def keyframe_of_latest(self) -> Encoded:
        """A keyframe of the latest version: the stored one, or one encoded now and kept
        in memory (a new state) for the next late joiner."""
        held = self._held
        keyframe = held.keyframes.get(held.latest)
        if keyframe is None:
            keyframe = encode_version(
                held.latest, self._latest_weights(), None, -1, self.chunk_bytes, *_version_meta(self.manifest(held.latest)), threads=self.encode_threads
            )
            self._held = dataclasses.replace(held, keyframes={**held.keyframes, held.latest: keyframe})
        return keyframe

    def _latest_weights(self) -> Mapping[str, RawTensor]:
        """The latest weights, safe to encode from (see ``live_weights``)."""
        held = self._held
        if not self.live_weights:
            return held.weights
        rebuilt = self.weights_at(held.latest)
        if rebuilt is None:
            raise FailedPrecondition(f"version {held.latest} cannot be rebuilt from the versions held")
        return rebuilt

    def versions(self) -> list[int]:
        """The versions held, oldest first (see :meth:`Held.versions`)."""
        return self._held.versions()

    def stored_bytes(self) -> int:
        """The encoded bytes held (see :meth:`Held.stored_bytes`)."""
        return self._held.stored_bytes()

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
        deltas: dict[int, Encoded] = {}
        keyframes: dict[int, Encoded] = {}
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
            (keyframes if enc.is_keyframe else deltas)[enc.manifest.version] = enc
        if not keyframes:
            return  # deltas alone cannot be decoded: nothing is held
        start = max(keyframes)
        decoder = decode_all([keyframes[start]])
        v = start
        while (nxt := next((d for d in sorted(deltas) if d > v and deltas[d].manifest.base_version == v), None)) is not None:
            decoder = decode_all([deltas[nxt]], decoder.weights, v)
            v = nxt
        self._held = Held(latest=v, weights=decoder.weights, deltas=deltas, keyframes=keyframes)
        log.info("recovered versions up to %d from %s", v, self.data_dir)

    def _retain(self, latest: int, deltas: dict[int, Encoded], keyframes: dict[int, Encoded]) -> list[Path]:
        """Keeps the newest ``keep`` versions up to ``latest``, plus the newest keyframe
        recovery needs: drops the others from ``deltas`` and ``keyframes`` (the next
        state's) and returns their folders, removed once that state is in place."""
        floor = latest - self.keep
        persisted = [k for k in keyframes if (self._dir(k, True) / COMPLETE).exists()]
        anchor = max(persisted, default=-1)
        dropped: list[Path] = []
        for version in [v for v in deltas if v <= min(floor, anchor)]:
            del deltas[version]
            dropped.append(self._dir(version, False))
        for version in [k for k in keyframes if k not in (anchor, latest) and k <= floor]:
            del keyframes[version]
            dropped.append(self._dir(version, True))
        return dropped

    def _remove(self, folders: list[Path]) -> None:
        """Removes the folders of versions no longer held, and version folders left empty."""
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
        for folder in self.data_dir.iterdir():
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()
