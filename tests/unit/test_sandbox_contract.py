"""One contract, two backends: the process backend and the Docker backend (a private,
real dockerd started here) must behave the same, also under hostile input.

Docker tests are skipped only when dockerd is not installed; with dockerd present they run
(a failing daemon start is an error, not a skip).
"""
from __future__ import annotations

import asyncio
import os
import shutil
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from meridian.errors import InvalidArgument, NotFound, ResourceExhausted
from services.envsandbox.sandbox import Backend, ExecResult, Limits, SandboxManager, collect
from services.envsandbox.tasks import TaskSuite

BACKENDS = ["process", "docker"]
SECRET_ENV = "MERIDIAN_TEST_SERVICE_SECRET"


@pytest.fixture(scope="module")
def dockerd_url() -> Iterator[str]:
    if shutil.which("dockerd") is None:
        pytest.skip("dockerd is not installed (apt package docker.io): docker backend not tested")
    from services.envsandbox.dockerd import private_dockerd

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
    manager = SandboxManager(backend, default_limits=Limits(memory_bytes=256 << 20, max_pids=64, disk_bytes=32 << 20, wall_seconds=10), max_sandboxes=3)
    loop.run(manager.start())
    try:
        yield loop, manager
    finally:
        loop.run(manager.close_all())
        loop.close()


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
    loop, m, attacker, bystander = pair
    _, _, res = loop.run(run(m, attacker, ["python3", "-c", "a = []\nwhile True: a.append(bytearray(16 << 20))"], timeout_s=8))
    assert res.exit_code != 0 and not res.timed_out
    assert res.signal == 9 or res.exit_code == 1  # OOM-killed, or MemoryError under the address-space limit
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
    threading.Thread(target=lambda: accepted.append(listener.accept()), daemon=True).start()
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
        listener.close()
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
