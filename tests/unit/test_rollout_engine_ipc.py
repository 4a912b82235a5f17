"""vLLM socket folders: removed by their engine, or by the next engine once theirs is killed."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from services.rollout import engine_ipc

# A stand-in engine process: makes its folder under argv[1], says where, and waits.
OWNER = """
import sys, time
from services.rollout import engine_ipc
print(engine_ipc.create(sys.argv[1]).path, flush=True)
time.sleep(300)
"""


def test_a_live_engines_folder_stays_and_its_own_shutdown_removes_it(tmp_path: Path) -> None:
    mine = engine_ipc.create(tmp_path)
    (Path(mine.path) / "socket").touch()
    assert engine_ipc.sweep_stale(tmp_path) == []  # another open of the lock is refused
    assert Path(mine.path, "socket").exists()
    mine.remove()
    assert not Path(mine.path).exists() and list(tmp_path.iterdir()) == []


def test_a_killed_engines_folder_is_removed_by_the_next_engine(tmp_path: Path) -> None:
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None
        theirs = Path(owner.stdout.readline().strip())
        assert theirs.is_dir()
        assert engine_ipc.sweep_stale(tmp_path) == []  # its owner lives
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=30)
        mine = engine_ipc.create(tmp_path)  # what an engine does when it starts
        try:
            assert not theirs.exists()
            assert [p.name for p in tmp_path.iterdir()] == [Path(mine.path).name]
        finally:
            mine.remove()
    finally:
        owner.kill()
        owner.wait()
        if owner.stdout is not None:
            owner.stdout.close()


def test_folders_without_a_lock_file_are_left_alone(tmp_path: Path) -> None:
    older = tmp_path / (engine_ipc.PREFIX + "older")  # an older version's, or one being made
    older.mkdir()
    other = tmp_path / "not-ours"
    other.mkdir()
    assert engine_ipc.sweep_stale(tmp_path) == []
    assert older.is_dir() and other.is_dir()
