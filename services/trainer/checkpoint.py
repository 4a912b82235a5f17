"""Atomic trainer checkpoints: each is a folder ``step-<N>`` holding ``state.pt`` (model,
optimiser, scheduler, RNG states), ``meta.json`` (step, policy version, trained
trajectory ids, hashes) and a ``COMPLETE`` marker.

A checkpoint is written into a temporary folder, every file and the folder are
fsynced, the marker is written last, and only then is the folder renamed into place
(and the parent fsynced). A crash at any moment leaves either the previous newest
complete checkpoint or the new one, never a half-written one that counts.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MARKER = "COMPLETE"
STATE_FILE = "state.pt"
META_FILE = "meta.json"
_NAME = re.compile(r"^step-(\d{9})$")
_TMP_PREFIX = ".tmp-"
# A checkpoint a same-step rewrite moved aside (see save_checkpoint).
_REPLACED = re.compile(r"^\.tmp-replaced-(step-\d{9})-\d+$")


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checkpoint_name(step: int) -> str:
    return f"step-{step:09d}"


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoint folders under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _NAME.match(p.name) and (p / MARKER).is_file()]
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))  # type: ignore[union-attr]


def latest_checkpoint(root: Path) -> Path | None:
    found = complete_checkpoints(root)
    return found[-1] if found else None


def save_checkpoint(root: Path, step: int, state: dict[str, Any], meta: dict[str, Any], keep: int) -> Path:
    """Writes one checkpoint atomically, then prunes all but the newest ``keep`` complete ones."""
    import torch

    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_name(step)
    tmp = root / f"{_TMP_PREFIX}{checkpoint_name(step)}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    torch.save(state, tmp / STATE_FILE)
    (tmp / META_FILE).write_text(json.dumps(meta))
    for name in (STATE_FILE, META_FILE):
        _fsync_file(tmp / name)
    (tmp / MARKER).write_text("ok\n")
    _fsync_file(tmp / MARKER)
    _fsync_dir(tmp)
    if (final / MARKER).is_file():
        # The same step again: a step that trained nothing (stale or flat groups) took more
        # groups, which only the newer meta lists, and they are acked once this returns.
        # Moved aside first: a crash between the renames leaves it aside, complete, and
        # restore_replaced puts it back (the groups it covers are acked: falling back to
        # an older step would lose their effect), never a half-written one.
        aside = root / f"{_TMP_PREFIX}replaced-{checkpoint_name(step)}-{os.getpid()}"
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(final, aside)
        os.rename(tmp, final)
        _fsync_dir(root)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        _fsync_dir(root)
    prune(root, keep)
    return final


def restore_replaced(root: Path) -> None:
    """Puts back a complete checkpoint that a same-step rewrite moved aside when a crash
    came before the rewrite took its place (no complete folder of that step is there);
    one the rewrite did replace is left for :func:`prune`. Call before looking for the
    newest checkpoint."""
    if not root.is_dir():
        return
    for aside in sorted(root.iterdir()):
        m = _REPLACED.match(aside.name)
        if m is None or not (aside / MARKER).is_file() or (root / m.group(1) / MARKER).is_file():
            continue
        shutil.rmtree(root / m.group(1), ignore_errors=True)  # an incomplete one, if any
        os.rename(aside, root / m.group(1))
        _fsync_dir(root)
        log.warning("checkpoint %s was put back: a crash came while the same step was written again", m.group(1))


def prune(root: Path, keep: int) -> None:
    """Removes older complete checkpoints beyond ``keep`` and leftovers of interrupted writes."""
    for old in complete_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for p in root.iterdir():
        if p.name.startswith(_TMP_PREFIX) or (_NAME.match(p.name) and not (p / MARKER).is_file()):
            shutil.rmtree(p, ignore_errors=True)


def load_checkpoint(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(state, meta) of one complete checkpoint folder."""
    import torch

    if not (path / MARKER).is_file():
        raise FileNotFoundError(f"checkpoint {path} has no {MARKER} marker")
    meta = json.loads((path / META_FILE).read_text())
    state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=False)
    return state, meta


def read_meta(path: Path) -> dict[str, Any]:
    return json.loads((path / META_FILE).read_text())
