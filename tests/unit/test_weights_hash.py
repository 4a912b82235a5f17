"""The element hash (meridian.elementhash) and the shape bounds of raw tensors
(meridian.tensors) that the weights hash rests on. What the digest binds (name, dtype,
shape, every element) and its final sha256 format are in test_weightsync_store and
test_weightsync_inplace."""
from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest

from meridian import elementhash
from meridian.tensors import MAX_ELEMENTS, RawTensor, element_count, weights_hash

MASK = (1 << 64) - 1
SALTS = (0x9E3779B97F4A7C15, 0xD1B54A32D192ED03)
HIGH = 0xC2B2AE3D27D4EB4F


def _term(index: int, bits: int, salt: int) -> int:
    """One element's term of one lane, as elementhash's docstring defines it: the key
    ``index << 32 ^ bits`` (the index's high bits folded in with a multiplier) through the
    splitmix64 finaliser, salted per lane. Plain Python ints, so nothing here shares a
    bug with the numba kernels."""
    x = ((index << 32) ^ bits ^ ((index >> 32) * HIGH)) & MASK
    x ^= salt
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def _reference_sums(bits: np.ndarray, first_index: int = 0) -> tuple[int, int]:
    return tuple(sum(_term(first_index + i, int(v), salt) for i, v in enumerate(bits)) & MASK for salt in SALTS)  # type: ignore[return-value]


@pytest.mark.parametrize(
    "bits",
    [np.array([0, 1, 0x7F80, 0xFFFF], dtype=np.uint16), np.array([0x3F800000, 0xFFFFFFFF, 0, 0x80000000], dtype=np.uint32)],
)
def test_element_sums_follow_the_documented_formula(bits: np.ndarray) -> None:
    """The element sums are part of the weights hash, a contract between processes and
    releases like its sha256 framing (pinned in test_weightsync_inplace): a changed salt,
    multiplier or key layout would make an origin and a subscriber of different releases
    disagree on every version, so the kernels must keep computing this exact formula."""
    assert elementhash.range_sums(bits, 0, bits.shape[0]) == _reference_sums(bits)


def test_weights_hash_of_a_fixed_weight_set_is_pinned() -> None:
    """End to end, element sums included: the digest a manifest names for these weights
    in every release."""
    weights = {
        "norm": RawTensor("fp32", (2,), np.array([0x3F800000, 0xFFFFFFFF], dtype=np.uint32)),
        "lm_head": RawTensor("bf16", (2, 2), np.array([0, 1, 0x7F80, 0xFFFF], dtype=np.uint16)),
    }
    assert weights_hash(weights) == "3bd1c642b113ece651e8cbe49da10b0781d37a88de835b4865b3cac6b105e059"


def test_indices_2_pow_32_apart_hash_differently() -> None:
    """``index << 32`` alone wraps at 2**32 elements, where element i and element
    i + 2**32 would get the same term: a swap between them, in a tensor that big, would go
    unseen. The index's high bits are folded in; change_sums takes any position, so the
    fold is checked without a 4-billion-element tensor."""
    old, new = np.array([0], dtype=np.uint16), np.array([5], dtype=np.uint16)
    low = elementhash.change_sums(np.array([3], dtype=np.int64), old, new)
    high = elementhash.change_sums(np.array([3 + (1 << 32)], dtype=np.int64), old, new)
    assert low != high
    want = tuple((_term(3 + (1 << 32), 5, s) - _term(3 + (1 << 32), 0, s)) & MASK for s in SALTS)
    assert high == want


def test_tensor_sums_on_a_pool_equal_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """Slicing one tensor across threads must cover each element exactly once, the last
    partial slice included."""
    monkeypatch.setattr(elementhash, "_SLICE", 100)
    bits = np.random.default_rng(0).integers(0, 1 << 16, 1050, dtype=np.uint64).astype(np.uint16)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        assert elementhash.tensor_sums(bits, pool) == elementhash.range_sums(bits, 0, bits.shape[0])


def test_element_count_refuses_negative_dimensions_even_when_their_product_is_positive() -> None:
    """A peer's shape (-2, -3) multiplies to 6: a check of the product alone would take it
    for a 6-element tensor and hash a shape no tensor has."""
    with pytest.raises(ValueError, match="negative dimension"):
        element_count((-2, -3))
    with pytest.raises(ValueError, match="negative dimension"):
        RawTensor("bf16", (-2, -3), np.zeros(6, dtype=np.uint16))


def test_element_count_bound_is_inclusive() -> None:
    """MAX_ELEMENTS is the most a peer may make us allocate, itself allowed."""
    assert element_count((MAX_ELEMENTS,)) == MAX_ELEMENTS
    assert element_count((1 << 20, 1 << 20)) == MAX_ELEMENTS
    with pytest.raises(ValueError, match="more than"):
        element_count((MAX_ELEMENTS + 1,))


@pytest.mark.parametrize(("dtype", "wire"), [("bf16", "DTYPE_BF16"), ("fp16", "DTYPE_FP16"), ("fp32", "DTYPE_FP32")])
def test_each_dtype_goes_on_the_wire_as_its_own_enum_value(dtype: str, wire: str) -> None:
    """bf16 and fp16 are both 16-bit patterns: a release that swapped them would still
    agree with itself, but a peer that follows the proto (another release, another
    language's client) would read one as the other: every version refused on its hash,
    or every number wrong where a client does not check it."""
    from meridian.tensors import PB_DTYPE_NAMES
    from meridian.v1 import weightsync_pb2 as pb

    bits = np.zeros(2, dtype=np.uint32 if dtype == "fp32" else np.uint16)
    meta = RawTensor(dtype, (2,), bits).meta("w")
    assert pb.DType.Name(meta.dtype) == wire and PB_DTYPE_NAMES[meta.dtype] == dtype
