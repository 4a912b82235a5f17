"""In-place apply, undo logs and the incrementally updated weights hash."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meridian.errors import DataLoss
from meridian import elementhash
from services.weightsync.receiver import Decoder
from services.weightsync.versions import Encoded, encode_version
from meridian.tensors import RawTensor, hash_of_sums, weights_hash

Weights = dict[str, RawTensor]
CHUNK_BYTES = 64


def _weights(seed: int) -> Weights:
    rng = np.random.default_rng(seed)
    bf16 = (rng.normal(0, 0.05, 200).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return {
        "a": RawTensor("bf16", (20, 10), bf16),
        "b": RawTensor("fp32", (7,), rng.normal(0, 1, 7).astype(np.float32).view(np.uint32)),
        "c": RawTensor("fp16", (0,), np.zeros(0, dtype=np.uint16)),
    }


def _changed(weights: Weights, seed: int, fraction: float) -> Weights:
    rng = np.random.default_rng(seed)
    out = {}
    for name, t in weights.items():
        bits = t.bits.copy()
        if bits.size:
            idx = rng.choice(bits.size, size=max(1, int(bits.size * fraction)), replace=False)
            bits[idx] += 1
        out[name] = RawTensor(t.dtype, t.shape, bits)
    return out


def _copy(weights: Weights) -> Weights:
    return {n: RawTensor(t.dtype, t.shape, t.bits.copy()) for n, t in weights.items()}


def _apply(decoder: Decoder, enc: Encoded) -> int:
    decoder.begin(enc.manifest)
    for i, payload in enumerate(enc.chunks):
        decoder.add_chunk(i, payload)
    return decoder.finish()


def _same(a: Weights, b: Weights) -> bool:
    return set(a) == set(b) and all(np.array_equal(a[n].bits, b[n].bits) and a[n].shape == b[n].shape for n in a)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(0, 0xFFFF), min_size=0, max_size=300),
    st.lists(st.tuples(st.integers(0, 299), st.integers(0, 0xFFFF)), max_size=40),
)
def test_incremental_sums_equal_full_sums(values: list[int], edits: list[tuple[int, int]]) -> None:
    old = np.array(values, dtype=np.uint16)
    new = old.copy()
    for i, v in edits:
        if i < new.size:
            new[i] = v
    pos = np.flatnonzero(new != old).astype(np.int64)
    moved = elementhash.add(elementhash.range_sums(old, 0, old.size), elementhash.change_sums(pos, old[pos], new[pos]))
    assert moved == elementhash.range_sums(new, 0, new.size)


def test_full_sums_on_threads_equal_one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(elementhash, "_SLICE", 1000)
    arrays = [np.random.default_rng(1).integers(0, 1 << 32, 4321, dtype=np.uint64).astype(np.uint32), np.zeros(0, np.uint16)]
    assert elementhash.many_tensor_sums(arrays) == [elementhash.range_sums(a, 0, a.shape[0]) for a in arrays]


def test_weights_hash_sees_a_moved_or_swapped_element() -> None:
    w = _weights(0)
    h = weights_hash(w)
    swapped = _copy(w)
    swapped["a"].bits[[0, 1]] = swapped["a"].bits[[1, 0]]
    assert w["a"].bits[0] != w["a"].bits[1] and weights_hash(swapped) != h
    flipped = _copy(w)
    flipped["b"].bits[3] ^= 1 << 31
    assert weights_hash(flipped) != h


def test_weights_hash_format_is_pinned() -> None:
    """The weights hash is a contract between processes and releases (manifests name it,
    stores keep it): a faster way to compute it must give the same digest."""
    items = [("model.norm.weight", "bf16", (576,), (1, (1 << 64) - 1)), ("lm_head", "fp32", (49152, 576), (12345678901234567890, 42)), ("a", "fp16", (), (0, 0))]
    assert hash_of_sums(items) == "06ef61b1d4cc88e93318398c157d90bd8dde7c4ffb24facf561a63cdf3590144"


@pytest.mark.parametrize("fraction", [0.0, 0.05, 1.0])  # no change, sparse, total (keyframe chunks)
def test_in_place_apply_is_exact_and_undo_restores(fraction: float) -> None:
    v0 = _weights(1)
    v1 = _changed(v0, 2, fraction)
    held = _copy(v0)
    buffers = {n: t.bits for n, t in held.items()}
    decoder = Decoder(held, 0, in_place=True)
    assert _apply(decoder, encode_version(1, v1, v0, 0, CHUNK_BYTES)) == 1
    assert _same(decoder.weights, v1)
    assert all(decoder.weights[n].bits is buffers[n] for n in buffers)  # no new buffers
    undo = decoder.last_undo
    assert undo is not None and (undo.version, undo.base_version) == (1, 0)
    assert _same(undo.previous_weights(decoder.weights), v0)
    assert _same(decoder.weights, v1)  # previous_weights copies
    assert decoder.revert_last() == 0
    assert _same(decoder.weights, v0)
    # The decoder follows on from the reverted version, hash checks included.
    assert _apply(decoder, encode_version(1, v1, v0, 0, CHUNK_BYTES)) == 1
    assert _same(decoder.weights, v1)


def test_in_place_chain_then_keyframe() -> None:
    versions = [_weights(3)]
    for s in range(3):
        versions.append(_changed(versions[-1], 10 + s, 0.1))
    decoder = Decoder(_copy(versions[0]), 0, in_place=True)
    for v in range(1, 4):
        _apply(decoder, encode_version(v, versions[v], versions[v - 1], v - 1, CHUNK_BYTES))
        assert _same(decoder.weights, versions[v])
    other = {"z": RawTensor("bf16", (3,), np.array([1, 2, 3], dtype=np.uint16))}
    _apply(decoder, encode_version(9, other, None, -1, CHUNK_BYTES))
    assert _same(decoder.weights, other)
    assert decoder.last_undo is not None
    assert _same(decoder.last_undo.previous_weights(decoder.weights), versions[3])


def test_in_place_hash_mismatch_reverts() -> None:
    v0, v1 = _weights(4), _changed(_weights(4), 5, 0.2)
    enc = encode_version(1, v1, v0, 0, CHUNK_BYTES)
    enc.manifest.weights_hash = weights_hash(v0)
    held = _copy(v0)
    decoder = Decoder(held, 0, in_place=True)
    with pytest.raises(DataLoss, match="hash"):
        _apply(decoder, enc)
    assert decoder.version == 0 and _same(decoder.weights, v0)


def test_abort_reverts_a_half_applied_version() -> None:
    v0, v1 = _weights(6), _changed(_weights(6), 7, 0.3)
    enc = encode_version(1, v1, v0, 0, CHUNK_BYTES)
    decoder = Decoder(_copy(v0), 0, in_place=True)
    decoder.begin(enc.manifest)
    for i in range(len(enc.chunks) // 2):
        decoder.add_chunk(i, enc.chunks[i])
    assert not _same(decoder.weights, v0)
    decoder.abort()
    assert _same(decoder.weights, v0)
    assert _apply(decoder, enc) == 1 and _same(decoder.weights, v1)


def test_copy_mode_keeps_previous_versions_valid() -> None:
    v0, v1 = _weights(8), _changed(_weights(8), 9, 0.2)
    held = _copy(v0)
    decoder = Decoder(held, 0)
    _apply(decoder, encode_version(1, v1, v0, 0, CHUNK_BYTES))
    assert _same(held, v0) and _same(decoder.weights, v1) and decoder.last_undo is None


def test_manifest_of_another_codec_is_refused() -> None:
    from meridian.errors import FailedPrecondition

    v0 = _weights(10)
    enc = encode_version(0, v0, None, -1, CHUNK_BYTES)
    enc.manifest.codec = "meridian-ctx-rice-v1"  # an older origin: sha256-based weights hash
    with pytest.raises(FailedPrecondition, match="codec"):
        Decoder(None, -1).begin(enc.manifest)
