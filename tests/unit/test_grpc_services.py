"""WeightSync and EnvSandbox over real in-process gRPC servers (conftest ``serving``),
and the ErrorBoundary interceptor on a toy service."""
from __future__ import annotations

import asyncio
import os
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import grpc
import numpy as np
import pytest

from meridian.errors import NotFound
from meridian.grpc_runtime import ErrorBoundary, check_health
from meridian.v1 import envsandbox_pb2 as es
from meridian.v1 import envsandbox_pb2_grpc as es_grpc
from meridian.v1 import weightsync_pb2 as ws
from meridian.v1 import weightsync_pb2_grpc as ws_grpc
from services.envsandbox.config import EnvSandboxConfig
from services.envsandbox.server import EnvSandboxService
from services.weightsync import client
from services.weightsync.client import WeightSubscriber
from services.weightsync.config import WeightSyncConfig
from services.weightsync.server import WeightSyncService
from meridian.tensors import RawTensor, weights_hash

T = TypeVar("T")
Serving = Callable[..., Any]  # conftest.serving: async context manager yielding an address
MiB = 1024 * 1024
TIMEOUT_S = 30.0  # only guards against a hang; no test depends on speed


def run(coro: Awaitable[T]) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coro, TIMEOUT_S)

    return asyncio.run(bounded())


async def expect_code(code: grpc.StatusCode, call: Awaitable[Any]) -> str:
    """Awaits ``call``, which must fail with ``code``; returns the status details."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.code() == code, info.value.details()
    return info.value.details() or ""


# ---------------------------------------------------------------- weightsync


def _weights(seed: int) -> dict[str, RawTensor]:
    rng = np.random.default_rng(seed)
    return {
        "emb": RawTensor("bf16", (64, 8), rng.integers(0x3C00, 0x3F00, 512, dtype=np.uint16)),
        "bias": RawTensor("fp32", (7,), rng.normal(size=7).astype(np.float32).view(np.uint32)),
    }


def _nudged(weights: dict[str, RawTensor], seed: int) -> dict[str, RawTensor]:
    rng = np.random.default_rng(seed)
    out = {}
    for name, t in weights.items():
        bits = t.bits.copy()
        bits[rng.integers(0, bits.size, 5)] ^= 1
        out[name] = RawTensor(t.dtype, t.shape, bits)
    return out


def _same(a: dict[str, RawTensor], b: dict[str, RawTensor]) -> bool:
    return set(a) == set(b) and all(np.array_equal(a[n].bits, b[n].bits) for n in a) and weights_hash(a) == weights_hash(b)


def _weightsync(tmp_path: Path) -> WeightSyncService:
    # A small chunk size makes every version span several chunks.
    return WeightSyncService(WeightSyncConfig(role="origin", data_dir=str(tmp_path / "ws"), chunk_mb=0.0005))


def _header(version: int = 0) -> ws.PublishRequest:
    return ws.PublishRequest(header=ws.PublishHeader(version=version))


def _piece(offset: int, data: bytes, name: str = "", dtype: int = ws.DTYPE_BF16, shape: Iterable[int] = (4,)) -> ws.PublishRequest:
    meta = ws.TensorMeta(name=name, dtype=dtype, shape=list(shape)) if name else None
    return ws.PublishRequest(piece=ws.TensorPiece(meta=meta, offset=offset, data=data))


BAD_PUBLISH_STREAMS: dict[str, list[ws.PublishRequest]] = {
    "piece before header": [_piece(0, b"\0" * 8, name="t"), _header()],
    "two headers": [_header(), _header()],
    "no header": [],
    "first piece without meta": [_header(), _piece(0, b"\0" * 8)],
    "wrong offset": [_header(), _piece(0, b"\0" * 4, name="t"), _piece(6, b"\0" * 2)],
    "overlong data": [_header(), _piece(0, b"\0" * 10, name="t")],  # 4 bf16 = 8 bytes
    "unknown dtype": [_header(), _piece(0, b"\0" * 8, name="t", dtype=ws.DTYPE_UNSPECIFIED)],
    "negative dimension": [_header(), _piece(0, b"", name="t", shape=(-1, 4))],
    "tensor started twice": [_header(), _piece(0, b"\0" * 8, name="t"), _piece(0, b"\0" * 8, name="t")],
    "incomplete tensor": [_header(), _piece(0, b"\0" * 6, name="t")],
    "empty request": [_header(), ws.PublishRequest()],
    # A whole-version Publish (part_count 0) that names a part: otherwise a valid version.
    "part fields on a whole publish": [
        ws.PublishRequest(header=ws.PublishHeader(version=0, part_index=1, part_tensors=["t"])), _piece(0, b"\0" * 8, name="t"),
    ],
}


def test_weightsync_publish_then_subscribe_latest(tmp_path: Path, grpc_serving: Serving) -> None:
    v0 = _weights(0)
    v1 = _nudged(v0, 1)

    async def main() -> None:
        async with grpc_serving(_weightsync(tmp_path)) as address:
            r0 = await client.publish(address, 0, v0)
            r1 = await client.publish(address, 1, v1, trace_context={"traceparent": "00-x-y-01"})
            assert (r0.version, r1.version) == (0, 1)
            assert r1.raw_bytes == sum(t.nbytes for t in v1.values())
            assert await client.latest_version(address) == 1

            # A newcomer gets the verified latest in one keyframe.
            sub = WeightSubscriber(address, None, -1)
            try:
                updates = [u async for u in sub.updates(follow=False)]
            finally:
                await sub.close()
            assert [u.version for u in updates] == [1]
            assert _same(updates[0].weights, v1)
            assert updates[0].manifest.base_version == -1
            assert updates[0].manifest.weights_hash == weights_hash(v1)

            # A holder of v0 gets the delta, with its encoded form when asked.
            sub = WeightSubscriber(address, v0, 0)
            try:
                updates = [u async for u in sub.updates(follow=False, keep_encoded=True)]
            finally:
                await sub.close()
            assert [(u.version, u.manifest.base_version) for u in updates] == [(1, 0)]
            assert _same(updates[0].weights, v1)
            enc = updates[0].encoded
            assert enc is not None and len(enc.chunks) == len(enc.manifest.chunks) > 1

            async with grpc.aio.insecure_channel(address) as channel:
                stub = ws_grpc.WeightSyncStub(channel)
                status = await stub.Status(ws.WeightSyncStatusRequest())
                assert status.latest_version == 1 and list(status.versions) == [0, 1] and status.role == "origin"
                manifest = await stub.GetManifest(ws.GetManifestRequest(version=1))
                assert manifest.version == 1 and dict(manifest.trace_context) == {"traceparent": "00-x-y-01"}

    run(main())


def test_weightsync_follow_receives_new_versions(tmp_path: Path, grpc_serving: Serving) -> None:
    v0 = _weights(0)
    v1 = _nudged(v0, 1)

    async def main() -> None:
        async with grpc_serving(_weightsync(tmp_path)) as address:
            await client.publish(address, 0, v0)
            sub = WeightSubscriber(address, None, -1)
            stream = sub.updates(follow=True)
            try:
                first = await anext(stream)
                assert first.version == 0 and _same(first.weights, v0)
                await client.publish(address, 1, v1)
                second = await anext(stream)
                assert second.version == 1 and _same(second.weights, v1)
            finally:
                await stream.aclose()
                await sub.close()

    run(main())


_PUBLISH_AND_WAIT = """
import asyncio, sys
import numpy as np
from meridian.tensors import RawTensor
from services.weightsync import client
saved = np.load(sys.argv[2])
weights = {k[:-6]: RawTensor(str(saved[k[:-6] + ".dtype"]), tuple(saved[k[:-6] + ".shape"]), saved[k]) for k in saved.files if k.endswith(".bits_")}
asyncio.run(client.publish(sys.argv[1], 1, weights))
"""


def test_weightsync_announces_a_version_whose_publisher_was_killed(tmp_path: Path, grpc_serving: Serving, monkeypatch: pytest.MonkeyPatch) -> None:
    """A trainer SIGKILLed after its last byte but before the answer: the origin still
    stores the version and followers get it. (They waited for good: the dropped
    connection cancelled the Publish handler between storing and announcing, and the
    restarted trainer's republish answers "already held", which announces nothing.)"""
    v0 = _weights(0)
    v1 = _nudged(v0, 1)
    saved = tmp_path / "v1.npz"
    np.savez(saved, **{f"{n}.bits_": t.bits for n, t in v1.items()}, **{f"{n}.dtype": t.dtype for n, t in v1.items()},
             **{f"{n}.shape": np.array(t.shape) for n, t in v1.items()})
    service = _weightsync(tmp_path)
    storing, release = threading.Event(), threading.Event()
    real = service.store.publish

    def held_back(version: int, *args: Any, **kwargs: Any) -> Any:
        if version == 1:
            storing.set()
            release.wait(TIMEOUT_S)
        return real(version, *args, **kwargs)

    monkeypatch.setattr(service.store, "publish", held_back)

    async def main() -> None:
        async with grpc_serving(service) as address:
            await client.publish(address, 0, v0)
            sub = WeightSubscriber(address, None, -1)
            stream = sub.updates(follow=True)
            try:
                assert (await anext(stream)).version == 0
                env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
                publisher = await asyncio.create_subprocess_exec(sys.executable, "-c", _PUBLISH_AND_WAIT, address, str(saved), env=env)
                try:
                    assert await asyncio.to_thread(storing.wait, TIMEOUT_S)
                finally:
                    publisher.kill()  # the trainer dies while the origin stores its version
                    await publisher.wait()
                await asyncio.sleep(0.5)  # the origin sees the connection go first
                release.set()
                update = await asyncio.wait_for(anext(stream), 10)
                assert update.version == 1 and _same(update.weights, v1)
                assert (await client.publish(address, 1, v1)).version == 1  # the republish
            finally:
                release.set()
                await stream.aclose()
                await sub.close()

    run(main())


@pytest.mark.parametrize("case", sorted(BAD_PUBLISH_STREAMS))
def test_weightsync_bad_publish_stream_is_invalid_argument(tmp_path: Path, case: str, grpc_serving: Serving) -> None:
    v0 = _weights(0)

    async def main() -> None:
        async with grpc_serving(_weightsync(tmp_path)) as address:
            async with grpc.aio.insecure_channel(address) as channel:
                stub = ws_grpc.WeightSyncStub(channel)
                await expect_code(grpc.StatusCode.INVALID_ARGUMENT, stub.Publish(iter(BAD_PUBLISH_STREAMS[case])))
                status = await stub.Status(ws.WeightSyncStatusRequest())
                assert status.latest_version == -1  # nothing was stored
            # The service still accepts a good version afterwards.
            assert (await client.publish(address, 0, v0)).version == 0

    run(main())


def test_weightsync_publish_rejects_overflowing_shape(tmp_path: Path, grpc_serving: Serving) -> None:
    stream = [_header(), _piece(0, b"", name="t", shape=(2**32, 2**32))]

    async def main() -> None:
        async with grpc_serving(_weightsync(tmp_path)) as address:
            async with grpc.aio.insecure_channel(address) as channel:
                stub = ws_grpc.WeightSyncStub(channel)
                await expect_code(grpc.StatusCode.INVALID_ARGUMENT, stub.Publish(iter(stream)))

    run(main())


def test_weightsync_publish_errors_map_to_status(tmp_path: Path, grpc_serving: Serving) -> None:
    v0 = _weights(0)

    async def main() -> None:
        async with grpc_serving(_weightsync(tmp_path)) as address:
            await client.publish(address, 0, v0)
            async with grpc.aio.insecure_channel(address) as channel:
                stub = ws_grpc.WeightSyncStub(channel)
                # Re-publishing the same version with the same weights is accepted (a
                # trainer's replay); with other weights it is ALREADY_EXISTS.
                again = await stub.Publish(client.publish_requests(0, v0))
                assert again.version == 0
                await expect_code(grpc.StatusCode.ALREADY_EXISTS, stub.Publish(client.publish_requests(0, _nudged(v0, 1))))
                # A header hash that does not match the pieces: DATA_LOSS.
                requests = list(client.publish_requests(1, _nudged(v0, 1)))
                requests[0].header.weights_hash = weights_hash(v0)
                await expect_code(grpc.StatusCode.DATA_LOSS, stub.Publish(iter(requests)))
                # A different tensor set: INVALID_ARGUMENT.
                fewer = {"emb": v0["emb"]}
                await expect_code(grpc.StatusCode.INVALID_ARGUMENT, stub.Publish(client.publish_requests(1, fewer)))
                assert (await stub.Status(ws.WeightSyncStatusRequest())).latest_version == 0

    run(main())


def test_weightsync_get_manifest_missing_is_not_found(tmp_path: Path, grpc_serving: Serving) -> None:
    async def main() -> None:
        async with grpc_serving(_weightsync(tmp_path)) as address:
            async with grpc.aio.insecure_channel(address) as channel:
                stub = ws_grpc.WeightSyncStub(channel)
                await expect_code(grpc.StatusCode.NOT_FOUND, stub.GetManifest(ws.GetManifestRequest(version=-1)))
                await client.publish(address, 0, _weights(0))
                await expect_code(grpc.StatusCode.NOT_FOUND, stub.GetManifest(ws.GetManifestRequest(version=7)))
                assert (await stub.GetManifest(ws.GetManifestRequest(version=-1))).version == 0

    run(main())


def test_weightsync_fetch_chunk_outside_the_version_is_invalid_argument(tmp_path: Path, grpc_serving: Serving) -> None:
    """FetchChunk serves only chunks of the version's manifest: an index at or past the
    chunk count is INVALID_ARGUMENT (a bad request, not a chunk still to come: NOT_FOUND
    would have a subscriber wait for it), and the last chunk inside the bound is served."""
    v0 = _weights(0)
    v1 = _nudged(v0, 1)

    async def main() -> None:
        async with grpc_serving(_weightsync(tmp_path)) as address:
            await client.publish(address, 0, v0)
            await client.publish(address, 1, v1)
            async with grpc.aio.insecure_channel(address) as channel:
                stub = ws_grpc.WeightSyncStub(channel)
                manifest = await stub.GetManifest(ws.GetManifestRequest(version=1))
                count = len(manifest.chunks)
                assert count > 1
                for index in (count, count + 1):
                    details = await expect_code(
                        grpc.StatusCode.INVALID_ARGUMENT, stub.FetchChunk(ws.FetchChunkRequest(version=1, base_version=0, index=index))
                    )
                    assert f"chunk {index} is outside version 1" in details
                last = await stub.FetchChunk(ws.FetchChunkRequest(version=1, base_version=0, index=count - 1))
                assert (last.index, len(last.data)) == (count - 1, manifest.chunks[count - 1].size)
                status = await stub.Status(ws.WeightSyncStatusRequest())
                assert status.chunk_fetches == 1  # the refused requests sent nothing

    run(main())


def test_weightsync_subscribe_rejects_bad_from_version(tmp_path: Path, grpc_serving: Serving) -> None:
    async def main() -> None:
        async with grpc_serving(_weightsync(tmp_path)) as address:
            async with grpc.aio.insecure_channel(address) as channel:
                stub = ws_grpc.WeightSyncStub(channel)
                call = stub.Subscribe(ws.SubscribeRequest(from_version=-2))

                async def drain() -> None:
                    async for _ in call:
                        pass

                await expect_code(grpc.StatusCode.INVALID_ARGUMENT, drain())
                # Nothing published yet and no follow: an empty, successful stream.
                items = [x async for x in stub.Subscribe(ws.SubscribeRequest(from_version=-1, follow=False))]
                assert items == []

    run(main())


def test_weightsync_relay_refuses_publish(tmp_path: Path) -> None:
    # No start(): the relay's mirroring task is not needed to check the refusal.
    relay = WeightSyncService(WeightSyncConfig(role="relay", upstream="127.0.0.1:1", data_dir=str(tmp_path / "r")))

    async def main() -> None:
        server = grpc.aio.server(interceptors=[ErrorBoundary()])
        relay.register(server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = ws_grpc.WeightSyncStub(channel)
                await expect_code(grpc.StatusCode.FAILED_PRECONDITION, stub.Publish(client.publish_requests(0, _weights(0))))
        finally:
            await server.stop(None)
            await relay.stop()

    run(main())


# ---------------------------------------------------------------- envsandbox

SMALL_RECEIVE = [("grpc.max_receive_message_length", 1 * MiB)]


def _sandbox_service(tmp_path: Path) -> EnvSandboxService:
    return EnvSandboxService(EnvSandboxConfig(root=str(tmp_path / "sandboxes")))


async def _exec(stub: es_grpc.EnvSandboxStub, request: es.ExecRequest) -> tuple[bytes, bytes, es.ExecResult]:
    out, err, result = b"", b"", None
    async for chunk in stub.Exec(request):
        kind = chunk.WhichOneof("payload")
        if kind == "stdout":
            out += chunk.stdout
        elif kind == "stderr":
            err += chunk.stderr
        else:
            result = chunk.result
    assert result is not None
    return out, err, result


async def _still_answers(stub: es_grpc.EnvSandboxStub, sandbox_id: str) -> None:
    """A good request after a bad one: the service is unharmed."""
    reply = await stub.ReadFiles(es.ReadFilesRequest(sandbox_id=sandbox_id, paths=["solution.py"]))
    assert reply.files[0].content.startswith(b"def add")


def test_envsandbox_solve_task_and_errors(tmp_path: Path, grpc_serving: Serving) -> None:
    async def main() -> None:
        async with grpc_serving(_sandbox_service(tmp_path), options=SMALL_RECEIVE) as address:
            assert await check_health(address) == "SERVING"
            assert await check_health(address, "meridian.v1.EnvSandbox") == "SERVING"
            async with grpc.aio.insecure_channel(address) as channel:
                stub = es_grpc.EnvSandboxStub(channel)
                task = await stub.GetTask(es.GetTaskRequest(task_id="python/add"))
                info = await stub.Create(es.CreateRequest(task_id="python/add"))
                assert info.task_id == "python/add" and info.sandbox_id
                sid = info.sandbox_id
                solution = b"def add(a, b):\n    return a + b\n"
                await stub.WriteFiles(es.WriteFilesRequest(sandbox_id=sid, files=[es.File(path=task.answer_path, content=solution)]))
                result = await stub.RunTests(es.RunTestsRequest(sandbox_id=sid))
                assert result.reward == pytest.approx(1.0)
                assert result.tests and all(t.passed for t in result.tests)
                assert result.exec.exit_code == 0

                out, _, res = await _exec(stub, es.ExecRequest(sandbox_id=sid, argv=["python3", "-c", "print(6 * 7)"]))
                assert out == b"42\n" and res.exit_code == 0 and not res.timed_out

                # Unknown sandbox ids.
                ghost = "sbx-does-not-exist"
                await expect_code(grpc.StatusCode.NOT_FOUND, _exec(stub, es.ExecRequest(sandbox_id=ghost, argv=["true"])))
                await expect_code(grpc.StatusCode.NOT_FOUND, stub.ReadFiles(es.ReadFilesRequest(sandbox_id=ghost, paths=["a"])))
                await expect_code(grpc.StatusCode.NOT_FOUND, stub.Close(es.CloseRequest(sandbox_id=ghost)))
                await expect_code(grpc.StatusCode.NOT_FOUND, stub.RunTests(es.RunTestsRequest(sandbox_id=ghost)))
                await _still_answers(stub, sid)

                # Paths that leave the workspace.
                for path in ("../x", "/etc/passwd", "a/../../x"):
                    await expect_code(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        stub.WriteFiles(es.WriteFilesRequest(sandbox_id=sid, files=[es.File(path=path, content=b"x")])),
                    )
                await expect_code(grpc.StatusCode.INVALID_ARGUMENT, stub.ReadFiles(es.ReadFilesRequest(sandbox_id=sid, paths=["../x"])))
                await _still_answers(stub, sid)

                # Exec without a command.
                await expect_code(grpc.StatusCode.INVALID_ARGUMENT, _exec(stub, es.ExecRequest(sandbox_id=sid, argv=[])))
                await expect_code(grpc.StatusCode.INVALID_ARGUMENT, _exec(stub, es.ExecRequest(sandbox_id=sid, argv=[""])))
                await _still_answers(stub, sid)

                # A request over the server's receive limit is refused before any handler runs.
                big = es.File(path="big.bin", content=b"\0" * (2 * MiB))
                await expect_code(grpc.StatusCode.RESOURCE_EXHAUSTED, stub.WriteFiles(es.WriteFilesRequest(sandbox_id=sid, files=[big])))
                await _still_answers(stub, sid)

                # Unknown task, duplicate file: the boundary maps core errors too.
                await expect_code(grpc.StatusCode.NOT_FOUND, stub.Create(es.CreateRequest(task_id="no/such-task")))
                dup = [es.File(path="a", content=b"1"), es.File(path="a", content=b"2")]
                await expect_code(grpc.StatusCode.INVALID_ARGUMENT, stub.WriteFiles(es.WriteFilesRequest(sandbox_id=sid, files=dup)))
                await _still_answers(stub, sid)

                await stub.Close(es.CloseRequest(sandbox_id=sid))
                await expect_code(grpc.StatusCode.NOT_FOUND, stub.RunTests(es.RunTestsRequest(sandbox_id=sid)))
                assert list((await stub.List(es.ListRequest())).sandboxes) == []

    run(main())


def test_envsandbox_hostile_requests_get_clear_statuses(tmp_path: Path, grpc_serving: Serving) -> None:
    """Oversized arguments, loader variables and limits or lifetimes past the caps answer
    INVALID_ARGUMENT (not INTERNAL), and the service goes on serving."""

    async def main() -> None:
        async with grpc_serving(_sandbox_service(tmp_path)) as address:
            async with grpc.aio.insecure_channel(address) as channel:
                stub = es_grpc.EnvSandboxStub(channel)
                sid = (await stub.Create(es.CreateRequest(task_id="python/add", files=[es.File(path="solution.py", content=b"def add(a, b): pass\n")]))).sandbox_id
                invalid = grpc.StatusCode.INVALID_ARGUMENT
                for request in (
                    es.ExecRequest(sandbox_id=sid, argv=["echo", "x" * 300_000]),
                    es.ExecRequest(sandbox_id=sid, argv=["echo", *["y" * 1024] * 4000]),
                    es.ExecRequest(sandbox_id=sid, argv=["true"], env={"LD_PRELOAD": "/workspace/evil.so"}),
                    es.ExecRequest(sandbox_id=sid, argv=["true"], timeout_seconds=float("nan")),
                ):
                    await expect_code(invalid, _exec(stub, request))
                    await _still_answers(stub, sid)
                for create in (
                    es.CreateRequest(limits=es.Limits(memory_bytes=1 << 40)),
                    es.CreateRequest(limits=es.Limits(max_pids=10**6)),
                    es.CreateRequest(limits=es.Limits(cpus=64)),
                    es.CreateRequest(limits=es.Limits(wall_seconds=1e9)),
                    es.CreateRequest(limits=es.Limits(disk_bytes=1 << 40)),
                    es.CreateRequest(ttl_seconds=float("nan")),
                    es.CreateRequest(ttl_seconds=float("inf")),
                    es.CreateRequest(lease_seconds=float("nan")),
                    es.CreateRequest(lease_seconds=-1.0),
                    es.CreateRequest(lease_seconds=1e12),
                ):
                    await expect_code(invalid, stub.Create(create))
                assert [b.sandbox_id for b in (await stub.List(es.ListRequest())).sandboxes] == [sid]
                await _still_answers(stub, sid)

    run(main())


def test_envsandbox_wrong_solution_scores_zero(tmp_path: Path, grpc_serving: Serving) -> None:
    async def main() -> None:
        async with grpc_serving(_sandbox_service(tmp_path)) as address:
            async with grpc.aio.insecure_channel(address) as channel:
                stub = es_grpc.EnvSandboxStub(channel)
                wrong = es.File(path="solution.py", content=b"def add(a, b):\n    return a - b\n")
                info = await stub.Create(es.CreateRequest(task_id="python/add", files=[wrong]))
                result = await stub.RunTests(es.RunTestsRequest(sandbox_id=info.sandbox_id))
                # a - b fails all three cases (1, 2), (-4, 4) and (10, 5).
                assert result.reward == 0.0
                assert result.tests and not any(t.passed for t in result.tests)

    run(main())


def test_envsandbox_stop_removes_workspaces(tmp_path: Path, grpc_serving: Serving) -> None:
    service = _sandbox_service(tmp_path)

    async def main() -> None:
        async with grpc_serving(service) as address:
            async with grpc.aio.insecure_channel(address) as channel:
                stub = es_grpc.EnvSandboxStub(channel)
                await stub.Create(es.CreateRequest(task_id="python/add"))
                assert len((await stub.List(es.ListRequest())).sandboxes) == 1

    run(main())
    assert not (tmp_path / "sandboxes").exists() or not any((tmp_path / "sandboxes").iterdir())


# ---------------------------------------------------------------- ErrorBoundary


class ToyService:
    """A bytes-in, bytes-out service whose methods fail on purpose."""

    service_names = ("test.Toy",)

    def __init__(self, dead_address: str = "") -> None:
        self.secret = "secret-detail-must-not-leak"
        self.dead_address = dead_address  # a service this one calls, which is down

    def register(self, server: grpc.aio.Server) -> None:
        async def boom(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            raise RuntimeError(self.secret)

        async def missing(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            raise NotFound("no such thing: widget-9")

        async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            return request

        async def downstream(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            async with grpc.aio.insecure_channel(self.dead_address) as channel:
                return await channel.unary_unary("/test.Toy/Echo")(request, timeout=5)  # type: ignore[no-any-return]

        async def stream_boom(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
            yield b"one"
            raise KeyError(self.secret)

        async def stream_in_boom(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> bytes:
            async for _ in requests:
                pass
            raise ZeroDivisionError(self.secret)

        handlers: dict[str, grpc.RpcMethodHandler] = {
            "Boom": grpc.unary_unary_rpc_method_handler(boom),
            "Missing": grpc.unary_unary_rpc_method_handler(missing),
            "Echo": grpc.unary_unary_rpc_method_handler(echo),
            "Downstream": grpc.unary_unary_rpc_method_handler(downstream),
            "StreamBoom": grpc.unary_stream_rpc_method_handler(stream_boom),
            "StreamInBoom": grpc.stream_unary_rpc_method_handler(stream_in_boom),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Toy", handlers),))

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass


def test_error_boundary_hides_unexpected_errors(grpc_serving: Serving) -> None:
    toy = ToyService()

    async def main() -> None:
        async with grpc_serving(toy) as address:
            async with grpc.aio.insecure_channel(address) as channel:
                details = await expect_code(grpc.StatusCode.INTERNAL, channel.unary_unary("/test.Toy/Boom")(b"x"))
                assert "ref=" in details and toy.secret not in details and "RuntimeError" not in details

                # Each failure gets its own reference.
                again = await expect_code(grpc.StatusCode.INTERNAL, channel.unary_unary("/test.Toy/Boom")(b"x"))
                assert again != details

                call = channel.unary_stream("/test.Toy/StreamBoom")(b"x")
                got: list[bytes] = []

                async def drain() -> None:
                    async for item in call:
                        got.append(item)

                details = await expect_code(grpc.StatusCode.INTERNAL, drain())
                assert got == [b"one"]
                assert "ref=" in details and toy.secret not in details

                details = await expect_code(grpc.StatusCode.INTERNAL, channel.stream_unary("/test.Toy/StreamInBoom")(iter([b"a", b"b"])))
                assert "ref=" in details and toy.secret not in details

                assert await channel.unary_unary("/test.Toy/Echo")(b"still alive") == b"still alive"

    run(main())


def test_error_boundary_maps_meridian_errors_with_their_message(grpc_serving: Serving) -> None:
    async def main() -> None:
        async with grpc_serving(ToyService()) as address:
            async with grpc.aio.insecure_channel(address) as channel:
                details = await expect_code(grpc.StatusCode.NOT_FOUND, channel.unary_unary("/test.Toy/Missing")(b""))
                assert details == "no such thing: widget-9"
                await expect_code(grpc.StatusCode.UNIMPLEMENTED, channel.unary_unary("/test.Toy/Nope")(b""))

    run(main())


def test_error_boundary_answers_unavailable_when_a_service_it_calls_is_down(grpc_serving: Serving, pick_port: Callable[[], int]) -> None:
    """A dependency that is down (rollout's envsandbox restarting) is retryable for the
    caller: UNAVAILABLE naming it, not INTERNAL."""
    async def main() -> None:
        async with grpc_serving(ToyService(dead_address=f"127.0.0.1:{pick_port()}")) as address:
            async with grpc.aio.insecure_channel(address) as channel:
                details = await expect_code(grpc.StatusCode.UNAVAILABLE, channel.unary_unary("/test.Toy/Downstream")(b"x"))
                assert details.startswith("a service this call depends on answered UNAVAILABLE")

    run(main())


def test_check_health_reports_unreachable_for_closed_port(pick_port: Callable[[], int]) -> None:
    assert run(check_health(f"127.0.0.1:{pick_port()}", timeout_s=2.0)) == "UNREACHABLE"


def test_check_health_unknown_service_is_not_found(grpc_serving: Serving) -> None:
    async def main() -> None:
        async with grpc_serving(ToyService()) as address:
            assert await check_health(address, "test.Toy") == "SERVING"
            assert await check_health(address, "no.such.Service") == "NOT_FOUND"

    run(main())
