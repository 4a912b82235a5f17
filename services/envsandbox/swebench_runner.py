"""Runs named tests of a SWE-bench-style task; prints PASS/FAIL per test id.

RunTests runs it as ``python3 -I -S -c <this file> --stdin`` with the test ids and the
hidden test files as JSON on standard input (``{"tests": [...], "files": {path: text}}``),
after every process of the sandbox is gone: neither this runner nor the hidden tests are
ever on the sandbox's disk, so no test's code can read them or rewrite what a later test
runs. (Run by hand as ``python3 -I -S .tests/_swebench_runner.py .tests/_swebench_tests.json``
it reads them from ``.tests/`` and removes that folder first.)

The runner process (P) never runs code under test, and makes itself non-dumpable, so
same-user processes cannot reach its descriptors or memory; its standard output is the
one channel the service scores. Each test runs in a child (C) started from a fresh
interpreter in a session of its own, with its hidden files in memory (an import hook
serves them before anything in the workspace) and stdout and stderr pointed at /dev/null
before any of it runs. C reports its verdict on a private copy of its stdout, on a line
that must carry a nonce P gave only to that child; after C ends, or outlives its time,
its whole process group is killed.

What this cannot stop: a test's verdict is decided inside C, where the test calls the
code under test, so code written to find the runner's state in its own interpreter can
forge the verdict of every test that imports it. That takes no knowledge of the task: a
few lines at the top of a module the tests import, which walk the stack for the nonce,
write a passing verdict on the runner's private copy of stdout and exit, score every
sample instance 1. So can a value whose ``__eq__`` is always true, against tests that
compare with ``==``. Blind writes to inherited descriptors do not (no nonce), and
nothing reaches P's memory. The hidden files are not out of reach: C holds every one of
them in the same interpreter as the code under test, which can read them. Only tests
that compare values outside C (as the built-in harness's checks do) would close this.
"""
import ctypes
import json
import os
import secrets
import select
import shutil
import subprocess
import sys
import time

PR_SET_DUMPABLE = 4
CHILD_TIMEOUT_S = 8
MAX_REPORT_BYTES = 1 << 20

# The child: reads its request, keeps a private copy of stdout for the verdict, and
# points fds 0-2 elsewhere before any test or repository code runs.
CHILD = r'''
import importlib.util, inspect, json, os, sys, traceback, unittest
_req = json.loads(sys.stdin.buffer.read().decode("utf-8"))
_rep = os.fdopen(os.dup(1), "w")
_null = os.open(os.devnull, os.O_RDWR)
for _fd in (0, 1, 2):
    os.dup2(_null, _fd)
ROOT = os.getcwd()
FILES = _req["files"]


def one_line(text):
    # No surrogate escaping needed here: C's line is json.dumps output (ASCII, a lone
    # surrogate written as \\udcXX), and P's one_line escapes the reason it prints.
    return " ".join(str(text).split())[:300]


class HiddenFiles:
    """Serves modules from the hidden files before any other finder, so the workspace
    cannot stand in for them: ``a.b`` is ``a/b.py`` or ``a/b/__init__.py`` relative
    to the repository root or to the test file's own folder."""

    def __init__(self, bases):
        self.bases = bases

    def find_spec(self, fullname, path=None, target=None):
        rel = fullname.replace(".", "/")
        for base in self.bases:
            for name, package in ((rel + "/__init__.py", True), (rel + ".py", False)):
                hidden = base + "/" + name if base else name
                if hidden in FILES:
                    filename = os.path.join(ROOT, hidden)
                    spec = importlib.util.spec_from_loader(fullname, Source(FILES[hidden], filename), origin=filename, is_package=package)
                    if package:
                        spec.submodule_search_locations = [os.path.dirname(filename)]
                    return spec
        return None


class Source:
    def __init__(self, text, filename):
        self.text, self.filename = text, filename

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        module.__file__ = self.filename
        exec(compile(self.text, self.filename, "exec"), module.__dict__)


def load(rel_path):
    """The test module at rel_path: the hidden (patched) copy, else the workspace's."""
    folder = os.path.dirname(rel_path)
    sys.meta_path.insert(0, HiddenFiles(["", folder] if folder else [""]))
    # Imports inside the test resolve against the repository, then the test's own folder.
    sys.path.insert(0, ROOT)
    sys.path.append(os.path.join(ROOT, folder))
    if rel_path in FILES:
        text = FILES[rel_path]
    elif os.path.isfile(os.path.join(ROOT, rel_path)):
        with open(os.path.join(ROOT, rel_path)) as fh:
            text = fh.read()
    else:
        raise FileNotFoundError("no test file " + rel_path)
    spec = importlib.util.spec_from_loader("_swebench_test", Source(text, os.path.join(ROOT, rel_path)))
    module = importlib.util.module_from_spec(spec)
    sys.modules["_swebench_test"] = module
    spec.loader.exec_module(module)
    return module


def run_one(test_id):
    """(passed, reason) for one test id."""
    rel_path, *names = test_id.split("::")
    target = getattr(load(rel_path), names[0])
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


def main(nonce):
    try:
        ok, reason = run_one(_req["test_id"])
    except BaseException as exc:
        ok, reason = False, type(exc).__name__ + ": " + str(exc)
        if isinstance(exc, AssertionError) and not str(exc):
            tb = traceback.extract_tb(exc.__traceback__)
            reason = "AssertionError at line %d" % tb[-1].lineno if tb else "AssertionError"
    _rep.write(json.dumps({"nonce": nonce, "ok": ok, "reason": one_line(reason)}) + "\n")
    _rep.flush()
    os._exit(0 if ok else 1)


main(_req.pop("nonce"))
'''


def one_line(text):
    # Lone surrogates escaped first: written back as raw bytes (surrogateescape), they
    # could spell a line break such as NEL (C2 85) inside a FAIL line (see harness.one_line).
    safe = str(text).encode("utf-8", "backslashreplace").decode("utf-8")
    return " ".join(safe.split())[:300]


def run_in_child(test_id, files):
    """(passed, reason) of one test, run in a fresh interpreter in a session of its own;
    the group is killed when the child ends or outlives CHILD_TIMEOUT_S."""
    nonce = secrets.token_hex(16)
    request = json.dumps({"test_id": test_id, "files": files, "nonce": nonce}).encode()
    proc = subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", CHILD],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        close_fds=True, start_new_session=True,
    )
    out, timed_out = read_until(proc, request, time.monotonic() + CHILD_TIMEOUT_S)
    try:
        os.killpg(proc.pid, 9)  # what the test left running goes with it
    except OSError:
        pass
    code = proc.wait()
    if timed_out:
        return False, "timed out"
    verdicts = []
    for line in out.decode("utf-8", "replace").splitlines():
        try:
            item = json.loads(line)
        except ValueError:
            continue
        if isinstance(item, dict) and item.get("nonce") == nonce:
            verdicts.append(item)
    if len(verdicts) != 1:
        return False, "the test process reported no verdict" if not verdicts else "the test process reported more than one verdict"
    verdict = verdicts[0]
    if code != 0:
        return False, str(verdict.get("reason") or "") or "the test process exited with %d" % code
    return verdict.get("ok") is True, str(verdict.get("reason", ""))


def read_until(proc, stdin, deadline):
    """The child's stdout until it closes or ``deadline`` passes: (bytes, timed out).
    (The harness has the same reader: each runs alone from memory in the sandbox, with
    nothing of this project importable, so each carries its own.)"""
    try:
        proc.stdin.write(stdin)
        proc.stdin.close()
    except OSError:
        pass
    fd = proc.stdout.fileno()
    chunks = []
    size = 0
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            proc.stdout.close()
            return b"".join(chunks), True
        ready, _, _ = select.select([fd], [], [], remaining)
        if not ready:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            proc.stdout.close()
            return b"".join(chunks), False
        if size < MAX_REPORT_BYTES:
            chunks.append(chunk)
            size += len(chunk)


def read_request():
    """(test ids, hidden files): from stdin, or from the ``.tests/`` folder of a run by
    hand (then removed, so no test can read or change it)."""
    if sys.argv[1:] == ["--stdin"]:
        request = json.loads(sys.stdin.buffer.read().decode("utf-8"))
        return request["tests"], request["files"]
    folder = os.path.dirname(os.path.abspath(sys.argv[1]))
    with open(sys.argv[1]) as fh:
        test_ids = json.load(fh)
    files = {}
    for base, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(base, name)
            with open(path) as fh:
                files[os.path.relpath(path, folder)] = fh.read()
    shutil.rmtree(folder, ignore_errors=True)
    return test_ids, files


def main():
    # Same-user processes cannot open our descriptors or memory once we are not dumpable.
    ctypes.CDLL(None).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    test_ids, files = read_request()
    out = sys.stdout
    out.write(f"TOTAL {len(test_ids)}\n")
    failed = 0
    for test_id in test_ids:
        ok, reason = run_in_child(test_id, files)
        failed += not ok
        out.write(f"PASS {test_id}\n" if ok else f"FAIL {test_id}: {one_line(reason) or 'failed'}\n")
        out.flush()
    sys.exit(1 if failed else 0)


main()
