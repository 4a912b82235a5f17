"""envsandbox under calls cut off at random moments (a client's deadline, a client that
goes away), over a real in-process server (process backend): whatever a call was doing
when it was cut off, every sandbox the service still lists is whole and works, what it
counts is what it holds, and once everything is closed nothing is left behind (no
process, mount, cgroup or uid, no slot). Each cut off call answers DEADLINE_EXCEEDED or
a clear status, never INTERNAL/UNKNOWN."""
from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import grpc

from meridian.v1 import envsandbox_pb2 as es
from meridian.v1 import envsandbox_pb2_grpc as es_grpc
from services.envsandbox.config import EnvSandboxConfig
from services.envsandbox.server import EnvSandboxService

CALLS = 120
BROKEN = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}


def _consistent(service: EnvSandboxService) -> bool:
    """Slots held = live sandboxes + room reserved (false while a teardown runs)."""
    boxes = service.sandboxes
    return boxes.slots.held == len(boxes.list()) + boxes.reserved


async def _until(condition: Callable[[], bool], what: str, bound_s: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + bound_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"{what}: not within {bound_s} s"
        await asyncio.sleep(0.05)


def test_calls_cut_off_at_random_moments_leave_nothing_broken_or_behind(tmp_path: Path, grpc_serving: Any) -> None:
    service = EnvSandboxService(EnvSandboxConfig(root=str(tmp_path / "sandboxes"), max_sandboxes=8, max_create_wait_s=1.0))
    rng = random.Random(7)
    files = [es.File(path=f"data/part-{i}.bin", content=bytes([i]) * (256 << 10)) for i in range(4)]
    broken: list[str] = []

    async def main() -> None:
        async with grpc_serving(service) as address, grpc.aio.insecure_channel(address) as channel:
            stub = es_grpc.EnvSandboxStub(channel)
            live: list[str] = []
            requests: list[str] = []

            async def create(first_deadline_s: float) -> es.SandboxInfo:
                """A Create, and if it was cut off, its retry (the same request id) at once,
                as a client does: the retry may find the first call still at work."""
                request = es.CreateRequest(
                    task_id="python/add", files=files, fork_reserve=rng.randint(0, 2), wait_seconds=rng.choice([0.0, 0.5]),
                    client_request_id=f"req-{len(requests)}",
                )
                requests.append(request.client_request_id)
                try:
                    return await stub.Create(request, timeout=first_deadline_s)
                except grpc.aio.AioRpcError as exc:
                    if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                        raise
                return await stub.Create(request, timeout=30)

            def call(sid: str) -> tuple[str, Coroutine[Any, Any, Any]]:
                kind = rng.choice(["create", "create", "fork", "exec", "write", "read", "tests", "close"] if live else ["create"])
                timeout = 10 ** rng.uniform(-3.3, -0.5)  # 0.5 ms to 300 ms: cut off anywhere, or not at all
                if kind == "create":
                    return kind, create(timeout)
                if kind == "fork":
                    return kind, stub.Fork(es.ForkRequest(sandbox_id=sid, count=rng.randint(1, 2)), timeout=timeout)
                if kind == "exec":
                    return kind, _drain(stub.Exec(es.ExecRequest(sandbox_id=sid, argv=["sh", "-c", "echo x > out.txt; sleep 0.1"]), timeout=timeout))
                if kind == "write":
                    return kind, stub.WriteFiles(es.WriteFilesRequest(sandbox_id=sid, files=files), timeout=timeout)
                if kind == "read":
                    return kind, stub.ReadFiles(es.ReadFilesRequest(sandbox_id=sid, paths=["data/part-3.bin"]), timeout=timeout)
                if kind == "tests":
                    return kind, stub.RunTests(es.RunTestsRequest(sandbox_id=sid), timeout=timeout)
                return kind, stub.Close(es.CloseRequest(sandbox_id=sid), timeout=timeout)

            for _ in range(CALLS):
                sid = rng.choice(live) if live else ""
                kind, pending = call(sid)
                try:
                    answer = await pending
                except grpc.aio.AioRpcError as exc:
                    if exc.code() in BROKEN:
                        broken.append(f"{kind}: {exc.code().name} {exc.details()}")
                    if exc.code() == grpc.StatusCode.NOT_FOUND or kind == "close":
                        live[:] = [s for s in live if s != sid]
                    continue
                if kind == "create":
                    # The sandbox it names is made, files and all (a retry must wait for
                    # a first call still at work, or make its own if that one was cut off).
                    got = await stub.ReadFiles(es.ReadFilesRequest(sandbox_id=answer.sandbox_id, paths=[files[-1].path]))
                    assert got.files[0].content == files[-1].content
                    live.append(answer.sandbox_id)
                elif kind == "fork":
                    live += [s.sandbox_id for s in answer.sandboxes]
                elif kind == "close":
                    live.remove(sid)

            # Teardowns of cut off Closes and Creates run on, and so do cut off RunTests
            # (a sandbox refuses other calls until its tests have returned: a full suite saw
            # ReadFiles below refused so); then the counts add up.
            await _until(lambda: _consistent(service), "slots held = live sandboxes + reserved")
            await _until(lambda: not any(box.testing for box in service.sandboxes.list()), "cut off RunTests returned")
            listed = (await stub.List(es.ListRequest())).sandboxes
            for info in listed:
                # Whole: every file its Create wrote is there, and a command runs in it.
                got = await stub.ReadFiles(es.ReadFilesRequest(sandbox_id=info.sandbox_id, paths=[f.path for f in files]))
                assert [f.content for f in got.files] == [f.content for f in files], info.sandbox_id
                out = b"".join([c.stdout async for c in stub.Exec(es.ExecRequest(sandbox_id=info.sandbox_id, argv=["echo", "ok"]))])
                assert out == b"ok\n", info.sandbox_id
            for info in listed:
                await stub.Close(es.CloseRequest(sandbox_id=info.sandbox_id))
            await _until(lambda: service.sandboxes.slots.held == 0, "every slot back")
            assert service.sandboxes.slots.waiting == 0
            assert await service.sandboxes.backend.leftovers() == []

    asyncio.run(main())
    assert broken == []


async def _drain(stream: Any) -> None:
    async for _ in stream:
        pass
