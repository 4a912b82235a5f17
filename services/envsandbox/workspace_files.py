"""Symlink-proof file access below a workspace root, one directory descriptor at a time.

Every path component is opened with ``O_NOFOLLOW`` relative to its parent's descriptor,
so a symlink planted anywhere in the path (or swapped in while we walk) is refused
instead of followed out of the workspace. ``..`` and absolute paths are refused up front.

This module is self-contained (standard library only, no Meridian imports) because the
Docker backend runs it inside the container as well; errors are ``PathError`` with a
``kind`` of ``invalid`` or ``not_found`` that callers map to their own error types.
"""
from __future__ import annotations

import errno
import os
import stat

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class PathError(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


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
        name = parts[-1]
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
    finally:
        os.close(parent)


def read_file(root_fd: int, relative: str, max_bytes: int) -> bytes:
    """The regular file at ``relative`` (never a symlink, FIFO or device), at most ``max_bytes``."""
    parts = split_relative(relative)
    parent = _walk_dirs(root_fd, parts[:-1], relative, create=False, owner=None)
    try:
        try:
            # O_NONBLOCK: a FIFO planted under the name must not hang the service.
            fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=parent)
        except FileNotFoundError:
            raise PathError("not_found", f"no file {relative!r} in the workspace") from None
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise PathError("invalid", f"path is or goes through a symlink: {relative!r}") from None
            raise
        with os.fdopen(fd, "rb") as fh:
            st = os.fstat(fh.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise PathError("invalid", f"not a regular file: {relative!r}")
            if st.st_size > max_bytes:
                raise PathError("invalid", f"file {relative!r} is larger than {max_bytes} bytes")
            return fh.read(max_bytes + 1)[:max_bytes]
    finally:
        os.close(parent)


def remove_tree(root_fd: int, relative: str) -> None:
    """Removes ``relative`` (file, symlink or folder tree) without following any symlink."""
    parts = split_relative(relative)
    try:
        parent = _walk_dirs(root_fd, parts[:-1], relative, create=False, owner=None)
    except PathError:
        return
    try:
        _remove_entry(parent, parts[-1])
    finally:
        os.close(parent)


def _remove_entry(parent: int, name: str) -> None:
    try:
        st = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
        try:
            for child in os.listdir(fd):
                _remove_entry(fd, child)
        finally:
            os.close(fd)
        os.rmdir(name, dir_fd=parent)
    else:
        os.unlink(name, dir_fd=parent)


def copy_tree(src_fd: int, dst_fd: int, owner: tuple[int, int] | None = None) -> None:
    """Copies folders, regular files and symlinks (as links) from ``src_fd`` into ``dst_fd``."""
    for name in os.listdir(src_fd):
        st = os.stat(name, dir_fd=src_fd, follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            os.mkdir(name, st.st_mode & 0o777, dir_fd=dst_fd)
            s = os.open(name, _DIR_FLAGS, dir_fd=src_fd)
            d = os.open(name, _DIR_FLAGS, dir_fd=dst_fd)
            try:
                if owner is not None:
                    os.fchown(d, *owner)
                copy_tree(s, d, owner)
            finally:
                os.close(s)
                os.close(d)
        elif stat.S_ISLNK(st.st_mode):
            os.symlink(os.readlink(name, dir_fd=src_fd), name, dir_fd=dst_fd)
            if owner is not None:
                os.chown(name, *owner, dir_fd=dst_fd, follow_symlinks=False)
        elif stat.S_ISREG(st.st_mode):
            s = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=src_fd)
            d = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, st.st_mode & 0o777, dir_fd=dst_fd)
            try:
                if owner is not None:
                    os.fchown(d, *owner)
                while chunk := os.read(s, 1 << 20):
                    os.write(d, chunk)
            finally:
                os.close(s)
                os.close(d)
        # FIFOs, sockets and devices are not copied.
