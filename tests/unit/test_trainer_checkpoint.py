"""Atomic checkpoints: complete ones are found, half-written ones never count, old ones go."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from services.trainer import checkpoint as ckpt


def _save(root: Path, step: int, keep: int = 3) -> Path:
    return ckpt.save_checkpoint(root, step, {"w": torch.full((2,), float(step))}, {"step": step}, keep)


def test_save_then_load_round_trip(tmp_path: Path) -> None:
    path = _save(tmp_path, 7)
    assert path.name == "step-000000007" and (path / ckpt.MARKER).is_file()
    state, meta = ckpt.load_checkpoint(path)
    assert torch.equal(state["w"], torch.full((2,), 7.0)) and meta == {"step": 7}


def test_latest_ignores_incomplete_and_temporary_folders(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    _save(tmp_path, 2)
    # A crash mid-write leaves a temporary folder, or (never renamed) a folder without its marker.
    (tmp_path / ".tmp-step-000000003-99").mkdir()
    (tmp_path / "step-000000004").mkdir()
    (tmp_path / "step-000000004" / ckpt.STATE_FILE).write_bytes(b"half")
    assert ckpt.latest_checkpoint(tmp_path) == tmp_path / "step-000000002"
    ckpt.prune(tmp_path, keep=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000001", "step-000000002"]


def test_keeps_the_newest_n(tmp_path: Path) -> None:
    for step in range(1, 6):
        _save(tmp_path, step, keep=2)
    assert [p.name for p in ckpt.complete_checkpoints(tmp_path)] == ["step-000000004", "step-000000005"]


def test_the_same_step_again_replaces_it_whole(tmp_path: Path) -> None:
    """A step that trained nothing takes more groups at the same step number; the newer
    checkpoint, which lists them, must be the one on disk (they are acked after it)."""
    _save(tmp_path, 3)
    ckpt.save_checkpoint(tmp_path, 3, {"w": torch.zeros(2)}, {"step": 3, "trained_groups": ["g"]}, 3)
    state, meta = ckpt.load_checkpoint(tmp_path / "step-000000003")
    assert meta == {"step": 3, "trained_groups": ["g"]} and torch.equal(state["w"], torch.zeros(2))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]


def test_missing_root_has_no_checkpoint(tmp_path: Path) -> None:
    assert ckpt.latest_checkpoint(tmp_path / "absent") is None


def test_a_crash_inside_a_same_step_rewrite_keeps_that_step(tmp_path: Path) -> None:
    """Killed between moving step 3 aside and renaming its rewrite into place: step 3 (whose
    groups were acked) comes back, not step 2, and a replaced one that was superseded goes."""
    _save(tmp_path, 2)
    _save(tmp_path, 3)
    aside = tmp_path / ".tmp-replaced-step-000000003-4242"
    (tmp_path / "step-000000003").rename(aside)  # the state the crash leaves
    (tmp_path / ".tmp-step-000000003-4242").mkdir()  # the rewrite, never renamed
    ckpt.restore_replaced(tmp_path)
    assert ckpt.latest_checkpoint(tmp_path) == tmp_path / "step-000000003"
    assert ckpt.load_checkpoint(tmp_path / "step-000000003")[1] == {"step": 3}
    # Crashed after the rewrite took its place: the old one stays aside, for prune.
    stale = tmp_path / ".tmp-replaced-step-000000003-77"
    stale.mkdir()
    (stale / ckpt.MARKER).write_text("ok\n")
    ckpt.restore_replaced(tmp_path)
    ckpt.prune(tmp_path, keep=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000002", "step-000000003"]


def test_a_checkpoint_without_its_marker_is_not_loaded(tmp_path: Path) -> None:
    """A torn checkpoint (its files there, its COMPLETE marker not) must never be loaded,
    even when named directly: its state may be half-written."""
    path = _save(tmp_path, 5)
    torn = tmp_path / "step-000000006"
    shutil.copytree(path, torn)
    (torn / ckpt.MARKER).unlink()
    with pytest.raises(FileNotFoundError, match=ckpt.MARKER):
        ckpt.load_checkpoint(torn)


def test_a_crash_between_the_renames_of_a_same_step_rewrite_keeps_that_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rewrite of step 3 dies after step 3 was moved aside and before the new one
    took its place: the restarted trainer finds step 3 (whose groups may be acked), never
    step 2; the old checkpoint is moved aside, not deleted, before the rename."""
    _save(tmp_path, 2)
    _save(tmp_path, 3)
    rename = os.rename

    def crash_on_the_rewrite(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        if Path(src).name.startswith(".tmp-step-"):
            raise OSError("killed")  # the process dies here
        rename(src, dst)

    monkeypatch.setattr(os, "rename", crash_on_the_rewrite)
    with pytest.raises(OSError, match="killed"):
        ckpt.save_checkpoint(tmp_path, 3, {"w": torch.zeros(2)}, {"step": 3, "trained_groups": ["g"]}, 3)
    monkeypatch.undo()
    ckpt.restore_replaced(tmp_path)
    assert ckpt.latest_checkpoint(tmp_path) == tmp_path / "step-000000003"
    state, meta = ckpt.load_checkpoint(tmp_path / "step-000000003")
    assert meta == {"step": 3} and torch.equal(state["w"], torch.full((2,), 3.0))
