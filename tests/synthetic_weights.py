"""Small bf16 models and their RL-like steps for weightsync and rollout tests: two tensors
("a.weight", "b.weight") of normal(0, 0.02) values, and steps that move a sparse set of
elements by one bf16 ulp, like an Adam step (the deltas a real step makes, in miniature)."""
from __future__ import annotations

import numpy as np

from meridian.tensors import RawTensor, Weights, weights_hash


def bf16_weights(seed: int, n: int) -> dict[str, RawTensor]:
    """``n`` bf16 elements, a third of them in "a.weight", the rest in "b.weight"
    (a keyframe of them compresses to ~25 %)."""
    rng = np.random.default_rng(seed)
    bits = (rng.normal(0, 0.02, n).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    cut = n // 3
    return {"a.weight": RawTensor("bf16", (cut,), bits[:cut].copy()), "b.weight": RawTensor("bf16", (n - cut,), bits[cut:].copy())}


def stepped(w: Weights, seed: int, frac: float = 0.005) -> dict[str, RawTensor]:
    """The next version of ``w``: ``frac`` of each tensor's elements (at least one) moved
    by one ulp."""
    rng = np.random.default_rng(1000 + seed)
    out = {}
    for name, t in w.items():
        bits = t.bits.copy()
        bits[rng.choice(bits.size, size=max(1, int(bits.size * frac)), replace=False)] += 1
        out[name] = RawTensor(t.dtype, t.shape, bits)
    return out


def chain(n_versions: int, n: int) -> list[dict[str, RawTensor]]:
    """Versions 0 .. ``n_versions`` - 1 of an ``n``-element model, each a step of the last."""
    versions = [bf16_weights(0, n)]
    for v in range(1, n_versions):
        versions.append(stepped(versions[-1], v))
    return versions


def copied(w: Weights) -> dict[str, RawTensor]:
    """A deep copy (the bits too)."""
    return {n: RawTensor(t.dtype, t.shape, t.bits.copy()) for n, t in w.items()}


def same(a: Weights, b: Weights) -> bool:
    """The same tensor names with the same bits, and the same weights hash."""
    return set(a) == set(b) and all(np.array_equal(a[k].bits, b[k].bits) for k in a) and weights_hash(a) == weights_hash(b)
