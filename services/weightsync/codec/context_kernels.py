"""The numba kernels of format version 2 (see format.py): deltas whose changed
positions are coded against the previous delta's change list, so that decoding
costs O(changes) and never reads an unchanged element.

Bit I/O (Rice codes, the LSB-first word stream) is shared with kernels.py.
"""

from __future__ import annotations

import hashlib
import inspect

import numpy as np
from numba import njit

from services.weightsync.codec import kernels as _k1

from services.weightsync.codec.format import _BIN_RAW, _FLAG_CONTEXT, _G_FLIP, _G_NEWSIGN, _NGROUPS, _QMAX, _RAW_BITS
from services.weightsync.codec.kernels import _best_k, _body_words, _get_rice, _ordered_key, _peek, _put, _put_rice, _uv

# See the note in kernels.py: numba freezes these into its cached kernels.
if (_NGROUPS, _G_FLIP, _G_NEWSIGN, _BIN_RAW, _FLAG_CONTEXT, _QMAX, _RAW_BITS) != (258, 256, 257, 0x80, 1, 24, 40):
    raise ImportError("codec format constants changed: update context_kernels.py too (numba cache)")

# The helpers below are compiled into this file's cached kernels, and numba's
# cache only notices edits to this file: an edit to them in kernels.py alone
# would leave stale machine code running here. Pinning their source makes it
# an import error instead (update the digest, which also refreshes the cache).
_SHARED = ("_ordered_key", "_rice_cost", "_best_k", "_put", "_put_rice", "_ctz", "_peek", "_get_rice", "_uv", "_body_words")
_SHARED_DIGEST = "d46b81cbd5efe012"
if hashlib.sha256("".join(inspect.getsource(getattr(_k1, n).py_func) for n in _SHARED).encode()).hexdigest()[:16] != _SHARED_DIGEST:
    raise ImportError("kernels.py bit I/O helpers changed: update _SHARED_DIGEST in context_kernels.py (numba cache)")


@njit(cache=True, nogil=True)
def _fingerprint(pos, old, new):
    """32-bit fingerprint of a change list (chunk-relative positions, old and
    new bits): FNV-1a over 64-bit words. One sequential pass, O(changes)."""
    h = np.uint64(0xCBF29CE484222325)
    prime = np.uint64(0x100000001B3)
    h = (h ^ np.uint64(pos.shape[0])) * prime
    for j in range(pos.shape[0]):
        h = (h ^ np.uint64(pos[j])) * prime
        h = (h ^ ((np.uint64(old[j]) << np.uint64(32)) | np.uint64(new[j]))) * prime
    return np.int64((h ^ (h >> np.uint64(32))) & np.uint64(0xFFFFFFFF))


@njit(cache=True, nogil=True)
def _context_features(pos, old, new, start, count, shift, emask, sign_bit, full):
    """A context change list (absolute positions) as the coder uses it:
    chunk-relative positions, per change its group (the old exponent of *this*
    delta = the context's new exponent) and its step sign, and the list's
    fingerprint. Status -1 when the positions are not strictly ascending
    inside [start, start + count)."""
    m = pos.shape[0]
    rel = np.empty(m, dtype=np.int64)
    grp = np.empty(m, dtype=np.int64)
    neg = np.empty(m, dtype=np.bool_)
    last = -1
    for j in range(m):
        p = pos[j] - start
        if p <= last or p >= count:
            return -1, rel, grp, neg, 0
        last = p
        rel[j] = p
        grp[j] = (np.int64(new[j]) >> shift) & emask
        neg[j] = _ordered_key(np.int64(new[j]), sign_bit, full) < _ordered_key(np.int64(old[j]), sign_bit, full)
    return 0, rel, grp, neg, _fingerprint(rel, old, new)


@njit(cache=True, nogil=True, inline="always")
def _zigzag(x):
    """Signed -> unsigned: 0, -1, 1, -2, 2 ... -> 0, 1, 2, 3, 4 ..."""
    return 2 * x if x >= 0 else -2 * x - 1


@njit(cache=True, nogil=True)
def _rice_total(values, k):
    """Bits of the Rice(k) codes of values (with the escape of format.py)."""
    total = 0
    for v in values:
        q = v >> k
        total += (_QMAX + _RAW_BITS) if q >= _QMAX else q + 1 + k
    return total


@njit(cache=True, nogil=True)
def _diff_positions(new, old, new64, old64):
    """Positions where new != old, ascending; compares four elements per word
    when word views (see kernels.py) are given."""
    n = new.shape[0]
    out = np.empty(n, dtype=np.int64)  # untouched pages of np.empty cost nothing
    ne = 0
    start = 0
    if new64 is not None:
        for j in range(new64.shape[0]):
            if new64[j] != old64[j]:
                for lane in range(4):
                    i = 4 * j + lane
                    if new[i] != old[i]:
                        out[ne] = i
                        ne += 1
        start = 4 * new64.shape[0]
    for i in range(start, n):
        if new[i] != old[i]:
            out[ne] = i
            ne += 1
    return out[:ne].copy()


@njit(cache=True, nogil=True)
def _bin_cost(bits, n):
    """Cheapest code of n binary symbols: (code byte, minority count, cost in
    bits). Code _BIN_RAW: n raw bits; else (majority << 6) | k: the Rice(k)
    coded runs of the majority symbol before each minority symbol."""
    ones = 0
    for j in range(n):
        ones += bits[j]
    major = 1 if 2 * ones >= n else 0
    r = ones if major == 0 else n - ones
    if r == 0:
        return np.int64(major << 6), np.int64(0), np.int64(8)
    runs = np.empty(r, dtype=np.int64)
    run = 0
    q = 0
    for j in range(n):
        if bits[j] == major:
            run += 1
        else:
            runs[q] = run
            q += 1
            run = 0
    k = _best_k(runs, r, _RAW_BITS)
    cost = 16  # code byte and a short varint
    for j in range(r):
        rq = runs[j] >> k
        cost += (_QMAX + _RAW_BITS) if rq >= _QMAX else rq + 1 + k
    if n + 8 <= cost:
        return np.int64(_BIN_RAW), np.int64(0), np.int64(n + 8)
    return np.int64((major << 6) | k), np.int64(r), np.int64(cost)


@njit(cache=True, nogil=True)
def _put_bins(words, acc, state, bits, n, code):
    """Write n binary symbols with a code chosen by _bin_cost."""
    if code == _BIN_RAW:
        for j in range(n):
            _put(words, acc, state, bits[j], 1)
        return
    major = code >> 6
    k = code & 63
    run = 0
    for j in range(n):
        if bits[j] == major:
            run += 1
        else:
            _put_rice(words, acc, state, run, k)
            run = 0


@njit(cache=True, nogil=True)
def _mag_rows(cls, steps, ne):
    """Magnitude table of formats 2 and 3: per old-exponent class with a change
    of more than one step, [class, k, centre] with centre -1 for plain
    Rice(|steps| - 1), else Rice of the zigzag distance to the class median."""
    ccount = np.zeros(256, dtype=np.int64)
    for e in range(ne):
        ccount[cls[e]] += 1
    coff = np.zeros(257, dtype=np.int64)
    for c in range(256):
        coff[c + 1] = coff[c] + ccount[c]
    mags = np.empty(ne, dtype=np.int64)
    cfill = coff[:-1].copy()
    for e in range(ne):
        c = cls[e]
        mags[cfill[c]] = abs(steps[e]) - 1
        cfill[c] += 1
    # Per class either Rice(|steps| - 1) or, when the steps bunch around a typical size
    # (tiny weights move by ~lr / grid spacing steps each time), Rice of the zigzag
    # distance to the class median, which costs less.
    mrows = np.empty((256, 3), dtype=np.int64)
    nm = 0
    for c in range(256):
        if ccount[c] == 0:
            continue
        seg = mags[coff[c] : coff[c + 1]]
        if seg.max() == 0:
            continue
        n = ccount[c]
        kp = _best_k(seg, n, 32)
        center = np.int64(np.median(seg))
        zz = np.empty(n, dtype=np.int64)
        for q in range(n):
            zz[q] = _zigzag(seg[q] - center)
        kc = _best_k(zz, n, 32)
        mrows[nm, 0] = c
        if center > 0 and _rice_total(zz, kc) + 24 < _rice_total(seg, kp):
            mrows[nm, 1] = kc
            mrows[nm, 2] = center
        else:
            mrows[nm, 1] = kp
            mrows[nm, 2] = -1
        nm += 1
    return mrows[:nm].copy()


@njit(cache=True, nogil=True)
def _encode_v2(new, old, pos, ctx_pos, ctx_grp, ctx_neg, shift, emask, sign_bit, full):
    """Code a chunk's changes (positions pos, from _diff_positions) against the
    context (empty arrays: none).

    Returns (n_new, k_new, table rows [group, code, minority count], magnitude
    table rows [class, k], stream words, stream bits, changed positions, their
    old bits, their new bits)."""
    ne = pos.shape[0]
    m = ctx_pos.shape[0]
    # Merge the changes with the context: which context changes changed again
    # (in context order), and for each change whether it repeats one.
    again = np.zeros(m, dtype=np.int64)
    rep_of = np.full(ne, -1, dtype=np.int64)
    j = 0
    for e in range(ne):
        p = pos[e]
        while j < m and ctx_pos[j] < p:
            j += 1
        if j < m and ctx_pos[j] == p:
            again[j] = 1
            rep_of[e] = j
    steps = np.empty(ne, dtype=np.int64)
    cls = np.empty(ne, dtype=np.int64)
    olds = np.empty(ne, dtype=old.dtype)
    news = np.empty(ne, dtype=new.dtype)
    n_new = 0
    n_rep = 0
    for e in range(ne):
        i = pos[e]
        o = np.int64(old[i])
        olds[e] = old[i]
        news[e] = new[i]
        steps[e] = _ordered_key(np.int64(new[i]), sign_bit, full) - _ordered_key(o, sign_bit, full)
        cls[e] = (o >> shift) & emask
        if rep_of[e] < 0:
            n_new += 1
        else:
            n_rep += 1
    # Binary groups: again flags per context exponent, sign flips of repeats,
    # signs of new changes.
    gsize = np.zeros(_NGROUPS, dtype=np.int64)
    for jj in range(m):
        gsize[ctx_grp[jj]] += 1
    gsize[_G_FLIP] = n_rep
    gsize[_G_NEWSIGN] = n_new
    goff = np.zeros(_NGROUPS + 1, dtype=np.int64)
    for g in range(_NGROUPS):
        goff[g + 1] = goff[g] + gsize[g]
    gbits = np.empty(goff[_NGROUPS], dtype=np.int64)
    gfill = goff[:-1].copy()
    for jj in range(m):
        g = ctx_grp[jj]
        gbits[gfill[g]] = again[jj]
        gfill[g] += 1
    new_gaps = np.empty(n_new, dtype=np.int64)
    last = -1
    q = 0
    for e in range(ne):
        negative = 1 if steps[e] < 0 else 0
        if rep_of[e] < 0:
            gbits[gfill[_G_NEWSIGN]] = negative
            gfill[_G_NEWSIGN] += 1
            new_gaps[q] = pos[e] - last - 1
            last = pos[e]
            q += 1
        else:
            gbits[gfill[_G_FLIP]] = 1 if negative != (1 if ctx_neg[rep_of[e]] else 0) else 0
            gfill[_G_FLIP] += 1
    # Choose codes; groups left out of the table hold their default symbol
    # (again: 1, flip and new sign: 0).
    rows = np.empty((_NGROUPS, 3), dtype=np.int64)
    nrows = 0
    for g in range(_NGROUPS):
        n = gsize[g]
        if n == 0:
            continue
        code, r, _ = _bin_cost(gbits[goff[g] : goff[g + 1]], n)
        default = 1 if g < _G_FLIP else 0
        if code != _BIN_RAW and r == 0 and (code >> 6) == default:
            continue
        rows[nrows, 0] = g
        rows[nrows, 1] = code
        rows[nrows, 2] = r
        nrows += 1
    k_new = _best_k(new_gaps, n_new, _RAW_BITS)
    # Magnitudes |steps| - 1 per old exponent class; classes left out are all +-1.
    mrows = _mag_rows(cls, steps, ne)
    nm = mrows.shape[0]
    # Worst case: 64 bits per Rice code (gaps, magnitudes, runs), one per bit.
    cap = (goff[_NGROUPS] * 64 + ne * 128) // 64 + 4
    words = np.zeros(cap, dtype=np.uint64)
    acc = np.zeros(1, dtype=np.uint64)
    state = np.zeros(2, dtype=np.int64)
    r = 0
    for g in range(_G_FLIP):  # again groups, ascending
        if r < nrows and rows[r, 0] == g:
            _put_bins(words, acc, state, gbits[goff[g] : goff[g + 1]], gsize[g], rows[r, 1])
            r += 1
    for e in range(n_new):
        _put_rice(words, acc, state, new_gaps[e], k_new)
    for g in range(_G_FLIP, _NGROUPS):
        if r < nrows and rows[r, 0] == g:
            _put_bins(words, acc, state, gbits[goff[g] : goff[g + 1]], gsize[g], rows[r, 1])
            r += 1
    # Magnitudes in change order, each with its class's code, so that the
    # decoder reads them in the same pass that visits each changed element.
    mk = np.full(256, -1, dtype=np.int64)
    mc = np.full(256, -1, dtype=np.int64)
    for t in range(nm):
        mk[mrows[t, 0]] = mrows[t, 1]
        mc[mrows[t, 0]] = mrows[t, 2]
    for e in range(ne):
        c = cls[e]
        if mk[c] >= 0:
            v = abs(steps[e]) - 1
            _put_rice(words, acc, state, _zigzag(v - mc[c]) if mc[c] >= 0 else v, mk[c])
    nbits = state[1] * 64 + state[0]
    if state[0] > 0:
        words[state[1]] = acc[0]
    return n_new, k_new, rows[:nrows].copy(), mrows[:nm].copy(), words, nbits, pos, olds, news


@njit(cache=True, nogil=True)
def _read_bins(words, pos, nbits, dst, n, code):
    """Read n binary symbols written by _put_bins into dst[:n]. Returns the new
    bit position, or -1 on overrun / a run past the end."""
    if code == _BIN_RAW:
        if pos + n > nbits:
            return -1
        for j in range(n):
            dst[j] = np.int64((_peek(words, pos + j) & np.uint64(1)))
        return pos + n
    return -1  # unreachable: runs are read by _read_runs (needs the minority count)


@njit(cache=True, nogil=True)
def _read_runs(words, pos, nbits, dst, n, code, r):
    """Read the runs form of n binary symbols with r minority symbols."""
    major = code >> 6
    k = code & 63
    j = 0
    for _ in range(r):
        run, pos = _get_rice(words, pos, k)
        if pos > nbits or run > n - j - 1:
            return -1
        for t in range(run):
            dst[j + t] = major
        j += run
        dst[j] = 1 - major
        j += 1
    for t in range(j, n):
        dst[t] = major
    return pos


@njit(cache=True, nogil=True)
def _decode_v2(old, out, count, ctx_pos, ctx_grp, ctx_neg, rows, mrows, n_new, k_new, words, nbits, shift, emask, sign_bit, full):
    """Decode a version-2 delta stream and apply it to out, which already holds
    old. Reads old and writes out only at changed positions. Returns (status,
    positions, old bits, new bits); status < 0: see _V2_ERRORS, and out is as
    it was (what was written is put back)."""
    no_pos = np.empty(0, dtype=np.int64)
    no_bits = np.empty(0, dtype=old.dtype)
    m = ctx_pos.shape[0]
    gsize = np.zeros(_NGROUPS, dtype=np.int64)
    for j in range(m):
        gsize[ctx_grp[j]] += 1
    gsize[_G_NEWSIGN] = n_new
    code = np.full(_NGROUPS, -1, dtype=np.int64)  # -1: default symbol
    rmin = np.zeros(_NGROUPS, dtype=np.int64)
    for t in range(rows.shape[0]):
        code[rows[t, 0]] = rows[t, 1]
        rmin[rows[t, 0]] = rows[t, 2]
    # 1. Again flags, expanded per group, then walked in context order.
    goff = np.zeros(_G_FLIP + 1, dtype=np.int64)
    for g in range(_G_FLIP):
        goff[g + 1] = goff[g] + gsize[g]
    flags = np.ones(m, dtype=np.int64)
    bp = 0
    for g in range(_G_FLIP):
        if code[g] >= 0:
            if code[g] == _BIN_RAW:
                bp = _read_bins(words, bp, nbits, flags[goff[g] :], gsize[g], code[g])
            else:
                bp = _read_runs(words, bp, nbits, flags[goff[g] :], gsize[g], code[g], rmin[g])
            if bp < 0:
                return -1, no_pos, no_bits, no_bits
    gptr = goff[:-1].copy()
    rep_pos = np.empty(m, dtype=np.int64)
    rep_idx = np.empty(m, dtype=np.int64)
    n_rep = 0
    for j in range(m):
        g = ctx_grp[j]
        if flags[gptr[g]]:
            rep_pos[n_rep] = ctx_pos[j]
            rep_idx[n_rep] = j
            n_rep += 1
        gptr[g] += 1
    # 2. New positions from their gaps.
    new_pos = np.empty(n_new, dtype=np.int64)
    last = -1
    for e in range(n_new):
        gap, bp = _get_rice(words, bp, k_new)
        if bp > nbits:
            return -1, no_pos, no_bits, no_bits
        last = last + gap + 1
        if last >= count:
            return -2, no_pos, no_bits, no_bits
        new_pos[e] = last
    # 3. Sign flips of repeats, signs of new changes.
    gsize[_G_FLIP] = n_rep
    flips = np.zeros(n_rep, dtype=np.int64)
    nsign = np.zeros(n_new, dtype=np.int64)
    for g in range(_G_FLIP, _NGROUPS):
        dst = flips if g == _G_FLIP else nsign
        if code[g] >= 0:
            if code[g] == _BIN_RAW:
                bp = _read_bins(words, bp, nbits, dst, gsize[g], code[g])
            else:
                bp = _read_runs(words, bp, nbits, dst, gsize[g], code[g], rmin[g])
            if bp < 0:
                return -1, no_pos, no_bits, no_bits
    # 4. Merge repeats and new positions (ascending) with each change's sign.
    ne = n_rep + n_new
    pos = np.empty(ne, dtype=np.int64)
    neg = np.empty(ne, dtype=np.int64)
    a = 0
    b = 0
    for e in range(ne):
        if b >= n_new or (a < n_rep and rep_pos[a] < new_pos[b]):
            pos[e] = rep_pos[a]
            neg[e] = 1 if ctx_neg[rep_idx[a]] != (flips[a] != 0) else 0
            a += 1
        else:
            if a < n_rep and rep_pos[a] == new_pos[b]:
                return -2, no_pos, no_bits, no_bits  # a new position repeats a context one
            pos[e] = new_pos[b]
            neg[e] = 1 if nsign[b] != 0 else 0
            b += 1
    # 5. The old values: a loop of its own, whose loads do not depend on one
    # another, so the CPU keeps many cache misses in flight (the changes are
    # scattered over the tensor: nearly every read is one).
    olds = np.empty(ne, dtype=old.dtype)
    for e in range(ne):
        olds[e] = old[pos[e]]
    # 6. Magnitudes (change order, each with its class's code), new values,
    # writes. Branch-free where the branches would be coin flips (the signs of
    # the weights and of their steps). A bad value (corrupt payload or wrong
    # base) puts back what was written before the error is returned.
    mk = np.full(256, -1, dtype=np.int64)
    mc = np.full(256, -1, dtype=np.int64)
    for t in range(mrows.shape[0]):
        mk[mrows[t, 0]] = mrows[t, 1]
        mc[mrows[t, 0]] = mrows[t, 2]
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
            if center >= 0:  # zigzag distance to the class centre
                v = center + ((v >> 1) if (v & 1) == 0 else -((v + 1) >> 1))
            if bp > nbits or v < 0:
                rc = -1 if bp > nbits else -3
                done = e
                break
            step = v + 1
        key = o ^ (sign_bit ^ (other * ((o & sign_bit) != 0)))
        key += step - 2 * step * neg[e]
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
        return rc, no_pos, no_bits, no_bits
    return 0, pos, olds, news


@njit(cache=True, nogil=True)
def _parse_head(buf, count, emask):
    """Parse and validate the head of a version-2 delta body (see format.py).

    Returns (status, flags, context count, fingerprint, n_new, k_new, binary
    group rows, magnitude rows, stream offset); status < 0: see _HEAD_ERRORS."""
    rows = np.zeros((0, 3), dtype=np.int64)
    mrows = np.zeros((0, 3), dtype=np.int64)
    z = np.int64(0)
    if buf.shape[0] < 1:
        return -10, z, z, z, z, z, rows, mrows, 0
    flags = np.int64(buf[0])
    if flags & ~np.int64(_FLAG_CONTEXT):
        return -11, z, z, z, z, z, rows, mrows, 0
    pos = 1
    ctx_count = z
    fp = z
    if flags & _FLAG_CONTEXT:
        ctx_count, pos = _uv(buf, pos)
        if pos < 0 or pos + 4 > buf.shape[0] or ctx_count > count:
            return -12, z, z, z, z, z, rows, mrows, 0
        fp = np.int64(buf[pos]) | (np.int64(buf[pos + 1]) << 8) | (np.int64(buf[pos + 2]) << 16) | (np.int64(buf[pos + 3]) << 24)
        pos += 4
    n_new, pos = _uv(buf, pos)
    if pos < 0 or n_new > count or pos >= buf.shape[0]:
        return -13, z, z, z, z, z, rows, mrows, 0
    k_new = np.int64(buf[pos])
    if k_new > _RAW_BITS:
        return -13, z, z, z, z, z, rows, mrows, 0
    nrows, pos = _uv(buf, pos + 1)
    if pos < 0 or nrows > _NGROUPS:
        return -14, z, z, z, z, z, rows, mrows, 0
    rows = np.zeros((nrows, 3), dtype=np.int64)
    last = -1
    for j in range(nrows):
        g, pos = _uv(buf, pos)
        if pos < 0 or pos >= buf.shape[0] or g <= last or g >= _NGROUPS:
            return -14, z, z, z, z, z, rows, mrows, 0
        last = g
        code = np.int64(buf[pos])
        pos += 1
        r = np.int64(0)
        if code != _BIN_RAW:
            r, pos = _uv(buf, pos)
            if pos < 0 or code & 0x80 or (code & 63) > _RAW_BITS or r > count:
                return -14, z, z, z, z, z, rows, mrows, 0
        rows[j, 0] = g
        rows[j, 1] = code
        rows[j, 2] = r
    nm, pos = _uv(buf, pos)
    if pos < 0 or nm > emask + 1:
        return -15, z, z, z, z, z, rows, mrows, 0
    mrows = np.zeros((nm, 3), dtype=np.int64)
    last = -1
    for j in range(nm):
        if pos + 2 > buf.shape[0]:
            return -15, z, z, z, z, z, rows, mrows, 0
        c = np.int64(buf[pos])
        kc = np.int64(buf[pos + 1])
        pos += 2
        center = np.int64(-1)
        if kc & 0x80:
            center, pos = _uv(buf, pos)
            if pos < 0 or center == 0:
                return -15, z, z, z, z, z, rows, mrows, 0
        if c <= last or c > emask or (kc & 0x7F) > 32:
            return -15, z, z, z, z, z, rows, mrows, 0
        last = c
        mrows[j, 0] = c
        mrows[j, 1] = kc & 0x7F
        mrows[j, 2] = center
    return 0, flags, ctx_count, fp, n_new, k_new, rows, mrows, pos


@njit(cache=True, nogil=True)
def _decode_chunk2(body, src, dst, start, count, has_ctx, ctx_pos, ctx_old, ctx_new, shift, emask, sign_bit, full):
    """Decode a version-2 delta body (uint8) onto dst (holding the base src of
    the chunk starting at element ``start``) in one call: the head, the
    context's check, the bit stream. Returns (status, context count and
    fingerprint the payload names, absolute positions, old bits, new bits);
    status < 0: see _HEAD_ERRORS / _V2_ERRORS."""
    no_pos = np.empty(0, dtype=np.int64)
    no_bits = np.empty(0, dtype=src.dtype)
    st, flags, ctx_count, fp, n_new, k_new, rows, mrows, off = _parse_head(body, count, emask)
    if st != 0:
        return st, ctx_count, fp, no_pos, no_bits, no_bits
    rel = np.empty(0, dtype=np.int64)
    grp = np.empty(0, dtype=np.int64)
    neg = np.empty(0, dtype=np.bool_)
    if flags & _FLAG_CONTEXT:
        if not has_ctx:
            return -20, ctx_count, fp, no_pos, no_bits, no_bits
        st, rel, grp, neg, got = _context_features(ctx_pos, ctx_old, ctx_new, start, count, shift, emask, sign_bit, full)
        if st != 0:
            return -21, ctx_count, fp, no_pos, no_bits, no_bits
        if rel.shape[0] != ctx_count or got != fp:
            return -22, ctx_count, fp, no_pos, no_bits, no_bits
    words, nbits = _body_words(body, off)
    rc, pos, olds, news = _decode_v2(src, dst, count, rel, grp, neg, rows, mrows, n_new, k_new, words, nbits, shift, emask, sign_bit, full)
    if rc != 0:
        return rc, ctx_count, fp, no_pos, no_bits, no_bits
    for e in range(pos.shape[0]):
        pos[e] += start
    return 0, ctx_count, fp, pos, olds, news


_HEAD_ERRORS = {
    -10: "truncated delta body (flags)",
    -11: "unknown delta flags",
    -12: "delta context count or fingerprint is corrupt or truncated",
    -13: "delta new-change count or gap parameter is corrupt or truncated",
    -14: "delta binary group table is corrupt or truncated",
    -15: "delta magnitude table is corrupt or truncated",
}

_V2_ERRORS = {
    -1: "delta bit stream is truncated",
    -2: "delta positions are out of order or outside the chunk (corrupt payload or wrong context)",
    -3: "delta step leaves the value grid (corrupt payload, wrong base or wrong context)",
    -4: "delta bit stream has trailing bytes",
}
