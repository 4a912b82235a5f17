"""Lossless delta codec for model weights travelling between regions: the byte format.

This module writes and parses everything around the delta bit stream; the
numba kernels that write and read the stream itself are in kernels.py
(format version 1), context_kernels.py (format version 2) and index_kernels.py
(format version 3), the public API in the package's __init__. All versions
decode; the encoders write version 1 unless asked for 2 or 3 (see "Format
version 2" and "Format version 3" for why and when).

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

Format version 2: deltas decoded in O(changes)
----------------------------------------------
Version 1 finds the changed positions with a pass over the whole chunk (the
old exponent of every element is the coding context), so applying a version
costs a pass over the model however little changed. Version 2 codes
positions against what a receiver holds without touching unchanged
elements: the *context*, i.e. the change list (positions, old and new bits)
of the previous delta of the same chunk range -- exactly the ``ChunkChanges``
that decoding that delta returned (and that the encoder returns in
``EncodedChunk.changes``). A delta of version N is decoded with the context
of N-1; a receiver that lacks it (first delta after a keyframe, a late
joiner) gets a delta coded without context (the header says which), and a
decoder never guesses: a payload that names a context is refused with
CodecError unless the context given has the same change count and
fingerprint (below), before anything is written.

The decoder reads and writes ``old``/``out`` only at the changed positions
(tests/unit/test_weightsync_codec.py plants garbage in every unchanged
element of an in-place buffer and checks that it neither matters nor moves).
Its work: a pass over the context list (sequential, O(previous changes)),
the codes of this delta (O(changes)), one gather of the old values at the
changed positions (a loop of its own, so the cache misses overlap) and one
pass that reads the magnitudes and writes the new values (a bad value puts
back what was written, so a refused chunk leaves ``out`` as it was).

What is coded, per chunk:

* *Again flags*: for each context change, whether that element changes
  again. Context: the element's exponent now (the context's new bits), a
  group per exponent. Groups without a table row are "all again" (tiny
  weights move every step).
* *New positions*: changes not in the context list, as gaps (unchanged
  elements skipped) with one Rice parameter per chunk. No exponent context:
  learning an unchanged element's exponent would need a pass.
* *Signs*: a repeated change codes whether its direction flipped against the
  previous step (Adam's momentum keeps it; default: no flip), a new change
  codes its sign.
* *Magnitudes* ``|steps| - 1`` per class of the old exponent (read at the
  changed position, which the decoder touches anyway), either Rice coded or
  as the Rice coded zigzag distance to the class median: weights far below
  the grid step move by about lr / spacing steps every time, a bump that
  plain Rice codes waste ~40 % on.

Binary groups (again flags, flips, new signs) are coded per group either as
raw bits or as the Rice-coded runs of the majority symbol before each
minority symbol, whichever is shorter; a group equal to its default costs
nothing. The encoder also codes every context-carrying chunk without the
context and keeps the smaller (coding is O(changes); the context does not pay
for itself on random changes, where its table outweighs what it predicts).

Measured on `meridian bench weightsync`'s recorded RL steps (SmolLM2-135M,
AdamW lr 1e-6, 5 steps after 3 warm-up steps; % of the full bf16 size;
"entropy" = static empirical entropy per 4 Mi-element chunk):

* positions, old-exponent context (what version 1 uses): 0.010-0.053 %
  entropy; the new positions without it (version 2): 0.064-0.34 %. The
  again flags given the exponent cost < 0.001 %: whether an element repeats
  is already explained by its exponent. The temporal context does not make
  up for losing the exponent context on *new* positions, for a reason
  specific to early training: the masters start on the bf16 grid, so all
  weights of one binade drift off their grid point together and cross the
  rounding midpoint at the same step (87 % of the 241 k weights with
  |w| in [2**-11, 2**-10) change at step 3, one of them also at step 2; 61 % of
  the 1.3 M in [2**-9, 2**-8) at step 5). Only the exponent predicts that.
* signs: 1 raw bit per change in version 1; given the previous sign a
  repeated change's sign costs 0.01-0.03 bits.
* magnitudes: entropy 0.066 %, per-class Rice (version 1) 0.10-0.11 %,
  the median-centred code 0.078 %.
* encoded, per step (first step without context): version 1 0.217, 0.181,
  0.179, 0.168, 0.255 (median 0.181); version 2 0.493, 0.168, 0.210, 0.159,
  0.482 (median 0.210). Version 2 wins where most changes repeat (steps 2
  and 4), loses on the synchronised crossings (steps 3 and 5) and without
  context. Hence the encoders' default stays version 1 until callers keep
  contexts (and, for version 3, indexes); getting both targets needs an exponent-aware position code that
  needs no pass over the tensor, e.g. a receiver-maintained sorted index of
  the small-magnitude elements per chunk (2 % of this model's elements;
  updated from each change list) whose per-exponent streams version 1's
  countdown could walk instead of the whole chunk. Costed on the same steps
  (version 1's position codes, which only count elements of the same
  exponent, plus version 2's sign and magnitude codes): 0.183, 0.125,
  0.129, 0.121, 0.211 (median 0.129); run-length codes for the exponents
  where nearly every element changes would take positions from 1 bit per
  change towards their entropy. Version 3 (below) is that design, with the
  run-length codes: 0.159, 0.108, 0.110, 0.105, 0.253
  (median 0.110). ``python -m benchmarks.codec``
  (``meridian bench codec``) measures the three versions on these steps.

Version-2 delta body::

    u8     flags            bit 0: coded against a context
    [uv    context change count, u32 context fingerprint]   if bit 0
    uv     n_new            changes not in the context
    u8     k_new            Rice parameter of the new-position gaps
    uv     binary group rows, each: uv group, u8 code, [uv minority count]
             groups 0..255: again flags per exponent (default all 1),
             256: sign flips of repeats, 257: signs of new changes
             (default all 0); code 0x80: raw bits, else
             (majority << 6) | k: Rice(k) runs (no count after raw)
    uv     magnitude rows, each: u8 class, u8 k | 0x80 if centred,
             [uv centre]; classes without a row are all +-1 step
    bits   again groups (ascending), new-position gaps (first = the
           position itself), flip group, new-sign group, then the
           magnitudes in change order, each with its class's code (the
           decoder reads them in the pass that writes the new values);
           zero padding.

Order of the changes: ascending position. The repeated changes are the
context entries whose again flag is 1; merged with the new positions they
give the change list the decoder returns. The fingerprint is FNV-1a over
(count, then per change: chunk-relative position, old bits << 32 | new bits),
folded to 32 bits: O(changes) to compute, and the decoder checks it before
writing anything. The version-2 header is the version-1 header with version
byte 2; keyframe bodies are the same in both versions.

Format version 3: exponent-aware positions in O(index + changes)
----------------------------------------------------------------
Version 1's position code is cheap because it knows every old exponent, and
costs a pass because it learns them by reading the whole chunk; version 2
needs no pass but loses the exponent. Version 3 keeps, on both sides, a
*position index* per chunk: the ascending chunk-relative positions of the
elements whose exponent field is below a threshold ``T``, each with its
exponent field (its *class*). Of this model's elements 1.6 % are in it, and
all but a handful of each step's changes (tiny weights move, large ones do
not: see "Why the delta coding looks the way it does").

* The index is a pure function of the chunk's values and ``T``
  (``build_index``: one pass, once -- at first use, after a keyframe). After
  that both sides keep it current from each change list
  (``update_index``, or the decoder does it in the same call): a changed
  element whose class changed is updated, one that crossed ``T`` enters or
  leaves; O(changes) when none crossed, else a merge, O(index + changes);
  never a pass over the tensor.
* ``T``, the threshold rule: the largest ``t`` such that at most 2 % of the
  chunk's elements have an exponent field below ``t`` (``index_threshold``,
  from the class histogram of the values the index is first built from; 0
  when the zero class alone is more). The encoder picks it when it builds its
  index; the payload names it, so a receiver builds the same index from its
  own copy of the same values (``ensure_index``). An index keeps its ``T``
  for its lifetime: re-choosing it would mean a pass.
* Fingerprint: the sum (mod 2**64) of a 64-bit mix of ``position << 8 |
  class`` over the entries -- order-free, so updating it costs O(changes) --
  mixed with the entry count and ``T``, folded to 32 bits. The payload names
  ``T``, the entry count and the fingerprint; a decoder refuses a missing or
  different index with CodecError before writing anything, and also checks
  at every changed position that the old value has the class the index says
  (an index change) or a class >= ``T`` (any other change).

What is coded, per chunk:

* *Index changes*: per class, the binary sequence "changed?" over the
  index entries of that class in position order, coded like version 2's
  binary groups (raw bits, or the Rice-coded runs of the majority symbol
  before each minority symbol). Sparse classes get version 1's gap code
  (runs of "unchanged"); classes where nearly every element changes -- the
  tiny weights of an early RL step -- get runs of "changed", a small
  fraction of a bit per change. Classes without a row have no change.
* *Other changes* (class >= ``T``: rare): gaps over the chunk's positions,
  one Rice parameter, no context.
* *Signs* (against the previous delta's change list, as in version 2: a
  repeat codes a flip, a new change its sign) and *magnitudes* (version 2's
  per-class plain or median-centred codes) -- which dominate the size now.
  The context's fingerprint differs from version 2's: the sum (mod 2**64)
  of a 64-bit mix of each change's (chunk-relative position, old bits, new
  bits), mixed with the count and folded to 32 bits -- no dependency from
  one change to the next, so checking a context costs less.

The decoder reads the index arrays, not the tensor, to find positions: it
expands each class group into one flag byte per index entry of that class
(O(runs) work), then walks the index once taking each entry's flag at its
class's next place (a counter and a load per entry, no branch), O(index)
plus O(changes) for the rest; it reads and writes ``old``/``out`` only at
the changed positions (tests/unit/test_weightsync_codec_v3.py plants
garbage in every other element, index entries included). A chunk whose
changes all fall outside the index is coded without it (the receiver then
needs none).

Measured (``meridian bench codec``, the recorded steps above, chunks of 2 Mi
elements, first step without context; apply = model bytes / time to apply a
delta in place, one thread, on a shared 2-core machine at load 2-7):

* size, % of full bf16 per step: 0.159, 0.108, 0.110, 0.105, 0.253, median
  0.110 (version 1: 0.181, version 2: 0.210). 0.3-1.3 % of a step's changes
  fall outside the index, except at step 5 (17 %): a wave of synchronised
  crossings reaches the class just above ``T``. A 4 % index takes that step
  to 0.187 (median 0.110 either way) and doubles the walk, hence 2 %.
* apply 6.6 GB/s (5.9 before the decoder's rework below; version 2: 8.2,
  version 1: 1.4), still far from the 20 GB/s aim. A step (step 3: 636 k
  changes, 2.09 M index entries, 285 chunks) costs ~36 ms of CPU, of which
  ~5 ms is the Python side of 285 ``decode_chunk_into`` calls and ~31 ms
  the kernels: per call ~3 us of numba dispatch (20 arguments) and boxing,
  then, summed over a step with the tensor cold (each measured alone, on a
  busy 2-core machine: +-30 %): the walk 6-7 ms (~3 ns per entry), the
  gather of the old values 5-6 ms (one cache miss per change: memory-bound,
  ~9 ns each; a software prefetch or loading them inside the walk or the
  magnitude loop was slower, since those loops then stall on the misses),
  the magnitude codes and writes ~7 ms (a serial chain through the bit
  position), the context repeats ~4 ms (a merge with the previous change
  list), the index update ~4 ms, signs ~1.5 ms, the context check ~1.4 ms.
  What the rework did, all bit-exact: the decode is a chain of small
  kernels (numba compiled the loops of the one long function 3-5x slower:
  the position merge alone took 20 ns per change there); no branch per
  change on a coin toss (a class with or without magnitude codes, a repeat
  or a new change; the gain of each is within the noise of this machine);
  Rice codes read with one count-trailing-zeros instruction; the index
  update touches only the changes that change a class (listed during the
  decode) and copies
  the entries between threshold crossings as blocks. 20 GB/s (13 ms) needs
  the per-call overhead gone (a batched entry point) and the gather
  overlapped with other work, e.g. threads over chunks.
* encode 1.35 GB/s (version 1: 1.2; no pass to learn exponents: a compare
  pass and the index); ``build_index`` once: 0.16 s for the whole model.

Version-3 delta body::

    u8     flags            bit 0: signs coded against a context,
                            bit 1: positions coded over an index
    [uv    context change count, u32 context fingerprint]   if bit 0
    [uv    T, uv index entry count, u32 index fingerprint]  if bit 1
    uv     n_out            changes outside the index
    u8     k_out            Rice parameter of their gaps
    uv     binary group rows, as in version 2:
             groups 0..T-1: changed flags of the index entries of class g
             (no row: none changed), 256: sign flips of repeats, 257: signs
             of new changes (no row: all 0)
    uv     magnitude rows, as in version 2
    bits   class groups (ascending), outside gaps (first = the position
           itself), flip group, new-sign group, magnitudes in change order;
           zero padding.

The version-3 header is the version-1 header with version byte 3; keyframe
bodies are the same in all versions.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import zstandard

DTYPES: dict[str, type] = {"bf16": np.uint16, "fp16": np.uint16, "fp32": np.uint32}

_MAGIC = b"MW"
_VERSION = 1  # what the version-1 encoder writes
_VERSION_2 = 2
_VERSION_3 = 3
_VERSIONS = (1, 2, 3)  # what this codec reads
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
_PAD = 40  # zero bytes appended to a bit stream before decoding (see kernels._peek)
_ZSTD_LEVEL = 3

# Format version 2 (see "Format version 2" above).
_NGROUPS = 258  # binary symbol groups: 0..255 again flags per exponent, then:
_G_FLIP = 256  # sign flips of repeated changes
_G_NEWSIGN = 257  # signs of new changes
_BIN_RAW = 0x80  # binary group code: raw bits (else (majority << 6) | k)
_FLAG_CONTEXT = 1  # v2/v3 delta flags: coded against a context change list
_FLAG_INDEX = 2  # v3 delta flags: positions coded over a position index
_INDEX_FRACTION = 0.02  # default share of a chunk's elements in its position index


class CodecError(ValueError):
    """Raised for malformed or truncated payloads and for inputs that do not
    match a payload (dtype, length, missing base for a delta)."""


@dataclass(frozen=True)
class ChunkChanges:
    """What a delta chunk changed: flat tensor positions (ascending) and the bits
    there before and after. Lets receivers update hashes and undo logs in
    O(changes) instead of a pass over the tensor, and is the context a
    version-2 delta of the next version is coded against."""

    positions: np.ndarray  # int64
    old: np.ndarray  # raw bits, the tensor's dtype
    new: np.ndarray
    # Format 3, decoded or encoded against a position index: the index of the
    # chunk after these changes (what the next version's delta needs).
    index: ChunkIndex | None = field(default=None, compare=False, repr=False)


class ChunkIndex(NamedTuple):
    """A chunk's position index (format version 3): the ascending
    chunk-relative positions of the elements whose exponent field is below
    ``threshold``, with each one's exponent field (its class). A pure function
    of the chunk's values and the threshold; ``fingerprint`` (32 bits, over
    the entries, their count and the threshold) is what a payload names.
    Immutable: updating one (``update_index``) returns a new one that may
    share arrays with it. (A named tuple, not a frozen dataclass: a receiver
    makes one per chunk per version, and a frozen dataclass costs 1.5 us to
    build, a tuple 0.3.)"""

    dtype: str
    start: int
    count: int
    threshold: int
    positions: np.ndarray  # int64, ascending, chunk-relative
    classes: np.ndarray  # uint8, the exponent field of each entry
    class_counts: np.ndarray  # int64[256], entries per class
    entry_hash: int  # sum of the entries' 64-bit hashes mod 2**64
    fingerprint: int


@dataclass(frozen=True)
class EncodedChunk:
    """One independently decodable piece of a tensor."""

    tensor: str  # tensor name
    start: int  # first element index (flat) this chunk covers
    count: int  # number of elements covered
    payload: bytes  # self-describing, see module docstring
    # What a delta chunk changed (exactly what decode_chunk_into returns for
    # it; None for a keyframe chunk): the context for the same chunk of the
    # next version.
    changes: ChunkChanges | None = field(default=None, compare=False, repr=False)
    # Format 3: the position index of this chunk's new values (whatever the
    # mode), which the next version's encode takes.
    index: ChunkIndex | None = field(default=None, compare=False, repr=False)


class ChunkHeader(NamedTuple):
    """Decoded payload header; ``body_offset`` is where the body starts. (A
    named tuple: parsed once per chunk received, see ChunkIndex.)"""

    mode: int
    dtype: str
    start: int
    count: int
    total: int
    crc: int
    body_offset: int
    version: int = 1


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
    # An IndexError ends a truncated varint: cheaper than a length check per
    # byte on the per-chunk path (a header has three of these).
    try:
        while shift <= 63:
            byte = buf[pos]
            pos += 1
            if byte < 0x80:
                return value | (byte << shift), pos
            value |= (byte & 0x7F) << shift
            shift += 7
    except IndexError:
        raise CodecError(f"truncated payload while reading {what}") from None
    raise CodecError(f"varint too long while reading {what}")


def _header_bytes(mode: int, dtype: str, start: int, count: int, total: int, body: bytes, version: int = _VERSION) -> bytes:
    return b"".join(
        (
            _MAGIC,
            bytes((version, mode, _DTYPE_CODES[dtype])),
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
    if payload[2] not in _VERSIONS:
        raise CodecError(f"unsupported format version {payload[2]} (this codec reads {_VERSIONS})")
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
    return ChunkHeader(mode, dtype, start, count, total, crc, pos + 4, payload[2])


# --------------------------------------------------------------------------
# Keyframes: byte planes + zstd
# --------------------------------------------------------------------------


def _keyframe_body(values: np.ndarray, dtype: str) -> bytes:
    nplanes = _BITS[dtype] // 8
    cctx = zstandard.ZstdCompressor(level=_ZSTD_LEVEL)
    wide = values.astype(np.uint32, copy=False)
    frames = [cctx.compress((wide >> np.uint32(8 * p)).astype(np.uint8).tobytes()) for p in range(nplanes)]
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
        raise CodecError(f"keyframe planes need {pos + sum(sizes)} body bytes, payload has {len(body)}")
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
# Delta bodies (the bit stream itself is written and read by kernels.py)
# --------------------------------------------------------------------------


def _delta_body(classes: np.ndarray, k_gap: np.ndarray, k_mag: np.ndarray, nev: np.ndarray, words: np.ndarray, nbits: int) -> bytes:
    """Lane count, class table and the first ``nbits`` of the bit stream ``words``."""
    table = bytearray()
    for c, kg, km, m in zip(classes.tolist(), k_gap.tolist(), k_mag.tolist(), nev.tolist()):
        table += bytes((c, kg, km)) + _uv_encode(m)
    stream = words.astype("<u8").tobytes()[: (nbits + 7) // 8]
    return b"".join((bytes((_LANES,)), _uv_encode(len(classes)), bytes(table), stream))


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


# --------------------------------------------------------------------------
# Version-2 delta bodies
# --------------------------------------------------------------------------


def _delta2_body(
    ctx_count: int | None,
    fingerprint: int,
    n_new: int,
    k_new: int,
    rows: np.ndarray,
    mrows: np.ndarray,
    words: np.ndarray,
    nbits: int,
) -> bytes:
    """A version-2 delta body; ``ctx_count`` None: coded without context."""
    head = bytearray()
    if ctx_count is None:
        head.append(0)
    else:
        head.append(_FLAG_CONTEXT)
        head += _uv_encode(ctx_count) + struct.pack("<I", fingerprint)
    head += _uv_encode(n_new) + bytes((k_new,)) + _uv_encode(len(rows))
    for g, code, r in rows.tolist():
        head += _uv_encode(g) + bytes((code,))
        if code != _BIN_RAW:
            head += _uv_encode(r)
    head += _uv_encode(len(mrows))
    for c, k, center in mrows.tolist():
        if center < 0:
            head += bytes((c, k))
        else:
            head += bytes((c, k | 0x80)) + _uv_encode(center)
    stream = words.astype("<u8").tobytes()[: (nbits + 7) // 8]
    return bytes(head) + stream


# --------------------------------------------------------------------------
# Version-3 delta bodies
# --------------------------------------------------------------------------


def _delta3_body(
    ctx: tuple[int, int] | None,
    index: tuple[int, int, int] | None,
    n_out: int,
    k_out: int,
    rows: np.ndarray,
    mrows: np.ndarray,
    words: np.ndarray,
    nbits: int,
) -> bytes:
    """A version-3 delta body: ``ctx`` (change count, fingerprint) or None,
    ``index`` (threshold, entry count, fingerprint) or None."""
    head = bytearray((( _FLAG_CONTEXT if ctx else 0) | (_FLAG_INDEX if index else 0),))
    if ctx:
        head += _uv_encode(ctx[0]) + struct.pack("<I", ctx[1])
    if index:
        head += _uv_encode(index[0]) + _uv_encode(index[1]) + struct.pack("<I", index[2])
    head += _uv_encode(n_out) + bytes((k_out,)) + _uv_encode(len(rows))
    for g, code, r in rows.tolist():
        head += _uv_encode(g) + bytes((code,))
        if code != _BIN_RAW:
            head += _uv_encode(r)
    head += _uv_encode(len(mrows))
    for c, k, center in mrows.tolist():
        if center < 0:
            head += bytes((c, k))
        else:
            head += bytes((c, k | 0x80)) + _uv_encode(center)
    stream = words.astype("<u8").tobytes()[: (nbits + 7) // 8]
    return bytes(head) + stream
