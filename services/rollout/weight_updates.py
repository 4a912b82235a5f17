"""How a new policy version reaches the engine, and the proof that it did.

One update, in order:

1. close the front gate (new requests wait) and pause the engine between steps;
2. write the version into the engine: only the changed elements, in place, through the
   worker's element path (``served_weights``); or, where the engine's loader cannot be
   followed element-wise, every tensor through vLLM's reload (the *full* path);
3. **read-back**: compare what the engine's kernels compute with, at the changed
   positions, with the published (hash-verified) weights -- bit for bit;
4. reset the prefix cache (its KV blocks were computed by the old weights), label the
   engine's tokens as the candidate's, resume, and score the version's **canary** past
   the gate: the trainer's own log-probs for fixed sequences under these weights;
5. both agree: the candidate is served (label, version, gate open). Either disagrees,
   or a step could not run (the engine refused to drop its cache, a scoring call failed):
   freeze, put back exactly what step 2 overwrote, check that the kernels compute with
   the old weights again, and keep serving the old version; the report says why.

A roll-back that fails, or an accepted version the engine cannot commit, leaves the
weights it computes with unknown: :meth:`WeightUpdater.update` raises, the gate stays
closed, and the service stops (see ``RolloutService.failure``).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
from opentelemetry.trace import Link

from meridian import canary as canary_check
from meridian import telemetry
from meridian.v1 import weightsync_pb2 as wpb
from services.rollout import rpc_arrays
from services.rollout.engine import Engine
from services.rollout.served_weights import Sample
from services.rollout.weight_changes import ChangeSet
from services.rollout.weight_layout import WeightLayout
from meridian.tensors import RawTensor, Weights, to_torch

log = logging.getLogger(__name__)
tracer = telemetry.tracer(__name__)

APPLY_PATHS = ("delta", "full")


@dataclasses.dataclass
class UpdateReport:
    """What one update did and how it was verified."""

    version: int
    accepted: bool
    path: str
    apply_ms: float = 0.0
    elements: int = 0
    readback_elements: int = 0
    readback_mismatches: int = 0
    canary: canary_check.CanaryVerdict | None = None
    error: str = ""
    timings: dict[str, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Tolerance:
    mean: float = canary_check.DEFAULT_MEAN_TOLERANCE
    max: float = canary_check.DEFAULT_MAX_TOLERANCE


def compare_samples(samples: Sequence[Sample], layout: WeightLayout, truth: Weights) -> tuple[int, int]:
    """(elements compared, elements that differ) between read-back samples and ``truth``
    (checkpoint names and dtypes; converted to the engine's dtype where they differ)."""
    compared = differ = 0
    for s in samples:
        for name, positions, index in layout.to_checkpoint(s.target, s.positions):
            expected = truth[name]
            want = expected.bits[positions]
            if expected.dtype != s.dtype:
                want = _convert_bits(want, expected.dtype, s.dtype)
            compared += index.size
            differ += int(np.count_nonzero(~same_value(want, s.bits[index], s.dtype)))
    return compared, differ


_LAYOUT = {"bf16": (15, 7), "fp16": (15, 10), "fp32": (31, 23)}  # sign bit, mantissa bits


def same_value(want: np.ndarray, got: np.ndarray, dtype: str) -> np.ndarray:
    """Bitwise equality, except what a kernel may legitimately compute with instead: a
    subnormal as a zero (CPUs flush them to zero in matrix units) and any NaN as a NaN."""
    sign, mantissa = _LAYOUT[dtype]
    one = want.dtype.type(1)
    exponent_mask = ((one << (sign - mantissa)) - one) << mantissa
    mantissa_mask = (one << mantissa) - one
    magnitude = ~(one << sign)
    want_exp, got_exp = want & exponent_mask, got & exponent_mask
    subnormal_as_zero = (want_exp == 0) & ((got & magnitude) == 0)
    both_nan = (want_exp == exponent_mask) & ((want & mantissa_mask) != 0) & (got_exp == exponent_mask) & ((got & mantissa_mask) != 0)
    return (want == got) | subnormal_as_zero | both_nan


def expected_positions(changes: ChangeSet, layout: WeightLayout, dense_sample: int = 4096) -> dict[str, np.ndarray]:
    """Engine positions the change set must change, per engine tensor: what the read-back
    checks (a whole tensor is represented by a sample of its positions)."""
    rng = np.random.default_rng(changes.version)
    out: dict[str, list[np.ndarray]] = {}
    picks = {n: p for n, (p, _) in changes.sparse.items()}
    for name, values in changes.dense.items():
        picks[name] = np.unique(rng.integers(0, values.shape[0], size=min(dense_sample, values.shape[0]), dtype=np.int64))
    for name, positions in picks.items():
        for placed in layout.place(name, positions):
            out.setdefault(placed.target, []).append(placed.positions)
    return {t: np.concatenate(p) for t, p in out.items()}


def _convert_bits(bits: np.ndarray, source: str, target: str) -> np.ndarray:
    from services.rollout.served_weights import engine_values, to_numpy_bits

    return to_numpy_bits(engine_values(bits, source, _torch_dtype(target), "cpu").view(_torch_dtype(target)))


def _torch_dtype(name: str):  # type: ignore[no-untyped-def]
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


class WeightUpdater:
    """Applies verified versions to one :class:`Engine` (see the module docstring)."""

    def __init__(self, engine: Engine, path: str = "delta", tolerance: Tolerance = Tolerance()) -> None:
        if path not in APPLY_PATHS:
            raise ValueError(f"apply path must be one of {APPLY_PATHS}, got {path!r}")
        self.engine = engine
        self.path = path
        self.tolerance = tolerance
        self.layout: WeightLayout | None = None
        self.fallback_reason = "full path chosen" if path == "full" else ""

    async def prepare(self, weights: Weights, files: Sequence[Path]) -> None:
        """Sets up the delta path against the version the engine loaded (``weights``, from
        ``files``): the worker discovers the layout and reads back every tensor, and all of
        it must match. Otherwise updates take the full path, and the log says why."""
        if self.path == "full":
            return
        checkpoint = {n: (t.dtype, list(t.shape)) for n, t in weights.items()}
        replies = await self.engine.llm.collective_rpc("meridian_prepare", args=(checkpoint, [str(f) for f in files]))
        reply = replies[0]
        if "error" in reply:
            self.fallback_reason = f"the engine's loader cannot be followed element-wise: {reply['error']}"
            log.warning("weight updates take the full path: %s", self.fallback_reason)
            return
        layouts = [WeightLayout.from_plain(r["layout"]) for r in replies]
        compared, differ = compare_samples([Sample.from_plain(p) for p in reply["samples"]], layouts[0], weights)
        if differ or not compared:
            self.fallback_reason = f"read-back of the loaded model differs from the checkpoint in {differ} of {compared} elements"
            log.warning("weight updates take the full path: %s", self.fallback_reason)
            return
        self.layout = layouts[0]
        log.info(
            "delta weight updates ready: %d checkpoint tensors in %d engine tensors; %.0f MiB kept unpacked; %d elements read back",
            len(self.layout.runs), len(self.layout.targets), reply["shadow_bytes"] / 2**20, compared,
        )

    async def update(
        self, changes: ChangeSet, truth: Weights, canary: wpb.Canary | None, previous: Callable[[], Weights], trace_context: Mapping[str, str] | None = None
    ) -> UpdateReport:
        """Applies ``changes`` (taking the engine from its version to ``changes.version``),
        verifies, and commits or rolls back. ``truth`` are the published weights of the new
        version; ``previous()`` rebuilds the served version's (only the full path needs it).
        ``trace_context`` (the version manifest's: the trainer step that published it) becomes
        a link of the ``rollout.weight_update`` span."""
        engine = self.engine
        path = "delta" if self.layout is not None else "full"
        report = UpdateReport(changes.version, False, path, elements=changes.elements)
        published_by = telemetry.span_context_of(dict(trace_context)) if trace_context else None
        with tracer.start_as_current_span("rollout.weight_update", links=[Link(published_by)] if published_by else None) as span:
            span.set_attribute("meridian.version", changes.version)
            span.set_attribute("meridian.base_version", engine.version)
            span.set_attribute("meridian.apply_path", path)
            async with engine.update_lock:
                t0 = time.perf_counter()
                engine.close_gate()
                await engine.pause()
                report.timings["pause_ms"] = (time.perf_counter() - t0) * 1e3
                try:
                    await self._write(changes, truth, report)
                except Exception as exc:  # noqa: BLE001 - a failed write is a rejected version
                    report.error = f"writing the version into the engine failed: {type(exc).__name__}: {exc}"
                if not report.error:
                    try:
                        await self._trial(changes.version, canary, report)
                    except Exception as exc:  # noqa: BLE001 - so is a trial that could not run
                        report.error = f"trying the version in the engine failed: {type(exc).__name__}: {exc}"
                if report.error:
                    await self._roll_back(changes.version, path, previous)
                else:
                    await self._accept(changes.version, path)
                # Not in a finally: after a failed roll-back the engine's weights are unknown
                # and it must not serve (the exception says so).
                engine.open_gate()
                report.apply_ms = (time.perf_counter() - t0) * 1e3
            report.accepted = not report.error
            span.set_attribute("meridian.accepted", report.accepted)
            span.set_attribute("meridian.apply_ms", report.apply_ms)
            if report.error:
                span.add_event("weight_update_rejected", {"reason": report.error, "version": changes.version})
                log.error("version %d rejected, still serving %d: %s", changes.version, engine.version, report.error)
        return report

    async def _write(self, changes: ChangeSet, truth: Weights, report: UpdateReport) -> None:
        """Step 2 and 3: write the version, then compare the read-back with ``truth``."""
        t0 = time.perf_counter()
        if report.path == "delta":
            assert self.layout is not None
            verify = {t: rpc_arrays.pack_positions(p) for t, p in expected_positions(changes, self.layout).items()}
            reply = (await self.engine.llm.collective_rpc("meridian_apply", args=(changes.as_plain(), verify)))[0]
            report.timings.update({k: reply[k] for k in ("write_ms", "process_ms", "readback_ms")})
            report.timings["rpc_ms"] = (time.perf_counter() - t0) * 1e3
            t1 = time.perf_counter()
            compared, differ = compare_samples([Sample.from_plain(p) for p in reply["samples"]], self.layout, truth)
            report.timings["compare_ms"] = (time.perf_counter() - t1) * 1e3
            report.readback_elements, report.readback_mismatches = compared, differ
            if differ:
                report.error = f"the engine computes with other weights than version {changes.version} at {differ} of {compared} elements read back"
            return
        await self._full_reload(truth)
        report.timings["reload_ms"] = (time.perf_counter() - t0) * 1e3

    async def _trial(self, version: int, canary: wpb.Canary | None, report: UpdateReport) -> None:
        """Step 4: score the canary with the candidate being served past the gate."""
        engine = self.engine
        await _drop_cached_kv(engine)
        await engine.label_trial(version)
        await engine.resume()
        t0 = time.perf_counter()
        if canary is not None and canary.sequences:
            # One batch: the sequences are prefilled together, as any concurrent requests are.
            served = await asyncio.gather(*(engine.score_now(list(seq.token_ids)) for seq in canary.sequences))
            verdict = canary_check.compare(canary, served, self.tolerance.mean, self.tolerance.max)
            report.canary = verdict
            if not verdict.ok:
                report.error = f"canary: {verdict.reason}"
        report.timings["canary_ms"] = (time.perf_counter() - t0) * 1e3

    async def _accept(self, version: int, path: str) -> None:
        """Step 5: the candidate becomes the served version. Not undone on failure: once
        the engine forgot how to revert, what it computes with is no longer known (the
        exception says so, and the follower ends)."""
        if path == "delta":
            await self.engine.llm.collective_rpc("meridian_commit")
        await self.engine.settle_trial(version, accepted=True)

    async def _roll_back(self, version: int, path: str, previous: Callable[[], Weights]) -> None:
        """Puts the served version back and proves the kernels compute with it again; when
        the element path cannot, reloads the served version whole and leaves the element
        path (its held tensors can no longer be trusted)."""
        engine = self.engine
        await engine.freeze()
        try:
            if path == "delta":
                reply = (await engine.llm.collective_rpc("meridian_revert"))[0]
                if reply["mismatches"]:
                    log.error("rolling back version %d left %d elements wrong; reloading version %d whole", version, reply["mismatches"], engine.version)
                    self.layout, self.fallback_reason = None, f"a roll-back of version {version} failed its read-back"
                    path = "full"
            if path == "full":
                await self._full_reload(previous())
            await _drop_cached_kv(engine)
            await engine.settle_trial(version, accepted=False)
        finally:
            await engine.resume()

    async def _full_reload(self, weights: Weights) -> None:
        path = await asyncio.to_thread(_write_shared, weights)
        try:
            await self.engine.llm.collective_rpc("meridian_full_reload", args=(path,))
        finally:
            os.unlink(path)


async def _drop_cached_kv(engine: Engine) -> None:
    """Forgets every KV block the previous weights computed: the prefix cache, and the
    KV of requests frozen mid-generation (they are preempted and recomputed from their
    tokens so far, so their next tokens come from the new weights on a consistent cache)."""
    if not await engine.llm.reset_prefix_cache(reset_running_requests=True):
        raise RuntimeError("the engine could not drop its KV cache")


def _write_shared(weights: Mapping[str, RawTensor]) -> str:
    """A safetensors file the engine's workers can load (shared memory when available)."""
    from safetensors.torch import save_file

    folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
    fd, path = tempfile.mkstemp(dir=folder, prefix="meridian-weights-", suffix=".safetensors")
    os.close(fd)
    save_file({n: to_torch(t) for n, t in weights.items()}, path)
    return path
