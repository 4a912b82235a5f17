"""Additive element hash: the per-tensor part of :func:`tensors.weights_hash`.

A tensor's value is the pair of sums, modulo 2**64, over its elements of
``mix_lane(index, bits)`` for two independent lanes. Because it is a sum, a
receiver that changes a few elements updates it in O(changed elements):
subtract each old element's term, add the new one. A full computation equals
the incrementally updated one bit for bit, so the origin (full pass) and a
subscriber (incremental) agree.

What it is for: catching a decode against the wrong base, a codec bug or
corrupted memory. It is not meant to resist a forger (the chunks' sha256
guard the transport); an additive hash over a public mixer can be steered by
someone choosing many elements on purpose.

Index and bits are packed as ``index << 32 ^ bits`` (injective for tensors
below 2**32 elements; bigger ones fold the index's high bits in as well), then
put through the splitmix64 finaliser with a different salt per lane.
"""
from __future__ import annotations

import concurrent.futures
import os

import numpy as np
from numba import njit

_SALT0 = np.uint64(0x9E3779B97F4A7C15)
_SALT1 = np.uint64(0xD1B54A32D192ED03)
_HIGH = np.uint64(0xC2B2AE3D27D4EB4F)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_MASK64 = (1 << 64) - 1

#: Elements per task when one tensor is hashed on several threads.
_SLICE = 1 << 23
_THREADS = min(8, os.cpu_count() or 1)


@njit(cache=True, nogil=True, inline="always")
def _key(i, v):
    u = np.uint64(i)
    return (u << np.uint64(32)) ^ np.uint64(v) ^ ((u >> np.uint64(32)) * _HIGH)


@njit(cache=True, nogil=True, inline="always")
def _mix(x):
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


@njit(cache=True, nogil=True)
def _range_sums(bits, start, stop):
    """Both lane sums over bits[start:stop] (indices are tensor indices)."""
    s0 = np.uint64(0)
    s1 = np.uint64(0)
    for i in range(start, stop):
        k = _key(i, bits[i])
        s0 += _mix(k ^ _SALT0)
        s1 += _mix(k ^ _SALT1)
    return s0, s1


@njit(cache=True, nogil=True)
def _change_sums(positions, old_vals, new_vals):
    """Sum of (new term - old term) over the changed elements, both lanes."""
    s0 = np.uint64(0)
    s1 = np.uint64(0)
    for e in range(positions.shape[0]):
        i = positions[e]
        ko = _key(i, old_vals[e])
        kn = _key(i, new_vals[e])
        s0 += _mix(kn ^ _SALT0) - _mix(ko ^ _SALT0)
        s1 += _mix(kn ^ _SALT1) - _mix(ko ^ _SALT1)
    return s0, s1


Sums = tuple[int, int]


def add(a: Sums, b: Sums) -> Sums:
    """Lane-wise sum modulo 2**64."""
    return (a[0] + b[0]) & _MASK64, (a[1] + b[1]) & _MASK64


def range_sums(bits: np.ndarray, start: int, stop: int) -> Sums:
    """The hash terms of elements ``start..stop`` of a 1-D raw-bit array (one thread)."""
    if stop <= start:
        return 0, 0
    s0, s1 = _range_sums(bits, start, stop)
    return int(s0), int(s1)


def change_sums(positions: np.ndarray, old_vals: np.ndarray, new_vals: np.ndarray) -> Sums:
    """How the sums move when elements ``positions`` go from ``old_vals`` to ``new_vals``."""
    if positions.shape[0] == 0:
        return 0, 0
    s0, s1 = _change_sums(positions, old_vals, new_vals)
    return int(s0), int(s1)


def tensor_sums(bits: np.ndarray, pool: concurrent.futures.Executor | None = None) -> Sums:
    """The full sums of one tensor, split into slices on ``pool`` when given."""
    n = bits.shape[0]
    if pool is None or n <= _SLICE:
        return range_sums(bits, 0, n)
    parts = pool.map(lambda lo: range_sums(bits, lo, min(n, lo + _SLICE)), range(0, n, _SLICE))
    total: Sums = (0, 0)
    for part in parts:
        total = add(total, part)
    return total


def many_tensor_sums(arrays: list[np.ndarray]) -> list[Sums]:
    """Full sums of several tensors, on a thread pool when there is enough work
    (the kernels release the GIL)."""
    total = sum(a.shape[0] for a in arrays)
    if _THREADS <= 1 or total <= _SLICE:
        return [range_sums(a, 0, a.shape[0]) for a in arrays]
    with concurrent.futures.ThreadPoolExecutor(_THREADS) as pool:
        jobs = [
            (k, lo, min(a.shape[0], lo + _SLICE))
            for k, a in enumerate(arrays)
            for lo in range(0, max(a.shape[0], 1), _SLICE)
        ]
        parts = list(pool.map(lambda job: range_sums(arrays[job[0]], job[1], job[2]), jobs))
    out: list[Sums] = [(0, 0)] * len(arrays)
    for (k, _, _), part in zip(jobs, parts):
        out[k] = add(out[k], part)
    return out
