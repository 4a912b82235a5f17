"""The trusted test harness: the only code whose output becomes a reward.

Tasks name it as ``python3 -I -S .tests/_harness.py .tests/<test module>``; RunTests runs
it as ``python3 -I -S -c <this file> --stdin .tests/<test module>`` with the test module's
source on standard input, after every process of the sandbox is gone. Neither this file
nor the hidden tests are ever on the sandbox's disk, so nothing there can read or replace
them. The harness process (P) never runs code under test itself, so nothing the solution
does can write P's standard output, the one channel the service scores:

* P makes itself non-dumpable first, so same-user processes cannot open its file
  descriptors (``/proc/<P>/fd``), read or write its memory, or ptrace it.
* Code under test runs only in child processes (C) started from a fresh interpreter,
  with no inherited descriptors but their own pipes, stdout and stderr pointed at
  /dev/null before any of it runs. A child reports *values* on a private pipe; P compares
  them with the expected values, which exist only in P's memory.
* In a child the workspace comes *last* on ``sys.path``, after the test module's own
  imports have run: a ``subprocess.py`` in the workspace cannot stand in for the standard
  library's.
* A child that outlives its time is killed with its process group, and P stops reading
  its pipe at once (a grandchild that left the group cannot hold P up).

The test module takes one of three shapes:

``cases``  ``NAME`` (a function in ``solution.py``) and ``CASES`` (``[(args, want), ...]``,
           literals); optionally ``same(got, want)``. One child calls the function per case.
``checks`` ``check_<name>()`` functions that exercise the workspace and compare with
           ``eq(got, want)``. P evaluates every ``want`` itself (in the module namespace)
           and sends the child a copy of the function in which ``eq(got, want)`` became
           "report ``got``": the child never holds the expected value. A check passes when
           its child finished normally, every ``eq`` in it ran, and every reported value
           equals its ``want`` (so an ``eq`` belongs where it always runs, not in a branch); a
           check with no ``eq`` passes when its child finishes (use it only for checks
           that run no code under test in-process, e.g. ``sh -n script``).
           ``raised(fn, *args)`` gives the name of the exception ``fn`` raised, or None.
``script`` anything else: the module runs in P and prints its own ``PASS``/``FAIL``/``SCORE``
           lines. Only for tests that run no code under test at all (they read files).
"""
import ast
import ctypes
import json
import math
import os
import select
import shutil
import subprocess
import sys
import time

PR_SET_DUMPABLE = 4
CHILD_TIMEOUT_S = float(os.environ.get("MERIDIAN_CHECK_TIMEOUT_S", "8"))
_REPORT_FD_ENV = "MERIDIAN_REPORT_FD"

# The child's prelude: it keeps a private copy of its stdout for reports and points fd 1
# and 2 elsewhere before any code under test runs (prints cannot corrupt the reports).
# The workspace joins sys.path only later, at its end (WORKSPACE_ON_PATH).
CHILD_PRELUDE = r'''
import ast as _ast, json as _json, os as _os, sys as _sys
_rep = _os.fdopen(_os.dup(1), "w", buffering=1)
_null = _os.open(_os.devnull, _os.O_WRONLY)
_os.dup2(_null, 1)
_os.dup2(_null, 2)


def __report__(index, got):
    try:
        text = repr(got)
    except BaseException as exc:  # a hostile __repr__ reports as an error value
        text = "<unrepresentable %s>" % type(exc).__name__
    _rep.write(_json.dumps({"eq": index, "got": text}) + "\n")


def raised(fn, *args, **kwargs):
    """The name of the exception fn(*args, **kwargs) raises, or None."""
    try:
        fn(*args, **kwargs)
    except Exception as exc:
        return type(exc).__name__
    return None
'''

WORKSPACE_ON_PATH = "\n_sys.path.append(_os.getcwd())\n"

CASES_CHILD = CHILD_PRELUDE + WORKSPACE_ON_PATH + r'''
import importlib.util as _ilu
_name, _cases = _json.loads(_sys.stdin.readline())
try:
    _spec = _ilu.spec_from_file_location("solution", "solution.py")
    _mod = _ilu.module_from_spec(_spec)
    _spec.loader.exec_module(_mod)
    _fn = getattr(_mod, _name)
except BaseException as _exc:
    _rep.write(_json.dumps({"load_error": "cannot load %s: %s" % (_name, type(_exc).__name__)}) + "\n")
    _os._exit(1)
for _i, _args in enumerate(_cases):
    try:
        _got = _fn(*_ast.literal_eval(_args))
    except BaseException as _exc:
        _rep.write(_json.dumps({"case": _i, "raised": type(_exc).__name__}) + "\n")
        continue
    try:
        _text = repr(_got)
    except BaseException as _exc:
        _text = "<unrepresentable %s>" % type(_exc).__name__
    _rep.write(_json.dumps({"case": _i, "got": _text}) + "\n")
_rep.write(_json.dumps({"done": True}) + "\n")
_rep.flush()
_os._exit(0)
'''

CHECK_RUNNER = r'''
_check = globals()["check_" + _sys.argv[1]]
try:
    _check()
except BaseException as _exc:
    _msg = " ".join(str(_exc).split())[:300]
    _rep.write(_json.dumps({"error": "%s%s" % (type(_exc).__name__, ": " + _msg if _msg else "")}) + "\n")
    _rep.flush()
    _os._exit(1)
_rep.write(_json.dumps({"done": True}) + "\n")
_rep.flush()
_os._exit(0)
'''


def one_line(text: str) -> str:
    """``text`` as one printable line of at most 300 characters for the scored output.

    Lone surrogates are escaped first. A child can report any string (an exception
    message, a value's repr), and this process's stdout writes U+DC80..U+DCFF back as
    raw bytes (surrogateescape): ``\\udcc2\\udc85``, two lone surrogates that are no
    whitespace to ``str.split()`` here, would reach the service as the bytes C2 85,
    which it decodes to NEL, a line break to ``str.splitlines()``, so one FAIL line
    could carry forged PASS lines. (A real NEL is whitespace to ``str.split()`` and is
    folded into a space here.)"""
    safe = str(text).encode("utf-8", "backslashreplace").decode("utf-8")
    return " ".join(safe.split())[:300]


def default_same(got, want) -> bool:
    """Floats compare with a tolerance; everything else must be equal."""
    if isinstance(want, float) and isinstance(got, (int, float)) and not isinstance(got, bool):
        return math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-6)
    if isinstance(want, (list, tuple)) and isinstance(got, type(want)) and len(got) == len(want):
        return all(default_same(g, w) for g, w in zip(got, want))
    return got == want


def decode_value(text: str):
    """A reported repr back as a value; a non-literal stays a marker no want can equal."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return _Opaque(text)


class _Opaque:
    def __init__(self, text: str) -> None:
        self.text = text

    def __eq__(self, other) -> bool:
        return False

    def __repr__(self) -> str:
        return self.text[:200]


def run_child(source: str, argv: list, stdin: bytes, timeout_s: float) -> tuple:
    """Runs ``source`` in a fresh interpreter; returns (report lines, exit code, timed out).

    Reads the child's pipe only until the deadline: then the child's process group is
    killed and whatever still holds the pipe (a grandchild that left the group) is
    abandoned with it, so no child can hold the harness up. The group is killed when
    the child ends in time too."""
    proc = subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", source, *argv],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        close_fds=True,
        start_new_session=True,
    )
    out, timed_out = _read_until(proc, stdin, time.monotonic() + timeout_s)
    # Always: what the child left running in its group (a daemon a build script
    # started) must not live on beside the next checks, whose pipes it could reach.
    _kill(proc)
    try:
        code = proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        code = -9
    reports = []
    for line in out.decode("utf-8", "replace").splitlines()[:10000]:
        try:
            item = json.loads(line)
        except ValueError:
            continue
        if isinstance(item, dict):
            reports.append(item)
    return reports, code, timed_out


MAX_REPORT_BYTES = 16 << 20


def _read_until(proc: subprocess.Popen, stdin: bytes, deadline: float) -> tuple:
    """The child's stdout until it closes or ``deadline`` passes: (bytes, timed out)."""
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


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, 9)
    except OSError:
        proc.kill()


# ------------------------------------------------------------------ modes


def run_cases(ns: dict, emit) -> None:
    name, cases = ns["NAME"], ns["CASES"]
    same = ns.get("same", default_same)
    emit(f"TOTAL {len(cases)}")
    request = json.dumps([name, [repr(tuple(args)) for args, _ in cases]]).encode() + b"\n"
    reports, code, timed_out = run_child(CASES_CHILD, [], request, CHILD_TIMEOUT_S)
    results = {}
    load_error = None
    for item in reports:
        if "load_error" in item:
            load_error = str(item["load_error"])
        elif isinstance(item.get("case"), int) and item["case"] not in results:
            results[item["case"]] = item
    for i, (_args, want) in enumerate(cases):
        item = results.get(i)
        if item is None:
            why = load_error or ("timed out" if timed_out else "no result (the solution exited early)")
            emit(f"FAIL case{i}: {one_line(why)}")
        elif "raised" in item:
            emit(f"FAIL case{i}: raised {one_line(item['raised'])}")
        else:
            got = decode_value(str(item.get("got", "")))
            try:
                ok = bool(same(got, want))
            except Exception:
                ok = False
            emit(f"PASS case{i}" if ok else f"FAIL case{i}: got {one_line(repr(got))}, want {one_line(repr(want))}")


class _StripWants(ast.NodeTransformer):
    """``eq(got, want)`` → ``__report__(k, got)``; records every ``want`` expression."""

    def __init__(self) -> None:
        self.wants: list = []

    def visit_Call(self, node: ast.Call):
        self.generic_visit(node)
        if isinstance(node.func, ast.Name) and node.func.id == "eq" and len(node.args) == 2 and not node.keywords:
            self.wants.append(node.args[1])
            index = ast.Constant(len(self.wants) - 1)
            return ast.copy_location(ast.Call(ast.Name("__report__", ast.Load()), [index, node.args[0]], []), node)
        return node


def run_checks(tree: ast.Module, ns: dict, emit) -> None:
    same = ns.get("same", default_same)
    # The child gets the module with every check's expected values cut out.
    child_body = []
    wants_by_check: dict = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("check_"):
            stripper = _StripWants()
            node = stripper.visit(node)
            wants_by_check[node.name[6:]] = stripper.wants
        child_body.append(node)
    child_module = ast.fix_missing_locations(ast.Module(child_body, []))
    # The module's own imports run before the workspace is on the path.
    child_source = CHILD_PRELUDE + ast.unparse(child_module) + WORKSPACE_ON_PATH + CHECK_RUNNER
    emit(f"TOTAL {len(wants_by_check)}")
    for name, want_nodes in wants_by_check.items():
        try:
            wants = [eval(compile(ast.Expression(w), "<want>", "eval"), ns) for w in want_nodes]
        except Exception as exc:
            emit(f"FAIL {name}: harness cannot evaluate an expected value: {one_line(exc)}")
            continue
        reports, code, timed_out = run_child(child_source, [name], b"", CHILD_TIMEOUT_S)
        emit(judge_check(name, wants, reports, code, timed_out, same))


def judge_check(name: str, wants: list, reports: list, code: int, timed_out: bool, same) -> str:
    """One PASS/FAIL line from a check child's reports."""
    if timed_out:
        return f"FAIL {name}: timed out"
    checked: set = set()
    for item in reports:
        if "error" in item:
            return f"FAIL {name}: {one_line(item['error'])}"
        if "eq" in item:
            k = item["eq"]
            if not isinstance(k, int) or not 0 <= k < len(wants):
                return f"FAIL {name}: malformed report"
            got = decode_value(str(item.get("got", "")))
            try:
                ok = bool(same(got, wants[k]))
            except Exception:
                ok = False
            if not ok:
                return f"FAIL {name}: got {one_line(repr(got))}, want {one_line(repr(wants[k]))}"
            checked.add(k)
    done = any(item.get("done") is True for item in reports)
    if code != 0 or not done:
        return f"FAIL {name}: the check did not finish (exit {code})"
    # Every eq must have run: a child that reported the first value right and then
    # "done" has not been checked on the rest.
    missing = sorted(set(range(len(wants))) - checked)
    if missing:
        return f"FAIL {name}: {len(missing)} of {len(wants)} values were never checked (eq {', '.join(map(str, missing[:5]))})"
    return f"PASS {name}"


def run_script(source: str, path: str, ns: dict) -> None:
    exec(compile(source, path, "exec"), ns)


def main() -> int:
    ctypes.CDLL(None).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    if len(sys.argv) == 3 and sys.argv[1] == "--stdin":
        path, source = sys.argv[2], sys.stdin.read()
    else:  # a test module on disk (a task run by hand): it leaves the disk first
        path = sys.argv[1]
        with open(path) as fh:
            source = fh.read()
        shutil.rmtree(os.path.dirname(os.path.abspath(path)), ignore_errors=True)
    # Checks may make scratch folders next to their module: it has an empty one where the
    # sandbox left a way to make it. A workspace the sandbox made read-only (or filled) is
    # scored all the same: what the tests then cannot read or write fails, nothing errors.
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    except OSError:
        pass
    tree = ast.parse(source, path)
    ns: dict = {"__name__": "_meridian_tests", "__file__": path}
    shapes = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)} | {
        t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)
    }
    out = sys.stdout

    def emit(line: str) -> None:
        out.write(line + "\n")
        out.flush()

    if "NAME" in shapes and "CASES" in shapes:
        exec(compile(source, path, "exec"), ns)
        run_cases(ns, emit)
    elif any(s.startswith("check_") for s in shapes):
        # Only module-level definitions run here; check bodies run in the children.
        saved = list(sys.path)
        exec(compile(source, path, "exec"), ns)
        sys.path[:] = saved
        run_checks(tree, ns, emit)
    else:
        run_script(source, path, ns)
    return 0


if __name__ == "__main__":
    sys.exit(main())
