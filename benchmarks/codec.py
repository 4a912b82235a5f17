"""Benchmark helpers for the weight-sync delta codec.

Two public entry points:

* :func:`synthetic_adam_versions` builds consecutive versions of a model's
  weights the way a real RL trainer produces them (fp32 master weights, AdamW
  steps with lr 1e-6, cast to bf16 by round-to-nearest-even), so that tests
  and benchmarks see the same statistics as production without loading a
  real model.
* :func:`run_codec_bench` encodes/decodes each consecutive pair of versions
  and reports sizes (ours, raw, zstd, XOR+zstd) and single-thread speeds.
"""

from __future__ import annotations

import os
import statistics
import time

import numpy as np
import zstandard

from services.weightsync import codec

__all__ = ["synthetic_adam_versions", "run_codec_bench", "fp32_to_bf16_bits"]

APPLY_REPEATS = 3


# --------------------------------------------------------------------------
# Synthetic AdamW trajectories
# --------------------------------------------------------------------------


def fp32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Cast float32 values to bf16 raw bits (uint16) with round-to-nearest-even.

    Implemented on the fp32 bit pattern, exactly as torch does it for finite
    values: add 0x7FFF plus the lowest kept bit, then drop the low 16 bits.
    NaNs are kept quiet (the payload would otherwise round into infinity).
    """
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    lsb = (bits >> np.uint32(16)) & np.uint32(1)
    rounded = ((bits + np.uint32(0x7FFF) + lsb) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        rounded[nan] = ((bits[nan] >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)
    return rounded


def _default_shapes(n_elems: int, rng: np.random.Generator) -> list[tuple[str, int, str]]:
    """Pick tensor sizes resembling a small transformer: one embedding, many
    matrices, a few LayerNorm-like gain vectors. Returns (name, size, kind)."""
    hidden = 576
    shapes: list[tuple[str, int, str]] = []
    emb = max(hidden, n_elems // 4)
    shapes.append(("model.embed_tokens.weight", emb, "matrix"))
    remaining = n_elems - emb
    layer = 0
    while remaining > 0:
        for part, mult in (("q_proj", 1), ("o_proj", 1), ("up_proj", 2.67), ("down_proj", 2.67)):
            size = min(remaining, int(hidden * hidden * mult))
            if size <= 0:
                break
            shapes.append((f"model.layers.{layer}.{part}.weight", size, "matrix"))
            remaining -= size
        if remaining > 0:
            size = min(remaining, hidden)
            shapes.append((f"model.layers.{layer}.input_layernorm.weight", size, "norm"))
            remaining -= size
        layer += 1
    return shapes


def synthetic_adam_versions(
    n_elems: int = 20_000_000,
    steps: int = 5,
    *,
    lr: float = 1e-6,
    weight_decay: float = 0.01,
    seed: int = 0,
) -> list[dict[str, np.ndarray]]:
    """Return ``steps + 1`` consecutive bf16 versions (raw uint16 bits) of a
    synthetic model with about ``n_elems`` parameters.

    Model: fp32 master weights ``w ~ N(0, sigma)`` with a per-tensor sigma in
    [0.01, 0.1] (LayerNorm-like gains ~ 1.0). Each step is AdamW with
    warmed-up moments: gradients are ``g = mu + tau * N(0, 1)`` with a small
    persistent per-element drift ``mu`` (so the update direction is partly
    persistent, as in real training), ``m``/``v`` start at their stationary
    values, and the update is ``lr * (m / (sqrt(v) + eps) + wd * w)``.
    With lr = 1e-6 about 0.3-0.4 % of bf16 elements change per step.
    """
    rng = np.random.default_rng(seed)
    beta1, beta2, eps = 0.9, 0.999, 1e-8
    masters: dict[str, np.ndarray] = {}
    states: dict[str, tuple[np.ndarray, ...]] = {}
    shapes = _default_shapes(n_elems, rng)
    # Stratified per-tensor sigmas in [0.01, 0.1] (shuffled), so the changed
    # fraction does not swing with a few random draws; the embedding gets
    # the usual init std 0.02.
    n_mat = sum(kind == "matrix" for _, _, kind in shapes)
    sigmas = list(rng.permutation(np.linspace(0.01, 0.1, max(n_mat - 1, 1))))
    for name, size, kind in shapes:
        if kind == "norm":
            w = (1.0 + 0.05 * rng.standard_normal(size, dtype=np.float32)).astype(np.float32)
        else:
            sigma = 0.02 if name == "model.embed_tokens.weight" or not sigmas else float(sigmas.pop())
            w = (sigma * rng.standard_normal(size, dtype=np.float32)).astype(np.float32)
        # Per-element gradient noise scale: tensor scale times a log-normal
        # spread, so some elements move (and change bf16 value) more often.
        tau = np.float32(rng.uniform(1e-4, 1e-2)) * np.exp(0.5 * rng.standard_normal(size, dtype=np.float32)).astype(np.float32)
        mu = (0.05 * tau * rng.standard_normal(size, dtype=np.float32)).astype(np.float32)
        # Warmed-up moments: E[m] = mu, Var[m] = tau^2 (1-b1)/(1+b1). v carries
        # the long (beta2 = 0.999) memory of larger early gradients: 3.5x the
        # current stationary value, so |m/sqrt(v)| ~ 0.1 and 0.3-0.4 % change.
        m = mu + np.float32(np.sqrt((1 - beta1) / (1 + beta1))) * tau * rng.standard_normal(size, dtype=np.float32)
        v = (3.5 * (mu * mu + tau * tau)).astype(np.float32)
        masters[name] = w
        states[name] = (m.astype(np.float32), v, mu, tau)

    versions = [{k: fp32_to_bf16_bits(w) for k, w in masters.items()}]
    for _ in range(steps):
        out: dict[str, np.ndarray] = {}
        for name, w in masters.items():
            m, v, mu, tau = states[name]
            g = mu + tau * rng.standard_normal(w.size, dtype=np.float32)
            m *= np.float32(beta1)
            m += np.float32(1 - beta1) * g
            v *= np.float32(beta2)
            v += np.float32(1 - beta2) * g * g
            upd = m / (np.sqrt(v) + np.float32(eps))
            upd += np.float32(weight_decay) * w
            w -= np.float32(lr) * upd
            out[name] = fp32_to_bf16_bits(w)
        versions.append(out)
    return versions


# --------------------------------------------------------------------------
# Benchmark
# --------------------------------------------------------------------------


def _warm_up(dtype: str) -> float:
    """Trigger numba compilation (or cache load) of every format outside the timed region."""
    t0 = time.perf_counter()
    raw = codec.DTYPES[dtype]
    vs = [np.arange(4096, dtype=raw)]
    for _ in range(2):
        nxt = vs[-1].copy()
        nxt[::7] += raw(1)
        vs.append(nxt)
    for fmt in codec.FORMAT_VERSIONS:
        ctx = idx = None
        for old, new in zip(vs, vs[1:]):
            chunks = codec.encode_tensor("warmup", new, old, dtype, format_version=fmt, context=ctx, index=idx)
            buf = old.copy()
            for j, c in enumerate(chunks):
                held_idx = codec.ensure_index(c.payload, buf, idx[j] if idx else None)
                codec.decode_chunk_into(c.payload, buf, buf, context=ctx[j] if ctx else None, index=held_idx)
            ctx = [c.changes for c in chunks] if fmt >= 2 else None
            idx = [c.index for c in chunks] if fmt == 3 else None
    return time.perf_counter() - t0


def _format_figures(
    old_v: dict[str, np.ndarray],
    new_v: dict[str, np.ndarray],
    dtype: str,
    fmt: int,
    state: tuple[dict[str, list], dict[str, list]] | None,
    chunk_elems: int,
) -> tuple[dict, tuple[dict[str, list], dict[str, list]], bool]:
    """Encode one step in format ``fmt``, decode it into fresh buffers and apply
    it in place; returns the figures, the next state (per tensor the chunks'
    contexts and position indexes, as a receiver keeps them) and
    bit-exactness.

    Format 3's receiver builds a chunk's index once, before its first delta
    (``ensure_index``, a pass over the chunk): timed apart as
    ``index_build_s``, not as apply time, since it is paid once, not per version."""
    names = sorted(new_v)
    raw_bytes = sum(new_v[k].nbytes for k in names)
    context, index = state if state is not None else (None, None)

    def ctx(k: str) -> list | None:
        return context[k] if context is not None and fmt >= 2 else None

    def idx(k: str) -> list | None:
        return index[k] if index is not None and fmt == 3 else None

    t0 = time.perf_counter()
    encoded = {
        k: codec.encode_tensor(k, new_v[k], old_v[k], dtype, chunk_elems=chunk_elems, context=ctx(k), index=idx(k), format_version=fmt) for k in names
    }
    t_enc = time.perf_counter() - t0

    # The receiver's indexes of old (format 3): built where missing (first use).
    t0 = time.perf_counter()
    held_idx = {k: [codec.ensure_index(c.payload, old_v[k], idx(k)[j] if idx(k) else None) for j, c in enumerate(encoded[k])] for k in names}
    t_build = time.perf_counter() - t0

    outs = {k: np.zeros_like(new_v[k]) for k in names}  # allocation is not decode work
    t0 = time.perf_counter()
    for k in names:
        c_k = ctx(k)
        for j, chunk in enumerate(encoded[k]):
            codec.decode_chunk_into(chunk.payload, outs[k], old_v[k], context=c_k[j] if c_k else None, index=held_idx[k][j])
    t_dec = time.perf_counter() - t0
    exact = all(np.array_equal(outs[k], new_v[k]) for k in names)

    # In place, as a receiver applies a version: cost should follow the changes.
    # Best of APPLY_REPEATS: on a shared machine the minimum is the least noisy.
    t_apply = c_apply = float("inf")
    for _ in range(APPLY_REPEATS):
        held = {k: old_v[k].copy() for k in names}
        got: dict[str, list] = {}
        t0, c0 = time.perf_counter(), time.thread_time()
        for k in names:
            c_k = ctx(k)
            got[k] = [
                codec.decode_chunk_into(chunk.payload, held[k], held[k], context=c_k[j] if c_k else None, index=held_idx[k][j])
                for j, chunk in enumerate(encoded[k])
            ]
        t_apply = min(t_apply, time.perf_counter() - t0)
        c_apply = min(c_apply, time.thread_time() - c0)
        exact = exact and all(np.array_equal(held[k], new_v[k]) for k in names)
    # The next version's indexes: what each delta's decode returned (None after
    # a keyframe chunk: rebuilt at first use); they must equal the encoder's.
    next_idx = {k: [ch.index if ch is not None else None for ch in got[k]] for k in names}
    if fmt == 3:
        exact = exact and all(
            a is None or b is None or a.fingerprint == b.fingerprint for k in names for a, b in zip(next_idx[k], (c.index for c in encoded[k]))
        )
    fig = {
        "bytes": sum(len(c.payload) for k in names for c in encoded[k]),
        "encode_gbps": raw_bytes / t_enc / 1e9,
        "decode_gbps": raw_bytes / t_dec / 1e9,
        "apply_gbps": raw_bytes / t_apply / 1e9,
        "apply_gbps_cpu": raw_bytes / c_apply / 1e9,
        "keyframe_chunks": sum(codec.parse_header(c.payload).mode == codec.MODE_KEYFRAME for k in names for c in encoded[k]),
        "context_chunks": sum(_uses_context(c.payload) for k in names for c in encoded[k]),
    }
    if fmt == 3:
        fig["index_build_s"] = t_build
        fig["index_entries"] = sum(i.positions.shape[0] for k in names for i in held_idx[k] if i is not None)
    return fig, (got, next_idx), exact


def _uses_context(payload: bytes) -> bool:
    """Whether a payload is a version-2 or -3 delta coded against a context."""
    hdr = codec.parse_header(payload)
    return hdr.version >= 2 and hdr.mode == codec.MODE_DELTA and payload[hdr.body_offset] & 1 == 1


def run_codec_bench(
    versions: list[dict[str, np.ndarray]],
    dtype: str,
    *,
    chunk_elems: int = 2 << 20,
    formats: tuple[int, ...] = (1, 2, 3),
) -> dict:
    """Encode each consecutive pair of ``versions`` (dicts name -> 1-D raw-bit
    array) in each format version, decode it again single-threaded, and report
    per-step figures.

    Formats 2 and 3 run as a receiver would: the first step without context, each
    later one against the change lists the previous step's decode returned;
    format 3 also over the position indexes the previous decode returned
    (built once before the first step, timed as ``index_build_s``).

    Returns ``{"steps": [...], "summary": {...}}``. Each step has
    ``changed_fraction``, ``full_bf16_bytes`` (raw size of the new version),
    ``zstd_full_bytes`` and ``xor_zstd_bytes`` (zstd level 3 of the raw new
    version / of old XOR new) and per format (``"v1"``, ``"v2"``, ``"v3"``): ``bytes``,
    ``encode_gbps``, ``decode_gbps`` (into fresh buffers, which includes
    copying the base), ``apply_gbps`` (in place, as a receiver applies it, best of
    ``APPLY_REPEATS``; ``apply_gbps_cpu`` over the thread's CPU time, which
    a busy machine disturbs less), all
    raw model bytes per second on one thread, ``keyframe_chunks`` and
    ``context_chunks`` (format 3 also ``index_build_s`` and ``index_entries``).
    ``ours_bytes`` is the newest format's size. The summary
    holds per format the medians ``pct_of_full`` and speeds, plus
    ``ours_pct_of_full``, ``ours_vs_xor_zstd``, ``bit_exact`` (every step of
    every format decoded and compared), ``jit_warmup_s`` and ``load_average``
    (1, 5, 15 minutes, at the end: speeds on a shared machine need it).
    """
    if len(versions) < 2:
        raise ValueError("need at least two versions to measure a step")
    warmup = _warm_up(dtype)
    cctx = zstandard.ZstdCompressor(level=3)
    steps = []
    exact = True
    contexts: dict[int, tuple | None] = {fmt: None for fmt in formats}
    for old_v, new_v in zip(versions, versions[1:]):
        if set(old_v) != set(new_v):
            raise ValueError("consecutive versions must have the same tensor names")
        names = sorted(new_v)
        step = {
            "changed_fraction": sum(int(np.count_nonzero(new_v[k] != old_v[k])) for k in names) / max(sum(new_v[k].size for k in names), 1),
            "full_bf16_bytes": sum(new_v[k].nbytes for k in names),
            "zstd_full_bytes": sum(len(cctx.compress(new_v[k].tobytes())) for k in names),
            "xor_zstd_bytes": sum(len(cctx.compress((new_v[k] ^ old_v[k]).tobytes())) for k in names),
        }
        for fmt in formats:
            fig, contexts[fmt], ok = _format_figures(old_v, new_v, dtype, fmt, contexts[fmt], chunk_elems)
            step[f"v{fmt}"] = fig
            exact = exact and ok
        step["ours_bytes"] = step[f"v{max(formats)}"]["bytes"]
        steps.append(step)
    med = statistics.median
    summary: dict = {
        "ours_pct_of_full": med(100 * s["ours_bytes"] / s["full_bf16_bytes"] for s in steps),
        "ours_vs_xor_zstd": med(s["ours_bytes"] / s["xor_zstd_bytes"] for s in steps),
        "xor_zstd_pct_of_full": med(100 * s["xor_zstd_bytes"] / s["full_bf16_bytes"] for s in steps),
        "changed_fraction": med(s["changed_fraction"] for s in steps),
    }
    for fmt in formats:
        f = f"v{fmt}"
        summary[f] = {
            "pct_of_full": med(100 * s[f]["bytes"] / s["full_bf16_bytes"] for s in steps),
            "pct_of_full_per_step": [100 * s[f]["bytes"] / s["full_bf16_bytes"] for s in steps],
            "encode_gbps": med(s[f]["encode_gbps"] for s in steps),
            "decode_gbps": med(s[f]["decode_gbps"] for s in steps),
            "apply_gbps": med(s[f]["apply_gbps"] for s in steps),
            "apply_gbps_cpu": med(s[f]["apply_gbps_cpu"] for s in steps),
        }
    summary.update({"bit_exact": exact, "jit_warmup_s": warmup, "load_average": list(os.getloadavg())})
    return {"steps": steps, "summary": summary}


def main(argv: list[str] | None = None) -> int:
    """``meridian bench codec [--steps K] [--synthetic N]``: formats 1, 2 and 3 on
    the recorded real RL versions of the built-in model (as ``meridian bench
    weightsync`` records and caches them) or on synthetic AdamW versions; prints
    one JSON object."""
    import argparse
    import json
    import sys

    parser = argparse.ArgumentParser(prog="meridian bench codec")
    parser.add_argument("--json", action="store_true", help="accepted for symmetry with the other benches: the output is always one JSON object")
    parser.add_argument("--steps", type=int, default=5, help="recorded RL steps (>= 1)")
    parser.add_argument("--synthetic", type=int, default=0, help="use N-parameter synthetic versions instead")
    ns = parser.parse_args(argv)
    if ns.synthetic:
        versions = synthetic_adam_versions(ns.synthetic, ns.steps)
        source = f"synthetic AdamW, {ns.synthetic} parameters"
    else:
        from benchmarks.weightsync import recorded_versions

        recorded, _ = recorded_versions(ns.steps, True, lambda msg: print(msg, file=sys.stderr, flush=True))
        dtypes = {t.dtype for v in recorded for t in v.values()}
        if dtypes != {"bf16"}:
            raise SystemExit(f"expected bf16 versions, got {sorted(dtypes)}")
        versions = [{k: t.bits for k, t in v.items()} for v in recorded]
        source = "recorded RL steps of the built-in model (lr 1e-6)"
    report = run_codec_bench(versions, "bf16")
    report["source"] = source
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
