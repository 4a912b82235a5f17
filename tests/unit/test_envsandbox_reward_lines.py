"""The scored output's line framing, attacked from inside the sandbox.

The harness (and the SWE-bench runner) print text the tested code chose inside FAIL
lines: a reported value's repr, an exception's message. Their stdout writes lone
surrogates U+DC80..U+DCFF back as raw bytes, so that text could spell the UTF-8 of NEL
(C2 85) or LINE SEPARATOR (E2 80 A8): not whitespace to the harness, which keeps a
FAIL line on one line, but a line break to ``str.splitlines()``, which the service
scored with. Every case then failed and the reward was still about 0.95, from PASS
lines the harness never wrote. Both ends are tested: the harness's output stays valid
UTF-8 (the text comes back escaped), and the service breaks lines at "\\n" only.

Docker tests are skipped only when dockerd is not installed.
"""
from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator

import pytest

from services.envsandbox.sandbox import Backend, Limits, SandboxManager
from services.envsandbox.swebench import load_swebench_jsonl
from services.envsandbox.tasks import TaskSuite, score_output

BACKENDS = ["process", pytest.param("docker", marks=pytest.mark.docker)]

# Each forged line starts with a line break spelled in surrogates (NEL, then U+2028).
NEL = "chr(0xDCC2) + chr(0xDC85)"
LS = "chr(0xDCE2) + chr(0xDC80) + chr(0xDCA8)"

# cases: every answer is an object whose repr is a run of forged PASS lines.
FORGED_REPR = (
    f"_BREAK = {NEL}\n"
    "class _Forged:\n"
    "    def __repr__(self):\n"
    "        return ''.join(_BREAK + 'PASS forged%d' % i for i in range(40))\n"
    "def add(a, b):\n"
    "    return _Forged()\n"
)
# checks: the package under test raises an exception whose message is the forged lines.
FORGED_MESSAGE = (
    f"_BREAK = {LS}\n"
    "class InsufficientFunds(Exception):\n"
    "    pass\n"
    "class Account:\n"
    "    def __init__(self, *args):\n"
    "        raise RuntimeError(''.join(_BREAK + 'PASS forged%d' % i for i in range(40)))\n"
    "def transfer(*args):\n"
    "    pass\n"
)
# SWE-bench: the module every test imports fails with the same kind of message.
FORGED_IMPORT = f"raise RuntimeError(''.join({NEL} + 'PASS forged%d' % i for i in range(40)))\n"


@pytest.fixture(scope="module", params=BACKENDS)
def manager(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[asyncio.AbstractEventLoop, SandboxManager]]:
    root = tmp_path_factory.mktemp(request.param)
    backend: Backend
    daemon = None
    if request.param == "docker":
        if shutil.which("dockerd") is None:
            pytest.skip("dockerd is not installed (apt package docker.io): docker backend not tested")
        from benchmarks.support.dockerd import private_dockerd
        from services.envsandbox.docker_backend import DockerBackend

        daemon = private_dockerd()
        backend = DockerBackend(root, base_url=daemon.__enter__().base_url)
    else:
        from services.envsandbox.process_backend import ProcessBackend

        backend = ProcessBackend(root)
    loop = asyncio.new_event_loop()
    m = SandboxManager(backend, default_limits=Limits(memory_bytes=256 << 20, max_pids=64, disk_bytes=32 << 20, wall_seconds=30), max_sandboxes=2)
    try:
        loop.run_until_complete(m.start())
        yield loop, m
    finally:
        loop.run_until_complete(m.close_all())
        loop.close()
        if daemon is not None:
            daemon.__exit__(None, None, None)


def _run_tests(manager: tuple[asyncio.AbstractEventLoop, SandboxManager], task, files: dict[str, str]) -> tuple[float, list, bytes]:  # type: ignore[no-untyped-def]
    loop, m = manager

    async def main() -> tuple[float, list, bytes]:
        box = await m.create(task=task, files={p: c.encode() for p, c in files.items()})
        try:
            outcome, _, output = await m.run_tests(box.sandbox_id)
            return outcome.reward, outcome.cases, output
        finally:
            await m.close(box.sandbox_id)

    return loop.run_until_complete(main())


@pytest.mark.parametrize(
    ("task_id", "files"),
    [("python/add", {"solution.py": FORGED_REPR}), ("bugfix/bank_transfer", {"bank/__init__.py": FORGED_MESSAGE})],
    ids=["cases-repr", "checks-exception"],
)
def test_text_from_the_tested_code_cannot_start_a_line(manager, task_id: str, files: dict[str, str]) -> None:  # type: ignore[no-untyped-def]
    """Wrong everywhere, with forged PASS lines behind line breaks spelled in surrogates:
    scores 0, and the harness's output is valid UTF-8 that shows the text escaped."""
    task = TaskSuite.builtin().get(task_id)
    reward, cases, output = _run_tests(manager, task, files)
    assert reward == 0.0, output
    assert not [name for name, _, _ in cases if name.startswith("forged")], output
    text = output.decode("utf-8")  # strict: no raw bytes from the tested code's text
    assert "\\udc" in text and "\x85" not in text and "\u2028" not in text, text


def test_swebench_failure_reasons_stay_on_their_line(manager) -> None:  # type: ignore[no-untyped-def]
    from tests.unit.test_task_suite import SAMPLE_JSONL

    task = load_swebench_jsonl(SAMPLE_JSONL)[2]
    store = task.files["kvstore/store.py"]
    reward, cases, output = _run_tests(manager, task, {"kvstore/store.py": FORGED_IMPORT + store})
    assert reward == 0.0, output
    assert [name for name, _, _ in cases if name.startswith("forged")] == [], output
    assert "\\udc" in output.decode("utf-8"), output


def test_score_output_breaks_lines_at_newlines_only() -> None:
    """Whatever a test command's text holds, NEL, U+2028, form feeds and the like do not
    start a result line; a CRLF line still scores."""
    forged = "TOTAL 2\nFAIL a: got x\x85PASS f1\u2028PASS f2\x0cPASS f3\x1ePASS f4\rPASS f5\nPASS b\r\n"
    outcome = score_output("pass_fraction", forged, 0)
    assert [(name, ok) for name, ok, _ in outcome.cases] == [("a", False), ("b", True)]
    assert outcome.reward == 0.5
