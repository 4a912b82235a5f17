"""Lossless delta codec for model weights travelling between regions.

A new policy version is sent as chunks, each coding a contiguous run of one
tensor's elements either as a *keyframe* (self-contained) or as a *delta*
against the previous version, which the receiver already holds. The codec
works on raw bit patterns (uint16 for bf16/fp16, uint32 for fp32), so every
bit pattern -- NaN payloads, infinities, -0.0, denormals -- round-trips
exactly.

Why the delta coding looks the way it does
------------------------------------------
After one RL step (AdamW, lr ~1e-6) only ~0.3 % of bf16 elements change, and
*whether* an element changes depends mostly on its old exponent: an Adam step
is ~lr in absolute size while the bf16 grid spacing is 2**(exponent - 7), so a
weight of 1e-3 changes ~100x more often than a weight of 0.1. The decoder
knows every old exponent, so we use it as the coding context:

* Each element belongs to a *stream* ``(lane, class)`` where ``class`` is the
  old value's exponent field and ``lane = index % 4``. Within a stream the
  changed elements are an (almost) i.i.d. Bernoulli process with a
  per-class rate, whose gaps are geometric; Rice codes with a per-class
  parameter are within ~1 % of the entropy of a geometric source. The lanes
  carry no statistical meaning: they give the per-element decode loop four
  independent counters, so it is not serialised on one memory location.
* A changed element's value is coded as the signed number of steps on the
  *ordered integer* image of the float grid (a monotone bijection of bit
  patterns to integers), so an Adam step of "one ulp up" is ``+1``. We code
  a sign bit plus a per-class Rice code of ``|steps| - 1``; classes where
  every change is one step send no magnitude bits at all.
* Codes are grouped per class, so the decoder expands them into arrays in
  short serial loops that touch only the changes; the per-element pass
  (one per chunk) then only counts down and, at a change, pops the next gap.

Payload format (all integers little endian; "uv" = unsigned LEB128 varint)
------------------------------------------------------------------------
Header::

    b"MW"  magic            (2 bytes)
    u8     format version   (currently 1)
    u8     mode             (0 = keyframe, 1 = delta)
    u8     dtype code       (0 = bf16, 1 = fp16, 2 = fp32)
    uv     start, count     (element range of this chunk)
    uv     total            (element count of the whole tensor)
    u32    crc32 of the body
    ...    body             (rest of the payload)

Keyframe body::

    u8     number of byte planes P (2 for 16-bit dtypes, 4 for fp32)
    P x uv compressed size of each plane
    P x    zstd frame of byte plane p (bits 8p..8p+7 of every element)

  Splitting bytes into planes puts the low-entropy sign/exponent byte of
  bf16 in its own plane, where zstd's entropy stage can exploit it.

Delta body::

    u8     number of lanes L (currently 4)
    uv     number of active classes C (classes with at least one change)
    C x    (u8 class, u8 k_gap, u8 k_mag, uv changes n_c)   ascending class;
           k_mag = 255 means every change in the class is +-1 step
    bits   for each active class c in table order:
             Rice(k_gap) of the first gap of stream (lane, c), lane 0..L-1;
             Rice(k_gap) of the gap after each change of class c (element
               order) -- the last one of a stream overshoots its end;
             Rice(k_mag) of |steps| - 1 of each change (unless k_mag = 255);
           then one raw sign bit per change in element order (1 = negative);
           zero padding to a byte.

  A "gap" counts the unchanged elements of the same stream that are
  skipped. Bits are written LSB first (the decoder reads the stream as
  little-endian 64-bit words). A Rice code of ``v`` with parameter ``k`` is
  ``q = v >> k`` zero bits, a one bit, then the low ``k`` bits of ``v``; if
  ``q >= 24`` it is 24 zero bits followed by ``v`` in 40 raw bits.

A delta chunk carries no fingerprint of its base (hashing the base would
cost a full extra pass): decoding against the wrong base yields wrong values
or, often, a CodecError, so callers must track versions themselves.
"""

from __future__ import annotations

import struct
import sys
import zlib
from dataclasses import dataclass

import numpy as np
import zstandard
from numba import njit

__all__ = [
    "DTYPES",
    "CodecError",
    "EncodedChunk",
    "encode_tensor",
    "encode_keyframe_chunk",
    "encode_delta_chunk",
    "decode_chunk_into",
    "ChunkChanges",
    "decode_tensor",
    "parse_header",
    "ChunkHeader",
]

DTYPES: dict[str, type] = {"bf16": np.uint16, "fp16": np.uint16, "fp32": np.uint32}

_MAGIC = b"MW"
_VERSION = 1
MODE_KEYFRAME = 0
MODE_DELTA = 1
_DTYPE_CODES = {"bf16": 0, "fp16": 1, "fp32": 2}
_DTYPE_NAMES = {v: k for k, v in _DTYPE_CODES.items()}
# Where the exponent field sits (shift, mask) and the width of the raw word.
_EXP_FIELD = {"bf16": (7, 0xFF), "fp16": (10, 0x1F), "fp32": (23, 0xFF)}
_BITS = {"bf16": 16, "fp16": 16, "fp32": 32}

_LANES = 4  # independent counter sets in the decode loop (see module doc)
_NCLASS = 256  # class = exponent field; fp16 only uses the first 32
_KMAG_UNIT = 255  # k_mag sentinel: every change in the class is +-1 step
_QMAX = 24  # Rice escape: this many zeros, then the value in _RAW_BITS bits
_RAW_BITS = 40
_MAX_CHUNK = 1 << 39  # gaps must fit the 40-bit escape
_PAD = 40  # zero bytes appended to a bit stream before decoding (see _peek)
# If more than this fraction of a chunk changed, also try a keyframe and keep
# the smaller; below it a delta is always far smaller, so we skip the work.
_TRY_KEYFRAME_FRACTION = 0.2
_ZSTD_LEVEL = 3


class CodecError(ValueError):
    """Raised for malformed or truncated payloads and for inputs that do not
    match a payload (dtype, length, missing base for a delta)."""


@dataclass(frozen=True)
class EncodedChunk:
    """One independently decodable piece of a tensor."""

    tensor: str  # tensor name
    start: int  # first element index (flat) this chunk covers
    count: int  # number of elements covered
    payload: bytes  # self-describing, see module docstring


@dataclass(frozen=True)
class ChunkHeader:
    """Decoded payload header; ``body_offset`` is where the body starts."""

    mode: int
    dtype: str
    start: int
    count: int
    total: int
    crc: int
    body_offset: int


# --------------------------------------------------------------------------
# Small byte helpers
# --------------------------------------------------------------------------


def _uv_encode(value: int) -> bytes:
    """Unsigned LEB128."""
    if value < 0:
        raise ValueError(f"varint must be non-negative, got {value}")
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _uv_decode(buf: bytes, pos: int, what: str) -> tuple[int, int]:
    """Read an unsigned LEB128 at ``pos``; return (value, new_pos)."""
    value = 0
    shift = 0
    while True:
        if pos >= len(buf):
            raise CodecError(f"truncated payload while reading {what}")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise CodecError(f"varint too long while reading {what}")


def _header_bytes(mode: int, dtype: str, start: int, count: int, total: int, body: bytes) -> bytes:
    return b"".join(
        (
            _MAGIC,
            bytes((_VERSION, mode, _DTYPE_CODES[dtype])),
            _uv_encode(start),
            _uv_encode(count),
            _uv_encode(total),
            struct.pack("<I", zlib.crc32(body)),
        )
    )


def parse_header(payload: bytes) -> ChunkHeader:
    """Parse and validate a payload header (not the body checksum)."""
    if len(payload) < 5:
        raise CodecError(f"payload too short for a header ({len(payload)} bytes)")
    if payload[:2] != _MAGIC:
        raise CodecError(f"bad magic {payload[:2]!r}, expected {_MAGIC!r}")
    if payload[2] != _VERSION:
        raise CodecError(f"unsupported format version {payload[2]} (this codec reads {_VERSION})")
    mode = payload[3]
    if mode not in (MODE_KEYFRAME, MODE_DELTA):
        raise CodecError(f"unknown chunk mode {mode}")
    if payload[4] not in _DTYPE_NAMES:
        raise CodecError(f"unknown dtype code {payload[4]}")
    dtype = _DTYPE_NAMES[payload[4]]
    pos = 5
    start, pos = _uv_decode(payload, pos, "start")
    count, pos = _uv_decode(payload, pos, "count")
    total, pos = _uv_decode(payload, pos, "total")
    if start + count > total:
        raise CodecError(f"chunk range [{start}, {start + count}) exceeds tensor length {total}")
    if pos + 4 > len(payload):
        raise CodecError("truncated payload while reading body checksum")
    (crc,) = struct.unpack_from("<I", payload, pos)
    return ChunkHeader(mode, dtype, start, count, total, crc, pos + 4)


# --------------------------------------------------------------------------
# Keyframes: byte planes + zstd
# --------------------------------------------------------------------------


def _keyframe_body(values: np.ndarray, dtype: str) -> bytes:
    nplanes = _BITS[dtype] // 8
    cctx = zstandard.ZstdCompressor(level=_ZSTD_LEVEL)
    wide = values.astype(np.uint32, copy=False)
    frames = [
        cctx.compress((wide >> np.uint32(8 * p)).astype(np.uint8).tobytes()) for p in range(nplanes)
    ]
    head = bytes((nplanes,)) + b"".join(_uv_encode(len(f)) for f in frames)
    return head + b"".join(frames)


def _decode_keyframe(body: bytes, out: np.ndarray, dtype: str, count: int) -> None:
    nplanes = _BITS[dtype] // 8
    if not body or body[0] != nplanes:
        raise CodecError(f"keyframe body must start with plane count {nplanes}")
    pos = 1
    sizes = []
    for p in range(nplanes):
        size, pos = _uv_decode(body, pos, f"keyframe plane {p} size")
        sizes.append(size)
    if pos + sum(sizes) != len(body):
        raise CodecError(
            f"keyframe planes need {pos + sum(sizes)} body bytes, payload has {len(body)}"
        )
    dctx = zstandard.ZstdDecompressor()
    acc = np.zeros(count, dtype=np.uint32)
    for p, size in enumerate(sizes):
        try:
            plane = dctx.decompress(body[pos : pos + size], max_output_size=count)
        except zstandard.ZstdError as exc:
            raise CodecError(f"keyframe plane {p} is corrupt: {exc}") from exc
        if len(plane) != count:
            raise CodecError(f"keyframe plane {p} has {len(plane)} bytes, expected {count}")
        acc |= np.frombuffer(plane, dtype=np.uint8).astype(np.uint32) << np.uint32(8 * p)
        pos += size
    out[:] = acc  # narrowing to uint16 is exact: only 2 planes were filled


# --------------------------------------------------------------------------
# Delta hot loops (numba). Streams are indexed s = lane * 256 + class.
# --------------------------------------------------------------------------


@njit(cache=True, nogil=True, inline="always")
def _ordered_key(x, sign_bit, full):
    """Monotone bijection raw bits -> integer (so +1 is one grid step up)."""
    if x & sign_bit:
        return (~x) & full
    return x | sign_bit


@njit(cache=True, nogil=True)
def _finish_scan(new, old, ne, ev_pos, ev_stream, ev_rank, counts, sign_bit, full):
    """Trim the event arrays and compute each event's signed step count."""
    ev_delta = np.empty(ne, dtype=np.int64)
    for e in range(ne):
        i = ev_pos[e]
        ev_delta[e] = _ordered_key(np.int64(new[i]), sign_bit, full) - _ordered_key(
            np.int64(old[i]), sign_bit, full
        )
    return ne, ev_stream[:ne].copy(), ev_rank[:ne].copy(), ev_delta, counts.reshape(-1)


@njit(cache=True, nogil=True, inline="always")
def _scan_elements(new, old, start, stop, shift, emask, counts, ev_pos, ev_stream, ev_rank, ne):
    """Elements start..stop one at a time: count each stream, record each change (its
    position, stream and rank in the stream). Returns the new change count."""
    for i in range(start, stop):
        lane = i & (_LANES - 1)
        c = (np.int64(old[i]) >> shift) & emask
        r = counts[lane, c]
        counts[lane, c] = r + 1
        if new[i] != old[i]:
            ev_pos[ne] = i
            ev_stream[ne] = (lane << 8) | c
            ev_rank[ne] = r
            ne += 1
    return ne


@njit(cache=True, nogil=True)
def _scan_changes(new, old, shift, emask, sign_bit, full):
    """One pass over a chunk: find changed elements, their stream, their rank
    inside the stream and their signed step count. Also count stream sizes.
    Generic path (any dtype/alignment); see _scan_changes16 for the fast one."""
    n = new.shape[0]
    counts = np.zeros((_LANES, _NCLASS), dtype=np.int64)
    # np.empty touches no memory until written, so sizing for the worst case
    # costs nothing in the common sparse case.
    ev_pos = np.empty(n, dtype=np.int64)
    ev_stream = np.empty(n, dtype=np.int64)
    ev_rank = np.empty(n, dtype=np.int64)
    ne = _scan_elements(new, old, 0, n, shift, emask, counts, ev_pos, ev_stream, ev_rank, 0)
    return _finish_scan(new, old, ne, ev_pos, ev_stream, ev_rank, counts, sign_bit, full)


@njit(cache=True, nogil=True)
def _scan_changes16(new, old, new64, old64, shift, emask, sign_bit, full):
    """Same result as _scan_changes for 16-bit data, ~2x faster: it reads
    four elements (one lane each) per 64-bit word, so the change test is one
    compare per word and the four lane counters update independently."""
    n = new.shape[0]
    counts = np.zeros((_LANES, _NCLASS), dtype=np.int64)
    c0 = counts[0]
    c1 = counts[1]
    c2 = counts[2]
    c3 = counts[3]
    ev_pos = np.empty(n, dtype=np.int64)
    ev_stream = np.empty(n, dtype=np.int64)
    ev_rank = np.empty(n, dtype=np.int64)
    ne = 0
    sh = np.uint64(shift)
    em = np.uint64(emask)
    for j in range(new64.shape[0]):
        w = old64[j]
        # Element 4j+l sits in bits 16l..16l+15 (little-endian host).
        c0[(w >> sh) & em] += 1
        c1[(w >> (sh + np.uint64(16))) & em] += 1
        c2[(w >> (sh + np.uint64(32))) & em] += 1
        c3[(w >> (sh + np.uint64(48))) & em] += 1
        if new64[j] != w:
            for lane in range(_LANES):
                i = 4 * j + lane
                if new[i] != old[i]:
                    c = (np.int64(old[i]) >> shift) & emask
                    ev_pos[ne] = i
                    ev_stream[ne] = (lane << 8) | c
                    ev_rank[ne] = counts[lane, c] - 1
                    ne += 1
    ne = _scan_elements(new, old, 4 * new64.shape[0], n, shift, emask, counts, ev_pos, ev_stream, ev_rank, ne)  # tail (< 4)
    return _finish_scan(new, old, ne, ev_pos, ev_stream, ev_rank, counts, sign_bit, full)


def _scan(new: np.ndarray, old: np.ndarray, dtype: str):
    """Dispatch to the word-parallel scan when the data allows it."""
    shift, emask = _EXP_FIELD[dtype]
    full = (1 << _BITS[dtype]) - 1
    sign_bit = 1 << (_BITS[dtype] - 1)
    n4 = new.shape[0] // 4
    if (
        _BITS[dtype] == 16
        and sys.byteorder == "little"
        and n4 > 0
        and new.ctypes.data % 8 == 0
        and old.ctypes.data % 8 == 0
    ):
        new64 = new[: 4 * n4].view(np.uint64)
        old64 = old[: 4 * n4].view(np.uint64)
        return _scan_changes16(new, old, new64, old64, shift, emask, sign_bit, full)
    return _scan_changes(new, old, shift, emask, sign_bit, full)


@njit(cache=True, nogil=True, inline="always")
def _rice_cost(v, k):
    q = v >> k
    if q >= _QMAX:
        return _QMAX + _RAW_BITS
    return q + 1 + k


@njit(cache=True, nogil=True)
def _best_k(values, nvalues, maxk):
    """Rice parameter minimising the coded size of values[:nvalues]."""
    if nvalues == 0:
        return 0
    total = 0.0
    for j in range(nvalues):
        total += values[j]
    mean = total / nvalues
    k0 = 0
    while k0 < maxk and (1 << (k0 + 1)) <= mean:
        k0 += 1
    best_k = 0
    best_cost = -1
    for k in range(max(0, k0 - 2), min(maxk, k0 + 2) + 1):
        cost = 0
        for j in range(nvalues):
            cost += _rice_cost(values[j], k)
        if best_cost < 0 or cost < best_cost:
            best_cost = cost
            best_k = k
    return best_k


@njit(cache=True, nogil=True, inline="always")
def _put(words, acc, state, value, nbits):
    """Append the low nbits (1..40) of value to the stream, LSB first.

    words: uint64 output; acc: uint64[1] pending bits; state: int64[2] =
    (number of pending bits, next word index). A word is flushed as soon as
    it fills up."""
    v = np.uint64(value)
    nacc = state[0]
    acc[0] |= v << np.uint64(nacc)
    nacc += nbits
    if nacc >= 64:
        words[state[1]] = acc[0]
        state[1] += 1
        nacc -= 64
        # nacc was >= 24 here (nbits <= 40), so this shift is in 24..63.
        acc[0] = (v >> np.uint64(nbits - nacc)) if nacc > 0 else np.uint64(0)
    state[0] = nacc


@njit(cache=True, nogil=True, inline="always")
def _put_rice(words, acc, state, v, k):
    """Rice code of v >= 0 with parameter k (see module doc for the escape)."""
    q = v >> k
    if q >= _QMAX:
        _put(words, acc, state, 0, _QMAX)
        _put(words, acc, state, v, _RAW_BITS)
        return
    if q + 1 + k <= 40:
        _put(words, acc, state, ((v & ((1 << k) - 1)) << (q + 1)) | (1 << q), q + 1 + k)
    else:
        _put(words, acc, state, 1 << q, q + 1)
        _put(words, acc, state, v & ((1 << k) - 1), k)


@njit(cache=True, nogil=True)
def _encode_events(ev_stream, ev_rank, ev_delta, counts):
    """Choose per-class Rice parameters and write the delta bit stream.

    Returns (classes, k_gap, k_mag, events per class, stream words, bits)."""
    ne = ev_stream.shape[0]
    # Backward pass: gap from each event to the next change of its stream
    # (or past the stream's end), and each stream's first gap.
    nxt = counts.copy()
    gap_after = np.empty(ne, dtype=np.int64)
    for e in range(ne - 1, -1, -1):
        s = ev_stream[e]
        gap_after[e] = nxt[s] - ev_rank[e] - 1
        nxt[s] = ev_rank[e]
    nev_class = np.zeros(_NCLASS, dtype=np.int64)
    for e in range(ne):
        nev_class[ev_stream[e] & 0xFF] += 1
    classes = np.nonzero(nev_class)[0]
    # Group per-class values contiguously (element order within a class).
    offs = np.zeros(_NCLASS + 1, dtype=np.int64)
    for c in range(_NCLASS):
        offs[c + 1] = offs[c] + nev_class[c]
    fill = offs[:-1].copy()
    gaps_by_c = np.empty(ne, dtype=np.int64)
    mags_by_c = np.empty(ne, dtype=np.int64)
    for e in range(ne):
        c = ev_stream[e] & 0xFF
        gaps_by_c[fill[c]] = gap_after[e]
        mags_by_c[fill[c]] = abs(ev_delta[e]) - 1
        fill[c] += 1
    k_gap = np.zeros(_NCLASS, dtype=np.int64)
    k_mag = np.zeros(_NCLASS, dtype=np.int64)
    tmp = np.empty(ne + _LANES, dtype=np.int64)
    for c in classes:
        m = nev_class[c]
        for lane in range(_LANES):
            tmp[lane] = nxt[(lane << 8) | c]
        tmp[_LANES : _LANES + m] = gaps_by_c[offs[c] : offs[c + 1]]
        k_gap[c] = _best_k(tmp, m + _LANES, _RAW_BITS)
        mags = mags_by_c[offs[c] : offs[c + 1]]
        k_mag[c] = _KMAG_UNIT if mags.max() == 0 else _best_k(mags, m, 32)
    # Worst case per value: 24 + 40 bits; plus one sign bit per event.
    cap = (ne * 129 + classes.shape[0] * _LANES * 64) // 64 + 2
    words = np.zeros(cap, dtype=np.uint64)
    acc = np.zeros(1, dtype=np.uint64)
    state = np.zeros(2, dtype=np.int64)
    for c in classes:
        for lane in range(_LANES):
            _put_rice(words, acc, state, nxt[(lane << 8) | c], k_gap[c])
        for j in range(offs[c], offs[c + 1]):
            _put_rice(words, acc, state, gaps_by_c[j], k_gap[c])
        if k_mag[c] != _KMAG_UNIT:
            for j in range(offs[c], offs[c + 1]):
                _put_rice(words, acc, state, mags_by_c[j], k_mag[c])
    for e in range(ne):  # raw sign bits, element order
        _put(words, acc, state, 1 if ev_delta[e] < 0 else 0, 1)
    nbits = state[1] * 64 + state[0]
    if state[0] > 0:
        words[state[1]] = acc[0]
    return classes, k_gap[classes], k_mag[classes], nev_class[classes], words, nbits


# Count-trailing-zeros by de Bruijn multiplication (numba has no public ctz).
_DEBRUIJN = np.uint64(0x03F79D71B4CB0A89)
_CTZ_TABLE = np.zeros(64, dtype=np.int64)
for _i in range(64):
    _CTZ_TABLE[((1 << _i) * int(_DEBRUIJN) & 0xFFFFFFFFFFFFFFFF) >> 58] = _i
del _i


@njit(cache=True, nogil=True, inline="always")
def _ctz(x):
    """Index of the lowest set bit of a non-zero uint64."""
    low = x & (~x + np.uint64(1))
    return _CTZ_TABLE[(low * _DEBRUIJN) >> np.uint64(58)]


@njit(cache=True, nogil=True, inline="always")
def _peek(words, pos):
    """64 bits of the stream starting at bit pos. The stream carries _PAD
    zero bytes so reads up to one event (<= 129 bits) past the last
    checked position stay in bounds."""
    wi = pos >> 6
    sh = np.uint64(pos & 63)
    # (x << 1) << (63 - sh) avoids the undefined shift by 64 when sh == 0.
    return (words[wi] >> sh) | ((words[wi + 1] << np.uint64(1)) << (np.uint64(63) - sh))


@njit(cache=True, nogil=True, inline="always")
def _get_rice(words, pos, k):
    """Return (value, new_pos) of the Rice code at bit pos."""
    w = _peek(words, pos)
    if (w & np.uint64((1 << _QMAX) - 1)) == 0:  # escape: raw value follows
        pos += _QMAX
        v = np.int64(_peek(words, pos) & np.uint64((1 << _RAW_BITS) - 1))
        return v, pos + _RAW_BITS
    q = _ctz(w)
    if k == 0:
        return q, pos + q + 1
    if q + 1 + k <= 64:
        low = np.int64((w >> np.uint64(q + 1)) & np.uint64((1 << k) - 1))
    else:
        low = np.int64(_peek(words, pos + q + 1) & np.uint64((1 << k) - 1))
    return (q << k) | low, pos + q + 1 + k


@njit(cache=True, nogil=True)
def _read_sections(words, nbits, classes, k_gap_c, k_mag_c, nev_c):
    """Decode the per-class sections into flat arrays.

    Returns (status, gaps, gap_start per class, mags, mag_start per class,
    bit position of the sign bits). status < 0 on overrun."""
    ncls = classes.shape[0]
    ne = 0
    for j in range(ncls):
        ne += nev_c[j]
    gaps = np.empty(ne + _LANES * ncls, dtype=np.int64)
    mags = np.zeros(ne, dtype=np.int64)
    gap_start = np.zeros(_NCLASS, dtype=np.int64)
    mag_start = np.zeros(_NCLASS, dtype=np.int64)
    g = 0
    m = 0
    pos = 0
    for j in range(ncls):
        c = classes[j]
        gap_start[c] = g
        for _ in range(_LANES + nev_c[j]):
            gaps[g], pos = _get_rice(words, pos, k_gap_c[j])
            g += 1
            if pos > nbits:
                return -1, gaps, gap_start, mags, mag_start, pos
        mag_start[c] = m
        if k_mag_c[j] != _KMAG_UNIT:
            for _ in range(nev_c[j]):
                mags[m], pos = _get_rice(words, pos, k_mag_c[j])
                m += 1
                if pos > nbits:
                    return -1, gaps, gap_start, mags, mag_start, pos
        else:
            m += nev_c[j]  # stays zero: |steps| - 1 == 0
    return 0, gaps, gap_start, mags, mag_start, pos


@njit(cache=True, nogil=True, inline="always")
def _event_value(o, mag_minus_1, negative, sign_bit, full):
    """New bits for old bits o moved by +-(mag_minus_1 + 1) grid steps, or -1
    if that leaves the grid (only possible for a corrupt payload)."""
    step = mag_minus_1 + 1
    key = _ordered_key(np.int64(o), sign_bit, full) + (-step if negative else step)
    if key < 0 or key > full:
        return np.int64(-1)
    if key & sign_bit:
        return key ^ sign_bit
    return (~key) & full


# Deliberately not inlined: the rare path out of the hot loops, which run ~10 %
# faster when it does not take up their registers.
@njit(cache=True, nogil=True)
def _count_down(rem, s, gaps, gptr, gend, evs, ne, i):
    """Countdown of stream s went negative at element i: record the change
    and load the stream's next gap. Returns the new change count, or -1 if
    the stream has no gap left (corrupt payload)."""
    c = s & 0xFF
    if gptr[c] >= gend[c]:
        return -1
    rem[s] = gaps[gptr[c]]
    gptr[c] += 1
    evs[ne] = i
    return ne + 1


@njit(cache=True, nogil=True)
def _count_down_group(rem, s0, s1, s2, s3, r0, r1, r2, r3, gaps, gptr, gend, evs, ne, i):
    """The four countdowns of elements i..i+3 after one went negative: _count_down each
    negative one in element order. Returns the new change count, or -1 if corrupt."""
    if r0 < 0:
        ne = _count_down(rem, s0, gaps, gptr, gend, evs, ne, i)
        if ne < 0:
            return -1
    if r1 < 0:
        ne = _count_down(rem, s1, gaps, gptr, gend, evs, ne, i + 1)
        if ne < 0:
            return -1
    if r2 < 0:
        ne = _count_down(rem, s2, gaps, gptr, gend, evs, ne, i + 2)
        if ne < 0:
            return -1
    if r3 < 0:
        ne = _count_down(rem, s3, gaps, gptr, gend, evs, ne, i + 3)
    return ne


@njit(cache=True, nogil=True, inline="always")
def _start_countdowns(classes, nev_c, gaps, gptr):
    """Per stream (lane, class) its first gap, and per class where its gaps end."""
    gend = np.zeros(_NCLASS, dtype=np.int64)
    rem = np.full(_LANES * _NCLASS, np.int64(1) << 62, dtype=np.int64)
    for j in range(classes.shape[0]):
        c = classes[j]
        for lane in range(_LANES):
            rem[(lane << 8) | c] = gaps[gptr[c]]
            gptr[c] += 1
        gend[c] = gptr[c] + nev_c[j]
    return gend, rem


@njit(cache=True, nogil=True)
def _find_changes(old, shift, emask, classes, nev_c, gaps, gptr, evs):
    """Pass 1: walk the chunk with one countdown per stream and return how
    many changes were found (their positions go to evs), or -1 if corrupt.

    Four elements (one per lane) per iteration with four separate counter
    rows, so consecutive updates never wait on each other."""
    n = old.shape[0]
    gend, rem = _start_countdowns(classes, nev_c, gaps, gptr)
    ne = 0
    n4 = n // 4
    for j in range(n4):
        i = 4 * j
        s0 = (np.int64(old[i]) >> shift) & emask
        s1 = ((np.int64(old[i + 1]) >> shift) & emask) | 256
        s2 = ((np.int64(old[i + 2]) >> shift) & emask) | 512
        s3 = ((np.int64(old[i + 3]) >> shift) & emask) | 768
        r0 = rem[s0] - 1
        r1 = rem[s1] - 1
        r2 = rem[s2] - 1
        r3 = rem[s3] - 1
        rem[s0] = r0
        rem[s1] = r1
        rem[s2] = r2
        rem[s3] = r3
        if (r0 | r1 | r2 | r3) < 0:  # rare: handle the group in element order
            ne = _count_down_group(rem, s0, s1, s2, s3, r0, r1, r2, r3, gaps, gptr, gend, evs, ne, i)
            if ne < 0:
                return -1
    for i in range(4 * n4, n):  # tail (< 4 elements)
        s = (((i & (_LANES - 1))) << 8) | ((np.int64(old[i]) >> shift) & emask)
        rem[s] -= 1
        if rem[s] < 0:
            ne = _count_down(rem, s, gaps, gptr, gend, evs, ne, i)
            if ne < 0:
                return -1
    return ne


@njit(cache=True, nogil=True)
def _find_changes16(old, old64, shift, emask, classes, nev_c, gaps, gptr, evs):
    """_find_changes for 16-bit data read as 64-bit words (four elements, one
    per lane, per load): same result, ~15 % faster because the class of each
    element comes from one shift of a register instead of four loads."""
    gend, rem = _start_countdowns(classes, nev_c, gaps, gptr)
    ne = 0
    sh = np.uint64(shift)
    em = np.uint64(emask)
    for j in range(old64.shape[0]):
        w = old64[j]
        s0 = np.int64((w >> sh) & em)
        s1 = np.int64((w >> (sh + np.uint64(16))) & em) | 256
        s2 = np.int64((w >> (sh + np.uint64(32))) & em) | 512
        s3 = np.int64((w >> (sh + np.uint64(48))) & em) | 768
        r0 = rem[s0] - 1
        r1 = rem[s1] - 1
        r2 = rem[s2] - 1
        r3 = rem[s3] - 1
        rem[s0] = r0
        rem[s1] = r1
        rem[s2] = r2
        rem[s3] = r3
        if (r0 | r1 | r2 | r3) < 0:  # rare: handle the group in element order
            ne = _count_down_group(rem, s0, s1, s2, s3, r0, r1, r2, r3, gaps, gptr, gend, evs, ne, 4 * j)
            if ne < 0:
                return -1
    for i in range(4 * old64.shape[0], old.shape[0]):  # tail (< 4 elements)
        s = ((i & (_LANES - 1)) << 8) | ((np.int64(old[i]) >> shift) & emask)
        rem[s] -= 1
        if rem[s] < 0:
            ne = _count_down(rem, s, gaps, gptr, gend, evs, ne, i)
            if ne < 0:
                return -1
    return ne


@njit(cache=True, nogil=True)
def _decode_delta(old, old64, out, shift, emask, sign_bit, full, classes, k_gap_c, k_mag_c, nev_c, words, nbits):
    """Apply the delta bit stream to out[:], which already holds old[:].

    Codes are first expanded into arrays (short serial loops over the
    changes only), pass 1 finds the changed positions, pass 2 writes their
    new values. Returns 0 on success or a negative error code (see
    _DELTA_ERRORS)."""
    st, gaps, gptr, mags, mptr, sign_pos = _read_sections(words, nbits, classes, k_gap_c, k_mag_c, nev_c)
    no_pos = np.empty(0, dtype=np.int64)
    no_old = np.empty(0, dtype=old.dtype)
    if st < 0:
        return st, no_pos, no_old
    ne = mags.shape[0]
    if sign_pos + ne > nbits:
        return -1, no_pos, no_old
    if nbits - (sign_pos + ne) >= 8:
        return -4, no_pos, no_old
    # Sized for the worst case; untouched pages of np.empty cost nothing.
    evs = np.empty(old.shape[0], dtype=np.int64)
    if old64.shape[0] > 0:
        found = _find_changes16(old, old64, shift, emask, classes, nev_c, gaps, gptr, evs)
    else:
        found = _find_changes(old, shift, emask, classes, nev_c, gaps, gptr, evs)
    if found != ne:
        return -2, no_pos, no_old
    olds = np.empty(ne, dtype=old.dtype)
    for e in range(ne):
        i = evs[e]
        o = old[i]
        olds[e] = o
        c = (np.int64(o) >> shift) & emask
        sbit = sign_pos + e
        neg = ((words[sbit >> 6] >> np.uint64(sbit & 63)) & np.uint64(1)) != 0
        val = _event_value(o, mags[mptr[c]], neg, sign_bit, full)
        if val < 0:
            return -3, no_pos, no_old
        mptr[c] += 1
        out[i] = val
    return 0, evs[:ne].copy(), olds


_DELTA_ERRORS = {
    -1: "delta bit stream is truncated",
    -2: "delta change counts do not match the bit stream (corrupt payload or wrong base)",
    -3: "delta step leaves the value grid (corrupt payload or wrong base)",
    -4: "delta bit stream has trailing bytes",
}


# --------------------------------------------------------------------------
# Chunk encoders
# --------------------------------------------------------------------------


def _check_array(arr: np.ndarray, dtype: str, what: str) -> None:
    want = DTYPES[dtype]
    if not isinstance(arr, np.ndarray) or arr.ndim != 1:
        raise CodecError(f"{what} must be a 1-D numpy array")
    if arr.dtype != want:
        raise CodecError(f"{what} has dtype {arr.dtype}, {dtype} needs raw bits as {np.dtype(want)}")


def _check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise CodecError(f"unknown dtype {dtype!r}, expected one of {sorted(DTYPES)}")


def encode_keyframe_chunk(new: np.ndarray, dtype: str, start: int, count: int) -> bytes:
    """Encode new[start:start+count] as a self-contained keyframe payload."""
    _check_dtype(dtype)
    _check_array(new, dtype, "new")
    body = _keyframe_body(new[start : start + count], dtype)
    return _header_bytes(MODE_KEYFRAME, dtype, start, count, new.shape[0], body) + body


def encode_delta_chunk(new: np.ndarray, old: np.ndarray, dtype: str, start: int, count: int) -> bytes:
    """Encode new[start:start+count] against old; falls back to a keyframe
    payload when most of the chunk changed and the keyframe is smaller."""
    _check_dtype(dtype)
    _check_array(new, dtype, "new")
    _check_array(old, dtype, "old")
    if new.shape != old.shape:
        raise CodecError(f"new has {new.shape[0]} elements but old has {old.shape[0]}")
    n_sl = np.ascontiguousarray(new[start : start + count])
    o_sl = np.ascontiguousarray(old[start : start + count])
    ne, ev_stream, ev_rank, ev_delta, counts = _scan(n_sl, o_sl, dtype)
    classes, k_gap, k_mag, nev, words, nbits = _encode_events(ev_stream, ev_rank, ev_delta, counts)
    table = bytearray()
    for c, kg, km, m in zip(classes.tolist(), k_gap.tolist(), k_mag.tolist(), nev.tolist()):
        table += bytes((c, kg, km)) + _uv_encode(m)
    stream = words.astype("<u8").tobytes()[: (nbits + 7) // 8]
    body = b"".join((bytes((_LANES,)), _uv_encode(len(classes)), bytes(table), stream))
    if ne > _TRY_KEYFRAME_FRACTION * count:
        key_body = _keyframe_body(n_sl, dtype)
        if len(key_body) < len(body):
            return _header_bytes(MODE_KEYFRAME, dtype, start, count, new.shape[0], key_body) + key_body
    return _header_bytes(MODE_DELTA, dtype, start, count, new.shape[0], body) + body


def encode_tensor(
    name: str,
    new: np.ndarray,
    old: np.ndarray | None,
    dtype: str,
    *,
    chunk_elems: int = 1 << 22,
) -> list[EncodedChunk]:
    """Encode one tensor (1-D raw-bit view) as independently decodable chunks.

    With ``old`` None every chunk is a keyframe; otherwise each chunk is a
    delta against ``old`` unless a keyframe is smaller. A zero-length tensor
    yields one empty chunk so the receiver still learns about the tensor.
    """
    _check_dtype(dtype)
    _check_array(new, dtype, "new")
    if old is not None:
        _check_array(old, dtype, "old")
        if old.shape != new.shape:
            raise CodecError(
                f"tensor {name!r}: new has {new.shape[0]} elements but old has {old.shape[0]}"
            )
    if not 1 <= chunk_elems <= _MAX_CHUNK:
        raise CodecError(f"chunk_elems must be in [1, 2**39], got {chunk_elems}")
    total = new.shape[0]
    chunks = []
    for start in range(0, max(total, 1), chunk_elems):
        count = min(chunk_elems, total - start)
        if old is None:
            payload = encode_keyframe_chunk(new, dtype, start, count)
        else:
            payload = encode_delta_chunk(new, old, dtype, start, count)
        chunks.append(EncodedChunk(name, start, count, payload))
    return chunks


# --------------------------------------------------------------------------
# Decoding
# --------------------------------------------------------------------------


def _parse_delta_table(body: bytes, dtype: str) -> tuple[np.ndarray, ...]:
    """Parse the delta class table; return (classes, k_gap, k_mag, events
    per class, offset of the bit stream)."""
    if len(body) < 1:
        raise CodecError("truncated delta body (lane count)")
    lanes = body[0]
    if lanes != _LANES:
        raise CodecError(f"delta uses {lanes} lanes, this codec decodes {_LANES}")
    nclass, pos = _uv_decode(body, 1, "delta class count")
    _, emask = _EXP_FIELD[dtype]
    if nclass > emask + 1:
        raise CodecError(f"delta lists {nclass} classes, {dtype} has {emask + 1}")
    rows = []
    for j in range(nclass):
        if pos + 3 > len(body):
            raise CodecError(f"truncated delta class table (entry {j} of {nclass})")
        c, kg, km = body[pos], body[pos + 1], body[pos + 2]
        nev, pos = _uv_decode(body, pos + 3, f"event count of class {c}")
        if c > emask or (rows and c <= rows[-1][0]) or kg > _RAW_BITS or (km > 32 and km != _KMAG_UNIT):
            raise CodecError(f"delta class table entry {j} is corrupt ({c}, {kg}, {km})")
        rows.append((c, kg, km, nev))
    table = np.array(rows, dtype=np.int64).reshape(-1, 4)
    return table[:, 0].copy(), table[:, 1].copy(), table[:, 2].copy(), table[:, 3].copy(), pos


_NO_WORDS = np.empty(0, dtype=np.uint64)


def _stream_words(stream: memoryview) -> np.ndarray:
    """The delta bit stream as native uint64 words plus _PAD zero bytes (one copy)."""
    nwords = (len(stream) + _PAD + 7) // 8
    words = np.zeros(nwords, dtype=np.uint64)
    words.view(np.uint8)[: len(stream)] = np.frombuffer(stream, dtype=np.uint8)
    if sys.byteorder != "little":
        words.byteswap(inplace=True)  # the stream is little-endian words
    return words


def _words16(src: np.ndarray) -> np.ndarray:
    """``src`` as 64-bit words for the word-parallel decode loop, or an empty
    array when the data is not 16-bit, not 8-byte aligned or not little endian."""
    n4 = src.shape[0] // 4
    if src.dtype.itemsize != 2 or sys.byteorder != "little" or n4 == 0 or src.ctypes.data % 8:
        return _NO_WORDS
    return src[: 4 * n4].view(np.uint64)


@dataclass(frozen=True)
class ChunkChanges:
    """What a delta chunk changed: flat tensor positions (ascending) and the bits
    there before and after. Lets receivers update hashes and undo logs in
    O(changes) instead of a pass over the tensor."""

    positions: np.ndarray  # int64
    old: np.ndarray  # raw bits, the tensor's dtype
    new: np.ndarray


def decode_chunk_into(payload: bytes, out: np.ndarray, old: np.ndarray | None) -> ChunkChanges | None:
    """Decode one chunk payload into ``out[start:start+count]``.

    Returns the changed elements for a delta chunk, None for a keyframe chunk
    (which rewrites its whole range).

    ``out`` is the full 1-D raw-bit destination tensor; ``old`` is the full
    previous tensor (needed for delta chunks, ignored for keyframes). Raises
    CodecError on malformed payloads or mismatched dtype/length/base.
    ``out`` may be the same array as ``old`` (in-place update).
    """
    hdr = parse_header(payload)
    _check_array(out, hdr.dtype, "out")
    if out.shape[0] != hdr.total:
        raise CodecError(f"payload is for a tensor of {hdr.total} elements, out has {out.shape[0]}")
    body = memoryview(payload)[hdr.body_offset :]
    if zlib.crc32(body) != hdr.crc:
        raise CodecError("payload body checksum mismatch (corrupt or truncated payload)")
    lo, hi = hdr.start, hdr.start + hdr.count
    if hdr.mode == MODE_KEYFRAME:
        _decode_keyframe(body, out[lo:hi], hdr.dtype, hdr.count)
        return None
    if old is None:
        raise CodecError("delta chunk needs the previous version of the tensor (old is None)")
    _check_array(old, hdr.dtype, "old")
    if old.shape[0] != hdr.total:
        raise CodecError(f"payload is for a tensor of {hdr.total} elements, old has {old.shape[0]}")
    classes, k_gap, k_mag, nev, pos = _parse_delta_table(body, hdr.dtype)
    if int(nev.sum()) > hdr.count:
        raise CodecError(f"delta claims {int(nev.sum())} changes in a chunk of {hdr.count}")
    stream = body[pos:]
    # Decode reads the byte stream as little-endian 64-bit words (same bit
    # order); astype gives a native, aligned copy on any host.
    words = _stream_words(stream)
    shift, emask = _EXP_FIELD[hdr.dtype]
    full = (1 << _BITS[hdr.dtype]) - 1
    sign_bit = 1 << (_BITS[hdr.dtype] - 1)
    dst = out[lo:hi]
    src = old[lo:hi]
    if np.may_share_memory(dst, src):
        if dst.ctypes.data != src.ctypes.data:
            # Overlapping but shifted views: copying old into out would
            # clobber old values the decode loop still has to read.
            src = src.copy()
            np.copyto(dst, src)
        # else: in-place update, out already holds old.
    else:
        np.copyto(dst, src)
    rc, positions, old_bits = _decode_delta(
        src, _words16(src), dst, shift, emask, sign_bit, full, classes, k_gap, k_mag, nev, words, 8 * len(stream)
    )
    if rc != 0:
        raise CodecError(f"{_DELTA_ERRORS.get(rc, f'delta decode error {rc}')} (chunk start {lo})")
    return ChunkChanges(positions + lo, old_bits, dst[positions])


def decode_tensor(chunks: list[EncodedChunk] | list[bytes], old: np.ndarray | None, dtype: str) -> np.ndarray:
    """Convenience: decode all chunks of one tensor into a new array."""
    _check_dtype(dtype)
    payloads = [c.payload if isinstance(c, EncodedChunk) else c for c in chunks]
    if not payloads:
        raise CodecError("no chunks to decode")
    total = parse_header(payloads[0]).total
    out = np.empty(total, dtype=DTYPES[dtype])
    for p in payloads:
        decode_chunk_into(p, out, old)
    return out
