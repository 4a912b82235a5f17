"""The accept/roll-back decision of :class:`WeightUpdater`, on the element (delta) path
and the full path, and what each outcome leaves in the engine.

The engine here is the recording stand-in of ``test_service_failure`` extended with an
element path: its worker keeps engine tensors as numpy arrays and writes change sets
through the layout as ``served_weights`` does (the real one runs inside vLLM: see
tests/integration/test_served_weights.py). ``corrupt`` makes it write one element wrong,
``revert_mismatches`` makes its revert report elements it could not put back.
"""
from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from meridian import canary as canary_check
from meridian.tensors import RawTensor, Weights, from_torch
from services.rollout import rpc_arrays
from services.rollout.served_weights import Sample
from services.rollout.weight_changes import ChangeSet
from services.rollout.weight_layout import Run, WeightLayout
from services.rollout.weight_updates import WeightUpdater, compare_samples, expected_positions, same_value
from tests.unit.test_service_failure import FakeEngine, FakeLLM

# q (2x3) and k (1x3) fused into qkv (3x3); norm on its own.
LAYOUT = WeightLayout({"q": [Run("qkv", 0, 0, 6)], "k": [Run("qkv", 0, 6, 3)], "norm": [Run("norm", 0, 0, 3)]}, {"qkv": (3, 3), "norm": (3,)})
SHAPES = {"q": (2, 3), "k": (1, 3), "norm": (3,)}


def _weights(seed: int) -> dict[str, RawTensor]:
    rng = np.random.default_rng(seed)
    return {n: RawTensor("bf16", s, rng.integers(0x3C00, 0x4000, size=int(np.prod(s)), dtype=np.uint16)) for n, s in SHAPES.items()}


def _delta(weights: dict[str, RawTensor], version: int) -> tuple[dict[str, RawTensor], ChangeSet]:
    """A new version moving one element of each tensor, and its change set."""
    new = {n: RawTensor(t.dtype, t.shape, t.bits.copy()) for n, t in weights.items()}
    sparse = {}
    for n, t in new.items():
        t.bits[1] ^= np.uint16(1)
        sparse[n] = (np.array([1], dtype=np.int64), t.bits[[1]])
    return new, ChangeSet(version, version - 1, sparse, {}, {n: (t.dtype, tuple(t.shape)) for n, t in new.items()})


class ElementLLM(FakeLLM):
    """A worker with the element path: engine tensors in numpy, writes through the layout."""

    def __init__(self, weights: Weights, fail: set[str] = frozenset(), corrupt: bool = False, revert_mismatches: int = 0) -> None:
        super().__init__(set(fail))
        self.engine = {t: np.zeros(int(np.prod(s)), dtype=np.uint16) for t, s in LAYOUT.targets.items()}
        self._load(weights)
        self.corrupt = corrupt
        self.revert_mismatches = revert_mismatches
        self.undo: list[tuple[str, np.ndarray, np.ndarray]] = []
        self.reloaded: list[Weights] = []
        self.layout_error = ""  # what meridian_prepare answers instead of a layout
        self.readable = 1 << 30  # elements per engine tensor meridian_prepare reads back

    def _load(self, weights: Weights) -> None:
        for name, t in weights.items():
            for target, dst, offset, length in LAYOUT.place_range(name, 0, t.bits.shape[0]):
                self.engine[target][dst : dst + length] = t.bits[offset : offset + length]

    def _samples(self, verify: dict[str, Any]) -> list[Any]:
        out = []
        for target, packed in verify.items():
            positions = rpc_arrays.unpack_positions(packed)
            out.append(Sample(target, positions, self.engine[target][positions].copy(), "bf16", target).as_plain())
        return out

    async def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        await super().collective_rpc(method, args)
        if method == "meridian_apply":
            changes, verify = args
            for name, (packed_positions, packed_values) in changes["sparse"].items():
                positions, values = rpc_arrays.unpack_positions(packed_positions), rpc_arrays.unpack(packed_values)
                for placed in LAYOUT.place(name, positions):
                    self.undo.append((placed.target, placed.positions, self.engine[placed.target][placed.positions].copy()))
                    self.engine[placed.target][placed.positions] = values[placed.index]
            if self.corrupt:
                self.engine["qkv"][7] ^= 1  # k's element 1, as the kernels would compute with it
            return [{"samples": self._samples(verify), "write_ms": 0.0, "process_ms": 0.0, "readback_ms": 0.0}]
        if method == "meridian_prepare":
            if self.layout_error:
                return [{"error": self.layout_error}]
            verify = {t: rpc_arrays.pack_positions(np.arange(a.shape[0], dtype=np.int64)[: self.readable]) for t, a in self.engine.items()}
            return [{"layout": LAYOUT.as_plain(), "samples": self._samples(verify), "shadow_bytes": 0}]
        if method == "meridian_commit":
            self.undo = []
        if method == "meridian_revert":
            for target, positions, old in reversed(self.undo):
                self.engine[target][positions] = old
            self.undo = []
            return [{"mismatches": self.revert_mismatches}]
        if method == "meridian_full_reload":
            from safetensors.torch import load_file

            # The file the updater wrote: what a full reload puts into the engine.
            loaded = {n: from_torch(t) for n, t in load_file(args[0]).items()}
            self.reloaded.append(loaded)
            self._load(loaded)
        return [0]


def _engine_holds(llm: ElementLLM, weights: Weights) -> bool:
    expected = ElementLLM(weights)
    return all(np.array_equal(llm.engine[t], expected.engine[t]) for t in llm.engine)


def _delta_updater(llm: ElementLLM) -> tuple[WeightUpdater, FakeEngine]:
    engine = FakeEngine(set())
    engine.llm = llm  # type: ignore[assignment]
    updater = WeightUpdater(engine, "delta")  # type: ignore[arg-type]
    updater.layout = LAYOUT  # what prepare() finds when the loaded model reads back right
    return updater, engine


def _canary(logprob: float = 0.0) -> Any:
    return canary_check.build([[1, 2, 3]], [[0.0, logprob, logprob]])


def test_a_delta_update_that_reads_back_right_is_committed_and_served() -> None:
    """The control: written, read back equal, canary agrees -- committed (the worker
    forgets how to undo it) and served."""
    v0 = _weights(0)
    v1, changes = _delta(v0, 1)
    llm = ElementLLM(v0)
    updater, engine = _delta_updater(llm)
    report = asyncio.run(updater.update(changes, v1, _canary(), lambda: v0))
    assert report.accepted and report.path == "delta" and report.error == ""
    assert report.readback_elements == 3 and report.readback_mismatches == 0 and report.elements == 3
    assert engine.version == 1 and engine.settled == [(1, True)] and engine.gate_open
    assert "meridian_commit" in llm.calls and llm.undo == [], "an accepted version must be committed in the worker"
    assert _engine_holds(llm, v1)


def test_a_delta_update_that_reads_back_wrong_is_rolled_back() -> None:
    """One element the kernels compute with differs from the published version: the
    version is rejected, the report counts the mismatch, and what the write overwrote is
    put back -- the engine holds the served version again."""
    v0 = _weights(0)
    v1, changes = _delta(v0, 1)
    llm = ElementLLM(v0, corrupt=True)
    updater, engine = _delta_updater(llm)
    report = asyncio.run(updater.update(changes, v1, _canary(), lambda: v0))
    assert not report.accepted and (report.readback_elements, report.readback_mismatches) == (3, 1)
    assert "other weights than version 1 at 1 of 3" in report.error
    assert engine.version == 0 and engine.settled == [(1, False)] and engine.gate_open
    assert "meridian_commit" not in llm.calls and "meridian_revert" in llm.calls
    assert _engine_holds(llm, v0)


def test_a_version_the_canary_disagrees_with_is_rolled_back() -> None:
    """Read-back right, canary off by a nat per token: rejected, with the verdict in the
    report, and the served version back in the engine."""
    v0 = _weights(0)
    v1, changes = _delta(v0, 1)
    llm = ElementLLM(v0)
    updater, engine = _delta_updater(llm)
    report = asyncio.run(updater.update(changes, v1, _canary(-1.0), lambda: v0))
    assert not report.accepted and report.error.startswith("canary:")
    assert report.canary is not None and not report.canary.ok and report.canary.mean_diff == pytest.approx(1.0)
    assert engine.version == 0 and engine.settled == [(1, False)]
    assert _engine_holds(llm, v0)


def test_a_roll_back_the_worker_cannot_prove_reloads_the_served_version_and_leaves_the_element_path() -> None:
    """The revert left elements wrong: the served version is reloaded whole (from
    ``previous()``), and the element path is left for good -- its held tensors can no
    longer be trusted -- so the next update takes the full path."""
    v0 = _weights(0)
    v1, changes = _delta(v0, 1)
    llm = ElementLLM(v0, corrupt=True, revert_mismatches=2)
    updater, engine = _delta_updater(llm)
    report = asyncio.run(updater.update(changes, v1, _canary(), lambda: v0))
    assert not report.accepted and engine.version == 0
    assert len(llm.reloaded) == 1 and all(np.array_equal(llm.reloaded[0][n].bits, v0[n].bits) for n in v0)
    assert _engine_holds(llm, v0)
    assert updater.layout is None and "roll-back of version 1" in updater.fallback_reason
    llm.corrupt = False
    v2, changes2 = _delta(v0, 1)
    report = asyncio.run(updater.update(changes2, v2, _canary(), lambda: v0))
    assert report.accepted and report.path == "full" and _engine_holds(llm, v2)


@pytest.mark.parametrize("fault", ["none", "loaded differently", "nothing read back", "loader not followable"])
def test_the_element_path_is_taken_only_when_the_loaded_model_reads_back_as_the_checkpoint(fault: str) -> None:
    """``prepare`` trusts the element path only if every element the engine read back is
    the checkpoint's, and at least one was: else updates take the full path, and
    ``fallback_reason`` says why."""
    v0 = _weights(0)
    llm = ElementLLM(v0)
    if fault == "loaded differently":
        llm.engine["norm"][2] ^= 1
    elif fault == "nothing read back":
        llm.readable = 0
    elif fault == "loader not followable":
        llm.layout_error = "the loader copies a strided view"
    engine = FakeEngine(set())
    engine.llm = llm  # type: ignore[assignment]
    updater = WeightUpdater(engine, "delta")  # type: ignore[arg-type]
    asyncio.run(updater.prepare(v0, []))
    if fault == "none":
        assert updater.layout is not None and updater.layout.runs == LAYOUT.runs and updater.fallback_reason == ""
        return
    assert updater.layout is None
    assert {"loaded differently": "in 1 of 12 elements", "nothing read back": "in 0 of 0 elements", "loader not followable": "strided view"}[fault] in updater.fallback_reason


class OrderedEngine(FakeEngine):
    """The stand-in engine, logging its pauses and resumes among the worker calls."""

    async def pause(self) -> None:
        self.llm.calls.append("pause")

    async def freeze(self) -> None:
        self.llm.calls.append("freeze")

    async def resume(self) -> None:
        self.llm.calls.append("resume")


def test_a_roll_back_runs_with_the_engine_frozen_and_drops_the_candidates_kv() -> None:
    """Requests in flight resumed with the candidate during its trial: the revert must
    happen frozen (no step computes on half-reverted weights), the KV the candidate
    computed is dropped before anything runs again, and the engine resumes last."""
    v0 = _weights(0)
    v1, changes = _delta(v0, 1)
    llm = ElementLLM(v0)
    engine = OrderedEngine(set())
    engine.llm = llm  # type: ignore[assignment]
    updater = WeightUpdater(engine, "delta")  # type: ignore[arg-type]
    updater.layout = LAYOUT
    report = asyncio.run(updater.update(changes, v1, _canary(-1.0), lambda: v0))
    assert not report.accepted
    trial = llm.calls.index("resume")  # the candidate is served past the gate for its canary
    assert llm.calls[:trial] == ["pause", "meridian_apply", "reset_prefix_cache"]
    assert llm.calls[trial + 1 :] == ["freeze", "meridian_revert", "reset_prefix_cache", "resume"]


# ------------------------------------------------------------ pure parts


@pytest.mark.parametrize(
    ("dtype", "bits", "normal", "subnormal", "nan", "inf"),
    [
        ("bf16", np.uint16, 0x3F80, 0x0001, 0x7FC0, 0x7F80),
        ("fp16", np.uint16, 0x3C00, 0x0001, 0x7E00, 0x7C00),
        ("fp32", np.uint32, 0x3F800000, 0x00000001, 0x7FC00000, 0x7F800000),
    ],
)
def test_read_back_equality_is_bitwise_but_for_flushed_subnormals_and_nan_payloads(dtype: str, bits: type, normal: int, subnormal: int, nan: int, inf: int) -> None:
    """What a kernel may compute with instead of the published bits: a subnormal as a
    (signed) zero, another NaN. Nothing else passes: a subnormal as another value, a zero
    as a subnormal, a NaN as an infinity, a normal number one bit off."""
    sign = 1 << (16 if bits is np.uint16 else 32) - 1
    pairs = {
        (normal, normal): True,
        (normal, normal + 1): False,
        (subnormal, 0): True,
        (subnormal, sign): True,
        (subnormal, subnormal + 1): False,
        (0, subnormal): False,
        (nan, nan + 1): True,
        (nan, inf): False,
        (inf, nan): False,
        (inf, inf): True,
    }
    want = np.array([w for w, _ in pairs], dtype=bits)
    got = np.array([g for _, g in pairs], dtype=bits)
    assert same_value(want, got, dtype).tolist() == list(pairs.values())


def test_read_back_of_an_engine_running_fp32_is_compared_in_its_dtype() -> None:
    """A bf16 checkpoint in an engine that computes in fp32: the published bits are
    converted before the comparison, so equal values compare equal and one wrong element
    is counted once."""
    truth = {"norm": RawTensor("bf16", (3,), np.array([0x3F80, 0xC000, 0x3E00], dtype=np.uint16))}
    layout = WeightLayout({"norm": [Run("norm", 0, 0, 3)]}, {"norm": (3,)})
    engine = truth["norm"].bits.astype(np.uint32) << 16  # bf16 is the top half of fp32
    positions = np.arange(3, dtype=np.int64)
    assert compare_samples([Sample("norm", positions, engine, "fp32", "norm")], layout, truth) == (3, 0)
    engine[2] ^= 1
    assert compare_samples([Sample("norm", positions, engine, "fp32", "norm")], layout, truth) == (3, 1)


def test_the_read_back_checks_tensors_that_travel_whole() -> None:
    """A tensor in a change set's dense part (a keyframe) is read back too -- at a sample
    of its positions, in the engine's coordinates -- not left unchecked."""
    weights = _weights(0)
    changes = ChangeSet(3, 2, {}, {"k": weights["k"].bits}, {"k": ("bf16", (1, 3))})
    positions = expected_positions(changes, LAYOUT)
    assert set(positions) == {"qkv"} and positions["qkv"].size > 0
    assert set(positions["qkv"].tolist()) <= {6, 7, 8}, "k lands on qkv's last row"
