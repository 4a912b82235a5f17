"""The pure cores of a weight update: the checkpoint -> engine layout, change sets built
from the decoder's undo logs (one version, several after a rejection, a keyframe), the
read-back comparison, and the canary verdict."""
from __future__ import annotations

import numpy as np
import pytest

from meridian import canary
from meridian.errors import FailedPrecondition
from services.rollout.served_weights import Sample
from services.rollout.weight_changes import ChangeSet
from services.rollout.weight_layout import LayoutError, Run, WeightLayout
from services.rollout.weight_updates import compare_samples
from services.weightsync.receiver import Decoder
from services.weightsync.versions import encode_version
from meridian.tensors import RawTensor

# A fused engine tensor as vLLM builds it: q (4x3), k (2x3) and v (2x3) stacked into qkv (8x3).
CHECKPOINT = {"q": (4, 3), "k": (2, 3), "v": (2, 3), "norm": (3,)}


def _fused() -> WeightLayout:
    return WeightLayout(
        {"q": [Run("qkv", 0, 0, 12)], "k": [Run("qkv", 0, 12, 6)], "v": [Run("qkv", 0, 18, 6)], "norm": [Run("norm", 0, 0, 3)]},
        {"qkv": (8, 3), "norm": (3,)},
    )


def test_layout_translates_both_ways() -> None:
    layout = _fused()
    layout.validate(CHECKPOINT)
    (placed,) = layout.place("k", np.array([0, 5], dtype=np.int64))
    assert placed.target == "qkv" and placed.positions.tolist() == [12, 17]
    back = {name: pos.tolist() for name, pos, _ in layout.to_checkpoint("qkv", np.array([0, 13, 23], dtype=np.int64))}
    assert back == {"q": [0], "k": [1], "v": [5]}
    assert list(layout.place_range("v", 2, 3)) == [("qkv", 20, 0, 3)]
    assert WeightLayout.from_plain(layout.as_plain()).runs == layout.runs


def test_layout_with_runs_split_across_targets() -> None:
    layout = WeightLayout({"w": [Run("a", 0, 0, 4), Run("b", 4, 2, 4)]}, {"a": (4,), "b": (6,)})
    layout.validate({"w": (8,)})
    placed = {p.target: (p.positions.tolist(), p.index.tolist()) for p in layout.place("w", np.array([1, 5, 7], dtype=np.int64))}
    assert placed == {"a": ([1], [0]), "b": ([3, 5], [1, 2])}
    assert layout.uncovered() == {"b": 2}


def test_layout_with_split_runs_translates_each_element_through_its_own_run() -> None:
    """Checkpoint tensor w lands in two engine tensors, the second run starting at w's
    element 4 and b's element 2: every translation must subtract its run's own source
    start and add its own destination start, and an element on a run's end belongs to the
    next run only. The plain form (what crosses to the worker processes) keeps it all."""
    layout = WeightLayout({"w": [Run("a", 0, 0, 4), Run("b", 4, 2, 4)]}, {"a": (4,), "b": (2, 3)})
    layout.validate({"w": (8,)})
    placed = {p.target: (p.positions.tolist(), p.index.tolist()) for p in layout.place("w", np.array([3, 4], dtype=np.int64))}
    assert placed == {"a": ([3], [0]), "b": ([2], [1])}
    assert list(layout.place_range("w", 2, 4)) == [("a", 2, 0, 2), ("b", 2, 2, 2)]
    assert list(layout.place_range("w", 5, 3)) == [("b", 3, 0, 3)]
    back = [(name, pos.tolist(), index.tolist()) for name, pos, index in layout.to_checkpoint("b", np.array([0, 2, 5], dtype=np.int64))]
    assert back == [("w", [4, 7], [1, 2])], "b's elements 0, 1 are padding; 2 is w's 4"
    again = WeightLayout.from_plain(layout.as_plain())
    assert (again.runs, again.targets) == (layout.runs, layout.targets)


@pytest.mark.parametrize(
    ("runs", "message"),
    [
        ({"q": [Run("qkv", 0, 0, 11)]}, "cover"),  # one element never lands
        ({"q": [Run("qkv", 1, 1, 11)]}, "cover"),  # the first element never lands
        ({"q": [Run("qkv", 0, 0, 6), Run("qkv", 8, 8, 4)]}, "cover"),  # a gap inside
        ({"q": [Run("qkv", 0, 0, 8), Run("qkv", 6, 12, 6)]}, "cover"),  # elements 6, 7 land twice
        ({"q": [Run("qkv", 0, 0, 14), Run("qkv", 14, 14, -2)]}, "cover"),  # a negative run "ending" at 12
        ({"q": [Run("qkv", 0, -2, 12)]}, "outside"),
        ({"q": [Run("qkv", 0, 0, 12)], "k": [Run("qkv", 0, 10, 6)]}, "same elements"),  # overlap
        ({"q": [Run("qkv", 0, 20, 12)]}, "outside"),
        ({"q": [Run("nope", 0, 0, 12)]}, "unknown engine tensor"),
    ],
)
def test_layout_refuses_what_is_not_exactly_once(runs: dict[str, list[Run]], message: str) -> None:
    shapes = {n: CHECKPOINT[n] for n in runs}
    with pytest.raises(LayoutError, match=message):
        WeightLayout(runs, {"qkv": (8, 3)}).validate(shapes)


def _weights(seed: int) -> dict[str, RawTensor]:
    rng = np.random.default_rng(seed)
    return {n: RawTensor("bf16", s, rng.integers(0, 1 << 15, size=int(np.prod(s)), dtype=np.uint16)) for n, s in CHECKPOINT.items()}


def _moved(weights: dict[str, RawTensor], seed: int, count: int = 3) -> dict[str, RawTensor]:
    rng = np.random.default_rng(seed)
    out = {}
    for name, t in weights.items():
        bits = t.bits.copy()
        where = rng.choice(bits.shape[0], size=min(count, bits.shape[0]), replace=False)
        bits[where] = bits[where] ^ np.uint16(1)
        out[name] = RawTensor(t.dtype, t.shape, bits)
    return out


def _decode(decoder: Decoder, version: int, new: dict[str, RawTensor], old: dict[str, RawTensor] | None, base: int) -> None:
    enc = encode_version(version, new, old, base, 64)
    decoder.begin(enc.manifest)
    for i, chunk in enumerate(enc.chunks):
        decoder.add_chunk(i, chunk)
    decoder.finish()


def test_change_set_of_one_version_is_exactly_its_changed_elements() -> None:
    v0, v1 = _weights(0), None
    v1 = _moved(v0, 1)
    decoder = Decoder({n: RawTensor(t.dtype, t.shape, t.bits.copy()) for n, t in v0.items()}, 0, in_place=True)
    _decode(decoder, 1, v1, v0, 0)
    changes = ChangeSet.from_undos(decoder.weights, [decoder.last_undo])
    assert (changes.version, changes.base_version, changes.dense) == (1, 0, {})
    for name in CHECKPOINT:
        want = np.flatnonzero(v0[name].bits != v1[name].bits)
        positions, values = changes.sparse[name]
        assert positions.tolist() == want.tolist() and values.tolist() == v1[name].bits[want].tolist()
    assert changes.elements == sum(np.count_nonzero(v0[n].bits != v1[n].bits) for n in CHECKPOINT)


def test_change_set_across_rejected_versions_is_the_union_with_todays_values() -> None:
    v0 = _weights(0)
    v1, v2 = _moved(v0, 1), None
    v2 = _moved(v1, 2)
    decoder = Decoder({n: RawTensor(t.dtype, t.shape, t.bits.copy()) for n, t in v0.items()}, 0, in_place=True)
    _decode(decoder, 1, v1, v0, 0)
    first = decoder.last_undo
    _decode(decoder, 2, v2, v1, 1)
    changes = ChangeSet.from_undos(decoder.weights, [first, decoder.last_undo])
    assert (changes.version, changes.base_version) == (2, 0)
    for name in CHECKPOINT:
        engine = v0[name].bits.copy()
        positions, values = changes.sparse[name]
        engine[positions] = values
        assert engine.tolist() == v2[name].bits.tolist(), "v0 plus the change set must be v2"
    with pytest.raises(ValueError, match="consecutive"):
        ChangeSet.from_undos(decoder.weights, [decoder.last_undo, first])


def test_change_set_holds_a_tensor_a_delta_rewrote_chunk_by_chunk() -> None:
    """A delta whose chunk is so dense it travels as a keyframe chunk records the rewrite
    as an undo *range*, not as changed positions: the change set must still carry those
    elements, or the engine keeps the old values there and serves a mix of versions."""
    v0 = _weights(0)
    v1 = _moved(v0, 1)
    v1["q"] = _weights(7)["q"]  # every element of q new: cheaper as a keyframe chunk
    decoder = Decoder({n: RawTensor(t.dtype, t.shape, t.bits.copy()) for n, t in v0.items()}, 0, in_place=True)
    _decode(decoder, 1, v1, v0, 0)
    assert [name for name, _, _ in decoder.last_undo.ranges] == ["q"], "the setup must produce a keyframe chunk inside a delta"
    changes = ChangeSet.from_undos(decoder.weights, [decoder.last_undo])
    for name in CHECKPOINT:
        engine = v0[name].bits.copy()
        positions, values = changes.sparse[name]
        engine[positions] = values
        assert engine.tolist() == v1[name].bits.tolist(), f"v0 plus the change set must be v1 ({name})"


def test_change_set_of_a_keyframe_carries_whole_tensors() -> None:
    v0 = _weights(0)
    decoder = Decoder({}, -1, in_place=True)
    _decode(decoder, 3, v0, None, -1)
    changes = ChangeSet.from_undos(decoder.weights, [decoder.last_undo])
    assert changes.is_full(len(CHECKPOINT)) and not changes.sparse
    assert all(changes.dense[n].tolist() == v0[n].bits.tolist() for n in CHECKPOINT)


def test_change_set_lists_an_element_two_versions_changed_once() -> None:
    """Across rejected versions an element changed by both is written once: positions
    are ascending and unique (as ``ChangeSet.sparse`` promises) and ``elements`` counts
    what the engine writes, not the sum of the versions' changes."""
    v0 = _weights(0)
    v1 = _moved(v0, 1)
    v2 = _moved(v1, 2)  # norm has 3 elements: both versions change all of them
    decoder = Decoder({n: RawTensor(t.dtype, t.shape, t.bits.copy()) for n, t in v0.items()}, 0, in_place=True)
    _decode(decoder, 1, v1, v0, 0)
    first = decoder.last_undo
    _decode(decoder, 2, v2, v1, 1)
    changes = ChangeSet.from_undos(decoder.weights, [first, decoder.last_undo])
    for name, (positions, _) in changes.sparse.items():
        assert np.all(np.diff(positions) > 0), f"{name}: positions {positions.tolist()} not ascending and unique"
    union = {n: (v0[n].bits != v1[n].bits) | (v1[n].bits != v2[n].bits) for n in CHECKPOINT}
    assert changes.positions()["norm"].tolist() == [0, 1, 2]
    assert changes.elements == sum(int(np.count_nonzero(m)) for m in union.values())


def test_change_set_across_a_rejected_delta_and_a_keyframe_is_the_keyframe() -> None:
    """A follower that rejected a delta and is then sent a keyframe (the server's plan
    when the chain is not held or is larger) must apply it: the keyframe replaces every
    tensor, so each travels whole and only whole, from the version the engine serves.
    Refusing the pair as not consecutive stopped the follower, and the service with it."""
    v0 = _weights(0)
    v1 = _moved(v0, 1)
    v2 = _weights(2)
    decoder = Decoder({n: RawTensor(t.dtype, t.shape, t.bits.copy()) for n, t in v0.items()}, 0, in_place=True)
    _decode(decoder, 1, v1, v0, 0)
    first = decoder.last_undo
    _decode(decoder, 2, v2, None, -1)
    changes = ChangeSet.from_undos(decoder.weights, [first, decoder.last_undo])
    assert (changes.version, changes.base_version) == (2, 0)
    assert changes.sparse == {} and changes.is_full(len(CHECKPOINT))
    assert all(changes.dense[n].tolist() == v2[n].bits.tolist() for n in CHECKPOINT)
    assert changes.elements == sum(int(np.prod(s)) for s in CHECKPOINT.values())


def test_a_version_that_drops_a_tensor_is_refused_as_a_failed_precondition() -> None:
    """An engine cannot drop a tensor in place. The refusal must be FailedPrecondition,
    naming the tensor: the follower answers that by asking for a keyframe, where any
    other error (a KeyError on the missing tensor) would stop it."""
    v0 = _weights(0)
    decoder = Decoder({n: RawTensor(t.dtype, t.shape, t.bits.copy()) for n, t in v0.items()}, 0, in_place=True)
    _decode(decoder, 1, {n: t for n, t in _weights(1).items() if n != "norm"}, None, -1)
    with pytest.raises(FailedPrecondition, match="'norm'"):
        ChangeSet.from_undos(decoder.weights, [decoder.last_undo])


def test_read_back_comparison_finds_a_wrong_element_through_the_layout() -> None:
    truth = _weights(0)
    layout = _fused()
    qkv = np.concatenate([truth["q"].bits, truth["k"].bits, truth["v"].bits])
    positions = np.arange(24, dtype=np.int64)
    good = Sample("qkv", positions, qkv.copy(), "bf16", "qkv_proj")
    assert compare_samples([good], layout, truth) == (24, 0)
    bad = qkv.copy()
    bad[13] ^= 1  # k's element 1 as the kernel computes with it
    assert compare_samples([Sample("qkv", positions, bad, "bf16", "qkv_proj")], layout, truth) == (24, 1)


def _canary() -> object:
    return canary.build([[1, 2, 3], [4, 5]], [[0.0, -1.0, -2.0], [0.0, -3.0]])


def test_canary_accepts_bf16_noise_and_rejects_a_different_model() -> None:
    probe = _canary()
    ok = canary.compare(probe, [[0.0, -1.01, -2.02], [0.0, -2.99]])  # type: ignore[arg-type]
    assert ok.ok and ok.tokens == 3 and ok.max_diff == pytest.approx(0.02, abs=1e-6)
    far = canary.compare(probe, [[0.0, -1.5, -2.5], [0.0, -3.5]])  # type: ignore[arg-type]
    assert not far.ok and "on average" in far.reason
    spike = canary.compare(probe, [[0.0, -1.0, -2.0], [0.0, -5.0]], mean_tolerance=1.0, max_tolerance=1.5)  # type: ignore[arg-type]
    assert not spike.ok and "single" not in spike.reason and "a canary token" in spike.reason


@pytest.mark.parametrize(
    "served",
    [[[0.0, -1.0, -2.0]], [[0.0, -1.0], [0.0, -3.0]], [[0.0, float("nan"), -2.0], [0.0, -3.0]]],
)
def test_canary_rejects_malformed_scores(served: list[list[float]]) -> None:
    assert not canary.compare(_canary(), served).ok  # type: ignore[arg-type]
