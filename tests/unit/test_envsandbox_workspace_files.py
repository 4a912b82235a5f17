"""workspace_files on a plain folder: deep trees (thousands of levels, as a sandbox can make
them) are removed and copied without recursion and with a few descriptors open, symlinks in
them are never followed, and bad paths are PathErrors, never a bare OSError."""
from __future__ import annotations

import contextlib
import os
import socket
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from services.envsandbox import workspace_files
from services.envsandbox.workspace_files import PathError

DEPTH = 2000
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW


class FdCount:
    """How many descriptors workspace_files holds open at most (os.open and os.dup minus os.close)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.live = self.peak = 0
        real_open, real_dup, real_close = os.open, os.dup, os.close

        def opened(fd: int) -> int:
            self.live += 1
            self.peak = max(self.peak, self.live)
            return fd

        def close(fd: int) -> None:
            real_close(fd)
            self.live -= 1

        monkeypatch.setattr(workspace_files.os, "open", lambda *a, **k: opened(real_open(*a, **k)))
        monkeypatch.setattr(workspace_files.os, "dup", lambda fd: opened(real_dup(fd)))
        monkeypatch.setattr(workspace_files.os, "close", close)


def build_deep(top: Path, outside: Path) -> None:
    """``top/a/a/...`` DEPTH levels deep; on the way: files of several modes, a folder of mode
    0o750 holding a file, symlinks out of the tree (absolute, relative, to a folder), a FIFO."""
    top.mkdir()
    fd = os.open(top, DIR_FLAGS)
    try:
        for level in range(DEPTH):
            if level % 100 == 0:
                f = os.open("f.txt", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd)
                os.write(f, f"level {level}".encode())
                os.close(f)
                os.chmod("f.txt", 0o751 if level % 200 == 0 else 0o640, dir_fd=fd)
                os.symlink(str(outside), "out", dir_fd=fd)
                os.symlink("../../../../outside", "up", dir_fd=fd)
                os.mkdir("d", dir_fd=fd)
                os.chmod("d", 0o750, dir_fd=fd)
                d = os.open("d", DIR_FLAGS, dir_fd=fd)
                g = os.open("g.bin", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=d)
                os.write(g, bytes(range(256)) * 3)
                os.close(g)
                os.close(d)
            if level == 1500:
                os.mkfifo("pipe", dir_fd=fd)
            os.mkdir("a", dir_fd=fd)
            if level == 1000:
                os.chmod("a", 0o777, dir_fd=fd)
            nxt = os.open("a", DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nxt
        f = os.open("bottom.txt", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
        os.write(f, b"the bottom")
        os.close(f)
    finally:
        os.close(fd)


def describe(top: Path) -> Iterator[tuple[int, str, str, int, bytes]]:
    """(level, name, kind, mode, link target or content) of everything in a tree built by
    build_deep, walked down the ``a`` chain with two descriptors at most."""
    fd = os.open(top, DIR_FLAGS)
    level = 0
    try:
        while True:
            names = sorted(os.listdir(fd))
            for name in names:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                mode = stat.S_IMODE(st.st_mode)
                if stat.S_ISLNK(st.st_mode):
                    yield level, name, "link", 0, os.readlink(name, dir_fd=fd).encode()
                elif stat.S_ISREG(st.st_mode):
                    yield level, name, "file", mode, _read(fd, name)
                elif stat.S_ISDIR(st.st_mode):
                    yield level, name, "dir", mode, b""
                    if name == "d":
                        d = os.open(name, DIR_FLAGS, dir_fd=fd)
                        yield from ((level, f"d/{n}", "file", stat.S_IMODE(os.stat(n, dir_fd=d).st_mode), _read(d, n)) for n in sorted(os.listdir(d)))
                        os.close(d)
                else:
                    yield level, name, "special", mode, b""
            if "a" not in names:
                return
            nxt = os.open("a", DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd, level = nxt, level + 1
    finally:
        os.close(fd)


def _read(dir_fd: int, name: str) -> bytes:
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dir_fd)
    try:
        return os.read(fd, 1 << 20)
    finally:
        os.close(fd)


@pytest.fixture
def deep(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """A workspace holding a DEPTH-level ``.tests`` tree, and a folder outside it that the
    tree's symlinks point at. Everything in tmp_path is removed afterwards with remove_tree
    (pytest's own clean-up, shutil.rmtree, recurses and fails on trees this deep)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("not the sandbox's")
    ws = tmp_path / "ws"
    ws.mkdir()
    build_deep(ws / ".tests", outside)
    (ws / "other.txt").write_text("stays")
    yield ws, outside
    remove_below(tmp_path)


def remove_below(folder: Path) -> None:
    """Removes everything in ``folder`` with remove_tree (iterative: pytest's own clean-up,
    shutil.rmtree, recurses and fails on the trees these tests build)."""
    fd = os.open(folder, DIR_FLAGS)
    try:
        for name in os.listdir(fd):
            workspace_files.remove_tree(fd, name)
    finally:
        os.close(fd)


def test_remove_tree_removes_a_tree_thousands_of_levels_deep(deep: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    ws, outside = deep
    root = os.open(ws, DIR_FLAGS)
    try:
        fds = FdCount(monkeypatch)
        workspace_files.remove_tree(root, ".tests")
        assert fds.peak <= 4 and fds.live == 0
    finally:
        monkeypatch.undo()
        os.close(root)
    assert sorted(os.listdir(ws)) == ["other.txt"]
    # The symlinks to a folder outside were removed, never followed.
    assert (outside / "keep.txt").read_text() == "not the sandbox's"


def test_copy_tree_copies_a_tree_thousands_of_levels_deep_faithfully(deep: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ws, outside = deep
    dst = tmp_path / "copy"
    dst.mkdir()
    src_fd, dst_fd = os.open(ws, DIR_FLAGS), os.open(dst, DIR_FLAGS)
    umask = os.umask(0o077)  # the copy keeps modes whatever the service's umask
    try:
        fds = FdCount(monkeypatch)
        workspace_files.copy_tree(src_fd, dst_fd)
        assert fds.peak <= 6 and fds.live == 0
    finally:
        monkeypatch.undo()
        os.umask(umask)
        os.close(src_fd)
        os.close(dst_fd)

    want = [e for e in describe(ws / ".tests") if e[2] != "special"]  # FIFOs are not copied
    got = list(describe(dst / ".tests"))
    assert got == want
    assert len(want) > DEPTH and want[-1] == (DEPTH, "bottom.txt", "file", 0o644, b"the bottom")
    assert (DEPTH // 2, "a", "dir", 0o777, b"") in got and (0, "f.txt", "file", 0o751, b"level 0") in got
    # Symlinks are copied as links, never followed: nothing of the folder they point at came along.
    assert (1500, "out", "link", 0, str(outside).encode()) in got
    assert sorted(os.listdir(dst)) == [".tests", "other.txt"]
    assert all(e[4] != b"not the sandbox's" for e in got)
    assert (outside / "keep.txt").read_text() == "not the sandbox's"


def test_copy_tree_stops_when_a_folder_is_moved_out_from_under_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The walk climbs back up through '..' only to the folder it came from: a folder moved
    out of the workspace mid-copy (by a process still running in the sandbox) stops the copy
    instead of leading it into what is around the workspace."""
    around = tmp_path / "around"
    (around / "ws" / "a" / "b").mkdir(parents=True)
    (around / "ws" / "a" / "b" / "f.txt").write_text("mine")
    (around / "ws" / "a" / "secret.txt").write_text("harmless")
    (around / "secret.txt").write_text("TOP SECRET")
    dst = tmp_path / "copy"
    dst.mkdir()
    b_ino = os.stat(around / "ws" / "a" / "b").st_ino
    real_listdir = os.listdir

    def listdir(fd: int) -> list[str]:
        names = sorted(real_listdir(fd))
        if isinstance(fd, int) and os.fstat(fd).st_ino == b_ino:
            os.rename(around / "ws" / "a" / "b", around / "b")  # now '..' of b is `around`
        return names

    monkeypatch.setattr(workspace_files.os, "listdir", listdir)
    src_fd, dst_fd = os.open(around / "ws", DIR_FLAGS), os.open(dst, DIR_FLAGS)
    try:
        with pytest.raises(PathError) as caught:
            workspace_files.copy_tree(src_fd, dst_fd)
    finally:
        os.close(src_fd)
        os.close(dst_fd)
    assert caught.value.kind == "changed"
    copied = [p.read_text() for p in dst.rglob("*") if p.is_file()]
    assert "TOP SECRET" not in copied


def test_bad_paths_are_path_errors_not_os_errors(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "d").mkdir()
    (ws / "file.txt").write_text("x")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(ws / "sock"))
    long = "x" * 300
    root = os.open(ws, DIR_FLAGS)
    try:
        for rel in (long, f"{long}/f.txt", f"d/{long}", "sock"):
            with pytest.raises(PathError) as caught:
                workspace_files.read_file(root, rel, 1000)
            assert caught.value.kind == "invalid" and repr(rel)[:20] in str(caught.value)
        for rel in (long, f"{long}/f.txt", f"d/{long}"):
            with pytest.raises(PathError) as caught:
                workspace_files.write_file(root, rel, b"x")
            assert caught.value.kind == "invalid"
            # Nothing by that name can exist, so there is nothing to remove.
            workspace_files.remove_tree(root, rel)
        with pytest.raises(PathError) as caught:
            workspace_files._walk_dirs(root, [long], long, create=False, owner=None)
        assert caught.value.kind == "invalid"
        with pytest.raises(PathError) as caught:
            workspace_files.read_file(root, "d/nope.txt", 1000)
        assert caught.value.kind == "not_found"
    finally:
        os.close(root)
        sock.close()


def test_read_file_stops_at_the_total_budget(tmp_path: Path) -> None:
    (tmp_path / "f.txt").write_bytes(b"x" * 100)
    root = os.open(tmp_path, DIR_FLAGS)
    try:
        assert workspace_files.read_file(root, "f.txt", 1000, total_left=100) == b"x" * 100
        with pytest.raises(PathError) as caught:
            workspace_files.read_file(root, "f.txt", 1000, total_left=99)
        assert caught.value.kind == "too_large"
        with pytest.raises(PathError) as caught:
            workspace_files.read_file(root, "f.txt", 99, total_left=1000)
        assert caught.value.kind == "invalid"
    finally:
        os.close(root)


def _remove_read_only_trees(ws: int) -> list[str]:
    """Makes read-only, unreadable and deep folders in ``.tests`` of the folder ``ws`` (a
    descriptor: no path above it needs to be searchable), then removes ``.tests``."""

    def mkdirs(path: str, files: tuple[str, ...] = ()) -> None:
        fd = os.dup(ws)
        for name in path.split("/"):
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, dir_fd=fd)
            nxt = os.open(name, DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nxt
        for name in files:
            os.close(os.open(name, os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
        os.close(fd)

    mkdirs(".tests/x/y")
    mkdirs(".tests/r/s")
    mkdirs(".tests/r", ("f.txt",))
    mkdirs(".tests/u/v/w")
    mkdirs(".tests/u/v", ("f.txt",))
    fd = os.open(".tests", DIR_FLAGS, dir_fd=ws)
    for level in range(1500):
        os.mkdir("a", dir_fd=fd)
        if level % 300 == 0:
            os.close(os.open("f.txt", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
            os.fchmod(fd, 0o500)
        nxt = os.open("a", DIR_FLAGS, dir_fd=fd)
        os.close(fd)
        fd = nxt
    os.close(fd)
    tests = os.open(".tests", DIR_FLAGS, dir_fd=ws)
    for path, mode in (("x/y", 0o555), ("r/s", 0o500), ("r", 0o555), ("u/v", 0o000), ("u", 0o100)):
        os.chmod(path, mode, dir_fd=tests)
    os.close(tests)
    workspace_files.remove_tree(ws, ".tests")
    return sorted(os.listdir(ws))


def test_remove_tree_as_the_owner_of_read_only_and_unreadable_folders(tmp_path: Path) -> None:
    """Without root (the Docker backend removes .tests as the sandbox's user), folders the
    sandbox made read-only or unreadable, however deep, are removed all the same."""
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "keep.txt").write_text("x")
    ws_fd = os.open(ws, DIR_FLAGS)
    try:
        if os.geteuid() != 0:
            assert _remove_read_only_trees(ws_fd) == ["keep.txt"]
        else:
            assert _as_nobody(lambda: _remove_read_only_trees(ws_fd), ws) == "['keep.txt']"
    finally:
        workspace_files.remove_tree(ws_fd, ".tests")  # whatever is left: too deep for pytest's clean-up
        os.close(ws_fd)


def _as_nobody(fn: Callable[[], object], owned: Path) -> str:
    """``repr(fn())`` (or the error it raised) from a child that is uid 65534 and owns ``owned``."""
    os.chown(owned, 65534, 65534)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            os.write(write, repr(fn()).encode())
        except BaseException as exc:
            os.write(write, f"{type(exc).__name__}: {exc}".encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as fh:
        said = fh.read()
    os.waitpid(pid, 0)
    return said


def _owner_operations(ws: int, own: int) -> dict[str, object]:
    """As the owner of the folder ``ws`` (and of ``own``, outside it): takes away from itself
    what a hostile sandbox would (folders and files it may not read, search or change, the
    top folder ``ws`` included, a symlink to ``../own``, a locked folder of its own), then runs
    the service's file operations; what they answered."""
    for folder in ("ro", "ro/deep", "locked", "gone", "gone/sub"):
        os.mkdir(folder, 0o755, dir_fd=ws)
    for path, data in (("ro/old.txt", b"old"), ("locked/h.txt", b"hidden"), ("gone/sub/f", b"f"), ("own.txt", b"own")):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=own if path == "own.txt" else ws)
        os.write(fd, data)
        os.close(fd)
    os.symlink("../own", "link", dir_fd=ws)
    for path, mode in (("ro/old.txt", 0o444), ("locked/h.txt", 0), ("locked", 0), ("ro/deep", 0o555), ("ro", 0o555), ("gone/sub", 0), ("gone", 0o500)):
        os.chmod(path, mode, dir_fd=ws)
    os.fchmod(own, 0)
    os.fchmod(ws, 0)
    said: dict[str, object] = {}
    for path, data in (("ro/new.txt", b"new"), ("ro/old.txt", b"replaced"), ("ro/deep/more/m.txt", b"m"), ("locked/w.txt", b"w"), ("top.txt", b"t")):
        workspace_files.write_file(ws, path, data)
    for path in ("ro/new.txt", "ro/old.txt", "ro/deep/more/m.txt", "locked/w.txt", "locked/h.txt", "top.txt"):
        said[path] = workspace_files.read_file(ws, path, 100)
    for path in ("link/own.txt", "link/new.txt"):
        for name, op in (("read", lambda p=path: workspace_files.read_file(ws, p, 100)), ("write", lambda p=path: workspace_files.write_file(ws, p, b"x"))):
            try:
                op()
                said[f"{name} {path}"] = "done"
            except PathError as exc:
                said[f"{name} {path}"] = exc.kind
    workspace_files.remove_tree(ws, "gone")
    return said


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")
def test_file_operations_as_the_owner_work_whatever_modes_it_left(tmp_path: Path) -> None:
    """Without root (the Docker backend works as the sandbox's user) writes, reads and
    removals do what they do as root, whatever modes the owner took from itself, and leave
    every mode as it was (a written file has the mode write_file gives); a symlink to a
    locked folder is neither followed nor changed."""
    ws, own = tmp_path / "ws", tmp_path / "own"
    ws.mkdir()
    own.mkdir()
    os.chown(own, 65534, 65534)
    ws_fd, own_fd = os.open(ws, DIR_FLAGS), os.open(own, DIR_FLAGS)
    umask = os.umask(0o022)
    try:
        said = _as_nobody(lambda: _owner_operations(ws_fd, own_fd), ws)
    finally:
        os.umask(umask)
        os.close(ws_fd)
        os.close(own_fd)
    assert said == repr({
        "ro/new.txt": b"new", "ro/old.txt": b"replaced", "ro/deep/more/m.txt": b"m", "locked/w.txt": b"w",
        "locked/h.txt": b"hidden", "top.txt": b"t",
        "read link/own.txt": "invalid", "write link/own.txt": "invalid", "read link/new.txt": "invalid", "write link/new.txt": "invalid",
    })
    modes = {p: oct(stat.S_IMODE(os.lstat(ws / p).st_mode)) for p in (".", "ro", "ro/deep", "ro/old.txt", "ro/new.txt", "ro/deep/more", "locked", "locked/h.txt", "locked/w.txt")}
    assert modes == {
        ".": "0o0", "ro": "0o555", "ro/deep": "0o555", "ro/old.txt": "0o644", "ro/new.txt": "0o644",
        "ro/deep/more": "0o755", "locked": "0o0", "locked/h.txt": "0o0", "locked/w.txt": "0o644",
    }
    assert stat.S_IMODE(os.stat(own).st_mode) == 0 and sorted(os.listdir(own)) == ["own.txt"]
    assert sorted(os.listdir(ws)) == ["link", "locked", "ro", "top.txt"]
