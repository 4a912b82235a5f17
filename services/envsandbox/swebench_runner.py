"""Runs named tests of a SWE-bench-style task; prints PASS/FAIL per test id.

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
    rep.write(json.dumps({"ok": ok, "reason": one_line(reason)}) + "\n")
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
    out.write(f"TOTAL {len(test_ids)}\n")
    failed = 0
    for test_id in test_ids:
        ok, reason = run_in_child(test_id)
        failed += not ok
        out.write(f"PASS {test_id}\n" if ok else f"FAIL {test_id}: {one_line(reason) or 'failed'}\n")
        out.flush()
    sys.exit(1 if failed else 0)


main()
