"""Sandbox leases over a real in-process envsandbox server: a holder that lives keeps its
sandboxes (a :class:`LeaseKeeper` renews them), and a holder killed with SIGKILL, which
never closes anything, leaves them open for a lease, not for their time-to-live."""
from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from meridian.v1 import envsandbox_pb2 as es
from meridian.v1 import envsandbox_pb2_grpc as es_grpc
from services.envsandbox.client import LeaseKeeper
from services.envsandbox.config import EnvSandboxConfig
from services.envsandbox.server import EnvSandboxService
from tests.unit.test_grpc_services import expect_code, run

Serving = Callable[..., Any]
LEASE_S = 1.5
REAP_S = 0.1

#: A holder as rollout is one: it makes a leased sandbox, keeps its lease and prints its
#: id; told to (a line on stdin), it runs a command in it until it is killed. It never
#: closes anything.
HOLDER = """
import asyncio, sys
import grpc
from meridian.v1 import envsandbox_pb2 as es, envsandbox_pb2_grpc as es_grpc
from services.envsandbox.client import LeaseKeeper

async def main():
    async with grpc.aio.insecure_channel(sys.argv[1]) as channel:
        stub = es_grpc.EnvSandboxStub(channel)
        keeper = LeaseKeeper(stub, float(sys.argv[2]))
        box = await stub.Create(es.CreateRequest(task_id="python/add", lease_seconds=keeper.lease_s))
        keeper.hold([box.sandbox_id])
        keeper.start()
        print(box.sandbox_id, flush=True)
        await asyncio.to_thread(sys.stdin.readline)
        async for chunk in stub.Exec(es.ExecRequest(sandbox_id=box.sandbox_id, argv=["sh", "-c", "echo running; sleep 1000"])):
            print(chunk.stdout.decode().strip(), flush=True)

asyncio.run(main())
"""


def _service(tmp_path: Path) -> EnvSandboxService:
    return EnvSandboxService(EnvSandboxConfig(root=str(tmp_path / "sandboxes"), reap_interval_s=REAP_S))


async def _live(stub: es_grpc.EnvSandboxStub) -> set[str]:
    return {b.sandbox_id for b in (await stub.List(es.ListRequest())).sandboxes}


async def _gone_within(stub: es_grpc.EnvSandboxStub, sandbox_id: str, bound_s: float) -> None:
    """Waits until ``sandbox_id`` is no longer listed; fails past ``bound_s``."""
    t0 = time.monotonic()
    while sandbox_id in await _live(stub):
        assert time.monotonic() - t0 < bound_s, f"{sandbox_id} still open {bound_s} s on"
        await asyncio.sleep(0.05)


def test_a_sigkilled_holder_leaves_its_sandbox_for_a_lease_only(tmp_path: Path, grpc_serving: Serving) -> None:
    """Killed mid-command, the holder's call ends with its connection, and the sandbox
    closes a lease after its last renewal (its time-to-live is the default 600 s)."""
    service = _service(tmp_path)

    async def main() -> None:
        async with grpc_serving(service) as address:
            async with grpc.aio.insecure_channel(address) as channel:
                stub = es_grpc.EnvSandboxStub(channel)
                env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")])}
                holder = await asyncio.create_subprocess_exec(sys.executable, "-c", HOLDER, address, str(LEASE_S), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env)
                try:
                    assert holder.stdout is not None and holder.stdin is not None
                    sandbox_id = (await holder.stdout.readline()).decode().strip()
                    info = {b.sandbox_id: b for b in (await stub.List(es.ListRequest())).sandboxes}
                    assert info[sandbox_id].lease_seconds == LEASE_S
                    # Alive, the holder keeps it over several leases by renewing alone.
                    await asyncio.sleep(3 * LEASE_S)
                    assert sandbox_id in await _live(stub)
                    holder.stdin.write(b"go\n")
                    await holder.stdin.drain()
                    assert (await holder.stdout.readline()).strip() == b"running"
                    workspace = Path(service.sandboxes.backend._sandbox_root(sandbox_id))  # type: ignore[attr-defined]
                    assert workspace.is_dir(), "the sandbox's workspace should be there while it lives"
                finally:
                    holder.send_signal(signal.SIGKILL)
                    await holder.wait()
                # Its last renewal came at most a third of a lease before the kill.
                await _gone_within(stub, sandbox_id, LEASE_S + 10 * REAP_S + 2.0)
                # Unlisted first, then destroyed: its processes killed, its workspace removed.
                t0 = time.monotonic()
                while workspace.exists():
                    assert time.monotonic() - t0 < 10.0, "a lapsed lease must remove the workspace"
                    await asyncio.sleep(0.05)
                await expect_code(grpc.StatusCode.NOT_FOUND, stub.Exec(es.ExecRequest(sandbox_id=sandbox_id, argv=["true"])).read())

    run(main())


def test_the_keeper_renews_what_it_holds_and_forgets_what_is_gone(tmp_path: Path, grpc_serving: Serving) -> None:
    async def main() -> None:
        async with grpc_serving(_service(tmp_path)) as address:
            async with grpc.aio.insecure_channel(address) as channel:
                stub = es_grpc.EnvSandboxStub(channel)
                keeper = LeaseKeeper(stub, LEASE_S)
                held = await stub.Create(es.CreateRequest(lease_seconds=LEASE_S))
                let_go = await stub.Create(es.CreateRequest(lease_seconds=LEASE_S))
                keeper.hold([held.sandbox_id, let_go.sandbox_id, "sbx-never-made"])
                assert await keeper.renew_once() == ["sbx-never-made"]
                assert keeper.held == {held.sandbox_id, let_go.sandbox_id}
                keeper.release([let_go.sandbox_id])
                keeper.start()
                try:
                    await _gone_within(stub, let_go.sandbox_id, LEASE_S + 10 * REAP_S + 2.0)
                    assert held.sandbox_id in await _live(stub)
                    await stub.Close(es.CloseRequest(sandbox_id=held.sandbox_id))
                    await asyncio.sleep(LEASE_S)  # a tick or more: the keeper learns it is gone
                    assert keeper.held == frozenset()
                finally:
                    await keeper.stop()
                # Without a lease the keeper holds nothing and renews nothing.
                idle = LeaseKeeper(stub, 0.0)
                idle.hold(["sbx-a"])
                idle.start()
                assert idle.held == frozenset() and await idle.renew_once() == []
                await idle.stop()

    run(main())


@pytest.mark.parametrize("lease_s", [float("nan"), float("inf"), -1.0])
def test_a_keeper_refuses_a_lease_that_is_no_duration(lease_s: float) -> None:
    with pytest.raises(ValueError, match="lease_s"):
        LeaseKeeper(None, lease_s)  # type: ignore[arg-type]
