"""Lossless delta codec for model weights travelling between regions.

The public API. The payload format and why the delta coding looks the way it
does are described in format.py; the numba kernels are in kernels.py.
"""

from __future__ import annotations

import sys
import zlib
from collections.abc import Sequence

import numpy as np

from services.weightsync.codec.format import (
    _uv_decode,
    _BITS,
    _EXP_FIELD,
    _MAX_CHUNK,
    _PAD,
    _VERSION,
    _VERSION_2,
    _VERSION_3,
    _INDEX_FRACTION,
    _FLAG_INDEX,
    DTYPES,
    MODE_DELTA,
    MODE_KEYFRAME,
    ChunkChanges,
    ChunkHeader,
    ChunkIndex,
    CodecError,
    EncodedChunk,
    _decode_keyframe,
    _delta2_body,
    _delta3_body,
    _delta_body,
    _header_bytes,
    _keyframe_body,
    _parse_delta_table,
    parse_header,
)
from services.weightsync.codec.kernels import _DELTA_ERRORS, _decode_chunk1, _decode_delta, _encode_events, _scan_changes
from services.weightsync.codec.context_kernels import (
    _HEAD_ERRORS,
    _V2_ERRORS,
    _context_features,
    _decode_chunk2,
    _diff_positions,
    _encode_v2,
)
from services.weightsync.codec.index_kernels import (
    _HEAD3_ERRORS,
    _V3_ERRORS,
    _build_index,
    _class_histogram,
    _context3,
    _decode_chunk3,
    _encode_v3,
    _index_fingerprint,
    _update_index,
)

__all__ = [
    "DTYPES",
    "MODE_KEYFRAME",
    "MODE_DELTA",
    "CodecError",
    "EncodedChunk",
    "encode_tensor",
    "encode_keyframe_chunk",
    "encode_delta_chunk",
    "encode_chunk",
    "FORMAT_VERSIONS",
    "decode_chunk_into",
    "ChunkChanges",
    "ChunkIndex",
    "build_index",
    "update_index",
    "next_index",
    "ensure_index",
    "index_threshold",
    "decode_tensor",
    "parse_header",
    "ChunkHeader",
]

# If more than this fraction of a chunk changed, also try a keyframe and keep
# the smaller; below it a delta is always far smaller, so we skip the work.
_TRY_KEYFRAME_FRACTION = 0.2

#: Format versions the encoders write (``format_version=``); the decoder reads all.
#: The encoders write version 1 unless asked for another: versions 2 and 3 pay
#: off only when the caller keeps and passes each chunk's context (2, 3) and
#: position index (3) from version to version (see format.py).
FORMAT_VERSIONS = (_VERSION, _VERSION_2, _VERSION_3)


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


# Comparing an array's dtype with a dtype is a few times cheaper than with a
# scalar type, and this check runs twice per chunk decoded.
_NP_DTYPES = {name: np.dtype(t) for name, t in DTYPES.items()}


def _check_array(arr: np.ndarray, dtype: str, what: str) -> None:
    want = _NP_DTYPES[dtype]
    if not isinstance(arr, np.ndarray) or arr.ndim != 1:
        raise CodecError(f"{what} must be a 1-D numpy array")
    if arr.dtype != want:
        raise CodecError(f"{what} has dtype {arr.dtype}, {dtype} needs raw bits as {want}")


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


def encode_keyframe_chunk(new: np.ndarray, dtype: str, start: int, count: int, *, format_version: int = _VERSION) -> bytes:
    """Encode new[start:start+count] as a self-contained keyframe payload
    (the same body in both format versions)."""
    _check_dtype(dtype)
    _check_array(new, dtype, "new")
    if format_version not in FORMAT_VERSIONS:
        raise CodecError(f"format_version must be one of {FORMAT_VERSIONS}, got {format_version}")
    body = _keyframe_body(new[start : start + count], dtype)
    return _header_bytes(MODE_KEYFRAME, dtype, start, count, new.shape[0], body, format_version) + body


_NO_INT = np.empty(0, np.int64)
_NO_BOOL = np.empty(0, np.bool_)
_NO_BITS = {name: np.empty(0, t) for name, t in DTYPES.items()}  # no context's bits


def _read_only(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


# "No index", read-only like every real index's arrays (see _make_index): numba compiles
# one kernel per argument type, read-only flag included, and the format-3 decoder is the
# slowest of them to compile (about 10 s per dtype from an empty cache).
_NO_INDEX = (_read_only(np.empty(0, np.int64)), _read_only(np.empty(0, np.uint8)), _read_only(np.zeros(256, np.int64)))


def _checked_context(context: ChunkChanges | None, dtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The previous delta's changes (positions, old bits, new bits) as contiguous arrays,
    checked against ``dtype``; None when there is no context or it is empty (the chunk is
    then coded, or decoded, without one)."""
    if context is None:
        return None
    if not isinstance(context, ChunkChanges):
        raise CodecError(f"context must be the ChunkChanges of the previous delta, got {type(context).__name__}")
    if context.positions.shape[0] == 0:
        return None
    raw = DTYPES[dtype]
    if context.old.dtype != raw or context.new.dtype != raw:
        raise CodecError(f"context bits have dtype {context.old.dtype}/{context.new.dtype}, {dtype} needs {np.dtype(raw)}")
    if not context.positions.shape == context.old.shape == context.new.shape:
        raise CodecError("context positions, old and new bits differ in length")
    return np.ascontiguousarray(context.positions, dtype=np.int64), np.ascontiguousarray(context.old), np.ascontiguousarray(context.new)


def _context_arrays(context: ChunkChanges | None, dtype: str, start: int, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int] | None:
    """A context change list as the kernels take it (chunk-relative positions,
    exponent group, step sign, fingerprint), or None when there is no context
    or it is empty (both code the chunk without one)."""
    checked = _checked_context(context, dtype)
    if checked is None:
        return None
    pos, old, new = checked
    shift, emask = _EXP_FIELD[dtype]
    st, rel, grp, neg, fingerprint = _context_features(pos, old, new, start, count, shift, emask, 1 << (_BITS[dtype] - 1), (1 << _BITS[dtype]) - 1)
    if st != 0:
        raise CodecError(
            f"context positions are not ascending inside this chunk [{start}, {start + count}): pass the changes of the previous delta for the same chunk range"
        )
    return rel, grp, neg, int(fingerprint)


# --------------------------------------------------------------------------
# Position index (format 3)
# --------------------------------------------------------------------------


def index_threshold(values: np.ndarray, dtype: str, *, fraction: float = _INDEX_FRACTION) -> int:
    """The threshold rule of format 3: the largest ``t`` such that the elements
    of ``values`` (one chunk's raw bits) whose exponent field is below ``t``
    are at most ``fraction`` of them (0 when the zero class alone is more).
    Deterministic in the values; a payload names the threshold it used."""
    _check_dtype(dtype)
    shift, emask = _EXP_FIELD[dtype]
    cum = np.cumsum(_class_histogram(np.ascontiguousarray(values), shift, emask)[: emask + 1])
    return int(np.searchsorted(cum, fraction * values.shape[0], side="right"))


def _make_index(dtype: str, start: int, count: int, t: int, pos: np.ndarray, cls: np.ndarray, counts: np.ndarray, h, fp: int | None = None) -> ChunkIndex:
    for a in (pos, cls, counts):
        if a.flags.writeable:  # an array kept from the index before is read-only already
            a.flags.writeable = False  # shared between successive indexes
    h = int(h)
    if fp is None:
        fp = int(_index_fingerprint(np.uint64(h), pos.shape[0], t))
    return ChunkIndex(dtype, start, count, t, pos, cls, counts, h, int(fp))


def build_index(values: np.ndarray, dtype: str, start: int, count: int, threshold: int | None = None, *, fraction: float = _INDEX_FRACTION) -> ChunkIndex:
    """The position index of ``values[start:start+count]`` (``values``: the
    full 1-D raw-bit tensor) for ``threshold`` (None: :func:`index_threshold`
    of the chunk). One pass over the chunk: do it once (first use, after a
    keyframe), then keep it current with the change lists."""
    _check_dtype(dtype)
    _check_array(values, dtype, "values")
    if start < 0 or count < 0 or start + count > values.shape[0]:
        raise CodecError(f"chunk [{start}, {start + count}) is outside a tensor of {values.shape[0]} elements")
    sl = np.ascontiguousarray(values[start : start + count])
    shift, emask = _EXP_FIELD[dtype]
    t = index_threshold(sl, dtype, fraction=fraction) if threshold is None else int(threshold)
    if not 0 <= t <= emask + 1:
        raise CodecError(f"index threshold {t} is outside [0, {emask + 1}] for {dtype}")
    pos, cls, counts, h = _build_index(sl, shift, emask, t)
    return _make_index(dtype, start, count, t, pos, cls, counts, h)


def _check_index(index: ChunkIndex, dtype: str, start: int, count: int) -> None:
    if not isinstance(index, ChunkIndex):
        raise CodecError(f"index must be a ChunkIndex (see build_index), got {type(index).__name__}")
    if (index.dtype, index.start, index.count) != (dtype, start, count):
        raise CodecError(
            f"position index is for {index.dtype} chunk [{index.start}, {index.start + index.count}), "
            f"not {dtype} chunk [{start}, {start + count}): pass the index of this chunk"
        )


def _index_after(index: ChunkIndex, rel: np.ndarray, old: np.ndarray, new: np.ndarray) -> ChunkIndex:
    shift, emask = _EXP_FIELD[index.dtype]
    st, pos, cls, counts, h, fp = _update_index(
        index.positions, index.classes, index.class_counts, np.uint64(index.entry_hash), index.threshold, rel, old, new, shift, emask
    )
    if st != 0:
        raise CodecError(
            f"position index of chunk [{index.start}, {index.start + index.count}) does not describe the old values of these changes (stale index or wrong base)"
        )
    if pos is index.positions and cls is index.classes and counts is index.class_counts:
        return index
    return _make_index(index.dtype, index.start, index.count, index.threshold, pos, cls, counts, h, fp)


def update_index(index: ChunkIndex, changes: ChunkChanges) -> ChunkIndex:
    """The index after a delta's changes (the ``ChunkChanges`` of this chunk,
    any format): O(index + changes), no pass over the chunk. Raises
    CodecError when the index does not describe the changes' old values."""
    _check_index(index, index.dtype, index.start, index.count)
    raw = DTYPES[index.dtype]
    if changes.old.dtype != raw or changes.new.dtype != raw:
        raise CodecError(f"change bits have dtype {changes.old.dtype}, {index.dtype} needs {np.dtype(raw)}")
    rel = np.ascontiguousarray(changes.positions, dtype=np.int64) - index.start
    if rel.shape[0] and (rel[0] < 0 or rel[-1] >= index.count or np.any(np.diff(rel) <= 0)):
        raise CodecError(f"change positions are not ascending inside chunk [{index.start}, {index.start + index.count})")
    return _index_after(index, rel, np.ascontiguousarray(changes.old), np.ascontiguousarray(changes.new))


def next_index(index: ChunkIndex | None, changes: ChunkChanges) -> ChunkIndex | None:
    """The position index of a chunk after a delta chunk decoded over ``index`` (what
    :func:`ensure_index` gave) made ``changes``: the one the decode left (format 3), else
    ``index`` moved by the changes (a format-1 payload), else None (none was held)."""
    if changes.index is not None or index is None:
        return changes.index
    return update_index(index, changes)


def _payload_index(payload: bytes, hdr: ChunkHeader) -> tuple[int, int, int] | None:
    """(threshold, entry count, fingerprint) a version-3 delta is coded over, or None."""
    if hdr.version != _VERSION_3 or hdr.mode != MODE_DELTA:
        return None
    pos = hdr.body_offset
    if pos >= len(payload):
        raise CodecError("truncated delta body (flags)")
    flags = payload[pos]
    if not flags & _FLAG_INDEX:
        return None
    pos += 1
    if flags & 1:
        _, pos = _uv_decode(payload, pos, "context count")
        pos += 4
    t, pos = _uv_decode(payload, pos, "index threshold")
    m, pos = _uv_decode(payload, pos, "index count")
    if pos + 4 > len(payload):
        raise CodecError("truncated payload while reading the index fingerprint")
    return t, m, int.from_bytes(payload[pos : pos + 4], "little")


def ensure_index(payload: bytes, values: np.ndarray, index: ChunkIndex | None, *, header: ChunkHeader | None = None) -> ChunkIndex | None:
    """The index a payload needs for decoding against ``values`` (the
    receiver's current full tensor): ``index`` itself when it is the one the
    payload names (or the payload needs none and ``index`` is of its chunk; of another
    chunk: None), else one built from ``values``
    with the payload's threshold (one pass: first use, after a keyframe or a
    mismatch). A receiver calls this before ``decode_chunk_into``.
    ``header``: ``parse_header(payload)`` when the caller has it already."""
    hdr = header if header is not None else parse_header(payload)
    want = _payload_index(payload, hdr)
    same_chunk = index is not None and (index.dtype, index.start, index.count) == (hdr.dtype, hdr.start, hdr.count)
    if want is None:
        # A payload coded without an index decodes without one; an index of another
        # chunk (the origin now cuts its tensors otherwise) is dropped, not carried on.
        return index if same_chunk else None
    if same_chunk and (index.threshold, index.positions.shape[0], index.fingerprint) == want:
        return index
    if values.shape[0] != hdr.total:
        raise CodecError(f"payload is for a tensor of {hdr.total} elements, values has {values.shape[0]}")
    _, emask = _EXP_FIELD[hdr.dtype]
    if want[0] > emask + 1:
        raise CodecError(f"payload names index threshold {want[0]}, {hdr.dtype} has {emask + 1} classes")
    return build_index(values, hdr.dtype, hdr.start, hdr.count, want[0])


def _encode_delta_v3(
    n_sl: np.ndarray, o_sl: np.ndarray, pos: np.ndarray, dtype: str, ctx: tuple | None, index: ChunkIndex
) -> tuple[bytes, np.ndarray, np.ndarray]:
    """Version-3 delta body of a chunk whose changes are at ``pos`` over
    ``index`` (the index of ``o_sl``) and against ``ctx`` (from
    _context3_arrays) or without; also the changes' old and new bits."""
    shift, emask = _EXP_FIELD[dtype]
    ctx_pos, ctx_neg = (ctx[0], ctx[1]) if ctx is not None else (_NO_INT, _NO_BOOL)
    use_idx = index.positions.shape[0] > 0
    st, n_out, k_out, rows, mrows, words, nbits, olds, news = _encode_v3(
        n_sl, o_sl, pos, ctx_pos, ctx_neg, use_idx, index.positions, index.classes, index.class_counts, index.threshold,
        shift, emask, 1 << (_BITS[dtype] - 1), (1 << _BITS[dtype]) - 1,
    )  # fmt: skip
    if st != 0:
        raise CodecError(
            f"position index of chunk [{index.start}, {index.start + index.count}) does not describe old (stale index): pass the index of the old version"
        )
    used = use_idx and int(n_out) < pos.shape[0]  # no change in the index: the receiver needs none
    ctx_head = (ctx[0].shape[0], ctx[2]) if ctx is not None else None
    idx_head = (index.threshold, index.positions.shape[0], index.fingerprint) if used else None
    return _delta3_body(ctx_head, idx_head, int(n_out), int(k_out), rows, mrows, words, int(nbits)), olds, news


def _context3_arrays(context: ChunkChanges | None, dtype: str, start: int, count: int) -> tuple[np.ndarray, np.ndarray, int] | None:
    """A context change list as the version-3 kernels take it (chunk-relative
    positions, step signs, version-3 fingerprint), or None when there is none
    or it is empty."""
    checked = _checked_context(context, dtype)
    if checked is None:
        return None
    st, rel, neg, fingerprint = _context3(
        *checked,
        start, count, 1 << (_BITS[dtype] - 1), (1 << _BITS[dtype]) - 1,
    )  # fmt: skip
    if st != 0:
        raise CodecError(
            f"context positions are not ascending inside this chunk [{start}, {start + count}): pass the changes of the previous delta for the same chunk range"
        )
    return rel, neg, int(fingerprint)


def _encode_delta_v1(n_sl: np.ndarray, o_sl: np.ndarray, dtype: str) -> tuple[bytes, int]:
    """Version-1 delta body of a chunk and its change count."""
    ne, ev_stream, ev_rank, ev_delta, counts = _scan(n_sl, o_sl, dtype)
    classes, k_gap, k_mag, nev, words, nbits = _encode_events(ev_stream, ev_rank, ev_delta, counts)
    return _delta_body(classes, k_gap, k_mag, nev, words, nbits), ne


def _encode_delta_v2(
    n_sl: np.ndarray, o_sl: np.ndarray, pos: np.ndarray, dtype: str, ctx: tuple[np.ndarray, ...] | None
) -> tuple[bytes, np.ndarray, np.ndarray]:
    """Version-2 delta body of a chunk whose changes are at ``pos``, coded
    against ``ctx`` (from _context_arrays) or without; also the changes' old
    and new bits."""
    shift, emask = _EXP_FIELD[dtype]
    if ctx is None:
        ctx_count, fingerprint = None, 0
        ctx = (_NO_INT, _NO_INT, _NO_BOOL, 0)
    else:
        ctx_count, fingerprint = ctx[0].shape[0], ctx[3]
    n_new, k_new, rows, mrows, words, nbits, _, olds, news = _encode_v2(
        n_sl, o_sl, pos, ctx[0], ctx[1], ctx[2], shift, emask, 1 << (_BITS[dtype] - 1), (1 << _BITS[dtype]) - 1
    )
    return _delta2_body(ctx_count, fingerprint, int(n_new), int(k_new), rows, mrows, words, int(nbits)), olds, news


def encode_chunk(
    new: np.ndarray,
    old: np.ndarray,
    dtype: str,
    start: int,
    count: int,
    *,
    context: ChunkChanges | None = None,
    index: ChunkIndex | None = None,
    format_version: int = _VERSION,
    name: str = "",
) -> EncodedChunk:
    """Encode new[start:start+count] against old as one chunk (a delta, or a
    keyframe when most of the chunk changed and that is smaller).

    ``context``: for format versions 2 and 3, the changes of the previous delta of
    this chunk range (the ``changes`` of the chunk encoded for the previous
    version, which is also what ``decode_chunk_into`` returned to every
    receiver); None or empty writes a delta that needs no context. The
    returned chunk's ``changes`` are the context for the next version (None
    for a keyframe chunk).

    ``index``: for format version 3, the position index of ``old``'s chunk
    (the ``index`` of the chunk encoded for the previous version; None builds
    one from ``old`` with :func:`index_threshold`, a pass). The returned
    chunk's ``index`` is the one for the next version."""
    _check_dtype(dtype)
    _check_array(new, dtype, "new")
    _check_array(old, dtype, "old")
    if new.shape != old.shape:
        raise CodecError(f"new has {new.shape[0]} elements but old has {old.shape[0]}")
    if format_version not in FORMAT_VERSIONS:
        raise CodecError(f"format_version must be one of {FORMAT_VERSIONS}, got {format_version}")
    if index is not None and format_version != _VERSION_3:
        raise CodecError(f"format version {format_version} has no position index; pass format_version=3")
    n_sl = np.ascontiguousarray(new[start : start + count])
    o_sl = np.ascontiguousarray(old[start : start + count])
    changes = None
    new_index = None
    if format_version == _VERSION:
        if context is not None:
            raise CodecError("format version 1 has no context; pass format_version=2 or 3")
        body, ne = _encode_delta_v1(n_sl, o_sl, dtype)
    else:
        ctx = _context_arrays(context, dtype, start, count) if format_version == _VERSION_2 else None
        n64, o64 = _words16(n_sl), _words16(o_sl)
        if n64 is None or o64 is None:
            n64 = o64 = None
        pos = _diff_positions(n_sl, o_sl, n64, o64)
        if format_version == _VERSION_3:
            if index is None:
                index = build_index(old, dtype, start, count)
            _check_index(index, dtype, start, count)
            body, olds, news = _encode_delta_v3(n_sl, o_sl, pos, dtype, _context3_arrays(context, dtype, start, count), index)
            new_index = _index_after(index, pos, olds, news)
        else:
            body, olds, news = _encode_delta_v2(n_sl, o_sl, pos, dtype, None)
            if ctx is not None:
                # The context does not pay for itself on every chunk (e.g. random
                # changes: its table costs more than it saves); coding is O(changes),
                # so try both and keep the smaller.
                with_ctx = _encode_delta_v2(n_sl, o_sl, pos, dtype, ctx)[0]
                if len(with_ctx) < len(body):
                    body = with_ctx
        ne = pos.shape[0]
        changes = ChunkChanges(pos + start, olds, news, new_index)
    if ne > _TRY_KEYFRAME_FRACTION * count:
        key_body = _keyframe_body(n_sl, dtype)
        if len(key_body) < len(body):
            payload = _header_bytes(MODE_KEYFRAME, dtype, start, count, new.shape[0], key_body, format_version)
            return EncodedChunk(name, start, count, payload + key_body, None, new_index)
    payload = _header_bytes(MODE_DELTA, dtype, start, count, new.shape[0], body, format_version) + body
    return EncodedChunk(name, start, count, payload, changes, new_index)


def encode_delta_chunk(
    new: np.ndarray,
    old: np.ndarray,
    dtype: str,
    start: int,
    count: int,
    *,
    context: ChunkChanges | None = None,
    index: ChunkIndex | None = None,
    format_version: int = _VERSION,
) -> bytes:
    """Encode new[start:start+count] against old; falls back to a keyframe
    payload when most of the chunk changed and the keyframe is smaller. See
    :func:`encode_chunk` (which also returns the chunk's changes and index)."""
    return encode_chunk(new, old, dtype, start, count, context=context, index=index, format_version=format_version).payload


def encode_tensor(
    name: str,
    new: np.ndarray,
    old: np.ndarray | None,
    dtype: str,
    *,
    chunk_elems: int = 1 << 22,
    context: Sequence[ChunkChanges | None] | None = None,
    index: Sequence[ChunkIndex | None] | None = None,
    format_version: int = _VERSION,
) -> list[EncodedChunk]:
    """Encode one tensor (1-D raw-bit view) as independently decodable chunks.

    With ``old`` None every chunk is a keyframe; otherwise each chunk is a
    delta against ``old`` unless a keyframe is smaller. A zero-length tensor
    yields one empty chunk so the receiver still learns about the tensor.

    ``context`` (format version 2): one entry per chunk, the ``changes`` of the
    same chunk of the previous version's encoding (``[c.changes for c in
    previous_chunks]``, same ``chunk_elems``); None (or a None entry) codes
    without context. Each returned chunk's ``changes`` is the next context.

    ``index`` (format version 3): one entry per chunk, the ``index`` of the
    same chunk of the previous version's encoding; None (or a None entry)
    builds it from ``old`` (a pass). Each returned chunk's ``index`` is the
    next one (for keyframe chunks too).
    """
    _check_dtype(dtype)
    _check_array(new, dtype, "new")
    if old is not None:
        _check_array(old, dtype, "old")
        if old.shape != new.shape:
            raise CodecError(f"tensor {name!r}: new has {new.shape[0]} elements but old has {old.shape[0]}")
    if not 1 <= chunk_elems <= _MAX_CHUNK:
        raise CodecError(f"chunk_elems must be in [1, 2**39], got {chunk_elems}")
    total = new.shape[0]
    starts = range(0, max(total, 1), chunk_elems)
    if context is not None and len(context) != len(starts):
        raise CodecError(f"tensor {name!r}: context has {len(context)} entries for {len(starts)} chunks")
    if index is not None and len(index) != len(starts):
        raise CodecError(f"tensor {name!r}: index has {len(index)} entries for {len(starts)} chunks")
    chunks = []
    for j, start in enumerate(starts):
        count = min(chunk_elems, total - start)
        if old is None:
            payload = encode_keyframe_chunk(new, dtype, start, count, format_version=format_version)
            idx = build_index(new, dtype, start, count) if format_version == _VERSION_3 else None
            chunks.append(EncodedChunk(name, start, count, payload, None, idx))
        else:
            ctx = context[j] if context is not None else None
            idx = index[j] if index is not None else None
            chunks.append(encode_chunk(new, old, dtype, start, count, context=ctx, index=idx, format_version=format_version, name=name))
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


def decode_chunk_into(
    payload: bytes,
    out: np.ndarray,
    old: np.ndarray | None,
    *,
    context: ChunkChanges | None = None,
    index: ChunkIndex | None = None,
    header: ChunkHeader | None = None,
    checksum: bool = True,
) -> ChunkChanges | None:
    """Decode one chunk payload into ``out[start:start+count]``.

    Returns the changed elements for a delta chunk, None for a keyframe chunk
    (which rewrites its whole range).

    ``out`` is the full 1-D raw-bit destination tensor; ``old`` is the full
    previous tensor (needed for delta chunks, ignored for keyframes). Raises
    CodecError on malformed payloads or mismatched dtype/length/base.
    ``out`` may be the same array as ``old`` (in-place update): a version-2
    delta then reads and writes only the changed elements.

    ``context``: for a version-2 delta coded against a context, the changes
    this call returned for the same chunk of the previous version (None if
    that was a keyframe chunk); a missing or different context raises
    CodecError. Ignored by payloads that need none.

    ``index``: for a version-3 delta, the position index of ``old``'s chunk
    (see :func:`ensure_index`); a payload coded over an index refuses a
    missing or different one with CodecError before writing anything. When
    given, the returned changes carry the updated index (``.index``) for
    the next version.

    ``header``: ``parse_header(payload)`` when the caller has it already (a
    receiver decoding many small chunks pays for each parse).

    ``checksum=False`` skips the body's CRC: for a payload already checked
    against a stronger digest (a manifest's sha256). A malformed body is
    refused with CodecError either way.
    """
    hdr = header if header is not None else parse_header(payload)
    _check_array(out, hdr.dtype, "out")
    if out.shape[0] != hdr.total:
        raise CodecError(f"payload is for a tensor of {hdr.total} elements, out has {out.shape[0]}")
    body = memoryview(payload)[hdr.body_offset :]
    if checksum and zlib.crc32(body) != hdr.crc:
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
    if hdr.version == _VERSION_2:
        return _decode_delta2(hdr, body, out, old, context)
    if hdr.version == _VERSION_3:
        return _decode_delta3(hdr, body, out, old, context, index)
    return _decode_delta1(hdr, body, out, old)


def _decode_delta1(hdr: ChunkHeader, body: memoryview, out: np.ndarray, old: np.ndarray) -> ChunkChanges:
    """Decode a version-1 delta chunk (see decode_chunk_into) in one kernel
    call (_decode_chunk1: the class table, the stream and the changes), as
    versions 2 and 3 do; a head the kernel refuses goes through the parser
    here (_decode_delta1_steps), which names the fault."""
    lo, hi = hdr.start, hdr.start + hdr.count
    if out is old:
        dst = src = out[lo:hi]  # in place: out already holds old
        copy = False
    else:
        dst, src = out[lo:hi], old[lo:hi]
        if np.may_share_memory(dst, src):
            return _decode_delta1_steps(hdr, body, out, old)  # overlapping views: _base_into's care
        copy = True
    shift, emask = _EXP_FIELD[hdr.dtype]
    rc, positions, olds, news = _decode_chunk1(
        np.frombuffer(body, dtype=np.uint8), src, dst, copy, lo, hdr.count, shift, emask, 1 << (_BITS[hdr.dtype] - 1), (1 << _BITS[hdr.dtype]) - 1
    )
    if rc == 0:
        return ChunkChanges(positions, olds, news)
    if rc == 1:  # nothing written: the step by step decode raises the head's own error
        return _decode_delta1_steps(hdr, body, out, old)
    raise CodecError(f"{_DELTA_ERRORS.get(rc, f'delta decode error {rc}')} (chunk start {lo})")


def _decode_delta1_steps(hdr: ChunkHeader, body: memoryview, out: np.ndarray, old: np.ndarray) -> ChunkChanges:
    """_decode_delta1 step by step from Python: format.py's table parser (and
    its errors), the stream words, the base copy and the decode kernel."""
    lo, hi = hdr.start, hdr.start + hdr.count
    classes, k_gap, k_mag, nev, pos = _parse_delta_table(body, hdr.dtype)
    if int(nev.sum()) > hdr.count:
        raise CodecError(f"delta claims {int(nev.sum())} changes in a chunk of {hdr.count}")
    stream = body[pos:]
    words = _stream_words(stream)
    shift, emask = _EXP_FIELD[hdr.dtype]
    full = (1 << _BITS[hdr.dtype]) - 1
    sign_bit = 1 << (_BITS[hdr.dtype] - 1)
    dst, src = _base_into(out[lo:hi], old[lo:hi])
    rc, positions, old_bits = _decode_delta(src, _words16(src), dst, shift, emask, sign_bit, full, classes, k_gap, k_mag, nev, words, 8 * len(stream))
    if rc != 0:
        raise CodecError(f"{_DELTA_ERRORS.get(rc, f'delta decode error {rc}')} (chunk start {lo})")
    return ChunkChanges(positions + lo, old_bits, dst[positions])


def _base_into(dst: np.ndarray, src: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Make ``dst`` hold the base ``src`` (nothing to do in place); returns
    (dst, the array to read the base from)."""
    if np.may_share_memory(dst, src):
        if dst.ctypes.data != src.ctypes.data:
            # Overlapping but shifted views: copying old into out would
            # clobber old values the decode loop still has to read.
            src = src.copy()
            np.copyto(dst, src)
        # else: in-place update, out already holds old.
    else:
        np.copyto(dst, src)
    return dst, src


def _decoder_context(hdr: ChunkHeader, context: ChunkChanges | None) -> tuple[bool, np.ndarray, np.ndarray, np.ndarray]:
    """(has context, positions, old bits, new bits) of the previous delta's changes, checked."""
    checked = _checked_context(context, hdr.dtype)
    if checked is None:
        return False, _NO_INT, _NO_BITS[hdr.dtype], _NO_BITS[hdr.dtype]
    return (True, *checked)


def _raise_context_error(rc: int, lo: int, hi: int, ctx_count: int, fingerprint: int, context: ChunkChanges | None) -> None:
    """Raises the CodecError of a context failure code (-20..-22) of formats 2 and 3."""
    if rc == -20:
        raise CodecError(f"delta chunk [{lo}, {hi}) is coded against the previous delta's changes of this chunk (context), and none was given")
    if rc == -21:
        raise CodecError(f"context positions are not ascending inside this chunk [{lo}, {hi}): pass the changes of the previous delta for the same chunk range")
    if rc == -22:
        given = context.positions.shape[0] if context is not None else 0
        raise CodecError(
            f"delta chunk [{lo}, {hi}) was coded against a different context ({ctx_count} changes, "
            f"fingerprint {ctx_count and fingerprint:08x}; given {given} changes): pass the "
            "changes of the previous version's delta for this chunk"
        )


def _decode_delta2(hdr: ChunkHeader, body: memoryview, out: np.ndarray, old: np.ndarray, context: ChunkChanges | None) -> ChunkChanges:
    """Decode a version-2 delta chunk (see decode_chunk_into): one kernel call,
    since per-call overhead is a real share of applying a sparse version."""
    lo, hi = hdr.start, hdr.start + hdr.count
    has_ctx, ctx_pos, ctx_old, ctx_new = _decoder_context(hdr, context)
    if out is old:
        dst = src = out[lo:hi]  # in place: reads and writes only the changed elements
    else:
        dst, src = _base_into(out[lo:hi], old[lo:hi])
    shift, emask = _EXP_FIELD[hdr.dtype]
    rc, ctx_count, fingerprint, positions, olds, news = _decode_chunk2(
        np.frombuffer(body, dtype=np.uint8), src, dst, lo, hdr.count, has_ctx, ctx_pos, ctx_old, ctx_new,
        shift, emask, 1 << (_BITS[hdr.dtype] - 1), (1 << _BITS[hdr.dtype]) - 1,
    )  # fmt: skip
    if rc == 0:
        return ChunkChanges(positions, olds, news)
    _raise_context_error(rc, lo, hi, ctx_count, fingerprint, context)
    msg = _HEAD_ERRORS.get(rc) or _V2_ERRORS.get(rc, f"delta decode error {rc}")
    raise CodecError(f"{msg} (chunk start {lo})")


def _decode_delta3(hdr: ChunkHeader, body: memoryview, out: np.ndarray, old: np.ndarray, context: ChunkChanges | None, index: ChunkIndex | None) -> ChunkChanges:
    """Decode a version-3 delta chunk (see decode_chunk_into): one kernel call
    that also updates the index."""
    lo, hi = hdr.start, hdr.start + hdr.count
    has_ctx, ctx_pos, ctx_old, ctx_new = _decoder_context(hdr, context)
    if index is None:
        has_idx, (ipos, icls, icounts), ih, ifp, it = False, _NO_INDEX, np.uint64(0), 0, 0
    else:
        _check_index(index, hdr.dtype, lo, hdr.count)
        has_idx, ipos, icls, icounts = True, index.positions, index.classes, index.class_counts
        ih, ifp, it = np.uint64(index.entry_hash), index.fingerprint, index.threshold
    if out is old:
        dst = src = out[lo:hi]  # in place: reads and writes only the changed elements
    else:
        dst, src = _base_into(out[lo:hi], old[lo:hi])
    shift, emask = _EXP_FIELD[hdr.dtype]
    rc, ctx_count, cfp, t, icount, pfp, positions, olds, news, npos, ncls, ncounts, nh, nfp = _decode_chunk3(
        np.frombuffer(body, dtype=np.uint8), src, dst, lo, hdr.count, has_ctx, ctx_pos, ctx_old, ctx_new,
        has_idx, ipos, icls, icounts, ih, ifp, it, shift, emask, 1 << (_BITS[hdr.dtype] - 1), (1 << _BITS[hdr.dtype]) - 1,
    )  # fmt: skip
    if rc == 0:
        new_index = None
        if index is not None:
            same = npos is index.positions and ncls is index.classes and ncounts is index.class_counts
            new_index = index if same else _make_index(hdr.dtype, lo, hdr.count, index.threshold, npos, ncls, ncounts, nh, nfp)
        return ChunkChanges(positions, olds, news, new_index)
    _raise_context_error(rc, lo, hi, ctx_count, cfp, context)
    if rc == -23:
        raise CodecError(f"delta chunk [{lo}, {hi}) is coded over a position index (threshold {t}) and none was given: see ensure_index")
    if rc == -24:
        raise CodecError(
            f"delta chunk [{lo}, {hi}) was coded over a different position index (threshold {t}, {icount} entries, "
            f"fingerprint {pfp:08x}; given threshold {index.threshold}, {index.positions.shape[0]} entries, "
            f"fingerprint {index.fingerprint:08x}): pass the index of the previous version (see ensure_index)"
        )
    msg = _HEAD3_ERRORS.get(rc) or _V3_ERRORS.get(rc, f"delta decode error {rc}")
    raise CodecError(f"{msg} (chunk start {lo})")


def decode_tensor(
    chunks: list[EncodedChunk] | list[bytes],
    old: np.ndarray | None,
    dtype: str,
    *,
    context: Sequence[ChunkChanges | None] | None = None,
    index: Sequence[ChunkIndex | None] | None = None,
) -> np.ndarray:
    """Convenience: decode all chunks of one tensor into a new array
    (``context``, ``index``: one entry per chunk, as for :func:`encode_tensor`)."""
    _check_dtype(dtype)
    payloads = [c.payload if isinstance(c, EncodedChunk) else c for c in chunks]
    if not payloads:
        raise CodecError("no chunks to decode")
    total = parse_header(payloads[0]).total
    out = np.empty(total, dtype=DTYPES[dtype])
    if context is not None and len(context) != len(payloads):
        raise CodecError(f"context has {len(context)} entries for {len(payloads)} chunks")
    if index is not None and len(index) != len(payloads):
        raise CodecError(f"index has {len(index)} entries for {len(payloads)} chunks")
    for j, p in enumerate(payloads):
        decode_chunk_into(p, out, old, context=context[j] if context is not None else None, index=index[j] if index is not None else None)
    return out
