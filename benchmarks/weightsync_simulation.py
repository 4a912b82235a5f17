"""``python -m benchmarks.weightsync_simulation [--bench FILE] [--versions N] [--json]``:
checks the weightsync propagation model (:mod:`services.weightsync.simulation`) against
real runs at small scale before it is trusted at large scale.

The real runs: the services themselves (origin, relay, in-place subscribers) in this
process, as ``meridian bench weightsync`` runs them, on the versions that bench records
(real RL steps of the built-in model, taken from its cache or recorded once), with the
inter-region hop through the WAN link emulator. The event loops' own costs (per chunk,
message and byte) come from ``benchmarks/weightsync_send_cost.py`` and the codec's from
this run; one configuration calibrates the only figure the model cannot take from
elsewhere, what the services lose to each other per chunk when they share one process and
two cores (``message_overhead_s``, charged only in that setting); the others (relay,
emulated links of several bandwidths and latencies, one or two subscribers) are predicted
with no further fitting and compared.

Prints one JSON object (``--json``) or a table: per configuration the measured median
propagation (origin holds the version -> every subscriber holds it verified), the model's
prediction and the error.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import contextlib
import gzip
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from services.weightsync import simulation as sim

LOOPBACK = sim.Link(1e9, 0.0)  # in-process gRPC over loopback: bytes are cheap, no latency
TOLERANCE = 0.20
CHUNK_BYTES = 4 << 20  # the service default (chunk_mb = 4)

#: name -> (emulated link Mbit/s, None: unlimited; one-way ms; relay behind the emulator; subscribers)
CONFIGS: dict[str, tuple[float | None, float, bool, int]] = {
    "calibration: relay, unlimited link, 1 subscriber": (None, 0.0, True, 1),
    "bench link: relay, 100 Mbit/s 50 ms, 1 subscriber": (100.0, 50.0, True, 1),
    "relay, 20 Mbit/s 20 ms, 1 subscriber": (20.0, 20.0, True, 1),
    "relay, 100 Mbit/s 150 ms, 2 subscribers": (100.0, 150.0, True, 2),
    "relay, unlimited link, 2 subscribers": (None, 0.0, True, 2),
    "no relay: origin -> 2 subscribers": (None, 0.0, False, 2),
}
CALIBRATION = next(iter(CONFIGS))


# ---------------------------------------------------------------- real runs


async def _measure(versions: list[Any], workdir: Path, mbit: float | None, latency_ms: float, relay: bool, subscribers: int) -> dict[str, Any]:
    """Propagation of versions 2.. from the origin to ``subscribers`` in-place subscribers,
    through a relay behind the link emulator or straight from the origin. Version 1 goes
    through first, unmeasured: a receiver's first delta also builds its position indexes
    (a pass over the model, ~3x that version's propagation here), once per start, which
    the model leaves out; what it predicts is a follower's every later version."""
    from meridian.link_emulator import LinkEmulator
    from benchmarks.weightsync import serve_on_loopback
    from services.weightsync import client
    from services.weightsync.client import WeightSubscriber
    from services.weightsync.config import WeightSyncConfig
    from services.weightsync.server import WeightSyncService

    origin_svc = WeightSyncService(WeightSyncConfig(data_dir=str(workdir / "origin")))
    out: dict[str, Any] = {"propagation_s": [], "encoded_bytes": [], "chunks": 0}
    async with contextlib.AsyncExitStack() as stack:
        origin = await stack.enter_async_context(serve_on_loopback(origin_svc))
        await client.publish(origin, 0, versions[0])
        source, relay_svc = origin, None
        link = None
        if relay:
            link = await stack.enter_async_context(LinkEmulator(origin))
            relay_svc = WeightSyncService(WeightSyncConfig(role="relay", upstream=link.address, data_dir=str(workdir / "relay")))
            source = await stack.enter_async_context(serve_on_loopback(relay_svc))
        subs = [WeightSubscriber(source, None, -1, in_place=True) for _ in range(subscribers)]
        streams = [s.updates(follow=True) for s in subs]
        try:
            for stream in streams:  # v0 over an unlimited link; the deltas are measured
                assert (await anext(stream)).version == 0
            while relay_svc is not None and relay_svc.store.latest < 0:
                await asyncio.sleep(0.05)
            if link is not None and mbit is not None:
                link.set_link(bandwidth=mbit * 1e6 / 8, latency_s=latency_ms / 1e3)
            await asyncio.sleep(0.5)

            async def next_update(stream: AsyncIterator[Any]) -> tuple[Any, float]:
                update = await anext(stream)
                return update, time.monotonic()

            for v in range(1, len(versions)):
                # Subscribers take the version as it comes, while the origin still answers Publish.
                waiting = [asyncio.ensure_future(next_update(s)) for s in streams]
                await client.publish(origin, v, versions[v])
                got = await asyncio.gather(*waiting)
                for update, _ in got:
                    if update.version != v:
                        raise RuntimeError(f"a subscriber got version {update.version}, expected {v}")
                if v >= 2:
                    out["propagation_s"].append(max(t for _, t in got) - origin_svc.available_at[v])
                    out["encoded_bytes"].append(int(got[0][0].manifest.encoded_bytes))
                    out["chunks"] = len(got[0][0].manifest.chunks)
                while relay_svc is not None and relay_svc.store.latest < v:
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.2)  # let the relay's store work finish before the next version
        finally:
            for stream in streams:
                await stream.aclose()
            for s in subs:
                await s.close()
    return out


# ---------------------------------------------------------------- the model of those runs


def _layout(versions: list[Any]) -> sim.ModelLayout:
    """The recorded model's real tensors, in the encoder's order, each with the density
    of its deltas (encoded bytes per raw byte over all the steps, relative to the whole
    model's): the order the stream brings bytes and decode work in."""
    from services.weightsync.versions import encode_version, stream_order

    encoded = dict.fromkeys(versions[0], 0)
    for v in range(1, len(versions)):
        enc = encode_version(v, versions[v], versions[v - 1], v - 1, CHUNK_BYTES)
        for ref in enc.manifest.chunks:
            encoded[ref.tensor] += ref.size
    raw = {n: t.nbytes for n, t in versions[0].items()}
    names = stream_order(raw, encoded)
    average = sum(encoded.values()) / sum(raw.values())
    return sim.ModelLayout(
        "recorded", tuple((1, int(versions[0][n].bits.size)) for n in names), tuple(encoded[n] / raw[n] / average for n in names)
    )


def _config(layout: sim.ModelLayout, rates: sim.CodecRates, mbit: float | None, latency_ms: float, relay: bool, subscribers: int) -> sim.SimConfig:
    wan = LOOPBACK if mbit is None else sim.Link(mbit * 1e6 / 8, latency_ms / 1e3)
    if relay:
        topology = sim.Topology(
            regions=2, subscribers_per_region=subscribers, origin_subscribers=0, wan=wan, lan=LOOPBACK, nic_bytes_s=LOOPBACK.bandwidth_bytes_s
        )
    else:
        topology = sim.Topology(regions=1, subscribers_per_region=subscribers, lan=LOOPBACK, nic_bytes_s=LOOPBACK.bandwidth_bytes_s)
    # Every service in one process, as in the runs: one event loop, this machine's cores.
    return sim.SimConfig(layout, topology, rates, mode="current", cores=os.cpu_count() or 1, single_process=True, max_segments=1024)


def _fit_message_overhead(layout: sim.ModelLayout, rates: sim.CodecRates, measured_s: float, config: tuple[float | None, float, bool, int]) -> float:
    """The per-chunk contention cost with which the model gives ``measured_s`` for ``config``
    (bisection: the prediction grows with it)."""
    lo, hi = 0.0, 0.1
    for _ in range(30):  # 0.1 s / 2**30: far below the noise
        mid = (lo + hi) / 2
        predicted = sim.simulate(_config(layout, rates.replace(message_overhead_s=mid), *config))["propagation_s"]
        lo, hi = (mid, hi) if predicted < measured_s else (lo, mid)
    return (lo + hi) / 2


def _codec_rates(versions: list[Any]) -> dict[str, float]:
    """Per-core codec speeds on these versions, measured now (the machine's load changes;
    rates measured at another time would not describe these runs): the origin's encode
    (``encode_version``: codec, sha256 per chunk; its full weights hash timed apart), a
    subscriber's in-place apply (per byte, and per chunk its Python part) and a relay's
    decode into fresh buffers (``Decoder``)."""
    from benchmarks.weightsync import per_chunk_version
    from meridian.tensors import weights_hash
    from services.weightsync.versions import encode_version

    raw = sum(t.nbytes for t in versions[0].values())
    t_enc, t_hash, t_apply, t_version, t_copy, sizes, per_chunk = [], [], [], [], [], [], []
    encode_version(1, versions[1], versions[0], 0, CHUNK_BYTES)  # compile the kernels outside the timing
    for v in range(1, len(versions)):
        old, new = versions[v - 1], versions[v]
        t0 = time.perf_counter()
        enc = encode_version(v, new, old, v - 1, CHUNK_BYTES)
        t1 = time.perf_counter()
        weights_hash(new)
        t2 = time.perf_counter()
        t_enc.append(t1 - t0 - (t2 - t1))
        t_hash.append(t2 - t1)
        sizes.append(enc.size)
        applied, version_s = _apply_s(enc, old, True)
        t_apply.append(applied)
        t_version.append(version_s)
        t_copy.append(_apply_s(enc, old, False)[0])
        # The same delta in 64x smaller chunks costs the same per byte and more per chunk:
        # the difference is the Python (GIL-held) part of decoding one chunk (and the
        # kernel's fixed part of a call).
        small = per_chunk_version(enc, new, old, CHUNK_BYTES // 64)
        extra = len(small.chunks) - len(enc.chunks)
        per_chunk.append(max(0.0, (_apply_s(small, old, True)[0] - t_apply[-1]) / extra) if extra > 0 else 0.0)
    med = statistics.median
    chunk_s = med(per_chunk)
    chunks = len(enc.chunks)
    return {
        "encode_bytes_s": raw / med(t_enc),
        "weights_hash_bytes_s": raw / med(t_hash),
        # Per byte: what is left of an apply without its chunks' Python part and the version's.
        "decode_bytes_s": raw / max(med(t_apply) - chunks * chunk_s - med(t_version), med(t_apply) / 10),
        "decode_chunk_s": chunk_s,
        "version_tensor_s": med(t_version) / len(versions[0]),
        "decode_copy_bytes_s": raw / med(t_copy),
        "delta_fraction": med(sizes) / raw,
        **_manifest_sizes(enc.manifest),
    }


def _manifest_sizes(manifest: Any) -> dict[str, float]:
    """What a manifest costs on the wire per chunk reference and per tensor (with its
    fixed fields), gzipped at zlib's default level as Subscribe sends it (gRPC's gzip)."""
    bare = type(manifest)()
    bare.CopyFrom(manifest)
    del bare.chunks[:]
    full, tensors = (len(gzip.compress(m.SerializeToString(), compresslevel=6)) for m in (manifest, bare))
    return {"manifest_chunk_bytes": (full - tensors) / len(manifest.chunks), "manifest_tensor_bytes": tensors / len(manifest.tensors)}


def _apply_s(enc: Any, old: dict[str, Any], in_place: bool) -> tuple[float, float]:
    """Seconds to apply ``enc`` to a copy of ``old``, and of those the decoder's start and
    end of the version (``begin``, ``finish``: per tensor, not per chunk). In place as a
    follower does: its position indexes built already (by applying it once and reverting
    it; a follower builds them once, at its first delta). Into fresh buffers: the first
    apply."""
    from meridian.tensors import RawTensor
    from services.weightsync.receiver import Decoder

    held = {k: RawTensor(t.dtype, t.shape, t.bits.copy()) for k, t in old.items()}
    decoder = Decoder(held, enc.manifest.base_version, in_place=in_place)
    decoder.prepare()  # once per subscriber, not per version

    def apply() -> tuple[float, float]:
        t0 = time.perf_counter()
        decoder.begin(enc.manifest)
        t1 = time.perf_counter()
        for i, payload in enumerate(enc.chunks):
            decoder.add_chunk(i, payload, verified=True)
        t2 = time.perf_counter()
        decoder.finish()
        t3 = time.perf_counter()
        return t3 - t0, (t1 - t0) + (t3 - t2)

    if not in_place:
        return apply()
    apply()
    decoder.revert_last()
    return apply()


def validate(versions: list[Any], rounds: int, log: Any) -> dict[str, Any]:
    """Runs every configuration ``rounds`` times, interleaved (the machine's load drifts),
    fits the per-chunk contention cost on the calibration configuration and predicts the others."""
    layout = _layout(versions)
    codec = _codec_rates(versions)
    log("codec rates now: " + ", ".join(f"{k} {v:.4g}" for k, v in codec.items()))
    measured: dict[str, list[float]] = {name: [] for name in CONFIGS}
    chunks: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="meridian-ws-sim-") as tmp:
        for r in range(rounds):
            for i, (name, config) in enumerate(CONFIGS.items()):
                run = asyncio.run(_measure(versions, Path(tmp) / f"{r}-{i}", *config))
                measured[name] += run["propagation_s"]
                chunks[name] = run["chunks"]
                log(f"round {r}, {name}: {[round(x, 3) for x in run['propagation_s']]}")
    rates = sim.DEFAULT_RATES.replace(**codec)
    calibration = statistics.median(measured[CALIBRATION])
    overhead = _fit_message_overhead(layout, rates, calibration, CONFIGS[CALIBRATION])
    rates = rates.replace(message_overhead_s=overhead, source="this run: codec rates measured now, per-chunk contention fitted on the calibration configuration")
    rows = []
    for name, config in CONFIGS.items():
        report = sim.simulate(_config(layout, rates, *config))
        real = statistics.median(measured[name])
        rows.append(
            {
                "config": name,
                "calibration": name == CALIBRATION,
                "measured_s": real,
                "measured_each_s": measured[name],
                "predicted_s": report["propagation_s"],
                "error_pct": 100 * (report["propagation_s"] - real) / real,
                "link_bound_s": report["link_bound_s"],
                "where_the_time_goes": report["where_the_time_goes"],
                "chunks_real": chunks[name],
                "chunks_model": report["model"]["chunks"],
            }
        )
    checked = [r for r in rows if not r["calibration"]]
    return {
        "model_rates": dataclasses.asdict(rates),
        "rows": rows,
        "max_abs_error_pct": max(abs(r["error_pct"]) for r in checked),
        "within_20pct": all(abs(r["error_pct"]) <= 100 * TOLERANCE for r in checked),
        "load_average_1m": os.getloadavg()[0],
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.weightsync_simulation")
    parser.add_argument("--bench", type=Path, default=None, help="a `meridian bench weightsync --json` output: also compare with its propagation run")
    parser.add_argument("--versions", type=int, default=3, help="deltas measured per configuration and round, after one that warms the receivers up (1-4; the bench's cached versions)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over all configurations, interleaved (default 3)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    ns = parser.parse_args(argv)
    if not 1 <= ns.versions <= 4 or ns.rounds < 1:
        parser.error("--versions must be in 1..4 and --rounds >= 1")

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    from benchmarks.weightsync import recorded_versions

    versions, _ = recorded_versions(5, True, log)  # what `meridian bench weightsync` records (and caches)
    result = validate(versions[: ns.versions + 2], ns.rounds, log)
    if ns.bench is not None:
        # The bench's own run of the second configuration, with its own codec figures: its
        # one-process run, the setting these configurations model (older bench files had
        # only that one, as "propagation").
        bench = json.loads(ns.bench.read_text())
        run = bench.get("propagation_one_process", bench["propagation"])
        real = statistics.median(p["propagation_s"] for p in run["per_version"])
        rates = sim.rates_from_bench(bench, sim.CodecRates(**result["model_rates"]))
        # Wall-clock decode, as the run saw it (the CPU-time figure describes a free core).
        rates = rates.replace(decode_bytes_s=bench["summary"]["decode_gbps"] * 1e9)
        layout = _layout(versions)
        predicted = sim.simulate(_config(layout, rates, *CONFIGS["bench link: relay, 100 Mbit/s 50 ms, 1 subscriber"]))["propagation_s"]
        result["bench_run"] = {
            "measured_s": real,
            "predicted_s": predicted,
            "error_pct": 100 * (predicted - real) / real,
            "load_average_1m": bench["summary"].get("load_average_1m"),
        }
    if ns.json:
        print(json.dumps(result))
    else:
        for r in result["rows"]:
            tag = " (calibration)" if r["calibration"] else ""
            print(f"{r['config']}: measured {r['measured_s']:.3f}s, model {r['predicted_s']:.3f}s ({r['error_pct']:+.0f}%){tag}")
        print(f"largest error {result['max_abs_error_pct']:.0f}% (within 20%: {result['within_20pct']})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
