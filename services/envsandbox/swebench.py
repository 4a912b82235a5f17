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
tests live in (in their patched form), plus a stdlib runner, ``.tests/_swebench_runner.py``, that imports each named test file
by path and calls the named function or method. A test id is ``path::function`` or
``path::Class::method``; ``unittest.TestCase`` classes run through unittest, plain
classes are instantiated and their method called (with ``setup_method`` /
``teardown_method`` when defined). Parametrised ids and fixtures are not supported.
Reward is ``all_pass`` over FAIL_TO_PASS + PASS_TO_PASS. The reference holds every file
the gold patch changes, in its patched form.
"""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path, PurePosixPath
from typing import Any

from meridian.errors import InvalidArgument
from services.envsandbox.tasks import TESTS_DIR, Task, TaskLimits

RUNNER_PATH = "_swebench_runner.py"
TEST_LIST_PATH = "_swebench_tests.json"
DEFAULT_LIMITS = TaskLimits(wall_seconds=60.0)

_HUNK_HEADER = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
_TEST_ID = re.compile(r"^[^\s:]+\.py::[A-Za-z_]\w*(?:::[A-Za-z_]\w*)?$")


class PatchError(InvalidArgument):
    """A unified diff that is malformed or does not apply to the given files."""


# ------------------------------------------------------------------ unified diffs


@dataclasses.dataclass
class _Hunk:
    old_start: int
    old_len: int
    new_start: int
    new_len: int
    old_lines: list[str]
    new_lines: list[str]
    header_line: int  # 1-based line in the diff, for error messages


@dataclasses.dataclass
class _FilePatch:
    old_path: str | None  # None for a created file
    new_path: str | None  # None for a deleted file
    hunks: list[_Hunk]


def _strip_prefix(raw: str) -> str | None:
    """The repository path of a ``---``/``+++`` header value; None for /dev/null."""
    path = raw.split("\t", 1)[0].strip()
    if path == "/dev/null":
        return None
    if path.startswith(("a/", "b/")):
        path = path[2:]
    return _check_rel_path(path, "diff header")


def _check_rel_path(path: str, what: str) -> str:
    pure = PurePosixPath(path)
    if not path or pure.is_absolute() or ".." in pure.parts or "\x00" in path:
        raise PatchError(f"{what}: unsafe or empty path {path!r}")
    return str(pure)


def parse_unified_diff(diff: str) -> list[_FilePatch]:
    """Parses a (git-style or plain) unified diff of text files; strict about counts."""
    # Split on "\n" only: str.splitlines would also break on \r, \f and friends that
    # may legitimately appear inside a line.
    lines = diff.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    patches: list[_FilePatch] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("GIT binary patch") or line.startswith("Binary files "):
            raise PatchError(f"diff line {i + 1}: binary patches are not supported")
        if line.startswith(("rename from ", "rename to ", "copy from ", "copy to ")):
            raise PatchError(f"diff line {i + 1}: renames and copies are not supported: {line!r}")
        if not line.startswith("--- "):
            # diff --git, index, mode lines and free text between file sections.
            i += 1
            continue
        if i + 1 >= len(lines) or not lines[i + 1].startswith("+++ "):
            raise PatchError(f"diff line {i + 1}: '---' header not followed by '+++'")
        old_path = _strip_prefix(line[4:])
        new_path = _strip_prefix(lines[i + 1][4:])
        if old_path is None and new_path is None:
            raise PatchError(f"diff line {i + 1}: both sides are /dev/null")
        i += 2
        hunks: list[_Hunk] = []
        while i < len(lines) and lines[i].startswith("@@"):
            hunk, i = _parse_hunk(lines, i)
            hunks.append(hunk)
        if not hunks:
            raise PatchError(f"diff line {i}: file section for {new_path or old_path!r} has no hunks")
        patches.append(_FilePatch(old_path, new_path, hunks))
    if not patches:
        raise PatchError("diff contains no file sections")
    return patches


def _parse_hunk(lines: list[str], i: int) -> tuple[_Hunk, int]:
    m = _HUNK_HEADER.match(lines[i])
    if not m:
        raise PatchError(f"diff line {i + 1}: malformed hunk header {lines[i]!r}")
    old_start, new_start = int(m.group(1)), int(m.group(3))
    old_len = int(m.group(2)) if m.group(2) is not None else 1
    new_len = int(m.group(4)) if m.group(4) is not None else 1
    hunk = _Hunk(old_start, old_len, new_start, new_len, [], [], i + 1)
    i += 1
    last: list[str] | None = None  # the side(s) the previous line went to, for "\ No newline"
    while i < len(lines) and (len(hunk.old_lines) < old_len or len(hunk.new_lines) < new_len):
        line = lines[i]
        tag, text = (line[:1], line[1:]) if line else (" ", "")  # some tools drop the space of empty context lines
        if tag == " ":
            hunk.old_lines.append(text + "\n")
            hunk.new_lines.append(text + "\n")
            last = ["old", "new"]
        elif tag == "-":
            hunk.old_lines.append(text + "\n")
            last = ["old"]
        elif tag == "+":
            hunk.new_lines.append(text + "\n")
            last = ["new"]
        elif tag == "\\":
            _drop_final_newline(hunk, last, i)
        else:
            raise PatchError(f"diff line {i + 1}: unexpected line in hunk: {line!r}")
        i += 1
    # A "\ No newline at end of file" marker may follow the hunk's last counted line.
    while i < len(lines) and lines[i].startswith("\\"):
        _drop_final_newline(hunk, last, i)
        i += 1
    if len(hunk.old_lines) != old_len or len(hunk.new_lines) != new_len:
        raise PatchError(
            f"diff line {hunk.header_line}: hunk claims -{old_len} +{new_len} lines but has "
            f"-{len(hunk.old_lines)} +{len(hunk.new_lines)}"
        )
    return hunk, i


def _drop_final_newline(hunk: _Hunk, last: list[str] | None, i: int) -> None:
    if last is None:
        raise PatchError(f"diff line {i + 1}: '\\' marker before any hunk line")
    for side in last:
        target = hunk.old_lines if side == "old" else hunk.new_lines
        target[-1] = target[-1][:-1]


def _apply_hunks(path: str, text: str, hunks: list[_Hunk]) -> str:
    """Applies hunks at exactly their stated positions (no fuzz, no offset search)."""
    src = _split_newline_only(text)
    out: list[str] = []
    pos = 0  # index into src of the next line not yet copied
    for hunk in hunks:
        # A zero-length old range names the line *after which* to insert.
        start = hunk.old_start if hunk.old_len == 0 else hunk.old_start - 1
        if start < pos:
            raise PatchError(f"{path}: hunk at diff line {hunk.header_line} overlaps or is out of order")
        actual = src[start:start + hunk.old_len]
        if actual != hunk.old_lines:
            where = next((k for k, (a, b) in enumerate(zip(actual, hunk.old_lines)) if a != b), len(actual))
            want = hunk.old_lines[where] if where < len(hunk.old_lines) else "<end of hunk>"
            got = actual[where] if where < len(actual) else "<end of file>"
            raise PatchError(
                f"{path}: hunk at diff line {hunk.header_line} does not apply at line {start + where + 1}: "
                f"expected {want!r}, found {got!r}"
            )
        out.extend(src[pos:start])
        out.extend(hunk.new_lines)
        pos = start + hunk.old_len
    out.extend(src[pos:])
    return "".join(out)


def _split_newline_only(text: str) -> list[str]:
    """Lines split at LF only (the last may lack one); unlike str.splitlines, CR and FF stay inside lines."""
    parts = text.split("\n")
    lines = [p + "\n" for p in parts[:-1]]
    if parts[-1]:
        lines.append(parts[-1])  # last line without a trailing newline
    return lines


def apply_unified_diff(files: dict[str, str], diff: str) -> tuple[dict[str, str], set[str], set[str]]:
    """Applies ``diff`` to ``files``.

    Returns ``(new_files, changed, deleted)``: the full patched file map, the paths
    created or modified, and the paths deleted. Raises PatchError when the diff is
    malformed or any hunk does not match the files exactly.
    """
    result = dict(files)
    changed: set[str] = set()
    deleted: set[str] = set()
    for fp in parse_unified_diff(diff):
        if fp.old_path is None:
            assert fp.new_path is not None
            if fp.new_path in result:
                raise PatchError(f"{fp.new_path}: diff creates a file that already exists")
            base = ""
        else:
            if fp.old_path not in result:
                raise PatchError(f"{fp.old_path}: diff modifies a file that does not exist")
            if fp.new_path is not None and fp.new_path != fp.old_path:
                raise PatchError(f"{fp.old_path}: renames (to {fp.new_path!r}) are not supported")
            base = result[fp.old_path]
        target = fp.new_path or fp.old_path
        assert target is not None  # parse_unified_diff rejects /dev/null on both sides
        patched = _apply_hunks(target, base, fp.hunks)
        if fp.new_path is None:
            if patched:
                raise PatchError(f"{target}: deletion hunk does not remove the whole file")
            del result[target]
            deleted.add(target)
            changed.discard(target)
        else:
            result[target] = patched
            changed.add(target)
            deleted.discard(target)
    return result, changed, deleted


# ------------------------------------------------------------------ runner shipped with each task

RUNNER_SOURCE = '''"""Runs named tests of a SWE-bench-style task; prints PASS/FAIL per test id.

Usage: python3 -I .tests/_swebench_runner.py .tests/_swebench_tests.json
Each test runs in its own child process (code under test never runs in this one).
Exits 1 when any test fails.
"""
import ctypes
import importlib.util
import inspect
import json
import os
import subprocess
import sys
import traceback
import unittest

CHILD_TIMEOUT_S = 8
HIDDEN = os.path.dirname(os.path.abspath(__file__))
ROOT = os.getcwd()
_modules = {}


def one_line(text):
    return " ".join(str(text).split())[:300]


def load(rel_path):
    """The test module at rel_path; the hidden (patched) copy wins over the workspace's."""
    if rel_path in _modules:
        return _modules[rel_path]
    hidden = os.path.join(HIDDEN, rel_path)
    path = hidden if os.path.isfile(hidden) else os.path.join(ROOT, rel_path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no test file {rel_path}")
    # Imports inside the test resolve against the repository, then the test's own folder.
    for extra in (ROOT, os.path.dirname(path)):
        if extra not in sys.path:
            sys.path.insert(0 if extra == ROOT else len(sys.path), extra)
    name = "_swebench_test_%d" % len(_modules)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    _modules[rel_path] = module
    return module


def run_one(test_id):
    """(passed, reason) for one test id."""
    rel_path, *names = test_id.split("::")
    module = load(rel_path)
    target = getattr(module, names[0])
    if len(names) == 1:
        if inspect.signature(target).parameters:
            return False, "test functions with arguments (fixtures) are not supported"
        target()
        return True, ""
    cls, method = target, names[1]
    if isinstance(cls, type) and issubclass(cls, unittest.TestCase):
        result = unittest.TestResult()
        cls(method).run(result)
        problems = result.errors + result.failures
        if problems:
            return False, problems[0][1].strip().splitlines()[-1]
        if result.skipped:
            return False, "skipped: " + str(result.skipped[0][1])
        if result.unexpectedSuccesses:
            return False, "unexpected success"
        return True, ""
    instance = cls()
    if hasattr(instance, "setup_method"):
        instance.setup_method(getattr(instance, method))
    try:
        getattr(instance, method)()
    finally:
        if hasattr(instance, "teardown_method"):
            instance.teardown_method(getattr(instance, method))
    return True, ""


def run_in_child(test_id):
    """(passed, reason): the test runs in a fresh interpreter that never holds this
    process's standard output, the only channel the service scores."""
    try:
        proc = subprocess.run(
            [sys.executable, "-I", "-S", os.path.abspath(__file__), "--one", test_id],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            close_fds=True, timeout=CHILD_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return False, "timed out"
    verdict = None
    for line in proc.stdout.decode("utf-8", "replace").splitlines():
        try:
            item = json.loads(line)
        except ValueError:
            continue
        if isinstance(item, dict) and verdict is None:
            verdict = item
    if verdict is None or proc.returncode != 0:
        return False, (verdict or {}).get("reason") or f"the test process exited with {proc.returncode}"
    return bool(verdict.get("ok")), str(verdict.get("reason", ""))


def one(test_id):
    """Child mode: run one test, report on a private copy of stdout."""
    rep = os.fdopen(os.dup(1), "w")
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    try:
        ok, reason = run_one(test_id)
    except BaseException as exc:
        ok, reason = False, f"{type(exc).__name__}: {exc}"
        if isinstance(exc, AssertionError) and not str(exc):
            tb = traceback.extract_tb(exc.__traceback__)
            reason = f"AssertionError at line {tb[-1].lineno}" if tb else "AssertionError"
    rep.write(json.dumps({"ok": ok, "reason": one_line(reason)}) + "\\n")
    rep.flush()
    os._exit(0 if ok else 1)


def main():
    if sys.argv[1] == "--one":
        one(sys.argv[2])
        return
    # Same-user processes cannot open our descriptors or memory once we are not dumpable.
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)
    with open(sys.argv[1]) as fh:
        test_ids = json.load(fh)
    out = sys.stdout
    out.write(f"TOTAL {len(test_ids)}\\n")
    failed = 0
    for test_id in test_ids:
        ok, reason = run_in_child(test_id)
        failed += not ok
        out.write(f"PASS {test_id}\\n" if ok else f"FAIL {test_id}: {one_line(reason) or 'failed'}\\n")
        out.flush()
    sys.exit(1 if failed else 0)


main()
'''


# ------------------------------------------------------------------ instances


def _str_map(instance_id: str, field: str, value: Any) -> dict[str, str]:
    if not isinstance(value, dict):
        raise InvalidArgument(f"instance {instance_id}: {field} must be an object path -> content")
    out: dict[str, str] = {}
    for path, content in value.items():
        if not isinstance(path, str) or not isinstance(content, str):
            raise InvalidArgument(f"instance {instance_id}: {field} entry {path!r} must map a path to text")
        try:
            out[_check_rel_path(path, f"{field}")] = content
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
