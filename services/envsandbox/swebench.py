"""SWE-bench-style instances as sandbox tasks.

One JSONL line is one instance::

    {
      "instance_id": "acme__widgets-12",
      "problem_statement": "...",             # the issue text shown to the agent
      "repo_files": {"path": "content"},      # the repository snapshot (instead of repo + base_commit)
      "test_patch": "diff --git ...",         # unified diff adding/changing test files
      "FAIL_TO_PASS": "[\"tests/test_x.py::test_new\"]",   # JSON-encoded string or list
      "PASS_TO_PASS": ["tests/test_x.py::TestCls::test_old"],
      "patch": "diff --git ..."               # optional gold fix
    }

The task's hidden tests are the files the test patch touches and the files the named
tests live in (in their patched form). RunTests hands them, with the test ids, to a
stdlib runner (``swebench_runner.py``, run from memory: see its docstring) that loads each
named test file in a child process and calls the named function or method. A test id is ``path::function`` or
``path::Class::method``; ``unittest.TestCase`` classes run through unittest, plain
classes are instantiated and their method called (with ``setup_method`` /
``teardown_method`` when defined). Parametrised ids and fixtures are not supported.
Reward is ``all_pass`` over FAIL_TO_PASS + PASS_TO_PASS. The reference holds every file
the gold patch changes, in its patched form.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from meridian.errors import InvalidArgument
from services.envsandbox.tasks import TESTS_DIR, Task, TaskLimits
from services.envsandbox.unified_diff import PatchError, apply_unified_diff, check_rel_path

RUNNER_PATH = "_swebench_runner.py"
TEST_LIST_PATH = "_swebench_tests.json"
DEFAULT_LIMITS = TaskLimits(wall_seconds=60.0)
#: The runner each task ships (a real module beside this one, read as text).
RUNNER_SOURCE = (Path(__file__).with_name("swebench_runner.py")).read_text()

_TEST_ID = re.compile(r"^[^\s:]+\.py::[A-Za-z_]\w*(?:::[A-Za-z_]\w*)?$")

__all__ = ["PatchError", "apply_unified_diff", "instance_to_task", "load_swebench_jsonl"]


# ------------------------------------------------------------------ instances


def _str_map(instance_id: str, field: str, value: Any) -> dict[str, str]:
    if not isinstance(value, dict):
        raise InvalidArgument(f"instance {instance_id}: {field} must be an object path -> content")
    out: dict[str, str] = {}
    for path, content in value.items():
        if not isinstance(path, str) or not isinstance(content, str):
            raise InvalidArgument(f"instance {instance_id}: {field} entry {path!r} must map a path to text")
        try:
            out[check_rel_path(path, f"{field}")] = content
        except PatchError as exc:
            raise InvalidArgument(f"instance {instance_id}: {exc}") from None
    return out


def _test_list(instance_id: str, field: str, value: Any) -> list[str]:
    """A list of test ids from a list or a JSON-encoded list; missing means empty."""
    if value is None:
        return []
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise InvalidArgument(f"instance {instance_id}: {field} is not valid JSON: {exc}") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InvalidArgument(f"instance {instance_id}: {field} must be a list of test ids")
    for test_id in value:
        # Ids end up on PASS/FAIL lines that must parse as one token each.
        if not _TEST_ID.match(test_id):
            raise InvalidArgument(
                f"instance {instance_id}: {field} has unsupported test id {test_id!r} "
                "(want path.py::name or path.py::Class::name, no spaces or parameters)"
            )
    return list(value)


def instance_to_task(obj: dict[str, Any], split: str = "eval") -> Task:
    """Builds a ``swebench`` task from one decoded instance; InvalidArgument names the instance."""
    if not isinstance(obj, dict):
        raise InvalidArgument(f"instance must be a JSON object, got {type(obj).__name__}")
    instance_id = obj.get("instance_id")
    if not isinstance(instance_id, str) or not instance_id.strip():
        raise InvalidArgument("instance has no instance_id")
    problem = obj.get("problem_statement")
    if not isinstance(problem, str) or not problem.strip():
        raise InvalidArgument(f"instance {instance_id}: problem_statement is missing or empty")
    repo_files = _str_map(instance_id, "repo_files", obj.get("repo_files"))
    if not repo_files:
        raise InvalidArgument(f"instance {instance_id}: repo_files is empty")
    if any(p == TESTS_DIR or p.startswith(TESTS_DIR + "/") for p in repo_files):
        raise InvalidArgument(f"instance {instance_id}: repo_files may not use the reserved {TESTS_DIR}/ folder")
    test_patch = obj.get("test_patch")
    if not isinstance(test_patch, str) or not test_patch.strip():
        raise InvalidArgument(f"instance {instance_id}: test_patch is missing or empty")
    fail_to_pass = _test_list(instance_id, "FAIL_TO_PASS", obj.get("FAIL_TO_PASS"))
    pass_to_pass = _test_list(instance_id, "PASS_TO_PASS", obj.get("PASS_TO_PASS"))
    if not fail_to_pass:
        raise InvalidArgument(f"instance {instance_id}: FAIL_TO_PASS is empty")

    try:
        with_tests, test_changed, test_deleted = apply_unified_diff(repo_files, test_patch)
    except PatchError as exc:
        raise InvalidArgument(f"instance {instance_id}: test_patch: {exc}") from None
    if test_deleted:
        raise InvalidArgument(f"instance {instance_id}: test_patch deletes {sorted(test_deleted)}; hidden tests can only add files")
    test_ids = fail_to_pass + [t for t in pass_to_pass if t not in fail_to_pass]
    for test_id in test_ids:
        test_file = test_id.split("::", 1)[0]
        if test_file not in with_tests:
            raise InvalidArgument(f"instance {instance_id}: test {test_id!r} names a file in neither repo_files nor test_patch")

    # Hidden copies of every named test file (patched or not): the agent's edits to the
    # workspace's test files then cannot change what is run.
    hidden_paths = test_changed | {t.split("::", 1)[0] for t in test_ids}
    tests = {path: with_tests[path] for path in sorted(hidden_paths)}
    if RUNNER_PATH in tests or TEST_LIST_PATH in tests:
        raise InvalidArgument(f"instance {instance_id}: test_patch uses a reserved runner path")
    tests[RUNNER_PATH] = RUNNER_SOURCE
    tests[TEST_LIST_PATH] = json.dumps(test_ids, indent=1) + "\n"

    reference: dict[str, str] = {}
    answer_path = ""
    gold = obj.get("patch")
    if gold is not None:
        if not isinstance(gold, str):
            raise InvalidArgument(f"instance {instance_id}: patch must be a string")
        if gold.strip():
            try:
                fixed, changed, deleted = apply_unified_diff(repo_files, gold)
            except PatchError as exc:
                raise InvalidArgument(f"instance {instance_id}: patch: {exc}") from None
            if deleted:
                # A reference is applied by writing files, so it cannot express a deletion.
                raise InvalidArgument(f"instance {instance_id}: gold patch deletes {sorted(deleted)}, which a reference cannot express")
            reference = {path: fixed[path] for path in sorted(changed)}
            answer_path = sorted(changed)[0]

    instruction = (
        f"{problem.strip()}\n\n"
        "Edit the repository in the workspace so that the issue above is resolved. "
        "Hidden tests will be run against your changes."
    )
    task_split = obj.get("split", split)
    if task_split not in ("train", "eval"):
        raise InvalidArgument(f"instance {instance_id}: split must be train or eval, got {task_split!r}")
    return Task(
        id=f"swebench/{instance_id}",
        kind="swebench",
        split=task_split,
        instruction=instruction,
        files=repo_files,
        answer_path=answer_path,
        tests=tests,
        test_command=["python3", "-I", "-S", f"{TESTS_DIR}/{RUNNER_PATH}", f"{TESTS_DIR}/{TEST_LIST_PATH}"],
        reward="all_pass",
        reference=reference,
        limits=DEFAULT_LIMITS,
    )


def load_swebench_jsonl(path: str | Path, split: str = "eval") -> list[Task]:
    """Every instance of a JSONL file as a task; errors name the file, line and instance."""
    path = Path(path)
    tasks: list[Task] = []
    seen: set[str] = set()
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InvalidArgument(f"{path}:{lineno}: not valid JSON: {exc}") from None
        try:
            task = instance_to_task(obj, split=split)
        except InvalidArgument as exc:
            raise InvalidArgument(f"{path}:{lineno}: {exc}") from None
        if task.id in seen:
            raise InvalidArgument(f"{path}:{lineno}: duplicate instance_id {task.id.removeprefix('swebench/')!r}")
        seen.add(task.id)
        tasks.append(task)
    return tasks
