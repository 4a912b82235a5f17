"""Tests for codec format version 3: delta positions coded over a receiver-kept
position index (services/weightsync/codec/index_kernels.py)."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.codec import fp32_to_bf16_bits, run_codec_bench, synthetic_adam_versions
from services.weightsync import codec
from services.weightsync.codec import ChunkChanges, CodecError, build_index, decode_chunk_into, encode_tensor, ensure_index, update_index
from tests.unit.test_weightsync_codec import SPECIAL

PATTERNS = ["none", "sparse", "dense", "all", "repeat", "flip", "special", "random", "small", "cross"]


def _small_values(rng: np.random.Generator, dtype: str, n: int) -> np.ndarray:
    """Raw bits of values whose exponents spread over many classes, many small
    (weights near zero), so that indexes hold several classes."""
    x = (rng.standard_normal(n) * np.exp2(rng.integers(-30, 2, n))).astype(np.float32)
    if dtype == "bf16":
        return fp32_to_bf16_bits(x)
    if dtype == "fp16":
        return x.astype(np.float16).view(np.uint16)
    return x.view(np.uint32)


@st.composite
def version_chains(draw):
    """(dtype, versions, chunk_elems, fraction): 4-6 versions, each step one
    change pattern. "repeat"/"flip" move the previous step's positions again /
    back, "small" moves the smallest elements by a few steps, "cross" moves
    elements across exponent boundaries (index entries enter and leave)."""
    dtype = draw(st.sampled_from(sorted(codec.DTYPES)))
    raw = codec.DTYPES[dtype]
    top = int(np.iinfo(raw).max)
    n = draw(st.integers(0, 2500))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if draw(st.booleans()):
        cur = _small_values(rng, dtype, n)
    else:
        cur = rng.integers(0, top, n, dtype=raw, endpoint=True)
    if n:
        k = draw(st.integers(0, min(n, 30)))
        cur[rng.integers(0, n, k)] = rng.choice(np.array(SPECIAL[dtype], dtype=raw), k)
    shift, emask = codec.format._EXP_FIELD[dtype]
    versions = [cur]
    last_idx, last_step = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    for pattern in draw(st.lists(st.sampled_from(PATTERNS), min_size=3, max_size=5)):
        nxt = versions[-1].copy()
        step = None
        if pattern in ("sparse", "dense", "all"):
            frac = {"sparse": 0.01, "dense": 0.6, "all": 1.0}[pattern]
            idx = np.nonzero(rng.random(n) < frac)[0]
            step = rng.choice(np.array([-40, -3, -2, -1, 1, 1, 1, 2, 3, 700]), idx.size)
        elif pattern in ("repeat", "flip"):
            idx = last_idx
            step = last_step if pattern == "repeat" else -last_step
        elif pattern == "small":
            cls = (nxt.astype(np.int64) >> shift) & emask
            idx = np.nonzero(cls <= np.quantile(cls, 0.3) if n else np.zeros(0, bool))[0]
            idx = idx[rng.random(idx.size) < 0.8]
            step = rng.choice(np.array([1, 2, 3, 5, -1, -2]), idx.size)
        elif pattern == "cross":
            idx = np.nonzero(rng.random(n) < 0.1)[0]
            nxt[idx] = nxt[idx] ^ raw(1 << shift)  # lowest exponent bit: the class moves by one
            step = None
        elif pattern == "special":
            idx = np.nonzero(rng.random(n) < 0.2)[0]
            nxt[idx] = rng.choice(np.array(SPECIAL[dtype], dtype=raw), idx.size)
        elif pattern == "random":
            idx = np.nonzero(rng.random(n) < 0.05)[0]
            nxt[idx] = rng.integers(0, top, idx.size, dtype=raw, endpoint=True)
        else:
            idx = np.zeros(0, dtype=np.int64)
            step = np.zeros(0, dtype=np.int64)
        if step is not None:
            nxt[idx] = ((nxt[idx].astype(np.int64) + step) % (top + 1)).astype(raw)
        else:
            step = np.ones(idx.size, dtype=np.int64)
        versions.append(nxt)
        last_idx, last_step = idx, step
    chunk_elems = draw(st.sampled_from([1, 5, 64, 700, 1 << 22]))
    fraction = draw(st.sampled_from([0.0, 0.02, 0.3, 1.0]))
    return dtype, versions, chunk_elems, fraction


def _same_index(a: codec.ChunkIndex, b: codec.ChunkIndex) -> None:
    assert (a.dtype, a.start, a.count, a.threshold, a.fingerprint, a.entry_hash) == (b.dtype, b.start, b.count, b.threshold, b.fingerprint, b.entry_hash)
    assert np.array_equal(a.positions, b.positions) and np.array_equal(a.classes, b.classes)
    assert np.array_equal(a.class_counts, b.class_counts)


def _starts(n: int, chunk_elems: int) -> list[tuple[int, int]]:
    return [(s, min(chunk_elems, n - s)) for s in range(0, max(n, 1), chunk_elems)]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(version_chains())
def test_format_3_chain_roundtrips_with_index_and_context(case):
    """Every step encoded over the previous step's index and changes, decoded in
    place and into fresh buffers, bit exact. The index both sides carry along
    (updated from each change list, never rebuilt) equals the index built from
    scratch from the new values: it is a pure function of the weights."""
    dtype, versions, chunk_elems, fraction = case
    ranges = _starts(versions[0].size, chunk_elems)
    enc_idx = [build_index(versions[0], dtype, s, c, fraction=fraction) for s, c in ranges]
    enc_ctx = dec_ctx = None
    dec_idx: list = [None] * len(ranges)  # the receiver builds at first use
    held = versions[0].copy()
    for old, new in zip(versions, versions[1:]):
        chunks = encode_tensor("t", new, old, dtype, chunk_elems=chunk_elems, context=enc_ctx, index=enc_idx, format_version=3)
        fresh = np.empty_like(new)
        got_ctx, got_idx = [], []
        for j, c in enumerate(chunks):
            hdr = codec.parse_header(c.payload)
            assert hdr.version == 3
            idx = ensure_index(c.payload, held, dec_idx[j])
            ctx = dec_ctx[j] if dec_ctx else None
            again = decode_chunk_into(c.payload, fresh, old, context=ctx, index=idx)
            changes = decode_chunk_into(c.payload, held, held, context=ctx, index=idx)
            if changes is None:
                assert again is None and c.changes is None and hdr.mode == codec.MODE_KEYFRAME
                got_idx.append(None)  # rebuilt at first use
            else:
                want = np.nonzero(old[c.start : c.start + c.count] != new[c.start : c.start + c.count])[0] + c.start
                for a in (changes, again, c.changes):
                    assert np.array_equal(a.positions, want)
                    assert np.array_equal(a.old, old[want]) and np.array_equal(a.new, new[want])
                if idx is not None:
                    _same_index(changes.index, c.index)
                    _same_index(again.index, c.index)
                got_idx.append(changes.index)
            _same_index(c.index, build_index(new, dtype, c.start, c.count, enc_idx[j].threshold))
            got_ctx.append(changes)
        assert np.array_equal(held, new), "in-place chain is not bit exact"
        assert np.array_equal(fresh, new), "fresh decode is not bit exact"
        enc_ctx, enc_idx = [c.changes for c in chunks], [c.index for c in chunks]
        dec_ctx, dec_idx = got_ctx, got_idx


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(version_chains())
def test_update_index_equals_rebuilt_index(case):
    """update_index from any change list (crossings included) gives the index
    built from scratch from the new values; a stale index is refused."""
    dtype, versions, _, fraction = case
    n = versions[0].size
    idx = build_index(versions[0], dtype, 0, n, fraction=fraction)
    for old, new in zip(versions, versions[1:]):
        pos = np.nonzero(old != new)[0]
        nxt = update_index(idx, ChunkChanges(pos, old[pos], new[pos]))
        _same_index(nxt, build_index(new, dtype, 0, n, idx.threshold))
        back = update_index(nxt, ChunkChanges(pos, new[pos], old[pos]))
        _same_index(back, idx)
        idx = nxt


@pytest.mark.parametrize("dtype", sorted(codec.DTYPES))
def test_format_3_every_bit_pattern_roundtrips(dtype):
    """All 16-bit patterns (sampled for fp32) as old and as new with an index
    holding most classes: NaN payloads, infinities, -0.0, denormals."""
    raw = codec.DTYPES[dtype]
    if dtype == "fp32":
        rng = np.random.default_rng(0)
        allv = np.concatenate([rng.integers(0, 2**32, 60000, dtype=np.uint64).astype(raw), np.array(SPECIAL[dtype], dtype=raw)])
    else:
        allv = np.arange(1 << 16, dtype=np.uint32).astype(raw)
    for new, old in ((np.roll(allv, 1), allv), (np.roll(allv, 12345), allv), (allv, allv ^ raw(1))):
        for fraction in (0.02, 0.6):
            idx = [build_index(old, dtype, s, c, fraction=fraction) for s, c in _starts(old.size, 1 << 14)]
            chunks = encode_tensor("t", new, old, dtype, chunk_elems=1 << 14, index=idx, format_version=3)
            buf = old.copy()
            for j, c in enumerate(chunks):
                changes = decode_chunk_into(c.payload, buf, buf, index=idx[j])
                if changes is not None:
                    _same_index(changes.index, build_index(new, dtype, c.start, c.count, idx[j].threshold))
            assert np.array_equal(buf, new)


def _chain(n: int = 40_000, seed: int = 0, steps: int = 3) -> list[np.ndarray]:
    """bf16 versions shaped like early RL steps (Adam, lr 1e-6, masters that
    start on the bf16 grid): tiny weights move every step by a few grid steps,
    larger ones only once they drifted half a grid step, some cross exponents."""
    rng = np.random.default_rng(seed)
    w = (fp32_to_bf16_bits((rng.standard_normal(n) * 0.02).astype(np.float32)).astype(np.uint32) << 16).view(np.float32)
    out = [fp32_to_bf16_bits(w)]
    drift = rng.standard_normal(n).astype(np.float32) * 3e-7
    for _ in range(steps):
        w = w - drift * (1 + 0.1 * rng.standard_normal(n).astype(np.float32))
        out.append(fp32_to_bf16_bits(w))
    return out


def _encode_chain(vs: list[np.ndarray], chunk_elems: int = 1 << 22) -> list[list[codec.EncodedChunk]]:
    out = []
    ctx = idx = None
    for old, new in zip(vs, vs[1:]):
        chunks = encode_tensor("t", new, old, "bf16", chunk_elems=chunk_elems, context=ctx, index=idx, format_version=3)
        ctx, idx = [c.changes for c in chunks], [c.index for c in chunks]
        out.append(chunks)
    return out


def test_format_3_uses_the_index():
    vs = _chain(n=200_000)
    steps = _encode_chain(vs)
    for old, new, chunks in zip(vs, vs[1:], steps):
        (c,) = chunks
        assert codec.index_threshold(old, "bf16") == c.index.threshold
        flags = c.payload[codec.parse_header(c.payload).body_offset]
        assert flags & 2, "coded over the index"
        (v1,) = encode_tensor("t", new, old, "bf16", format_version=1)
        assert len(c.payload) < 1.1 * len(v1.payload)
    # Where nearly every small weight moves (early RL steps: the index classes
    # change at rates near 1), positions cost far less than format 1's >= 1 bit
    # (both pay a sign bit per change here: no context).
    old = vs[0]
    new = old.copy()
    small = np.nonzero(((old.astype(np.int64) >> 7) & 0xFF) < steps[0][0].index.threshold)[0]
    moved = small[np.random.default_rng(0).random(small.size) < 0.995]
    new[moved] += np.uint16(1)
    (c,) = encode_tensor("t", new, old, "bf16", format_version=3)
    (v1,) = encode_tensor("t", new, old, "bf16", format_version=1)
    assert len(c.payload) < 0.6 * len(v1.payload)


@pytest.mark.parametrize("seed", range(4))
def test_format_3_long_magnitude_codes_roundtrip(seed):
    """fp32 steps of 2**26-2**31 grid steps among short ones make magnitude codes
    of around 30 bits, which the property tests' steps (at most 700) never make. (A
    decoder that read the codes through a 64-bit window refilled at 32 bits left,
    without checking that a code fits in what is left, passed those tests, not this.)"""
    rng = np.random.default_rng(seed)
    n = 60_000
    old = rng.integers(1 << 20, 1 << 30, n, dtype=np.uint32)  # positive floats: bits order like keys
    new = old.copy()
    idx = np.nonzero(rng.random(n) < 0.2)[0]
    big = rng.random(idx.size) < 0.5
    step = np.where(big, rng.integers(1 << 26, 1 << 31, idx.size), rng.integers(1, 40, idx.size))
    step = np.where(rng.random(idx.size) < 0.5, step, -np.minimum(step, old[idx].astype(np.int64)))
    new[idx] = (old[idx].astype(np.int64) + step).astype(np.uint32)
    index = [build_index(old, "fp32", s, c) for s, c in _starts(n, 20_000)]
    chunks = encode_tensor("t", new, old, "fp32", chunk_elems=20_000, index=index, format_version=3)
    held = old.copy()
    for c, i in zip(chunks, index):
        hdr = codec.parse_header(c.payload)
        assert (hdr.version, hdr.mode) == (3, codec.MODE_DELTA)
        decode_chunk_into(c.payload, held, held, index=ensure_index(c.payload, held, i))
    assert np.array_equal(held, new)


def test_decode_touches_only_changed_elements():
    """Structural O(index + changes): in place, every element that does not
    change holds garbage (index entries included: the index is kept apart, the
    tensor is only read and written at the changes), which neither affects the
    result nor gets overwritten."""
    vs = _chain(seed=1, steps=2)
    first, second = _encode_chain(vs)
    garbage = np.random.default_rng(2).integers(0, 2**16, vs[0].size, dtype=np.uint16)
    idx0 = build_index(vs[0], "bf16", 0, vs[0].size, first[0].index.threshold)
    for (c,), old, new, idx, ctx in ((first, vs[0], vs[1], idx0, None), (second, vs[1], vs[2], first[0].index, first[0].changes)):
        assert c.payload[codec.parse_header(c.payload).body_offset] & 2
        changed = old != new
        buf = np.where(changed, old, garbage).astype(np.uint16)
        changes = decode_chunk_into(c.payload, buf, buf, context=ctx, index=idx)
        assert np.array_equal(buf[changed], new[changed])
        assert np.array_equal(buf[~changed], garbage[~changed])
        assert np.array_equal(changes.positions, np.nonzero(changed)[0])
        _same_index(changes.index, c.index)


def test_wrong_or_missing_index_raises_before_writing():
    vs = _chain(seed=3, steps=4)
    steps = _encode_chain(vs, chunk_elems=10_000)
    payload, ctx, idx = steps[2][1].payload, steps[1][1].changes, steps[1][1].index
    assert payload[codec.parse_header(payload).body_offset] & 2
    buf = vs[2].copy()

    def refused(match: str, index, context=ctx) -> None:
        with pytest.raises(CodecError, match=match):
            decode_chunk_into(payload, buf, buf, context=context, index=index)
        assert np.array_equal(buf, vs[2]), "a refused chunk must not write anything"

    refused("none was given", None)
    refused("different position index", steps[0][1].index)  # stale: two versions old
    refused("different position index", build_index(vs[2], "bf16", 10_000, 10_000, idx.threshold - 1))
    refused("not bf16 chunk", steps[1][0].index)  # another chunk's
    tampered = idx._replace(fingerprint=idx.fingerprint ^ 1)
    refused("different position index", tampered)
    # An index whose entries disagree with the weights (same fingerprint: its
    # arrays were edited): the class check at the changed positions refuses it.
    cls = idx.classes.copy()
    cls[:] = (cls.astype(np.int64) + 1) % idx.threshold
    refused("index", idx._replace(classes=cls))
    refused("different context", idx, codec.ChunkChanges(ctx.positions[:-1], ctx.old[:-1], ctx.new[:-1]))
    refused("different context", idx, codec.ChunkChanges(ctx.positions, ctx.new, ctx.old))  # same count, signs reversed
    # ensure_index rebuilds from the weights when the index does not fit.
    for wrong in (None, steps[0][1].index, tampered):
        got = ensure_index(payload, buf, wrong)
        _same_index(got, idx)
    assert ensure_index(payload, buf, idx) is idx
    decode_chunk_into(payload, buf, buf, context=ctx, index=idx)
    assert np.array_equal(buf[10_000:20_000], vs[3][10_000:20_000])
    with pytest.raises(CodecError, match="no position index"):
        encode_tensor("t", vs[1], vs[0], "bf16", index=[idx], format_version=2)
    with pytest.raises(CodecError, match="index has"):
        encode_tensor("t", vs[1], vs[0], "bf16", chunk_elems=10_000, index=[idx], format_version=3)
    with pytest.raises(CodecError, match="stale index"):  # the encoder checks too
        encode_tensor("t", vs[3], vs[2], "bf16", chunk_elems=10_000, index=[s.index for s in steps[0]], format_version=3)


def test_format_3_corrupt_and_truncated_payloads_raise():
    vs = _chain(seed=4, steps=2)
    first, second = _encode_chain(vs)
    (c,), ctx, idx = second, first[0].changes, first[0].index
    payload = c.payload
    rng = np.random.default_rng(0)
    for _ in range(150):  # any flipped bit: the body checksum or the header catches it
        bad = bytearray(payload)
        bad[int(rng.integers(2, len(bad)))] ^= 1 << int(rng.integers(0, 8))
        buf = vs[1].copy()
        with pytest.raises(CodecError):
            decode_chunk_into(bytes(bad), buf, buf, context=ctx, index=idx)
        assert np.array_equal(buf, vs[1])
    for cut in range(0, len(payload), max(1, len(payload) // 80)):
        with pytest.raises(CodecError):
            decode_chunk_into(payload[:cut], vs[1].copy(), vs[1], context=ctx, index=idx)
    # Bodies that pass the checksum but fail late, after every value was
    # written (trailing bytes): what was written is put back.
    hdr = codec.parse_header(payload)
    body = payload[hdr.body_offset :]
    head = payload[: hdr.body_offset - 4]
    for bad_body in (body + b"\x00", body + b"\x01\x00"):
        bad = head + struct.pack("<I", zlib.crc32(bad_body)) + bad_body
        buf = vs[1].copy()
        with pytest.raises(CodecError):
            decode_chunk_into(bad, buf, buf, context=ctx, index=idx)
        assert np.array_equal(buf, vs[1]), "a refused chunk must leave the buffer as it was"


def test_checksum_false_skips_only_the_crc():
    """checksum=False (a payload already checked against the manifest's sha256) decodes
    a chunk whose CRC field is wrong; the default refuses it. A body that does not
    parse is refused either way."""
    vs = _chain(seed=5, steps=2)
    first, second = _encode_chain(vs)
    (c,), ctx, idx = second, first[0].changes, first[0].index
    hdr = codec.parse_header(c.payload)
    at = hdr.body_offset - 4
    wrong_crc = c.payload[:at] + struct.pack("<I", hdr.crc ^ 1) + c.payload[hdr.body_offset :]
    buf = vs[1].copy()
    with pytest.raises(CodecError, match="checksum"):
        decode_chunk_into(wrong_crc, buf, buf, context=ctx, index=idx)
    decode_chunk_into(wrong_crc, buf, buf, context=ctx, index=idx, checksum=False)
    assert np.array_equal(buf, vs[2])
    truncated = wrong_crc[: hdr.body_offset + (len(wrong_crc) - hdr.body_offset) // 2]
    buf = vs[1].copy()
    with pytest.raises(CodecError):
        decode_chunk_into(truncated, buf, buf, context=ctx, index=idx, checksum=False)
    assert np.array_equal(buf, vs[1])


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=0, max_size=160), st.integers(0, 2), st.booleans(), st.booleans())
def test_format_3_garbage_body_with_valid_checksum_never_crashes(blob, dtype_code, with_context, with_index):
    """A body that passes the checksum but is garbage (a buggy or hostile peer),
    with a valid context and index head: CodecError or some decode, never a
    crash; a refused chunk writes nothing, an accepted one writes only where
    it says, and its index is the one rebuilt from the result."""
    dtype = ["bf16", "fp16", "fp32"][dtype_code]
    n = 300
    old = _small_values(np.random.default_rng(len(blob)), dtype, n)
    raw = codec.DTYPES[dtype]
    idx = build_index(old, dtype, 0, n, fraction=0.5)
    flags, head = 0, b""
    ctx = None
    if with_context:
        ctx = codec.ChunkChanges(np.arange(0, n, 7, dtype=np.int64), old[::7] ^ raw(1), old[::7])
        fingerprint = codec._context3_arrays(ctx, dtype, 0, n)[2]
        flags |= 1
        head += codec.format._uv_encode(ctx.positions.size) + struct.pack("<I", fingerprint)
    if with_index:
        flags |= 2
        head += codec.format._uv_encode(idx.threshold) + codec.format._uv_encode(idx.positions.size) + struct.pack("<I", idx.fingerprint)
    body = bytes((flags,)) + head + blob
    header = b"MW" + bytes((3, codec.MODE_DELTA, dtype_code, 0)) + codec.format._uv_encode(n) * 2
    payload = header + struct.pack("<I", zlib.crc32(body)) + body
    buf = old.copy()
    try:
        changes = decode_chunk_into(payload, buf, buf, context=ctx, index=idx)
    except CodecError:
        assert np.array_equal(buf, old)
        return
    untouched = np.ones(n, dtype=bool)
    untouched[changes.positions] = False
    assert np.array_equal(buf[untouched], old[untouched])
    _same_index(changes.index, build_index(buf, dtype, 0, n, idx.threshold))


def test_keyframes_and_thresholds():
    vs = _chain(seed=5)
    chunks = encode_tensor("t", vs[0], None, "bf16", chunk_elems=7_000, format_version=3)
    for c in chunks:
        assert codec.parse_header(c.payload).mode == codec.MODE_KEYFRAME
        _same_index(c.index, build_index(vs[0], "bf16", c.start, c.count))
        sl = vs[0][c.start : c.start + c.count]
        small = ((sl.astype(np.int64) >> 7) & 0xFF) < c.index.threshold
        assert small.sum() == c.index.positions.size <= 0.02 * c.count  # the rule: at most 2 %
        bigger = ((sl.astype(np.int64) >> 7) & 0xFF) <= c.index.threshold
        assert bigger.sum() > 0.02 * c.count  # ... and the largest threshold that keeps it so
    assert codec.index_threshold(np.zeros(100, np.uint16), "bf16") == 0  # zeros alone are more than 2 %
    assert codec.index_threshold(np.zeros(0, np.uint16), "bf16") == 256
    with pytest.raises(CodecError, match="threshold"):
        build_index(vs[0], "bf16", 0, 10, 257)
    with pytest.raises(CodecError, match="outside a tensor"):
        build_index(vs[0], "bf16", 0, vs[0].size + 1)
    # A chunk that changed almost entirely becomes a keyframe; its index is the new values'.
    rng = np.random.default_rng(1)
    new = fp32_to_bf16_bits(rng.normal(0, 0.02, vs[0].size).astype(np.float32))
    (c,) = encode_tensor("t", new, vs[0], "bf16", format_version=3)
    assert codec.parse_header(c.payload).mode == codec.MODE_KEYFRAME and c.changes is None
    _same_index(c.index, build_index(new, "bf16", 0, new.size, c.index.threshold))
    assert decode_chunk_into(c.payload, vs[0].copy(), vs[0]) is None


def test_synthetic_adam_format_3_in_bench():
    versions = synthetic_adam_versions(400_000, 3, seed=5)
    report = run_codec_bench(versions, "bf16", formats=(1, 3))
    assert report["summary"]["bit_exact"]
    for step in report["steps"]:
        assert step["v3"]["bytes"] < step["xor_zstd_bytes"]
        assert step["v3"]["index_entries"] > 0
    assert report["summary"]["v3"]["pct_of_full"] < 1.1 * report["summary"]["v1"]["pct_of_full"]
