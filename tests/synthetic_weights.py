"""Small bf16 models and their RL-like steps for weightsync and rollout tests: two tensors
("a.weight", "b.weight") of normal(0, 0.02) values, and steps that move 1 % of the elements
by one ulp (the deltas a real step makes, in miniature)."""
from __future__ import annotations

import numpy as np

from meridian.tensors import RawTensor, Weights


def bf16_weights(seed: int, n: int) -> Weights:
    """``n`` bf16 elements, a third of them in "a.weight", the rest in "b.weight"."""
    rng = np.random.default_rng(seed)
    bits = (rng.normal(0, 0.02, n).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return {"a.weight": RawTensor("bf16", (n // 3,), bits[: n // 3].copy()), "b.weight": RawTensor("bf16", (n - n // 3,), bits[n // 3 :].copy())}


def stepped(w: Weights, seed: int) -> Weights:
    """A delta of ``w``: 1 % of each tensor's elements moved by one ulp."""
    rng = np.random.default_rng(1000 + seed)
    out = {}
    for name, t in w.items():
        bits = t.bits.copy()
        bits[rng.choice(bits.size, size=bits.size // 100, replace=False)] += 1
        out[name] = RawTensor(t.dtype, t.shape, bits)
    return out


def copied(w: Weights) -> Weights:
    """A deep copy (the bits too)."""
    return {n: RawTensor(t.dtype, t.shape, t.bits.copy()) for n, t in w.items()}


def same(a: Weights, b: Weights) -> bool:
    """The same tensor names with the same bits."""
    return set(a) == set(b) and all(np.array_equal(a[n].bits, b[n].bits) for n in a)
