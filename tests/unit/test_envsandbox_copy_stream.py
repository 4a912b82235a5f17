"""A workspace copy as two processes joined by a stream (the Docker backend's Fork, here
without Docker): workspace_files.send_tree walks, receive_tree builds, docker_stream.relay
carries the bytes between two Docker exec sockets. The copy is copy_tree's (holes kept,
special files left out); a sender walking as the owner opens what only root could read and
gives every mode back, also when it is stopped half-way; a receiver takes no stream that is
not a copy; the relay holds one read at a time, stops the sender when the receiver fails,
and gives up at its deadline."""
from __future__ import annotations

import json
import os
import signal
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar
from pathlib import Path

import pytest

from services.envsandbox import docker_stream, workspace_files
from services.envsandbox.workspace_files import PathError
from tests.unit.test_envsandbox_workspace_files import DIR_FLAGS, build_deep, describe, remove_below

E = TypeVar("E", bound=BaseException)

NOBODY = 65534


@pytest.fixture
def folders(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """An empty source and an empty destination folder; everything below tmp_path is removed
    with remove_tree afterwards (trees here are too deep for pytest's clean-up)."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    dst.mkdir()
    yield src, dst
    remove_below(tmp_path)


def _streamed(src: Path, dst: Path) -> bool:
    """send_tree(src) in a thread into a pipe, receive_tree(dst) from it: what send_tree returned."""
    read, write = os.pipe()
    stop_read, stop_write = os.pipe()
    src_fd, dst_fd = os.open(src, DIR_FLAGS), os.open(dst, DIR_FLAGS)
    sent: list[bool] = []

    def send() -> None:
        try:
            sent.append(workspace_files.send_tree(src_fd, write, stop_read))
        finally:
            os.close(write)

    thread = threading.Thread(target=send)
    thread.start()
    try:
        workspace_files.receive_tree(dst_fd, read)
    finally:
        os.close(stop_write)  # a sender still writing stops
        thread.join()
        for fd in (read, stop_read, src_fd, dst_fd):
            os.close(fd)
    return sent == [True]


def test_a_streamed_copy_is_copy_tree_s_copy_and_keeps_holes(folders: tuple[Path, Path], tmp_path: Path) -> None:
    src, dst = folders
    outside = tmp_path / "outside"
    outside.mkdir()
    build_deep(src / ".tests", outside)
    # 64 MiB: a copy that fills the holes fails the check below, without filling the disk.
    size = 64 << 20
    with open(src / "sparse.bin", "wb") as fh:
        fh.write(b"head")
        fh.truncate(size)
        fh.seek(-4, os.SEEK_END)
        fh.write(b"tail")
    os.link(src / "sparse.bin", src / "hard.bin")
    assert _streamed(src, dst)
    want = [e for e in describe(src / ".tests") if e[2] != "special"]
    assert list(describe(dst / ".tests")) == want
    assert os.stat(dst / "sparse.bin").st_ino == os.stat(dst / "hard.bin").st_ino
    for name in ("sparse.bin", "hard.bin"):
        copy = os.stat(dst / name)
        assert copy.st_size == size and copy.st_blocks * 512 <= 1 << 20, "a hole was filled"
        assert copy.st_nlink == 2, "a hard link was copied as a separate file"
        with open(dst / name, "rb") as fh:
            assert fh.read(4) == b"head" and os.pread(fh.fileno(), 4, size - 4) == b"tail"


def _as_owner(fn: Callable[[], int], folder: Path) -> int:
    """Starts ``fn`` in a child that is uid NOBODY and owns ``folder``; the child's pid. Its
    exit status is what ``fn`` returns (99 when it raised)."""
    os.chown(folder, NOBODY, NOBODY)
    pid = os.fork()
    if pid == 0:
        code = 99
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            code = fn()
        finally:
            os._exit(code)
    return pid


def _exit_status(pid: int, within_s: float = 60.0) -> int:
    """The child's exit status; a child still running after ``within_s`` (a sender that
    never stops: the defect under test) is killed, and its status is -SIGKILL."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


LOCKED = {"secret": 0o000, "locked": 0o000, "locked/inner": 0o000, "wx": 0o300, "ro": 0o555}


def _build_locked(src_fd: int, big: int) -> None:
    """As the owner: a file and folders only root may read or search (LOCKED's modes), the
    innermost holding ``big`` bytes."""
    for folder in ("locked", "locked/inner", "wx", "ro"):
        os.mkdir(folder, 0o755, dir_fd=src_fd)
    for path, data in (("secret", b"s"), ("locked/inner/big.bin", os.urandom(big)), ("wx/y", b"y"), ("ro/x", b"x")):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=src_fd)
        os.write(fd, data)
        os.close(fd)
    for path in sorted(LOCKED, key=len, reverse=True):
        os.chmod(path, LOCKED[path], dir_fd=src_fd)


def _modes(src: Path) -> dict[str, int]:
    return {path: stat.S_IMODE(os.lstat(src / path).st_mode) for path in LOCKED}


def _copy_as_owner(src: Path, dst: Path, sender_source: Callable[[int], int]) -> int:
    """Streams a walk of ``src`` from a child acting as its owner into ``dst``: the child
    builds what it needs below ``src`` and returns the descriptor it walks from
    (``sender_source(src_fd)``). The child's exit status."""
    src_fd = os.open(src, DIR_FLAGS)
    read, write = os.pipe()
    stop_read, stop_write = os.pipe()

    def send() -> int:
        os.close(read)
        return 0 if workspace_files.send_tree(sender_source(src_fd), write, stop_read) else 1

    pid = _as_owner(send, src)
    try:
        os.close(write)
        dst_fd = os.open(dst, DIR_FLAGS)
        try:
            workspace_files.receive_tree(dst_fd, read)
        finally:
            os.close(dst_fd)
    finally:
        for fd in (read, stop_read, stop_write, src_fd):
            os.close(fd)
        status = _exit_status(pid)  # reaped also when the receiving side raised
    return status


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")
def test_a_sender_walking_as_the_owner_copies_what_only_root_could_read(folders: tuple[Path, Path]) -> None:
    """The Docker backend walks as the sandbox's user: what that user made unreadable to
    itself is copied all the same, with its mode, and the source keeps its modes."""
    src, dst = folders

    def locked(src_fd: int) -> int:
        _build_locked(src_fd, 3 << 20)
        return src_fd

    assert _copy_as_owner(src, dst, locked) == 0
    assert _modes(src) == LOCKED
    assert _modes(dst) == LOCKED
    for path in ("secret", "locked/inner/big.bin", "wx/y", "ro/x"):
        assert (dst / path).read_bytes() == (src / path).read_bytes()


def _build_links(src_fd: int, outside_fd: int) -> None:
    """As the owner: ``x/f`` (1 MiB) also linked as ``y/g``, ``top`` and ``x/deep/k``, in
    folders only root may search; ``lone`` with its second link in ``outside_fd``; a symlink
    to ``x/f``."""
    for folder in ("x", "x/deep", "y"):
        os.mkdir(folder, 0o755, dir_fd=src_fd)
    for path, data in (("x/f", os.urandom(1 << 20)), ("lone", b"lone")):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o640, dir_fd=src_fd)
        os.write(fd, data)
        os.close(fd)
    for link in ("y/g", "top", "x/deep/k"):
        os.link("x/f", link, src_dir_fd=src_fd, dst_dir_fd=src_fd)
    os.link("lone", "link", src_dir_fd=src_fd, dst_dir_fd=outside_fd)
    os.symlink("x/f", "sym", dir_fd=src_fd)
    for folder in ("x/deep", "x", "y"):
        os.chmod(folder, 0, dir_fd=src_fd)


LINKED = ("x/f", "y/g", "top", "x/deep/k")


def _check_links(src: Path, dst: Path) -> None:
    """``dst`` holds ``_build_links``' tree with its links kept: one inode for LINKED, a
    separate file for ``lone``; every folder has its mode in both trees."""
    for tree in (src, dst):
        assert {p: stat.S_IMODE(os.lstat(tree / p).st_mode) for p in ("x", "x/deep", "y")} == dict.fromkeys(("x", "x/deep", "y"), 0)
    for folder in ("x", "x/deep", "y"):
        os.chmod(dst / folder, 0o700)
        os.chmod(src / folder, 0o700)
    copies = [os.lstat(dst / p) for p in LINKED]
    assert len({(c.st_dev, c.st_ino) for c in copies}) == 1 and copies[0].st_nlink == len(LINKED)
    assert (copies[0].st_dev, copies[0].st_ino) != (os.lstat(src / "x/f").st_dev, os.lstat(src / "x/f").st_ino)
    assert (dst / "top").read_bytes() == (src / "x/f").read_bytes() and stat.S_IMODE(copies[0].st_mode) == 0o640
    assert os.lstat(dst / "lone").st_nlink == 1 and (dst / "lone").read_bytes() == b"lone"
    assert os.readlink(dst / "sym") == "x/f"
    (dst / "y" / "g").write_bytes(b"changed")
    assert (dst / "x" / "deep" / "k").read_bytes() == b"changed" and (src / "top").read_bytes() != b"changed"


def test_hard_links_stay_links_within_the_copy(folders: tuple[Path, Path], tmp_path: Path) -> None:
    """A file with several links in the tree is copied once and linked again in the copy,
    wherever its links are (folders only root may search included); a link whose other
    link is outside the tree is a file of its own. Streamed or not, the same copy."""
    src, dst = folders
    (tmp_path / "out").mkdir()
    src_fd, out_fd = os.open(src, DIR_FLAGS), os.open(tmp_path / "out", DIR_FLAGS)
    try:
        _build_links(src_fd, out_fd)
    finally:
        os.close(src_fd)
        os.close(out_fd)
    assert _streamed(src, dst)
    _check_links(src, dst)
    again = tmp_path / "again"
    again.mkdir()
    for folder in ("x", "x/deep", "y"):
        os.chmod(src / folder, 0)
    src_fd, dst_fd = os.open(src, DIR_FLAGS), os.open(again, DIR_FLAGS)
    try:
        workspace_files.copy_tree(src_fd, dst_fd)
    finally:
        os.close(src_fd)
        os.close(dst_fd)
    _check_links(src, again)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")
def test_hard_links_stay_links_copying_as_the_owner(folders: tuple[Path, Path], tmp_path: Path) -> None:
    """As the Docker backend copies (walk and build as the sandbox's user, no capability):
    links into and out of folders the owner locked itself out of are kept all the same."""
    src, dst = folders
    os.chown(dst, NOBODY, NOBODY)
    outside = tmp_path / "out"
    outside.mkdir()
    os.chown(outside, NOBODY, NOBODY)

    # Opened here: the owner may not reach tmp_path by name.
    src_fd, dst_fd, out_fd = os.open(src, DIR_FLAGS), os.open(dst, DIR_FLAGS), os.open(outside, DIR_FLAGS)

    def copy() -> int:
        _build_links(src_fd, out_fd)
        workspace_files.copy_tree(src_fd, dst_fd)
        return 0

    try:
        assert _exit_status(_as_owner(copy, src)) == 0
    finally:
        for fd in (src_fd, dst_fd, out_fd):
            os.close(fd)
    _check_links(src, dst)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")
def test_a_sender_walking_as_the_owner_copies_a_top_folder_it_locked_with_its_mode(folders: tuple[Path, Path]) -> None:
    """A sandbox that took every permission on its workspace folder from itself (chmod 0
    /workspace) still forks: the sender, holding the folder by an O_PATH descriptor as the
    Docker backend does, opens it to itself for the walk and gives its mode back, and the
    copy's top folder gets that mode too."""
    src, dst = folders

    def top_locked(src_fd: int) -> int:
        _build_locked(src_fd, 1 << 10)
        top = os.open(".", os.O_PATH | os.O_DIRECTORY, dir_fd=src_fd)
        os.fchmod(src_fd, 0)
        return top

    assert _copy_as_owner(src, dst, top_locked) == 0
    assert stat.S_IMODE(os.stat(src).st_mode) == 0 and stat.S_IMODE(os.stat(dst).st_mode) == 0
    assert _modes(src) == LOCKED and _modes(dst) == LOCKED
    assert (dst / "ro" / "x").read_bytes() == b"x"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")
def test_a_sender_stopped_half_way_gives_every_mode_back(folders: tuple[Path, Path]) -> None:
    """The receiving side gives up (its disk is full, say) while the sender is deep in
    folders it opened to itself: told to stop, the sender ends and the source has all its
    modes back, where a sender blocked on a full pipe would have held them."""
    src, _ = folders
    src_fd = os.open(src, DIR_FLAGS)
    read, write = os.pipe()
    stop_read, stop_write = os.pipe()
    ready_read, ready_write = os.pipe()

    def send() -> int:
        os.close(read)
        os.close(stop_write)
        _build_locked(src_fd, 8 << 20)
        os.write(ready_write, b"x")
        return 0 if workspace_files.send_tree(src_fd, write, stop_read) is False else 1

    pid = _as_owner(send, src)
    status: int | None = None
    try:
        os.close(write)
        os.close(ready_write)
        assert os.read(ready_read, 1) == b"x"
        received = b""
        while len(received) < 200_000:  # into locked/inner/big.bin, the pipe then full
            received += os.read(read, 65536)
        os.close(stop_write)
        stop_write = -1
        status = _exit_status(pid)
    finally:
        for fd in (read, stop_read, stop_write, ready_read, src_fd):
            if fd >= 0:
                os.close(fd)
        if status is None:  # the test failed before its wait: the sender ends with its pipes
            _exit_status(pid, within_s=5)
    assert status == 0, "the sender did not stop when told"
    assert _modes(src) == LOCKED


def _records(*records: tuple[bytes, bytes]) -> bytes:
    return b"".join(struct.pack(">cQ", kind, len(body)) + body for kind, body in records)


def _dir(name: bytes) -> tuple[bytes, bytes]:
    return b"D", struct.pack(">I", 0o755) + name


def _file(name: bytes) -> tuple[bytes, bytes]:
    return b"F", struct.pack(">I", 0o644) + name


def _linked(name: bytes) -> tuple[bytes, bytes]:
    return b"K", struct.pack(">I", 0o644) + name


END = (b"Z", b"")
UP = (b"U", b"")
TOP = (b"T", struct.pack(">I", 0o755))


def _refused(folder: Path, stream: bytes, error: type[E]) -> E:
    """What receive_tree raises (it must raise ``error``) for ``stream`` received into ``folder``."""
    read, write = os.pipe()
    os.write(write, stream)
    os.close(write)
    dst_fd = os.open(folder, DIR_FLAGS)
    try:
        with pytest.raises(error) as caught:
            workspace_files.receive_tree(dst_fd, read)
    finally:
        os.close(dst_fd)
        os.close(read)
    return caught.value


@pytest.mark.parametrize(
    ("stream", "kind"),
    [
        (_records(_file(b"../escape"), (b"E", struct.pack(">Q", 0)), END), "invalid"),
        (_records(_dir(b".."), END), "invalid"),
        (_records(_dir(b"a/b"), END), "invalid"),
        (_records(UP, _file(b"escape"), END), "invalid"),
        (_records((b"B", struct.pack(">Q", 0) + b"data"), END), "invalid"),
        (_records(_file(b"f"), _dir(b"d"), END), "invalid"),
        (_records(_dir(b"d"), END), "invalid"),
        (_records(_file(b"f"), (b"E", struct.pack(">Q", 0)), _file(b"f"), END), "invalid"),
        (_records((b"L", struct.pack(">I", 99) + b"x")), "invalid"),
        (_records((b"Q", b""), END), "invalid"),
        (struct.pack(">cQ", b"B", 1 << 40), "invalid"),
        (_records(_dir(b"d")), "truncated"),
        (_records(_file(b"f"), (b"B", struct.pack(">Q", 0) + b"da")), "truncated"),
        (_records((b"X", json.dumps(["changed", "moved"]).encode())), "changed"),
        (_records(TOP, _file(b"f"), (b"E", struct.pack(">Q", 0)), END), "invalid"),
        (_records(_dir(b"d"), TOP, UP, END), "invalid"),
        (_records((b"T", b"\x00"), END), "invalid"),
        (_records((b"H", struct.pack(">QB", 0, 1) + b"x"), END), "invalid"),
        (_records(_linked(b"f"), (b"E", struct.pack(">Q", 0)), (b"H", struct.pack(">QB", 0, 1) + b"g"), (b"H", struct.pack(">QB", 0, 0) + b"h"), END), "invalid"),
        (_records(_linked(b"f"), (b"E", struct.pack(">Q", 0)), (b"H", struct.pack(">QB", 0, 2) + b"g"), END), "invalid"),
        (_records(_linked(b"f"), (b"E", struct.pack(">Q", 0)), (b"H", struct.pack(">QB", 0, 0) + b"../g"), END), "invalid"),
        (_records(_linked(b"f"), (b"E", struct.pack(">Q", 0)), (b"H", struct.pack(">QB", 0, 0) + b"f"), END), "invalid"),
    ],
)
def test_a_receiver_takes_no_stream_that_is_not_a_copy(folders: tuple[Path, Path], stream: bytes, kind: str) -> None:
    """Whatever comes out of the source's container: nothing is made outside the
    destination, and the answer is a PathError of the right kind, never a crash."""
    _, dst = folders
    (dst / "sub").mkdir()
    caught = _refused(dst / "sub", stream, PathError)
    assert caught.kind == kind, caught
    assert sorted(os.listdir(dst)) == ["sub"]


def test_a_receiver_reports_the_sender_s_os_error_with_its_errno(folders: tuple[Path, Path]) -> None:
    _, dst = folders
    caught = _refused(dst, _records((b"X", json.dumps(["os", "Input/output error", 5, "a/b"]).encode())), OSError)
    assert (caught.errno, caught.filename) == (5, "a/b")


# ------------------------------------------------------------------ docker_stream


def _frame(stream: int, payload: bytes) -> bytes:
    return struct.pack(">BxxxI", stream, len(payload)) + payload


def test_demux_hands_on_payload_however_the_stream_is_cut() -> None:
    stream = _frame(1, b"hello ") + _frame(2, b"oops") + _frame(1, b"") + _frame(1, b"world" * 1000)
    for cut in (1, 3, 7, 8, 9, 100, len(stream)):
        demux = docker_stream.Demux()
        got: dict[int, bytes] = {1: b"", 2: b""}
        for at in range(0, len(stream), cut):
            for kind, piece in demux.feed(stream[at : at + cut]):
                got[kind] += piece
        assert got == {1: b"hello " + b"world" * 1000, 2: b"oops"}, cut


class FakeExec:
    """The Docker side of one exec's socket: ``run(sock)`` plays the process in a thread."""

    def __init__(self, run: Callable[[socket.socket], None]) -> None:
        self.ours, theirs = socket.socketpair()
        self.thread = threading.Thread(target=self._play, args=(theirs, run))
        self.thread.start()

    @staticmethod
    def _play(sock: socket.socket, run: Callable[[socket.socket], None]) -> None:
        try:
            run(sock)
        finally:
            sock.close()

    def close(self) -> None:
        self.thread.join()
        self.ours.close()


def _receive_all(reply: Callable[[bytes], bytes]) -> Callable[[socket.socket], None]:
    """A receiver that reads its whole input, then writes ``reply(input)`` on stdout."""

    def run(sock: socket.socket) -> None:
        got = b""
        while chunk := sock.recv(65536):
            got += chunk
        sock.sendall(_frame(1, reply(got)))

    return run


def test_relay_carries_the_sender_s_output_into_the_receiver() -> None:
    data = os.urandom(3 << 20)

    def send(sock: socket.socket) -> None:
        for at in range(0, len(data), 30000):
            sock.sendall(_frame(1, data[at : at + 30000]))
        sock.sendall(_frame(2, b"a warning"))
        sock.shutdown(socket.SHUT_WR)

    sender, receiver = FakeExec(send), FakeExec(_receive_all(lambda got: b"{}" if got == data else b"wrong"))
    try:
        relayed = docker_stream.relay(sender.ours, receiver.ours, deadline=float("inf"))
    finally:
        sender.close()
        receiver.close()
    assert relayed.reply == b"{}" and relayed.sender_stderr == b"a warning" and relayed.ended and not relayed.timed_out


def test_relay_stops_the_sender_when_the_receiver_gives_up() -> None:
    told: list[bool] = []

    def send(sock: socket.socket) -> None:
        # Writes until its standard input closes, as send_tree does.
        sock.setblocking(False)
        while True:
            try:
                if sock.recv(1) == b"":
                    told.append(True)
                    return
            except BlockingIOError:
                pass
            try:
                sock.send(_frame(1, b"x" * 30000))
            except BlockingIOError:
                pass

    def receive(sock: socket.socket) -> None:
        sock.recv(100_000)
        sock.sendall(_frame(1, b'{"error": ["os", "No space left on device", 28, null]}'))

    sender, receiver = FakeExec(send), FakeExec(receive)
    try:
        relayed = docker_stream.relay(sender.ours, receiver.ours, deadline=float("inf"))
    finally:
        sender.close()
        receiver.close()
    assert told == [True] and relayed.ended and b"No space" in relayed.reply


def test_relay_gives_up_at_its_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sender that never ends: both sides are told to stop at the deadline, and the
    relay returns after the grace even though they do not end (the caller kills them)."""
    monkeypatch.setattr(docker_stream, "GRACE_S", 0.2)
    release = threading.Event()
    sender = FakeExec(lambda sock: release.wait(30) and None)
    receiver = FakeExec(lambda sock: release.wait(30) and None)
    try:
        relayed = docker_stream.relay(sender.ours, receiver.ours, deadline=0.0)
    finally:
        release.set()
        sender.close()
        receiver.close()
    assert relayed.timed_out and not relayed.ended
