"""One contract, two backends: the process backend and the Docker backend (a private,
real dockerd started here) must behave the same, also under hostile input.

Docker tests are skipped only when dockerd is not installed; with dockerd present they run
(a failing daemon start is an error, not a skip).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import json
import os
import shutil
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from meridian.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from meridian.v1 import envsandbox_pb2 as es
from meridian.v1 import envsandbox_pb2_grpc as es_grpc
from services.envsandbox.config import EnvSandboxConfig
from services.envsandbox.sandbox import Backend, ExecResult, Limits, SandboxManager, collect
from services.envsandbox.server import EnvSandboxService
from services.envsandbox.tasks import Task, TaskSuite
from tests.unit.test_grpc_services import expect_code

BACKENDS = ["process", pytest.param("docker", marks=pytest.mark.docker)]
SECRET_ENV = "MERIDIAN_TEST_SERVICE_SECRET"


@pytest.fixture(scope="module")
def dockerd_url() -> Iterator[str]:
    if shutil.which("dockerd") is None:
        pytest.skip("dockerd is not installed (apt package docker.io): docker backend not tested")
    from benchmarks.support.dockerd import private_dockerd

    with private_dockerd() as daemon:
        yield daemon.base_url


class Loop:
    """One event loop per backend for the whole module (sandboxes outlive single tests)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()

    def run(self, coro):  # type: ignore[no-untyped-def]
        return self.loop.run_until_complete(coro)

    def close(self) -> None:
        self.loop.close()


@pytest.fixture(scope="module", params=BACKENDS)
def env(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Loop, SandboxManager]]:
    root = tmp_path_factory.mktemp(request.param)
    backend: Backend
    if request.param == "docker":
        url = request.getfixturevalue("dockerd_url")
        from services.envsandbox.docker_backend import DockerBackend

        backend = DockerBackend(root, base_url=url)
    else:
        from services.envsandbox.process_backend import ProcessBackend

        backend = ProcessBackend(root)
    loop = Loop()
    # Four: the two of `pair` live on while a test forks a sandbox of its own.
    manager = SandboxManager(backend, default_limits=Limits(memory_bytes=256 << 20, max_pids=64, disk_bytes=32 << 20, wall_seconds=10), max_sandboxes=4)
    loop.run(manager.start())
    try:
        yield loop, manager
    finally:
        loop.run(manager.close_all())
        loop.close()


@pytest.fixture(autouse=True)
def _no_sandbox_left(env: tuple[Loop, SandboxManager]) -> Iterator[None]:
    """Each test closes what it made: the module shares one manager of four slots, so
    sandboxes a failed test left would fail every later test that makes one (a full suite
    once saw seven more failures after one). Any left are closed here, and a test that
    left some fails for it."""
    loop, m = env
    before = {b.sandbox_id for b in m.list()}
    yield
    left = [b.sandbox_id for b in m.list() if b.sandbox_id not in before]
    for sid in left:
        with contextlib.suppress(NotFound):
            loop.run(m.close(sid))
    assert not left, f"the test left sandboxes open: {left}"


async def run(manager: SandboxManager, sid: str, argv: list[str], **kw: object) -> tuple[bytes, bytes, ExecResult]:
    return await collect(manager.exec(sid, argv, **kw))  # type: ignore[arg-type]


def sh(manager: SandboxManager, sid: str, script: str, **kw: object):  # type: ignore[no-untyped-def]
    return run(manager, sid, ["sh", "-c", script], **kw)


# ------------------------------------------------------------------ contract


def test_lifecycle_files_exec_and_close(env: tuple[Loop, SandboxManager]) -> None:
    loop, m = env

    async def main() -> None:
        box = await m.create(files={"a.txt": b"alpha", "dir/b.txt": b"beta"}, client_request_id="req-1")
        again = await m.create(client_request_id="req-1")
        assert again.sandbox_id == box.sandbox_id
        sid = box.sandbox_id
        assert sid in [b.sandbox_id for b in m.list()]

        out, err, res = await run(m, sid, ["sh", "-c", "cat a.txt dir/b.txt; echo oops >&2; read x; echo got=$x; echo $FOO; pwd; exit 3"], stdin=b"line\n", env={"FOO": "bar"})
        assert out == b"alphabetagot=line\nbar\n/workspace\n" and err == b"oops\n"
        assert res.exit_code == 3 and res.signal == 0 and not res.timed_out

        out, _, res = await run(m, sid, ["pwd"], cwd="dir")
        assert out == b"/workspace/dir\n" and res.exit_code == 0
        _, _, res = await run(m, sid, ["id", "-u"])
        out, _, _ = await run(m, sid, ["id", "-u"])
        assert out.strip() != b"0", "commands must not run as root"

        await sh(m, sid, "echo made > made.txt")
        await m.write_files(sid, {"dir/c.txt": b"gamma"})
        files = await m.read_files(sid, ["made.txt", "dir/c.txt"])
        assert files == {"made.txt": b"made\n", "dir/c.txt": b"gamma"}
        with pytest.raises(NotFound):
            await m.read_files(sid, ["nope.txt"])
        with pytest.raises(InvalidArgument):
            await run(m, sid, ["true"], cwd="../x")

        out, _, res = await run(m, sid, ["sh", "-c", "head -c 300000 /dev/zero"], timeout_s=5)
        assert len(out) == 300000 and not res.stdout_truncated

        copies = await m.fork(sid, 2)
        for copy in copies:
            assert (await m.read_files(copy.sandbox_id, ["dir/c.txt"]))["dir/c.txt"] == b"gamma"
        await sh(m, copies[0].sandbox_id, "echo changed > a.txt")
        assert (await m.read_files(copies[1].sandbox_id, ["a.txt"]))["a.txt"] == b"alpha"
        assert (await m.read_files(sid, ["a.txt"]))["a.txt"] == b"alpha"

        for b in [box, *copies]:
            await m.close(b.sandbox_id)
        with pytest.raises(NotFound):
            await run(m, sid, ["true"])
        assert await m.backend.leftovers() == []

    loop.run(main())


@pytest.mark.parametrize("first_call", ["finishes", "is_cancelled"])
def test_a_retried_create_answers_with_a_sandbox_that_is_ready(env: tuple[Loop, SandboxManager], first_call: str) -> None:
    """A retry of a Create (the same request id) that comes while the first call is still
    making the sandbox waits for that call: it answers with the first's sandbox once it is
    made, files and all, or, if the first call is cancelled (its client's deadline passed,
    the usual reason to retry), makes one of its own. It never answers with a sandbox that
    is not made yet or is already gone, and the cancelled call leaves the backend sound."""
    loop, m = env
    request_id = f"req-retried-{first_call}"
    # Writing them keeps the first call at work; the last one written shows it finished.
    files = {f"part-{i}.bin": os.urandom(1 << 20) for i in range(16)}

    async def main() -> None:
        held = m.slots.held
        first = asyncio.ensure_future(m.create(files=files, client_request_id=request_id))
        while m.slots.held == held and not first.done():  # until it has registered its sandbox
            await asyncio.sleep(0)
        retry = asyncio.ensure_future(m.create(files=files, client_request_id=request_id))
        await asyncio.sleep(0)  # the retry reaches the manager while the first is at work
        assert not first.done()
        if first_call == "is_cancelled":
            first.cancel()
        box = await retry
        assert await m.read_files(box.sandbox_id, ["part-15.bin"]) == {"part-15.bin": files["part-15.bin"]}
        if first_call == "finishes":
            assert (await first).sandbox_id == box.sandbox_id
        else:
            with pytest.raises(asyncio.CancelledError):
                await first
        assert [b.sandbox_id for b in m.list() if b.client_request_id == request_id] == [box.sandbox_id]
        await m.close(box.sandbox_id)
        # The backend still answers in step (a cancelled call must not leave it a reply behind).
        assert m.slots.held == held and await m.backend.leftovers() == []

    loop.run(main())


def test_a_close_whose_caller_goes_away_still_tears_the_sandbox_down(env: tuple[Loop, SandboxManager]) -> None:
    """A Close cancelled mid-teardown (its client's deadline passed) does not stop the
    teardown: the command still running is killed, nothing of the sandbox is left in the
    backend, and its slot comes back once that is done."""
    loop, m = env

    async def main() -> None:
        held = m.slots.held
        box = await m.create()
        sid = box.sandbox_id
        sleeper = asyncio.ensure_future(sh(m, sid, "echo up; exec sleep 60"))
        while box.execs == 0:  # the teardown has a process to kill and wait for
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        closing = asyncio.ensure_future(m.close(sid))
        await asyncio.sleep(0)  # into the teardown
        closing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closing
        for _ in range(3000):
            if m.slots.held == held:
                break
            await asyncio.sleep(0.01)
        assert m.slots.held == held, "the slot never came back: the teardown stopped"
        _, _, res = await asyncio.wait_for(sleeper, 30)
        assert res.signal == 9 or res.exit_code != 0, res
        with pytest.raises(NotFound):  # the backend let go of it
            await m.backend.read_files(sid, ["x"], 1)
        assert await m.backend.leftovers() == []

    loop.run(main())


def test_read_files_has_a_total_cap(env: tuple[Loop, SandboxManager], monkeypatch: pytest.MonkeyPatch) -> None:
    """One ReadFiles answers at most MAX_READ_TOTAL_BYTES of contents and paths on every
    backend (INVALID_ARGUMENT naming the path past it, nothing read beyond), so an answer
    always fits a gRPC message; a file named twice is read and counted once."""
    from services.envsandbox import workspace_files

    loop, m = env
    monkeypatch.setattr(workspace_files, "MAX_READ_TOTAL_BYTES", 1000)
    sid = loop.run(m.create(files={f"f{i}.txt": b"x" * 300 for i in range(5)})).sandbox_id
    try:
        three = [f"f{i}.txt" for i in range(3)]
        assert loop.run(m.read_files(sid, three)) == {p: b"x" * 300 for p in three}
        assert loop.run(m.read_files(sid, ["f0.txt"] * 50)) == {"f0.txt": b"x" * 300}
        with pytest.raises(InvalidArgument, match=r"more than 1000 bytes in all \(at 'f3.txt'\)"):
            loop.run(m.read_files(sid, [f"f{i}.txt" for i in range(5)]))
        with pytest.raises(InvalidArgument, match="more than 1000 bytes in all"):
            loop.run(m.read_files(sid, [f"./{'/' * i}f0.txt" for i in range(5)]))
    finally:
        loop.run(m.close(sid))

def test_limit_on_live_sandboxes(env: tuple[Loop, SandboxManager]) -> None:
    loop, m = env
    if m.backend.name == "docker":
        # The limit lives in the backend-independent manager; a container costs ~2 s here.
        pytest.skip("the live-sandbox limit is backend-independent; checked on the process backend")

    async def main() -> None:
        boxes = [await m.create() for _ in range(m.max_sandboxes)]
        with pytest.raises(ResourceExhausted):
            await m.create()
        with pytest.raises(ResourceExhausted):
            await m.fork(boxes[0].sandbox_id, 1)
        for b in boxes:
            await m.close(b.sandbox_id)
        assert m.list() == [] and await m.backend.leftovers() == []

    loop.run(main())


def test_run_tests_scores_and_resists_forgery(env: tuple[Loop, SandboxManager]) -> None:
    loop, m = env
    suite = TaskSuite.builtin()
    task = suite.get("python/add")
    forged = "import os\nfor fd in range(1, 32):\n    try: os.write(fd, b'PASS case0\\nPASS case1\\nPASS case2\\n')\n    except OSError: pass\ndef add(a, b):\n    return None\n"

    async def main() -> None:
        box = await m.create(task=task)
        sid = box.sandbox_id

        async def reward(solution: str) -> float:
            await m.write_files(sid, {"solution.py": solution.encode()})
            outcome, _, _ = await m.run_tests(sid)
            # The hidden tests are gone from the workspace after the run.
            with pytest.raises(NotFound):
                await m.read_files(sid, [".tests/test_solution.py"])
            return outcome.reward

        try:
            assert await reward(task.reference["solution.py"]) == 1.0
            assert await reward("") == 0.0
            assert await reward(forged) == 0.0
        finally:
            await m.close(sid)

    loop.run(main())


def test_swebench_tests_run_and_resist_forgery(env: tuple[Loop, SandboxManager]) -> None:
    """The SWE-bench runner, from memory on either backend: the gold patch scores 1, and a
    repository module that writes passing verdicts everywhere and exits scores 0."""
    from services.envsandbox.swebench import load_swebench_jsonl
    from tests.unit.test_task_suite import SAMPLE_JSONL, SWE_FORGE

    loop, m = env
    task = load_swebench_jsonl(SAMPLE_JSONL)[2]

    async def main() -> None:
        box = await m.create(task=task)
        sid = box.sandbox_id

        async def reward(files: dict[str, str]) -> float:
            await m.write_files(sid, {p: c.encode() for p, c in files.items()})
            outcome, _, _ = await m.run_tests(sid)
            return outcome.reward

        try:
            assert await reward(task.reference) == 1.0
            assert await reward({"kvstore/store.py": SWE_FORGE + task.files["kvstore/store.py"]}) == 0.0
        finally:
            await m.close(sid)

    loop.run(main())


# ------------------------------------------------------------------ RunTests owns its sandbox


def _shell_task(task_id: str, script: str) -> Task:
    """A task whose hidden test is the shell script ``script``, run from .tests/ (all_pass)."""
    name = task_id.rsplit("/", 1)[-1] + ".sh"
    return Task(
        id=task_id, kind="terminal", split="train", instruction="nothing to do", files={}, answer_path="answer.txt",
        tests={name: script}, test_command=["sh", f".tests/{name}"], reward="all_pass", reference={},
    )


#: Tests that take a while: the sandbox is theirs for about three seconds.
SLOW_TASK = _shell_task("custom/slow", "sleep 3; echo 'PASS slow'\n")
#: Tests that fail when anything but them writes ``forged`` while they run.
ALONE_TASK = _shell_task(
    "custom/alone",
    "rm -f forged\ni=0\nwhile [ $i -lt 10 ]; do\n  sleep 0.05\n"
    "  if [ -e forged ]; then echo 'FAIL alone: a process runs beside the tests'; exit 0; fi\n"
    "  i=$((i+1))\ndone\necho 'PASS alone'\n",
)


class _Served(EnvSandboxService):
    """The gRPC service over the module's manager (whose backend the module fixture starts
    and stops: this service's start and stop leave it alone), offering ``tasks``."""

    def __init__(self, manager: SandboxManager, tasks: list[Task], root: Path) -> None:
        super().__init__(EnvSandboxConfig(root=str(root)))
        self.sandboxes = manager
        self.suite = TaskSuite(tasks)

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass


async def _grpc_exec(stub: es_grpc.EnvSandboxStub, request: es.ExecRequest) -> es.ExecResult:
    result = None
    async for chunk in stub.Exec(request):
        if chunk.WhichOneof("payload") == "result":
            result = chunk.result
    assert result is not None
    return result


def test_run_tests_owns_its_sandbox_while_it_runs(env: tuple[Loop, SandboxManager], grpc_serving: Any, tmp_path: Path) -> None:
    """While RunTests runs, every call that could run code in its sandbox, change its files
    or read or copy them (the hidden tests are there) answers FAILED_PRECONDITION naming the
    sandbox, and none of them has any effect; once it returned they work again. Close does
    not wait for the tests: it closes the sandbox, and RunTests answers NOT_FOUND."""
    loop, m = env

    async def main() -> None:
        async with grpc_serving(_Served(m, [SLOW_TASK], tmp_path)) as address, grpc.aio.insecure_channel(address) as channel:
            stub = es_grpc.EnvSandboxStub(channel)
            sid = (await stub.Create(es.CreateRequest(task_id=SLOW_TASK.id, files=[es.File(path="a.txt", content=b"before")]))).sandbox_id
            tests: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            try:
                tests = asyncio.ensure_future(stub.RunTests(es.RunTestsRequest(sandbox_id=sid)))
                await asyncio.sleep(1.0)
                refused: dict[str, Callable[[], Awaitable[Any]]] = {
                    "Exec": lambda: _grpc_exec(stub, es.ExecRequest(sandbox_id=sid, argv=["sh", "-c", "echo exec > a.txt"])),
                    "WriteFiles": lambda: stub.WriteFiles(es.WriteFilesRequest(sandbox_id=sid, files=[es.File(path="a.txt", content=b"written")])),
                    "ReadFiles": lambda: stub.ReadFiles(es.ReadFilesRequest(sandbox_id=sid, paths=[".tests/slow.sh"])),
                    "Fork": lambda: stub.Fork(es.ForkRequest(sandbox_id=sid, count=1)),
                    "RunTests": lambda: stub.RunTests(es.RunTestsRequest(sandbox_id=sid)),
                }
                for name, call in refused.items():
                    details = await expect_code(grpc.StatusCode.FAILED_PRECONDITION, call())
                    assert sid in details and "tests are running" in details, (name, details)
                assert not tests.done(), "the tests ended before every call was tried"
                assert list((await stub.Renew(es.RenewRequest(sandbox_ids=[sid]))).gone) == []
                assert sid in [b.sandbox_id for b in (await stub.List(es.ListRequest())).sandboxes]
                answer = await tests
                assert answer.reward == 1.0, answer.output
                assert len((await stub.List(es.ListRequest())).sandboxes) == len(m.list()), "a refused Fork made a sandbox"

                # Nothing of the refused calls happened, and they all work again.
                reply = await stub.ReadFiles(es.ReadFilesRequest(sandbox_id=sid, paths=["a.txt"]))
                assert reply.files[0].content == b"before"
                await stub.WriteFiles(es.WriteFilesRequest(sandbox_id=sid, files=[es.File(path="a.txt", content=b"written")]))
                result = await _grpc_exec(stub, es.ExecRequest(sandbox_id=sid, argv=["sh", "-c", "test \"$(cat a.txt)\" = written"]))
                assert result.exit_code == 0 and result.signal == 0
                copies = (await stub.Fork(es.ForkRequest(sandbox_id=sid, count=1))).sandboxes
                await stub.Close(es.CloseRequest(sandbox_id=copies[0].sandbox_id))

                # Close during the tests closes at once; RunTests then answers NOT_FOUND.
                tests = asyncio.ensure_future(stub.RunTests(es.RunTestsRequest(sandbox_id=sid)))
                await asyncio.sleep(1.0)
                assert not tests.done()
                await asyncio.wait_for(stub.Close(es.CloseRequest(sandbox_id=sid)), 2.5)
                details = await expect_code(grpc.StatusCode.NOT_FOUND, tests)
                assert sid in details and "closed while its tests ran" in details, details
                assert sid not in [b.sandbox_id for b in (await stub.List(es.ListRequest())).sandboxes]
                assert await m.backend.leftovers() == []
            finally:
                tests.cancel()
                if sid in [b.sandbox_id for b in m.list()]:
                    await m.close(sid)

    loop.run(main())


def test_an_exec_racing_run_tests_never_runs_beside_the_tests(env: tuple[Loop, SandboxManager], grpc_serving: Any, tmp_path: Path) -> None:
    """An Exec sent just before RunTests (it passed its checks, its process may not have
    started when RunTests kills the sandbox's processes) never runs beside the tests: a
    command that keeps writing the file the tests watch for, sent at offsets around
    RunTests' start, is refused or killed, and the tests always see nothing."""
    loop, m = env
    forge = ["sh", "-c", "while :; do : > forged; sleep 0.005; done"]

    async def main() -> None:
        async with grpc_serving(_Served(m, [ALONE_TASK], tmp_path)) as address, grpc.aio.insecure_channel(address) as channel:
            stub = es_grpc.EnvSandboxStub(channel)
            sid = (await stub.Create(es.CreateRequest(task_id=ALONE_TASK.id))).sandbox_id
            racer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            try:
                for delay in (0.0, 0.001, 0.002, 0.003, 0.005, 0.008, 0.012, 0.016, 0.024, 0.032, 0.05):
                    racer = asyncio.ensure_future(_grpc_exec(stub, es.ExecRequest(sandbox_id=sid, argv=forge, timeout_seconds=8)))
                    await asyncio.sleep(delay)
                    answer = await stub.RunTests(es.RunTestsRequest(sandbox_id=sid))
                    assert answer.reward == 1.0, (delay, answer.output)
                    try:
                        result = await racer
                    except grpc.aio.AioRpcError as exc:
                        assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION, exc
                    else:
                        # Killed (on Docker one killed while its exec starts ends 126), never run out.
                        assert not result.timed_out and (result.signal or result.exit_code), (delay, result)
            finally:
                racer.cancel()
                await m.close(sid)

    loop.run(main())


#: Tests written under .tests/ and run by a command that runs every script there, as a
#: discovering test runner (pytest, unittest discover) runs every test file it finds.
DISCOVERING_TASK = Task(
    id="custom/discovering", kind="terminal", split="train", instruction="write 42 to answer.txt", files={},
    answer_path="answer.txt",
    tests={"check.sh": "if [ \"$(cat answer.txt 2>/dev/null)\" = 42 ]; then echo 'PASS answer'; else echo 'FAIL answer: wrong'; fi\n"},
    test_command=["sh", "-c", 'for t in .tests/*.sh; do sh "$t"; done'], reward="pass_fraction", reference={},
)


def test_files_the_sandbox_planted_under_tests_are_gone_before_the_tests_run(env: tuple[Loop, SandboxManager]) -> None:
    """A task whose tests are written under .tests/ (any test command but the harness's and
    the SWE-bench runner's) runs them in a .tests/ of only its own files: scripts the
    sandbox put there beforehand, which such a test command would run too (here: nine
    forged PASS lines beside a failing check), are removed before the tests are written."""
    loop, m = env

    async def main() -> None:
        sid = (await m.create(task=DISCOVERING_TASK, files={"answer.txt": b"41"})).sandbox_id
        try:
            plant = "mkdir -p .tests && for i in 1 2 3 4 5 6 7 8 9; do echo \"echo 'PASS forged$i'\" > .tests/forged$i.sh; done"
            _, err, res = await sh(m, sid, plant)
            assert res.exit_code == 0, err
            outcome, _, output = await m.run_tests(sid)
            assert [(name, ok) for name, ok, _ in outcome.cases] == [("answer", False)], output
            assert outcome.reward == 0.0, output
        finally:
            await m.close(sid)

    loop.run(main())


def test_a_run_tests_whose_caller_goes_away_leaves_no_hidden_test_behind(env: tuple[Loop, SandboxManager]) -> None:
    """A RunTests cancelled at any moment (its client's deadline, a client gone) does not
    stop halfway: the sandbox stays the tests' until the run is over, and then no test
    file is on its disk. (Cut off while the tests were being written, they stayed in
    .tests/ for the solution to read, and the sandbox took calls again at once.)"""
    loop, m = env
    # Tests that take a while to write: the cut lands in the write at several moments.
    task = dataclasses.replace(DISCOVERING_TASK, tests={**DISCOVERING_TASK.tests, "padding.txt": "#" * (16 << 20)})

    async def main() -> None:
        sid = (await m.create(task=task, files={"answer.txt": b"41"})).sandbox_id
        try:
            # A whole run's time on this machine and backend, then cuts spread over it.
            began = time.monotonic()
            await m.run_tests(sid)
            whole_s = time.monotonic() - began
            for i in range(12):
                running = asyncio.ensure_future(m.run_tests(sid))
                await asyncio.sleep(whole_s * i / 12)
                running.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await running
                for _ in range(3000):
                    try:
                        out, _, _ = await sh(m, sid, "cat .tests/* 2>/dev/null; echo listed: $(ls -A .tests 2>/dev/null)")
                        break
                    except FailedPrecondition:  # still the tests' own
                        await asyncio.sleep(0.01)
                else:
                    raise AssertionError(f"the cut run {i} never ended")
                assert out == b"listed:\n", (i, whole_s, out[-200:])
        finally:
            await m.close(sid)

    loop.run(main())


def test_a_command_whose_caller_stopped_reading_does_not_run_beside_the_tests(env: tuple[Loop, SandboxManager]) -> None:
    """An exec whose output chunk is still with its caller (a slow or stalled reader) is no
    work RunTests waits for, but its command runs on: RunTests kills every process of the
    sandbox before the tests start, so a command that keeps writing the file the tests
    watch for never runs beside them, and its exec ends killed, not timed out."""
    loop, m = env
    forge = ["sh", "-c", "echo started; while :; do : > forged; sleep 0.005; done"]

    async def main() -> None:
        sid = (await m.create(task=ALONE_TASK)).sandbox_id
        stream = m.exec(sid, forge, timeout_s=8)
        try:
            assert await stream.__anext__() == ("stdout", b"started\n")
            await asyncio.sleep(0.2)  # the caller holds the chunk; the command goes on
            outcome, _, output = await m.run_tests(sid)
            assert outcome.reward == 1.0, output
            _, _, result = await collect(stream)
            assert not result.timed_out and (result.signal or result.exit_code), result
        finally:
            await stream.aclose()
            await m.close(sid)

    loop.run(main())


def test_output_written_before_the_exec_stream_is_read_arrives(env: tuple[Loop, SandboxManager], monkeypatch: pytest.MonkeyPatch) -> None:
    """A command's first output, and the start of a fork's copy stream, arrive even when
    written before the service has read the exec's start reply (a busy host). With Docker
    the reply's head is read through a buffered reader that also takes whatever follows
    it: a full suite under load lost an exec's first line there. Here the client reads
    every reply's head 0.3 s late, so that the command has written by then."""
    import http.client

    loop, m = env
    read_head = http.client.HTTPResponse.begin

    def late(response: http.client.HTTPResponse) -> None:
        time.sleep(0.3)
        read_head(response)

    async def main() -> None:
        box = await m.create(files={"a.txt": b"alpha", "dir/b.txt": b"beta"})
        fork = None
        try:
            monkeypatch.setattr(http.client.HTTPResponse, "begin", late)
            out, _, res = await sh(m, box.sandbox_id, "echo up; sleep 1; echo done")
            assert out == b"up\ndone\n" and res.exit_code == 0
            (fork,) = await m.fork(box.sandbox_id, 1)
            monkeypatch.undo()
            assert await m.read_files(fork.sandbox_id, ["a.txt", "dir/b.txt"]) == {"a.txt": b"alpha", "dir/b.txt": b"beta"}
        finally:
            monkeypatch.undo()
            for sid in (box.sandbox_id, *([fork.sandbox_id] if fork else [])):
                await m.close(sid)

    loop.run(main())


# ------------------------------------------------------------------ hostile input


@pytest.fixture(scope="module")
def pair(env: tuple[Loop, SandboxManager]) -> Iterator[tuple[Loop, SandboxManager, str, str]]:
    """An attacker sandbox and a bystander holding a secret file."""
    loop, m = env
    attacker = loop.run(m.create(files={"run.sh": b"#!/bin/sh\necho hi\n"}))
    bystander = loop.run(m.create(files={"secret.txt": b"bystander-token-5521"}))
    yield loop, m, attacker.sandbox_id, bystander.sandbox_id
    for sid in (attacker.sandbox_id, bystander.sandbox_id):
        if sid in [b.sandbox_id for b in m.list()]:
            loop.run(m.close(sid))


async def _healthy(m: SandboxManager, bystander: str, probe: bool = False) -> None:
    """The bystander is untouched and the service still serves (and, when asked, creates)."""
    out, _, res = await run(m, bystander, ["cat", "secret.txt"])
    assert out == b"bystander-token-5521" and res.exit_code == 0
    assert bystander in [b.sandbox_id for b in m.list()]
    if probe:
        box = await m.create()
        _, _, res = await run(m, box.sandbox_id, ["true"])
        assert res.exit_code == 0
        await m.close(box.sandbox_id)


def test_hostile_fork_bomb(pair) -> None:  # type: ignore[no-untyped-def]
    loop, m, attacker, bystander = pair
    _, _, res = loop.run(sh(m, attacker, "bomb() { bomb | bomb & }; bomb; sleep 30", timeout_s=4))
    assert res.timed_out or res.exit_code != 0
    loop.run(_healthy(m, bystander, probe=True))
    # The attacker's sandbox is usable again: nothing of the bomb survives the exec.
    out, _, res = loop.run(sh(m, attacker, "echo alive", timeout_s=10))
    assert out == b"alive\n" and res.exit_code == 0


def test_hostile_memory_bomb(pair) -> None:  # type: ignore[no-untyped-def]
    """The memory limit's OOM killer ends it, and says so, on both backends: the memory
    cgroup's limit (256 MiB and the tmpfs room) comes well before the process backend's
    address-space limit (512 MiB), so it is never a MemoryError."""
    loop, m, attacker, bystander = pair
    _, err, res = loop.run(run(m, attacker, ["python3", "-c", "a = []\nwhile True: a.append(bytearray(16 << 20))"], timeout_s=8))
    assert (res.exit_code, res.signal, res.timed_out, res.oom_killed) == (-1, 9, False, True), (res, err)
    assert err == b"", err
    loop.run(_healthy(m, bystander))


def test_hostile_disk_fill(pair) -> None:  # type: ignore[no-untyped-def]
    loop, m, attacker, bystander = pair
    out, err, res = loop.run(sh(m, attacker, "dd if=/dev/zero of=big bs=1M count=200 2>&1; dd if=/dev/zero of=/tmp/big bs=1M count=200 2>&1; du -sk big /tmp/big", timeout_s=8))
    assert res.exit_code == 0, out + err
    sizes = [int(line.split()[0]) for line in out.decode().splitlines() if line.endswith(("big", "/tmp/big")) and line.split()[0].isdigit()]
    assert sizes and all(s <= 33 * 1024 for s in sizes), out
    assert b"No space left" in out
    loop.run(sh(m, attacker, "rm -f big /tmp/big"))
    loop.run(_healthy(m, bystander))


def test_hostile_unbounded_output_and_sleeping_forever(pair) -> None:  # type: ignore[no-untyped-def]
    loop, m, attacker, bystander = pair
    out, err, res = loop.run(run(m, attacker, ["yes"], timeout_s=2))
    assert res.stdout_truncated and len(out) == m.default_limits.max_output_bytes
    _, _, res = loop.run(run(m, attacker, ["sleep", "1000"], timeout_s=1))
    assert res.timed_out and res.signal == 9
    loop.run(_healthy(m, bystander))


def test_hostile_network(pair) -> None:  # type: ignore[no-untyped-def]
    loop, m, attacker, bystander = pair
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    accepted: list[object] = []

    def accept_one() -> None:
        with contextlib.suppress(OSError):  # the listener closed under it: nothing came
            accepted.append(listener.accept())

    waiter = threading.Thread(target=accept_one, daemon=True)
    waiter.start()
    probe = (
        "import socket\n"
        f"for host, port in [('127.0.0.1', {port}), ('10.0.0.1', 80), ('1.1.1.1', 53)]:\n"
        "    s = socket.socket(); s.settimeout(2)\n"
        "    try:\n        s.connect((host, port)); print('CONNECTED', host)\n"
        "    except OSError as exc:\n        print('refused', host, type(exc).__name__)\n"
    )
    try:
        out, _, res = loop.run(run(m, attacker, ["python3", "-c", probe], timeout_s=9))
    finally:
        listener.shutdown(socket.SHUT_RDWR)  # wakes the accept
        listener.close()
        waiter.join(10)
    assert b"CONNECTED" not in out and out.count(b"refused") == 3, out
    assert not accepted
    loop.run(_healthy(m, bystander))


def test_hostile_reading_secrets(pair) -> None:  # type: ignore[no-untyped-def]
    loop, m, attacker, bystander = pair
    os.environ[SECRET_ENV] = "service-secret-7781"
    try:
        script = (
            "cat /etc/shadow; cat /proc/1/environ; cat /proc/$PPID/environ; for p in /proc/[0-9]*; do cat $p/environ; done; "
            "env; find / -name secret.txt 2>/dev/null -exec cat {} \\; ; ls /proc/*/root/ 2>&1 | head -5; cat /proc/*/root/workspace/secret.txt"
        )
        out, err, _ = loop.run(sh(m, attacker, script, timeout_s=9))
    finally:
        del os.environ[SECRET_ENV]
    everything = out + err
    shadow = Path("/etc/shadow").read_bytes() if Path("/etc/shadow").exists() else b""
    root_line = next((line for line in shadow.splitlines() if line.startswith(b"root:")), None)
    assert root_line is None or root_line not in everything
    assert b"service-secret-7781" not in everything
    assert b"bystander-token-5521" not in everything
    loop.run(_healthy(m, bystander))


def test_hostile_symlinks_in_file_paths(pair) -> None:  # type: ignore[no-untyped-def]
    loop, m, attacker, bystander = pair
    loop.run(sh(m, attacker, "ln -sf /etc/passwd passwd; ln -sfn / rootdir; ln -sfn .. up; mkdir -p d; ln -sfn /etc d/etc; mkfifo fifo"))
    passwd_before = Path("/etc/passwd").read_bytes()

    async def main() -> None:
        for path in ("passwd", "rootdir/etc/passwd", "up/x", "d/etc/passwd", "../secret.txt", "/etc/passwd", "fifo"):
            with pytest.raises((InvalidArgument, NotFound)):
                await m.read_files(attacker, [path])
        for path in ("rootdir/tmp/owned", "d/etc/owned", "up/owned", "../owned"):
            with pytest.raises(InvalidArgument):
                await m.write_files(attacker, {path: b"x"})
        # Writing over a symlink replaces the link, never its target.
        await m.write_files(attacker, {"passwd": b"mine"})
        assert (await m.read_files(attacker, ["passwd"]))["passwd"] == b"mine"

    loop.run(main())
    assert Path("/etc/passwd").read_bytes() == passwd_before
    loop.run(_healthy(m, bystander))


def test_hostile_killing_its_parent(pair) -> None:  # type: ignore[no-untyped-def]
    loop, m, attacker, bystander = pair
    _, _, res = loop.run(sh(m, attacker, "kill -9 $PPID; kill -9 1; kill -9 -1; sleep 2; echo survived", timeout_s=8))
    assert not res.timed_out
    loop.run(_healthy(m, bystander))
    out, _, res = loop.run(sh(m, attacker, "echo still-usable"))
    assert out == b"still-usable\n"


# A workspace made as hostile to a copy as a sandbox can make it: a folder chain 1,300
# levels deep, a path far beyond PATH_MAX, a FIFO and a socket, hard links, a sparse file
# far larger than the disk (1 TiB where no file size limit applies, 60 MiB otherwise),
# entries their owner may not read or search, names that are not UTF-8, symlinks out.
HOSTILE_TREE = r"""
import os, socket
os.mkdir('hostile'); os.chdir('hostile')
os.mkdir('deep'); os.chdir('deep')
for i in range(1300):
    if i % 250 == 0:
        open('f.txt', 'w').write('level %d' % i)
    os.mkdir('a'); os.chdir('a')
open('bottom.txt', 'w').write('bottom')
os.symlink('../../..', 'up')
for i in range(1301):
    os.chdir('..')
os.mkdir('long'); os.chdir('long')
for i in range(24):
    os.mkdir(chr(97 + i) * 200); os.chdir(chr(97 + i) * 200)
open('far.txt', 'w').write('far')
for i in range(25):
    os.chdir('..')
os.mkfifo('fifo')
socket.socket(socket.AF_UNIX).bind('sock')
open('h1', 'w').write('linked'); os.link('h1', 'h2')
with open('sparse.bin', 'wb') as f:
    f.write(b'head')
    try:
        f.truncate(1 << 40)
    except OSError:
        f.truncate(60 << 20)
    f.seek(-4, 2); f.write(b'tail')
with open('big.bin', 'wb') as f:
    f.write(os.urandom(16 << 20))
open('secret', 'w').write('not even for me'); os.chmod('secret', 0)
os.makedirs('locked/sub'); open('locked/in.txt', 'w').write('in'); os.chmod('locked', 0)
os.mkdir('ro'); open('ro/x', 'w').write('x'); os.chmod('ro', 0o555)
os.mkdir('wx'); open('wx/y', 'w').write('y'); os.chmod('wx', 0o300)
open('run.sh', 'w').write('#!/bin/sh\n'); os.chmod('run.sh', 0o751)
open(b'\xff\xfe', 'w').write('bytes'); open('new\nline', 'w').write('nl')
os.symlink('/', 'root'); os.symlink('nowhere', 'dangling'); os.mkdir('empty')
"""

# What is in a tree, one line an entry in a fixed order (depth, name, kind, mode, size, and a
# digest of a file's data extents, read once per inode, or a link's target), walked with
# chdir so that no path is ever longer than a name; folders and files the owner may not
# read are opened to it for the walk and given their mode back.
MANIFEST = r"""
import hashlib, os, stat, sys

def granted(name, st, need):
    mode = stat.S_IMODE(st.st_mode)
    if mode & need == need:
        return None
    os.chmod(name, mode | need)
    return mode

seen = {}

def digest(name, st):
    if st.st_ino not in seen:
        seen[st.st_ino] = read_digest(name, st)
    return seen[st.st_ino]

def read_digest(name, st):
    back = granted(name, st, 0o400)
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    h, pos = hashlib.sha256(), 0
    try:
        while True:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError:
                break
            pos = os.lseek(fd, start, os.SEEK_HOLE)
            h.update(b'@%d:' % start)
            while start < pos:
                chunk = os.pread(fd, min(1 << 20, pos - start), start)
                if not chunk:
                    break
                h.update(chunk)
                start += len(chunk)
    finally:
        os.close(fd)
        if back is not None:
            os.chmod(name, back)
    return h.hexdigest()[:16]

os.chdir(sys.argv[1])
stack = [[iter(sorted(os.listdir(b'.'))), None]]
while stack:
    name = next(stack[-1][0], None)
    if name is None:
        _, back = stack.pop()
        if stack:
            os.chdir(b'..')
            if back is not None:
                os.chmod(*back)
        continue
    st = os.lstat(name)
    mode = stat.S_IMODE(st.st_mode)
    line = [len(stack) - 1, name, '', mode, 0, '']
    if stat.S_ISDIR(st.st_mode):
        line[2] = 'dir'
        back = granted(name, st, 0o500)
        os.chdir(name)
        stack.append([iter(sorted(os.listdir(b'.'))), None if back is None else (name, back)])
    elif stat.S_ISLNK(st.st_mode):
        line[2:] = ['link', 0, 0, os.readlink(name)]
    elif stat.S_ISREG(st.st_mode):
        line[2:] = ['file', mode, st.st_size, digest(name, st)]
    else:
        line[2] = 'fifo' if stat.S_ISFIFO(st.st_mode) else 'sock' if stat.S_ISSOCK(st.st_mode) else 'other'
    print(*map(repr, line))
"""


def _manifest(loop: Loop, m: SandboxManager, sid: str, top: str) -> list[str]:
    out, err, res = loop.run(run(m, sid, ["python3", "-c", MANIFEST, top], timeout_s=10))
    assert res.exit_code == 0 and not res.stdout_truncated, err
    return out.decode().splitlines()


def test_hostile_workspace_forks_faithfully(pair) -> None:  # type: ignore[no-untyped-def]
    """What the sandbox built to break a copy forks, on both backends, into the same tree:
    every folder, file (data, holes, mode) and symlink, whatever its depth, path length,
    name or permissions; FIFOs and sockets are left out, hard links stay links within the
    copy. The source is left as it was, the host holds no copy of the workspace in memory,
    and nothing is left behind."""
    import tracemalloc

    loop, m, attacker, bystander = pair
    _, err, res = loop.run(run(m, attacker, ["python3", "-c", HOSTILE_TREE], timeout_s=10))
    assert res.exit_code == 0, err
    try:
        source = _manifest(loop, m, attacker, "hostile")
        kinds = {line.split()[2] for line in source}
        assert {"'dir'", "'file'", "'link'", "'fifo'", "'sock'"} <= kinds and len(source) > 1300
        tracemalloc.start()
        try:
            (copy,) = loop.run(asyncio.wait_for(m.fork(attacker, 1), 300))
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        try:
            assert peak < 8 << 20, f"the host held {peak} bytes while copying a workspace of 16 MiB"
            expected = [line for line in source if line.split()[2] not in ("'fifo'", "'sock'")]
            assert _manifest(loop, m, copy.sandbox_id, "hostile") == expected
            out, _, _ = loop.run(sh(m, copy.sandbox_id, "stat -c %h hostile/h1 hostile/h2; echo changed > hostile/h1; cat hostile/h2"))
            assert out == b"2\n2\nchanged\n", out
        finally:
            loop.run(m.close(copy.sandbox_id))
        assert _manifest(loop, m, attacker, "hostile") == source
        assert loop.run(m.backend.leftovers()) == []
    finally:
        loop.run(m.backend.remove(attacker, "hostile"))
    loop.run(_healthy(m, bystander))


def test_hostile_fork_that_does_not_fit_is_resource_exhausted(pair, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """A workspace whose copy needs more room than the copy has (12 MiB of files, in
    folders only root may search, forked into sandboxes given 8 MiB of disk here: a real
    copy has the source's room, and since hard links stay links a copy takes no more than
    its source) fails Fork with RESOURCE_EXHAUSTED, leaving no sandbox behind and the
    source exactly as it was: the copy gave up inside the folders it had opened to itself,
    stopped reading the source and gave the folders their modes back."""
    loop, m, attacker, bystander = pair
    build = (
        "import os\nos.makedirs('bomb/locked/inner'); os.chdir('bomb/locked/inner')\n"
        "for i in range(3):\n    open('a%d' % i, 'wb').write(os.urandom(4 << 20))\n"
        "open('secret', 'w').write('s'); os.chmod('secret', 0); os.chmod('.', 0o100); os.chmod('..', 0)\n"
    )
    create = m.backend.create

    async def small(sandbox_id: str, limits: Limits) -> None:
        await create(sandbox_id, dataclasses.replace(limits, disk_bytes=8 << 20))
    _, err, res = loop.run(run(m, attacker, ["python3", "-c", build], timeout_s=10))
    assert res.exit_code == 0, err
    try:
        source = _manifest(loop, m, attacker, "bomb")
        assert "'locked' 'dir' 0 " in " ".join(source).replace("b'", "'"), source
        live = {b.sandbox_id for b in m.list()}
        monkeypatch.setattr(m.backend, "create", small)
        with pytest.raises(ResourceExhausted, match="does not fit"):
            loop.run(asyncio.wait_for(m.fork(attacker, 1), 300))
        monkeypatch.undo()
        assert {b.sandbox_id for b in m.list()} == live and loop.run(m.backend.leftovers()) == []
        assert _manifest(loop, m, attacker, "bomb") == source
    finally:
        loop.run(m.backend.remove(attacker, "bomb"))
    loop.run(_healthy(m, bystander))

def test_fork_keeps_hard_links_within_the_copy(pair) -> None:  # type: ignore[no-untyped-def]
    """A file of 4 MiB hard-linked 300 times over three folders (1.2 GB of apparent size in a
    32 MiB workspace: each link is free) forks: the copy holds one file with all its links,
    one inode as seen from inside the fork, with the source's data. A file linked between
    two folders only root may search is linked in the copy too. Writing through a link of
    the copy changes every link of the copy, and nothing of the source."""
    loop, m, attacker, bystander = pair
    build = (
        "import os\nos.makedirs('links/a/deep'); os.makedirs('links/b'); os.makedirs('links/c'); os.makedirs('links/d')\n"
        "open('links/a/big', 'wb').write(os.urandom(4 << 20))\n"
        "for i in range(300):\n    os.link('links/a/big', ('links/a/l%d', 'links/b/l%d', 'links/a/deep/l%d')[i % 3] % i)\n"
        "open('links/c/small', 'w').write('small'); os.link('links/c/small', 'links/d/small')\n"
        "os.chmod('links/c', 0); os.chmod('links/d', 0)\n"
    )
    names = "links/a/big " + " ".join(("links/a/l%d", "links/b/l%d", "links/a/deep/l%d")[i % 3] % i for i in range(300))
    _, err, res = loop.run(run(m, attacker, ["python3", "-c", build], timeout_s=10))
    assert res.exit_code == 0, err
    try:
        source = _manifest(loop, m, attacker, "links")
        before, _, _ = loop.run(sh(m, attacker, "sha256sum links/a/big"))
        (copy,) = loop.run(asyncio.wait_for(m.fork(attacker, 1), 300))
        try:
            cid = copy.sandbox_id
            assert _manifest(loop, m, cid, "links") == source
            out, err, res = loop.run(sh(m, cid, f"stat -c %i {names} | sort -u | wc -l; stat -c %h links/a/big; sha256sum links/a/big"))
            assert res.exit_code == 0, err
            assert out == b"1\n301\n" + before, out
            out, err, res = loop.run(sh(m, cid, "chmod 700 links/c links/d && stat -c '%i %h' links/c/small links/d/small && cat links/d/small"))
            assert res.exit_code == 0, err
            first, second, content = out.decode().split("\n", 2)
            assert first == second and first.endswith(" 2") and content == "small", out
            out, err, res = loop.run(sh(m, cid, "echo changed > links/b/l1; cat links/a/big links/a/deep/l2"))
            assert out == b"changed\nchanged\n", (out, err)
        finally:
            loop.run(m.close(cid))
        after, _, _ = loop.run(sh(m, attacker, "sha256sum links/a/big; cat links/b/l1 | sha256sum"))
        assert after == before + before.replace(b"links/a/big", b"-"), after
        assert _manifest(loop, m, attacker, "links") == source
    finally:
        loop.run(m.backend.remove(attacker, "links"))
    loop.run(_healthy(m, bystander))


# ------------------------------------------------------------------ integrity: nothing outlives, fools or links


SURVIVOR = "setsid sh -c 'while :; do date +%s%N > /tmp/alive; sleep 0.05; done' </dev/null >/dev/null 2>&1 &"


def _leaving(loop_script: str, then: str = "time.sleep(100)") -> list[str]:
    """A command that leaves the exec's session itself (as the first process of the exec,
    or, where that leads a process group already, as its first child), starts
    ``loop_script`` in the background and then runs ``then``."""
    return ["python3", "-c", (
        "import os, subprocess, time\n"
        "try:\n    os.setsid()\nexcept PermissionError:\n"
        "    if os.fork():\n        time.sleep(100)\n        os._exit(0)\n    os.setsid()\n"
        f"subprocess.Popen(['sh', '-c', {loop_script!r}])\n{then}\n"
    )]


def _alive_stamps(loop: Loop, m: SandboxManager, sid: str) -> tuple[bytes, bytes]:
    first, _, _ = loop.run(sh(m, sid, "cat /tmp/alive 2>/dev/null; true"))
    loop.run(asyncio.sleep(0.4))
    second, _, _ = loop.run(sh(m, sid, "cat /tmp/alive 2>/dev/null; true"))
    return first, second


def test_no_descriptor_the_service_inherited_reaches_a_command(env: tuple[Loop, SandboxManager]) -> None:
    """A descriptor the service inherited without close-on-exec (from whatever started it:
    a supervisor's socket, a pipe) is not open in a sandboxed command: the command has
    stdin, stdout and stderr only (the process backend's launcher closes the rest)."""
    loop, m = env
    read_end, write_end = os.pipe()
    leaked = 200
    os.dup2(write_end, leaked)  # inheritable, as a descriptor from the service's parent would be
    try:
        box = loop.run(m.create())
        try:
            script = "import json, os; print(json.dumps(sorted(int(fd) for fd in os.listdir('/proc/self/fd') if os.path.exists(f'/proc/self/fd/{fd}'))))"
            out, err, res = loop.run(run(m, box.sandbox_id, ["python3", "-c", script]))
            assert res.exit_code == 0, (res, err)
            # 0, 1, 2, and the folder listdir opened (it is closed by the time exists() runs).
            assert json.loads(out) == [0, 1, 2], out
        finally:
            loop.run(m.close(box.sandbox_id))
    finally:
        for fd in (read_end, write_end, leaked):
            os.close(fd)


def test_no_group_the_service_holds_reaches_a_command(env: tuple[Loop, SandboxManager]) -> None:
    """Supplementary groups the service runs with (root's, e.g. disk or docker, from
    whatever started it) are dropped by the process backend's launcher: the command's
    only group is its sandbox's own gid. (Docker's commands are started by dockerd, which
    the service's groups never reach.)"""
    loop, m = env
    if m.backend.name == "docker":
        pytest.skip("the service's groups reach only the process backend's exec chain")
    box = loop.run(m.create())
    groups = os.getgroups()
    try:
        os.setgroups([6, 27])  # as if the service ran with the disk and sudo groups
        try:
            out, err, res = loop.run(run(m, box.sandbox_id, ["sh", "-c", "id -G; id -g"]))
        finally:
            os.setgroups(groups)
        assert res.exit_code == 0, err
        listed, own = out.decode().splitlines()
        assert listed.split() == [own], out
    finally:
        loop.run(m.close(box.sandbox_id))


def test_nothing_outlives_its_exec(pair) -> None:  # type: ignore[no-untyped-def]
    """A process that leaves its session (setsid) is gone when the exec returns: after a
    normal exit and after a timeout alike."""
    loop, m, attacker, bystander = pair
    _, _, res = loop.run(sh(m, attacker, SURVIVOR + " sleep 0.3; exit 0"))
    assert res.exit_code == 0
    first, second = _alive_stamps(loop, m, attacker)
    assert first == second, "a process started by a finished exec is still writing"
    stamp = "while :; do date +%s%N > /tmp/alive; sleep 0.05; done"
    _, _, res = loop.run(run(m, attacker, _leaving(stamp), timeout_s=1))
    assert res.timed_out
    first, second = _alive_stamps(loop, m, attacker)
    assert first == second, "a process started by a timed-out exec is still writing"
    loop.run(_healthy(m, bystander))


FAKE_HARNESS = "import sys\nprint('TOTAL 3')\nfor i in range(3):\n    print(f'PASS case{i}')\n"


def test_a_survivor_cannot_rewrite_the_tests(env: tuple[Loop, SandboxManager]) -> None:
    """A process left from an earlier exec keeps rewriting .tests/ with a harness that
    passes everything: RunTests still scores the wrong solution 0."""
    loop, m = env
    task = TaskSuite.builtin().get("python/add")

    async def main() -> None:
        box = await m.create(task=task, files={"solution.py": b"def add(a, b):\n    return -12345\n", "fake.py": FAKE_HARNESS.encode()})
        sid = box.sandbox_id
        try:
            rewrite = "while :; do mkdir -p .tests; cp fake.py .tests/_harness.py; cp fake.py .tests/test_solution.py; sleep 0.01; done"
            _, _, res = await run(m, sid, _leaving(rewrite), timeout_s=1)
            assert res.timed_out
            outcome, _, output = await m.run_tests(sid)
            assert outcome.reward == 0.0, output
        finally:
            await m.close(sid)

    loop.run(main())


# Every way a sandboxed command could take hold of a process it did not start, tried on
# every such process it can see. On Docker those are the container's init and the
# keep-alive that kill_all spares by design: whatever controls them outlives kill_all and
# runs beside the tests RunTests starts. Each attempt is harmless where it succeeds (the
# byte written into another process's memory is the one read there, a stopped process is
# continued, limits and priorities are set to what they were).
SURVIVOR_ATTACK = r"""
import ctypes, json, os, resource, signal
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
NR = {"x86_64": {"ptrace": 101, "process_vm_writev": 311}, "aarch64": {"ptrace": 117, "process_vm_writev": 271}}[os.uname().machine]
PTRACE_ATTACH, PTRACE_DETACH = 16, 17
DENIED = (1, 13, 3)  # EPERM, EACCES, ESRCH


class IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def writable_address(pid):
    with open("/proc/%d/maps" % pid) as fh:
        for line in fh:
            span, perms = line.split()[:2]
            if perms.startswith("rw"):
                return int(span.split("-")[0], 16)
    raise OSError("no writable mapping")


def attempts(pid):
    allowed = []
    try:
        fd = os.open("/proc/%d/mem" % pid, os.O_RDWR)
    except OSError:
        pass
    else:
        allowed.append("open /proc/pid/mem read-write")
        try:
            where = writable_address(pid)
            os.pwrite(fd, os.pread(fd, 1, where), where)
            allowed.append("write its memory")
        except OSError:
            pass
        os.close(fd)
    try:
        os.kill(pid, 0)
        allowed.append("signal it")
        os.kill(pid, signal.SIGSTOP)
        os.kill(pid, signal.SIGCONT)
        allowed.append("SIGSTOP")
    except OSError:
        pass
    if libc.syscall(NR["ptrace"], PTRACE_ATTACH, pid, 0, 0) == 0:
        allowed.append("ptrace attach")
        libc.syscall(NR["ptrace"], PTRACE_DETACH, pid, 0, 0)
    byte = ctypes.create_string_buffer(1)
    local, remote = IoVec(ctypes.addressof(byte), 1), IoVec(4096, 1)
    if libc.syscall(NR["process_vm_writev"], pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0) != -1 or ctypes.get_errno() not in DENIED:
        allowed.append("process_vm_writev")
    for name, act in [
        ("read /proc/pid/environ", lambda: open("/proc/%d/environ" % pid, "rb").read()),
        ("write /proc/pid/oom_score_adj", lambda: open("/proc/%d/oom_score_adj" % pid, "r+").write(open("/proc/%d/oom_score_adj" % pid).read())),
        ("set its limits", lambda: resource.prlimit(pid, resource.RLIMIT_NOFILE, resource.prlimit(pid, resource.RLIMIT_NOFILE))),
        ("set its priority", lambda: os.setpriority(os.PRIO_PROCESS, pid, os.getpriority(os.PRIO_PROCESS, pid))),
        ("set its CPU affinity", lambda: os.sched_setaffinity(pid, os.sched_getaffinity(pid))),
    ]:
        try:
            act()
            allowed.append(name)
        except OSError:
            pass
    return allowed


found = {}
for entry in os.listdir("/proc"):
    if entry.isdigit() and int(entry) != os.getpid():
        pid = int(entry)
        try:
            comm = open("/proc/%d/comm" % pid).read().strip()
        except OSError:
            comm = "?"
        found[pid] = {"comm": comm, "allowed": attempts(pid)}
print(json.dumps(found))
"""


def test_sandbox_code_cannot_control_what_outlives_kill_all(pair) -> None:  # type: ignore[no-untyped-def]
    """A command sees every process of its sandbox it did not start (on Docker, the
    container's init and keep-alive, which kill_all spares) and can neither write their
    memory, nor ptrace, signal or retune them: code planted there would otherwise outlive
    kill_all and run beside RunTests' harness, rewriting the tests or the workspace."""
    import json

    loop, m, attacker, bystander = pair

    def attack() -> dict[str, Any]:
        out, err, res = loop.run(run(m, attacker, ["python3", "-c", SURVIVOR_ATTACK]))
        assert res.exit_code == 0, out + err
        return json.loads(out)

    before = attack()
    loop.run(m.backend.kill_all(attacker))
    after = attack()
    # What the command saw is what kill_all leaves: the targets are the survivors.
    assert before.keys() == after.keys()
    if m.backend.name == "docker":
        assert "1" in before, before
    else:
        # Each command is process 1 of a pid namespace of its own: no process of the
        # sandbox outlives kill_all, so the command sees none but itself.
        assert before == {} and after == {}, (before, after)
    controlled = {pid: seen for pid, seen in {**before, **after}.items() if seen["allowed"]}
    assert not controlled, f"sandbox code controls processes that outlive kill_all: {controlled}"
    loop.run(_healthy(m, bystander))


HIDDEN_TEST_READER = (
    "import ast, glob, os\n"
    "def add(a, b):\n"
    "    for path in glob.glob('/workspace/**', recursive=True) + glob.glob('/tmp/**', recursive=True):\n"
    "        try:\n"
    "            text = open(path).read()\n"
    "        except OSError:\n"
    "            continue\n"
    "        if 'CASES' in text:\n"
    "            tree = ast.parse(text)\n"
    "            for node in tree.body:\n"
    "                if isinstance(node, ast.Assign) and node.targets[0].id == 'CASES':\n"
    "                    for args, want in ast.literal_eval(node.value):\n"
    "                        if tuple(args) == (a, b):\n"
    "                            return want\n"
    "    return None\n"
)


def _graded(env: tuple[Loop, SandboxManager], task_id: str, files: dict[str, bytes]) -> tuple[Any, bytes]:
    """RunTests on a fresh sandbox of ``task_id`` holding ``files``: (outcome, output)."""
    loop, m = env

    async def main() -> tuple[Any, bytes]:
        box = await m.create(task=TaskSuite.builtin().get(task_id), files=files)
        try:
            outcome, _, output = await m.run_tests(box.sandbox_id)
            return outcome, output
        finally:
            await m.close(box.sandbox_id)

    return loop.run(main())


def test_the_hidden_tests_are_never_on_the_sandbox_disk(env: tuple[Loop, SandboxManager]) -> None:
    """A solution that answers by reading the expected values from any file it can find
    scores 0: the tests reach the harness on its standard input only."""
    outcome, output = _graded(env, "python/add", {"solution.py": HIDDEN_TEST_READER.encode()})
    assert outcome.reward == 0.0, output


# Reads the expected values out of the memory of the process that started it (the
# harness, which holds the test module's source), through /proc/<pid>/mem.
HARNESS_MEMORY_READER = (
    "import ast, os, re\n"
    "_CASES = re.compile(rb'CASES = (\\[[^\\n]*\\])\\n')\n"
    "def _stolen():\n"
    "    found, pid = {}, os.getppid()\n"
    "    with open(f'/proc/{pid}/maps') as maps, open(f'/proc/{pid}/mem', 'rb', buffering=0) as mem:\n"
    "        for line in maps:\n"
    "            span, perms = line.split()[:2]\n"
    "            if not perms.startswith('r'):\n"
    "                continue\n"
    "            start, end = (int(x, 16) for x in span.split('-'))\n"
    "            try:\n"
    "                mem.seek(start)\n"
    "                data = mem.read(end - start)\n"
    "            except (OSError, OverflowError, ValueError):\n"
    "                continue\n"
    "            for match in _CASES.finditer(data):\n"
    "                try:\n"
    "                    found.update((tuple(args), want) for args, want in ast.literal_eval(match.group(1).decode()))\n"
    "                except Exception:\n"
    "                    pass\n"
    "    return found\n"
    "def add(a, b):\n"
    "    try:\n"
    "        return _stolen().get((a, b))\n"
    "    except OSError as exc:\n"
    "        return repr(exc)\n"
)


def test_the_tested_code_cannot_read_the_harness_memory(env: tuple[Loop, SandboxManager]) -> None:
    """The harness holds the test module (the expected values) in its memory and runs as
    the same uid as the code under test, its child: it makes itself non-dumpable first, so
    a solution that reads the values out of /proc/<harness>/mem scores 0 (the pipes the
    harness reads and writes are root's, so its memory is the way in; where Yama's
    ptrace_scope is 0, nothing else stops the read)."""
    outcome, output = _graded(env, "python/add", {"solution.py": HARNESS_MEMORY_READER.encode()})
    assert outcome.reward == 0.0, output
    assert b"PermissionError" in output, output  # the read was refused, not merely wrong


def test_a_workspace_module_cannot_shadow_the_standard_library(env: tuple[Loop, SandboxManager]) -> None:
    """A subprocess.py in the workspace does not stand in for the harness checks' own
    ``import subprocess``: a broken script still fails its syntax check."""
    fake = b"class _R:\n    returncode = 0\n    stdout = stderr = ''\ndef run(*a, **k):\n    return _R()\n"
    outcome, output = _graded(env, "terminal/fix_shell_script", {"build.sh": b"if then fi (\n", "subprocess.py": fake})
    syntax = [ok for name, ok, _ in outcome.cases if name == "syntax"]
    assert syntax == [False] and outcome.reward == 0.0, output


# Stands in for shutil, which the fix_shell_script task's check_script_output imports
# inside the check (after the workspace joined sys.path): its copy() writes the report
# the check wants instead of copying the (still broken) script.
FAKE_SHUTIL = (
    "import os\n"
    "def copy(src, dst):\n"
    "    os.makedirs(os.path.join(dst, 'build'), exist_ok=True)\n"
    "    with open(os.path.join(dst, 'build', 'report.txt'), 'w') as fh:\n"
    "        fh.write('nonempty=3\\n')\n"
    "def rmtree(*args, **kwargs):\n"
    "    pass\n"
)


def test_a_workspace_module_cannot_stand_in_for_one_a_check_imports_late(env: tuple[Loop, SandboxManager]) -> None:
    """The workspace comes last on a check child's sys.path, not only after the test
    module's top-level imports: a shutil.py in the workspace does not stand in for the
    standard library's that a check imports in its body, so a broken script still fails
    the check that runs it."""
    outcome, output = _graded(env, "terminal/fix_shell_script", {"build.sh": b"if then fi (\n", "shutil.py": FAKE_SHUTIL.encode()})
    script_output = [ok for name, ok, _ in outcome.cases if name == "script_output"]
    assert script_output == [False] and outcome.reward == 0.0, output


PRINTED_REPORTS = (
    "import sys\n"
    "FAKE = ''.join('{\"case\": %d, \"got\": \"%d\"}\\n' % (i, want) for i, want in enumerate([3, 0, -3, 300, 10]))\n"
    "sys.stdout.write(FAKE + 'PASS case0\\n'); sys.stdout.flush()\n"
    "sys.stderr.write(FAKE); sys.stderr.flush()\n"
    "def add(a, b):\n"
    "    print(FAKE)\n"
    "    return None\n"
)


def test_printed_reports_do_not_reach_the_harness(env: tuple[Loop, SandboxManager]) -> None:
    outcome, output = _graded(env, "python/add", {"solution.py": PRINTED_REPORTS.encode()})
    assert outcome.reward == 0.0, output


SYSCALL_PROBE = r"""
import ctypes, os, platform, socket
libc = ctypes.CDLL(None, use_errno=True)
NR = {"x86_64": {"keyctl": 250, "add_key": 248, "io_uring_setup": 425, "userfaultfd": 323, "unshare": 272, "bpf": 321,
                 "perf_event_open": 298, "ptrace": 101, "mount": 165, "setns": 308},
      "aarch64": {"keyctl": 219, "add_key": 217, "io_uring_setup": 425, "userfaultfd": 282, "unshare": 97, "bpf": 280,
                  "perf_event_open": 241, "ptrace": 117, "mount": 40, "setns": 268}}[platform.machine()]
args = {"keyctl": (0, 0), "add_key": (b"user", b"k", b"v", 1, -3), "io_uring_setup": (1, 0), "userfaultfd": (0,),
        "unshare": (0x10000000,), "bpf": (0, 0, 0), "perf_event_open": (0, 0, -1, -1, 0), "ptrace": (16, 1, 0, 0),
        "mount": (b"none", b"/tmp", b"tmpfs", 0, 0), "setns": (0, 0)}
for name, nr in NR.items():
    r = libc.syscall(nr, *args[name])
    print(name, "ALLOWED" if r != -1 else os.strerror(ctypes.get_errno()))
pid = os.fork()
if pid == 0:
    os._exit(0)
os.waitpid(pid, 0)
print("fork ok")
print("hostname", socket.gethostname())
print("uid", os.getuid())
"""


def test_seccomp_denies_what_links_or_escapes_sandboxes(pair) -> None:  # type: ignore[no-untyped-def]
    """Keyrings (a channel between sandboxes), io_uring, userfaultfd, bpf, perf, ptrace,
    new namespaces and mounts fail inside; ordinary forks work; each sandbox has its own
    uid and the host's name is not visible."""
    loop, m, attacker, bystander = pair
    out, err, res = loop.run(run(m, attacker, ["python3", "-c", SYSCALL_PROBE]))
    text = out.decode()
    assert res.exit_code == 0, out + err
    assert "ALLOWED" not in text, text
    assert "fork ok" in text and "hostname sandbox" in text and socket.gethostname() not in text.replace("hostname sandbox", "")
    other, _, _ = loop.run(run(m, bystander, ["id", "-u"]))
    assert text.split("uid ")[1].split()[0] != other.decode().strip(), "two live sandboxes share a uid"
    loop.run(_healthy(m, bystander))


# Each call that reaches into another process, made on the caller itself, where nothing
# but the seccomp filter refuses it (a process may read, write, compare and take the
# descriptors of its own).
SELF_REACH_PROBE = r"""
import ctypes, os, platform
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
NR = {"x86_64": {"process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312, "pidfd_open": 434, "pidfd_getfd": 438},
      "aarch64": {"process_vm_readv": 270, "process_vm_writev": 271, "kcmp": 272, "pidfd_open": 434, "pidfd_getfd": 438}}[platform.machine()]


class IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


src, dst = ctypes.create_string_buffer(b"x"), ctypes.create_string_buffer(1)
here, there = IoVec(ctypes.addressof(dst), 1), IoVec(ctypes.addressof(src), 1)
me, one, none = os.getpid(), ctypes.c_ulong(1), ctypes.c_ulong(0)
pidfd = libc.syscall(NR["pidfd_open"], me, 0)
assert pidfd >= 0, os.strerror(ctypes.get_errno())
calls = {
    "process_vm_readv": (me, ctypes.byref(here), one, ctypes.byref(there), one, none),
    "process_vm_writev": (me, ctypes.byref(there), one, ctypes.byref(here), one, none),
    "kcmp": (me, me, 0, 0, 0),  # KCMP_FILE: is my fd 0 my fd 0
    "pidfd_getfd": (pidfd, 0, 0),
}
for name, args in calls.items():
    r = libc.syscall(NR[name], *args)
    print(name, "ALLOWED" if r != -1 else os.strerror(ctypes.get_errno()))
"""


def test_seccomp_denies_reaching_into_processes_even_ones_own(pair) -> None:  # type: ignore[no-untyped-def]
    """process_vm_readv/writev, kcmp and pidfd_getfd fail with EPERM inside, even on the
    command's own process, where no uid or ptrace rule would refuse them: only the seccomp
    filter does, and it must (the harness and the code it tests share a uid)."""
    loop, m, attacker, bystander = pair
    out, err, res = loop.run(run(m, attacker, ["python3", "-c", SELF_REACH_PROBE]))
    assert res.exit_code == 0, out + err
    denied = os.strerror(errno.EPERM)
    assert out.decode().splitlines() == [f"{name} {denied}" for name in ("process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd")], out
    loop.run(_healthy(m, bystander))


def test_exec_cwd_is_a_folder_of_the_workspace_never_a_symlink(pair) -> None:  # type: ignore[no-untyped-def]
    """An exec's cwd is checked alike on both backends, one component at a time: a missing
    folder, a file, or a symlink the sandbox planted (to /, out of the workspace, even to a
    folder inside it) answers INVALID_ARGUMENT naming the path, and the command does not
    run; a real folder is where the command runs."""
    loop, m, attacker, bystander = pair
    _, err, res = loop.run(sh(m, attacker, "mkdir -p cwd/sub/deep && ln -s / cwd/root && ln -s /tmp cwd/tmp && ln -s sub cwd/inside && ln -s .. cwd/up && echo f > cwd/file"))
    assert res.exit_code == 0, err
    try:
        for path in ("cwd/missing", "cwd/sub/missing/x", "cwd/root", "cwd/root/etc", "cwd/tmp", "cwd/inside", "cwd/inside/deep", "cwd/up", "cwd/file"):
            with pytest.raises(InvalidArgument, match=f"cwd '{path}'"):
                loop.run(run(m, attacker, ["sh", "-c", "pwd; touch /tmp/ran-in-bad-cwd"], cwd=path))
        out, _, res = loop.run(sh(m, attacker, "ls /tmp/ran-in-bad-cwd 2>&1; true"))
        assert b"No such file" in out, out
        out, err, res = loop.run(run(m, attacker, ["pwd"], cwd="cwd/sub/deep"))
        assert (out, res.exit_code) == (b"/workspace/cwd/sub/deep\n", 0), err
    finally:
        loop.run(m.backend.remove(attacker, "cwd"))
    loop.run(_healthy(m, bystander))


def test_loader_variables_are_refused(pair) -> None:  # type: ignore[no-untyped-def]
    loop, m, attacker, bystander = pair
    for name in ("LD_PRELOAD", "LD_DEBUG", "LD_LIBRARY_PATH", "GCONV_PATH", "MALLOC_CHECK_", "GLIBC_TUNABLES"):
        with pytest.raises(InvalidArgument, match=name):
            loop.run(run(m, attacker, ["true"], env={name: "/workspace/x"}))
    out, _, _ = loop.run(sh(m, attacker, "echo $GREETING", env={"GREETING": "hello"}))
    assert out == b"hello\n"


@pytest.mark.parametrize(
    ("argv", "variables"),
    [(["echo", "x" * 300_000], {}), (["echo", *["y" * 1024] * 4000], {}), (["echo"] * 5000, {}), (["true"], {"BIG": "z" * 200_000})],
)
def test_oversized_exec_requests_are_invalid(pair, argv: list[str], variables: dict[str, str]) -> None:  # type: ignore[no-untyped-def]
    loop, m, attacker, _ = pair
    with pytest.raises(InvalidArgument):
        loop.run(run(m, attacker, argv, env=variables))


@pytest.mark.parametrize(
    ("limits", "ttl"),
    [
        ({"memory_bytes": 1 << 40}, 0.0),
        ({"disk_bytes": 1 << 40}, 0.0),
        ({"max_pids": 10**6}, 0.0),
        ({"cpus": 64.0}, 0.0),
        ({"wall_seconds": 1e9}, 0.0),
        ({"cpu_seconds": float("inf")}, 0.0),
        ({}, float("nan")),
        ({}, float("inf")),
        ({}, -1.0),
    ],
)
def test_client_limits_are_capped(env: tuple[Loop, SandboxManager], limits: dict[str, float], ttl: float) -> None:
    loop, m = env
    with pytest.raises(InvalidArgument):
        loop.run(m.create(limits=m.default_limits.merged(**limits) if limits else None, ttl_s=ttl))
    assert m.list() == [] or all(b.sandbox_id for b in m.list())



def test_a_lease_lapses_only_when_nothing_uses_or_renews_the_sandbox(pair, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """A leased sandbox (and its fork, which inherits the lease) is closed once no call
    and no renewal has touched it for a lease; a call running for longer holds it; a
    sandbox without a lease (the pair's) is never closed for it."""
    loop, m, attacker, bystander = pair
    now = [1000.0]
    monkeypatch.setattr(m, "clock", lambda: now[0])

    async def main() -> None:
        closed = dict(m.expired)
        held = await m.create(lease_s=10)
        (fork,) = await m.fork(held.sandbox_id, 1)
        assert fork.lease_s == 10
        now[0] += 9
        assert await m.reap_expired() == []
        assert m.renew([held.sandbox_id, "sbx-never-made"]) == ["sbx-never-made"]
        now[0] += 9  # held was renewed 9 s ago; the fork was last used 18 s ago
        assert await m.reap_expired() == [fork.sandbox_id]
        assert m.renew([fork.sandbox_id]) == [fork.sandbox_id]
        with pytest.raises(NotFound):
            await run(m, fork.sandbox_id, ["true"])
        # A call outlasting the lease holds the sandbox while it runs, and renews it when it ends.
        stream = m.exec(held.sandbox_id, ["sh", "-c", "echo up; sleep 1; echo done"])
        assert await stream.__anext__() == ("stdout", b"up\n")
        now[0] += 100
        assert await m.reap_expired() == []
        rest = [item async for item in stream]
        assert isinstance(rest[-1], ExecResult) and rest[-1].exit_code == 0
        now[0] += 9
        assert await m.reap_expired() == []
        now[0] += 2
        assert await m.reap_expired() == [held.sandbox_id]
        assert m.expired == {"lease": closed["lease"] + 2, "ttl": closed["ttl"]}
        assert {b.sandbox_id for b in m.list()} == {attacker, bystander}
        await _healthy(m, bystander, probe=True)

    loop.run(main())


def test_an_execs_socket_is_closed_only_once_its_reader_has_ended(pair, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """Docker: an exec whose caller goes away mid-output (or that times out) closes its
    socket only after the thread reading it has ended. Closed under a reader, the
    descriptor's number could be reused by another exec's socket, and the stale reader
    would read that exec's output."""
    loop, m, attacker, _ = pair
    if m.backend.name != "docker":
        pytest.skip("the process backend reads its commands' pipes on the event loop, with no thread")
    import threading

    readers_alive_at_close: list[list[str]] = []
    real = m.backend._end_exec

    async def end_exec(sandbox_id: str, *args: Any, **kwargs: Any) -> None:
        readers_alive_at_close.append([t.name for t in threading.enumerate() if t.name == f"exec-{sandbox_id}" and t.is_alive()])
        await real(sandbox_id, *args, **kwargs)

    monkeypatch.setattr(m.backend, "_end_exec", end_exec)

    async def main() -> None:
        stream = m.exec(attacker, ["sh", "-c", "while :; do echo x; sleep 0.05; done"])
        assert (await stream.__anext__())[0] == "stdout"
        await stream.aclose()  # the caller goes away while the command still writes
        _, _, res = await run(m, attacker, ["sh", "-c", "echo x; sleep 30"], timeout_s=1)
        assert res.timed_out

    loop.run(main())
    assert len(readers_alive_at_close) == 2 and readers_alive_at_close == [[], []], readers_alive_at_close

def test_exec_timeouts_must_be_finite(pair) -> None:  # type: ignore[no-untyped-def]
    loop, m, attacker, _ = pair
    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(InvalidArgument):
            loop.run(run(m, attacker, ["true"], timeout_s=bad))


def test_special_files_are_refused_without_blocking(pair) -> None:  # type: ignore[no-untyped-def]
    loop, m, attacker, bystander = pair
    loop.run(sh(m, attacker, "rm -f pipe; mkfifo pipe"))

    async def both() -> None:
        with pytest.raises((InvalidArgument, NotFound)):
            await asyncio.wait_for(m.read_files(attacker, ["pipe"]), 10)

    loop.run(both())
    loop.run(_healthy(m, bystander))


# ------------------------------------------------------------------ write errors


def _fail_writes_with(m: SandboxManager, monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    """Makes every file write of ``m``'s backend fail with ``OSError(code)`` where the file
    is opened: in this process (process backend) or in the container's copy of
    workspace_files (Docker backend)."""
    if m.backend.name == "docker":
        from services.envsandbox import docker_backend

        patch = f"def _write_in(*_a, **_k):\n    raise OSError({code}, os.strerror({code}))\n"
        monkeypatch.setattr(docker_backend, "FILES_MAIN", patch + docker_backend.FILES_MAIN)
    else:
        from services.envsandbox import workspace_files

        def failing(*_a: object, **_k: object) -> None:
            raise OSError(code, os.strerror(code))

        monkeypatch.setattr(workspace_files, "_write_in", failing)


def test_write_errors_say_what_happened_and_name_the_file(env: tuple[Loop, SandboxManager], monkeypatch: pytest.MonkeyPatch) -> None:
    """A full workspace is RESOURCE_EXHAUSTED; a host fault (an I/O error, a read-only file
    system) is INTERNAL and a host short of descriptors UNAVAILABLE, never 'no space'; a
    path the sandbox broke is INVALID_ARGUMENT. Every message names the file."""
    import errno

    from meridian.errors import MeridianError, Unavailable

    loop, m = env

    async def main() -> None:
        box = await m.create()
        sid = box.sandbox_id
        try:
            with pytest.raises(ResourceExhausted, match="big/file.bin"):
                await m.write_files(sid, {"small.txt": b"s", "big/file.bin": b"x" * (40 << 20)})
            await m.backend.remove(sid, "big")
            cases = [(errno.EIO, MeridianError, "INTERNAL"), (errno.EROFS, MeridianError, "INTERNAL"),
                     (errno.EMFILE, Unavailable, "UNAVAILABLE"), (errno.ENOTDIR, InvalidArgument, "INVALID_ARGUMENT")]
            for code, kind, status in cases:
                with monkeypatch.context() as patch:
                    _fail_writes_with(m, patch, code)
                    with pytest.raises(kind, match="d/e.txt") as caught:
                        await m.write_files(sid, {"d/e.txt": b"e"})
                assert caught.value.status == status, (errno.errorcode[code], caught.value)
            await m.write_files(sid, {"d/e.txt": b"e"})
            assert await m.read_files(sid, ["d/e.txt", "small.txt"]) == {"d/e.txt": b"e", "small.txt": b"s"}
        finally:
            await m.close(sid)

    loop.run(main())


# ------------------------------------------------------------------ modes the sandbox leaves on its own workspace
#
# The sandbox's user owns its workspace and may leave any mode on any of it (the folder
# itself included). RunTests scores the workspace as the sandbox's user sees it (the tests
# run as that user): a solution it can no longer read scores 0, one it can read scores as
# it should. The service's own file operations (RunTests' set-up, Fork, WriteFiles,
# ReadFiles) work whatever the modes, leave every mode as it was (a written file gets the
# mode WriteFiles gives), and never follow a symlink the sandbox planted. Same on both backends.

# name: (what the sandbox does, the reward RunTests must then give the reference solution)
MODE_ATTACKS = {
    "workspace_mode_0": ("chmod 0 /workspace", 0.0),
    "workspace_read_only": ("mkdir -p .tests/deep && chmod 0 .tests/deep .tests && chmod 555 /workspace", 1.0),
    "workspace_search_only": ("chmod 111 /workspace", 1.0),
    "solution_mode_0": ("chmod 0 solution.py", 0.0),
    "folders_and_files_mode_0": ("mkdir -p junk/in && touch junk/in/f && chmod 0 junk/in/f junk/in junk", 1.0),
    "workspace_removed_or_replaced": (
        "mkdir /tmp/mine && cp solution.py /tmp/mine/ && cd / && rm -rf /workspace; mv /workspace /tmp/old; ln -sfn /tmp/mine /workspace; true",
        0.0,
    ),
}


async def _mode_of_workspace(m: SandboxManager, sid: str) -> str:
    """The workspace folder's mode as the sandbox's user sees it (``stat`` needs no access to it)."""
    out, err, res = await run(m, sid, ["stat", "-c", "%a", "/workspace"])
    assert res.exit_code == 0, err
    return out.decode().strip()



def test_a_sandbox_that_fills_its_workspace_scores_0_not_an_error(env: tuple[Loop, SandboxManager]) -> None:
    """A full workspace cannot take the hidden tests of a task whose test command reads
    them from disk: RunTests scores 0 (an error would drop the episode, and its failure,
    from its group). A task whose tests run from memory scores as it should."""

    loop, m = env
    on_disk = Task(
        id="custom/ok", kind="terminal", split="train", instruction="write ok", files={}, answer_path="ok.txt",
        tests={"check.sh": "test \"$(cat ok.txt)\" = ok && echo 'PASS ok' || echo 'FAIL ok'\n"},
        test_command=["sh", ".tests/check.sh"], reward="all_pass", reference={"ok.txt": "ok"},
    )
    in_memory = TaskSuite.builtin().get("python/add")
    fill = "cat /dev/zero > fill 2>/dev/null; i=0; while true 2>/dev/null > f$i; do i=$((i+1)); done"

    async def main() -> None:
        for task, full_reward in ((on_disk, 0.0), (in_memory, 1.0)):
            box = await m.create(task=task, files={p: c.encode() for p, c in task.reference.items()})
            try:
                assert (await m.run_tests(box.sandbox_id))[0].reward == 1.0
                await sh(m, box.sandbox_id, fill)
                outcome, _, output = await m.run_tests(box.sandbox_id)
                assert outcome.reward == full_reward, output
                if full_reward == 0.0:
                    assert b"no room" in output
            finally:
                await m.close(box.sandbox_id)

    loop.run(main())


async def _reads_and_scores_its_reference(m: SandboxManager, sid: str, task: Any) -> None:
    """The sandbox, holding ``task``'s reference solution, still serves ReadFiles (the file
    as written) and RunTests (a full reward): nothing it did took the file helper's or the
    tests' memory."""
    assert (await m.read_files(sid, ["solution.py"]))["solution.py"] == task.reference["solution.py"].encode()
    outcome, _, output = await m.run_tests(sid)
    assert outcome.reward == 1.0, output


#: Touches memory a MiB at a time until something stops it: under OOM_LIMITS the memory
#: limit's OOM killer, well before the process backend's address-space limit (twice the
#: memory) would make it a MemoryError.
ALLOCATE = "a = []\nwhile True:\n    a.append(b'x' * (1 << 20))\n"
OOM_LIMITS = Limits(memory_bytes=64 << 20, max_pids=64, disk_bytes=4 << 20, wall_seconds=20, cpu_seconds=1)


def test_oom_kills_are_reported_as_what_they_are(env: tuple[Loop, SandboxManager]) -> None:
    """A command the memory limit's OOM killer ends is reported as killed by signal 9 with
    oom_killed, and its stderr holds nothing but its own (the process backend answered exit
    1 with unshare's "sigprocmask unblock failed", Docker never set oom_killed). Not
    OOM-killed, after that OOM kill in the same sandbox: a command whose child the OOM
    killer ended but that went on, one that exits 1, one killed by a SIGKILL that is not
    the OOM killer's, and one killed for its time."""
    loop, m = env

    async def main() -> None:
        sid = (await m.create(limits=OOM_LIMITS)).sandbox_id
        try:
            _, err, res = await run(m, sid, ["python3", "-c", ALLOCATE], timeout_s=20)
            assert (res.exit_code, res.signal, res.oom_killed, res.timed_out) == (-1, 9, True, False), (res, err)
            assert err == b"", err

            out, err, res = await sh(m, sid, 'python3 -c "$ALLOCATE"; echo child=$?', env={"ALLOCATE": ALLOCATE}, timeout_s=20)
            assert out == b"child=137\n" and (res.exit_code, res.signal, res.oom_killed) == (0, 0, False), (res, out, err)

            _, err, res = await sh(m, sid, "exit 1")
            assert (res.exit_code, res.signal, res.oom_killed) == (1, 0, False), (res, err)

            if m.backend.name == "docker":
                _, err, res = await sh(m, sid, "kill -9 $$")
            else:
                # The command is its pid namespace's process 1, which nothing in the sandbox
                # can signal: the kernel's SIGKILL at the CPU time limit.
                _, err, res = await sh(m, sid, "while :; do :; done", timeout_s=20)
            assert (res.exit_code, res.signal, res.oom_killed, res.timed_out) == (-1, 9, False, False), (res, err)
            assert err == b"", err

            _, err, res = await run(m, sid, ["sleep", "30"], timeout_s=1)
            assert (res.signal, res.oom_killed, res.timed_out) == (9, False, True), (res, err)
        finally:
            await m.close(sid)

    loop.run(main())


CPU_LIMITS = Limits(memory_bytes=128 << 20, max_pids=64, disk_bytes=8 << 20, wall_seconds=30, cpu_seconds=1)
BUSY = "while True: pass"


def test_the_cpu_time_limit_kills_each_process_that_spends_it(env: tuple[Loop, SandboxManager]) -> None:
    """cpu_seconds is every process's RLIMIT_CPU, soft and hard, on both backends: a busy
    command is killed by SIGKILL after a second of CPU with a wall limit of 30 (Docker
    applied no CPU limit at all, and the process backend's command, its pid namespace's
    process 1, which the kernel never sends SIGXCPU, ran to the hard limit a second later
    while its children died by SIGXCPU), reported as neither timed out nor OOM-killed; so
    is a busy child of a command that goes on, one that tried to raise the limit, and one
    whose PATH leads to a python3 of the sandbox's; a command that sleeps past it is not; the sandbox works on. On Docker the container's
    init and keep-alive have no CPU limit (one set on the container would be theirs too,
    and the init's death ends the container)."""
    loop, m = env
    refuse = (
        "import resource\ntry:\n    resource.setrlimit(resource.RLIMIT_CPU, (resource.RLIM_INFINITY,) * 2)\n"
        "except (ValueError, OSError):\n    print('refused', flush=True)\n" + BUSY
    )

    async def main() -> None:
        sid = (await m.create(limits=CPU_LIMITS, files={"keep.txt": b"kept"})).sandbox_id
        try:
            out, err, res = await run(m, sid, ["python3", "-c", "import resource; print(resource.getrlimit(resource.RLIMIT_CPU))"])
            assert out == b"(1, 1)\n" and res.exit_code == 0, (out, err, res)

            for argv in (["python3", "-c", BUSY], ["sh", "-c", "while :; do :; done"], ["python3", "-c", refuse]):
                out, err, res = await run(m, sid, argv, timeout_s=30)
                assert (res.exit_code, res.signal, res.timed_out, res.oom_killed) == (-1, 9, False, False), (argv, res, err)
                assert res.wall_seconds < 10, (argv, res)
                assert out == (b"refused\n" if argv[-1] == refuse else b""), (argv, out, err)

            # Whatever sets the limit is not found on the caller's PATH.
            await sh(m, sid, "mkdir bin && printf '#!/bin/sh\\nwhile :; do :; done\\n' > bin/python3 && chmod 755 bin/python3")
            _, err, res = await sh(m, sid, "while :; do :; done", env={"PATH": "/workspace/bin:/usr/bin:/bin"}, timeout_s=30)
            assert (res.exit_code, res.signal, res.timed_out) == (-1, 9, False) and res.wall_seconds < 10, (res, err)

            out, err, res = await sh(m, sid, 'python3 -c "$BUSY"; echo status=$?', env={"BUSY": BUSY}, timeout_s=30)
            assert out == b"status=137\n" and (res.exit_code, res.signal, res.oom_killed) == (0, 0, False), (out, err, res)

            out, err, res = await sh(m, sid, "sleep 3; echo slept", timeout_s=30)
            assert out == b"slept\n" and (res.exit_code, res.signal, res.timed_out) == (0, 0, False), (out, err, res)

            if m.backend.name == "docker":
                out, err, res = await sh(m, sid, 'for d in /proc/[0-9]*; do [ "$(stat -c %u $d)" = "$(id -u)" ] || grep "Max cpu time" $d/limits; done')
                lines = out.decode().splitlines()
                assert len(lines) == 2 and all(line.split()[3:5] == ["unlimited", "unlimited"] for line in lines), (out, err)

            out, _, res = await run(m, sid, ["cat", "keep.txt"])
            assert out == b"kept" and res.exit_code == 0
            await m.write_files(sid, {"after.txt": b"after"})
            assert (await m.read_files(sid, ["after.txt"])) == {"after.txt": b"after"}
        finally:
            await m.close(sid)

    loop.run(main())


# Spins for two seconds of wall time, then prints the CPU seconds it took and the wall.
SPIN = (
    "import os, time\n"
    "start = time.monotonic()\n"
    "while time.monotonic() - start < 2.0:\n"
    "    pass\n"
    "t = os.times()\n"
    "print(t.user + t.system, time.monotonic() - start)\n"
)


RLIMITS_PRINTED = (
    "import resource\n"
    "print(*(resource.getrlimit(getattr(resource, 'RLIMIT_' + n)) for n in ('CPU', 'FSIZE', 'NOFILE', 'AS', 'CORE')))\n"
)


def test_a_command_has_the_same_per_process_limits_on_both_backends(env: tuple[Loop, SandboxManager]) -> None:
    """Every process an exec starts has the sandbox's per-process limits, soft and hard
    alike, on both backends: CPU time, file size (``max_file_bytes``: a write past it fails
    and the writer dies of SIGXFSZ), open files, address space (twice the sandbox's memory
    cgroup limit), and no core dumps. Docker set only the CPU one: a command there wrote
    one file as large as the disk and held 20,000 files open."""
    loop, m = env
    limits = m.default_limits.merged(max_file_bytes=1 << 20)

    async def main() -> None:
        sid = (await m.create(limits=limits)).sandbox_id
        try:
            out, err, res = await run(m, sid, ["python3", "-c", RLIMITS_PRINTED])
            assert res.exit_code == 0, err
            from services.envsandbox import docker_backend, process_backend

            cgroup_memory = {"process": process_backend.memory_limit, "docker": docker_backend.memory_limit}[m.backend.name](limits)
            want = [limits.cpu_seconds, limits.max_file_bytes, 1024, 2 * cgroup_memory, 0]
            assert out.decode().strip() == " ".join(f"({int(v)}, {int(v)})" for v in want), out
            out, err, res = await sh(m, sid, "head -c 3000000 /dev/zero > big; echo status=$?; python3 -c \"import os; print(os.path.getsize('big'))\"")
            assert out == b"status=153\n1048576\n", (out, err, res)  # 128 + SIGXFSZ
        finally:
            await m.close(sid)

    loop.run(main())


def test_cpus_bounds_the_cpu_a_sandbox_gets_over_wall_time(env: tuple[Loop, SandboxManager]) -> None:
    """``cpus`` is the sandbox's share of the CPU (the cgroup's quota on the process backend,
    Docker's nano_cpus): a command that spins for two seconds of wall time with cpus=0.25
    gets about half a second of CPU, never a whole core's two."""
    loop, m = env

    async def main() -> None:
        sid = (await m.create(limits=m.default_limits.merged(cpus=0.25))).sandbox_id
        try:
            out, err, res = await run(m, sid, ["python3", "-c", SPIN], timeout_s=30)
            assert res.exit_code == 0, (out, err, res)
            cpu, wall = map(float, out.split())
            assert cpu <= 0.25 * wall + 0.35, f"{cpu:.2f} s of CPU in {wall:.2f} s with cpus=0.25"
        finally:
            await m.close(sid)

    loop.run(main())


def test_a_command_gets_its_environment_and_signal_dispositions_as_asked(env: tuple[Loop, SandboxManager]) -> None:
    """What sets the CPU limit before the command (Docker's is a Python process) leaves no
    trace in it: the environment exactly as asked (a name no shell keeps, and no LC_CTYPE,
    which Python adds to its own where LANG is C), SIGPIPE and SIGXFSZ not ignored (Python
    ignores both, and exec keeps them ignored), and a command that is not there ends 127
    with the same message on both backends."""
    loop, m = env

    async def main() -> None:
        sid = (await m.create()).sandbox_id
        try:
            out, err, res = await run(m, sid, ["env"], env={"LANG": "C", "ODD-NAME": "x y"})
            lines = out.decode().splitlines()
            assert res.exit_code == 0 and "ODD-NAME=x y" in lines and "LANG=C" in lines, (out, err)
            assert not [line for line in lines if line.startswith(("LC_", "PYTHON")) and line != "PYTHONDONTWRITEBYTECODE=1"], out

            out, err, res = await run(m, sid, ["grep", "^SigIgn", "/proc/self/status"])
            ignored = int(out.split()[1], 16)
            assert res.exit_code == 0 and not ignored & (1 << (13 - 1) | 1 << (25 - 1)), (out, err)  # SIGPIPE, SIGXFSZ

            out, err, res = await run(m, sid, ["no-such-command", "x"])
            assert (res.exit_code, res.signal) == (127, 0) and b"no-such-command: No such file or directory" in err, (out, err, res)
        finally:
            await m.close(sid)

    loop.run(main())


def test_a_full_disk_leaves_the_sandbox_its_memory(env: tuple[Loop, SandboxManager]) -> None:
    """memory_bytes is what a sandbox's processes may use and disk_bytes what its files may
    take: one must not eat the other. Tmpfs pages (and a tmpfs's inodes) are charged to the
    memory cgroup of whoever writes them, so a workspace and /tmp filled to their caps
    (bytes and inodes) with a disk as large as the memory once took the whole memory
    limit: the next command was OOM-killed, and on Docker the file helper too (ReadFiles
    and RunTests answered UNAVAILABLE). With a full disk a command still gets its memory,
    file operations work and the tests run and score."""
    loop, m = env
    task = TaskSuite.builtin().get("python/add")
    limits = Limits(memory_bytes=64 << 20, max_pids=64, disk_bytes=64 << 20, wall_seconds=60)
    fill = (
        "cat /dev/zero > fill 2>/dev/null; cat /dev/zero > /tmp/fill 2>/dev/null;"
        " i=0; while true 2>/dev/null > f$i; do i=$((i+1)); done;"
        " i=0; while true 2>/dev/null > /tmp/f$i; do i=$((i+1)); done"
    )
    # 48 MiB of touched memory on top of the interpreter: most of the memory limit.
    hold = "import os\nheld = b'x' * (48 << 20)\nprint(os.path.getsize('fill') >> 20, len(held) >> 20)\n"

    async def main() -> None:
        box = await m.create(task=task, files={p: c.encode() for p, c in task.reference.items()}, limits=limits)
        sid = box.sandbox_id
        try:
            _, err, res = await sh(m, sid, fill, timeout_s=60)
            assert res.signal == 0 and not res.oom_killed, (res, err)
            out, err, res = await run(m, sid, ["python3", "-c", hold], timeout_s=60)
            assert res.exit_code == 0 and not res.oom_killed, (res, err)
            filled, held = (int(n) for n in out.split())
            assert filled >= 48 and held == 48, out  # the workspace is (about) full, the memory held
            await _reads_and_scores_its_reference(m, sid, task)
        finally:
            await m.close(sid)

    loop.run(main())


#: Makes System V shared memory segments of 32 MiB, touching each (attached one at a time:
#: the process backend caps address space), and leaves them behind: a GiB if nothing
#: removes them, so the memory limit OOM-kills it on the way.
SYSV_SEGMENTS = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
size = 32 << 20
for _ in range(32):
    shmid = libc.shmget(0, ctypes.c_size_t(size), 0o1600)
    assert shmid >= 0, ctypes.get_errno()
    addr = libc.shmat(shmid, None, 0)
    assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
    ctypes.memset(addr, 1, size)
    libc.shmdt(ctypes.c_void_p(addr))
"""

# A segment nothing holds any more is gone at once, within the command that left it, not
# later: on the process backend it used to wait for the exec's IPC namespace, which the
# kernel frees on a work queue after the exec returned, still charged to the sandbox.
SYSV_GONE_AT_DETACH = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
shmid = libc.shmget(0, ctypes.c_size_t(1 << 20), 0o1600)
addr = libc.shmat(shmid, None, 0)
ctypes.memset(addr, 1, 1 << 20)
libc.shmdt(ctypes.c_void_p(addr))
stat = ctypes.create_string_buffer(512)
print("gone" if libc.shmctl(shmid, 2, stat) == -1 else "still there")
"""


def test_shared_memory_works_and_never_takes_the_sandboxs_memory(env: tuple[Loop, SandboxManager]) -> None:
    """/dev/shm is a small tmpfs of the sandbox's own on both backends (multiprocessing's
    locks need it: the process backend once had none, and `multiprocessing.Lock()` failed),
    and its room comes on top of the memory like the workspace's. Docker's default one (64
    MiB, no inode cap) once took the whole memory limit when filled with bytes and empty
    files, so the filler, the next command, the file helper and the tests were killed. A
    System V segment dies as soon as no process holds it (on Docker the container's IPC
    namespace outlives every exec: a segment filled up to the memory limit stayed,
    charged, and the next command's 48 MiB was OOM-killed; on the process backend it went
    with the exec's IPC namespace, which the kernel frees a moment after the exec returned,
    and on a loaded machine the next command was OOM-killed all the same)."""
    loop, m = env
    task = TaskSuite.builtin().get("python/add")
    limits = Limits(memory_bytes=64 << 20, max_pids=64, disk_bytes=64 << 20, wall_seconds=60)
    lock = "import multiprocessing as mp\nmp.Lock()\nprint('locked')\n"
    fill = "cat /dev/zero > /dev/shm/fill 2>/dev/null; i=0; while true 2>/dev/null > /dev/shm/f$i; do i=$((i+1)); done"
    hold = "import os\nheld = b'x' * (48 << 20)\nst = os.statvfs('/dev/shm')\nprint(st.f_bfree, st.f_ffree, len(held) >> 20)\n"

    async def main() -> None:
        box = await m.create(task=task, files={p: c.encode() for p, c in task.reference.items()}, limits=limits)
        sid = box.sandbox_id
        try:
            out, err, res = await run(m, sid, ["python3", "-c", lock], timeout_s=60)
            assert res.exit_code == 0 and out == b"locked\n", (res, err)
            out, err, res = await run(m, sid, ["python3", "-c", SYSV_GONE_AT_DETACH], timeout_s=60)
            assert out == b"gone\n", (out, err, res)
            _, err, res = await sh(m, sid, fill, timeout_s=60)
            assert res.signal == 0 and not res.oom_killed, (res, err)
            _, err, res = await run(m, sid, ["python3", "-c", SYSV_SEGMENTS], timeout_s=60)
            # Either OOM-killed on the way (a GiB in all), its segments as full as they got,
            # or done, where a segment goes as soon as nothing holds it (Docker's sysctl).
            assert not res.timed_out, (res, err)
            out, err, res = await run(m, sid, ["python3", "-c", hold], timeout_s=60)
            assert res.exit_code == 0 and not res.oom_killed, (res, err)
            assert out.split() == [b"0", b"0", b"48"], out  # /dev/shm full (bytes and inodes), the memory held
            await _reads_and_scores_its_reference(m, sid, task)
        finally:
            await m.close(sid)

    loop.run(main())


def _mount_options(mounts: str, path: str) -> set[str]:
    """The options of the mount ``path`` lies on, from /proc/mounts (the longest mount point above it)."""
    best, options = "", ""
    for line in mounts.splitlines():
        point, opts = line.split()[1], line.split()[3]
        if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, options = point, opts
    return set(options.split(","))


def test_a_program_the_sandbox_writes_runs_in_its_workspace_and_tmp(env: tuple[Loop, SandboxManager]) -> None:
    """An agent builds a program (a compiler's output, a script) and runs it: in /workspace
    and /tmp that works on both backends alike (Docker's tmpfs mounts are noexec unless
    asked, and the same program there ended 126 where the process backend ran it). No mount
    honours set-user-id programs or device nodes, and /dev/shm runs nothing, on either."""
    loop, m = env
    program = "printf '#!/bin/sh\\necho ran in %s\\n' {d} > {d}/prog && chmod +x {d}/prog && {d}/prog"

    async def main() -> None:
        sid = (await m.create()).sandbox_id
        try:
            for folder in ("/workspace", "/tmp"):
                out, err, res = await sh(m, sid, program.format(d=folder))
                assert (res.exit_code, out) == (0, f"ran in {folder}\n".encode()), (folder, res, err)
            _, _, res = await sh(m, sid, program.format(d="/dev/shm"))
            assert res.exit_code == 126, res
            mounts = (await run(m, sid, ["cat", "/proc/mounts"]))[0].decode()
            for folder in ("/workspace", "/tmp", "/dev/shm"):
                assert {"nosuid", "nodev"} <= _mount_options(mounts, folder), (folder, mounts)
        finally:
            await m.close(sid)

    loop.run(main())


@pytest.mark.parametrize("attack", list(MODE_ATTACKS))
def test_run_tests_scores_whatever_modes_the_sandbox_left(env: tuple[Loop, SandboxManager], attack: str) -> None:
    """After the sandbox changed the modes of its own workspace (or tried to remove or
    replace it), RunTests gives a real reward (1.0 where the tests, as the sandbox's user,
    can still read the solution; 0.0 where they cannot), never an error; the workspace's
    mode is left as the sandbox set it; Exec, WriteFiles, ReadFiles and Fork still work."""
    loop, m = env
    script, reward = MODE_ATTACKS[attack]
    task = TaskSuite.builtin().get("python/add")

    async def main() -> None:
        box = await m.create(task=task, files={"solution.py": task.reference["solution.py"].encode()})
        sid = box.sandbox_id
        try:
            _, err, res = await sh(m, sid, script)
            assert res.exit_code == 0, err
            mode = await _mode_of_workspace(m, sid)
            outcome, _, output = await m.run_tests(sid)
            assert outcome.reward == reward, output
            assert await _mode_of_workspace(m, sid) == mode
            with pytest.raises(NotFound):
                await m.read_files(sid, [".tests/test_solution.py"])
            _, _, res = await run(m, sid, ["true"])
            assert res.exit_code == 0
            await m.write_files(sid, {"probe/p.txt": b"probe"})
            assert await m.read_files(sid, ["probe/p.txt"]) == {"probe/p.txt": b"probe"}
            assert await _mode_of_workspace(m, sid) == mode
            (copy,) = await m.fork(sid, 1)
            try:
                assert await _mode_of_workspace(m, copy.sandbox_id) == mode
                assert await m.read_files(copy.sandbox_id, ["probe/p.txt"]) == {"probe/p.txt": b"probe"}
            finally:
                await m.close(copy.sandbox_id)
        finally:
            await m.close(sid)

    loop.run(main())


# Entries their owner may not read, search or change, and a workspace only root could list.
LOCKED_WORKSPACE = (
    "mkdir -p box/locked/sub box/ro/deep box/wx && echo in > box/locked/sub/in.txt && echo s > box/secret && "
    "echo r > box/ro/deep/r.txt && echo x > box/wx/x.txt && echo old > box/ro/old.txt && "
    "chmod 0 box/secret box/locked/sub/in.txt box/locked/sub box/locked && chmod 444 box/ro/old.txt && "
    "chmod 555 box/ro/deep box/ro && chmod 300 box/wx && chmod 0 /workspace"
)


def test_fork_copies_a_workspace_whatever_its_modes(env: tuple[Loop, SandboxManager]) -> None:
    """A workspace whose folder and entries their owner may not read or search forks into
    the same tree, the workspace folder's mode included; the source keeps every mode."""
    loop, m = env
    sid = loop.run(m.create()).sandbox_id
    try:
        _, err, res = loop.run(sh(m, sid, LOCKED_WORKSPACE))
        assert res.exit_code == 0, err
        (copy,) = loop.run(m.fork(sid, 1))
        try:
            assert loop.run(_mode_of_workspace(m, sid)) == "0"
            assert loop.run(_mode_of_workspace(m, copy.sandbox_id)) == "0"
            for each in (sid, copy.sandbox_id):
                loop.run(sh(m, each, "chmod 755 /workspace"))
            source = _manifest(loop, m, sid, "box")
            assert "'locked' 'dir' 0 " in " ".join(source).replace("b'", "'"), source
            assert _manifest(loop, m, copy.sandbox_id, "box") == source
        finally:
            loop.run(m.close(copy.sandbox_id))
    finally:
        loop.run(m.close(sid))


def test_file_operations_work_whatever_modes_the_sandbox_left(env: tuple[Loop, SandboxManager]) -> None:
    """WriteFiles writes into folders the sandbox made read-only or unreadable, over files
    it made read-only, and in a workspace folder it made unreadable; ReadFiles reads what
    the sandbox made unreadable. Every mode stays as the sandbox left it (a written file has
    WriteFiles' mode), the same on both backends; a symlink the sandbox planted to a locked
    folder of its own is neither followed nor changed."""
    loop, m = env

    async def main() -> None:
        box = await m.create()
        sid = box.sandbox_id
        try:
            plant = "mkdir /tmp/own && echo own > /tmp/own/o.txt && chmod 0 /tmp/own && ln -s /tmp/own box/link && "
            _, err, res = await sh(m, sid, "mkdir box && " + plant + LOCKED_WORKSPACE)
            assert res.exit_code == 0, err
            written = {
                "box/ro/new.txt": b"new", "box/ro/old.txt": b"replaced", "box/ro/deep/more/m.txt": b"m",
                "box/locked/sub/w.txt": b"w", "box/wx/x.txt": b"x2", "top.txt": b"t",
            }
            await m.write_files(sid, written)
            read = await m.read_files(sid, [*written, "box/secret", "box/locked/sub/in.txt", "box/ro/deep/r.txt"])
            assert read == {**written, "box/secret": b"s\n", "box/locked/sub/in.txt": b"in\n", "box/ro/deep/r.txt": b"r\n"}
            for path in ("box/link/o.txt", "box/link/new.txt"):
                with pytest.raises((InvalidArgument, NotFound)):
                    await m.read_files(sid, [path])
                with pytest.raises(InvalidArgument):
                    await m.write_files(sid, {path: b"x"})
            await m.backend.remove(sid, "box/wx")
            modes, err, res = await sh(
                m, sid,
                "stat -c '%a %n' /workspace /tmp/own; chmod 755 /workspace; "
                "stat -c '%a %n' box/ro box/ro/deep box/ro/old.txt box/ro/new.txt box/ro/deep/more box/ro/deep/more/m.txt box/locked top.txt; "
                "chmod 700 box/locked box/locked/sub; stat -c '%a %n' box/locked/sub/in.txt box/locked/sub/w.txt; ls box",
            )
            assert res.exit_code == 0, err
            assert modes.decode().split("\n") == [
                "0 /workspace", "0 /tmp/own",
                "555 box/ro", "555 box/ro/deep", "644 box/ro/old.txt", "644 box/ro/new.txt", "755 box/ro/deep/more",
                "644 box/ro/deep/more/m.txt", "0 box/locked", "644 top.txt",
                "0 box/locked/sub/in.txt", "644 box/locked/sub/w.txt",
                "link", "locked", "ro", "secret", "",
            ]
        finally:
            await m.close(sid)

    loop.run(main())


def test_a_file_operation_past_its_time_gives_the_modes_back(env: tuple[Loop, SandboxManager], monkeypatch: pytest.MonkeyPatch) -> None:
    """The Docker backend's file helper works as the sandbox's user and gives itself owner
    bits the sandbox took away for the step that needs them. One that runs past its time
    (here a removal of 20,000 files in a folder the sandbox made read-only, in a sandbox
    with 2 % of a CPU, against a limit lowered to 6 s) is not killed holding them: it
    stops itself before the host's limit, gives the modes back and answers UNAVAILABLE.
    The process backend works as root and never changes a mode."""
    loop, m = env
    if m.backend.name != "docker":
        pytest.skip("only the Docker backend's file helper gives itself owner bits (the process backend works as root)")
    from meridian.errors import Unavailable
    from services.envsandbox import docker_backend

    limit = 6.0
    monkeypatch.setattr(docker_backend, "FILES_OP_S", limit, raising=False)
    monkeypatch.setattr(docker_backend, "FILES_UNWIND_S", limit - 1.0, raising=False)
    collect_in = m.backend._run_collect  # type: ignore[attr-defined]

    async def within_limit(sid: str, argv: list[str], stdin: bytes, wall_s: float, max_output: int):  # type: ignore[no-untyped-def]
        return await collect_in(sid, argv, stdin, min(wall_s, limit), max_output)

    monkeypatch.setattr(m.backend, "_run_collect", within_limit)
    slow = Limits(memory_bytes=256 << 20, max_pids=64, disk_bytes=96 << 20, wall_seconds=120, cpus=0.02)
    sid = loop.run(m.create(limits=slow)).sandbox_id
    try:
        build = "import os\nos.makedirs('box/big')\nfor i in range(20000):\n    open('box/big/f%d' % i, 'w').close()\nos.chmod('box', 0o500)\n"
        _, err, res = loop.run(run(m, sid, ["python3", "-c", build], timeout_s=120))
        assert res.exit_code == 0, err
        with pytest.raises(Unavailable):
            loop.run(m.backend.remove(sid, "box/big"))
        out, err, res = loop.run(sh(m, sid, "stat -c '%a' box"))
        assert out == b"500\n", (out, err)
    finally:
        loop.run(m.close(sid))
