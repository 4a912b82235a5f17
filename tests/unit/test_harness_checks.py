"""The trusted harness's checks mode, attacked from the child's side: a child that reports
the first value right and then "done" has not passed, and nothing a check leaves running
outlives it."""
from __future__ import annotations

import time
from pathlib import Path

from services.envsandbox import harness


def test_a_check_passes_only_when_every_eq_ran() -> None:
    same = harness.default_same
    done = {"done": True}
    assert harness.judge_check("c", [1, 2], [{"eq": 0, "got": "1"}, {"eq": 1, "got": "2"}, done], 0, False, same) == "PASS c"
    # The first value right, then "done" before the second eq ran: not checked, not passed.
    early = harness.judge_check("c", [1, 2], [{"eq": 0, "got": "1"}, done], 0, False, same)
    assert early.startswith("FAIL c: 1 of 2 values were never checked (eq 1)"), early
    assert harness.judge_check("c", [1, 2], [{"eq": 0, "got": "1"}, {"eq": 1, "got": "3"}, done], 0, False, same).startswith("FAIL c: got 3")
    assert harness.judge_check("c", [], [done], 0, False, same) == "PASS c"  # a check without eq: finishing is all


def _state(pid: int) -> str:
    """A process's state letter ('' once it is gone; a zombie is 'Z')."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return ""


def test_what_a_check_leaves_running_is_killed_with_it() -> None:
    source = harness.CHILD_PRELUDE + (
        "import subprocess\n"
        "_p = subprocess.Popen(['sleep', '60'])\n"
        "_rep.write(_json.dumps({'pid': _p.pid}) + '\\n')\n"
        "_rep.write(_json.dumps({'done': True}) + '\\n')\n"
        "_rep.flush()\n"
        "_os._exit(0)\n"
    )
    reports, code, timed_out = harness.run_child(source, [], b"", 20)
    assert code == 0 and not timed_out
    [pid] = [r["pid"] for r in reports if "pid" in r]
    deadline = time.monotonic() + 10
    while _state(pid) not in ("", "Z") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _state(pid) in ("", "Z"), f"the check's background process {pid} outlived it"
