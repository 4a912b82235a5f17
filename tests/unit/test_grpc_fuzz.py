"""Every RPC of EnvSandbox (process backend) and WeightSync (an origin) under random and
mutated requests, over real in-process servers: each answer is a result or a clear status,
never INTERNAL/UNKNOWN (an exception that escaped a handler); after each request the
service still answers; and nothing it held before is lost (the sandboxes, their files, the
stored versions and their bytes)."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from meridian.tensors import RawTensor, weights_hash
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
from tests.grpc_fuzz import Finding, Fuzzer, fuzz, report, requests_for

REQUESTS_PER_METHOD = 60
CALL_TIMEOUT_S = 20.0  # a handler that takes longer on a request this small has stalled
PROBE_TIMEOUT_S = 10.0

# ---------------------------------------------------------------- envsandbox


def test_envsandbox_answers_every_random_request_and_keeps_what_it_held(tmp_path: Path, grpc_serving: Any) -> None:
    async def body() -> None:
        # A Create that finds the limit full waits at most a second here, within a call's time.
        service = EnvSandboxService(EnvSandboxConfig(root=str(tmp_path / "sandboxes"), max_sandboxes=32, max_create_wait_s=1.0))
        async with grpc_serving(service) as address, grpc.aio.insecure_channel(address) as channel:
            stub = es_grpc.EnvSandboxStub(channel)
            tasks = [t.id for t in (await stub.ListTasks(es.ListTasksRequest())).tasks]
            # A bystander the fuzzing never names: its file and its life must survive.
            bystander = (await stub.Create(es.CreateRequest(task_id="python/add"))).sandbox_id
            await stub.WriteFiles(es.WriteFilesRequest(sandbox_id=bystander, files=[es.File(path="keep.txt", content=b"kept")]))
            live = [(await stub.Create(es.CreateRequest(task_id=t))).sandbox_id for t in ("python/add", tasks[-1])]
            hints = {
                "sandbox_id": live, "sandbox_ids": live, "task_id": ["python/add", *tasks[:3]],
                "path": ["a.txt", "sub/b.py", "solution.py", "../a", "/etc/passwd", ".", "a/", "tests/x"],
                "paths": ["a.txt", "solution.py", "../a", "/proc/self/environ"],
                "argv": ["true", "sh", "-c", "echo hi; cat", "sleep", "0.2", "ls", "/"],
                "cwd": ["", ".", "sub", "../", "/tmp"],
                "count": [0, 1, 2, -1, 1000],
                "timeout_seconds": [0.0, 0.5, 2.0, -1.0],
                "fork_reserve": [0, 1, 2, 31, 32, 1000, 2**32 - 1], "wait_seconds": [0.0, 0.3, 5.0, -1.0, float("nan"), float("inf"), 1e300],
                "split": ["", "train", "eval"], "kind": ["", "python_function", "bugfix"],
            }
            valid: dict[str, Any] = {
                "ListTasks": es.ListTasksRequest(split="train"),
                "GetTask": es.GetTaskRequest(task_id="python/add"),
                "Create": es.CreateRequest(task_id="python/add", limits=es.Limits(memory_bytes=64 << 20), ttl_seconds=60, fork_reserve=1, wait_seconds=0.3),
                "Exec": es.ExecRequest(sandbox_id=live[0], argv=["sh", "-c", "echo hi"], timeout_seconds=5),
                "WriteFiles": es.WriteFilesRequest(sandbox_id=live[0], files=[es.File(path="a.txt", content=b"a")]),
                "ReadFiles": es.ReadFilesRequest(sandbox_id=live[0], paths=["a.txt"]),
                "Fork": es.ForkRequest(sandbox_id=live[0], count=1),
                "RunTests": es.RunTestsRequest(sandbox_id=live[0]),
                "Close": es.CloseRequest(sandbox_id=live[1]),
                "List": es.ListRequest(),
                "Renew": es.RenewRequest(sandbox_ids=live),
            }

            async def probe() -> None:
                await stub.List(es.ListRequest(), timeout=PROBE_TIMEOUT_S)

            findings: list[Finding] = []
            for method, seed_request in valid.items():
                requests = requests_for(seed_request, REQUESTS_PER_METHOD, hints)
                rpc = getattr(stub, method)
                await fuzz(f"EnvSandbox.{method}", lambda r, rpc=rpc: rpc(r, timeout=CALL_TIMEOUT_S), requests, probe, findings)
            assert not findings, report(findings)

            # Nothing it held was lost: the bystander lives and keeps its file.
            held = {s.sandbox_id for s in (await stub.List(es.ListRequest())).sandboxes}
            assert bystander in held
            read = await stub.ReadFiles(es.ReadFilesRequest(sandbox_id=bystander, paths=["keep.txt"]))
            assert [f.content for f in read.files] == [b"kept"]
            for sid in held:
                await stub.Close(es.CloseRequest(sandbox_id=sid))
            assert not (await stub.List(es.ListRequest())).sandboxes
            # No request, refused, timed out or cut off, kept a slot or a reserve.
            assert (service.sandboxes.slots.held, service.sandboxes.reserved, service.sandboxes.slots.waiting) == (0, 0, 0)

    asyncio.run(asyncio.wait_for(body(), 900))


# ---------------------------------------------------------------- weightsync


def _weights(seed: int) -> dict[str, RawTensor]:
    rng = np.random.default_rng(seed)
    return {
        "emb": RawTensor("bf16", (64, 8), rng.integers(0x3C00, 0x3F00, 512, dtype=np.uint16)),
        "bias": RawTensor("fp32", (7,), rng.normal(size=7).astype(np.float32).view(np.uint32)),
    }


async def _stream_call(rpc: Any, requests: list[Any]) -> Any:
    async def items() -> AsyncIterator[Any]:
        for r in requests:
            yield r

    return await rpc(items(), timeout=CALL_TIMEOUT_S)


@contextlib.asynccontextmanager
async def _origin(grpc_serving: Any, data_dir: Path) -> AsyncIterator[str]:
    async with grpc_serving(WeightSyncService(WeightSyncConfig(role="origin", data_dir=str(data_dir)))) as address:
        yield address


def test_weightsync_answers_every_random_request_and_keeps_its_versions(tmp_path: Path, grpc_serving: Any) -> None:
    v0, v1 = _weights(0), _weights(1)
    v1["emb"].bits[::7] += np.uint16(1)  # a sparse delta, like a training step's

    async def body() -> None:
        async with _origin(grpc_serving, tmp_path / "ws") as address, grpc.aio.insecure_channel(address) as channel:
            stub = ws_grpc.WeightSyncStub(channel)
            await client.publish(address, 0, v0)
            await client.publish(address, 1, v1)
            stored = {v: await client.manifest(address, v) for v in (0, 1)}
            v2 = _weights(2)
            valid_publish = list(client.publish_requests(2, v2))
            hints = {
                "version": [-1, 0, 1, 2, 3], "from_version": [-1, 0, 1], "base_version": [-1, 0, 1], "resume_version": [0, 1, 2],
                "resume_base": [-1, 0], "index": [0, 1, 2, 3], "name": ["emb", "bias", "x"], "offset": [0, 2, 512, 1024],
                "weights_hash": [weights_hash(v2), stored[1].weights_hash, ""], "part_count": [0, 1, 2], "part_index": [0, 1, 2],
                "part_tensors": ["emb", "bias"], "shape": [7, 64, 8, 0, -1],
            }
            findings: list[Finding] = []

            async def probe() -> None:
                await stub.Status(ws.WeightSyncStatusRequest(), timeout=PROBE_TIMEOUT_S)

            unary = {
                "GetManifest": ws.GetManifestRequest(version=1),
                "FetchChunk": ws.FetchChunkRequest(version=1, base_version=0, index=0),
                "Status": ws.WeightSyncStatusRequest(),
                "Subscribe": ws.SubscribeRequest(from_version=0),
            }
            for method, seed_request in unary.items():
                requests = requests_for(seed_request, REQUESTS_PER_METHOD, hints)
                for _, request in requests:
                    if method == "Subscribe":
                        request.follow = False  # a following stream stays open by design
                rpc = getattr(stub, method)
                await fuzz(f"WeightSync.{method}", lambda r, rpc=rpc: rpc(r, timeout=CALL_TIMEOUT_S), requests, probe, findings)

            # Publish: whole random streams, and the valid stream of version 2 with a few
            # fields changed, a message dropped or one repeated.
            streams = []
            for i in range(REQUESTS_PER_METHOD * 3):
                fuzzer = Fuzzer(seed=i, hints=hints)
                if i % 3 == 0:
                    stream = [fuzzer.message(ws.PublishRequest) for _ in range(fuzzer.rng.randint(0, 4))]
                else:
                    stream = list(valid_publish)
                    at = fuzzer.rng.randrange(len(stream))
                    edit = fuzzer.rng.choice(("mutate", "mutate", "drop", "repeat"))
                    if edit == "mutate":
                        stream[at] = fuzzer.mutate(stream[at], changes=1 + i % 2)
                    elif edit == "drop":
                        del stream[at]
                    else:
                        stream.insert(at, stream[at])
                streams.append((i, stream))
            await fuzz("WeightSync.Publish", lambda s: _stream_call(stub.Publish, s), streams, probe, findings)
            assert not findings, report(findings)

            # The versions it held are intact (same manifests), and what it serves now
            # rebuilds bit for bit: from nothing, and from version 0 through the deltas.
            for v, manifest in stored.items():
                assert await client.manifest(address, v) == manifest
            latest = await client.latest_version(address)
            for held, base in ((None, -1), (v0, 0)):
                updates = await _updates(address, held, base)
                assert updates and updates[-1].version == latest
                assert weights_hash(updates[-1].weights) == updates[-1].manifest.weights_hash
                if latest == 1:
                    assert weights_hash(updates[-1].weights) == weights_hash(v1)

    asyncio.run(asyncio.wait_for(body(), 900))


async def _updates(address: str, held: dict[str, RawTensor] | None, version: int) -> list[Any]:
    """What a subscriber holding ``held`` (``version``; -1: nothing) receives, not following."""
    sub = WeightSubscriber(address, held, version)
    try:
        return [u async for u in sub.updates(follow=False)]
    finally:
        await sub.close()
