"""Symlink-proof file access below a workspace root, one directory descriptor at a time.

Every path component is opened with ``O_NOFOLLOW`` relative to its parent's descriptor,
so a symlink planted anywhere in the path (or swapped in while we walk) is refused
instead of followed out of the workspace. ``..`` and absolute paths are refused up front.

Folder trees are walked without recursion and with a fixed number of descriptors open,
however deep they are (a sandbox can make a folder chain thousands of levels deep):
:func:`remove_tree` flattens the tree as it goes, :func:`copy_tree` climbs back up through
``..`` only after checking that it leads to the very folder it came down from.

This module is self-contained (standard library only, no Meridian imports) because the
Docker backend runs it inside the container as well; errors are ``PathError`` with a
``kind`` that callers map to their own error types: ``invalid`` (a bad path: through a
symlink or a file, too long, a socket or device where a file should be, ...),
``not_found``, ``too_large`` (a read past the caller's total budget) or ``changed`` (the
tree changed under a copy). Any other ``OSError`` (no space left, I/O error) is passed on,
from a read or write with the workspace path as its ``filename``.
"""
from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

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


def _walk_dirs(root_fd: int, parts: list[str], relative: str, create: bool, owner: tuple[int, int] | None) -> int:
    """A descriptor of the directory ``parts`` below ``root_fd`` (created when asked)."""
    with _bad_paths(relative):
        fd = os.dup(root_fd)
        try:
            for name in parts:
                try:
                    nxt = os.open(name, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise PathError("not_found", f"no such folder in the workspace: {relative!r}") from None
                    os.mkdir(name, 0o755, dir_fd=fd)
                    nxt = os.open(name, _DIR_FLAGS, dir_fd=fd)
                    if owner is not None:
                        os.fchown(nxt, *owner)
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


def write_file(root_fd: int, relative: str, content: bytes, mode: int = 0o644, owner: tuple[int, int] | None = None) -> None:
    """Writes ``content`` at ``relative``, replacing a symlink there rather than following it."""
    parts = split_relative(relative)
    parent = _walk_dirs(root_fd, parts[:-1], relative, create=True, owner=owner)
    try:
        with _bad_paths(relative):
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
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode & 0o777, dir_fd=parent)
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
                fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=parent)
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
        with _bad_paths(relative):
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
    permission back. As root this changes nothing."""
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except PermissionError:
        # Unreadable: an O_PATH descriptor (never through a symlink) and /proc set its mode.
        path = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            os.chmod(f"/proc/self/fd/{path}", stat.S_IMODE(os.fstat(path).st_mode) | 0o700)
        finally:
            os.close(path)
        fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    try:
        mode = stat.S_IMODE(os.fstat(fd).st_mode)
        if mode & 0o700 != 0o700 and os.geteuid() != 0:
            os.fchmod(fd, mode | 0o700)
    except BaseException:
        os.close(fd)
        raise
    return fd


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


def copy_tree(src_fd: int, dst_fd: int, owner: tuple[int, int] | None = None) -> None:
    """Copies folders, regular files and symlinks (as links) from ``src_fd`` into ``dst_fd``,
    keeping names and permission bits.

    Iterative, with one folder descriptor open on each side however deep the tree: the
    walk goes down by name (``O_NOFOLLOW``) and back up through ``..``, which must lead to
    the folder it came down from (PathError('changed') otherwise). An entry that goes away
    while it is copied is left out."""
    src, dst = os.dup(src_fd), os.dup(dst_fd)
    try:
        # One frame a level: what is left to copy there, both sides' identities, and the
        # folder's mode (set on the copy once it is filled, so a read-only folder can be).
        stack = [(iter(os.listdir(src)), _identity(src), _identity(dst), -1)]
        while stack:
            pending, _, _, mode = stack[-1]
            name = next(pending, None)
            if name is None:
                stack.pop()
                if mode >= 0:
                    os.fchmod(dst, mode)
                if stack:
                    up_src = _parent_of(src, stack[-1][1])
                    os.close(src)
                    src = up_src
                    up_dst = _parent_of(dst, stack[-1][2])
                    os.close(dst)
                    dst = up_dst
                continue
            try:
                st = os.stat(name, dir_fd=src, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISDIR(st.st_mode):
                down = _open_dir_pair(src, dst, name, owner)
                if down is None:
                    continue
                os.close(src)
                os.close(dst)
                src, dst = down
                stack.append((iter(os.listdir(src)), _identity(src), _identity(dst), st.st_mode & 0o777))
            elif stat.S_ISLNK(st.st_mode):
                try:
                    target = os.readlink(name, dir_fd=src)
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    raise _changed(name, exc) from None
                os.symlink(target, name, dir_fd=dst)
                if owner is not None:
                    os.chown(name, *owner, dir_fd=dst, follow_symlinks=False)
            elif stat.S_ISREG(st.st_mode):
                _copy_file(src, dst, name, st.st_mode & 0o777, owner)
            # FIFOs, sockets and devices are not copied.
    finally:
        os.close(src)
        os.close(dst)


def _changed(name: str, exc: OSError) -> OSError | PathError:
    """What an entry that went from one kind to another since its stat (a folder or file
    swapped for a symlink, say) is: PathError('changed'); any other OSError as it is."""
    if exc.errno not in (errno.ELOOP, errno.ENOTDIR, errno.EISDIR, errno.ENXIO, errno.ENODEV, errno.EINVAL):
        return exc
    return PathError("changed", f"{name!r} changed while the workspace was being copied: {exc.strerror or exc}")


def _open_dir_pair(src: int, dst: int, name: str, owner: tuple[int, int] | None) -> tuple[int, int] | None:
    """Descriptors of folder ``name`` below ``src`` and of its new copy below ``dst``."""
    try:
        s = os.open(name, _DIR_FLAGS, dir_fd=src)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise _changed(name, exc) from None
    try:
        os.mkdir(name, 0o700, dir_fd=dst)
        d = os.open(name, _DIR_FLAGS, dir_fd=dst)
    except BaseException:
        os.close(s)
        raise
    if owner is not None:
        try:
            os.fchown(d, *owner)
        except BaseException:
            os.close(s)
            os.close(d)
            raise
    return s, d


def _copy_file(src: int, dst: int, name: str, mode: int, owner: tuple[int, int] | None) -> None:
    try:
        s = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=src)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise _changed(name, exc) from None
    try:
        if not stat.S_ISREG(os.fstat(s).st_mode):
            return  # swapped for something else since the stat: not copied, like any special file
        d = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dst)
        try:
            if owner is not None:
                os.fchown(d, *owner)
            os.fchmod(d, mode)
            while chunk := os.read(s, 1 << 20):
                view = memoryview(chunk)
                while view:
                    view = view[os.write(d, view):]
        finally:
            os.close(d)
    finally:
        os.close(s)
