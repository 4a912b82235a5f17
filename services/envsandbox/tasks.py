"""Task format, the built-in suite's loader, and how test output becomes a reward.

A task is one JSON file::

    {
      "id": "py/add_numbers",            # unique, path-like
      "kind": "python_function",         # python_function | bugfix | terminal | scored
      "split": "train",                  # train | eval
      "instruction": "...",              # what the agent is asked to do
      "files": {"path": "content"},      # visible starting files
      "answer_path": "solution.py",      # where a single-answer submission is written
      "tests": {"path": "content"},      # hidden until RunTests; written under .tests/
      "test_command": ["python3", ".tests/test_solution.py"],
      "reward": "pass_fraction",         # pass_fraction | all_pass | score
      "reference": {"path": "content"},  # a known-good solution (suite checks use it)
      "limits": {"wall_seconds": 10}     # optional, overrides the sandbox defaults
    }

Test commands report one line per test case, ``PASS <name>`` or ``FAIL <name>: <why>``,
and, for ``score`` tasks, a final ``SCORE <float in [0, 1]>``. A ``TOTAL <n>`` line
announces how many cases will follow, so that cases missing from the output (the run
timed out or was killed) count as failed. The reward is the fraction of passed cases
(``pass_fraction``), 1 when every case passed and the command exited 0 (``all_pass``),
or the SCORE value (``score``); no parsable line means 0.

Only the test command's standard output is scored, and the built-in tasks run their
tests through the trusted harness (``harness.py``, copied to ``.tests/_harness.py``):
code under test never runs in the process that writes that output, so it cannot forge
results. Test modules take one of the harness's shapes (``cases``, ``checks``, ``script``).
"""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

from meridian.errors import InvalidArgument, NotFound

BUILTIN_DIR = Path(__file__).parent / "suites" / "builtin"
TESTS_DIR = ".tests"
REWARD_KINDS = ("pass_fraction", "all_pass", "score")

_RESULT_LINE = re.compile(r"^(PASS|FAIL) (\S+)(?::\s?(.*))?$")
_SCORE_LINE = re.compile(r"^SCORE (\S+)$")
_TOTAL_LINE = re.compile(r"^TOTAL (\d{1,6})$")


@dataclasses.dataclass(frozen=True)
class TaskLimits:
    wall_seconds: float = 20.0
    memory_bytes: int = 512 * 1024 * 1024
    max_output_bytes: int = 1024 * 1024


@dataclasses.dataclass(frozen=True)
class Task:
    id: str
    kind: str
    split: str
    instruction: str
    files: dict[str, str]
    answer_path: str
    tests: dict[str, str]
    test_command: list[str]
    reward: str
    reference: dict[str, str]
    limits: TaskLimits = TaskLimits()

    @classmethod
    def from_dict(cls, data: dict[str, Any], origin: str = "<dict>") -> "Task":
        """Validates and builds a task; errors name the file and the field."""
        try:
            task = cls(
                id=str(data["id"]),
                kind=str(data["kind"]),
                split=str(data.get("split", "train")),
                instruction=str(data["instruction"]),
                files=dict(data.get("files", {})),
                answer_path=str(data.get("answer_path", "solution.py")),
                tests=dict(data["tests"]),
                test_command=[str(a) for a in data["test_command"]],
                reward=str(data.get("reward", "pass_fraction")),
                reference=dict(data.get("reference", {})),
                limits=TaskLimits(**data.get("limits", {})),
            )
        except (KeyError, TypeError) as exc:
            raise InvalidArgument(f"task {origin}: missing or malformed field: {exc}") from exc
        if task.reward not in REWARD_KINDS:
            raise InvalidArgument(f"task {origin}: reward must be one of {REWARD_KINDS}, got {task.reward!r}")
        if task.split not in ("train", "eval"):
            raise InvalidArgument(f"task {origin}: split must be train or eval, got {task.split!r}")
        if not task.test_command:
            raise InvalidArgument(f"task {origin}: test_command is empty")
        return task


@dataclasses.dataclass(frozen=True)
class TestOutcome:
    reward: float
    cases: list[tuple[str, bool, str]]


def score_output(reward_kind: str, output: str, exit_code: int) -> TestOutcome:
    """Maps a test command's output and exit code to a reward (see module docstring)."""
    cases: list[tuple[str, bool, str]] = []
    score: float | None = None
    total = 0
    # Lines end at "\n" only. str.splitlines() also breaks at NEL, U+2028, \x1c.. and
    # others, which the tested code can get into the text of a FAIL line (a reported
    # value or exception message); each would start a line the test command never wrote.
    for line in output.split("\n"):
        line = line.strip()
        if m := _TOTAL_LINE.match(line):
            total = max(total, int(m.group(1)))
        elif m := _RESULT_LINE.match(line):
            cases.append((m.group(2), m.group(1) == "PASS", m.group(3) or ""))
        elif m := _SCORE_LINE.match(line):
            try:
                score = min(1.0, max(0.0, float(m.group(1))))
            except ValueError:
                score = None
    passed = sum(1 for _, ok, _ in cases if ok)
    expected = max(total, len(cases))
    if reward_kind == "score":
        reward = score if score is not None else 0.0
    elif reward_kind == "all_pass":
        reward = 1.0 if cases and passed == expected and exit_code == 0 else 0.0
    else:
        reward = passed / expected if expected else 0.0
    return TestOutcome(reward, cases)


class TaskSuite:
    """An in-memory set of tasks keyed by id."""

    def __init__(self, tasks: list[Task]) -> None:
        self._tasks: dict[str, Task] = {}
        for task in tasks:
            if task.id in self._tasks:
                raise InvalidArgument(f"duplicate task id {task.id!r}")
            self._tasks[task.id] = task

    @classmethod
    def load_dir(cls, root: Path) -> "TaskSuite":
        """Loads every ``*.json`` task below ``root``."""
        tasks = []
        for path in sorted(root.rglob("*.json")):
            try:
                data = json.loads(path.read_text())
            except json.JSONDecodeError as exc:
                raise InvalidArgument(f"task file {path}: {exc}") from exc
            tasks.append(Task.from_dict(data, origin=str(path)))
        return cls(tasks)

    @classmethod
    def builtin(cls) -> "TaskSuite":
        return cls.load_dir(BUILTIN_DIR)

    def get(self, task_id: str) -> Task:
        try:
            return self._tasks[task_id]
        except KeyError:
            raise NotFound(f"no task {task_id!r}") from None

    def select(self, split: str = "", kind: str = "") -> list[Task]:
        return [t for t in self._tasks.values() if (not split or t.split == split) and (not kind or t.kind == kind)]

    def __len__(self) -> int:
        return len(self._tasks)
