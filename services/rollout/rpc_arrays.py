"""numpy arrays across vLLM's ``collective_rpc``.

Arguments and results travel between the rollout process, the engine core and its
workers through msgpack, which turns an ndarray into an untyped (dtype, shape, data)
triple whose data may point into a receive buffer that is gone by the time the caller
looks. Packing arrays as (dtype, shape, bytes) ourselves keeps them intact both ways.
"""
from __future__ import annotations

from typing import Any

import numpy as np

Packed = tuple[str, list[int], bytes]


def pack(array: np.ndarray) -> Packed:
    """An array as builtins msgpack carries losslessly."""
    array = np.ascontiguousarray(array)
    return array.dtype.str, list(array.shape), array.tobytes()


def unpack(packed: Any) -> np.ndarray:
    """The inverse of :func:`pack` (a read-only view of the bytes)."""
    dtype, shape, data = packed
    return np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape)


def pack_positions(positions: np.ndarray) -> Packed:
    """Element positions, as 32-bit integers when they fit (half the bytes to move)."""
    if positions.size == 0 or int(positions.max()) < 1 << 32:
        return pack(positions.astype(np.uint32, copy=False))
    return pack(positions.astype(np.int64, copy=False))


def unpack_positions(packed: Any) -> np.ndarray:
    """The inverse of :func:`pack_positions`, as int64."""
    return unpack(packed).astype(np.int64)
