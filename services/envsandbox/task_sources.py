"""Where tasks come from beyond the built-in suite: a folder of task JSON files and of
SWE-bench-style JSONL files (one instance per line), as ``--tasks-dir`` names it."""
from __future__ import annotations

from pathlib import Path

from meridian.errors import InvalidArgument
from services.envsandbox.swebench import load_swebench_jsonl
from services.envsandbox.tasks import Task, TaskSuite


def load_tasks_dir(root: Path) -> list[Task]:
    """Every ``*.json`` task and every instance of every ``*.jsonl`` file below ``root``."""
    if not root.is_dir():
        raise InvalidArgument(f"tasks folder {root} does not exist")
    tasks = TaskSuite.load_dir(root).select()
    for path in sorted(root.rglob("*.jsonl")):
        tasks += load_swebench_jsonl(path)
    return tasks
