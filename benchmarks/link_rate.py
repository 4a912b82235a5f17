"""``python -m benchmarks.link_rate [--json]``: the rate the link emulator
(``meridian/link_emulator.py``) really carries, against the rate it is set to, while its
event loop is busy half of the time (2 ms of work in every 4, as a process that decodes
weight chunks beside the link is).

The weightsync benches and the simulation's validation run every service and the link in
one process; an emulated link that carries less than its setting makes every transfer
through it look slower than the link would be. One connection sends one second of the
link's bytes through it to a sink on loopback; the carried rate is those bytes over the
time to the last byte, less the latency.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from typing import Any

from meridian.link_emulator import LinkEmulator

#: Link settings measured: (Mbit/s, one-way latency in ms).
LINKS = ((20.0, 20.0), (100.0, 50.0))
BUSY_S, IDLE_S = 0.002, 0.002


async def carried_mbit_s(mbit_s: float, latency_ms: float) -> float:
    """Mbit/s carried through a link set to ``mbit_s`` while the loop is busy half the time."""
    bandwidth = mbit_s * 1e6 / 8
    received = 0
    done = asyncio.Event()
    total = int(bandwidth)  # one second of the link

    async def sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal received
        while data := await reader.read(1 << 16):
            received += len(data)
            if received >= total:
                done.set()
        writer.close()

    async def busy(stop: asyncio.Event) -> None:
        while not stop.is_set():
            started = time.perf_counter()
            while time.perf_counter() - started < BUSY_S:
                pass
            await asyncio.sleep(IDLE_S)

    server = await asyncio.start_server(sink, "127.0.0.1", 0)
    stop = asyncio.Event()
    load = asyncio.ensure_future(busy(stop))
    try:
        port = server.sockets[0].getsockname()[1]
        async with LinkEmulator(f"127.0.0.1:{port}", bandwidth=bandwidth, latency_s=latency_ms / 1e3) as link:
            host, link_port = link.address.rsplit(":", 1)
            _, writer = await asyncio.open_connection(host, int(link_port))
            started = time.monotonic()
            writer.write(b"\0" * total)
            await writer.drain()
            await asyncio.wait_for(done.wait(), 60)
            elapsed = time.monotonic() - started - latency_ms / 1e3
            writer.close()
    finally:
        stop.set()
        await load
        server.close()
        await server.wait_closed()
    return total * 8 / 1e6 / elapsed


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.link_rate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    ns = parser.parse_args(argv)
    rows: list[dict[str, Any]] = []
    for mbit_s, latency_ms in LINKS:
        carried = asyncio.run(carried_mbit_s(mbit_s, latency_ms))
        rows.append({"set_mbit_s": mbit_s, "latency_ms": latency_ms, "carried_mbit_s": carried, "carried_vs_set": carried / mbit_s})
    result = {"links": rows, "busy_fraction": BUSY_S / (BUSY_S + IDLE_S), "load_average_1m": os.getloadavg()[0]}
    if ns.json:
        print(json.dumps(result, indent=2))
    else:
        for r in rows:
            print(f"{r['set_mbit_s']:g} Mbit/s, {r['latency_ms']:g} ms: carries {r['carried_mbit_s']:.1f} Mbit/s ({r['carried_vs_set']:.3f} of its setting)")
        print(f"load average {result['load_average_1m']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
