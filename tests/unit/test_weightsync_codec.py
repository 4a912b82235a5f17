"""Tests for the weight-sync delta codec (services/weightsync/codec/)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.weightsync import codec
from services.weightsync.codec import CodecError, decode_chunk_into, encode_tensor
from benchmarks.codec import fp32_to_bf16_bits, run_codec_bench, synthetic_adam_versions

# Interesting raw bit patterns per dtype: +-0, +-inf, NaNs (quiet, signalling,
# with payload), denormals, extremes of the finite range.
SPECIAL = {
    "bf16": [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x7F81, 0x0001, 0x8001, 0x7F7F, 0xFF7F, 0x3F80],
    "fp16": [0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E00, 0xFE01, 0x7C01, 0x0001, 0x8001, 0x7BFF, 0xFBFF, 0x3C00],
    "fp32": [
        0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001,
        0x7F800001, 0x00000001, 0x80000001, 0x7F7FFFFF, 0xFF7FFFFF, 0x3F800000,
    ],
}


def _roundtrip(new: np.ndarray, old: np.ndarray | None, dtype: str, chunk_elems: int) -> list:
    chunks = encode_tensor("t", new, old, dtype, chunk_elems=chunk_elems)
    out = np.empty_like(new)
    for c in chunks:
        decode_chunk_into(c.payload, out, old)
    assert np.array_equal(out, new), "round trip is not bit exact"
    return chunks


@st.composite
def tensor_pairs(draw):
    """(dtype, old, new, chunk_elems) with mixed change patterns."""
    dtype = draw(st.sampled_from(sorted(codec.DTYPES)))
    raw = codec.DTYPES[dtype]
    n = draw(st.integers(0, 3000))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    top = np.iinfo(raw).max
    old = rng.integers(0, top, n, dtype=raw, endpoint=True)
    # Sprinkle special bit patterns into old.
    if n:
        k = draw(st.integers(0, min(n, 20)))
        pos = rng.integers(0, n, k)
        old[pos] = rng.choice(np.array(SPECIAL[dtype], dtype=raw), k)
    pattern = draw(st.sampled_from(["none", "total", "sparse_small", "sparse_random", "dense_small", "special"]))
    new = old.copy()
    if n:
        if pattern == "total":
            new = rng.integers(0, top, n, dtype=raw, endpoint=True)
        elif pattern in ("sparse_small", "dense_small"):
            frac = 0.01 if pattern == "sparse_small" else 0.6
            m = rng.random(n) < frac
            step = rng.integers(-3, 4, n).astype(np.int64)
            new[m] = ((old[m].astype(np.int64) + step[m]) % (int(top) + 1)).astype(raw)
        elif pattern == "sparse_random":
            m = rng.random(n) < 0.05
            new[m] = rng.integers(0, top, int(m.sum()), dtype=raw, endpoint=True)
        elif pattern == "special":
            m = rng.random(n) < 0.3
            new[m] = rng.choice(np.array(SPECIAL[dtype], dtype=raw), int(m.sum()))
    chunk_elems = draw(st.sampled_from([1, 3, 7, 64, 1000, 1 << 22]))
    return dtype, old, new, chunk_elems


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tensor_pairs())
def test_delta_roundtrip_bit_exact(case):
    dtype, old, new, chunk_elems = case
    chunks = _roundtrip(new, old, dtype, chunk_elems)
    assert sum(c.count for c in chunks) == new.size
    assert [c.start for c in chunks] == list(range(0, max(new.size, 1), chunk_elems))[: len(chunks)]


@settings(max_examples=60, deadline=None)
@given(tensor_pairs())
def test_keyframe_roundtrip_bit_exact(case):
    dtype, _, new, chunk_elems = case
    chunks = _roundtrip(new, None, dtype, chunk_elems)
    assert all(codec.parse_header(c.payload).mode == codec.MODE_KEYFRAME for c in chunks)


@pytest.mark.parametrize("dtype", sorted(codec.DTYPES))
def test_every_bit_pattern_roundtrips(dtype):
    """All 16-bit patterns (sampled for fp32) as old and as new, including
    NaN payloads, infinities and -0.0; also moving each value to its
    neighbour patterns across the +-0 boundary."""
    raw = codec.DTYPES[dtype]
    if dtype == "fp32":
        rng = np.random.default_rng(0)
        allv = np.concatenate([rng.integers(0, 2**32, 60000, dtype=np.uint64).astype(raw), np.array(SPECIAL[dtype], dtype=raw)])
    else:
        allv = np.arange(1 << 16, dtype=np.uint32).astype(raw)
    for shift in (1, 2, 12345):
        _roundtrip(np.roll(allv, shift), allv, dtype, 1 << 14)
    _roundtrip(allv, allv ^ raw(1), dtype, 1 << 14)  # +-1 ulp-ish, crosses 0/-0
    _roundtrip(allv, None, dtype, 1 << 14)


def test_negative_zero_and_nan_are_distinct():
    old = np.array([0x0000, 0x7FC0, 0x8000, 0x3F80], dtype=np.uint16)
    new = np.array([0x8000, 0x7FC1, 0x0000, 0xBF80], dtype=np.uint16)
    _roundtrip(new, old, "bf16", 2)


def test_empty_and_single_element():
    for dtype, raw in codec.DTYPES.items():
        e = np.zeros(0, dtype=raw)
        chunks = _roundtrip(e, e, dtype, 8)
        assert len(chunks) == 1 and chunks[0].count == 0
        _roundtrip(e, None, dtype, 8)
        one = np.array([5], dtype=raw)
        _roundtrip(one, np.array([7], dtype=raw), dtype, 8)
        _roundtrip(one, None, dtype, 8)


def test_chunks_decode_independently_in_any_order():
    versions = synthetic_adam_versions(200_000, 1, seed=3)
    name = max(versions[0], key=lambda k: versions[0][k].size)
    old, new = versions[0][name], versions[1][name]
    chunks = encode_tensor(name, new, old, "bf16", chunk_elems=10_007)
    assert len(chunks) > 5
    order = list(range(len(chunks)))
    random.Random(0).shuffle(order)
    out = np.zeros_like(new)
    for k in order:
        decode_chunk_into(chunks[k].payload, out, old)
    assert np.array_equal(out, new)
    # Re-fetching and re-applying one chunk is idempotent.
    decode_chunk_into(chunks[order[0]].payload, out, old)
    assert np.array_equal(out, new)


def test_in_place_decode():
    versions = synthetic_adam_versions(50_000, 1, seed=4)
    for name in versions[0]:
        old, new = versions[0][name], versions[1][name]
        chunks = encode_tensor(name, new, old, "bf16", chunk_elems=4096)
        buf = old.copy()
        for c in chunks:
            decode_chunk_into(c.payload, buf, buf)
        assert np.array_equal(buf, new)


def test_total_change_falls_back_to_keyframe():
    rng = np.random.default_rng(1)
    old = rng.integers(0, 2**16, 50_000, dtype=np.uint16)
    new = fp32_to_bf16_bits(rng.normal(0, 0.02, 50_000).astype(np.float32))
    chunks = _roundtrip(new, old, "bf16", 1 << 22)
    assert codec.parse_header(chunks[0].payload).mode == codec.MODE_KEYFRAME


def test_keyframe_compresses_bf16_weights():
    w = np.random.default_rng(2).normal(0, 0.02, 200_000).astype(np.float32)
    bits = fp32_to_bf16_bits(w)
    size = sum(len(c.payload) for c in _roundtrip(bits, None, "bf16", 1 << 22))
    assert size < 0.8 * bits.nbytes
    assert size <= len(zstandard.ZstdCompressor(level=3).compress(bits.tobytes()))


def test_no_change_is_tiny():
    x = np.arange(100_000, dtype=np.uint16)
    chunks = _roundtrip(x, x.copy(), "bf16", 1 << 22)
    assert len(chunks[0].payload) < 32


def test_synthetic_adam_delta_beats_xor_zstd():
    versions = synthetic_adam_versions(600_000, 2, seed=5)
    report = run_codec_bench(versions, "bf16")
    assert report["summary"]["bit_exact"]
    for step in report["steps"]:
        assert 0.001 < step["changed_fraction"] < 0.01  # few tensors: sigma draws vary
        assert step["ours_bytes"] < 0.6 * step["xor_zstd_bytes"]
        assert step["ours_bytes"] < 0.004 * step["full_bf16_bytes"]


def test_fp32_to_bf16_rounds_to_nearest_even():
    vals = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, -2.5, 0.0, -0.0, np.inf, -np.inf, np.nan], dtype=np.float32)
    bits = fp32_to_bf16_bits(vals)
    # 1 + 2^-8 is a tie between 1.0 and 1 + 2^-7: rounds to even (1.0).
    assert bits[0] == 0x3F80 and bits[1] == 0x3F80 and bits[2] == 0x3F82
    assert bits[3] == 0xC020 and bits[4] == 0x0000 and bits[5] == 0x8000
    assert bits[6] == 0x7F80 and bits[7] == 0xFF80 and (bits[8] & 0x7FFF) > 0x7F80


# ---------------------------------------------------------------- errors


def _sample_delta_payload() -> tuple[bytes, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    old = rng.integers(0, 2**16, 5000, dtype=np.uint16)
    new = old.copy()
    idx = rng.choice(5000, 100, replace=False)
    new[idx] += np.uint16(1)
    (chunk,) = encode_tensor("t", new, old, "bf16")
    assert codec.parse_header(chunk.payload).mode == codec.MODE_DELTA
    return chunk.payload, old, new


def test_truncated_payloads_raise():
    payload, old, _ = _sample_delta_payload()
    out = np.empty_like(old)
    for cut in range(len(payload)):
        with pytest.raises(CodecError):
            decode_chunk_into(payload[:cut], out, old)


def test_bad_magic_version_mode_dtype_raise():
    payload, old, _ = _sample_delta_payload()
    out = np.empty_like(old)
    with pytest.raises(CodecError, match="magic"):
        decode_chunk_into(b"XX" + payload[2:], out, old)
    with pytest.raises(CodecError, match="version"):
        decode_chunk_into(payload[:2] + b"\x09" + payload[3:], out, old)
    with pytest.raises(CodecError, match="mode"):
        decode_chunk_into(payload[:3] + b"\x07" + payload[4:], out, old)
    with pytest.raises(CodecError, match="dtype code"):
        decode_chunk_into(payload[:4] + b"\x09" + payload[5:], out, old)
    # A fp32 destination for a bf16 payload.
    with pytest.raises(CodecError, match="dtype"):
        decode_chunk_into(payload, np.empty(old.size, dtype=np.uint32), old.astype(np.uint32))
    # fp16 header on a bf16 body still needs matching arrays: wrong length.
    with pytest.raises(CodecError, match="elements"):
        decode_chunk_into(payload, np.empty(old.size + 1, dtype=np.uint16), old)


def test_delta_without_base_raises():
    payload, old, _ = _sample_delta_payload()
    with pytest.raises(CodecError, match="previous version"):
        decode_chunk_into(payload, np.empty_like(old), None)
    with pytest.raises(CodecError, match="old has"):
        decode_chunk_into(payload, np.empty_like(old), old[:-1])


def test_corrupted_bytes_raise():
    payload, old, _ = _sample_delta_payload()
    out = np.empty_like(old)
    rng = np.random.default_rng(0)
    for _ in range(200):
        bad = bytearray(payload)
        pos = int(rng.integers(8, len(bad)))
        bad[pos] ^= 1 << int(rng.integers(0, 8))
        with pytest.raises(CodecError):
            decode_chunk_into(bytes(bad), out, old)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_garbage_never_crashes(blob):
    out = np.zeros(1000, dtype=np.uint16)
    try:
        decode_chunk_into(blob, out, out.copy())
    except CodecError:
        pass


def test_encode_input_validation():
    x = np.zeros(10, dtype=np.uint16)
    with pytest.raises(CodecError):
        encode_tensor("t", x, None, "int8")
    with pytest.raises(CodecError):
        encode_tensor("t", x.astype(np.float32), None, "fp32")
    with pytest.raises(CodecError):
        encode_tensor("t", x, x[:5], "bf16")
    with pytest.raises(CodecError):
        encode_tensor("t", x, None, "bf16", chunk_elems=0)
