"""What the engine must write to serve a new version: the changed elements, from the
weightsync decoder's undo logs, in checkpoint coordinates.

The decoder updates its buffers in place and records, per version, which elements it
changed (:class:`~services.weightsync.client.UndoLog`). The engine only needs those
elements' new values: a version touches well under 1 % of them. When the engine did not
take one or more versions (a rejected update), the change set spans all of them since
the version the engine serves: the union of their positions, with today's values.
Tensors the decoder replaced whole (a keyframe) travel whole.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from meridian.errors import FailedPrecondition
from services.rollout import rpc_arrays
from services.weightsync.client import UndoLog
from meridian.tensors import RawTensor


@dataclasses.dataclass
class ChangeSet:
    """Elements to write to go from ``base_version`` (served) to ``version``."""

    version: int
    base_version: int
    #: name -> (ascending flat positions, new raw bits there)
    sparse: dict[str, tuple[np.ndarray, np.ndarray]]
    #: name -> the whole tensor's new raw bits
    dense: dict[str, np.ndarray]
    #: name -> (dtype, shape) of every tensor named above
    meta: dict[str, tuple[str, tuple[int, ...]]]

    @property
    def elements(self) -> int:
        """Elements the engine writes."""
        return sum(p.shape[0] for p, _ in self.sparse.values()) + sum(v.shape[0] for v in self.dense.values())

    def is_full(self, tensor_count: int) -> bool:
        """True when every one of ``tensor_count`` tensors travels whole."""
        return not self.sparse and len(self.dense) == tensor_count

    def positions(self) -> dict[str, np.ndarray]:
        """Changed positions per tensor (all positions of a dense tensor are implied, not listed)."""
        return {name: pos for name, (pos, _) in self.sparse.items()}

    @classmethod
    def whole(cls, weights: Mapping[str, RawTensor], version: int, base_version: int) -> ChangeSet:
        """Every tensor, whole (a keyframe, or the fallback that rewrites everything)."""
        return cls(version, base_version, {}, {n: t.bits for n, t in weights.items()}, {n: (t.dtype, t.shape) for n, t in weights.items()})

    @classmethod
    def from_undos(cls, weights: Mapping[str, RawTensor], undos: Sequence[UndoLog]) -> ChangeSet:
        """The elements ``undos`` (oldest first; each a delta on the one before, or a
        keyframe) changed, with their values in ``weights`` (the decoder's buffers, as of
        the last undo's version). A keyframe replaces every tensor, so what follows one
        does not depend on what preceded it."""
        if not undos:
            raise ValueError("no versions to apply")
        for older, newer in zip(undos, undos[1:]):
            if newer.base_version >= 0 and newer.base_version != older.version:
                raise ValueError(f"undo logs are not consecutive: {older.version} then a delta on {newer.base_version}")
        parts: dict[str, list[np.ndarray]] = {}
        dense: set[str] = set()
        for undo in undos:
            for name, positions, _old in undo.changes:
                parts.setdefault(name, []).append(positions)
            for name, start, old in undo.ranges:
                parts.setdefault(name, []).append(np.arange(start, start + old.shape[0], dtype=np.int64))
            for name in undo.replaced:
                if name not in weights:
                    raise FailedPrecondition(f"version {undo.version} drops tensor {name!r}; an engine cannot drop a tensor in place")
                dense.add(name)
        sparse: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for name, pieces in parts.items():
            if name in dense:
                continue
            positions = np.unique(np.concatenate(pieces)) if len(pieces) > 1 else np.sort(pieces[0])
            sparse[name] = (positions, weights[name].bits[positions])
        meta = {n: (weights[n].dtype, tuple(weights[n].shape)) for n in (*sparse, *dense)}
        return cls(undos[-1].version, undos[0].base_version, sparse, {n: weights[n].bits for n in dense}, meta)

    def as_plain(self) -> dict[str, object]:
        """Builtins and numpy only, for the engine's worker processes."""
        return {
            "version": self.version,
            "sparse": {n: (rpc_arrays.pack_positions(p), rpc_arrays.pack(v)) for n, (p, v) in self.sparse.items()},
            "dense": {n: rpc_arrays.pack(v) for n, v in self.dense.items()},
            "meta": {n: (d, list(s)) for n, (d, s) in self.meta.items()},
        }
