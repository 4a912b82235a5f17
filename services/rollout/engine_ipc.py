"""Folders for vLLM's socket files, one per engine, that do not outlive their engine.

vLLM binds its processes' IPC sockets as files under ``VLLM_RPC_BASE_PATH`` and never
removes them. An engine removes its folder at shutdown; one that is killed (SIGKILL, the
OOM killer) cannot. So each folder holds an advisory lock on a file inside it for as long
as a process of its engine keeps that file open (the kernel drops the lock with the last
holder, however it died), and every engine that starts removes the folders whose lock
nobody holds. A folder without that file (being created, or made by an older version) is
left alone."""

from __future__ import annotations

import dataclasses
import fcntl
import os
import shutil
import tempfile
from pathlib import Path

PREFIX = "meridian-vllm-"
LOCK_NAME = ".owner"


@dataclasses.dataclass
class IpcDir:
    """An engine's socket folder and the open, locked file that marks it as in use."""

    path: str
    lock_fd: int

    def remove(self) -> None:
        """Removes the folder and lets go of its lock (at the engine's shutdown)."""
        try:
            shutil.rmtree(self.path, ignore_errors=True)
        finally:
            if self.lock_fd >= 0:
                os.close(self.lock_fd)
                self.lock_fd = -1


def create(parent: str | Path | None = None) -> IpcDir:
    """A new folder under ``parent`` (default: the temp folder), locked for this process,
    after removing the folders there whose engines are gone."""
    sweep_stale(parent)
    path = tempfile.mkdtemp(prefix=PREFIX, dir=parent)
    # Locked under another name, then renamed: a sweeper only opens LOCK_NAME, so it
    # never finds the file before its lock is held.
    pending = os.path.join(path, LOCK_NAME + ".new")
    fd = os.open(pending, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(pending, os.path.join(path, LOCK_NAME))
    except BaseException:
        os.close(fd)
        shutil.rmtree(path, ignore_errors=True)
        raise
    return IpcDir(path, fd)


def sweep_stale(parent: str | Path | None = None) -> list[str]:
    """Removes the engine folders under ``parent`` whose lock no process holds; returns
    their paths. Folders of live engines, of other users and without a lock file stay."""
    removed = []
    for folder in sorted(Path(parent or tempfile.gettempdir()).glob(PREFIX + "*")):
        try:
            fd = os.open(folder / LOCK_NAME, os.O_RDWR)
        except OSError:
            continue  # no lock file (not ours to judge) or not readable (another user's)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # its engine still runs
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(str(folder))
        finally:
            os.close(fd)
    return removed
