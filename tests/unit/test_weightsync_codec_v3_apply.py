"""Tests for the pieces of codec format 3's fast in-place apply
(services/weightsync/codec/index_kernels.py) that the round-trip tests in
test_weightsync_codec_v3.py do not pin on their own: the Rice reader the
decoder uses instead of the shared one, and the refusal of an index whose
class counts disagree with its classes (the walk lays out per-class flags by
those counts)."""

from __future__ import annotations

import numpy as np
import pytest

from services.weightsync import codec
from services.weightsync.codec import CodecError, decode_chunk_into
from services.weightsync.codec.format import _PAD, _QMAX, _RAW_BITS
from services.weightsync.codec.index_kernels import _rice
from services.weightsync.codec.kernels import _get_rice
from tests.unit.test_weightsync_codec_v3 import _chain, _encode_chain


def _stream(rng: np.random.Generator, nbits: int, zero_runs: bool) -> np.ndarray:
    """Random stream words plus the codec's zero padding; with ``zero_runs``
    long zero stretches, so that escapes (>= _QMAX zeros) and long unary
    parts occur."""
    bits = rng.random(nbits) < (0.02 if zero_runs else 0.5)
    raw = np.packbits(bits.astype(np.uint8), bitorder="little").tobytes() + bytes(_PAD + 8)
    return np.frombuffer(raw[: len(raw) // 8 * 8], dtype="<u8").astype(np.uint64)


@pytest.mark.parametrize("zero_runs", [False, True])
def test_rice_reader_equals_the_shared_one(zero_runs):
    """The decoder's count-trailing-zeros Rice reader gives the shared reader's
    value and position for every parameter format 3 admits (0.._RAW_BITS),
    escapes included, at every bit offset."""
    rng = np.random.default_rng(7 + zero_runs)
    words = _stream(rng, 6000, zero_runs)
    escapes = 0
    for k in range(_RAW_BITS + 1):
        for pos in range(0, 4000, 7):
            want = _get_rice(words, pos, k)
            assert _rice(words, pos, k) == want, (k, pos)
            escapes += want[1] - pos == _QMAX + _RAW_BITS
    assert escapes > 0 or not zero_runs, "the escape path was not exercised"


@pytest.mark.parametrize("edit", ["move", "more", "fewer"])
def test_index_whose_class_counts_disagree_is_refused_before_writing(edit):
    """An index whose class counts do not match its classes (its fingerprint
    covers entries, not counts, so it passes the payload's check) is refused
    with CodecError and nothing is written: the walk finds its classes
    overrunning or falling short of their flags."""
    vs = _chain(seed=5, steps=2)
    steps = _encode_chain(vs, chunk_elems=10_000)
    chunk = next(c for c in steps[1] if c.changes is not None and codec.parse_header(c.payload).mode == codec.MODE_DELTA)
    payload, ctx = chunk.payload, next(c for c in steps[0] if c.start == chunk.start).changes
    idx = next(c for c in steps[0] if c.start == chunk.start).index
    assert payload[codec.parse_header(payload).body_offset] & 2, "the chunk must be coded over the index"
    present = np.nonzero(idx.class_counts)[0]
    counts = idx.class_counts.copy()
    if edit == "move":
        counts[present[-1]] -= 1
        counts[present[0]] += 1
    elif edit == "more":
        counts[present[-1]] += 3
    else:
        counts[present[-1]] -= 1
    buf = vs[1].copy()
    with pytest.raises(CodecError):
        decode_chunk_into(payload, buf, buf, context=ctx, index=idx._replace(class_counts=counts))
    assert np.array_equal(buf, vs[1]), "a refused chunk must not write anything"
    got = decode_chunk_into(payload, buf, buf, context=ctx, index=idx)  # the true index still decodes
    assert got is not None and np.array_equal(buf[chunk.start : chunk.start + chunk.count], vs[2][chunk.start : chunk.start + chunk.count])
