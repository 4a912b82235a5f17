"""The numba kernels of format version 3 (see format.py): deltas whose changed
positions are coded per exponent class over the receiver's *position index*
(the ascending positions of a chunk's small-magnitude elements and their
exponent classes), so that decoding costs O(index + changes) and never reads
an element outside the index and the changes.

Binary groups, signs against the previous delta (the context) and magnitude
codes are format 2's; their helpers are compiled in from context_kernels.py
and kernels.py, whose source is pinned below like context_kernels.py pins
kernels.py's (numba's cache only notices edits to this file).
"""

from __future__ import annotations

import hashlib
import inspect
import sys

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.cpython.unsafe.numbers import trailing_zeros as _cttz
from numba.extending import intrinsic

from services.weightsync.codec import context_kernels as _k2
from services.weightsync.codec import kernels as _k1
from services.weightsync.codec.context_kernels import _bin_cost, _mag_rows, _put_bins, _zigzag
from services.weightsync.codec.format import _BIN_RAW, _FLAG_CONTEXT, _FLAG_INDEX, _G_FLIP, _G_NEWSIGN, _NGROUPS, _PAD, _QMAX, _RAW_BITS
from services.weightsync.codec.kernels import _best_k, _body_words, _ordered_key, _peek, _put_rice, _uv

# See the note in kernels.py: numba freezes these into its cached kernels.
if (_NGROUPS, _G_FLIP, _G_NEWSIGN, _BIN_RAW, _FLAG_CONTEXT, _FLAG_INDEX, _QMAX, _RAW_BITS, _PAD) != (258, 256, 257, 0x80, 1, 2, 24, 40, 40):
    raise ImportError("codec format constants changed: update index_kernels.py too (numba cache)")
_LITTLE = sys.byteorder == "little"  # frozen into the cached kernels too; the cache is per machine

_SHARED_1 = ("_ordered_key", "_rice_cost", "_best_k", "_put", "_put_rice", "_peek", "_uv", "_body_words")
_SHARED_2 = ("_zigzag", "_rice_total", "_bin_cost", "_put_bins", "_mag_rows")
_SHARED_DIGEST = "d45c6f1926716c78"


def _shared_digest() -> str:
    src = "".join(inspect.getsource(getattr(_k1, n).py_func) for n in _SHARED_1)
    src += "".join(inspect.getsource(getattr(_k2, n).py_func) for n in _SHARED_2)
    return hashlib.sha256(src.encode()).hexdigest()[:16]


if _shared_digest() != _SHARED_DIGEST:
    raise ImportError("kernels.py/context_kernels.py helpers changed: update _SHARED_DIGEST in index_kernels.py (numba cache)")


# --------------------------------------------------------------------------
# The position index
# --------------------------------------------------------------------------


@njit(cache=True, nogil=True, inline="always")
def _mix(x):
    """splitmix64's finaliser of x + the golden ratio: a 64-bit mixing function."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@njit(cache=True, nogil=True, inline="always")
def _entry_hash(p, c):
    """The hash term of index entry (chunk-relative position p, class c)."""
    return _mix((np.uint64(p) << np.uint64(8)) | np.uint64(c))


@njit(cache=True, nogil=True)
def _index_fingerprint(h, m, t):
    """32-bit fingerprint of an index: its entry-hash sum h (mod 2**64), entry
    count m and threshold t. The sum makes it O(changes) to keep current."""
    x = _mix(h + _mix((np.uint64(m) << np.uint64(9)) | np.uint64(t)))
    return np.int64((x ^ (x >> np.uint64(32))) & np.uint64(0xFFFFFFFF))


@njit(cache=True, nogil=True)
def _class_histogram(vals, shift, emask):
    """Elements per exponent class (one pass)."""
    counts = np.zeros(256, dtype=np.int64)
    for i in range(vals.shape[0]):
        counts[(np.int64(vals[i]) >> shift) & emask] += 1
    return counts


@njit(cache=True, nogil=True)
def _build_index(vals, shift, emask, t):
    """The index of a chunk's values (one pass): ascending positions and
    classes of the elements whose exponent field is below t, the count per
    class and the entry-hash sum."""
    n = vals.shape[0]
    pos = np.empty(n, dtype=np.int64)  # untouched pages of np.empty cost nothing
    cls = np.empty(n, dtype=np.uint8)
    counts = np.zeros(256, dtype=np.int64)
    h = np.uint64(0)
    m = 0
    for i in range(n):
        c = (np.int64(vals[i]) >> shift) & emask
        if c < t:
            pos[m] = i
            cls[m] = c
            counts[c] += 1
            h += _entry_hash(i, c)
            m += 1
    return pos[:m].copy(), cls[:m].copy(), counts, h


@njit(cache=True, nogil=True)
def _find_slots(ipos, icls, t, rel, old, shift, emask):
    """For each change (chunk-relative ascending positions ``rel``, old bits)
    its index slot, or -1 outside the index: a merge walk, O(index + changes).
    Status -1 when the index does not describe the old bits (an entry with
    another class, or a small element missing from it)."""
    m = ipos.shape[0]
    ne = rel.shape[0]
    slot = np.empty(ne, dtype=np.int64)
    j = 0
    for e in range(ne):
        p = rel[e]
        while j < m and ipos[j] < p:
            j += 1
        co = (np.int64(old[e]) >> shift) & emask
        if j < m and ipos[j] == p:
            if np.int64(icls[j]) != co:
                return -1, slot
            slot[e] = j
        else:
            if co < t:
                return -1, slot
            slot[e] = -1
    return 0, slot


@njit(cache=True, nogil=True)
def _index_events(rel, old, new, t, shift, emask):
    """The changes that touch an index of threshold t (a class change with
    either class below t), listed without a branch: (their numbers in a
    buffer of len(rel) + 1, their count). Few of a step's changes do."""
    ne = rel.shape[0]
    ev = np.empty(ne + 1, dtype=np.int64)
    nev = 0
    for e in range(ne):
        co = (np.int64(old[e]) >> shift) & emask
        cn = (np.int64(new[e]) >> shift) & emask
        ev[nev] = e
        nev += (co != cn) & ((co < t) | (cn < t))
    return ev, nev


@njit(cache=True, nogil=True)
def _apply_events(ipos, icls, icounts, ih, t, rel, old, new, slot, ev, nev, shift, emask):
    """The index after the changes, given each change's slot (_find_slots)
    and the changes that touch it (_index_events): elements whose class
    changed are updated, those that crossed the threshold enter or leave.
    O(events) when none crossed (plus a copy of the classes); otherwise the
    entries between crossings are copied as blocks (O(index) bytes moved, no
    per-entry work) and the class changes patched after. Returns (positions,
    classes, counts, hash); unchanged arrays are returned as they are (not
    copied)."""
    if nev == 0:
        return ipos, icls, icounts, ih
    m = ipos.shape[0]
    counts = icounts.copy()  # 256 entries
    h = ih
    n_ins = 0
    n_del = 0
    for q in range(nev):
        e = ev[q]
        p = rel[e]
        co = (np.int64(old[e]) >> shift) & emask
        cn = (np.int64(new[e]) >> shift) & emask
        if co < t:
            counts[co] -= 1
            h -= _entry_hash(p, co)
        if cn < t:
            counts[cn] += 1
            h += _entry_hash(p, cn)
        if co >= t:
            n_ins += 1
        elif cn >= t:
            n_del += 1
    if n_ins == 0 and n_del == 0:
        cls = icls.copy()  # same entries, some classes differ
        for q in range(nev):
            e = ev[q]
            cls[slot[e]] = (np.int64(new[e]) >> shift) & emask
        return ipos, cls, counts, h
    n = m + n_ins - n_del
    npos = np.empty(n, dtype=np.int64)
    ncls = np.empty(n, dtype=np.uint8)
    # 1. Copy the entries between crossings as blocks; an entering element
    # is written at its place, a leaving one skipped.
    j = 0  # next entry of the old index to copy
    k = 0  # next entry of the new one to write
    for q in range(nev):
        e = ev[q]
        cn = (np.int64(new[e]) >> shift) & emask
        s = slot[e]
        if s >= 0 and cn < t:
            continue  # a class change: patched below
        if s < 0:  # enters: copy up to its place
            s = j + np.searchsorted(ipos[j:], rel[e])
        for i in range(s - j):  # a plain loop: numba's slice assignment allocates
            npos[k + i] = ipos[j + i]
            ncls[k + i] = icls[j + i]
        k += s - j
        if slot[e] >= 0:
            j = s + 1  # leaves
        else:
            j = s
            npos[k] = rel[e]
            ncls[k] = cn
            k += 1
    for i in range(m - j):
        npos[k + i] = ipos[j + i]
        ncls[k + i] = icls[j + i]
    # 2. Class changes, at their slots shifted by the crossings before them.
    d = 0
    for q in range(nev):
        e = ev[q]
        cn = (np.int64(new[e]) >> shift) & emask
        if slot[e] < 0:
            d += 1
        elif cn >= t:
            d -= 1
        else:
            ncls[slot[e] + d] = cn
    return npos, ncls, counts, h


@njit(cache=True, nogil=True)
def _apply_slots(ipos, icls, icounts, ih, t, rel, old, new, slot, shift, emask):
    """_index_events then _apply_events."""
    ev, nev = _index_events(rel, old, new, t, shift, emask)
    return _apply_events(ipos, icls, icounts, ih, t, rel, old, new, slot, ev, nev, shift, emask)


@njit(cache=True, nogil=True)
def _update_index(ipos, icls, icounts, ih, t, rel, old, new, shift, emask):
    """_find_slots then _apply_slots: (status, positions, classes, counts, hash, fingerprint)."""
    st, slot = _find_slots(ipos, icls, t, rel, old, shift, emask)
    if st != 0:
        return st, ipos, icls, icounts, ih, np.int64(0)
    npos, ncls, ncounts, nh = _apply_slots(ipos, icls, icounts, ih, t, rel, old, new, slot, shift, emask)
    return 0, npos, ncls, ncounts, nh, _index_fingerprint(nh, npos.shape[0], t)


@njit(cache=True, nogil=True)
def _context3(pos, old, new, start, count, sign_bit, full):
    """A context change list (absolute positions) as version 3 uses it:
    chunk-relative positions, each change's step sign, and the list's
    fingerprint -- unlike version 2's FNV chain an order-free sum of mixed
    (position, old bits, new bits) terms with the count, so the loop carries
    no dependency from one change to the next. Status -1 when the positions
    are not strictly ascending inside [start, start + count)."""
    m = pos.shape[0]
    rel = np.empty(m, dtype=np.int64)
    neg = np.empty(m, dtype=np.bool_)
    h = np.uint64(0)
    last = -1
    for j in range(m):
        p = pos[j] - start
        if p <= last or p >= count:
            return -1, rel, neg, np.int64(0)
        last = p
        rel[j] = p
        o = np.int64(old[j])
        n = np.int64(new[j])
        neg[j] = _ordered_key(n, sign_bit, full) < _ordered_key(o, sign_bit, full)
        h += _mix(_mix(np.uint64(p)) ^ ((np.uint64(o) << np.uint64(32)) | np.uint64(n)))
    x = _mix(h + _mix(np.uint64(m)))
    return 0, rel, neg, np.int64((x ^ (x >> np.uint64(32))) & np.uint64(0xFFFFFFFF))


# --------------------------------------------------------------------------
# Encoder
# --------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def _encode_v3(new, old, pos, ctx_pos, ctx_neg, use_idx, ipos, icls, icounts, t, shift, emask, sign_bit, full):
    """Code a chunk's changes (ascending positions ``pos``) over the index
    (``use_idx``) and against the context (empty arrays: none).

    Returns (status, n_out, k_out, binary rows [group, code, minority count],
    magnitude rows, stream words, stream bits, old bits, new bits); status -1:
    the index does not describe ``old``."""
    ne = pos.shape[0]
    steps = np.empty(ne, dtype=np.int64)
    cls = np.empty(ne, dtype=np.int64)
    olds = np.empty(ne, dtype=old.dtype)
    news = np.empty(ne, dtype=new.dtype)
    for e in range(ne):
        i = pos[e]
        o = np.int64(old[i])
        olds[e] = old[i]
        news[e] = new[i]
        steps[e] = _ordered_key(np.int64(new[i]), sign_bit, full) - _ordered_key(o, sign_bit, full)
        cls[e] = (o >> shift) & emask
    rows = np.empty((_NGROUPS, 3), dtype=np.int64)
    no_words = np.zeros(1, dtype=np.uint64)
    # 1. Rank of each change among the index entries of its class (-1: outside).
    rank = np.full(ne, -1, dtype=np.int64)
    active = np.zeros(256, dtype=np.int64)
    if use_idx:
        m = ipos.shape[0]
        run = np.zeros(256, dtype=np.int64)
        j = 0
        for e in range(ne):
            p = pos[e]
            while j < m and ipos[j] < p:
                run[icls[j]] += 1
                j += 1
            c = cls[e]
            if j < m and ipos[j] == p:
                if np.int64(icls[j]) != c:
                    return -1, 0, 0, rows[:0], rows[:0], no_words, 0, olds, news
                rank[e] = run[c]
                run[c] += 1
                active[c] = 1
                j += 1
            elif c < t:
                return -1, 0, 0, rows[:0], rows[:0], no_words, 0, olds, news
    # 2. Binary groups: per active class the changed flags of its index entries,
    # then sign flips of repeats and signs of new changes (as in format 2).
    goff = np.zeros(_NGROUPS + 1, dtype=np.int64)
    gsize = np.zeros(_NGROUPS, dtype=np.int64)
    for c in range(256):
        if active[c]:
            gsize[c] = icounts[c]
    m_ctx = ctx_pos.shape[0]
    rep_of = np.full(ne, -1, dtype=np.int64)
    jj = 0
    n_rep = 0
    for e in range(ne):
        p = pos[e]
        while jj < m_ctx and ctx_pos[jj] < p:
            jj += 1
        if jj < m_ctx and ctx_pos[jj] == p:
            rep_of[e] = jj
            n_rep += 1
    gsize[_G_FLIP] = n_rep
    gsize[_G_NEWSIGN] = ne - n_rep
    for g in range(_NGROUPS):
        goff[g + 1] = goff[g] + gsize[g]
    gbits = np.zeros(goff[_NGROUPS], dtype=np.int64)
    fill_flip = goff[_G_FLIP]
    fill_new = goff[_G_NEWSIGN]
    n_out = 0
    for e in range(ne):
        if rank[e] >= 0:
            gbits[goff[cls[e]] + rank[e]] = 1
        else:
            n_out += 1
        negative = 1 if steps[e] < 0 else 0
        if rep_of[e] >= 0:
            gbits[fill_flip] = 1 if negative != (1 if ctx_neg[rep_of[e]] else 0) else 0
            fill_flip += 1
        else:
            gbits[fill_new] = negative
            fill_new += 1
    nrows = 0
    for g in range(_NGROUPS):
        n = gsize[g]
        if n == 0:
            continue
        code, r, _ = _bin_cost(gbits[goff[g] : goff[g + 1]], n)
        if g >= _G_FLIP and code != _BIN_RAW and r == 0 and (code >> 6) == 0:
            continue  # all default (no flip, positive): no row
        rows[nrows, 0] = g
        rows[nrows, 1] = code
        rows[nrows, 2] = r
        nrows += 1
    # 3. Changes outside the index: gaps over the chunk's positions.
    out_gaps = np.empty(n_out, dtype=np.int64)
    last = -1
    q = 0
    for e in range(ne):
        if rank[e] < 0:
            out_gaps[q] = pos[e] - last - 1
            last = pos[e]
            q += 1
    k_out = _best_k(out_gaps, n_out, _RAW_BITS)
    mrows = _mag_rows(cls, steps, ne)
    # Worst case: 64 bits per Rice code (runs, gaps, magnitudes), one per bit.
    cap = (goff[_NGROUPS] * 64 + ne * 128) // 64 + 4
    words = np.zeros(cap, dtype=np.uint64)
    acc = np.zeros(1, dtype=np.uint64)
    state = np.zeros(2, dtype=np.int64)
    r = 0
    for g in range(_G_FLIP):  # class groups, ascending
        if r < nrows and rows[r, 0] == g:
            _put_bins(words, acc, state, gbits[goff[g] : goff[g + 1]], gsize[g], rows[r, 1])
            r += 1
    for e in range(n_out):
        _put_rice(words, acc, state, out_gaps[e], k_out)
    for g in range(_G_FLIP, _NGROUPS):
        if r < nrows and rows[r, 0] == g:
            _put_bins(words, acc, state, gbits[goff[g] : goff[g + 1]], gsize[g], rows[r, 1])
            r += 1
    mk = np.full(256, -1, dtype=np.int64)
    mc = np.full(256, -1, dtype=np.int64)
    for q in range(mrows.shape[0]):
        mk[mrows[q, 0]] = mrows[q, 1]
        mc[mrows[q, 0]] = mrows[q, 2]
    for e in range(ne):
        c = cls[e]
        if mk[c] >= 0:
            v = abs(steps[e]) - 1
            _put_rice(words, acc, state, _zigzag(v - mc[c]) if mc[c] >= 0 else v, mk[c])
    nbits = state[1] * 64 + state[0]
    if state[0] > 0:
        words[state[1]] = acc[0]
    return 0, n_out, k_out, rows[:nrows].copy(), mrows, words, nbits, olds, news


# --------------------------------------------------------------------------
# Decoder
# --------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def _parse_head3(buf, count, emask):
    """Parse and validate the head of a version-3 delta body (see format.py).

    Returns (status, flags, context count, context fingerprint, index
    threshold, index count, index fingerprint, n_out, k_out, binary rows,
    magnitude rows, stream offset); status < 0: see _HEAD3_ERRORS."""
    rows = np.zeros((0, 3), dtype=np.int64)
    mrows = np.zeros((0, 3), dtype=np.int64)
    z = np.int64(0)
    if buf.shape[0] < 1:
        return -10, z, z, z, z, z, z, z, z, rows, mrows, 0
    flags = np.int64(buf[0])
    if flags & ~np.int64(_FLAG_CONTEXT | _FLAG_INDEX):
        return -11, z, z, z, z, z, z, z, z, rows, mrows, 0
    pos = 1
    ctx_count = z
    cfp = z
    if flags & _FLAG_CONTEXT:
        ctx_count, pos = _uv(buf, pos)
        if pos < 0 or pos + 4 > buf.shape[0] or ctx_count > count:
            return -12, z, z, z, z, z, z, z, z, rows, mrows, 0
        cfp = np.int64(buf[pos]) | (np.int64(buf[pos + 1]) << 8) | (np.int64(buf[pos + 2]) << 16) | (np.int64(buf[pos + 3]) << 24)
        pos += 4
    t = z
    icount = z
    ifp = z
    if flags & _FLAG_INDEX:
        t, pos = _uv(buf, pos)
        if pos < 0 or t > emask + 1:
            return -16, z, z, z, z, z, z, z, z, rows, mrows, 0
        icount, pos = _uv(buf, pos)
        if pos < 0 or pos + 4 > buf.shape[0] or icount > count:
            return -16, z, z, z, z, z, z, z, z, rows, mrows, 0
        ifp = np.int64(buf[pos]) | (np.int64(buf[pos + 1]) << 8) | (np.int64(buf[pos + 2]) << 16) | (np.int64(buf[pos + 3]) << 24)
        pos += 4
    n_out, pos = _uv(buf, pos)
    if pos < 0 or n_out > count or pos >= buf.shape[0]:
        return -13, z, z, z, z, z, z, z, z, rows, mrows, 0
    k_out = np.int64(buf[pos])
    if k_out > _RAW_BITS:
        return -13, z, z, z, z, z, z, z, z, rows, mrows, 0
    nrows, pos = _uv(buf, pos + 1)
    if pos < 0 or nrows > _NGROUPS:
        return -14, z, z, z, z, z, z, z, z, rows, mrows, 0
    rows = np.zeros((nrows, 3), dtype=np.int64)
    last = -1
    for j in range(nrows):
        g, pos = _uv(buf, pos)
        if pos < 0 or pos >= buf.shape[0] or g <= last or g >= _NGROUPS or (g < _G_FLIP and g >= t):
            return -14, z, z, z, z, z, z, z, z, rows, mrows, 0
        last = g
        code = np.int64(buf[pos])
        pos += 1
        r = np.int64(0)
        if code != _BIN_RAW:
            r, pos = _uv(buf, pos)
            if pos < 0 or code & 0x80 or (code & 63) > _RAW_BITS or r > count:
                return -14, z, z, z, z, z, z, z, z, rows, mrows, 0
        rows[j, 0] = g
        rows[j, 1] = code
        rows[j, 2] = r
    nm, pos = _uv(buf, pos)
    if pos < 0 or nm > emask + 1:
        return -15, z, z, z, z, z, z, z, z, rows, mrows, 0
    mrows = np.zeros((nm, 3), dtype=np.int64)
    last = -1
    for j in range(nm):
        if pos + 2 > buf.shape[0]:
            return -15, z, z, z, z, z, z, z, z, rows, mrows, 0
        c = np.int64(buf[pos])
        kc = np.int64(buf[pos + 1])
        pos += 2
        center = np.int64(-1)
        if kc & 0x80:
            center, pos = _uv(buf, pos)
            if pos < 0 or center == 0:
                return -15, z, z, z, z, z, z, z, z, rows, mrows, 0
        if c <= last or c > emask or (kc & 0x7F) > 32:
            return -15, z, z, z, z, z, z, z, z, rows, mrows, 0
        last = c
        mrows[j, 0] = c
        mrows[j, 1] = kc & 0x7F
        mrows[j, 2] = center
    return 0, flags, ctx_count, cfp, t, icount, ifp, n_out, k_out, rows, mrows, pos


@njit(cache=True, nogil=True, inline="always")
def _rice(words, pos, k):
    """_get_rice for the parameters format 3 admits (k <= _RAW_BITS): the
    same (value, new position), with a count-trailing-zeros instruction and
    no branch on k. A code that is not an escape has q < _QMAX, so
    q + 1 + k <= 64: it lies in the one 64-bit peek."""
    w = _peek(words, pos)
    if (w & np.uint64((1 << _QMAX) - 1)) == 0:  # escape: raw value follows
        pos += _QMAX
        v = np.int64(_peek(words, pos) & np.uint64((1 << _RAW_BITS) - 1))
        return v, pos + _RAW_BITS
    q = np.int64(_cttz(w))
    low = np.int64((w >> np.uint64(q + 1)) & ((np.uint64(1) << np.uint64(k)) - np.uint64(1)))
    return (q << k) | low, pos + q + 1 + k


@njit(cache=True, nogil=True)
def _read_signs(words, bp, nbits, dst, n, code, r):
    """A binary group (as _read_bins / _read_runs read it, same checks and
    result) into dst[:n] as int8; no row (code -1): all 0. New bit position
    or -1."""
    if code < 0:
        dst[:n] = 0
        return bp
    if code == _BIN_RAW:
        if bp + n > nbits:
            return -1
        for j in range(n):
            dst[j] = np.int8((words[(bp + j) >> 6] >> np.uint64((bp + j) & 63)) & np.uint64(1))
        return bp + n
    major = np.int8(code >> 6)
    k = code & 63
    j = 0
    for _ in range(r):
        run, bp = _rice(words, bp, k)
        if bp > nbits or run > n - j - 1:
            return -1
        dst[j : j + run] = major
        j += run
        dst[j] = 1 - major
        j += 1
    dst[j:n] = major
    return bp


@njit(cache=True, nogil=True)
def _walk_index(ipos, icls, icounts, t, code, rmin, words, nbits):
    """Read the class groups (classes below t with a row in ``code``) and walk
    the index once. Every group is first expanded into its flags, one byte
    per index entry of its class, the classes' flags laid out one after the
    other (a raw group bit by bit; a runs group as its majority symbol with
    the minority symbols set: O(its entries) bytes, O(runs) work); classes
    without a row get zeros. The walk then takes each entry's flag at its
    class's next place: per entry a counter and a load, no branch. (Classes
    interleave at random along the index: a branch per entry on its class's
    code, or on a countdown to its next minority symbol, mispredicts often,
    and a countdown carries more state from one entry to the next.)

    Returns (status, bit position after the groups, number of flagged
    entries, their index slots, their positions); status -1: truncated, -2:
    the codes do not fit the index."""
    e0 = np.empty(0, np.int64)
    m = ipos.shape[0]
    goff = np.zeros(257, dtype=np.int64)
    cap = 0
    for c in range(256):
        goff[c + 1] = goff[c] + icounts[c]
        if c < t and code[c] >= 0:
            if icounts[c] == 0:
                return -2, 0, 0, e0, e0
            cap += icounts[c]
    # Slack of m + 1: an index whose counts disagree with its classes reads
    # past its class's flags but not past the buffer (and is refused below).
    flags = np.zeros(goff[256] + m + 1, dtype=np.int8)
    bp = 0
    for c in range(min(t, 256)):
        if code[c] < 0:
            continue
        n = icounts[c]
        g = goff[c]
        if code[c] == _BIN_RAW:
            if bp + n > nbits:
                return -1, 0, 0, e0, e0
            for i in range(n):
                flags[g + i] = np.int8((words[(bp + i) >> 6] >> np.uint64((bp + i) & 63)) & np.uint64(1))
            bp += n
        else:
            major = np.int8(1 if (code[c] >> 6) == 1 else 0)
            flags[g : g + n] = major
            k = code[c] & 63
            used = 0
            for _ in range(rmin[c]):
                run, bp = _rice(words, bp, k)
                used += run + 1
                if bp > nbits or used > n:
                    return -1 if bp > nbits else -2, 0, 0, e0, e0
                flags[g + used - 1] = 1 - major
    # Room for every entry plus one (a slot is written before the count
    # moves), so no bound check is needed in the loop; untouched pages of
    # np.empty cost nothing.
    in_slot = np.empty(m + 1, dtype=np.int64)
    in_pos = np.empty(m + 1, dtype=np.int64)  # their positions: the index is read in order here
    q = 0
    if cap > 0:
        nxt = goff[:256].copy()
        for j in range(m):
            c = icls[j]  # unsigned: no negative-index wraparound in the lookups
            g = nxt[c]
            nxt[c] = g + 1
            in_slot[q] = j
            in_pos[q] = ipos[j]
            q += flags[g]
        for c in range(256):  # the index's counts agree with its classes
            if nxt[c] != goff[c + 1]:
                return -2, bp, 0, e0, e0
    return 0, bp, q, in_slot[:q], in_pos[:q]


@njit(cache=True, nogil=True)
def _out_positions(words, bp, nbits, n_out, k_out, count):
    """The changes outside the index, from their gaps: (status, bit position,
    ascending chunk-relative positions)."""
    out_pos = np.empty(n_out, dtype=np.int64)
    last = -1
    for e in range(n_out):
        gap, bp = _rice(words, bp, k_out)
        if bp > nbits:
            return -1, bp, out_pos
        last = last + gap + 1
        if last >= count:
            return -2, bp, out_pos
        out_pos[e] = last
    return 0, bp, out_pos


@njit(cache=True, nogil=True)
def _merge_positions(in_slot, in_pos, out_pos):
    """The flagged index entries (slots, positions) and the outside changes
    merged ascending: (status, positions, index slot of each or -1); status
    -2: an outside change at an index entry."""
    n_in = in_slot.shape[0]
    n_out = out_pos.shape[0]
    if n_out == 0:
        return 0, in_pos, in_slot
    ne = n_in + n_out
    pos = np.empty(ne, dtype=np.int64)
    pslot = np.empty(ne, dtype=np.int64)
    a = 0
    b = 0
    for e in range(ne):
        if b >= n_out or (a < n_in and in_pos[a] < out_pos[b]):
            pos[e] = in_pos[a]
            pslot[e] = in_slot[a]
            a += 1
        else:
            p = out_pos[b]
            if a < n_in and in_pos[a] == p:
                return -2, pos, pslot
            pos[e] = p
            pslot[e] = -1
            b += 1
    return 0, pos, pslot


@intrinsic
def _prefetch(typingctx, arr, i):
    """A hint to start loading the cache line of ``arr[i]`` (for a read, into
    every cache level): LLVM's prefetch, which never faults, so ``i`` needs no
    bound check. A no-op where the target has no prefetch instruction."""
    sig = types.void(arr, i)

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fn = builder.module.declare_intrinsic("llvm.prefetch", fnty=ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]))
        builder.call(fn, [builder.bitcast(builder.gep(data, [args[1]]), i8p), ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return sig, codegen


# How many changes ahead _old_values asks for a line: the loads of a cold
# tensor then overlap beyond what the core's own miss buffers allow (the old
# values of the built-in model's deltas: 4.6 -> 2.2 ms per version).
_PREFETCH_AHEAD = 128


@njit(cache=True, nogil=True)
def _old_values(old, pos):
    """The old bits at the changed positions: a loop of its own, independent
    loads, so that the cache misses (the tensor is cold) overlap, each line
    asked for _PREFETCH_AHEAD changes before it is read. (Loading them in
    the walk instead stalls the walk behind the misses.)"""
    n = pos.shape[0]
    olds = np.empty(n, dtype=old.dtype)
    for e in range(min(_PREFETCH_AHEAD, n)):
        _prefetch(old, pos[e])
    for e in range(n - _PREFETCH_AHEAD):
        _prefetch(old, pos[e + _PREFETCH_AHEAD])
        olds[e] = old[pos[e]]
    for e in range(max(n - _PREFETCH_AHEAD, 0), n):
        olds[e] = old[pos[e]]
    return olds


@njit(cache=True, nogil=True)
def _repeats(pos, ctx_pos, ctx_old, ctx_new, sign_bit, full):
    """For each change (ascending positions) that repeats one of the context
    (ascending positions ``ctx_pos``), the sign of that earlier step (0/1),
    else -1; and the number of repeats."""
    ne = pos.shape[0]
    prev = np.full(ne, -1, dtype=np.int8)
    m_ctx = ctx_pos.shape[0]
    n_rep = 0
    other = full ^ sign_bit
    e = 0
    j = 0
    # A merge without branches on the data (which of the two lists moves
    # is a coin toss): both move on a match.
    while e < ne and j < m_ctx:
        p = pos[e]
        x = ctx_pos[j]
        o = np.int64(ctx_old[j])
        n = np.int64(ctx_new[j])
        hit = np.int64(p == x)
        down = np.int64((n ^ (sign_bit ^ (other * ((n & sign_bit) != 0)))) < (o ^ (sign_bit ^ (other * ((o & sign_bit) != 0)))))  # _ordered_key
        prev[e] = np.int8(hit * (down + 1) - 1)  # a later pass at e rewrites it only when e did not move
        n_rep += hit
        e += np.int64(p <= x)
        j += np.int64(x <= p)
    return prev, n_rep


@njit(cache=True, nogil=True)
def _signs(prev, flips, nsign):
    """Each change's sign (1: a step down): a repeat's is its previous sign
    (``prev``, from _repeats) flipped by the next flip bit, a new change's
    the next new-sign bit. The repeats and the new changes are listed first
    and the bits scattered to them, so no loop picks per change between two
    counters (a select the compiler may turn into a branch on "repeat?", a
    coin toss).
    """
    ne = prev.shape[0]
    negs = np.empty(ne, dtype=np.int8)
    reps = np.empty(ne + 1, dtype=np.int64)
    news = np.empty(ne + 1, dtype=np.int64)
    nr = 0
    nn = 0
    for e in range(ne):
        r = np.int64(prev[e] >= 0)
        reps[nr] = e
        news[nn] = e
        nr += r
        nn += 1 - r
    for i in range(nr):
        e = reps[i]
        negs[e] = prev[e] ^ np.int8(flips[i] != 0)
    for i in range(nn):
        negs[news[i]] = np.int8(nsign[i] != 0)
    return negs


@njit(cache=True, nogil=True)
def _check_olds(olds, pslot, icls, t, shift, emask):
    """Whether the old values agree with the index: an index change must have
    the entry's class, an outside one a class at or above the threshold."""
    for e in range(olds.shape[0]):
        c = (np.int64(olds[e]) >> shift) & emask
        s = pslot[e]
        if (s >= 0 and c != np.int64(icls[s])) or (s < 0 and c < t):
            return False
    return True


@njit(cache=True, nogil=True)
def _apply_steps(out, pos, olds, negs, mrows, words, bp, nbits, et, shift, emask, sign_bit, full):
    """Magnitudes (in change order), new values, their writes to out, and the
    changes that touch an index of threshold ``et`` (as _index_events lists
    them). Returns (status, bit position, new bits, events, their count);
    status -1/-3 (see _V3_ERRORS): out is as it was (what was written is put
    back)."""
    ne = pos.shape[0]
    mk = np.full(256, -1, dtype=np.int64)
    mc = np.full(256, -1, dtype=np.int64)
    for q in range(mrows.shape[0]):
        mk[mrows[q, 0]] = mrows[q, 1]
        mc[mrows[q, 0]] = mrows[q, 2]
    news = np.empty(ne, dtype=olds.dtype)
    ev = np.empty(ne + 1, dtype=np.int64)
    nev = 0
    other = full ^ sign_bit
    rc = 0
    done = ne
    for e in range(ne):
        o = np.int64(olds[e])
        c = (o >> shift) & emask
        # Every change reads a code, kept only where its class has magnitude
        # codes (no branch on the class: classes interleave at random; the
        # stream's padding covers the read past the end).
        k = mk[c]
        has = -np.int64(k >= 0)  # all ones or 0: masks, not products, on the bit position's chain
        v, nbp = _rice(words, bp, k & 63)
        center = mc[c]
        # Median-centred classes code a zigzag offset from the centre.
        v += (center + ((v >> 1) ^ -(v & 1)) - v) & -np.int64(center >= 0)
        bp += (nbp - bp) & has
        v &= has
        step = 1 + v
        if (bp > nbits) | (v < 0):
            rc = -1 if bp > nbits else -3
            done = e
            break
        neg = np.int64(negs[e])
        key = o ^ (sign_bit ^ (other * ((o & sign_bit) != 0)))
        key += step - 2 * step * neg
        if key < 0 or key > full:
            rc = -3
            done = e
            break
        nv = key ^ (sign_bit ^ (other * ((key & sign_bit) == 0)))
        news[e] = nv
        out[pos[e]] = nv
        cn = (nv >> shift) & emask
        ev[nev] = e
        nev += (c != cn) & ((c < et) | (cn < et))
    if rc != 0:
        for e in range(done):
            out[pos[e]] = olds[e]
    return rc, bp, news, ev, nev


@njit(cache=True, nogil=True)
def _decode_v3(
    old, out, count, flags, ctx_pos, ctx_old, ctx_new, ipos, icls, icounts, t, et, rows, mrows, n_out, k_out, words, nbits, shift, emask, sign_bit, full
):
    """Decode a version-3 delta stream and apply it to out, which holds old.
    Reads the index, and old/out only at changed positions; ``ctx_pos`` are
    the context's chunk-relative positions (checked), ``et`` the threshold
    of the index the caller keeps (for the index events). Each step is a
    function of its own: numba compiles a loop in a long function with many
    live arrays several times slower.

    Returns (status, chunk-relative positions, old bits, new bits, each
    change's index slot or -1, the index events as _index_events lists them
    for ``et``, their count); status < 0: see _V3_ERRORS, and out is as it
    was (what was written is put back)."""
    no_pos = np.empty(0, dtype=np.int64)
    no_bits = np.empty(0, dtype=old.dtype)
    code = np.full(_NGROUPS, -1, dtype=np.int64)  # -1: no row (default symbol)
    rmin = np.zeros(_NGROUPS, dtype=np.int64)
    for q in range(rows.shape[0]):
        code[rows[q, 0]] = rows[q, 1]
        rmin[rows[q, 0]] = rows[q, 2]
    # 1. The flagged index entries, ascending; 2. the changes outside the
    # index; 3. both merged.
    st, bp, n_in, in_slot, in_pos = _walk_index(ipos, icls, icounts, t, code, rmin, words, nbits)
    if st != 0:
        return st, no_pos, no_bits, no_bits, no_pos, no_pos, 0
    st, bp, out_pos = _out_positions(words, bp, nbits, n_out, k_out, count)
    if st != 0:
        return st, no_pos, no_bits, no_bits, no_pos, no_pos, 0
    st, pos, pslot = _merge_positions(in_slot, in_pos, out_pos)
    if st != 0:
        return st, no_pos, no_bits, no_bits, no_pos, no_pos, 0
    # 4. Signs: flips of repeats (in the context list), signs of new changes.
    ne = pos.shape[0]
    if ctx_pos.shape[0] == 0:
        # No context (what the service sends): no repeats, and the new-sign
        # bits are the changes' signs in order, read straight into place.
        negs = np.empty(ne, dtype=np.int8)
        bp = _read_signs(words, bp, nbits, negs[:0], 0, code[_G_FLIP], rmin[_G_FLIP])
        if bp < 0:
            return -1, no_pos, no_bits, no_bits, no_pos, no_pos, 0
        bp = _read_signs(words, bp, nbits, negs, ne, code[_G_NEWSIGN], rmin[_G_NEWSIGN])
    else:
        prev, n_rep = _repeats(pos, ctx_pos, ctx_old, ctx_new, sign_bit, full)
        flips = np.empty(n_rep, dtype=np.int8)
        nsign = np.empty(ne - n_rep, dtype=np.int8)
        bp = _read_signs(words, bp, nbits, flips, n_rep, code[_G_FLIP], rmin[_G_FLIP])
        if bp < 0:
            return -1, no_pos, no_bits, no_bits, no_pos, no_pos, 0
        bp = _read_signs(words, bp, nbits, nsign, ne - n_rep, code[_G_NEWSIGN], rmin[_G_NEWSIGN])
        negs = _signs(prev, flips, nsign)
    if bp < 0:
        return -1, no_pos, no_bits, no_bits, no_pos, no_pos, 0
    # 5. The old values, checked against the index; 6. the new ones, written.
    olds = _old_values(old, pos)
    if flags & _FLAG_INDEX and not _check_olds(olds, pslot, icls, t, shift, emask):
        return -5, no_pos, no_bits, no_bits, no_pos, no_pos, 0
    rc, bp, news, ev, nev = _apply_steps(out, pos, olds, negs, mrows, words, bp, nbits, et, shift, emask, sign_bit, full)
    if rc == 0 and nbits - bp >= 8:
        rc = -4
        for e in range(ne):
            out[pos[e]] = olds[e]
    if rc != 0:
        return rc, no_pos, no_bits, no_bits, no_pos, no_pos, 0
    return 0, pos, olds, news, pslot, ev, nev


@njit(cache=True, nogil=True)
def _context3_rel(pos, old, new, start, count):
    """_context3's status, chunk-relative positions and fingerprint (not the
    signs: the decoder reads those at the repeats only), in loops without a
    branch or a dependency from one change to the next, which the compiler
    vectorises."""
    m = pos.shape[0]
    rel = np.empty(m, dtype=np.int64)
    for j in range(m):
        rel[j] = pos[j] - start
    bad = m > 0 and (rel[0] < 0 or rel[m - 1] >= count)
    for j in range(1, m):
        bad |= rel[j] <= rel[j - 1]
    if bad:
        return -1, rel, np.int64(0)
    h = np.uint64(0)
    for j in range(m):
        h += _mix(_mix(np.uint64(rel[j])) ^ ((np.uint64(old[j]) << np.uint64(32)) | np.uint64(new[j])))
    x = _mix(h + _mix(np.uint64(m)))
    return 0, rel, np.int64((x ^ (x >> np.uint64(32))) & np.uint64(0xFFFFFFFF))


@njit(cache=True, nogil=True)
def _decode_chunk3(body, src, dst, start, count, has_ctx, ctx_pos, ctx_old, ctx_new, has_idx, ipos, icls, icounts, ih, ifp, it, shift, emask, sign_bit, full):
    """Decode a version-3 delta body (uint8) onto dst (holding the base src of
    the chunk starting at element ``start``) in one call: the head, the
    context's and the index's checks, the bit stream, and the index update.

    Returns (status, what the payload names: context count and fingerprint,
    index threshold, count and fingerprint; absolute positions, old bits, new
    bits; the updated index: positions, classes, counts, hash, fingerprint). status < 0:
    see _HEAD3_ERRORS / _V3_ERRORS; nothing is written unless status is 0."""
    no_pos = np.empty(0, dtype=np.int64)
    no_bits = np.empty(0, dtype=src.dtype)
    st, flags, ctx_count, cfp, t, icount, pfp, n_out, k_out, rows, mrows, off = _parse_head3(body, count, emask)
    if st != 0:
        return st, ctx_count, cfp, t, icount, pfp, no_pos, no_bits, no_bits, ipos, icls, icounts, ih, ifp
    rel = np.empty(0, dtype=np.int64)
    if flags & _FLAG_CONTEXT:
        if not has_ctx:
            return -20, ctx_count, cfp, t, icount, pfp, no_pos, no_bits, no_bits, ipos, icls, icounts, ih, ifp
        st, rel, got = _context3_rel(ctx_pos, ctx_old, ctx_new, start, count)
        if st != 0:
            return -21, ctx_count, cfp, t, icount, pfp, no_pos, no_bits, no_bits, ipos, icls, icounts, ih, ifp
        if rel.shape[0] != ctx_count or got != cfp:
            return -22, ctx_count, cfp, t, icount, pfp, no_pos, no_bits, no_bits, ipos, icls, icounts, ih, ifp
    if flags & _FLAG_INDEX:
        if not has_idx:
            return -23, ctx_count, cfp, t, icount, pfp, no_pos, no_bits, no_bits, ipos, icls, icounts, ih, ifp
        if it != t or ipos.shape[0] != icount or ifp != pfp:
            return -24, ctx_count, cfp, t, icount, pfp, no_pos, no_bits, no_bits, ipos, icls, icounts, ih, ifp
    words, nbits = _body_words(body, off)
    rc, pos, olds, news, slot, ev, nev = _decode_v3(
        src, dst, count, flags, rel, ctx_old, ctx_new, ipos, icls, icounts, t, it, rows, mrows, n_out, k_out, words, nbits, shift, emask, sign_bit, full
    )
    if rc != 0:
        return rc, ctx_count, cfp, t, icount, pfp, no_pos, no_bits, no_bits, ipos, icls, icounts, ih, ifp
    npos, ncls, ncounts, nh, nfp = ipos, icls, icounts, ih, ifp
    if has_idx:
        if not flags & _FLAG_INDEX:  # coded without the index: find the slots
            st, slot = _find_slots(ipos, icls, it, pos, olds, shift, emask)
            if st != 0:  # the index does not describe the base: undo the writes
                for e in range(pos.shape[0]):
                    dst[pos[e]] = olds[e]
                return -5, ctx_count, cfp, t, icount, pfp, no_pos, no_bits, no_bits, ipos, icls, icounts, ih, ifp
        npos, ncls, ncounts, nh = _apply_events(ipos, icls, icounts, ih, it, pos, olds, news, slot, ev, nev, shift, emask)
        if nh != ih or npos.shape[0] != ipos.shape[0]:
            nfp = _index_fingerprint(nh, npos.shape[0], it)
    for e in range(pos.shape[0]):
        pos[e] += start
    return 0, ctx_count, cfp, t, icount, pfp, pos, olds, news, npos, ncls, ncounts, nh, nfp


_HEAD3_ERRORS = {
    -10: "truncated delta body (flags)",
    -11: "unknown delta flags",
    -12: "delta context count or fingerprint is corrupt or truncated",
    -13: "delta outside-change count or gap parameter is corrupt or truncated",
    -14: "delta binary group table is corrupt or truncated",
    -15: "delta magnitude table is corrupt or truncated",
    -16: "delta index threshold, count or fingerprint is corrupt or truncated",
}

_V3_ERRORS = {
    -1: "delta bit stream is truncated",
    -2: "delta positions are out of order, outside the chunk or disagree with the index (corrupt payload or wrong index)",
    -3: "delta step leaves the value grid (corrupt payload, wrong base or wrong context)",
    -4: "delta bit stream has trailing bytes",
    -5: "the position index does not describe the base values at the changed positions (wrong base or stale index)",
}
