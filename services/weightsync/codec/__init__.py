"""Lossless delta codec for model weights travelling between regions.

The public API. The payload format and why the delta coding looks the way it
does are described in format.py; the numba kernels are in kernels.py.
"""

from __future__ import annotations

import sys
import zlib
from dataclasses import dataclass

import numpy as np

from services.weightsync.codec.format import (
    _BITS,
    _EXP_FIELD,
    _MAX_CHUNK,
    _PAD,
    DTYPES,
    MODE_DELTA,
    MODE_KEYFRAME,
    ChunkHeader,
    CodecError,
    EncodedChunk,
    _decode_keyframe,
    _delta_body,
    _header_bytes,
    _keyframe_body,
    _parse_delta_table,
    parse_header,
)
from services.weightsync.codec.kernels import _DELTA_ERRORS, _decode_delta, _encode_events, _scan_changes

__all__ = [
    "DTYPES",
    "MODE_KEYFRAME",
    "MODE_DELTA",
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

# If more than this fraction of a chunk changed, also try a keyframe and keep
# the smaller; below it a delta is always far smaller, so we skip the work.
_TRY_KEYFRAME_FRACTION = 0.2


def _words16(src: np.ndarray) -> np.ndarray | None:
    """``src`` as 64-bit words for the word-parallel kernels (see kernels.py),
    or None when the data is not 16-bit, not 8-byte aligned or not little endian."""
    n4 = src.shape[0] // 4
    if src.dtype.itemsize != 2 or sys.byteorder != "little" or n4 == 0 or src.ctypes.data % 8:
        return None
    return src[: 4 * n4].view(np.uint64)


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


def _scan(new: np.ndarray, old: np.ndarray, dtype: str):
    """Run the scan kernel, word-parallel when both arrays allow it."""
    shift, emask = _EXP_FIELD[dtype]
    full = (1 << _BITS[dtype]) - 1
    sign_bit = 1 << (_BITS[dtype] - 1)
    new64, old64 = _words16(new), _words16(old)
    if new64 is None or old64 is None:
        new64 = old64 = None
    return _scan_changes(new, old, new64, old64, shift, emask, sign_bit, full)


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
    body = _delta_body(classes, k_gap, k_mag, nev, words, nbits)
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


def _stream_words(stream: memoryview) -> np.ndarray:
    """The delta bit stream as native uint64 words plus _PAD zero bytes (one copy)."""
    nwords = (len(stream) + _PAD + 7) // 8
    words = np.zeros(nwords, dtype=np.uint64)
    words.view(np.uint8)[: len(stream)] = np.frombuffer(stream, dtype=np.uint8)
    if sys.byteorder != "little":
        words.byteswap(inplace=True)  # the stream is little-endian words
    return words


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
