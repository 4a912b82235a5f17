"""Unified diffs (``diff --git`` / ``---``/``+++``/``@@``), parsed and applied to an
in-memory file map: how SWE-bench-style test and gold patches become task files."""
from __future__ import annotations

import dataclasses
import re
from pathlib import PurePosixPath

from meridian.errors import InvalidArgument

_HUNK_HEADER = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


class PatchError(InvalidArgument):
    """A unified diff that is malformed or does not apply to the given files."""


# ------------------------------------------------------------------ unified diffs


@dataclasses.dataclass
class _Hunk:
    old_start: int
    old_len: int
    new_start: int
    new_len: int
    old_lines: list[str]
    new_lines: list[str]
    header_line: int  # 1-based line in the diff, for error messages


@dataclasses.dataclass
class _FilePatch:
    old_path: str | None  # None for a created file
    new_path: str | None  # None for a deleted file
    hunks: list[_Hunk]


def _strip_prefix(raw: str) -> str | None:
    """The repository path of a ``---``/``+++`` header value; None for /dev/null."""
    path = raw.split("\t", 1)[0].strip()
    if path == "/dev/null":
        return None
    if path.startswith(("a/", "b/")):
        path = path[2:]
    return check_rel_path(path, "diff header")


def check_rel_path(path: str, what: str) -> str:
    pure = PurePosixPath(path)
    if not path or pure.is_absolute() or ".." in pure.parts or "\x00" in path:
        raise PatchError(f"{what}: unsafe or empty path {path!r}")
    return str(pure)


def parse_unified_diff(diff: str) -> list[_FilePatch]:
    """Parses a (git-style or plain) unified diff of text files; strict about counts."""
    # Split on "\n" only: str.splitlines would also break on \r, \f and friends that
    # may legitimately appear inside a line.
    lines = diff.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    patches: list[_FilePatch] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("GIT binary patch") or line.startswith("Binary files "):
            raise PatchError(f"diff line {i + 1}: binary patches are not supported")
        if line.startswith(("rename from ", "rename to ", "copy from ", "copy to ")):
            raise PatchError(f"diff line {i + 1}: renames and copies are not supported: {line!r}")
        if not line.startswith("--- "):
            # diff --git, index, mode lines and free text between file sections.
            i += 1
            continue
        if i + 1 >= len(lines) or not lines[i + 1].startswith("+++ "):
            raise PatchError(f"diff line {i + 1}: '---' header not followed by '+++'")
        old_path = _strip_prefix(line[4:])
        new_path = _strip_prefix(lines[i + 1][4:])
        if old_path is None and new_path is None:
            raise PatchError(f"diff line {i + 1}: both sides are /dev/null")
        i += 2
        hunks: list[_Hunk] = []
        while i < len(lines) and lines[i].startswith("@@"):
            hunk, i = _parse_hunk(lines, i)
            hunks.append(hunk)
        if not hunks:
            raise PatchError(f"diff line {i}: file section for {new_path or old_path!r} has no hunks")
        patches.append(_FilePatch(old_path, new_path, hunks))
    if not patches:
        raise PatchError("diff contains no file sections")
    return patches


def _parse_hunk(lines: list[str], i: int) -> tuple[_Hunk, int]:
    m = _HUNK_HEADER.match(lines[i])
    if not m:
        raise PatchError(f"diff line {i + 1}: malformed hunk header {lines[i]!r}")
    old_start, new_start = int(m.group(1)), int(m.group(3))
    old_len = int(m.group(2)) if m.group(2) is not None else 1
    new_len = int(m.group(4)) if m.group(4) is not None else 1
    hunk = _Hunk(old_start, old_len, new_start, new_len, [], [], i + 1)
    i += 1
    last: list[str] | None = None  # the side(s) the previous line went to, for "\ No newline"
    while i < len(lines) and (len(hunk.old_lines) < old_len or len(hunk.new_lines) < new_len):
        line = lines[i]
        tag, text = (line[:1], line[1:]) if line else (" ", "")  # some tools drop the space of empty context lines
        if tag == " ":
            hunk.old_lines.append(text + "\n")
            hunk.new_lines.append(text + "\n")
            last = ["old", "new"]
        elif tag == "-":
            hunk.old_lines.append(text + "\n")
            last = ["old"]
        elif tag == "+":
            hunk.new_lines.append(text + "\n")
            last = ["new"]
        elif tag == "\\":
            _drop_final_newline(hunk, last, i)
        else:
            raise PatchError(f"diff line {i + 1}: unexpected line in hunk: {line!r}")
        i += 1
    # A "\ No newline at end of file" marker may follow the hunk's last counted line.
    while i < len(lines) and lines[i].startswith("\\"):
        _drop_final_newline(hunk, last, i)
        i += 1
    if len(hunk.old_lines) != old_len or len(hunk.new_lines) != new_len:
        raise PatchError(
            f"diff line {hunk.header_line}: hunk claims -{old_len} +{new_len} lines but has "
            f"-{len(hunk.old_lines)} +{len(hunk.new_lines)}"
        )
    return hunk, i


def _drop_final_newline(hunk: _Hunk, last: list[str] | None, i: int) -> None:
    if last is None:
        raise PatchError(f"diff line {i + 1}: '\\' marker before any hunk line")
    for side in last:
        target = hunk.old_lines if side == "old" else hunk.new_lines
        target[-1] = target[-1][:-1]


def _apply_hunks(path: str, text: str, hunks: list[_Hunk]) -> str:
    """Applies hunks at exactly their stated positions (no fuzz, no offset search)."""
    src = _split_newline_only(text)
    out: list[str] = []
    pos = 0  # index into src of the next line not yet copied
    for hunk in hunks:
        # A zero-length old range names the line *after which* to insert.
        start = hunk.old_start if hunk.old_len == 0 else hunk.old_start - 1
        if start < pos:
            raise PatchError(f"{path}: hunk at diff line {hunk.header_line} overlaps or is out of order")
        actual = src[start:start + hunk.old_len]
        if actual != hunk.old_lines:
            where = next((k for k, (a, b) in enumerate(zip(actual, hunk.old_lines)) if a != b), len(actual))
            want = hunk.old_lines[where] if where < len(hunk.old_lines) else "<end of hunk>"
            got = actual[where] if where < len(actual) else "<end of file>"
            raise PatchError(
                f"{path}: hunk at diff line {hunk.header_line} does not apply at line {start + where + 1}: "
                f"expected {want!r}, found {got!r}"
            )
        out.extend(src[pos:start])
        out.extend(hunk.new_lines)
        pos = start + hunk.old_len
    out.extend(src[pos:])
    return "".join(out)


def _split_newline_only(text: str) -> list[str]:
    """Lines split at LF only (the last may lack one); unlike str.splitlines, CR and FF stay inside lines."""
    parts = text.split("\n")
    lines = [p + "\n" for p in parts[:-1]]
    if parts[-1]:
        lines.append(parts[-1])  # last line without a trailing newline
    return lines


def apply_unified_diff(files: dict[str, str], diff: str) -> tuple[dict[str, str], set[str], set[str]]:
    """Applies ``diff`` to ``files``.

    Returns ``(new_files, changed, deleted)``: the full patched file map, the paths
    created or modified, and the paths deleted. Raises PatchError when the diff is
    malformed or any hunk does not match the files exactly.
    """
    result = dict(files)
    changed: set[str] = set()
    deleted: set[str] = set()
    for fp in parse_unified_diff(diff):
        if fp.old_path is None:
            assert fp.new_path is not None
            if fp.new_path in result:
                raise PatchError(f"{fp.new_path}: diff creates a file that already exists")
            base = ""
        else:
            if fp.old_path not in result:
                raise PatchError(f"{fp.old_path}: diff modifies a file that does not exist")
            if fp.new_path is not None and fp.new_path != fp.old_path:
                raise PatchError(f"{fp.old_path}: renames (to {fp.new_path!r}) are not supported")
            base = result[fp.old_path]
        target = fp.new_path or fp.old_path
        assert target is not None  # parse_unified_diff rejects /dev/null on both sides
        patched = _apply_hunks(target, base, fp.hunks)
        if fp.new_path is None:
            if patched:
                raise PatchError(f"{target}: deletion hunk does not remove the whole file")
            del result[target]
            deleted.add(target)
            changed.discard(target)
        else:
            result[target] = patched
            changed.add(target)
            deleted.discard(target)
    return result, changed, deleted
