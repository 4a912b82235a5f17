"""``python -m benchmarks.weightsync_send_cost [--repeats N] [--json]``: what sending a
version costs a weightsync server's process, split into a cost per chunk, per gRPC message
and per encoded byte, and what receiving it costs a subscriber's event loop per chunk: the
loop figures of ``meridian simulate weightsync`` (``send_*_s``, ``receive_chunk_s``).

Small-scale propagation runs (``benchmarks.weightsync_simulation``) cannot tell these
apart: there a delta always has the same few hundred chunks of ~2 KB in the same few
messages, so any split fits. At the frontier (a 1T model: ~490,000 chunks, 2.6 GB per
version and child) they differ by orders of magnitude, so they are measured apart here.
An origin serves real versions (synthetic bf16 tensors, 1 % of the elements changed)
on loopback; a client in another process only drains ``Subscribe`` messages, so the
server process's CPU time is the sender's alone. The version is cut into small or large
chunks and coalesced into small or large messages, and a keyframe adds bytes; the three
costs are the least-squares fit over those variants (CPU seconds, the server's event loop
and gRPC's threads together). The receiving side: an in-place subscriber in this process
takes the delta from an origin in another process, and the CPU time of its event loop's
thread (not of its decode threads) is fitted per chunk.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

#: (chunk KiB, message KiB, from_version): 0 sends the delta 0 -> 1, -1 the keyframe of 1.
#: The last has many chunks in each large message (64 per MiB), as a 1T model's delta with
#: ``--chunk-mb 32 --message-kib 1024`` has (~25).
VARIANTS = ((16, 64, 0), (16, 1, 0), (256, 64, 0), (4096, 64, 0), (4096, 64, -1), (4096, 1024, -1), (16, 1024, -1))
RECEIVE_VARIANTS = ((16, 64, 0), (256, 64, 0), (4096, 64, 0))
TENSORS, ELEMENTS = 32, 1 << 20  # 64 MiB of bf16

_DRAIN = r"""
import asyncio, sys
import grpc
from meridian.grpc_runtime import channel_options
from meridian.v1 import weightsync_pb2 as pb, weightsync_pb2_grpc as pb_grpc

async def main(address, from_version, repeats):
    async with grpc.aio.insecure_channel(address, options=channel_options()) as channel:
        stub = pb_grpc.WeightSyncStub(channel)
        for _ in range(repeats):
            chunks = messages = 0
            async for item in stub.Subscribe(pb.SubscribeRequest(from_version=from_version, follow=False)):
                messages += 1
                chunks += len(item.batch.chunks) if item.HasField("batch") else int(item.HasField("chunk"))
            print(chunks, messages, flush=True)

asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
"""


def _versions() -> tuple[dict[str, Any], dict[str, Any]]:
    from meridian.tensors import RawTensor

    rng = np.random.default_rng(0)
    v0, v1 = {}, {}
    for i in range(TENSORS):
        bits = (rng.normal(0, 0.02, ELEMENTS).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        changed = bits.copy()
        changed[rng.choice(ELEMENTS, ELEMENTS // 100, replace=False)] += 1
        v0[f"w{i:02d}"], v1[f"w{i:02d}"] = RawTensor("bf16", (ELEMENTS,), bits), RawTensor("bf16", (ELEMENTS,), changed)
    return v0, v1


async def _measure(chunk_kib: int, message_kib: int, from_version: int, repeats: int) -> dict[str, Any]:
    """Server CPU seconds per version sent, with the version's chunk, message and byte counts."""
    from benchmarks.weightsync import serve_on_loopback
    from services.weightsync import client
    from services.weightsync.config import WeightSyncConfig
    from services.weightsync.server import WeightSyncService

    v0, v1 = _versions()
    with tempfile.TemporaryDirectory(prefix="meridian-send-cost-") as tmp:
        config = WeightSyncConfig(data_dir=tmp, chunk_mb=chunk_kib / 1024, message_kib=message_kib, keyframe_every=1)
        service = WeightSyncService(config)
        async with serve_on_loopback(service) as address:
            await client.publish(address, 0, v0)
            await client.publish(address, 1, v1)
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
            drain = await asyncio.create_subprocess_exec(
                sys.executable, "-c", _DRAIN, address, str(from_version), str(repeats + 1), stdout=subprocess.PIPE, env=env
            )
            assert drain.stdout is not None
            await drain.stdout.readline()  # the first version warms the path up, untimed
            c0, w0 = time.process_time(), time.perf_counter()
            for _ in range(repeats):
                chunks, messages = map(int, (await drain.stdout.readline()).split())
            cpu, wall = (time.process_time() - c0) / repeats, (time.perf_counter() - w0) / repeats
            if await drain.wait() != 0:
                raise RuntimeError("the draining client failed")
            sent = service.store.keyframes[1] if from_version < 0 else service.store.deltas[1]
    return {"chunk_kib": chunk_kib, "message_kib": message_kib, "keyframe": from_version < 0, "chunks": chunks,
            "messages": messages, "bytes": sent.size, "cpu_s": cpu, "wall_s": wall}


_SERVE = r"""
import asyncio, sys
from benchmarks.weightsync import serve_on_loopback
from benchmarks.weightsync_send_cost import _versions
from services.weightsync import client
from services.weightsync.config import WeightSyncConfig
from services.weightsync.server import WeightSyncService

async def main(data_dir, chunk_kib, message_kib):
    service = WeightSyncService(WeightSyncConfig(data_dir=data_dir, chunk_mb=chunk_kib / 1024, message_kib=message_kib, keyframe_every=1000))
    async with serve_on_loopback(service) as address:
        v0, v1 = _versions()
        await client.publish(address, 0, v0)
        await client.publish(address, 1, v1)
        print(address, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)

asyncio.run(main(sys.argv[1], float(sys.argv[2]), int(sys.argv[3])))
"""


async def _measure_receive(chunk_kib: int, message_kib: int, repeats: int) -> dict[str, Any]:
    """The receiving event loop's CPU seconds per delta taken by an in-place subscriber
    (verify, bookkeeping, hand-off to the decode threads; the decoding itself runs on
    those threads and is not counted), the origin in another process."""
    from services.weightsync.client import WeightSubscriber

    v0, _ = _versions()
    with tempfile.TemporaryDirectory(prefix="meridian-receive-cost-") as tmp:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        server = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _SERVE, tmp, str(chunk_kib), str(message_kib), stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
        )
        assert server.stdout is not None and server.stdin is not None
        try:
            address = (await server.stdout.readline()).decode().strip()
            cpu: list[float] = []
            for i in range(repeats + 1):
                held = {k: type(t)(t.dtype, t.shape, t.bits.copy()) for k, t in v0.items()}
                sub = WeightSubscriber(address, held, 0, in_place=True)
                try:
                    c0 = time.thread_time()
                    async for update in sub.updates(follow=False):
                        chunks = len(update.manifest.chunks)
                        size = update.manifest.encoded_bytes
                    if i:  # the first warms the kernels and the channel up
                        cpu.append(time.thread_time() - c0)
                finally:
                    await sub.close()
        finally:
            server.stdin.close()
            await server.wait()
    messages = max(1, min(chunks, -(-size // (message_kib << 10))))
    return {"chunk_kib": chunk_kib, "message_kib": message_kib, "chunks": chunks, "messages": messages, "bytes": size,
            "loop_cpu_s": sorted(cpu)[len(cpu) // 2]}


def fit(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Least-squares per-chunk, per-message and per-byte seconds (clipped at 0)."""
    a = np.array([[r["chunks"], r["messages"], r["bytes"]] for r in rows], float)
    b = np.array([r["cpu_s"] for r in rows])
    scale = a.max(axis=0)  # columns differ by 10**6: solve on normalised ones
    coef = np.linalg.lstsq(a / scale, b, rcond=None)[0] / scale
    chunk, message, byte = (max(0.0, float(x)) for x in coef)
    return {"send_chunk_s": chunk, "send_message_s": message, "send_byte_s": byte}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.weightsync_send_cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20, help="versions sent per variant (default 20)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    ns = parser.parse_args(argv)
    if ns.repeats < 1:
        parser.error("--repeats must be >= 1")
    rows = [asyncio.run(_measure(*variant, ns.repeats)) for variant in VARIANTS]
    costs = fit(rows)
    predicted = [costs["send_chunk_s"] * r["chunks"] + costs["send_message_s"] * r["messages"] + costs["send_byte_s"] * r["bytes"] for r in rows]
    for r, p in zip(rows, predicted):
        r["fitted_cpu_s"] = p
    receive = [asyncio.run(_measure_receive(chunk, message, ns.repeats)) for chunk, message, _ in RECEIVE_VARIANTS]
    a = np.array([[r["chunks"]] for r in receive], float)
    per_chunk = float(np.linalg.lstsq(a, np.array([r["loop_cpu_s"] for r in receive]), rcond=None)[0][0])
    result = {"variants": rows, "fit": costs, "receive": receive, "receive_chunk_s": per_chunk, "load_average": os.getloadavg()}
    if ns.json:
        print(json.dumps(result, indent=2))
    else:
        for r in rows:
            print(f"chunks {r['chunk_kib']:>5} KiB, messages {r['message_kib']:>5} KiB{' (keyframe)' if r['keyframe'] else ''}: "
                  f"{r['chunks']} chunks, {r['messages']} messages, {r['bytes'] / 1e6:.2f} MB: {1e3 * r['cpu_s']:.2f} ms CPU "
                  f"(fit {1e3 * r['fitted_cpu_s']:.2f})")
        print(f"per chunk {1e6 * costs['send_chunk_s']:.2f} us, per message {1e6 * costs['send_message_s']:.1f} us, "
              f"per MB {1e3 * costs['send_byte_s'] * 1e6:.2f} ms; load {os.getloadavg()[0]:.1f}")
        for r in receive:
            print(f"receive: chunks {r['chunk_kib']:>5} KiB: {r['chunks']} chunks, {r['messages']} messages: "
                  f"{1e3 * r['loop_cpu_s']:.2f} ms of the loop's CPU")
        print(f"receive: {1e6 * per_chunk:.1f} us of the loop per chunk")
    return 0


if __name__ == "__main__":
    sys.exit(main())
