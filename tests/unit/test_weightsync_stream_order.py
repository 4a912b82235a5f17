"""The order a version's chunks travel in (versions.stream_order): every chunk once, each
tensor's in order, and decode work arriving in step with the bytes."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from meridian.tensors import RawTensor, weights_hash
from services.weightsync.receiver import decode_all
from services.weightsync.versions import CHUNK_DECODE_OVERHEAD_BYTES, encode_version, stream_order


def _largest_gap(sizes: list[tuple[str, list[int]]], order: list[tuple[str, int]]) -> float:
    """The largest difference, along the stream, between the share of the bytes sent and
    the share of the decode work sent."""
    by = dict(sizes)
    b = np.array([by[n][j] for n, j in order], dtype=float)
    w = b + CHUNK_DECODE_OVERHEAD_BYTES
    return float(np.max(np.abs(np.cumsum(b) / b.sum() - np.cumsum(w) / w.sum())))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 50_000), min_size=1, max_size=12), min_size=1, max_size=30))
def test_every_chunk_once_and_each_tensor_in_order(chunk_sizes):
    sizes = [(f"t{i:02d}", s) for i, s in enumerate(chunk_sizes)]
    order = stream_order(sizes)
    assert sorted(order) == sorted((n, j) for n, s in sizes for j in range(len(s)))
    for name, s in sizes:
        assert [j for n, j in order if n == name] == list(range(len(s)))


def test_a_dense_tensor_is_spread_among_the_small_chunks():
    """One tensor of large chunks (a dense embedding delta: most of the bytes) and many of
    small chunks (most of the work): name order sends the bytes first and leaves most of
    the work to the end; the stream order keeps the two shares within one chunk's."""
    sizes = [("a.embed", [20_000] * 14)] + [(f"layer.{i:03d}", [300]) for i in range(270)]
    in_name_order = [(n, j) for n, s in sizes for j in range(len(s))]
    assert _largest_gap(sizes, in_name_order) > 0.15
    order = stream_order(sizes)
    largest_chunk_share = 20_000 / sum(sum(s) for _, s in sizes)
    assert _largest_gap(sizes, order) <= largest_chunk_share


def test_a_version_in_stream_order_decodes_bit_exactly():
    rng = np.random.default_rng(0)
    old = {
        "a.embed": RawTensor("bf16", (4096,), rng.integers(0, 1 << 15, 4096, dtype=np.uint16)),
        **{f"layer.{i}": RawTensor("bf16", (256,), rng.integers(0, 1 << 15, 256, dtype=np.uint16)) for i in range(8)},
    }
    new = {k: RawTensor(t.dtype, t.shape, t.bits.copy()) for k, t in old.items()}
    new["a.embed"].bits[::3] += 1  # dense: most of the bytes
    for i in range(8):
        new[f"layer.{i}"].bits[i] += 1
    first = encode_version(0, old, None, -1, 1024)
    delta = encode_version(1, new, old, 0, 1024)
    tensors = [ref.tensor for ref in delta.manifest.chunks]
    assert tensors != sorted(tensors), "the dense tensor's chunks should be spread out"
    held = decode_all([first, delta]).weights
    assert weights_hash(held) == weights_hash(new)
    assert all(np.array_equal(held[k].bits, new[k].bits) for k in new)
