"""Raw tensors as weightsync moves them: 1-D numpy arrays of bit patterns plus a dtype
name and a shape, and the hash every party checks the full weights against."""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import struct
from collections.abc import Mapping

import numpy as np

from meridian.v1 import weightsync_pb2 as pb

RAW_DTYPES: dict[str, type] = {"bf16": np.uint16, "fp16": np.uint16, "fp32": np.uint32}
PB_DTYPES = {"bf16": pb.DTYPE_BF16, "fp16": pb.DTYPE_FP16, "fp32": pb.DTYPE_FP32}
PB_DTYPE_NAMES = {v: k for k, v in PB_DTYPES.items()}


@dataclasses.dataclass(frozen=True)
class RawTensor:
    """One tensor's bits: ``bits`` is 1-D (uint16 for bf16/fp16, uint32 for fp32)."""

    dtype: str
    shape: tuple[int, ...]
    bits: np.ndarray

    def __post_init__(self) -> None:
        want = RAW_DTYPES.get(self.dtype)
        if want is None:
            raise ValueError(f"unsupported dtype {self.dtype!r} (bf16, fp16, fp32)")
        numel = element_count(self.shape)
        if self.bits.dtype != want or self.bits.ndim != 1 or self.bits.shape[0] != numel:
            raise ValueError(
                f"bits must be 1-D {np.dtype(want).name} with {numel} elements for shape {self.shape}, "
                f"got {self.bits.dtype} {self.bits.shape}"
            )

    @property
    def nbytes(self) -> int:
        return int(self.bits.nbytes)

    def meta(self, name: str) -> pb.TensorMeta:
        return pb.TensorMeta(name=name, dtype=PB_DTYPES[self.dtype], shape=list(self.shape))


Weights = Mapping[str, RawTensor]

#: No tensor of a real model comes near this; it bounds what a peer can make us allocate.
MAX_ELEMENTS = 1 << 40


def element_count(shape: tuple[int, ...] | list[int]) -> int:
    """Elements in ``shape``, exactly (Python ints do not wrap); ValueError when absurd."""
    if any(d < 0 for d in shape):
        raise ValueError(f"negative dimension in shape {list(shape)}")
    numel = math.prod(shape)
    if numel > MAX_ELEMENTS:
        raise ValueError(f"shape {list(shape)} has {numel} elements, more than {MAX_ELEMENTS}")
    return numel


def hash_of_sums(items: list[tuple[str, str, tuple[int, ...], tuple[int, int]]]) -> str:
    """The weights hash from each tensor's (name, dtype, shape, element-hash sums).

    Lets a receiver that keeps the sums up to date incrementally (see
    :mod:`meridian.elementhash`) check a version without a full pass."""
    # One update over the joined parts: the same digest as an update per part, at a
    # third of the cost per tensor (a receiver does this every version).
    parts = [b"meridian-weights-v2\0"]
    for name, dtype, shape, sums in sorted(items):
        parts.append(_tensor_key(name, dtype, tuple(shape)))
        parts.append(_SUMS.pack(*sums))
    return hashlib.sha256(b"".join(parts)).hexdigest()


_SUMS = struct.Struct("<QQ")  # a tensor's two element-hash sums, little-endian


@functools.lru_cache(maxsize=1 << 16)
def _tensor_key(name: str, dtype: str, shape: tuple[int, ...]) -> bytes:
    """A tensor's part of the weights hash before its sums: the same for every version of
    a model, so a receiver checking each version does not format it again."""
    return f"{name}\0{dtype}\0{','.join(map(str, shape))}\0".encode()


def weights_hash(weights: Weights) -> str:
    """sha256 over (name, dtype, shape, additive element hash) of every tensor, in name
    order. The element hash is a sum of per-element terms (elementhash), so a receiver
    that changes a few elements can update it without a full pass; computed in full
    here, on several threads for large weight sets."""
    from meridian import elementhash  # numba: only where hashes are computed

    names = sorted(weights)
    sums = elementhash.many_tensor_sums([np.ascontiguousarray(weights[n].bits) for n in names])
    return hash_of_sums([(n, weights[n].dtype, tuple(weights[n].shape), s) for n, s in zip(names, sums)])


def from_torch(tensor) -> RawTensor:  # type: ignore[no-untyped-def]
    """A torch tensor (bf16, fp16 or fp32, on any device) as raw bits; imports torch lazily."""
    import torch

    names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
    views = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
    if tensor.dtype not in names:
        raise ValueError(f"unsupported torch dtype {tensor.dtype}")
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    bits = flat.view(views[tensor.dtype]).numpy().view(RAW_DTYPES[names[tensor.dtype]])
    return RawTensor(names[tensor.dtype], tuple(tensor.shape), bits)


def to_torch(raw: RawTensor):  # type: ignore[no-untyped-def]
    """The inverse of :func:`from_torch` (shares memory with ``raw.bits``)."""
    import torch

    kinds = {"bf16": (np.int16, torch.bfloat16), "fp16": (np.int16, torch.float16), "fp32": (np.int32, torch.float32)}
    signed, dtype = kinds[raw.dtype]
    return torch.from_numpy(raw.bits.view(signed)).view(dtype).reshape(raw.shape)
