"""The numba kernels of the delta codec: the scan that finds a chunk's changes,
Rice coding of the delta bit stream, and the decoder's bit reader and passes.
The layout they write and read is described in format.py. Streams (lane,
class) are indexed s = lane * 256 + class.

Word views: on a little-endian host, 8-byte aligned 16-bit data can also be
passed as uint64 words (four elements per word, element 4j+l in bits
16l..16l+15 of word j); the scan and find kernels take such a view or None.
A None argument makes numba compile a separate version without the word code.

context_kernels.py (format version 2) compiles the bit I/O helpers of this file into
its own kernels and pins their source (``_SHARED_DIGEST`` there): editing
one of them means updating that digest too.
"""

from __future__ import annotations

import sys

import numpy as np
from numba import njit

from services.weightsync.codec.format import _KMAG_UNIT, _LANES, _NCLASS, _PAD, _QMAX, _RAW_BITS

# numba freezes globals into compiled kernels, and cache=True keys its on-disk
# cache on this file only: changing one of these in format.py alone would keep
# the stale cached kernels running. Pinning them here makes that an import error.
if (_LANES, _NCLASS, _QMAX, _RAW_BITS, _KMAG_UNIT, _PAD) != (4, 256, 24, 40, 255, 40):
    raise ImportError("codec format constants changed: update kernels.py too (numba cache)")


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
        ev_delta[e] = _ordered_key(np.int64(new[i]), sign_bit, full) - _ordered_key(np.int64(old[i]), sign_bit, full)
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
def _scan_changes(new, old, new64, old64, shift, emask, sign_bit, full):
    """One pass over a chunk: find changed elements, their stream, their rank
    inside the stream and their signed step count. Also count stream sizes.

    new64/old64: word views of new/old (see module doc) or None. Words are
    scanned ~1.7x faster: one compare per four elements finds that none
    changed, and the four lane counters update independently."""
    n = new.shape[0]
    counts = np.zeros((_LANES, _NCLASS), dtype=np.int64)
    # np.empty touches no memory until written, so sizing for the worst case
    # costs nothing in the common sparse case.
    ev_pos = np.empty(n, dtype=np.int64)
    ev_stream = np.empty(n, dtype=np.int64)
    ev_rank = np.empty(n, dtype=np.int64)
    ne = 0
    nwords = 0
    if old64 is not None:
        nwords = old64.shape[0]
        c0 = counts[0]
        c1 = counts[1]
        c2 = counts[2]
        c3 = counts[3]
        # Unsigned class indices: numba then needs no negative-index check.
        sh = np.uint64(shift)
        em = np.uint64(emask)
        for j in range(nwords):
            w = old64[j]
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
    ne = _scan_elements(new, old, 4 * nwords, n, shift, emask, counts, ev_pos, ev_stream, ev_rank, ne)
    return _finish_scan(new, old, ne, ev_pos, ev_stream, ev_rank, counts, sign_bit, full)


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
    """Rice code of v >= 0 with parameter k (see format.py for the escape)."""
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


@njit(cache=True, nogil=True, inline="always")
def _group_bits(old, old64, j):
    """Raw bits of elements 4j..4j+3 (lanes 0..3) as int64, from the word view
    if there is one (see module doc), else from the elements."""
    if old64 is None:
        i = 4 * j
        return np.int64(old[i]), np.int64(old[i + 1]), np.int64(old[i + 2]), np.int64(old[i + 3])
    w = old64[j]
    # A constant mask before the cast shows LLVM the values are non-negative,
    # so the lookups they feed need no negative-index wraparound; masking with
    # the runtime exponent mask instead kept it, and this path ~1.6x slower.
    m = np.uint64(0xFFFF)
    return np.int64(w & m), np.int64((w >> np.uint64(16)) & m), np.int64((w >> np.uint64(32)) & m), np.int64(w >> np.uint64(48))


@njit(cache=True, nogil=True)
def _find_changes(old, old64, shift, emask, classes, nev_c, gaps, gptr, evs):
    """Pass 1: walk the chunk with one countdown per stream and return how
    many changes were found (their positions go to evs), or -1 if corrupt.
    old64: word view of old (see module doc) or None.

    Four elements (one per lane) per iteration with four separate counter
    rows, so consecutive updates never wait on each other."""
    n = old.shape[0]
    gend, rem = _start_countdowns(classes, nev_c, gaps, gptr)
    ne = 0
    ngroups = n // 4 if old64 is None else old64.shape[0]
    for j in range(ngroups):
        x0, x1, x2, x3 = _group_bits(old, old64, j)
        s0 = (x0 >> shift) & emask
        s1 = ((x1 >> shift) & emask) | 256
        s2 = ((x2 >> shift) & emask) | 512
        s3 = ((x3 >> shift) & emask) | 768
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
    for i in range(4 * ngroups, n):  # tail (< 4 elements)
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
    found = _find_changes(old, old64, shift, emask, classes, nev_c, gaps, gptr, evs)
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


_LITTLE = sys.byteorder == "little"  # frozen into the cached kernels; the cache is per machine


@njit(cache=True, nogil=True, inline="always")
def _uv(buf, pos):
    """Unsigned LEB128 at buf[pos]: (value, new pos), or (-1, -1) if truncated
    or longer than 63 bits (the caller then lets format.py's parser name the
    fault, or refuses the body)."""
    value = np.int64(0)
    shift = 0
    while True:
        if pos >= buf.shape[0] or shift > 56:
            return np.int64(-1), -1
        b = np.int64(buf[pos])
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7


@njit(cache=True, nogil=True, inline="always")
def _body_words(body, off):
    """A delta body's bit stream (its bytes from ``off``) as little-endian 64-bit
    words with _PAD bits of zeros past its end for the reader's look-ahead: (words,
    bit count). On a little-endian host a copy; elsewhere assembled byte by byte."""
    nb = body.shape[0] - off
    words = np.zeros((nb + _PAD + 7) // 8, dtype=np.uint64)
    if _LITTLE:
        words.view(np.uint8)[:nb] = body[off:]
    else:
        for i in range(nb):
            words[i >> 3] |= np.uint64(body[off + i]) << np.uint64(8 * (i & 7))
    return words, 8 * nb


@njit(cache=True, nogil=True)
def _parse_table1(body, count, emask):
    """format.py's _parse_delta_table (and the caller's check that the event
    counts fit the chunk) on the body's bytes: (ok, classes, k_gap, k_mag,
    event counts, stream offset). Not ok for anything that parser or check
    refuses, and also for varints it would read as over 63 bits: the caller
    then runs them to raise their own error."""
    z = np.zeros(0, dtype=np.int64)
    n = body.shape[0]
    if n < 1 or body[0] != _LANES:
        return False, z, z, z, z, 0
    nclass, pos = _uv(body, 1)
    if pos < 0 or nclass > emask + 1:
        return False, z, z, z, z, 0
    classes = np.empty(nclass, dtype=np.int64)
    k_gap = np.empty(nclass, dtype=np.int64)
    k_mag = np.empty(nclass, dtype=np.int64)
    nev = np.empty(nclass, dtype=np.int64)
    total = 0
    for j in range(nclass):
        if pos + 3 > n:
            return False, z, z, z, z, 0
        c = np.int64(body[pos])
        kg = np.int64(body[pos + 1])
        km = np.int64(body[pos + 2])
        m, pos = _uv(body, pos + 3)
        if pos < 0 or c > emask or (j > 0 and c <= classes[j - 1]) or kg > _RAW_BITS or (km > 32 and km != _KMAG_UNIT):
            return False, z, z, z, z, 0
        total += m  # each m <= count checked below, so no overflow
        if m > count or total > count:
            return False, z, z, z, z, 0
        classes[j] = c
        k_gap[j] = kg
        k_mag[j] = km
        nev[j] = m
    return True, classes, k_gap, k_mag, nev, pos


@njit(cache=True, nogil=True)
def _decode_chunk1(body, src, dst, copy, start, count, shift, emask, sign_bit, full):
    """Decode a version-1 delta body (uint8) onto dst, which holds the base src
    of the chunk starting at element ``start`` (with ``copy``, dst is another
    array and gets src's values first, once the head is read), in one call:
    the class table, the stream words, the word view of src (where it is 8-byte aligned on a
    little-endian host) and _decode_delta. Per-call overhead is a real share
    of a sparse version's apply: in Python these steps cost ~30 us per chunk,
    ~2 ms per version of the built-in model (its 62 LayerNorm-sized chunks go
    in format 1), for ~1 us of work each.

    Returns (status, absolute positions, old bits, new bits); status 1: the
    head is refused and nothing written (run format.py's parser for the
    error), < 0: see _DELTA_ERRORS."""
    no_pos = np.empty(0, dtype=np.int64)
    no_bits = np.empty(0, dtype=src.dtype)
    ok, classes, k_gap, k_mag, nev, off = _parse_table1(body, count, emask)
    if not ok:
        return 1, no_pos, no_bits, no_bits
    words, nbits = _body_words(body, off)
    if copy:  # a plain loop: distinct arrays (the caller checked)
        for i in range(src.shape[0]):
            dst[i] = src[i]
    n4 = src.shape[0] // 4
    if _LITTLE and src.itemsize == 2 and n4 > 0 and src.ctypes.data % 8 == 0:
        rc, positions, olds = _decode_delta(src, src[: 4 * n4].view(np.uint64), dst, shift, emask, sign_bit, full, classes, k_gap, k_mag, nev, words, nbits)
    else:
        rc, positions, olds = _decode_delta(src, None, dst, shift, emask, sign_bit, full, classes, k_gap, k_mag, nev, words, nbits)
    if rc != 0:
        return rc, no_pos, no_bits, no_bits
    news = np.empty(positions.shape[0], dtype=src.dtype)
    for e in range(positions.shape[0]):
        news[e] = dst[positions[e]]
        positions[e] += start
    return 0, positions, olds, news
