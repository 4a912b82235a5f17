"""``meridian bench sandbox --json``: sandbox latency and throughput, process vs Docker.

For each backend, measured in this run: create → ``exec true`` → close (p50, p99),
``exec true`` in a live sandbox (p50), sandboxes per second at concurrency 16, and the
number of live sandboxes reached without an error (up to a cap). Docker runs against a
private dockerd this benchmark starts and stops itself; without dockerd it is reported as
unavailable with the reason. ``grpc``: the same cycle as a client sees it, through a
running envsandbox service (its own process, process backend, every hardening on).
Prints one JSON object.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from services.envsandbox.sandbox import Backend, ExecResult, SandboxManager


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


async def _exec_true(manager: SandboxManager, sandbox_id: str) -> None:
    result = None
    async for item in manager.exec(sandbox_id, ["true"]):
        if isinstance(item, ExecResult):
            result = item
    if result is None or result.exit_code != 0:
        raise RuntimeError(f"exec true failed in {sandbox_id}: {result}")


async def _cycle(manager: SandboxManager) -> float:
    start = time.perf_counter()
    box = await manager.create()
    await _exec_true(manager, box.sandbox_id)
    await manager.close(box.sandbox_id)
    return (time.perf_counter() - start) * 1000


async def measure(backend: Backend, cycles: int, execs: int, concurrent_total: int, live_cap: int) -> dict:
    manager = SandboxManager(backend, max_sandboxes=max(live_cap, 16))
    try:
        await manager.start()
        await _cycle(manager)  # warm-up
        cycle_ms = [await _cycle(manager) for _ in range(cycles)]

        box = await manager.create()
        exec_ms = []
        for _ in range(execs):
            start = time.perf_counter()
            await _exec_true(manager, box.sandbox_id)
            exec_ms.append((time.perf_counter() - start) * 1000)
        await manager.close(box.sandbox_id)

        remaining = concurrent_total

        async def worker() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                await _cycle(manager)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(16)))
        per_s = concurrent_total / (time.perf_counter() - start)

        live = 0
        error = ""
        try:
            for _ in range(live_cap):
                await manager.create()
                live += 1
        except Exception as exc:  # the figure is how far it got; the reason is reported
            error = f"{type(exc).__name__}: {exc}"
        for b in manager.list():
            await manager.close(b.sandbox_id)
        return {
            "create_exec_close_p50_ms": round(statistics.median(cycle_ms), 2),
            "create_exec_close_p99_ms": round(_pct(cycle_ms, 0.99), 2),
            "exec_p50_ms": round(statistics.median(exec_ms), 2),
            "sandboxes_per_s": round(per_s, 2),
            "max_live_sandboxes": live,
            "max_live_cap": live_cap,
            "max_live_error": error,
            "cycles": cycles,
        }
    finally:
        await manager.close_all()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="meridian bench sandbox")
    parser.add_argument("--json", action="store_true", help="print one JSON object (the only output format)")
    parser.add_argument("--cycles", type=int, default=50, help="process backend create/exec/close cycles")
    parser.add_argument("--docker-cycles", type=int, default=8, help="docker backend cycles (each takes ~1 s)")
    parser.add_argument("--live-cap", type=int, default=256, help="process backend: live sandboxes to try")
    parser.add_argument("--docker-live-cap", type=int, default=24, help="docker backend: live sandboxes to try")
    parser.add_argument("--skip-docker", action="store_true")
    args = parser.parse_args(argv)

    from services.envsandbox.process_backend import ProcessBackend

    # Context for the figures: other work on the machine inflates every latency here.
    report: dict = {"backends": {}, "loadavg_1m_at_start": round(os.getloadavg()[0], 2)}
    with tempfile.TemporaryDirectory(prefix="meridian-bench-") as tmp:
        report["backends"]["process"] = asyncio.run(
            measure(ProcessBackend(Path(tmp) / "process"), args.cycles, 50, 4 * 16, args.live_cap)
        )
        report["grpc"] = _through_grpc(Path(tmp) / "service", args.cycles, 4 * 16)
        if args.skip_docker:
            report["backends"]["docker"] = {"unavailable": "skipped (--skip-docker)"}
        else:
            report["backends"]["docker"] = _docker(Path(tmp) / "docker", args)
    proc, dock = report["backends"]["process"], report["backends"]["docker"]
    if "create_exec_close_p50_ms" in dock:
        report["process_vs_docker_speedup"] = round(dock["create_exec_close_p50_ms"] / proc["create_exec_close_p50_ms"], 1)
    else:
        report["process_vs_docker_speedup"] = None
    report["loadavg_1m_at_end"] = round(os.getloadavg()[0], 2)
    report["targets"] = {"grpc_create_exec_close_p50_ms": 10.0, "grpc_sandboxes_per_s": 300.0, "process_vs_docker_speedup": 50.0}
    print(json.dumps(report))
    return 0


def _through_grpc(root: Path, cycles: int, concurrent_total: int) -> dict:
    """create → exec true → close through a real envsandbox service process."""
    from meridian import stack

    root.mkdir(parents=True)
    proc, address, log = stack.spawn_service("envsandbox", ["--insecure", "true", "--root", str(root / "sandboxes"), "--max-sandboxes", "64"], root, dict(os.environ))
    try:
        stack.wait_serving({"envsandbox": address}, {"envsandbox": proc}, {"envsandbox": str(log)}, 120)
        return asyncio.run(_grpc_cycles(address, cycles, concurrent_total))
    finally:
        stack.Stack(root, {"envsandbox": proc.pid}, {}, {}, "").stop(30)


async def _grpc_cycles(address: str, cycles: int, concurrent_total: int) -> dict:
    from meridian.grpc_runtime import open_channel
    from meridian.v1 import envsandbox_pb2 as pb
    from meridian.v1 import envsandbox_pb2_grpc as pb_grpc

    async with open_channel(address) as channel:
        stub = pb_grpc.EnvSandboxStub(channel)

        async def cycle() -> float:
            start = time.perf_counter()
            box = await stub.Create(pb.CreateRequest())
            code = None
            async for chunk in stub.Exec(pb.ExecRequest(sandbox_id=box.sandbox_id, argv=["true"])):
                if chunk.HasField("result"):
                    code = chunk.result.exit_code
            await stub.Close(pb.CloseRequest(sandbox_id=box.sandbox_id))
            if code != 0:
                raise RuntimeError(f"exec true through gRPC ended with {code}")
            return (time.perf_counter() - start) * 1000

        await cycle()  # warm-up
        cycle_ms = [await cycle() for _ in range(cycles)]
        remaining = concurrent_total

        async def worker() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                await cycle()

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(16)))
        per_s = concurrent_total / (time.perf_counter() - start)
    return {
        "create_exec_close_p50_ms": round(statistics.median(cycle_ms), 2),
        "create_exec_close_p99_ms": round(_pct(cycle_ms, 0.99), 2),
        "sandboxes_per_s": round(per_s, 2),
        "concurrency": 16,
        "cycles": cycles,
    }


def _docker(root: Path, args: argparse.Namespace) -> dict:
    from benchmarks.support.dockerd import DockerdUnavailable, private_dockerd

    try:
        from services.envsandbox.docker_backend import DockerBackend

        with private_dockerd() as daemon:
            return asyncio.run(measure(DockerBackend(root, base_url=daemon.base_url), args.docker_cycles, 10, 16, args.docker_live_cap))
    except DockerdUnavailable as exc:
        return {"unavailable": str(exc)}
    except ImportError as exc:
        return {"unavailable": f"Docker SDK missing: {exc}"}
