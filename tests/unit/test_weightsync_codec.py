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
        0x00000000,
        0x80000000,
        0x7F800000,
        0xFF800000,
        0x7FC00000,
        0xFFC00001,
        0x7F800001,
        0x00000001,
        0x80000001,
        0x7F7FFFFF,
        0xFF7FFFFF,
        0x3F800000,
    ],
}


def _roundtrip(new: np.ndarray, old: np.ndarray | None, dtype: str, chunk_elems: int, fmt: int = 1) -> list:
    chunks = encode_tensor("t", new, old, dtype, chunk_elems=chunk_elems, format_version=fmt)
    out = np.empty_like(new)
    for c in chunks:
        decode_chunk_into(c.payload, out, old)
        assert codec.parse_header(c.payload).version == fmt
    assert np.array_equal(out, new), "round trip is not bit exact"
    if fmt == 1 and old is not None:
        _roundtrip(new, old, dtype, chunk_elems, 2)  # and without context in format 2
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
    for i, step in enumerate(report["steps"]):
        assert 0.001 < step["changed_fraction"] < 0.01  # few tensors: sigma draws vary
        assert step["v1"]["bytes"] < 0.6 * step["xor_zstd_bytes"]
        assert step["v1"]["bytes"] < 0.004 * step["full_bf16_bytes"]
        assert step["v2"]["bytes"] < step["xor_zstd_bytes"]
        # Format 2 runs against the previous step's changes from the second step on.
        assert (step["v2"]["context_chunks"] > 0) == (i > 0)


def test_fp32_to_bf16_rounds_to_nearest_even():
    vals = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, -2.5, 0.0, -0.0, np.inf, -np.inf, np.nan], dtype=np.float32)
    bits = fp32_to_bf16_bits(vals)
    # 1 + 2^-8 is a tie between 1.0 and 1 + 2^-7: rounds to even (1.0).
    assert bits[0] == 0x3F80 and bits[1] == 0x3F80 and bits[2] == 0x3F82
    assert bits[3] == 0xC020 and bits[4] == 0x0000 and bits[5] == 0x8000
    assert bits[6] == 0x7F80 and bits[7] == 0xFF80 and (bits[8] & 0x7FFF) > 0x7F80


# ---------------------------------------------------------------- errors


def _sample_delta_payload(fmt: int = 1) -> tuple[bytes, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    old = rng.integers(0, 2**16, 5000, dtype=np.uint16)
    new = old.copy()
    idx = rng.choice(5000, 100, replace=False)
    new[idx] += np.uint16(1)
    (chunk,) = encode_tensor("t", new, old, "bf16", format_version=fmt)
    assert codec.parse_header(chunk.payload).mode == codec.MODE_DELTA
    return chunk.payload, old, new


def _index_of(payload: bytes, old: np.ndarray) -> codec.ChunkIndex | None:
    """The position index a format-3 payload is coded over (None for other formats), so
    that a damaged payload fails on its damage, not on a missing index."""
    return codec.ensure_index(payload, old, None)


@pytest.mark.parametrize("fmt", codec.FORMAT_VERSIONS)
def test_truncated_payloads_raise(fmt):
    payload, old, _ = _sample_delta_payload(fmt)
    out = np.empty_like(old)
    index = _index_of(payload, old)
    decode_chunk_into(payload, out, old, index=index)  # whole, it decodes
    for cut in range(len(payload)):
        with pytest.raises(CodecError):
            decode_chunk_into(payload[:cut], out, old, index=index)


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
    # A start field of ten continuation bytes would pass 64 bits; one that ends
    # the payload is truncated.
    with pytest.raises(CodecError, match="varint too long while reading start"):
        decode_chunk_into(payload[:5] + b"\x80" * 10 + payload[5:], out, old)
    with pytest.raises(CodecError, match="truncated payload while reading start"):
        decode_chunk_into(payload[:5] + b"\x80" * 3, out, old)


@pytest.mark.parametrize("fmt", codec.FORMAT_VERSIONS)
def test_delta_without_base_raises(fmt):
    payload, old, _ = _sample_delta_payload(fmt)
    with pytest.raises(CodecError, match="previous version"):
        decode_chunk_into(payload, np.empty_like(old), None)
    with pytest.raises(CodecError, match="old has"):
        decode_chunk_into(payload, np.empty_like(old), old[:-1])


@pytest.mark.parametrize("fmt", codec.FORMAT_VERSIONS)
def test_corrupted_bytes_raise(fmt):
    payload, old, _ = _sample_delta_payload(fmt)
    out = np.empty_like(old)
    index = _index_of(payload, old)
    rng = np.random.default_rng(0)
    for _ in range(200):
        bad = bytearray(payload)
        pos = int(rng.integers(8, len(bad)))
        bad[pos] ^= 1 << int(rng.integers(0, 8))
        with pytest.raises(CodecError):
            decode_chunk_into(bytes(bad), out, old, index=index)


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


# ---------------------------------------------------------------- format 2: chains with context

# A format-1 payload as the format-1 encoder wrote it (bf16, 64 elements, five
# changes): old payloads must stay decodable.
_V1_PAYLOAD = bytes.fromhex("4d57010100004040e322eae004051500ff01720001018000ff01b8000001bc00ff01ffd3ff7e0e")


def test_format_1_payload_still_decodes():
    old = (np.arange(64, dtype=np.uint16) * 517 + 0x3A00).astype(np.uint16)
    new = old.copy()
    new[[3, 17, 18, 40, 63]] += np.array([1, 2, 0xFFFF, 1, 5], dtype=np.uint16)
    assert codec.parse_header(_V1_PAYLOAD).version == 1
    out = np.zeros_like(old)
    changes = decode_chunk_into(_V1_PAYLOAD, out, old)
    assert np.array_equal(out, new)
    assert changes.positions.tolist() == [3, 17, 18, 40, 63]
    # A context is ignored by payloads that need none; the v1 encoder still writes it.
    buf = old.copy()
    decode_chunk_into(_V1_PAYLOAD, buf, buf, context=changes)
    assert np.array_equal(buf, new)
    (again,) = encode_tensor("t", new, old, "bf16", format_version=1)
    assert again.payload == _V1_PAYLOAD


PATTERNS = ["none", "sparse", "dense", "all", "repeat", "flip", "special", "random"]


@st.composite
def version_chains(draw):
    """(dtype, versions, chunk_elems): 4-6 versions, each step one change pattern;
    "repeat" moves the previous step's positions again in the same direction,
    "flip" moves them back (sign flips)."""
    dtype = draw(st.sampled_from(sorted(codec.DTYPES)))
    raw = codec.DTYPES[dtype]
    top = int(np.iinfo(raw).max)
    n = draw(st.integers(0, 2500))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    cur = rng.integers(0, top, n, dtype=raw, endpoint=True)
    if n:
        k = draw(st.integers(0, min(n, 30)))
        cur[rng.integers(0, n, k)] = rng.choice(np.array(SPECIAL[dtype], dtype=raw), k)
    versions = [cur]
    last_idx, last_step = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    for pattern in draw(st.lists(st.sampled_from(PATTERNS), min_size=3, max_size=5)):
        nxt = versions[-1].copy()
        if pattern in ("sparse", "dense", "all"):
            frac = {"sparse": 0.01, "dense": 0.6, "all": 1.0}[pattern]
            idx = np.nonzero(rng.random(n) < frac)[0]
            step = rng.choice(np.array([-40, -3, -2, -1, 1, 1, 1, 2, 3, 700]), idx.size)
        elif pattern in ("repeat", "flip"):
            idx = last_idx
            step = last_step if pattern == "repeat" else -last_step
        elif pattern == "special":
            idx = np.nonzero(rng.random(n) < 0.2)[0]
            step = None
            nxt[idx] = rng.choice(np.array(SPECIAL[dtype], dtype=raw), idx.size)
        elif pattern == "random":
            idx = np.nonzero(rng.random(n) < 0.05)[0]
            step = None
            nxt[idx] = rng.integers(0, top, idx.size, dtype=raw, endpoint=True)
        else:
            idx, step = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        if step is not None:
            nxt[idx] = ((nxt[idx].astype(np.int64) + step) % (top + 1)).astype(raw)
        else:
            step = np.ones(idx.size, dtype=np.int64)
        versions.append(nxt)
        last_idx, last_step = idx, step
    chunk_elems = draw(st.sampled_from([1, 5, 64, 700, 1 << 22]))
    return dtype, versions, chunk_elems


def _check_changes(changes, old: np.ndarray, new: np.ndarray) -> None:
    want = np.nonzero(old != new)[0]
    assert changes.positions.dtype == np.int64
    assert np.array_equal(np.sort(changes.positions), changes.positions)
    assert np.array_equal(changes.old, old[changes.positions])
    assert np.array_equal(changes.new, new[changes.positions])
    assert set(changes.positions.tolist()) <= set(want.tolist())


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(version_chains())
def test_format_2_chain_roundtrips_with_context(case):
    """Every step encoded against the previous step's changes, decoded in place
    and into fresh buffers, bit exact; the decoder's change lists equal the
    encoder's, so they can be the next step's context on both sides."""
    dtype, versions, chunk_elems = case
    enc_ctx = dec_ctx = None
    held = versions[0].copy()
    for old, new in zip(versions, versions[1:]):
        chunks = encode_tensor("t", new, old, dtype, chunk_elems=chunk_elems, context=enc_ctx, format_version=2)
        fresh = np.empty_like(new)
        got = []
        for j, c in enumerate(chunks):
            assert codec.parse_header(c.payload).version == 2
            ctx = dec_ctx[j] if dec_ctx else None
            changes = decode_chunk_into(c.payload, held, held, context=ctx)
            again = decode_chunk_into(c.payload, fresh, old, context=ctx)
            if changes is None:
                assert again is None and c.changes is None
            else:
                _check_changes(changes, old, new)
                for a, b in ((changes, again), (changes, c.changes)):
                    assert np.array_equal(a.positions, b.positions)
                    assert np.array_equal(a.old, b.old) and np.array_equal(a.new, b.new)
            got.append(changes)
        assert np.array_equal(held, new), "in-place chain is not bit exact"
        assert np.array_equal(fresh, new), "fresh decode is not bit exact"
        enc_ctx, dec_ctx = [c.changes for c in chunks], got


def _chain(n: int = 20_000, seed: int = 0) -> list[np.ndarray]:
    """Three bf16 versions with Adam-like persistence: most changed elements
    change again in the same direction, a few new ones join."""
    rng = np.random.default_rng(seed)
    v0 = fp32_to_bf16_bits(rng.normal(0, 0.02, n).astype(np.float32))
    hot = rng.choice(n, n // 50, replace=False)
    out = [v0]
    for _ in range(2):
        nxt = out[-1].copy()
        idx = np.union1d(hot[rng.random(hot.size) < 0.9], rng.choice(n, n // 500, replace=False))
        nxt[idx] += np.uint16(1)
        out.append(nxt)
    return out


def test_context_makes_persistent_changes_smaller():
    v0, v1, v2 = _chain()
    (c1,) = encode_tensor("t", v1, v0, "bf16", format_version=2)
    (with_ctx,) = encode_tensor("t", v2, v1, "bf16", context=[c1.changes], format_version=2)
    (without,) = encode_tensor("t", v2, v1, "bf16", format_version=2)
    assert len(with_ctx.payload) < 0.75 * len(without.payload)


def test_delta_decode_touches_only_changed_elements():
    """Structural O(changes): in place, every unchanged element holds garbage that
    neither affects the result nor gets overwritten, and nothing is read or
    written outside the changed positions (format 1 reads every old exponent)."""
    v0, v1, v2 = _chain(seed=1)
    (c1,) = encode_tensor("t", v1, v0, "bf16", format_version=2)
    (c2,) = encode_tensor("t", v2, v1, "bf16", context=[c1.changes], format_version=2)
    for payload, old, new, ctx in ((c1.payload, v0, v1, None), (c2.payload, v1, v2, c1.changes)):
        changed = old != new
        garbage = np.random.default_rng(2).integers(0, 2**16, old.size, dtype=np.uint16)
        buf = np.where(changed, old, garbage).astype(np.uint16)
        changes = decode_chunk_into(payload, buf, buf, context=ctx)
        assert np.array_equal(buf[changed], new[changed])
        assert np.array_equal(buf[~changed], garbage[~changed])
        assert np.array_equal(changes.positions, np.nonzero(changed)[0])
    # The same sabotage breaks format 1, which uses every old exponent as context.
    (v1_payload,) = encode_tensor("t", v1, v0, "bf16", format_version=1)
    buf = np.where(v0 != v1, v0, np.uint16(0x7F00)).astype(np.uint16)
    try:
        decode_chunk_into(v1_payload.payload, buf, buf)
        assert not np.array_equal(buf[v0 != v1], v1[v0 != v1])
    except CodecError:
        pass


def test_wrong_or_missing_context_raises():
    v0, v1, v2 = _chain(seed=3)
    chunks1 = encode_tensor("t", v1, v0, "bf16", chunk_elems=5000, format_version=2)
    chunks2 = encode_tensor("t", v2, v1, "bf16", chunk_elems=5000, context=[c.changes for c in chunks1], format_version=2)
    payload, ctx = chunks2[1].payload, chunks1[1].changes
    assert payload[codec.parse_header(payload).body_offset] & 1  # coded against the context
    buf = v1.copy()
    with pytest.raises(CodecError, match="none was given"):
        decode_chunk_into(payload, buf, buf)
    # Another chunk's list, one change fewer, one sign different: all refused.
    with pytest.raises(CodecError, match="not ascending inside this chunk"):
        decode_chunk_into(payload, buf, buf, context=chunks1[0].changes)
    short = codec.ChunkChanges(ctx.positions[:-1], ctx.old[:-1], ctx.new[:-1])
    with pytest.raises(CodecError, match="different context"):
        decode_chunk_into(payload, buf, buf, context=short)
    flipped = codec.ChunkChanges(ctx.positions, ctx.new, ctx.old)
    with pytest.raises(CodecError, match="different context"):
        decode_chunk_into(payload, buf, buf, context=flipped)
    assert np.array_equal(buf, v1), "a refused chunk must not write anything"
    with pytest.raises(CodecError, match="format version 1 has no context"):
        encode_tensor("t", v2, v1, "bf16", chunk_elems=5000, context=[c.changes for c in chunks1], format_version=1)
    with pytest.raises(CodecError, match="context has"):
        encode_tensor("t", v2, v1, "bf16", chunk_elems=5000, context=[None], format_version=2)
    with pytest.raises(CodecError, match="format_version"):
        encode_tensor("t", v2, v1, "bf16", format_version=4)


def test_format_2_corrupt_payloads_raise():
    v0, v1, v2 = _chain(seed=4)
    (c1,) = encode_tensor("t", v1, v0, "bf16", format_version=2)
    (c2,) = encode_tensor("t", v2, v1, "bf16", context=[c1.changes], format_version=2)
    payload = c2.payload
    rng = np.random.default_rng(0)
    for _ in range(100):  # any flipped bit: the body checksum or the header catches it
        bad = bytearray(payload)
        bad[int(rng.integers(2, len(bad)))] ^= 1 << int(rng.integers(0, 8))
        with pytest.raises(CodecError):
            decode_chunk_into(bytes(bad), v1.copy(), v1, context=c1.changes)
    for cut in range(0, len(payload), max(1, len(payload) // 60)):
        with pytest.raises(CodecError):
            decode_chunk_into(payload[:cut], v1.copy(), v1, context=c1.changes)


@settings(max_examples=150, deadline=None)
@given(st.binary(min_size=1, max_size=120), st.integers(0, 2), st.booleans())
def test_format_2_garbage_body_with_valid_checksum_never_crashes(blob, dtype_code, with_context):
    """A body that passes the checksum but is garbage (a buggy or hostile peer):
    CodecError or some decode, never a crash, and writes only where it says."""
    import struct
    import zlib

    dtype = ["bf16", "fp16", "fp32"][dtype_code]
    raw = codec.DTYPES[dtype]
    n = 300
    old = np.random.default_rng(len(blob)).integers(0, 2**16, n).astype(raw)
    body = blob
    ctx = None
    if with_context:
        ctx = codec.ChunkChanges(np.arange(0, n, 7, dtype=np.int64), old[::7] ^ raw(1), old[::7])
        from services.weightsync.codec.context_kernels import _fingerprint

        fp = int(_fingerprint(ctx.positions, ctx.old, ctx.new))
        body = bytes((1,)) + codec.format._uv_encode(ctx.positions.size) + struct.pack("<I", fp) + blob
    header = b"MW" + bytes((2, codec.MODE_DELTA, dtype_code, 0)) + codec.format._uv_encode(n) * 2
    payload = header + struct.pack("<I", zlib.crc32(body)) + body
    buf = old.copy()
    try:
        changes = decode_chunk_into(payload, buf, buf, context=ctx)
    except CodecError:
        assert np.array_equal(buf, old)
        return
    untouched = np.ones(n, dtype=bool)
    untouched[changes.positions] = False
    assert np.array_equal(buf[untouched], old[untouched])


def test_decode_tensor_and_encode_chunk_take_contexts():
    v0, v1, v2 = _chain(seed=5)
    first = encode_tensor("t", v1, v0, "bf16", chunk_elems=3000, format_version=2)
    ctx = [c.changes for c in first]
    second = encode_tensor("t", v2, v1, "bf16", chunk_elems=3000, context=ctx, format_version=2)
    assert np.array_equal(codec.decode_tensor(second, v1, "bf16", context=ctx), v2)
    with pytest.raises(CodecError, match="context has"):
        codec.decode_tensor(second, v1, "bf16", context=ctx[:-1])
    one = codec.encode_chunk(v2, v1, "bf16", 3000, 3000, context=ctx[1], format_version=2, name="t")
    assert one.payload == second[1].payload and one.tensor == "t"
    assert np.array_equal(one.changes.positions, second[1].changes.positions)
    assert codec.encode_delta_chunk(v2, v1, "bf16", 3000, 3000, context=ctx[1], format_version=2) == one.payload
