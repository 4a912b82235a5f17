"""Symlink-proof file access below a workspace root, one directory descriptor at a time.

Every path component is opened with ``O_NOFOLLOW`` relative to its parent's descriptor,
so a symlink planted anywhere in the path (or swapped in while we walk) is refused
instead of followed out of the workspace. ``..`` and absolute paths are refused up front.

Folder trees are walked without recursion and with a fixed number of descriptors open,
however deep they are (a sandbox can make a folder chain thousands of levels deep):
:func:`remove_tree` flattens the tree as it goes, :func:`copy_tree` climbs back up through
``..`` only after checking that it leads to the very folder it came down from. A copy can
also run as two processes, :func:`send_tree` and :func:`receive_tree`, joined by a stream.

Every operation works whatever modes the sandbox left on its workspace, the workspace
folder itself included, and leaves them as they were. As root (the process backend) modes
do not stand in the way. Without root (the Docker backend runs this module in the container
as the sandbox's user, who owns every entry of the workspace) an entry that lacks an owner
permission bit an operation needs gets it from its owner for that step, through a
descriptor of that very entry (never by name, so never through a symlink), and its mode
back right after: see :func:`_owner_may` and :func:`_open_as_owner`. The process needs no
capability for this, and the sandbox gains nothing: its owner could change those modes itself.

This module is self-contained (standard library only, no Meridian imports) because the
Docker backend runs it inside the container as well; errors are ``PathError`` with a
``kind`` that callers map to their own error types: ``invalid`` (a bad path: through a
symlink or a file, too long, a socket or device where a file should be, ...),
``not_found``, ``too_large`` (a read past the caller's total budget), ``changed`` (the
tree changed under a copy) or ``truncated`` (a copy's stream was cut off). Any other ``OSError`` (no space left, I/O error) is passed on,
from a read or write with the workspace path as its ``filename``.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import select
import stat
import struct
from collections.abc import Callable, Iterator
from typing import Any

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: A folder held to look names up in: opening it takes no permission on the folder itself.
_LOOKUP_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: Owner permission bits: to look a name up in a folder; to add or remove names there too.
_SEARCH, _CHANGE = 0o100, 0o300

#: errno values that say the path is wrong (the caller's or the sandbox's doing, never the
#: service's): a name too long, a symlink, file, socket or device where something else
#: should be, a file in use or not ours to touch.
_BAD_PATH_ERRNOS = frozenset({
    errno.ENAMETOOLONG, errno.ELOOP, errno.ENOTDIR, errno.EISDIR, errno.ENXIO, errno.ENODEV,
    errno.EINVAL, errno.EACCES, errno.EPERM, errno.ETXTBSY, errno.EEXIST, errno.ENOTEMPTY,
})


class PathError(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@contextlib.contextmanager
def _bad_paths(relative: str) -> Iterator[None]:
    """Turns an ``OSError`` that means a bad path into a PathError naming ``relative``."""
    try:
        yield
    except FileNotFoundError:
        raise PathError("not_found", f"no such file or folder in the workspace: {relative!r}") from None
    except OSError as exc:
        if exc.errno in _BAD_PATH_ERRNOS:
            raise PathError("invalid", f"bad workspace path {relative!r}: {exc.strerror or exc}") from None
        if exc.errno is None:
            raise
        # Any other error (no space left, an I/O error) is passed on naming the workspace
        # path, not the last component the failing call was given, so callers can report it.
        raise OSError(exc.errno, exc.strerror, relative) from None


def split_relative(relative: str) -> list[str]:
    """The components of a relative workspace path; PathError('invalid') for anything else."""
    if not relative or relative.startswith("/") or "\x00" in relative:
        raise PathError("invalid", f"path must be relative and non-empty: {relative!r}")
    parts = [p for p in relative.split("/") if p not in ("", ".")]
    if not parts or ".." in parts:
        raise PathError("invalid", f"path escapes the workspace: {relative!r}")
    return parts


def _grant(fd: int, need: int) -> int:
    """Gives the owner of the entry open at ``fd`` (any descriptor, ``O_PATH`` too) the
    permission bits ``need``; returns the mode to give back with :func:`_restore` (-1: none
    was changed). As root nothing is changed: root needs no permission bits. The change goes
    through /proc to the very entry ``fd`` holds, whatever took its name meanwhile."""
    if os.geteuid() == 0:
        return -1
    mode = stat.S_IMODE(os.fstat(fd).st_mode)
    if mode & need == need:
        return -1
    os.chmod(f"/proc/self/fd/{fd}", mode | need)
    return mode


def _restore(fd: int, mode: int) -> None:
    """Gives the entry open at ``fd`` its mode ``mode`` back (-1: it was never changed)."""
    if mode >= 0:
        os.chmod(f"/proc/self/fd/{fd}", mode)


@contextlib.contextmanager
def _owner_may(fd: int, need: int) -> Iterator[None]:
    """For the duration, the owner of the entry open at ``fd`` has the permission bits
    ``need`` on it (see :func:`_grant`); afterwards, also after an error, its mode is back."""
    back = _grant(fd, need)
    try:
        yield
    finally:
        _restore(fd, back)


def _open_as_owner(dir_fd: int, name: str, flags: int, need: int, mode: int = 0o600) -> int:
    """``name`` below ``dir_fd`` opened with ``flags`` (which hold ``O_NOFOLLOW``). When its
    owner lacks the bits ``need`` for that (the sandbox took them away), they are given for
    the open and taken back after it: through an ``O_PATH`` descriptor of the very entry
    (never a symlink) and /proc, so the entry that got them is the entry opened. ``mode``:
    that of a file ``O_CREAT`` makes."""
    try:
        return os.open(name, flags, mode, dir_fd=dir_fd)
    except PermissionError:
        if os.geteuid() == 0:
            raise
    path = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        if stat.S_ISLNK(os.fstat(path).st_mode):
            raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), name)
        with _owner_may(path, need):
            # The magic link reaches what the O_PATH descriptor holds: no O_NOFOLLOW (it
            # would refuse the link itself), and no O_CREAT (the entry exists).
            return os.open(f"/proc/self/fd/{path}", flags & ~(os.O_NOFOLLOW | os.O_CREAT | os.O_EXCL))
    finally:
        os.close(path)


def _walk_dirs(root_fd: int, parts: list[str] | list[bytes], relative: str, create: bool, owner: tuple[int, int] | None) -> int:
    """A descriptor of the directory ``parts`` below ``root_fd`` (created when asked), to
    look names up in: an ``O_PATH`` one, unless this call made the folder."""
    with _bad_paths(relative):
        fd = os.dup(root_fd)
        try:
            for name in parts:
                try:
                    nxt = _step_down(fd, name, relative, create, owner)
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise PathError("invalid", f"path goes through a symlink or a file: {relative!r}") from None
                    raise
                os.close(fd)
                fd = nxt
            return fd
        except BaseException:
            os.close(fd)
            raise


def _step_down(fd: int, name: str | bytes, relative: str, create: bool, owner: tuple[int, int] | None) -> int:
    """The folder ``name`` below the folder ``fd``, made (``owner``'s) when it is missing and
    ``create`` is set. Searching ``fd`` and adding to it are granted for the step alone."""
    with _owner_may(fd, _SEARCH):
        try:
            return os.open(name, _LOOKUP_FLAGS, dir_fd=fd)
        except FileNotFoundError:
            if not create:
                raise PathError("not_found", f"no such folder in the workspace: {relative!r}") from None
    with _owner_may(fd, _CHANGE):
        os.mkdir(name, 0o755, dir_fd=fd)
        nxt = os.open(name, _DIR_FLAGS, dir_fd=fd)
    try:
        if owner is not None:
            os.fchown(nxt, *owner)
    except BaseException:
        os.close(nxt)
        raise
    return nxt


def check_folder(root_fd: int, relative: str) -> None:
    """Nothing when ``relative`` is a folder below ``root_fd`` reached without a symlink;
    PathError otherwise (``not_found``: a folder on the way is missing; ``invalid``: the
    path is or goes through a symlink or a file). The rule for an exec's working folder,
    on every backend."""
    parts = split_relative(relative)
    os.close(_walk_dirs(root_fd, parts, relative, create=False, owner=None))


def write_file(root_fd: int, relative: str, content: bytes, mode: int = 0o644, owner: tuple[int, int] | None = None) -> None:
    """Writes ``content`` at ``relative``, replacing a symlink there rather than following it."""
    parts = split_relative(relative)
    parent = _walk_dirs(root_fd, parts[:-1], relative, create=True, owner=owner)
    try:
        with _bad_paths(relative), _owner_may(parent, _CHANGE):
            _write_in(parent, parts[-1], relative, content, mode, owner)
    finally:
        os.close(parent)


def _write_in(parent: int, name: str, relative: str, content: bytes, mode: int, owner: tuple[int, int] | None) -> None:
    try:
        st = os.stat(name, dir_fd=parent, follow_symlinks=False)
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISREG(st.st_mode) and not stat.S_ISDIR(st.st_mode):
            os.unlink(name, dir_fd=parent)
        elif stat.S_ISDIR(st.st_mode):
            raise PathError("invalid", f"path is a folder: {relative!r}")
    except FileNotFoundError:
        pass
    # O_NONBLOCK: a FIFO swapped in after the check above fails the open (no reader)
    # instead of blocking; anything but a regular file is refused before writing.
    try:
        fd = _open_as_owner(parent, name, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o200, mode & 0o777)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
            raise PathError("invalid", f"not a regular file: {relative!r}") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise PathError("invalid", f"not a regular file: {relative!r}")
    os.ftruncate(fd, 0)
    with os.fdopen(fd, "wb") as fh:
        if owner is not None:
            os.fchown(fh.fileno(), *owner)
        os.fchmod(fh.fileno(), mode & 0o777)
        fh.write(content)


#: The most one ReadFiles may answer in all (contents and paths): well below the service's
#: 64 MiB gRPC message limit, so an answer is never too big to send, and a request naming
#: thousands of files cannot make the service hold gigabytes.
MAX_READ_TOTAL_BYTES = 48 << 20


def read_files(root_fd: int, paths: list[str], max_bytes: int, total: int) -> dict[str, bytes]:
    """The regular files at ``paths`` (each read once however often it is named), each at
    most ``max_bytes``; PathError('invalid') naming the path where the answer would pass
    ``total`` bytes of contents and paths (the callers pass MAX_READ_TOTAL_BYTES, read when
    called), before anything past it is read."""

    def too_much(rel: str) -> PathError:
        return PathError("invalid", f"ReadFiles would answer more than {total} bytes in all (at {rel!r}); ask for fewer files at once")

    out: dict[str, bytes] = {}
    used = 0
    for rel in dict.fromkeys(paths):
        used += len(rel.encode())
        if used > total:
            raise too_much(rel)
        try:
            out[rel] = read_file(root_fd, rel, max_bytes, total_left=total - used)
        except PathError as exc:
            if exc.kind == "too_large":
                raise too_much(rel) from None
            raise
        used += len(out[rel])
    return out


def read_file(root_fd: int, relative: str, max_bytes: int, total_left: int | None = None) -> bytes:
    """The regular file at ``relative`` (never a symlink, FIFO or device), at most ``max_bytes``.

    ``total_left``, when given, is what is left of the caller's budget for all its reads: a
    file larger than that is PathError('too_large'), and nothing past it is read."""
    parts = split_relative(relative)
    parent = _walk_dirs(root_fd, parts[:-1], relative, create=False, owner=None)
    try:
        with _bad_paths(relative):
            try:
                # O_NONBLOCK: a FIFO planted under the name must not hang the service.
                with _owner_may(parent, _SEARCH):
                    fd = _open_as_owner(parent, parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o400)
            except FileNotFoundError:
                raise PathError("not_found", f"no file {relative!r} in the workspace") from None
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise PathError("invalid", f"path is or goes through a symlink: {relative!r}") from None
                if exc.errno in (errno.ENXIO, errno.ENODEV):
                    raise PathError("invalid", f"not a regular file: {relative!r}") from None
                raise
            with os.fdopen(fd, "rb") as fh:
                st = os.fstat(fh.fileno())
                if not stat.S_ISREG(st.st_mode):
                    raise PathError("invalid", f"not a regular file: {relative!r}")
                if st.st_size > max_bytes:
                    raise PathError("invalid", f"file {relative!r} is larger than {max_bytes} bytes")
                over_budget = PathError("too_large", f"file {relative!r} ({st.st_size} bytes) takes the read past its total budget")
                if total_left is not None and st.st_size > total_left:
                    raise over_budget
                limit = max_bytes if total_left is None else min(max_bytes, total_left)
                data = fh.read(limit + 1)
                if len(data) > limit and limit < max_bytes:
                    raise over_budget  # it grew since the fstat
                return data[:limit]
    finally:
        os.close(parent)


def remove_tree(root_fd: int, relative: str) -> None:
    """Removes ``relative`` (file, symlink or folder tree of any depth) without following any
    symlink. Nothing to remove (no such path, or one through a symlink or a file, or a name
    no file system takes) is no error."""
    parts = split_relative(relative)
    try:
        parent = _walk_dirs(root_fd, parts[:-1], relative, create=False, owner=None)
    except PathError:
        return
    try:
        with _bad_paths(relative), _owner_may(parent, _CHANGE):
            try:
                st = os.stat(parts[-1], dir_fd=parent, follow_symlinks=False)
            except OSError as exc:
                if exc.errno in (errno.ENOENT, errno.ENAMETOOLONG):
                    return
                raise
            _remove_entry(parent, parts[-1], st)
    finally:
        os.close(parent)


def _remove_entry(parent: int, name: str, st: os.stat_result) -> None:
    """Removes ``name`` below ``parent``. A folder is flattened, never recursed into: each of
    its sub-folders has its own sub-folders moved up into the top folder (under fresh names)
    before it is emptied and removed, so at most two folder descriptors are open however
    deep the tree, and nothing is opened through a symlink or a ``..``. Entries that are
    already gone are no error."""
    if not stat.S_ISDIR(st.st_mode):
        _unlink(parent, name)
        return
    try:
        top = _open_to_owner(parent, name)
    except FileNotFoundError:
        return
    try:
        fresh = 0
        while entries := os.listdir(top):
            for entry in entries:
                if not _is_dir(top, entry):
                    _unlink(top, entry)
                    continue
                try:
                    sub = _open_to_owner(top, entry)
                except FileNotFoundError:
                    continue
                try:
                    for child in os.listdir(sub):
                        if _is_dir(sub, child):
                            fresh = _move_up(sub, child, top, fresh)
                        else:
                            _unlink(sub, child)
                finally:
                    os.close(sub)
                _rmdir(top, entry)
    finally:
        os.close(top)
    _rmdir(parent, name)


def _open_to_owner(dir_fd: int, name: str) -> int:
    """A descriptor of folder ``name``, which its owner may now read, search and change.

    Without root (the Docker backend works as the sandbox's user) a folder the sandbox made
    read-only or unreadable could not be emptied otherwise; its owner can give itself the
    permission back (never given back: the folder is being removed). As root this changes
    nothing."""
    path = os.open(name, _LOOKUP_FLAGS, dir_fd=dir_fd)
    try:
        _grant(path, 0o700)
        # '.' of the O_PATH descriptor: the very folder that was granted, whatever its name is now.
        return os.open(".", _DIR_FLAGS, dir_fd=path)
    finally:
        os.close(path)


def _is_dir(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISDIR(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except FileNotFoundError:
        return False


def _unlink(dir_fd: int, name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=dir_fd)


def _rmdir(dir_fd: int, name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.rmdir(name, dir_fd=dir_fd)


def _move_up(src_dir: int, name: str, dst_dir: int, fresh: int) -> int:
    """Moves folder ``name`` from ``src_dir`` into ``dst_dir`` under a name not taken there."""
    while True:
        fresh += 1
        new = f".removing-{fresh}"
        try:
            os.stat(new, dir_fd=dst_dir, follow_symlinks=False)
        except FileNotFoundError:
            try:
                os.rename(name, new, src_dir_fd=src_dir, dst_dir_fd=dst_dir)
            except FileNotFoundError:
                pass  # gone already: nothing to move
            except PermissionError:
                # Moving a folder takes write permission on it (its '..' changes).
                os.close(_open_to_owner(src_dir, name))
                os.rename(name, new, src_dir_fd=src_dir, dst_dir_fd=dst_dir)
            return fresh


def _identity(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def _parent_of(fd: int, expected: tuple[int, int]) -> int:
    """A descriptor of the folder above ``fd``, which must be the one (``expected``) the walk
    came down from: a folder moved meanwhile would lead the walk anywhere, so it stops it."""
    parent = os.open("..", _DIR_FLAGS, dir_fd=fd)
    if _identity(parent) != expected:
        os.close(parent)
        raise PathError("changed", "a folder was moved while the workspace was being copied")
    return parent


# ------------------------------------------------------------------ copying a tree
#
# A copy is a walk of the source (walk_tree) into a stream of entries that a TreeBuilder
# makes again below the destination. copy_tree joins the two in one process; the Docker
# backend walks in the source's container and builds in the destination's, the entries
# streamed between them (send_tree, receive_tree), so both backends copy the same way.
# The entries, in the order a depth-first walk meets them (names and targets are bytes):
#
#   ("dir", name, mode)      a folder; the entries below it follow, then ("up",)
#   ("up",)                  the end of the folder entered last
#   ("link", name, target)   a symlink, copied as a link (never followed)
#   ("file", name, mode, linked)
#                            a regular file; its data follows, then ("end", size). linked:
#                            it has other links, which the walk may meet: the builder keeps
#                            where it made the file, as linked file number 0, 1, 2, ...
#   ("hardlink", name, number, last)
#                            another link to linked file ``number`` of this copy, made as a
#                            link to that copy; last: the walk will name it no more
#   ("data", offset, bytes)  some of the file's data; holes are not sent, so the copy of a
#                            sparse file is as sparse (and fits wherever the source did)
#   ("end", size)            the end of the file and its size
#   ("top", mode)            the mode of the copied folder itself: the last entry
#
# FIFOs, sockets and devices are not copied. Hard links stay links within the copy (keyed
# by the source's st_dev and st_ino), so a file linked hundreds of times takes its room
# once, as in the source; a link whose other links are outside the tree is a file of its own.

#: The most file data one entry carries: what a copy holds in memory at a time.
CHUNK_BYTES = 1 << 20

Entry = tuple[Any, ...]


def copy_tree(src_fd: int, dst_fd: int, owner: tuple[int, int] | None = None, check: Callable[[], None] | None = None) -> None:
    """Copies folders, regular files (data, holes and permission bits; hard links as links
    within the copy) and symlinks (as links) from ``src_fd`` into the empty folder
    ``dst_fd``, ``owner``'s when given.

    Iterative, with one folder descriptor open on each side however deep the tree (see
    :func:`walk_tree`); PathError('changed') when a folder is moved during the copy.
    ``check`` is called before each entry (at most a CHUNK_BYTES piece of a file): what
    it raises stops the copy, whose walk then gives back the modes it changed."""
    builder = TreeBuilder(dst_fd, owner)
    try:
        with contextlib.closing(walk_tree(src_fd)) as entries:
            for entry in entries:
                if check is not None:
                    check()
                builder.add(entry)
        builder.finish()
    finally:
        builder.close()


def walk_tree(src_fd: int) -> Iterator[Entry]:
    """The entries of the tree below ``src_fd`` (see above).

    Iterative, with one folder descriptor open however deep the tree: the walk goes down
    by name (``O_NOFOLLOW``) and back up through ``..``, which must lead to the folder it
    came down from (PathError('changed') otherwise). An entry that goes away while it is
    walked is left out.

    Not as root (the Docker backend walks as the sandbox's user), a folder or file its
    owner may not read (or search), ``src_fd``'s folder included (``src_fd`` may be an
    ``O_PATH`` descriptor), is opened to the owner for the walk and given its mode back
    once the walk is done with it, also when the walk stops early."""
    top_mode = stat.S_IMODE(os.fstat(src_fd).st_mode) & 0o777
    top_back = _grant(src_fd, 0o500)
    try:
        src = os.open(".", _DIR_FLAGS, dir_fd=src_fd)
    except BaseException:
        _restore(src_fd, top_back)
        raise
    # One frame a level: the names left to walk there, the folder's identity, and the mode
    # to give the folder back when the walk leaves it (-1: it was not changed).
    stack: list[tuple[Iterator[str], tuple[int, int], int]] = []
    links = _Links()
    try:
        stack.append((iter(os.listdir(src)), _identity(src), -1))
        while stack:
            name = next(stack[-1][0], None)
            if name is None:
                back = stack.pop()[2]
                if stack:
                    src = _leave(src, stack[-1][1], back)
                    yield ("up",)
                continue
            try:
                st = os.stat(name, dir_fd=src, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISDIR(st.st_mode):
                down = _enter(src, name, st)
                if down is None:
                    continue
                os.close(src)
                src, frame = down
                stack.append(frame)
                yield ("dir", os.fsencode(name), st.st_mode & 0o777)
            elif stat.S_ISLNK(st.st_mode):
                try:
                    target = os.readlink(name, dir_fd=src)
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    raise _changed(name, exc) from None
                yield ("link", os.fsencode(name), os.fsencode(target))
            elif stat.S_ISREG(st.st_mode):
                again = links.again(st)
                if again is not None:
                    yield ("hardlink", os.fsencode(name), *again)
                else:
                    yield from _file_entries(src, name, st, links)
            # FIFOs, sockets and devices are not copied.
        yield ("top", top_mode)
    finally:
        try:
            _unwind(src, stack)
        finally:
            _restore(src_fd, top_back)


def _enter(src: int, name: str, st: os.stat_result) -> tuple[int, tuple[Iterator[str], tuple[int, int], int]] | None:
    """A descriptor of folder ``name`` below ``src`` and its walk frame (None: it is gone)."""
    opened = _open_to_walk(src, name, _DIR_FLAGS, 0o500, stat.S_IFDIR, st)
    if opened is None:
        return None
    fd, back = opened
    try:
        return fd, (iter(os.listdir(fd)), _identity(fd), back)
    except BaseException:
        _give_back(fd, back)
        os.close(fd)
        raise


class _Links:
    """The files with other links that a walk copied and has not yet met all the links of:
    by (st_dev, st_ino), the number the builder knows the copy by and the links left to meet."""

    def __init__(self) -> None:
        self.pending: dict[tuple[int, int], list[int]] = {}
        self.count = 0

    def first(self, st: os.stat_result) -> bool:
        """Whether the file ``st`` (fstat of the descriptor copied) has other links: it is then
        linked file number ``count`` of the copy."""
        if st.st_nlink < 2:
            return False
        self.pending[(st.st_dev, st.st_ino)] = [self.count, st.st_nlink - 1]
        self.count += 1
        return True

    def again(self, st: os.stat_result) -> tuple[int, bool] | None:
        """(number, last) when ``st`` is a link to a file the walk copied already, else None."""
        key = (st.st_dev, st.st_ino)
        known = self.pending.get(key) if st.st_nlink > 1 else None
        if known is None:
            return None
        known[1] -= 1
        if known[1] <= 0:
            del self.pending[key]
        return known[0], known[1] <= 0


def _file_entries(src: int, name: str, st: os.stat_result, links: _Links) -> Iterator[Entry]:
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    opened = _open_to_walk(src, name, flags, 0o400, stat.S_IFREG, st)
    if opened is None:
        return
    fd, back = opened
    try:
        _give_back(fd, back)  # the descriptor is all the walk needs
        now = os.fstat(fd)
        if not stat.S_ISREG(now.st_mode):
            return  # swapped for something else since the stat: not copied, like any special file
        yield ("file", os.fsencode(name), st.st_mode & 0o777, links.first(now))
        for offset, data in _extents(fd):
            yield ("data", offset, data)
        yield ("end", os.fstat(fd).st_size)
    finally:
        os.close(fd)


def _extents(fd: int) -> Iterator[tuple[int, bytes]]:
    """(offset, bytes) of the file's data, CHUNK_BYTES at most each, skipping its holes."""
    pos = 0
    while True:
        end: int | None
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
            end = os.lseek(fd, start, os.SEEK_HOLE)
        except OSError as exc:
            if exc.errno == errno.ENXIO:
                return  # no data at or past pos
            if exc.errno != errno.EINVAL:
                raise
            start, end = pos, None  # a file system without SEEK_DATA: read it all
        while end is None or start < end:
            data = os.pread(fd, CHUNK_BYTES if end is None else min(CHUNK_BYTES, end - start), start)
            if not data:
                return  # shorter than it was a moment ago
            yield start, data
            start += len(data)
        pos = end


def _open_to_walk(dir_fd: int, name: str, flags: int, need: int, kind: int, st: os.stat_result) -> tuple[int, int] | None:
    """``name`` below ``dir_fd`` opened with ``flags``, and the mode to give it back later
    (-1: none); None when it is gone. Not as root, an entry whose owner lacks the ``need``
    permission bits gets them first: through an ``O_PATH`` descriptor, so the very entry
    that was checked (a ``kind`` one, never a symlink) is changed and then opened."""
    if os.geteuid() == 0 or stat.S_IMODE(st.st_mode) & need == need:
        try:
            return os.open(name, flags, dir_fd=dir_fd), -1
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise _changed(name, exc) from None
    try:
        path = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    try:
        mode = os.fstat(path).st_mode
        if stat.S_IFMT(mode) != kind:
            raise PathError("changed", f"{name!r} changed while the workspace was being copied")
        back = stat.S_IMODE(mode)
        proc = f"/proc/self/fd/{path}"
        os.chmod(proc, back | need)
        try:
            # Through /proc the open reaches the entry the O_PATH descriptor holds (a magic
            # link, so without O_NOFOLLOW), whatever took its name meanwhile.
            return os.open(proc, flags & ~os.O_NOFOLLOW), back
        except BaseException:
            os.chmod(proc, back)
            raise
    finally:
        os.close(path)


def _give_back(fd: int, mode: int) -> None:
    """Gives the entry open at ``fd`` its mode ``mode`` back (-1: it was never changed)."""
    if mode >= 0:
        os.fchmod(fd, mode)


def _leave(fd: int, parent: tuple[int, int], back: int) -> int:
    """Climbs from folder ``fd`` to its parent, which must be ``parent``, and closes ``fd``,
    giving it its mode ``back`` once '..' is open (opening it took the search permission)."""
    try:
        up = _parent_of(fd, parent)
    except BaseException:
        _give_back(fd, back)
        raise
    try:
        _give_back(fd, back)
    except BaseException:
        os.close(up)
        raise
    os.close(fd)
    return up


def _unwind(fd: int, stack: list[tuple[Iterator[str], tuple[int, int], int]]) -> None:
    """Ends a walk at folder ``fd``, ``stack`` deep: a walk that stopped early (an error, a
    reader that stopped) gives the folders it opened to itself their modes back, as far up
    as '..' still leads where the walk came down from; then ``fd`` is closed."""
    try:
        while len(stack) > 1:
            back = stack.pop()[2]
            fd = _leave(fd, stack[-1][1], back)
    except (OSError, PathError):
        pass  # moved or gone meanwhile: what is above can no longer be reached
    finally:
        os.close(fd)


def _changed(name: str, exc: OSError) -> OSError | PathError:
    """What an entry that went from one kind to another since its stat (a folder or file
    swapped for a symlink, say) is: PathError('changed'); any other OSError as it is."""
    if exc.errno not in (errno.ELOOP, errno.ENOTDIR, errno.EISDIR, errno.ENXIO, errno.ENODEV, errno.EINVAL):
        return exc
    return PathError("changed", f"{name!r} changed while the workspace was being copied: {exc.strerror or exc}")


class TreeBuilder:
    """Makes the entries of a walk (see above) below an empty folder, ``owner``'s when given.

    Its entries are checked as the hostile input they may be (in the Docker backend they
    come out of the source sandbox's container): a name must be one component, ``up``
    never climbs above the top, data only goes into a file, ``top`` comes last and at the
    top, a hard link names a linked file this builder made; PathError('invalid')
    otherwise. A folder gets its mode once it is filled, so a read-only one can be; the top
    folder (``dst_fd``, possibly an ``O_PATH`` descriptor) gets the mode of a ``top`` entry
    when the builder finishes.

    A hard link is made to the very file the builder made (its st_dev and st_ino checked),
    found from the top of the copy one ``O_NOFOLLOW`` component at a time, never through
    ``..``: it never links to anything outside the copy."""

    def __init__(self, dst_fd: int, owner: tuple[int, int] | None = None) -> None:
        self.owner = owner
        self.dst = os.dup(dst_fd)
        self.top = os.dup(dst_fd)
        self.file = -1
        # One frame a level: the folder's identity and the mode it gets when it is left.
        self.frames: list[tuple[tuple[int, int], int]] = [(_identity(self.dst), -1)]
        self.top_mode = -1  # the top's mode from a "top" entry; -1: none came yet
        # Where the builder is: (the folder above's place, this folder's name); None: the top.
        self.place: tuple[Any, bytes] | None = None
        # The linked files made (see the entries above) whose links may still come, by
        # number: the place of their folder, their name and their identity.
        self.linked: dict[int, tuple[tuple[Any, bytes] | None, bytes, tuple[int, int]]] = {}
        self.linked_count = 0

    def add(self, entry: Entry) -> None:
        """Makes one entry."""
        kind, args = entry[0], entry[1:]
        if self.top_mode >= 0:
            raise _bad_stream(f"{kind!r} entry after the top's mode")
        if (self.file >= 0) != (kind in ("data", "end")):
            raise _bad_stream(f"{kind!r} entry {'inside' if self.file >= 0 else 'outside'} a file")
        make = {
            "dir": self._dir, "up": self._up, "link": self._link, "file": self._file, "data": self._data, "end": self._end,
            "top": self._top, "hardlink": self._hardlink,
        }.get(kind)
        if make is None:
            raise _bad_stream(f"unknown entry {kind!r}")
        try:
            make(*args)
        except FileExistsError:
            raise _bad_stream(f"{args[0]!r} comes twice") from None

    def finish(self) -> None:
        """Checks that the entries ended where they began (every folder and file closed) and
        gives the top folder its mode, last: the copy was made in it whatever that mode is."""
        if self.file >= 0 or len(self.frames) != 1:
            raise _bad_stream("the entries end inside a folder or file")
        if self.top_mode >= 0:
            os.chmod(f"/proc/self/fd/{self.dst}", self.top_mode)

    def close(self) -> None:
        """Closes the descriptors the builder holds."""
        if self.file >= 0:
            os.close(self.file)
            self.file = -1
        for name in ("dst", "top"):
            fd = getattr(self, name)
            if fd >= 0:
                os.close(fd)
                setattr(self, name, -1)

    def _dir(self, name: bytes, mode: int) -> None:
        os.mkdir(_one_name(name), 0o700, dir_fd=self.dst)
        fd = os.open(name, _DIR_FLAGS, dir_fd=self.dst)
        try:
            if self.owner is not None:
                os.fchown(fd, *self.owner)
            self.frames.append((_identity(fd), mode & 0o777))
        except BaseException:
            os.close(fd)
            raise
        os.close(self.dst)
        self.dst = fd
        self.place = (self.place, name)

    def _up(self) -> None:
        if len(self.frames) < 2 or self.place is None:
            raise _bad_stream("'up' above the top of the copy")
        self.dst = _leave(self.dst, self.frames[-2][0], self.frames[-1][1])
        self.frames.pop()
        self.place = self.place[0]

    def _top(self, mode: int) -> None:
        if len(self.frames) != 1:
            raise _bad_stream("the top's mode inside a folder")
        self.top_mode = mode & 0o777

    def _link(self, name: bytes, target: bytes) -> None:
        os.symlink(target, _one_name(name), dir_fd=self.dst)
        if self.owner is not None:
            os.chown(name, *self.owner, dir_fd=self.dst, follow_symlinks=False)

    def _file(self, name: bytes, mode: int, linked: bool = False) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(_one_name(name), flags, 0o600, dir_fd=self.dst)
        try:
            if self.owner is not None:
                os.fchown(fd, *self.owner)
            os.fchmod(fd, mode & 0o777)
            if linked:
                self.linked[self.linked_count] = (self.place, name, _identity(fd))
                self.linked_count += 1
        except BaseException:
            os.close(fd)
            raise
        self.file = fd

    def _hardlink(self, name: bytes, number: int, last: bool) -> None:
        made = self.linked.pop(number, None) if last else self.linked.get(number)
        if made is None:
            raise _bad_stream(f"a link to linked file {number}, which is none of this copy's")
        place, first, identity = made
        changed = PathError("changed", f"linked file {first!r} changed in the copy while the workspace was being copied")
        folder = self._folder_at(place)
        try:
            with _owner_may(folder, _SEARCH):
                path = os.open(first, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=folder)
        except FileNotFoundError:
            raise changed from None
        finally:
            if folder != self.dst:
                os.close(folder)
        try:
            if _identity(path) != identity:
                raise changed
            # Through /proc the link is made to the entry the O_PATH descriptor holds.
            os.link(f"/proc/self/fd/{path}", _one_name(name), dst_dir_fd=self.dst, follow_symlinks=True)
        finally:
            os.close(path)

    def _folder_at(self, place: tuple[Any, bytes] | None) -> int:
        """A descriptor of the copy's folder at ``place``: the folder being built, or one found
        from the top (``O_PATH``, to be closed by the caller)."""
        if place is self.place:
            return self.dst
        parts: list[bytes] = []
        while place is not None:
            place, part = place
            parts.append(part)
        parts.reverse()
        return _walk_dirs(self.top, parts, os.fsdecode(b"/".join(parts)), create=False, owner=None)

    def _data(self, offset: int, data: bytes) -> None:
        view = memoryview(data)
        while view:
            written = os.pwrite(self.file, view, offset)
            view, offset = view[written:], offset + written

    def _end(self, size: int) -> None:
        fd, self.file = self.file, -1
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)


def _one_name(name: bytes) -> bytes:
    """``name`` if it names an entry of the folder itself (one component), else PathError."""
    if not name or b"/" in name or b"\0" in name or name in (b".", b".."):
        raise _bad_stream(f"bad name {name!r}")
    return name


def _bad_stream(what: str) -> PathError:
    return PathError("invalid", f"not a copy of a workspace: {what}")


# ------------------------------------------------------------------ a copy as a byte stream
#
# send_tree writes a walk as records (a kind byte, a big-endian 8-byte length, the payload)
# and receive_tree builds from them: the Docker backend runs one in each container and
# relays the bytes between them. The stream ends with an end mark, or an error record
# (what stopped the walk); a stream without either was cut off.

_HEADER = struct.Struct(">cQ")
_U32, _U64 = struct.Struct(">I"), struct.Struct(">Q")
#: The longest payload a receiver accepts: a chunk of data and its offset; a link's name and target are shorter.
_MAX_PAYLOAD = CHUNK_BYTES + _U64.size


class _Stopped(Exception):
    """The reading side of a send_tree went away, or asked it to stop."""


def send_tree(src_fd: int, out_fd: int, stop_fd: int) -> bool:
    """Streams :func:`walk_tree` of ``src_fd`` into ``out_fd`` for receive_tree: its entries,
    then an end mark, or an error record where the walk failed. True once all is sent;
    False when it stopped because ``stop_fd`` became readable (the relay closed it: the
    receiving side gave up) or ``out_fd`` was closed. Stopping ends the walk as an error
    does, giving back the modes it changed, where a blocked write would hold them."""
    os.set_blocking(out_fd, False)
    try:
        try:
            with contextlib.closing(walk_tree(src_fd)) as entries:
                for entry in entries:
                    _send(out_fd, stop_fd, _record(entry))
            last = _HEADER.pack(b"Z", 0)
        except (PathError, OSError) as exc:
            body = json.dumps(describe_error(exc)).encode()
            last = _HEADER.pack(b"X", len(body)) + body
        _send(out_fd, stop_fd, last)
    except _Stopped:
        return False
    return True


def receive_tree(dst_fd: int, in_fd: int, owner: tuple[int, int] | None = None) -> None:
    """Makes below the empty folder ``dst_fd`` the tree that send_tree streams into
    ``in_fd``. Raises what the sender reported (see :func:`error_from`), PathError
    ('truncated') for a stream that ends before its end mark and PathError('invalid') for
    one that is not a copy of a workspace."""
    builder = TreeBuilder(dst_fd, owner)
    try:
        for entry in _entries(in_fd):
            builder.add(entry)
        builder.finish()
    finally:
        builder.close()


def describe_error(exc: PathError | OSError) -> list[Any]:
    """A PathError or OSError as JSON-able data for :func:`error_from` on the other side of
    a process boundary: [kind, message, errno, file name]."""
    if isinstance(exc, PathError):
        return [exc.kind, str(exc), None, None]
    filename = exc.filename if isinstance(exc.filename, str) else None
    return ["os", exc.strerror or str(exc), exc.errno, filename]


def error_from(described: list[Any]) -> PathError | OSError:
    """The error :func:`describe_error` described (an OSError with its errno and file name)."""
    kind, message, code, filename = (list(described) + [None, None])[:4]
    if kind != "os":
        return PathError(str(kind), str(message))
    return OSError(code, message, filename) if isinstance(code, int) else OSError(message)


def _record(entry: Entry) -> bytes:
    kind = entry[0]
    if kind == "dir":
        body = _U32.pack(entry[2]) + entry[1]
    elif kind == "up":
        body = b""
    elif kind == "link":
        body = _U32.pack(len(entry[1])) + entry[1] + entry[2]
    elif kind == "file":
        body = _U32.pack(entry[2]) + entry[1]
        if len(entry) > 3 and entry[3]:
            return _HEADER.pack(b"K", len(body)) + body
    elif kind == "hardlink":
        body = _U64.pack(entry[2]) + (b"\x01" if entry[3] else b"\x00") + entry[1]
    elif kind == "data":
        body = _U64.pack(entry[1]) + entry[2]
    elif kind == "top":
        body = _U32.pack(entry[1])
    else:
        body = _U64.pack(entry[1])
    kinds = {"dir": b"D", "up": b"U", "link": b"L", "file": b"F", "hardlink": b"H", "data": b"B", "end": b"E", "top": b"T"}
    return _HEADER.pack(kinds[kind], len(body)) + body


def _send(out_fd: int, stop_fd: int, data: bytes) -> None:
    """Writes all of ``data`` to the non-blocking ``out_fd``; _Stopped when ``stop_fd`` turns
    readable (or at its end) first, or when nobody reads ``out_fd`` any more."""
    view = memoryview(data)
    while view:
        readable, writable, _ = select.select([stop_fd], [out_fd], [])
        if readable:
            raise _Stopped()
        try:
            view = view[os.write(out_fd, view):]
        except BlockingIOError:
            continue
        except BrokenPipeError:
            raise _Stopped() from None


def _entries(in_fd: int) -> Iterator[Entry]:
    """The entries of a send_tree stream read from ``in_fd``, checked for shape."""
    while True:
        kind, body = _read_record(in_fd)
        if kind == b"Z":
            return
        if kind == b"X":
            try:
                described = json.loads(body)
            except ValueError:
                raise _bad_stream("an unreadable error record") from None
            raise error_from(described if isinstance(described, list) else [])
        yield _entry(kind, body)


def _entry(kind: bytes, body: bytes) -> Entry:
    fixed = {
        b"D": _U32.size, b"L": _U32.size, b"F": _U32.size, b"K": _U32.size, b"H": _U64.size + 1, b"B": _U64.size,
        b"E": _U64.size, b"U": 0, b"T": _U32.size,
    }.get(kind)
    if fixed is None or len(body) < fixed or kind in (b"E", b"U", b"T") and len(body) != fixed:
        raise _bad_stream(f"a record of kind {kind!r} and {len(body)} bytes")
    head, rest = body[:fixed], body[fixed:]
    if kind == b"D":
        return ("dir", rest, _U32.unpack(head)[0])
    if kind in (b"F", b"K"):
        return ("file", rest, _U32.unpack(head)[0], kind == b"K")
    if kind == b"H":
        if head[-1] not in (0, 1):
            raise _bad_stream("a hard link record with a bad flag")
        return ("hardlink", rest, _U64.unpack(head[:-1])[0], head[-1] == 1)
    if kind == b"L":
        size = _U32.unpack(head)[0]
        if size > len(rest):
            raise _bad_stream("a link record shorter than its name")
        return ("link", rest[:size], rest[size:])
    if kind == b"B":
        return ("data", _U64.unpack(head)[0], rest)
    if kind == b"E":
        return ("end", _U64.unpack(head)[0])
    if kind == b"T":
        return ("top", _U32.unpack(head)[0])
    return ("up",)


def _read_record(in_fd: int) -> tuple[bytes, bytes]:
    header = _read_exactly(in_fd, _HEADER.size)
    kind, size = _HEADER.unpack(header)
    if size > _MAX_PAYLOAD:
        raise _bad_stream(f"a record of {size} bytes")
    return kind, _read_exactly(in_fd, size)


def _read_exactly(in_fd: int, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = os.read(in_fd, size - len(data))
        if not chunk:
            raise PathError("truncated", "the copy of the workspace was cut off before its end")
        data += chunk
    return bytes(data)
