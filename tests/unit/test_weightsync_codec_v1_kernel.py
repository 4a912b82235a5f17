"""Format-1 deltas decode in one kernel call (kernels._decode_chunk1); the step by step
path from Python (codec._decode_delta1_steps) stays for heads the kernel refuses and for
overlapping views. Both must agree bit for bit, and on every refusal's error, whatever
the body holds: a payload damaged after its checksum was taken (checksum=False, as a
receiver decodes chunks already checked against the manifest) is the case a CRC does
not catch."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.weightsync import codec
from services.weightsync.codec import CodecError, decode_chunk_into, encode_tensor


def _payload(dtype: str = "bf16", n: int = 3001, seed: int = 5) -> tuple[bytes, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    raw = codec.DTYPES[dtype]
    old = rng.integers(0, np.iinfo(raw).max, n, dtype=raw)
    new = old.copy()
    idx = rng.choice(n, 60, replace=False)
    new[idx] += raw(1)
    (chunk,) = encode_tensor("t", new, old, dtype, format_version=1)
    assert codec.parse_header(chunk.payload).mode == codec.MODE_DELTA
    return chunk.payload, old, new


def _outcome(fn, payload: bytes, out: np.ndarray, old: np.ndarray):
    """What a decode gives: its changes and destination, or its error."""
    try:
        ch = fn(payload, out, old)
    except CodecError as exc:
        return ("error", str(exc), out.tolist())
    return ("ok", ch.positions.tolist(), ch.old.tolist(), ch.new.tolist(), out.tolist())


def _kernel(payload: bytes, out: np.ndarray, old: np.ndarray):
    return decode_chunk_into(payload, out, old, checksum=False)


def _steps(payload: bytes, out: np.ndarray, old: np.ndarray):
    hdr = codec.parse_header(payload)
    return codec._decode_delta1_steps(hdr, memoryview(payload)[hdr.body_offset :], out, old)


def _both(payload: bytes, old: np.ndarray, in_place: bool) -> list:
    """The outcome of the kernel path and of the step-by-step path, each on its own copy
    of ``old`` (decoded in place, or into a fresh array)."""
    got = []
    for fn in (_kernel, _steps):
        base = old.copy()
        out = base if in_place else np.zeros_like(old)
        got.append(_outcome(fn, payload, out, base))
    return got


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("in_place", [False, True])
def test_kernel_decode_equals_the_steps(dtype: str, in_place: bool) -> None:
    payload, old, new = _payload(dtype)
    got = _both(payload, old, in_place)
    assert got[0] == got[1]
    assert got[0][0] == "ok" and got[0][4] == new.tolist()


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_damaged_bodies_agree_with_the_steps(data) -> None:
    payload, old, _ = _payload()
    hdr = codec.parse_header(payload)
    body = bytearray(payload[hdr.body_offset :])
    head = min(len(body), 40)  # the lane count and class table, where the kernel parses
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, head - 1) if data.draw(st.booleans()) else st.integers(0, len(body) - 1))
        body[at] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(body)))
    damaged = payload[: hdr.body_offset] + bytes(body[:cut] if data.draw(st.booleans()) else body)
    got = _both(damaged, old, data.draw(st.booleans()))
    assert got[0] == got[1]


def test_overlapping_views_take_the_steps() -> None:
    """out and old shifted views of one buffer: the base is copied aside first."""
    payload, old, new = _payload(n=3000)
    buf = np.zeros(old.size + 1, dtype=old.dtype)
    buf[1:] = old
    out = buf[:-1]
    decode_chunk_into(payload, out, buf[1:], checksum=False)
    assert np.array_equal(out, new)
