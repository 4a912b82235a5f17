"""The process backend's file operations against what a sandbox can make of its workspace:
a folder chain thousands of levels deep neither blocks RunTests nor Fork, and bad paths
answer INVALID_ARGUMENT / NOT_FOUND (never INTERNAL, never RESOURCE_EXHAUSTED for a
name too long). Runs the real process backend, as tests/unit/test_sandbox_contract.py does."""
from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from meridian.errors import InvalidArgument, NotFound, Unavailable
from services.envsandbox import process_backend
from services.envsandbox.process_backend import ProcessBackend
from services.envsandbox.sandbox import Limits, SandboxManager, collect
from services.envsandbox.tasks import TaskSuite

DEPTH = 2000
LONG = "x" * 300


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[asyncio.AbstractEventLoop, SandboxManager]]:
    loop = asyncio.new_event_loop()
    manager = SandboxManager(
        ProcessBackend(tmp_path_factory.mktemp("process")),
        default_limits=Limits(memory_bytes=256 << 20, max_pids=64, disk_bytes=32 << 20, wall_seconds=20),
        max_sandboxes=4,
    )
    loop.run_until_complete(manager.start())
    try:
        yield loop, manager
    finally:
        loop.run_until_complete(manager.close_all())
        loop.close()


async def sh(m: SandboxManager, sid: str, script: str) -> bytes:
    out, err, res = await collect(m.exec(sid, ["sh", "-c", script], timeout_s=20))
    assert res.exit_code == 0, err
    return out


def deep_tree(top: str) -> str:
    """A shell line that makes ``top/a/a/...`` DEPTH levels deep, with a file at the bottom
    and a symlink to / halfway down."""
    return (
        f"python3 -c \"import os\nos.mkdir('{top}'); os.chdir('{top}')\nfor i in range({DEPTH}):\n"
        f"    os.mkdir('a'); os.chdir('a')\n    i == {DEPTH // 2} and os.symlink('/', 'root')\n"
        f"open('bottom.txt', 'w').write('deep')\""
    )


def test_run_tests_is_not_blocked_by_a_deep_tests_folder(env: tuple[asyncio.AbstractEventLoop, SandboxManager]) -> None:
    loop, m = env
    task = TaskSuite.builtin().get("python/add")

    async def main() -> None:
        box = await m.create(task=task, files={"solution.py": task.reference["solution.py"].encode()})
        try:
            await sh(m, box.sandbox_id, deep_tree(".tests"))
            for _ in range(2):
                outcome, _, output = await m.run_tests(box.sandbox_id)
                assert outcome.reward == 1.0, output
            assert b".tests" not in await sh(m, box.sandbox_id, "ls -A")
        finally:
            await m.close(box.sandbox_id)

    loop.run_until_complete(main())


def test_fork_copies_a_deep_tree(env: tuple[asyncio.AbstractEventLoop, SandboxManager]) -> None:
    loop, m = env
    bottom = "/".join(["deep", *["a"] * DEPTH, "bottom.txt"])

    async def main() -> None:
        box = await m.create(files={"top.txt": b"top"})
        try:
            await sh(m, box.sandbox_id, deep_tree("deep"))
            (copy,) = await m.fork(box.sandbox_id, 1)
            try:
                files = await m.read_files(copy.sandbox_id, ["top.txt", bottom])
                assert files == {"top.txt": b"top", bottom: b"deep"}
                link = "/".join(["deep", *["a"] * (DEPTH // 2 + 1), "root"])
                assert await sh(m, copy.sandbox_id, f"readlink {link}") == b"/\n"
            finally:
                await m.close(copy.sandbox_id)
        finally:
            await m.close(box.sandbox_id)

    loop.run_until_complete(main())


def test_bad_paths_answer_invalid_argument_or_not_found(env: tuple[asyncio.AbstractEventLoop, SandboxManager]) -> None:
    loop, m = env

    async def main() -> None:
        box = await m.create(files={"d/f.txt": b"f"})
        sid = box.sandbox_id
        try:
            await sh(m, sid, "python3 -c \"import socket; socket.socket(socket.AF_UNIX).bind('sock')\"; ln -s d link")
            for path in (LONG, f"{LONG}/f.txt", f"d/{LONG}", "sock", "link/f.txt", "d/f.txt/x"):
                with pytest.raises(InvalidArgument, match="sandbox|workspace|file|path"):
                    await m.read_files(sid, [path])
            with pytest.raises(NotFound):
                await m.read_files(sid, ["d/nope.txt"])
            for path in (LONG, f"{LONG}/f.txt", f"d/{LONG}"):
                with pytest.raises(InvalidArgument):
                    await m.write_files(sid, {path: b"x"})
            with pytest.raises(InvalidArgument):
                await collect(m.exec(sid, ["true"], cwd=f"d/{LONG}"))
            assert (await m.read_files(sid, ["d/f.txt"])) == {"d/f.txt": b"f"}
        finally:
            await m.close(sid)

    loop.run_until_complete(main())



def test_file_operations_leave_the_event_loop_free(env: tuple[asyncio.AbstractEventLoop, SandboxManager], monkeypatch: pytest.MonkeyPatch) -> None:
    """A big tree is walked in a worker thread, not on the event loop that serves every call."""
    loop, m = env
    import threading

    from services.envsandbox import workspace_files

    threads: list[str] = []
    real = workspace_files.copy_tree, workspace_files.remove_tree, workspace_files.read_file, workspace_files.write_file

    def spy(fn):  # type: ignore[no-untyped-def]
        def wrapped(*a, **k):  # type: ignore[no-untyped-def]
            threads.append(threading.current_thread().name)
            return fn(*a, **k)

        return wrapped

    for fn in real:
        monkeypatch.setattr(workspace_files, fn.__name__, spy(fn))

    async def main() -> None:
        box = await m.create(files={"f.txt": b"f"})
        try:
            await m.read_files(box.sandbox_id, ["f.txt"])
            (copy,) = await m.fork(box.sandbox_id, 1)
            await m.close(copy.sandbox_id)
            await m.backend.remove(box.sandbox_id, "f.txt")
        finally:
            await m.close(box.sandbox_id)

    loop.run_until_complete(main())
    assert len(threads) >= 4 and threading.main_thread().name not in threads



def _copies_through(monkeypatch: pytest.MonkeyPatch, before_each: Callable[[], None], before_all: Callable[[], None] = lambda: None) -> threading.Event:
    """Fork's copies run ``before_all`` first, then ``before_each`` before each entry (the
    copy's own check after it); returns an event set when the last copy ended."""
    from services.envsandbox import workspace_files

    real = workspace_files.copy_tree
    ended = threading.Event()

    def copy_tree(src: int, dst: int, owner: Any = None, check: Callable[[], None] | None = None) -> None:
        def each() -> None:
            before_each()
            if check is not None:
                check()

        ended.clear()
        try:
            before_all()
            real(src, dst, owner, each)
        finally:
            ended.set()

    monkeypatch.setattr(workspace_files, "copy_tree", copy_tree)
    return ended


def test_a_fork_past_its_time_is_unavailable_and_leaves_nothing(env: tuple[asyncio.AbstractEventLoop, SandboxManager], monkeypatch: pytest.MonkeyPatch) -> None:
    loop, m = env
    monkeypatch.setattr(process_backend, "COPY_WALL_S", 0.5)
    _copies_through(monkeypatch, lambda: time.sleep(0.01))

    async def main() -> None:
        box = await m.create(files={f"f{i}.txt": b"x" for i in range(200)})
        try:
            with pytest.raises(Unavailable, match="took more than"):
                await m.fork(box.sandbox_id, 1)
            assert [b.sandbox_id for b in m.list()] == [box.sandbox_id]
            assert (await m.read_files(box.sandbox_id, ["f199.txt"]))["f199.txt"] == b"x"
        finally:
            await m.close(box.sandbox_id)

    loop.run_until_complete(main())


def test_a_cancelled_fork_stops_its_copy_before_it_returns(env: tuple[asyncio.AbstractEventLoop, SandboxManager], monkeypatch: pytest.MonkeyPatch) -> None:
    """A Fork whose caller went away: the copy thread has stopped by the time the cancel
    is through, so nothing writes into the copy the manager then removes."""
    loop, m = env
    started = threading.Event()
    ended = _copies_through(monkeypatch, lambda: (started.set(), time.sleep(0.01)))

    async def main() -> None:
        box = await m.create(files={f"f{i}.txt": b"x" for i in range(500)})
        try:
            fork = asyncio.ensure_future(m.fork(box.sandbox_id, 1))
            assert await asyncio.to_thread(started.wait, 20)
            fork.cancel()
            with pytest.raises(asyncio.CancelledError):
                await fork
            assert ended.is_set(), "the copy went on after its Fork was cancelled"
            assert [b.sandbox_id for b in m.list()] == [box.sandbox_id]
        finally:
            await m.close(box.sandbox_id)

    loop.run_until_complete(main())


def test_blocked_copies_leave_the_default_executor_free(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight copies that cannot go on (more than the default executor's threads on a small
    machine) do not stop work that needs that executor (file operations, exec kills)."""
    release = threading.Event()
    _copies_through(monkeypatch, lambda: None, before_all=lambda: release.wait(30))
    manager = SandboxManager(ProcessBackend(tmp_path / "process"), default_limits=Limits(memory_bytes=256 << 20, max_pids=64, disk_bytes=8 << 20), max_sandboxes=10)

    async def main() -> None:
        await manager.start()
        try:
            box = await manager.create(files={"f.txt": b"f"})
            fork = asyncio.ensure_future(manager.fork(box.sandbox_id, 8))
            await asyncio.sleep(0.5)
            try:
                assert await asyncio.wait_for(asyncio.to_thread(lambda: "free"), 10) == "free"
                assert await asyncio.wait_for(manager.read_files(box.sandbox_id, ["f.txt"]), 10) == {"f.txt": b"f"}
            finally:
                release.set()
            assert len(await fork) == 8
        finally:
            release.set()
            await manager.close_all()

    asyncio.run(main())

def test_the_service_answers_clear_statuses_for_bad_paths_and_deep_trees(tmp_path: Path, grpc_serving: Any) -> None:
    """Through the real gRPC service: bad paths answer INVALID_ARGUMENT (not INTERNAL, not
    RESOURCE_EXHAUSTED), and a deep .tests folder neither fails RunTests nor Fork."""
    import grpc

    from meridian.v1 import envsandbox_pb2 as es
    from meridian.v1 import envsandbox_pb2_grpc as es_grpc
    from services.envsandbox.config import EnvSandboxConfig
    from services.envsandbox.server import EnvSandboxService

    async def code_of(call: Any) -> grpc.StatusCode:
        try:
            await call
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK

    async def exec_code(stub: es_grpc.EnvSandboxStub, request: es.ExecRequest) -> grpc.StatusCode:
        async def drain() -> None:
            async for _ in stub.Exec(request):
                pass

        return await code_of(drain())

    async def main() -> None:
        async with grpc_serving(EnvSandboxService(EnvSandboxConfig(root=str(tmp_path / "sandboxes")))) as address:
            async with grpc.aio.insecure_channel(address) as channel:
                stub = es_grpc.EnvSandboxStub(channel)
                solution = TaskSuite.builtin().get("python/add").reference["solution.py"].encode()
                sid = (await stub.Create(es.CreateRequest(task_id="python/add", files=[es.File(path="solution.py", content=solution)]))).sandbox_id
                setup = es.ExecRequest(sandbox_id=sid, argv=["sh", "-c", deep_tree(".tests") + "; python3 -c \"import socket; socket.socket(socket.AF_UNIX).bind('sock')\""])
                assert await exec_code(stub, setup) == grpc.StatusCode.OK
                invalid = grpc.StatusCode.INVALID_ARGUMENT
                for path in (LONG, f"{LONG}/f.txt", "sock"):
                    assert await code_of(stub.ReadFiles(es.ReadFilesRequest(sandbox_id=sid, paths=[path]))) == invalid
                    assert await code_of(stub.WriteFiles(es.WriteFilesRequest(sandbox_id=sid, files=[es.File(path=f"{path}/x", content=b"x")]))) == invalid
                assert await exec_code(stub, es.ExecRequest(sandbox_id=sid, argv=["true"], cwd=LONG)) == invalid
                fork = await stub.Fork(es.ForkRequest(sandbox_id=sid, count=1))
                reply = await stub.RunTests(es.RunTestsRequest(sandbox_id=sid))
                assert reply.reward == 1.0
                for box in [sid, *(b.sandbox_id for b in fork.sandboxes)]:
                    await stub.Close(es.CloseRequest(sandbox_id=box))

    asyncio.run(asyncio.wait_for(main(), 120))
