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

import numpy as np
from numba import njit

from services.weightsync.codec import context_kernels as _k2
from services.weightsync.codec import kernels as _k1
from services.weightsync.codec.context_kernels import _bin_cost, _mag_rows, _put_bins, _read_bins, _read_runs, _uv, _zigzag
from services.weightsync.codec.format import _BIN_RAW, _FLAG_CONTEXT, _FLAG_INDEX, _G_FLIP, _G_NEWSIGN, _NGROUPS, _PAD, _QMAX, _RAW_BITS
from services.weightsync.codec.kernels import _best_k, _get_rice, _ordered_key, _put_rice

# See the note in kernels.py: numba freezes these into its cached kernels.
if (_NGROUPS, _G_FLIP, _G_NEWSIGN, _BIN_RAW, _FLAG_CONTEXT, _FLAG_INDEX, _QMAX, _RAW_BITS, _PAD) != (258, 256, 257, 0x80, 1, 2, 24, 40, 40):
    raise ImportError("codec format constants changed: update index_kernels.py too (numba cache)")

_SHARED_1 = ("_ordered_key", "_rice_cost", "_best_k", "_put", "_put_rice", "_ctz", "_peek", "_get_rice")
_SHARED_2 = ("_zigzag", "_rice_total", "_bin_cost", "_put_bins", "_read_bins", "_read_runs", "_uv", "_mag_rows")
_SHARED_DIGEST = "af8707c04f8948ba"


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
def _apply_slots(ipos, icls, icounts, ih, t, rel, old, new, slot, shift, emask):
    """The index after the changes, given each change's slot (_find_slots):
    elements whose class changed are updated, those that crossed the
    threshold enter or leave. O(changes) when none crossed (plus a copy of
    the classes if one changed class), O(index + changes) otherwise. Returns
    (positions, classes, counts, hash); unchanged arrays are returned as they
    are (not copied)."""
    m = ipos.shape[0]
    ne = rel.shape[0]
    counts = icounts.copy()  # 256 entries
    h = ih
    cnew = np.empty(ne, dtype=np.int64)
    n_ins = 0
    n_del = 0
    n_mod = 0
    for e in range(ne):
        p = rel[e]
        co = (np.int64(old[e]) >> shift) & emask
        cn = (np.int64(new[e]) >> shift) & emask
        cnew[e] = cn
        if co == cn or (co >= t and cn >= t):
            continue
        if co < t:
            counts[co] -= 1
            h -= _entry_hash(p, co)
        if cn < t:
            counts[cn] += 1
            h += _entry_hash(p, cn)
        if co < t and cn < t:
            n_mod += 1
        elif co < t:
            n_del += 1
        else:
            n_ins += 1
    if n_ins == 0 and n_del == 0:
        if n_mod == 0:
            return ipos, icls, icounts, ih
        cls = icls.copy()  # same entries, some classes differ
        for e in range(ne):
            if slot[e] >= 0:
                cls[slot[e]] = cnew[e]
        return ipos, cls, counts, h
    npos = np.empty(m + n_ins - n_del, dtype=np.int64)
    ncls = np.empty(m + n_ins - n_del, dtype=np.uint8)
    k = 0
    j = 0
    for e in range(ne):
        if slot[e] < 0 and cnew[e] >= t:
            continue  # stays outside
        p = rel[e]
        while j < m and ipos[j] < p:
            npos[k] = ipos[j]
            ncls[k] = icls[j]
            k += 1
            j += 1
        if slot[e] >= 0:
            j += 1  # the entry itself: rewritten below or dropped
        if cnew[e] < t:
            npos[k] = p
            ncls[k] = cnew[e]
            k += 1
    while j < m:
        npos[k] = ipos[j]
        ncls[k] = icls[j]
        k += 1
        j += 1
    return npos, ncls, counts, h


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


@njit(cache=True, nogil=True)
def _read_group(words, bp, nbits, dst, n, code, r):
    """Read a binary group written by _put_bins into dst[:n]; new bit position or -1."""
    if code == _BIN_RAW:
        return _read_bins(words, bp, nbits, dst, n, code)
    return _read_runs(words, bp, nbits, dst, n, code, r)


_BIG = np.int64(1) << 62  # a countdown that never ends


@njit(cache=True, nogil=True)
def _walk_index(ipos, icls, icounts, t, code, rmin, words, nbits):
    """Read the class groups (classes below t with a row in ``code``) and walk
    the index once. Every group becomes runs first (a raw group: the runs of
    0 before each 1, O(its bits)), so that each entry costs the same few
    branch-free operations: per class a countdown to its next minority
    symbol; the entry is flagged when the countdown is at 0 xor the class's
    majority is 1. (Classes interleave at random along the index: a branch
    per entry on its class's code mispredicts often, which cost 3x.)

    Returns (status, bit position after the groups, number of flagged
    entries, their index slots); status -1: truncated, -2: the codes do not
    fit the index."""
    e0 = np.empty(0, np.int64)
    dense = np.zeros(256, dtype=np.int64)  # 1: majority symbol 1 (flag unless at a minority)
    rem = np.full(256, _BIG, dtype=np.int64)  # classes without a row: never flagged
    rptr = np.zeros(256, dtype=np.int64)
    rend = np.zeros(256, dtype=np.int64)
    nruns = 0
    cap = 0
    for c in range(min(t, 256)):
        if code[c] >= 0:
            if icounts[c] == 0:
                return -2, 0, 0, e0
            cap += icounts[c]
            nruns += icounts[c] if code[c] == _BIN_RAW else rmin[c]
    runs = np.empty(nruns, dtype=np.int64)
    bp = 0
    q = 0
    for c in range(min(t, 256)):
        if code[c] < 0:
            continue
        n = icounts[c]
        rptr[c] = q
        if code[c] == _BIN_RAW:
            if bp + n > nbits:
                return -1, 0, 0, e0
            run = 0
            for i in range(n):
                if (words[(bp + i) >> 6] >> np.uint64((bp + i) & 63)) & np.uint64(1):
                    runs[q] = run
                    q += 1
                    run = 0
                else:
                    run += 1
            bp += n
        else:
            dense[c] = 1 if (code[c] >> 6) == 1 else 0
            k = code[c] & 63
            used = 0
            for _ in range(rmin[c]):
                run, bp = _get_rice(words, bp, k)
                used += run + 1
                if bp > nbits or used > n:
                    return -1 if bp > nbits else -2, 0, 0, e0
                runs[q] = run
                q += 1
        rend[c] = q
        if rptr[c] < q:
            rem[c] = runs[rptr[c]]
            rptr[c] += 1
    m = ipos.shape[0]
    # Room for every entry plus one (a slot is written before the count
    # moves), so no bound check is needed in the loop; untouched pages of
    # np.empty cost nothing.
    in_slot = np.empty(m + 1, dtype=np.int64)
    q = 0
    if cap > 0:
        for j in range(m):
            c = icls[j]  # unsigned: no negative-index wraparound in the lookups
            r = rem[c]
            in_slot[q] = j
            q += (r == 0) ^ dense[c]
            if r == 0:  # a minority symbol (rare): load the next run
                p = rptr[c]
                if p < rend[c]:
                    rem[c] = runs[p]
                    rptr[c] = p + 1
                else:
                    rem[c] = _BIG
            else:
                rem[c] = r - 1
        if q > cap:
            return -2, bp, 0, e0
        for c in range(min(t, 256)):  # every minority symbol was met
            if code[c] >= 0 and (rptr[c] != rend[c] or rem[c] < _BIG // 2):
                return -2, bp, 0, e0
    return 0, bp, q, in_slot[:q]


@njit(cache=True, nogil=True)
def _decode_v3(old, out, count, flags, ctx_pos, ctx_neg, ipos, icls, icounts, t, rows, mrows, n_out, k_out, words, nbits, shift, emask, sign_bit, full):
    """Decode a version-3 delta stream and apply it to out, which holds old.
    Reads the index, and old/out only at changed positions. Returns (status,
    chunk-relative positions, old bits, new bits, each change's index slot or
    -1); status < 0: see _V3_ERRORS, and out is as it was (what was written
    is put back)."""
    no_pos = np.empty(0, dtype=np.int64)
    no_bits = np.empty(0, dtype=old.dtype)
    code = np.full(_NGROUPS, -1, dtype=np.int64)  # -1: no row (default symbol)
    rmin = np.zeros(_NGROUPS, dtype=np.int64)
    for q in range(rows.shape[0]):
        code[rows[q, 0]] = rows[q, 1]
        rmin[rows[q, 0]] = rows[q, 2]
    # 1. The class groups' codes: runs are expanded (O(minority symbols)),
    # raw groups only located; then one walk of the index finds the flagged
    # entries, ascending.
    st, bp, n_in, in_slot = _walk_index(ipos, icls, icounts, t, code, rmin, words, nbits)
    if st != 0:
        return st, no_pos, no_bits, no_bits, in_slot
    # 2. Changes outside the index, from their gaps.
    out_pos = np.empty(n_out, dtype=np.int64)
    last = -1
    for e in range(n_out):
        gap, bp = _get_rice(words, bp, k_out)
        if bp > nbits:
            return -1, no_pos, no_bits, no_bits, no_pos
        last = last + gap + 1
        if last >= count:
            return -2, no_pos, no_bits, no_bits, no_pos
        out_pos[e] = last
    # 3. Merge (ascending), remembering which came from the index, and find
    # the repeats of the context's changes (their previous sign: 0/1, else -1).
    ne = n_in + n_out
    pos = np.empty(ne, dtype=np.int64)
    pslot = np.empty(ne, dtype=np.int64)  # index slot, -1 outside
    prev = np.empty(ne, dtype=np.int8)
    m_ctx = ctx_pos.shape[0]
    n_rep = 0
    jj = 0
    a = 0
    b = 0
    for e in range(ne):
        if b >= n_out or (a < n_in and ipos[in_slot[a]] < out_pos[b]):
            p = ipos[in_slot[a]]
            pslot[e] = in_slot[a]
            a += 1
        else:
            p = out_pos[b]
            if a < n_in and ipos[in_slot[a]] == p:
                return -2, no_pos, no_bits, no_bits, no_pos  # an outside change at an index entry
            pslot[e] = -1
            b += 1
        pos[e] = p
        while jj < m_ctx and ctx_pos[jj] < p:
            jj += 1
        if jj < m_ctx and ctx_pos[jj] == p:
            prev[e] = 1 if ctx_neg[jj] else 0
            n_rep += 1
        else:
            prev[e] = -1
    # 4. Signs: flips of repeats (in the context list), signs of new changes.
    flips = np.zeros(n_rep, dtype=np.int64)
    nsign = np.zeros(ne - n_rep, dtype=np.int64)
    for g in range(_G_FLIP, _NGROUPS):
        if code[g] >= 0:
            dst = flips if g == _G_FLIP else nsign
            bp = _read_group(words, bp, nbits, dst, dst.shape[0], code[g], rmin[g])
            if bp < 0:
                return -1, no_pos, no_bits, no_bits, no_pos
    neg = np.empty(ne, dtype=np.int8)
    a = 0
    b = 0
    for e in range(ne):
        if prev[e] >= 0:
            neg[e] = prev[e] ^ (1 if flips[a] != 0 else 0)
            a += 1
        else:
            neg[e] = 1 if nsign[b] != 0 else 0
            b += 1
    # 5. The old values (a loop of its own: independent loads, so the cache
    # misses overlap), checked against the index: an index change must have
    # the entry's class, an outside one a class at or above the threshold.
    olds = np.empty(ne, dtype=old.dtype)
    for e in range(ne):
        olds[e] = old[pos[e]]
    if flags & _FLAG_INDEX:
        for e in range(ne):
            c = (np.int64(olds[e]) >> shift) & emask
            if (pslot[e] >= 0 and c != np.int64(icls[pslot[e]])) or (pslot[e] < 0 and c < t):
                return -5, no_pos, no_bits, no_bits, no_pos
    # 6. Magnitudes (change order), new values, writes; a bad value puts back
    # what was written.
    mk = np.full(256, -1, dtype=np.int64)
    mc = np.full(256, -1, dtype=np.int64)
    for q in range(mrows.shape[0]):
        mk[mrows[q, 0]] = mrows[q, 1]
        mc[mrows[q, 0]] = mrows[q, 2]
    news = np.empty(ne, dtype=old.dtype)
    other = full ^ sign_bit
    rc = 0
    done = ne
    for e in range(ne):
        o = np.int64(olds[e])
        c = (o >> shift) & emask
        step = np.int64(1)
        k = mk[c]
        if k >= 0:
            v, bp = _get_rice(words, bp, k)
            center = mc[c]
            if center >= 0:
                v = center + ((v >> 1) if (v & 1) == 0 else -((v + 1) >> 1))
            if bp > nbits or v < 0:
                rc = -1 if bp > nbits else -3
                done = e
                break
            step = v + 1
        key = o ^ (sign_bit ^ (other * ((o & sign_bit) != 0)))
        key += step - 2 * step * np.int64(neg[e])
        if key < 0 or key > full:
            rc = -3
            done = e
            break
        nv = key ^ (sign_bit ^ (other * ((key & sign_bit) == 0)))
        news[e] = nv
        out[pos[e]] = nv
    if rc == 0 and nbits - bp >= 8:
        rc = -4
    if rc != 0:
        for e in range(done):
            out[pos[e]] = olds[e]
        return rc, no_pos, no_bits, no_bits, no_pos
    return 0, pos, olds, news, pslot


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
    neg = np.empty(0, dtype=np.bool_)
    if flags & _FLAG_CONTEXT:
        if not has_ctx:
            return -20, ctx_count, cfp, t, icount, pfp, no_pos, no_bits, no_bits, ipos, icls, icounts, ih, ifp
        st, rel, neg, got = _context3(ctx_pos, ctx_old, ctx_new, start, count, sign_bit, full)
        if st != 0:
            return -21, ctx_count, cfp, t, icount, pfp, no_pos, no_bits, no_bits, ipos, icls, icounts, ih, ifp
        if rel.shape[0] != ctx_count or got != cfp:
            return -22, ctx_count, cfp, t, icount, pfp, no_pos, no_bits, no_bits, ipos, icls, icounts, ih, ifp
    if flags & _FLAG_INDEX:
        if not has_idx:
            return -23, ctx_count, cfp, t, icount, pfp, no_pos, no_bits, no_bits, ipos, icls, icounts, ih, ifp
        if it != t or ipos.shape[0] != icount or ifp != pfp:
            return -24, ctx_count, cfp, t, icount, pfp, no_pos, no_bits, no_bits, ipos, icls, icounts, ih, ifp
    nb = body.shape[0] - off
    words = np.zeros((nb + _PAD + 7) // 8, dtype=np.uint64)
    for i in range(nb):  # little-endian words, whatever the host
        words[i >> 3] |= np.uint64(body[off + i]) << np.uint64(8 * (i & 7))
    rc, pos, olds, news, slot = _decode_v3(src, dst, count, flags, rel, neg, ipos, icls, icounts, t, rows, mrows, n_out, k_out, words, 8 * nb, shift, emask, sign_bit, full)
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
        npos, ncls, ncounts, nh = _apply_slots(ipos, icls, icounts, ih, it, pos, olds, news, slot, shift, emask)
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
