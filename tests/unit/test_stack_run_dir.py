"""What a stopped stack leaves in a run folder nobody asked to keep: its logs and the
named entries, nothing else (a job's stack leaves gigabytes of checkpoints and stores)."""
from __future__ import annotations

from pathlib import Path

from meridian import stack as stack_mod


def _write(path: Path, size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)


def test_remove_state_keeps_the_logs_and_the_named_entries_only(tmp_path: Path) -> None:
    run = tmp_path / "run"
    outside = tmp_path / "outside" / "weights.bin"
    _write(outside, 4096)
    _write(run / "rollout.log", 10)
    _write(run / "weightsync-b.log", 20)
    _write(run / "report" / "summary.json", 30)
    removed = {
        "trainer-checkpoints/step-000000001/model.safetensors": 1 << 20,
        "credentials/ca.key": 100,
        "redis/appendonlydir/appendonly.aof": 300,
        "weightsync/v1/chunk-0": 500,
        "redis.conf": 40,
        "link-b.json": 50,
        "old.log/inside": 60,  # a folder named like a log is not a log
    }
    for name, size in removed.items():
        _write(run / name, size)
    (run / "sandboxes").mkdir()
    (run / "link-to-weights").symlink_to(outside)
    (run / "folder-link").symlink_to(outside.parent, target_is_directory=True)

    freed = stack_mod.remove_state(run, keep=frozenset({"report"}))

    assert sorted(p.relative_to(run).as_posix() for p in run.rglob("*")) == ["report", "report/summary.json", "rollout.log", "weightsync-b.log"]
    links = len(str(outside)) + len(str(outside.parent))  # a link's own size is its target's path
    assert freed == sum(removed.values()) + links
    assert outside.read_bytes() == b"x" * 4096  # links are removed, not followed


def test_remove_state_of_a_folder_with_logs_only_frees_nothing(tmp_path: Path) -> None:
    _write(tmp_path / "trainer.log", 10)
    assert stack_mod.remove_state(tmp_path) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["trainer.log"]
