"""Encode time of one version published whole vs in parts (sharded publish).

    python -m benchmarks.weightsync_parts [--parts 1,2] [--rounds 3] [--json]

Uses two consecutive versions of the RL recording ``meridian bench weightsync`` makes (and
caches; SmolLM2-135M, bf16, a real optimiser step between them). For each part count it
measures:

- ``encode_s``: the origin's encode of the delta alone, each part's tensors on its own
  worker thread (what the origin does with the parts of a sharded publish) — the codec
  releases the GIL, so this falls with the parts as long as there are free cores;
- ``largest_part_cpu_s``: the CPU time of the largest part's encode, i.e. the encode's
  wall time with a free core per part (``critical_path_speedup``), which a busy machine's
  wall clock cannot show;
- ``publish_s``: the whole Publish of the delta to an in-process origin on loopback
  (one stream, or one stream per part sent at once), receiving, checking, encoding,
  storing;
- with parts, what rank-side encoding (``parts.PartEncoder``) changes: ``origin_decode_s``,
  the origin's decode of the rank-encoded parts (each part on its own thread, as the
  origin takes them; the next delta, over the position indexes the one before left, into
  the spare buffers the version before left; ``origin_decode_copy_s`` into fresh copies of
  the base instead) against ``origin_encode_s``, its encode of the same parts, and ``publish_encoded_s``, the whole Publish
  with every rank encoding its own part (in this process: on a machine with few cores the
  ranks' encoding competes with everything else);

and checks that every part count stores the same bytes. On a machine with few cores
(or other load) the gain is bounded by the free cores: ``cpu_count`` and the load average
are reported beside the figures.
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from meridian.tensors import RawTensor
from services.weightsync import client as weightsync
from services.weightsync import parts
from services.weightsync.config import WeightSyncConfig
from services.weightsync.server import WeightSyncService
from services.weightsync.versions import Spare, decode_tensors, encode_tensors

Weights = dict[str, RawTensor]


def _split(weights: Weights, count: int) -> list[Weights]:
    names = parts.partition({n: t.nbytes for n, t in weights.items()}, count)
    return [{n: weights[n] for n in ns} for ns in names]


def encode_seconds(new: Weights, old: Weights, count: int, chunk_bytes: int) -> tuple[float, list[float]]:
    """Wall time to encode ``new`` against ``old`` as ``count`` parts, one thread each, and
    each part's CPU time (its thread's): on free cores the wall time is the largest part's."""
    split = _split(new, count)

    def one(part: Weights) -> float:
        cpu = time.thread_time()
        encode_tensors(part, old, chunk_bytes)
        return time.thread_time() - cpu

    started = time.perf_counter()
    if count == 1:
        cpu = [one(new)]
    else:
        with concurrent.futures.ThreadPoolExecutor(count) as pool:
            cpu = list(pool.map(one, split))
    return time.perf_counter() - started, cpu


def origin_decode_seconds(versions: list[Weights], count: int, chunk_bytes: int) -> tuple[float, float, float]:
    """Wall times of the origin taking ``count`` rank-encoded parts of the delta
    ``versions[2]`` on ``versions[1]`` (encoded beforehand, as the ranks do), one thread
    each, in the steady state (over the position indexes the delta before left on both
    sides): decoding into the spare buffers (the version before the base, brought to the
    base by replaying its changes), decoding into fresh copies of the base, and, for
    comparison, encoding the same parts itself."""
    first = encode_tensors(versions[1], versions[0], chunk_bytes)
    # What the origin holds after taking version 1 from the ranks: its tensors, their
    # changes on version 0, and version 0's buffers.
    took = decode_tensors(first.payloads, versions[0], chunk_bytes)
    previous = took.encoded.carried
    new, old = versions[2], took.weights
    split = _split(new, count)
    payloads = [encode_tensors(part, old, chunk_bytes, previous).payloads for part in split]
    spare = Spare({n: RawTensor(t.dtype, t.shape, t.bits.copy()) for n, t in versions[0].items()}, dict(took.changes))
    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        started = time.perf_counter()
        list(pool.map(lambda p: decode_tensors(p, old, chunk_bytes, previous, spare=spare), payloads))
        spare_s = time.perf_counter() - started
        started = time.perf_counter()
        list(pool.map(lambda p: decode_tensors(p, old, chunk_bytes, previous), payloads))
        copy_s = time.perf_counter() - started
        started = time.perf_counter()
        list(pool.map(lambda part: encode_tensors(part, old, chunk_bytes, previous), split))
        encode_s = time.perf_counter() - started
    return spare_s, copy_s, encode_s


async def _publish(address: str, version: int, weights: Weights, count: int, encoders: list[parts.PartEncoder] | None = None) -> None:
    if count == 1:
        await weightsync.publish(address, version, weights)
        return
    digests: dict[str, parts.TensorDigest] = {}
    split = _split(weights, count)
    for part in split:
        digests.update(parts.tensor_digests(part))
    header = weightsync.version_header_from_digests(version, digests)
    coders = encoders or [None] * count
    await asyncio.gather(*(weightsync.publish_part(address, header, i, count, split[i], coders[i]) for i in range(count)))


async def publish_seconds(v0: Weights, v1: Weights, count: int, folder: Path, rank_encode: bool = False) -> tuple[float, bytes]:
    """Wall time of publishing delta ``v1`` (after ``v0``) in ``count`` parts (encoded by
    the ranks with ``rank_encode``); and the stored delta's chunk bytes (to check every
    part count stores the same)."""
    from benchmarks.weightsync import serve_on_loopback

    encoders = [parts.PartEncoder(os.cpu_count() or 1) for _ in range(count)] if rank_encode else None
    async with serve_on_loopback(WeightSyncService(WeightSyncConfig(role="origin", data_dir=str(folder)))) as address:
        await _publish(address, 0, v0, count, encoders)
        started = time.perf_counter()
        await _publish(address, 1, v1, count, encoders)
        elapsed = time.perf_counter() - started
    if encoders is not None and not all(e.last_encoded for e in encoders):
        raise RuntimeError("a rank-encoded part was refused and went raw")
    return elapsed, (folder / f"{1:010d}" / "delta" / "chunks.bin").read_bytes()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.weightsync_parts", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="1,2", help="part counts to compare (comma-separated)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, interleaved; medians are reported")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    ns = parser.parse_args(argv)
    counts = [int(c) for c in ns.parts.split(",")]

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    from benchmarks.weightsync import RECORDING_FORMAT, _load, _recording

    folder, _ = _recording(f"smollm2-135m-lr1e-6-f{RECORDING_FORMAT}-k5", 5, True, log)
    v0, v1, v2 = (_load(folder / f"v{k}.npz") for k in range(3))
    chunk_bytes = int(WeightSyncConfig().chunk_mb * (1 << 20))
    encode: dict[int, list[float]] = {c: [] for c in counts}
    part_cpu: dict[int, list[float]] = {c: [] for c in counts}
    publish: dict[int, list[float]] = {c: [] for c in counts}
    decode: dict[int, list[float]] = {c: [] for c in counts if c > 1}
    warm_encode: dict[int, list[float]] = {c: [] for c in counts if c > 1}
    decode_copy: dict[int, list[float]] = {c: [] for c in counts if c > 1}
    publish_encoded: dict[int, list[float]] = {c: [] for c in counts if c > 1}
    stored: dict[tuple[int, bool], bytes] = {}
    for r in range(ns.rounds):
        for c in counts:
            wall, cpu = encode_seconds(v1, v0, c, chunk_bytes)
            encode[c].append(wall)
            part_cpu[c].append(max(cpu))
            with tempfile.TemporaryDirectory(prefix="meridian-bench-parts-") as tmp:
                seconds, stored[c, False] = asyncio.run(publish_seconds(v0, v1, c, Path(tmp)))
            publish[c].append(seconds)
            log(f"round {r}: {c} part(s): encode {encode[c][-1]:.3f} s (largest part {part_cpu[c][-1]:.3f} s CPU), publish {publish[c][-1]:.3f} s")
            if c > 1:
                decoded, copied, encoded = origin_decode_seconds([v0, v1, v2], c, chunk_bytes)
                decode[c].append(decoded)
                decode_copy[c].append(copied)
                warm_encode[c].append(encoded)
                with tempfile.TemporaryDirectory(prefix="meridian-bench-parts-") as tmp:
                    seconds, stored[c, True] = asyncio.run(publish_seconds(v0, v1, c, Path(tmp), rank_encode=True))
                publish_encoded[c].append(seconds)
                log(f"round {r}: {c} rank-encoded parts: origin decode {decode[c][-1]:.3f} s, publish {publish_encoded[c][-1]:.3f} s")
    result: dict[str, Any] = {
        "model_bytes": sum(t.nbytes for t in v1.values()),
        "cpu_count": os.cpu_count(),
        "load_average_1m": os.getloadavg()[0],
        "identical_store": len(set(stored.values())) == 1,
        "per_parts": {
            str(c): {
                "encode_s": statistics.median(encode[c]),
                "largest_part_cpu_s": statistics.median(part_cpu[c]),
                "publish_s": statistics.median(publish[c]),
            }
            for c in counts
        },
    }
    for c in decode:
        row = result["per_parts"][str(c)]
        row["origin_decode_s"] = statistics.median(decode[c])
        row["origin_decode_copy_s"] = statistics.median(decode_copy[c])
        row["origin_encode_s"] = statistics.median(warm_encode[c])
        row["publish_encoded_s"] = statistics.median(publish_encoded[c])
        # The origin's own work per version (the next delta, position indexes carried):
        # decoding the ranks' chunks, where it encoded them before.
        row["origin_work_vs_encoding"] = row["origin_decode_s"] / row["origin_encode_s"]
    base = result["per_parts"][str(counts[0])]
    for c in counts:
        row = result["per_parts"][str(c)]
        row["encode_speedup"] = base["encode_s"] / row["encode_s"]
        # What the encode's wall time becomes with a free core per part.
        row["critical_path_speedup"] = base["largest_part_cpu_s"] / row["largest_part_cpu_s"]
        row["publish_speedup"] = base["publish_s"] / row["publish_s"]
    if ns.json:
        print(json.dumps(result, indent=2))
    else:
        for c in counts:
            row = result["per_parts"][str(c)]
            print(
                f"{c} part(s): encode {row['encode_s']:.3f} s (x{row['encode_speedup']:.2f}), largest part {row['largest_part_cpu_s']:.3f} s CPU "
                f"(x{row['critical_path_speedup']:.2f}), publish {row['publish_s']:.3f} s (x{row['publish_speedup']:.2f})"
            )
            if "origin_decode_s" in row:
                print(
                    f"  rank-encoded: origin decode {row['origin_decode_s']:.3f} s (into copies of the base {row['origin_decode_copy_s']:.3f} s) "
                    f"against encoding {row['origin_encode_s']:.3f} s "
                    f"(x{row['origin_work_vs_encoding']:.2f}), publish {row['publish_encoded_s']:.3f} s"
                )
        print(f"identical store: {result['identical_store']}; {result['cpu_count']} cores, load {result['load_average_1m']:.2f}")
    return 0 if result["identical_store"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
