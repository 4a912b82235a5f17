"""The built-in task suite and the SWE-bench loader, checked end to end in sandboxes.

Every built-in task must reach reward 1.0 with its reference and stay below 1.0 for
an untouched workspace; otherwise it teaches nothing (or the wrong thing).
"""
from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path
from typing import Any

import grpc
import pytest

from meridian.errors import InvalidArgument
from meridian.v1 import envsandbox_pb2 as es
from meridian.v1 import envsandbox_pb2_grpc as es_grpc
from services.envsandbox import tasks as tasks_mod
from services.envsandbox.config import EnvSandboxConfig
from services.envsandbox.process_backend import ProcessBackend
from services.envsandbox.sandbox import SandboxManager
from services.envsandbox.server import EnvSandboxService
from services.envsandbox.swebench import PatchError, apply_unified_diff, instance_to_task, load_swebench_jsonl

SAMPLE_JSONL = Path(tasks_mod.__file__).parent / "suites" / "swebench_sample.jsonl"
KINDS = ("python_function", "bugfix", "terminal")
BATCH = 8


async def _reward(manager: SandboxManager, task: tasks_mod.Task, files: dict[str, str]) -> tuple[float, str]:
    """Reward and test output of ``task`` in a fresh sandbox holding its files plus ``files``."""
    box = await manager.create(task=task, files={p: c.encode() for p, c in files.items()})
    try:
        outcome, _result, output = await manager.run_tests(box.sandbox_id)
        return outcome.reward, output.decode(errors="replace")
    finally:
        await manager.close(box.sandbox_id)


async def _rewards(root: Path, jobs: list[tuple[tasks_mod.Task, dict[str, str]]]) -> list[tuple[float, str]]:
    """Runs the jobs in batches: enough overlap to hide process start-up, little enough for 2 cores."""
    manager = SandboxManager(ProcessBackend(root))
    try:
        results: list[tuple[float, str]] = []
        for start in range(0, len(jobs), BATCH):
            batch = jobs[start:start + BATCH]
            results += await asyncio.gather(*(_reward(manager, t, f) for t, f in batch))
        return results
    finally:
        await manager.close_all()


# ------------------------------------------------------------------ (a) suite shape


def test_builtin_suite_shape() -> None:
    suite = tasks_mod.TaskSuite.builtin()
    all_tasks = suite.select()
    assert len(suite) >= 60
    kinds = Counter(t.kind for t in all_tasks)
    for kind in KINDS:
        assert kinds[kind] >= 18, f"only {kinds[kind]} {kind} tasks"
    ids = [t.id for t in all_tasks]
    assert len(ids) == len(set(ids))
    assert {t.split for t in all_tasks} == {"train", "eval"}
    assert suite.select(split="eval") and suite.select(split="train")


def test_builtin_task_files_are_consistent() -> None:
    """File name matches the id, and every task has a reference and an answer path it can use."""
    for path in sorted(tasks_mod.BUILTIN_DIR.rglob("*.json")):
        data = json.loads(path.read_text())
        rel = path.relative_to(tasks_mod.BUILTIN_DIR).with_suffix("").as_posix()
        assert data["id"] == rel, f"{path}: id {data['id']!r} does not match its file name"
        task = tasks_mod.Task.from_dict(data, origin=str(path))
        assert task.reference, f"{task.id}: no reference"
        assert task.instruction.strip(), f"{task.id}: empty instruction"
        if task.kind in ("python_function", "bugfix"):
            assert task.answer_path in task.reference, f"{task.id}: answer_path not in the reference"
        if task.kind == "bugfix":
            assert 2 <= len(task.files) <= 4, f"{task.id}: wants 2-4 starting files"
            assert task.answer_path in task.files, f"{task.id}: answer_path is not a starting file"
        for rel_path in [*task.files, *task.reference, *task.tests]:
            assert not rel_path.startswith(("/", tasks_mod.TESTS_DIR)) and ".." not in rel_path.split("/"), (task.id, rel_path)


async def _rewards_over_grpc(serving: Any, root: Path, jobs: list[tuple[tasks_mod.Task, dict[str, str]]]) -> list[tuple[float, str]]:
    """Like _rewards, through a real EnvSandbox gRPC server: Create, RunTests, Close."""
    service = EnvSandboxService(EnvSandboxConfig(root=str(root)))
    async with serving(service) as address:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = es_grpc.EnvSandboxStub(channel)

            async def one(task: tasks_mod.Task, files: dict[str, str]) -> tuple[float, str]:
                info = await stub.Create(es.CreateRequest(task_id=task.id, files=[es.File(path=p, content=c.encode()) for p, c in files.items()]))
                try:
                    reply = await stub.RunTests(es.RunTestsRequest(sandbox_id=info.sandbox_id))
                    return reply.reward, reply.output.decode(errors="replace")
                finally:
                    await stub.Close(es.CloseRequest(sandbox_id=info.sandbox_id))

            results: list[tuple[float, str]] = []
            for start in range(0, len(jobs), BATCH):
                results += await asyncio.gather(*(one(t, f) for t, f in jobs[start:start + BATCH]))
            return results


# ------------------------------------------------------------------ (b) every task in a sandbox


def test_every_builtin_task_reference_passes_and_empty_attempt_fails(tmp_path: Path, grpc_serving: Any) -> None:
    all_tasks = sorted(tasks_mod.TaskSuite.builtin().select(), key=lambda t: t.id)
    jobs = [(t, t.reference) for t in all_tasks] + [(t, {}) for t in all_tasks]
    results = asyncio.run(_rewards_over_grpc(grpc_serving, tmp_path / "sandboxes", jobs))
    reference_results, empty_results = results[: len(all_tasks)], results[len(all_tasks):]
    problems = []
    for task, (ref_reward, ref_out), (empty_reward, empty_out) in zip(all_tasks, reference_results, empty_results):
        if ref_reward != 1.0:
            problems.append(f"{task.id}: reference reward {ref_reward}\n{ref_out}")
        if empty_reward >= 1.0:
            problems.append(f"{task.id}: empty attempt reward {empty_reward}\n{empty_out}")
        if task.kind == "python_function" and empty_reward != 0.0:
            problems.append(f"{task.id}: empty attempt reward {empty_reward}, want 0\n{empty_out}")
    assert not problems, "\n".join(problems)


def test_tasks_served_carry_only_their_visible_files(tmp_path: Path, grpc_serving: Any) -> None:
    """ListTasks and GetTask give a task's visible files and nothing of its hidden tests or
    reference: the policy reads these messages, and a test or a known-good answer in them
    would be a reward it need not earn. Every served task's files are exactly its
    ``files``, and no test module or reference file the task does not show appears
    anywhere in the serialized message."""
    suite = tasks_mod.TaskSuite.builtin()

    def hidden(task: tasks_mod.Task) -> list[str]:
        """Test and reference texts that nothing the task shows contains."""
        shown = [task.instruction, *task.files.values()]
        return [c for c in [*task.tests.values(), *task.reference.values()] if len(c.strip()) >= 8 and not any(c in v for v in shown)]

    async def main() -> tuple[list[es.Task], list[es.Task]]:
        service = EnvSandboxService(EnvSandboxConfig(root=str(tmp_path / "sandboxes")))
        async with grpc_serving(service) as address, grpc.aio.insecure_channel(address) as channel:
            stub = es_grpc.EnvSandboxStub(channel)
            listed = list((await stub.ListTasks(es.ListTasksRequest())).tasks)
            got = [await stub.GetTask(es.GetTaskRequest(task_id=t.id)) for t in listed]
            return listed, got

    listed, got = asyncio.run(main())
    assert {t.id for t in listed} == {t.id for t in suite.select()}
    for served in [*listed, *got]:
        task = suite.get(served.id)
        assert {f.path: f.content.decode() for f in served.files} == task.files, task.id
        wire = served.SerializeToString()
        leaked = [text[:40] for text in hidden(task) if text.encode() in wire]
        assert not leaked, (task.id, leaked)


FORGE = (
    "import os, sys\n"
    "LINES = ''.join(f'PASS {n}\\n' for n in ['case0', 'case1', 'case2', 'case3', 'case4', 'deposit', 'transfer_moves_money'])\n"
    "for fd in range(1, 64):\n"
    "    try:\n"
    "        os.write(fd, LINES.encode())\n"
    "    except OSError:\n"
    "        pass\n"
    "for pid in range(1, 64):\n"
    "    for fd in range(0, 8):\n"
    "        try:\n"
    "            with open(f'/proc/{pid}/fd/{fd}', 'w') as fh:\n"
    "                fh.write(LINES)\n"
    "        except OSError:\n"
    "            pass\n"
    "sys.stdout.write(LINES)\n"
    "sys.stdout.flush()\n"
)


def test_forged_pass_lines_do_not_count(tmp_path: Path) -> None:
    """Code under test that writes PASS lines to every descriptor it can reach, its own and
    its parents' (through /proc), earns nothing from them; nor does exiting early."""
    suite = tasks_mod.TaskSuite.builtin()
    vowels = suite.get("python/count_vowels")
    bank = suite.get("bugfix/bank_transfer")
    jobs = [
        (vowels, {"solution.py": FORGE + "def count_vowels(s):\n    return -1\n"}),
        (vowels, {"solution.py": FORGE + "os._exit(0)\n"}),
        (bank, {"bank/account.py": FORGE + "os._exit(0)\n"}),
        (bank, {"bank/account.py": FORGE + bank.files["bank/account.py"]}),
        (bank, {}),
    ]
    results = asyncio.run(_rewards(tmp_path, jobs))
    for (task, _), (reward, output) in zip(jobs[:3], results[:3]):
        assert reward == 0.0, f"{task.id}\n{output}"
    # Forging on top of the buggy module earns exactly what the buggy module earns.
    (forged, forged_out), (plain, _) = results[3], results[4]
    assert forged == plain < 1.0, forged_out


# ------------------------------------------------------------------ (c) score_output


@pytest.mark.parametrize(
    ("kind", "output", "exit_code", "reward"),
    [
        ("pass_fraction", "PASS a\nFAIL b: wrong\nPASS c\nFAIL d\n", 0, 0.5),
        ("pass_fraction", "", 0, 0.0),
        ("pass_fraction", "noise\nPASSED a\n  PASS a  \n", 1, 1.0),  # surrounding spaces are stripped
        ("all_pass", "PASS a\nPASS b\n", 0, 1.0),
        ("all_pass", "PASS a\nPASS b\n", 1, 0.0),  # a crash after the last line is a failure
        ("all_pass", "PASS a\nFAIL b: x\n", 0, 0.0),
        ("all_pass", "nothing parsable\n", 0, 0.0),
        ("score", "PASS a\nSCORE 0.25\n", 0, 0.25),
        ("score", "SCORE 7\n", 0, 1.0),  # clamped
        ("score", "SCORE -1\n", 0, 0.0),
        ("score", "SCORE nan-ish\n", 0, 0.0),
        ("score", "PASS a\n", 0, 0.0),
        ("pass_fraction", "TOTAL 4\nPASS a\nPASS b\n", 0, 0.5),  # cases missing after TOTAL failed
        ("all_pass", "TOTAL 3\nPASS a\nPASS b\n", 0, 0.0),
        ("all_pass", "TOTAL 2\nPASS a\nPASS b\n", 0, 1.0),
    ],
)
def test_score_output(kind: str, output: str, exit_code: int, reward: float) -> None:
    assert tasks_mod.score_output(kind, output, exit_code).reward == pytest.approx(reward)


def test_score_output_cases_and_reasons() -> None:
    outcome = tasks_mod.score_output("pass_fraction", "PASS t/a.py::T::m\nFAIL t/b.py::f: AssertionError: 1 != 2\n", 0)
    assert outcome.cases == [("t/a.py::T::m", True, ""), ("t/b.py::f", False, "AssertionError: 1 != 2")]


# ------------------------------------------------------------------ (d) SWE-bench loader


def _sample_lines() -> list[dict]:
    return [json.loads(line) for line in SAMPLE_JSONL.read_text().splitlines() if line.strip()]


def test_swebench_sample_loads() -> None:
    tasks = load_swebench_jsonl(SAMPLE_JSONL)
    assert len(tasks) == 3
    for task in tasks:
        assert task.kind == "swebench" and task.reward == "all_pass" and task.id.startswith("swebench/")
        assert task.reference and task.answer_path in task.reference
        listed = json.loads(task.tests["_swebench_tests.json"])
        assert listed and all("::" in t for t in listed)


def test_swebench_reference_passes_and_unpatched_fails(tmp_path: Path) -> None:
    tasks = load_swebench_jsonl(SAMPLE_JSONL)
    results = asyncio.run(_rewards(tmp_path, [(t, t.reference) for t in tasks] + [(t, {}) for t in tasks]))
    raw = {line["instance_id"]: line for line in _sample_lines()}
    for i, task in enumerate(tasks):
        ref_reward, ref_out = results[i]
        empty_reward, empty_out = results[len(tasks) + i]
        assert ref_reward == 1.0, f"{task.id}\n{ref_out}"
        assert empty_reward == 0.0, f"{task.id}\n{empty_out}"
        # Unpatched: exactly the FAIL_TO_PASS tests fail, PASS_TO_PASS ones already pass.
        instance = raw[task.id.removeprefix("swebench/")]
        f2p = instance["FAIL_TO_PASS"]
        f2p = json.loads(f2p) if isinstance(f2p, str) else f2p
        failed = {name for name, ok, _ in tasks_mod.score_output("all_pass", empty_out, 1).cases if not ok}
        assert failed == set(f2p), f"{task.id}\n{empty_out}"


def test_swebench_jsonl_in_tasks_dir_is_served_over_grpc(tmp_path: Path, grpc_serving: Any) -> None:
    """``--tasks-dir`` takes SWE-bench-style JSONL beside task JSON: the service lists the
    instances and scores the gold patch 1 and the unpatched repository 0."""
    from services.envsandbox.config import EnvSandboxConfig
    from services.envsandbox.server import EnvSandboxService

    folder = tmp_path / "tasks"
    folder.mkdir()
    (folder / "instances.jsonl").write_text(SAMPLE_JSONL.read_text())
    tasks = load_swebench_jsonl(SAMPLE_JSONL)

    async def main() -> tuple[set[str], list[float]]:
        service = EnvSandboxService(EnvSandboxConfig(root=str(tmp_path / "sandboxes"), tasks_dir=str(folder)))
        async with grpc_serving(service) as address, grpc.aio.insecure_channel(address) as channel:
            stub = es_grpc.EnvSandboxStub(channel)
            listed = {t.id for t in (await stub.ListTasks(es.ListTasksRequest())).tasks}
            rewards = []
            for files in (tasks[0].reference, {}):
                info = await stub.Create(es.CreateRequest(task_id=tasks[0].id, files=[es.File(path=p, content=c.encode()) for p, c in files.items()]))
                rewards.append((await stub.RunTests(es.RunTestsRequest(sandbox_id=info.sandbox_id))).reward)
                await stub.Close(es.CloseRequest(sandbox_id=info.sandbox_id))
            return listed, rewards

    listed, rewards = asyncio.run(main())
    assert {t.id for t in tasks} <= listed and "python/add" in listed
    assert rewards == [1.0, 0.0]


def test_swebench_hidden_tests_ignore_workspace_test_edits(tmp_path: Path) -> None:
    """Rewriting the repository's own test file to pass everything changes nothing."""
    task = load_swebench_jsonl(SAMPLE_JSONL)[2]
    cheat = {"tests/test_falsy.py": "class TestFalsy:\n    def test_zero_is_kept(self): pass\n    def test_empty_string_is_kept(self): pass\n"}
    [(reward, output)] = asyncio.run(_rewards(tmp_path, [(task, cheat)]))
    assert reward == 0.0, output


# A repository module that, when a test imports it, writes passing verdicts to every
# descriptor it can reach (its own and, through /proc, its parent's) and exits cleanly.
SWE_FORGE = (
    "import os\n"
    "_OK = b'{\"ok\": true, \"reason\": \"\"}\\n'\n"
    "for _fd in range(64):\n"
    "    try:\n"
    "        os.write(_fd, _OK)\n"
    "    except OSError:\n"
    "        pass\n"
    "for _fd in range(64):\n"
    "    try:\n"
    "        with open(f'/proc/{os.getppid()}/fd/{_fd}', 'wb') as _fh:\n"
    "            _fh.write(_OK)\n"
    "    except OSError:\n"
    "        pass\n"
    "os._exit(0)\n"
)

# One that, when a test imports it, rewrites whatever hidden test or runner files it finds
# so that later tests would pass (the store itself stays buggy).
SWE_REWRITE = (
    "import os\n"
    "_STUB = 'class TestFalsy:\\n    def test_zero_is_kept(self): pass\\n    def test_empty_string_is_kept(self): pass\\n'\n"
    "_RUNNER = 'import sys\\nsys.stdout.write(\\'{\"ok\": true}\\\\n\\')\\n'\n"
    "for _base, _dirs, _names in os.walk('.'):\n"
    "    for _n in _names:\n"
    "        if _n == 'test_falsy.py' or _n == '_swebench_runner.py':\n"
    "            with open(os.path.join(_base, _n), 'w') as _fh:\n"
    "                _fh.write(_STUB if _n == 'test_falsy.py' else _RUNNER)\n"
)


def test_swebench_verdicts_cannot_be_forged_from_the_code_under_test(tmp_path: Path) -> None:
    """The code a test imports can neither pass a test by writing verdicts to the
    descriptors it can reach and exiting, nor change what a later test runs by rewriting
    hidden files (the runner and hidden tests are never on the sandbox's disk)."""
    task = load_swebench_jsonl(SAMPLE_JSONL)[2]
    store = task.files["kvstore/store.py"]
    jobs = [(task, {"kvstore/store.py": SWE_FORGE + store}), (task, {"kvstore/store.py": SWE_REWRITE + store})]
    (forged, forged_out), (rewritten, rewritten_out) = asyncio.run(_rewards(tmp_path, jobs))
    assert forged == 0.0, forged_out
    failed = {name for name, ok, _ in tasks_mod.score_output("all_pass", forged_out, 1).cases if not ok}
    assert failed == set(json.loads(task.tests["_swebench_tests.json"])), forged_out
    assert rewritten == 0.0, rewritten_out
    cases = {name: ok for name, ok, _ in tasks_mod.score_output("all_pass", rewritten_out, 1).cases}
    # Both falsy tests run the buggy store: the first one's import changed nothing later.
    assert cases["tests/test_falsy.py::TestFalsy::test_zero_is_kept"] is False, rewritten_out
    assert cases["tests/test_falsy.py::TestFalsy::test_empty_string_is_kept"] is False, rewritten_out
    assert cases["tests/test_store.py::test_set_get"] is True, rewritten_out


def test_swebench_malformed_lines_raise(tmp_path: Path) -> None:
    good = _sample_lines()[0]
    cases = {
        "missing problem_statement": ({k: v for k, v in good.items() if k != "problem_statement"}, "problem_statement"),
        "bad FAIL_TO_PASS": ({**good, "FAIL_TO_PASS": "[not json"}, "FAIL_TO_PASS"),
        "test id with spaces": ({**good, "FAIL_TO_PASS": ["tests/test_slug.py::test x"]}, "unsupported test id"),
        "unknown test file": ({**good, "FAIL_TO_PASS": ["tests/nope.py::test_x"]}, "neither"),
        "repo_files not an object": ({**good, "repo_files": ["a.py"]}, "repo_files"),
        "escaping path": ({**good, "repo_files": {"../evil.py": "x"}}, "unsafe"),
        "test patch on a missing file": ({**good, "test_patch": good["test_patch"].replace("tests/test_slug.py", "tests/gone.py")}, "does not exist"),
    }
    for label, (obj, fragment) in cases.items():
        with pytest.raises(InvalidArgument) as info:
            instance_to_task(obj)
        message = str(info.value)
        assert fragment in message, f"{label}: {message}"
        if "instance_id" in obj:
            assert good["instance_id"] in message, f"{label}: {message}"

    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(good) + "\n" + "{not json\n")
    with pytest.raises(InvalidArgument, match=r"bad\.jsonl:2"):
        load_swebench_jsonl(path)
    path.write_text(json.dumps(good) + "\n" + json.dumps({**good, "patch": good["patch"].replace("text.lower()", "text.upper()")}) + "\n")
    with pytest.raises(InvalidArgument, match=r"bad\.jsonl:2: instance textkit__textkit-101: patch: .*does not apply"):
        load_swebench_jsonl(path)
    path.write_text(json.dumps(good) + "\n" + json.dumps(good) + "\n")
    with pytest.raises(InvalidArgument, match="duplicate"):
        load_swebench_jsonl(path)


# ------------------------------------------------------------------ the diff applier


def test_apply_unified_diff_modify_create_delete() -> None:
    files = {"a.py": "one\ntwo\nthree\nfour\n", "gone.txt": "x\ny\n"}
    diff = (
        "diff --git a/a.py b/a.py\n--- a/a.py\n+++ b/a.py\n@@ -1,2 +1,2 @@\n-one\n+ONE\n two\n@@ -4 +4,2 @@\n four\n+five\n"
        "--- /dev/null\n+++ b/new/b.py\n@@ -0,0 +1,2 @@\n+print(1)\n+print(2)\n"
        "--- a/gone.txt\n+++ /dev/null\n@@ -1,2 +0,0 @@\n-x\n-y\n"
    )
    out, changed, deleted = apply_unified_diff(files, diff)
    assert out == {"a.py": "ONE\ntwo\nthree\nfour\nfive\n", "new/b.py": "print(1)\nprint(2)\n"}
    assert changed == {"a.py", "new/b.py"} and deleted == {"gone.txt"}
    assert files["a.py"] == "one\ntwo\nthree\nfour\n"  # input left alone


def test_apply_unified_diff_no_newline_at_end_and_carriage_returns() -> None:
    files = {"f.txt": "a\r\nb"}
    diff = "--- a/f.txt\n+++ b/f.txt\n@@ -1,2 +1,2 @@\n a\r\n-b\n\\ No newline at end of file\n+c\n"
    out, _, _ = apply_unified_diff(files, diff)
    assert out["f.txt"] == "a\r\nc\n"


@pytest.mark.parametrize(
    ("diff", "fragment"),
    [
        ("--- a/a.py\n+++ b/a.py\n@@ -2,1 +2,1 @@\n-nope\n+x\n", "does not apply at line 2"),  # non-matching hunk
        ("--- a/a.py\n+++ b/a.py\n@@ -1,2 +1,2 @@\n-one\n+x\n", "hunk claims"),  # counts disagree
        ("--- a/a.py\n+++ b/a.py\n@@ bogus @@\n", "malformed hunk header"),
        ("--- a/a.py\n+++ b/a.py\n", "no hunks"),
        ("just text\n", "no file sections"),
        ("--- /dev/null\n+++ b/a.py\n@@ -0,0 +1 @@\n+x\n", "already exists"),
        ("--- a/../x\n+++ b/../x\n@@ -1 +1 @@\n-one\n+x\n", "unsafe"),
        ("--- a/a.py\n+++ b/b.py\n@@ -1 +1 @@\n-one\n+x\n", "renames"),
        ("--- a/a.py\n+++ b/a.py\n@@ -1 +1 @@\n-one\n+x\n@@ -1 +1 @@\n-one\n+y\n", "out of order"),
    ],
)
def test_apply_unified_diff_rejects(diff: str, fragment: str) -> None:
    with pytest.raises(PatchError, match=fragment):
        apply_unified_diff({"a.py": "one\ntwo\n"}, diff)
