"""``meridian bench weightsync [--steps K] [--json] [--no-cache]``.

1. Records K+1 consecutive policy versions from real RL optimizer steps on the built-in
   SmolLM2-135M: the trainer's own :class:`Learner` (fp32 master weights, AdamW at
   lr 1e-6, the GRPO clipped policy-gradient loss) on fixed recorded trajectories
   (completions sampled once from the model for built-in task prompts, behaviour
   log-probs from a forward pass, rewards from a fixed deterministic rule with
   variance inside every group). A few warm-up steps first, so the Adam moments are
   warmed up as in a running job. Versions are the bf16 view the trainer publishes;
   they are cached under ``<cache>/bench/weightsync/`` so re-runs skip this part.
2. Codec, per step: our encoded size against the full bf16 size, zstd-3 of the full
   version and XOR of bf16 bits + zstd-3 (the common industry codec, the baseline),
   and encode/decode speed on one core; decode also on a thread pool.
3. Propagation: origin -> emulated WAN link (100 Mbit/s, 50 ms one way) -> relay ->
   subscriber, all real gRPC servers, the relay in a process of its own (the others in
   this one); per version, the time from the origin holding it to the subscriber holding
   it verified, against the link bound (encoded bytes / bandwidth + latency); also on a
   1 Gbit/s, 100 ms link, and with the relay in this process too.
4. Compacted deltas: a late joiner k versions behind (k = 1, 4, 16, 32) gets one delta
   from the version it holds to the latest; its size against the full bf16 size, the
   chain of k deltas and a keyframe. Needs max(k) + 1 versions: a second recording
   (``--compacted-steps``) keeps only the versions these figures use.

``--parts`` picks the slow parts to run (codec, propagation, compacted). Prints one JSON object (``--json``) or a short human summary.
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np

from meridian.tensors import RawTensor

LINK_BANDWIDTH = 100e6 / 8  # 100 Mbit/s, bytes/s
LINK_LATENCY_S = 0.050
#: The second link propagation is measured on: a fast, far one (1 Gbit/s, 100 ms one way),
#: where the round trip, not the bandwidth, bounds a delta.
FAST_FAR_LINK = (1e9 / 8, 0.100)
#: Versions behind the latest that a late joiner's compacted delta is measured for.
COMPACTED_KS = (1, 4, 16, 32)
WARMUP_STEPS = 3
GROUP_SIZE = 4
COMPLETION_TOKENS = 32
CHUNK_ELEMS = 2 << 20  # 4 MiB of bf16 per chunk, the service default (chunk_mb = 4)
RECORDING_FORMAT = 1
APPLY_REPEATS = 3


# ---------------------------------------------------------------- recording real RL steps


def _trajectories(model_dir: Path, prompts: list[str], seed: int) -> list[list[Any]]:
    """One GRPO group per prompt: sampled completions with behaviour log-probs and rewards."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from meridian.v1 import common_pb2
    from services.trainer.batch import token_logprobs

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    groups = []
    for g, prompt in enumerate(prompts):
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        prompt_ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        inp = torch.tensor([prompt_ids] * GROUP_SIZE)
        with torch.no_grad():
            out = model.generate(inp, attention_mask=torch.ones_like(inp), do_sample=True, temperature=1.0,
                                 max_new_tokens=COMPLETION_TOKENS, min_new_tokens=COMPLETION_TOKENS,
                                 pad_token_id=tok.eos_token_id)
            logp = token_logprobs(model(input_ids=out).logits, out)
        group = []
        for i in range(GROUP_SIZE):
            completion = out[i, len(prompt_ids):].tolist()
            behaviour = logp[i, len(prompt_ids) - 1 :].tolist()
            # A fixed, arbitrary rule with spread inside the group: how much of the
            # completion is code-ish punctuation.
            text = tok.decode(completion)
            reward = sum(ch in "():=[]" for ch in text) / max(len(text), 1) * 10 + 0.1 * i
            group.append(common_pb2.Trajectory(
                trajectory_id=f"bench-{g}-{i}", task_id=f"bench-{g}", group_id=f"bench-{g}", group_size=GROUP_SIZE,
                prompt_token_ids=prompt_ids, completion_token_ids=completion, logprobs=behaviour,
                loss_mask=[1] * len(completion), policy_versions=[0] * len(completion), reward=reward,
            ))
        groups.append(group)
    return groups


def _record(steps: int, folder: Path, log: Any, keep: set[int] | None = None) -> None:
    """Runs WARMUP_STEPS + ``steps`` real optimizer steps and saves steps + 1 bf16 versions
    (only those in ``keep`` when given: a long recording would take gigabytes). The size of
    each consecutive delta goes to ``deltas.json``, so chains need not be kept."""
    from services.weightsync.versions import encode_version

    from meridian.model_store import prepare_builtin
    from services.envsandbox.tasks import TaskSuite
    from services.trainer.config import TrainerConfig
    from services.trainer.learner import Learner

    model_dir = prepare_builtin()
    prompts = [t.instruction for t in TaskSuite.builtin().select()[:2]]
    t0 = time.perf_counter()
    groups = _trajectories(model_dir, prompts, seed=0)
    log(f"sampled {len(groups)} groups of {GROUP_SIZE} in {time.perf_counter() - t0:.1f}s")
    learner = Learner(model_dir, TrainerConfig(lr=1e-6, threads=max(1, os.cpu_count() or 1), max_policy_lag=10**6))
    folder.mkdir(parents=True, exist_ok=True)
    previous: dict[str, RawTensor] | None = None
    delta_bytes: list[int] = []
    for step in range(WARMUP_STEPS + steps + 1):
        if step >= WARMUP_STEPS:
            v = step - WARMUP_STEPS
            weights = learner.policy_weights()
            if keep is None or v in keep:
                _save(folder / f"v{v}.npz", weights)
            if previous is not None:
                delta_bytes.append(encode_version(v, weights, previous, v - 1, CHUNK_ELEMS * 2).size)
            previous = weights
            if v == steps:
                break
        result = learner.step(groups)
        log(f"step {step}: loss {result.loss:+.4f} grad_norm {result.grad_norm:.3f} ({result.seconds:.1f}s)")
    (folder / "deltas.json").write_text(json.dumps(delta_bytes))
    (folder / "COMPLETE").write_text("ok\n")


def _save(path: Path, weights: dict[str, RawTensor]) -> None:
    arrays = {f"{name}|{t.dtype}|{','.join(map(str, t.shape))}": t.bits for name, t in weights.items()}
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, path)


def _load(path: Path) -> dict[str, RawTensor]:
    out = {}
    with np.load(path) as data:
        for key in data.files:
            name, dtype, shape = key.split("|")
            out[name] = RawTensor(dtype, tuple(int(d) for d in shape.split(",") if d), data[key])
    return out


def _recording(name: str, steps: int, use_cache: bool, log: Any, keep: set[int] | None = None) -> tuple[Path, bool]:
    from meridian.model_store import cache_dir

    folder = cache_dir() / "bench" / "weightsync" / name
    cached = use_cache and (folder / "COMPLETE").exists()
    if not cached:
        if folder.exists():
            for f in folder.iterdir():
                f.unlink()
        _record(steps, folder, log, keep)
    return folder, cached


def recorded_versions(steps: int, use_cache: bool, log: Any) -> tuple[list[dict[str, RawTensor]], bool]:
    """``steps + 1`` consecutive versions; True when they came from the cache."""
    folder, cached = _recording(f"smollm2-135m-lr1e-6-f{RECORDING_FORMAT}-k{steps}", steps, use_cache, log)
    return [_load(folder / f"v{i}.npz") for i in range(steps + 1)], cached


def compacted_figures(steps: int, use_cache: bool, log: Any) -> dict[str, Any]:
    """For a late joiner k versions behind the latest (v``steps``): the compacted delta
    (the latest encoded against the version it holds, what ``plan_compacted`` builds),
    the chain of k deltas, and a keyframe of the latest, each in % of the full bf16 size."""
    from services.weightsync.versions import encode_version

    ks = [k for k in COMPACTED_KS if k <= steps]
    keep = {steps, *(steps - k for k in ks)}
    folder, cached = _recording(f"smollm2-135m-lr1e-6-f{RECORDING_FORMAT}-compacted-k{steps}", steps, use_cache, log, keep)
    deltas = json.loads((folder / "deltas.json").read_text())
    latest = _load(folder / f"v{steps}.npz")
    full = sum(t.nbytes for t in latest.values())
    t0 = time.perf_counter()
    keyframe = encode_version(steps, latest, None, -1, CHUNK_ELEMS * 2).size
    keyframe_s = time.perf_counter() - t0
    per_k = {}
    for k in ks:
        held = _load(folder / f"v{steps - k}.npz")
        t0 = time.perf_counter()
        compacted = encode_version(steps, latest, held, steps - k, CHUNK_ELEMS * 2).size
        seconds = time.perf_counter() - t0
        chain = sum(deltas[steps - k :])
        per_k[str(k)] = {
            "compacted_bytes": compacted, "compacted_pct_of_full": 100 * compacted / full,
            "chain_bytes": chain, "chain_pct_of_full": 100 * chain / full,
            "sent": "compacted" if compacted <= min(chain, keyframe) else ("chain" if chain <= keyframe else "keyframe"),
            "compacted_encode_s": seconds,
        }
        del held
    return {
        "latest_version": steps, "cached": cached, "full_bf16_bytes": full,
        "keyframe_bytes": keyframe, "keyframe_pct_of_full": 100 * keyframe / full, "keyframe_encode_s": keyframe_s,
        "per_k": per_k, "compacted_pct_of_full": {k: v["compacted_pct_of_full"] for k, v in per_k.items()},
        "ks_missing": [k for k in COMPACTED_KS if k > steps],
    }


# ---------------------------------------------------------------- codec figures


def _decode_all(jobs: list[tuple[str, bytes, Any]], old: dict[str, RawTensor], threads: int) -> tuple[dict[str, np.ndarray], float]:
    """Decodes every (tensor, payload, index of its base chunk) into fresh buffers."""
    from services.weightsync import codec

    outs = {k: np.empty_like(old[k].bits) for k, _, _ in jobs}
    for arr in outs.values():
        arr.fill(0)  # fault the pages in: allocation is not decode work

    def one(job: tuple[str, bytes, Any]) -> None:
        codec.decode_chunk_into(job[1], outs[job[0]], old[job[0]].bits, index=job[2])

    t0 = time.perf_counter()
    if threads == 1:
        for job in jobs:
            one(job)
    else:
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, jobs))
    return outs, time.perf_counter() - t0


def _chunk_jobs(enc: Any, old: dict[str, RawTensor], indexes: dict[str, list[Any]]) -> list[tuple[str, bytes, Any]]:
    """Each chunk of ``enc`` with the position index of its base chunk a receiver holds
    (``indexes``: the encoder's, which every receiver's equals; built where missing)."""
    from services.weightsync import codec

    jobs, seen = [], {}
    for ref, payload in zip(enc.manifest.chunks, enc.chunks):
        j = seen[ref.tensor] = seen.get(ref.tensor, -1) + 1
        held = indexes.get(ref.tensor, [])
        jobs.append((ref.tensor, payload, codec.ensure_index(payload, old[ref.tensor].bits, held[j] if j < len(held) else None)))
    return jobs


def _indexes_of(weights: dict[str, RawTensor]) -> dict[str, list[Any]]:
    """The position indexes the service's encoder builds for ``weights`` when it has none."""
    from services.weightsync import codec

    elems = CHUNK_ELEMS
    return {
        k: [codec.build_index(t.bits, t.dtype, s, min(elems, t.bits.size - s)) for s in range(0, max(t.bits.size, 1), elems)]
        for k, t in weights.items() if t.bits.size
    }


def _apply_in_place(
    enc: Any, held: dict[str, RawTensor], version: int, want: dict[str, RawTensor], repeats: int, threads: int = 1
) -> tuple[float, float, bool]:
    """Median wall and thread-CPU seconds of applying ``enc`` in place, as an in-place
    subscriber does (decode + undo log + incremental hash check + position index upkeep):
    on one thread, or with ``threads`` > 1 on that many, every ``threads``-th chunk to each
    (the subscriber's pool decodes chunks concurrently in the same way; the CPU figure is
    then the calling thread's only: meaningless). The undo log puts the base back between
    repeats. True when every apply gave ``want`` bit for bit and every revert gave the
    base back."""
    from services.weightsync.receiver import Decoder

    base = {k: t.bits.copy() for k, t in held.items()}
    decoder = Decoder(held, version - 1, in_place=True)
    decoder.prepare()  # the one-time full hash of what a subscriber starts from
    jobs = [list(range(len(enc.chunks)))[lo::threads] for lo in range(threads)] if threads > 1 else []
    pool = concurrent.futures.ThreadPoolExecutor(threads) if threads > 1 else None

    def run(indices: list[int]) -> None:
        for i in indices:
            decoder.add_chunk(i, enc.chunks[i], verified=True)

    def apply() -> None:
        decoder.begin(enc.manifest)
        if pool is None:
            run(list(range(len(enc.chunks))))
        else:
            list(pool.map(run, jobs))
        decoder.finish()

    try:
        # Untimed: the one-time position-index build a subscriber pays at its first delta.
        apply()
        exact = _same_bits(decoder.weights, want)
        decoder.revert_last()
        walls, cpus = [], []
        for _ in range(repeats):
            w0, c0 = time.perf_counter(), time.thread_time()
            apply()
            walls.append(time.perf_counter() - w0)
            cpus.append(time.thread_time() - c0)
            exact = exact and _same_bits(decoder.weights, want)
            decoder.revert_last()
            exact = exact and all(np.array_equal(decoder.weights[k].bits, base[k]) for k in base)
    finally:
        if pool is not None:
            pool.shutdown()  # also when an apply raised: no decode threads left behind
    return statistics.median(walls), statistics.median(cpus), exact


def per_chunk_version(enc: Any, new: dict[str, RawTensor], old: dict[str, RawTensor], chunk_bytes: int) -> Any:
    """The version ``enc`` (``new`` as a delta on ``old``) again in chunks of ``chunk_bytes``,
    every delta chunk in codec format 3: what an apply of it costs beyond an apply of
    ``enc`` is per-chunk work. (The service also sends a chunk in format 1 where that is
    smaller, which small chunks often are by a few bytes; format 1 decodes in a pass over
    its chunk, per-byte work that would be counted as per-chunk here: 26-39 instead of
    22 us per chunk.)"""
    from services.weightsync import codec
    from services.weightsync.versions import assemble_version

    payloads = {
        name: [c.payload for c in codec.encode_tensor(name, t.bits, old[name].bits, t.dtype, chunk_elems=max(1, chunk_bytes // t.bits.itemsize), format_version=3)]
        for name, t in new.items()
    }
    m = enc.manifest
    return assemble_version(m.version, new, payloads, m.base_version, m.weights_hash)


def codec_figures(versions: list[dict[str, RawTensor]], threads: int) -> tuple[list[dict[str, Any]], bool]:
    """Per-step sizes and speeds of what the service sends (``versions.encode_tensors``:
    codec format 3 over the position indexes the previous step left, as the origin keeps
    them); True when every step decoded bit-exactly."""
    import zstandard

    from meridian.tensors import weights_hash
    from services.weightsync import codec
    from services.weightsync.versions import Carried, assemble_version, encode_tensors

    cctx = zstandard.ZstdCompressor(level=3)
    steps, exact = [], True
    warm = {k: versions[0][k] for k in list(versions[0])[:2]}
    # JIT compile / cache load outside the timed region.
    warm_enc = encode_tensors({k: versions[1][k] for k in warm}, warm, CHUNK_ELEMS * 2)
    _decode_all([(k, p, codec.ensure_index(p, warm[k].bits, None)) for k in warm_enc.payloads for p in warm_enc.payloads[k][:1]], warm, 1)
    indexes = _indexes_of(versions[0])
    for old, new in zip(versions, versions[1:]):
        names = sorted(new)
        raw = sum(new[k].nbytes for k in names)
        version = len(steps) + 1
        t0 = time.perf_counter()
        tensors = encode_tensors(new, old, CHUNK_ELEMS * 2, Carried(indexes))
        t_enc = time.perf_counter() - t0
        t0 = time.perf_counter()
        threaded = encode_tensors(new, old, CHUNK_ELEMS * 2, Carried(indexes), threads)
        t_enc_mt = time.perf_counter() - t0
        exact = exact and threaded.payloads == tensors.payloads
        enc = assemble_version(version, new, tensors.payloads, version - 1, weights_hash(new))
        jobs = _chunk_jobs(enc, old, indexes)
        indexes = tensors.carried.indexes
        outs, t_dec = _decode_all(jobs, old, 1)
        outs_mt, t_dec_mt = _decode_all(jobs, old, threads)
        exact = exact and all(np.array_equal(outs[k], new[k].bits) and np.array_equal(outs_mt[k], new[k].bits) for k in names)
        held = {k: RawTensor(t.dtype, t.shape, t.bits.copy()) for k, t in old.items()}
        t_apply, c_apply, applied = _apply_in_place(enc, held, version, new, APPLY_REPEATS)
        t_apply_mt, _, applied_mt = _apply_in_place(enc, held, version, new, APPLY_REPEATS, threads)
        # The same delta in 64x smaller chunks: what an apply costs per chunk beyond its
        # bytes (the Python part of decoding a chunk, which holds the GIL).
        small = per_chunk_version(enc, new, old, CHUNK_ELEMS * 2 // 64)
        t_small, _, applied_small = _apply_in_place(small, held, version, new, APPLY_REPEATS)
        exact = exact and applied and applied_mt and applied_small
        steps.append({
            "changed_fraction": sum(int(np.count_nonzero(new[k].bits != old[k].bits)) for k in names) / sum(new[k].bits.size for k in names),
            "ours_bytes": enc.size,
            "full_bf16_bytes": raw,
            "zstd_full_bytes": sum(len(cctx.compress(new[k].bits.tobytes())) for k in names),
            "xor_zstd_bytes": sum(len(cctx.compress((new[k].bits ^ old[k].bits).tobytes())) for k in names),
            "encode_gbps": raw / t_enc / 1e9,
            "encode_gbps_threads": raw / t_enc_mt / 1e9,
            "decode_gbps": raw / t_apply / 1e9,
            "decode_gbps_cpu": raw / c_apply / 1e9,
            "apply_gbps_threads": raw / t_apply_mt / 1e9,
            "decode_chunk_us": 1e6 * max(0.0, t_small - t_apply) / max(1, len(small.chunks) - len(enc.chunks)),
            "decode_copy_gbps": raw / t_dec / 1e9,
            "decode_copy_gbps_threads": raw / t_dec_mt / 1e9,
        })
    return steps, exact


# ---------------------------------------------------------------- propagation


@contextlib.asynccontextmanager
async def serve_on_loopback(service: Any) -> AsyncIterator[str]:
    """A service on a free loopback port in this loop, with the production error boundary."""
    import grpc

    from meridian.grpc_runtime import ErrorBoundary, channel_options

    server = grpc.aio.server(interceptors=[ErrorBoundary()], options=channel_options())
    service.register(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        await service.start()
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(grace=None)
        await service.stop()


@contextlib.asynccontextmanager
async def relay_in_own_process(upstream: str, workdir: Path) -> AsyncIterator[str]:
    """A weightsync relay of ``upstream`` in a process of its own (``meridian serve
    weightsync --role relay``), as a region's relay runs: its own interpreter and GIL,
    this machine's cores. Yields its address once it is SERVING; stopped on the way out."""
    from meridian import stack

    workdir.mkdir(parents=True, exist_ok=True)
    args = ["--insecure", "true", "--role", "relay", "--upstream", upstream, "--data-dir", str(workdir / "relay")]
    proc, address, log = await asyncio.to_thread(stack.spawn_service, "weightsync", args, workdir, dict(os.environ))
    try:
        await asyncio.to_thread(stack.wait_serving, {"weightsync": address}, {"weightsync": proc}, {"weightsync": str(log)}, 120)
        yield address
    finally:
        await asyncio.to_thread(stack.Stack(workdir, {"weightsync": proc.pid}, {}, {}, "").stop, 30)


async def _propagation(
    versions: list[dict[str, RawTensor]], workdir: Path, bandwidth: float = LINK_BANDWIDTH, latency_s: float = LINK_LATENCY_S, one_process: bool = False
) -> list[dict[str, Any]]:
    """Each delta origin -> emulated link -> relay -> in-place subscriber. The origin, the
    link and the subscriber run in this process; the relay in its own (as deployed: a
    region's relay is not the subscriber's process) or, with ``one_process``, here too,
    where its decoding shares this process's GIL and event loop with the subscriber's."""
    from services.weightsync import client
    from services.weightsync.client import WeightSubscriber
    from services.weightsync.config import WeightSyncConfig
    from meridian.link_emulator import LinkEmulator
    from services.weightsync.server import WeightSyncService

    origin_svc = WeightSyncService(WeightSyncConfig(data_dir=str(workdir / "origin")))
    out = []
    async with contextlib.AsyncExitStack() as stack:
        origin = await stack.enter_async_context(serve_on_loopback(origin_svc))
        await client.publish(origin, 0, versions[0])
        # Bootstrap v0 over an unlimited link; measure the deltas over the WAN link.
        link = await stack.enter_async_context(LinkEmulator(origin))
        if one_process:
            relay_svc = WeightSyncService(WeightSyncConfig(role="relay", upstream=link.address, data_dir=str(workdir / "relay")))
            relay = await stack.enter_async_context(serve_on_loopback(relay_svc))

            async def relay_holds() -> int:
                return relay_svc.store.latest
        else:
            relay = await stack.enter_async_context(relay_in_own_process(link.address, workdir))

            async def relay_holds() -> int:
                return await client.latest_version(relay)

        # When the subscriber holds every chunk of a version verified: what is
        # left after it (decode tail, weights hash) is not transport.
        last_chunk: dict[int, float] = {}

        def on_chunk(manifest: Any, index: int, payload: bytes) -> None:
            if index == len(manifest.chunks) - 1:
                last_chunk[manifest.version] = time.monotonic()

        sub = WeightSubscriber(relay, None, -1, in_place=True, on_chunk=on_chunk)
        stream = sub.updates(follow=True)
        try:
            first = await anext(stream)
            assert first.version == 0
            while await relay_holds() < 0:
                await asyncio.sleep(0.05)
            link.set_link(bandwidth=bandwidth, latency_s=latency_s)
            await asyncio.sleep(0.5)
            for v in range(1, len(versions)):
                await client.publish(origin, v, versions[v])
                update = await anext(stream)
                got_at = time.monotonic()
                if update.version != v:
                    raise RuntimeError(f"subscriber got version {update.version}, expected {v}")
                exact = _same_bits(update.weights, versions[v])
                propagation = got_at - origin_svc.available_at[v]
                chunks_s = last_chunk[v] - origin_svc.available_at[v]
                bound = update.manifest.encoded_bytes / bandwidth + latency_s
                out.append({
                    "version": v, "encoded_bytes": int(update.manifest.encoded_bytes), "propagation_s": propagation,
                    "link_bound_s": bound, "propagation_vs_bound": propagation / bound, "bit_exact": exact,
                    "chunks_s": chunks_s, "chunks_vs_bound": chunks_s / bound,
                })
                # Let the relay finish storing before the next version.
                while await relay_holds() < v:
                    await asyncio.sleep(0.01)
        finally:
            await stream.aclose()
            await sub.close()
    return out


def _same_bits(a: dict[str, RawTensor], b: dict[str, RawTensor]) -> bool:
    return set(a) == set(b) and all(np.array_equal(a[k].bits, b[k].bits) for k in a)


# ---------------------------------------------------------------- main


def _propagation_summary(per_version: list[dict[str, Any]], bandwidth: float, latency_s: float) -> dict[str, Any]:
    med = statistics.median
    return {
        "link": {"bandwidth_mbit_s": bandwidth * 8 / 1e6, "latency_ms": latency_s * 1e3},
        "per_version": per_version,
        "propagation_vs_bound": med(p["propagation_vs_bound"] for p in per_version),
        "chunks_vs_bound": med(p["chunks_vs_bound"] for p in per_version),
        "load_average_1m": os.getloadavg()[0],
    }


PARTS = ("codec", "propagation", "compacted")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="meridian bench weightsync")
    parser.add_argument("--steps", type=int, default=5, help="consecutive RL optimizer steps to record (>= 1)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--no-cache", action="store_true", help="record the versions again")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="encode and decode threads for the multi-thread figures")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated parts to run, of {','.join(PARTS)}")
    parser.add_argument("--compacted-steps", type=int, default=max(COMPACTED_KS),
                        help="steps of the second recording the compacted figures use (the latest is this many versions after the first)")
    ns = parser.parse_args(argv)
    if ns.steps < 1 or ns.compacted_steps < 1:
        parser.error("--steps and --compacted-steps must be >= 1")
    parts = {p.strip() for p in ns.parts.split(",") if p.strip()}
    if not parts or parts - set(PARTS):
        parser.error(f"--parts takes a comma-separated subset of {','.join(PARTS)}")

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    versions, cached = recorded_versions(ns.steps, not ns.no_cache, log)
    record_s = time.perf_counter() - t0
    med = statistics.median
    result: dict[str, Any] = {
        "model": "SmolLM2-135M-Instruct (built-in)",
        "versions": {"steps": ns.steps, "lr": 1e-6, "warmup_steps": WARMUP_STEPS, "cached": cached, "record_s": record_s,
                     "params": sum(t.bits.size for t in versions[0].values())},
        "parts": sorted(parts),
        "definitions": {
            "decode_gbps": "raw bf16 bytes of the model / wall seconds to apply one delta in place on one thread "
                           f"(decode + undo log + incremental weights-hash check + position-index upkeep), median of {APPLY_REPEATS}",
            "decode_gbps_cpu": "the same, over the decoding thread's CPU seconds (robust to a shared machine)",
            "decode_copy_gbps": "raw bytes / wall seconds to decode one delta into fresh buffers on one thread (no hash)",
            "decode_copy_gbps_threads": "decode_copy_gbps on decode_threads threads",
            "decode_chunk_us": "what an in-place apply costs per chunk beyond its bytes (the same delta in 64x smaller chunks, all "
                               "in format 3, the difference over the extra chunks): the Python part of decoding a chunk, which "
                               "holds the GIL, and the kernel's fixed cost per call",
            "encode_gbps_threads": "raw bytes / wall seconds to encode one delta with its tensors on decode_threads threads (the origin's --encode-threads)",
            "apply_gbps_threads": "apply_gbps (in place, as a subscriber) with the chunks on decode_threads threads, median",
            "propagation_vs_bound": "seconds from the origin holding a version to the subscriber holding it verified and applied, "
                                    "over encoded bytes / bandwidth + one-way latency; median over versions. The relay runs in a "
                                    "process of its own, the origin, link and subscriber in this one; propagation_one_process "
                                    "has the relay in this process too (as measured before: its decoding shares the subscriber's GIL)",
            "chunks_vs_bound": "the same up to the subscriber holding every chunk verified (transport, without the decode tail)",
            "compacted_pct_of_full": "per k: one delta from v(latest - k) to the latest, % of the full bf16 size",
            "apply_gbps": "decode_gbps (codec format 3 over carried position indexes, what the service sends); "
                          "`meridian bench codec` measures each format's bare codec",
            "simulation": "frontier_figures of `meridian simulate weightsync` with this run's codec figures: "
                          "t_1t_4regions_10gbit_s for the code as it is, ..._pipelined for the pipelined design",
        },
        "targets": {"ours_pct_of_full": 0.13, "ours_vs_xor_zstd": 0.35, "apply_gbps": 20.0, "propagation_vs_bound": 1.25, "t_1t_4regions_10gbit_s": 15.0},
    }
    exact = True
    if "codec" in parts:
        steps, exact = codec_figures(versions, ns.threads)
        result["steps"] = steps
        result["summary"] = {
            "ours_pct_of_full": med(100 * s["ours_bytes"] / s["full_bf16_bytes"] for s in steps),
            "ours_vs_xor_zstd": med(s["ours_bytes"] / s["xor_zstd_bytes"] for s in steps),
            "xor_zstd_pct_of_full": med(100 * s["xor_zstd_bytes"] / s["full_bf16_bytes"] for s in steps),
            "changed_fraction": med(s["changed_fraction"] for s in steps),
            "encode_gbps": med(s["encode_gbps"] for s in steps),
            "encode_gbps_threads": med(s["encode_gbps_threads"] for s in steps),
            "decode_gbps": med(s["decode_gbps"] for s in steps),
            "decode_gbps_cpu": med(s["decode_gbps_cpu"] for s in steps),
            "decode_copy_gbps": med(s["decode_copy_gbps"] for s in steps),
            "decode_copy_gbps_threads": med(s["decode_copy_gbps_threads"] for s in steps),
            "apply_gbps_threads": med(s["apply_gbps_threads"] for s in steps),
            "decode_chunk_us": med(s["decode_chunk_us"] for s in steps),
            "decode_threads": ns.threads,
        }
        # The name for the in-place figure: what applying a version costs a subscriber.
        result["summary"]["apply_gbps"] = result["summary"]["decode_gbps"]
        # The frontier case (1T parameters, four regions, 10 Gbit/s) simulated with this
        # run's codec figures (services/weightsync/simulation.py; validated at small scale
        # by benchmarks/weightsync_simulation.py).
        from services.weightsync.simulation import frontier_figures

        result["simulation"] = frontier_figures(result, search_cores=False)
    else:
        result["summary"] = {}
    if "propagation" in parts:
        fast_bw, fast_lat = FAST_FAR_LINK
        with tempfile.TemporaryDirectory(prefix="meridian-ws-bench-") as tmp:
            default = asyncio.run(_propagation(versions, Path(tmp) / "default"))
            result["propagation"] = _propagation_summary(default, LINK_BANDWIDTH, LINK_LATENCY_S)
            fast = asyncio.run(_propagation(versions, Path(tmp) / "fast", fast_bw, fast_lat))
            result["propagation_1gbit_100ms"] = _propagation_summary(fast, fast_bw, fast_lat)
            shared = asyncio.run(_propagation(versions, Path(tmp) / "one-process", one_process=True))
            result["propagation_one_process"] = _propagation_summary(shared, LINK_BANDWIDTH, LINK_LATENCY_S)
        exact = exact and all(p["bit_exact"] for p in default + fast + shared)
    if "compacted" in parts:
        result["compacted"] = compacted_figures(ns.compacted_steps, not ns.no_cache, log)
        result["summary"]["compacted_pct_of_full"] = result["compacted"]["compacted_pct_of_full"]
    result["summary"]["load_average_1m"] = os.getloadavg()[0]
    result["summary"]["bit_exact"] = exact
    if ns.json:
        print(json.dumps(result))
        return 0
    s = result["summary"]
    if "codec" in parts:
        print(f"ours {s['ours_pct_of_full']:.3f}% of full bf16 ({s['ours_vs_xor_zstd']:.2f}x XOR+zstd), "
              f"encode {s['encode_gbps']:.2f} GB/s, decode {s['decode_gbps']:.2f} GB/s "
              f"({s['decode_copy_gbps_threads']:.2f} on {ns.threads} threads, fresh buffers), bit exact {s['bit_exact']}")
        sim = result["simulation"]
        print(f"simulated 1T version in four regions over 10 Gbit/s: {sim['t_1t_4regions_10gbit_s']:.1f} s as built, "
              f"{sim['t_1t_4regions_10gbit_s_pipelined']:.1f} s pipelined")
    if "propagation" in parts:
        for key in ("propagation", "propagation_1gbit_100ms", "propagation_one_process"):
            p = result[key]
            print(f"{key}: {p['propagation_vs_bound']:.2f}x the link bound ({p['chunks_vs_bound']:.2f}x until every chunk is held), "
                  f"{p['link']['bandwidth_mbit_s']:g} Mbit/s, {p['link']['latency_ms']:g} ms")
    if "compacted" in parts:
        print("compacted delta, % of full bf16, by versions behind: "
              + ", ".join(f"k={k} {v:.3f}%" for k, v in result["compacted"]["compacted_pct_of_full"].items()))
    return 0
