"""Where each checkpoint tensor's elements live inside the engine's own tensors.

Inference engines do not keep checkpoint tensors as they are: vLLM fuses
``q_proj``/``k_proj``/``v_proj`` into one ``qkv_proj`` weight, ``gate_proj``/``up_proj``
into ``gate_up_proj``, ties ``lm_head`` to the embedding, and may shard. A weight update
that names changed elements in checkpoint coordinates (what weightsync decodes) must be
translated into the engine's coordinates, and what the engine reads back must be
translated the other way to be compared with the published weights.

A :class:`WeightLayout` is that translation as contiguous *runs* (checkpoint elements
``[src, src+n)`` are engine elements ``[dst, dst+n)`` of one engine tensor). It is not
written by hand per model: the rollout worker records what vLLM's own loader copies
where (see ``served_weights``), so the layout is whatever the engine's loader does, and
:meth:`WeightLayout.validate` refuses one that does not cover every element exactly once.
Pure numpy; no torch or vLLM here.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping

import numpy as np


class LayoutError(ValueError):
    """The engine's loader does something a run layout cannot express (or it is inconsistent)."""


@dataclasses.dataclass(frozen=True)
class Run:
    """Checkpoint elements ``[src_start, src_start + length)`` of one tensor are engine
    elements ``[dst_start, dst_start + length)`` of tensor ``target`` (flat, row-major)."""

    target: str
    src_start: int
    dst_start: int
    length: int


@dataclasses.dataclass(frozen=True)
class Placed:
    """Some checkpoint elements as they land in one engine tensor."""

    target: str
    positions: np.ndarray  # int64, flat positions in the engine tensor
    index: np.ndarray  # int64, which of the input elements these are


@dataclasses.dataclass
class WeightLayout:
    """Checkpoint tensor name -> runs, and each engine tensor's shape."""

    runs: dict[str, list[Run]]
    targets: dict[str, tuple[int, ...]]

    def __post_init__(self) -> None:
        self._by_target: dict[str, list[tuple[str, Run]]] = {}
        for name, runs in self.runs.items():
            for r in runs:
                self._by_target.setdefault(r.target, []).append((name, r))

    def validate(self, checkpoint_shapes: Mapping[str, tuple[int, ...]]) -> None:
        """Raises :class:`LayoutError` unless every checkpoint element lands exactly once,
        inside its target, and no two elements land on the same engine element."""
        if set(self.runs) != set(checkpoint_shapes):
            missing = sorted(set(checkpoint_shapes) - set(self.runs))
            extra = sorted(set(self.runs) - set(checkpoint_shapes))
            raise LayoutError(f"layout and checkpoint disagree on tensors (not placed {missing[:3]}, unknown {extra[:3]})")
        claimed: dict[str, list[tuple[int, int]]] = {}
        for name, runs in self.runs.items():
            numel = math.prod(checkpoint_shapes[name])
            covered = sorted((r.src_start, r.src_start + r.length) for r in runs)
            if any(r.length <= 0 for r in runs) or covered[0][0] != 0 or covered[-1][1] != numel or any(
                a[1] != b[0] for a, b in zip(covered, covered[1:])
            ):
                raise LayoutError(f"{name}: runs {covered[:4]} do not cover its {numel} elements exactly once")
            for r in runs:
                if r.target not in self.targets:
                    raise LayoutError(f"{name}: run into unknown engine tensor {r.target!r}")
                if r.dst_start < 0 or r.dst_start + r.length > math.prod(self.targets[r.target]):
                    raise LayoutError(f"{name}: run [{r.dst_start}, +{r.length}) outside {r.target}{list(self.targets[r.target])}")
                claimed.setdefault(r.target, []).append((r.dst_start, r.dst_start + r.length))
        for target, spans in claimed.items():
            spans.sort()
            if any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
                raise LayoutError(f"two checkpoint tensors land on the same elements of {target}")

    def uncovered(self) -> dict[str, int]:
        """Engine tensors with elements no checkpoint element lands on (padding): count."""
        covered: dict[str, int] = {t: 0 for t in self.targets}
        for runs in self.runs.values():
            for r in runs:
                covered[r.target] += r.length
        return {t: math.prod(self.targets[t]) - n for t, n in covered.items() if math.prod(self.targets[t]) != n}

    # ------------------------------------------------------------ translation

    def place(self, name: str, positions: np.ndarray) -> Iterator[Placed]:
        """Checkpoint positions of tensor ``name`` (int64, any order) in engine coordinates."""
        for r in self.runs[name]:
            if len(self.runs[name]) == 1 and r.src_start == 0:
                yield Placed(r.target, positions + r.dst_start, np.arange(positions.shape[0], dtype=np.int64))
                return
            mask = (positions >= r.src_start) & (positions < r.src_start + r.length)
            index = np.flatnonzero(mask)
            if index.size:
                yield Placed(r.target, positions[index] - r.src_start + r.dst_start, index)

    def place_range(self, name: str, start: int, count: int) -> Iterator[tuple[str, int, int, int]]:
        """Checkpoint elements ``[start, start + count)`` of ``name`` as
        ``(target, dst_start, offset into the range, length)`` pieces."""
        for r in self.runs[name]:
            lo, hi = max(start, r.src_start), min(start + count, r.src_start + r.length)
            if lo < hi:
                yield r.target, r.dst_start + (lo - r.src_start), lo - start, hi - lo

    def to_checkpoint(self, target: str, positions: np.ndarray) -> Iterator[tuple[str, np.ndarray, np.ndarray]]:
        """Engine positions of ``target`` as ``(checkpoint name, positions, index)``;
        positions no checkpoint element lands on (padding) are left out."""
        for name, r in self._by_target.get(target, []):
            mask = (positions >= r.dst_start) & (positions < r.dst_start + r.length)
            index = np.flatnonzero(mask)
            if index.size:
                yield name, positions[index] - r.dst_start + r.src_start, index

    # ------------------------------------------------------------ transport

    def as_plain(self) -> dict[str, object]:
        """Builtins only, for pickling between processes without importing this module's types."""
        return {
            "runs": {n: [dataclasses.astuple(r) for r in runs] for n, runs in self.runs.items()},
            "targets": {t: list(s) for t, s in self.targets.items()},
        }

    @classmethod
    def from_plain(cls, plain: Mapping[str, object]) -> WeightLayout:
        runs = {n: [Run(*r) for r in rs] for n, rs in plain["runs"].items()}  # type: ignore[attr-defined]
        targets = {t: tuple(s) for t, s in plain["targets"].items()}  # type: ignore[attr-defined]
        return cls(runs, targets)
