"""Breaking-change check of the ``meridian.v1`` .proto files against the last release.

Other systems call Meridian through these contracts, so a change that breaks an existing
client or stored message must not slip in: a released contract's services, methods,
messages, fields and enum values stay, under the same names and numbers, with the same
types, cardinality, oneof membership and streaming; numbers and names a release reserved
are never reused. Adding is fine (fields, messages, methods, services, enum values). A
field or enum value may be retired only the protobuf way: removed with both its number and
its name reserved.

A release is a descriptor set committed under ``protos/releases/`` (``v<major>.<minor>.<patch>.binpb``,
with source info so a removal points at its line in the release); the newest one is the
reference. ``make test`` runs the check (tests/unit/test_proto_compat.py). By hand:

    python -m meridian.proto_compat                      # current protos vs the newest release
    python -m meridian.proto_compat release v0.2.0       # record the current protos as a release
    python -m meridian.proto_compat release v0.1.0 --ref 6e8f3a4   # ... or those of a git revision
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import descriptor_pb2

from meridian import protogen

RELEASES_DIR = protogen.PROTO_ROOT / "releases"
_RELEASE_NAME = re.compile(r"^v(\d+)\.(\d+)\.(\d+)\.binpb$")

FDP = descriptor_pb2.FieldDescriptorProto
# Descriptor path components (descriptor.proto field numbers), as source info uses them.
_MESSAGE, _ENUM, _SERVICE = 4, 5, 6
_FIELD, _NESTED, _NESTED_ENUM, _VALUE, _METHOD = 2, 3, 4, 2, 2


@dataclass(frozen=True)
class Break:
    """One breaking change: where (file:line:column; in the release for a removal), which
    element, and what changed."""

    location: str
    element: str
    change: str

    def __str__(self) -> str:
        return f"{self.location}: {self.element}: {self.change}"


@dataclass(frozen=True)
class _Element:
    """A descriptor with the file it is in and its source-info path there."""

    file: descriptor_pb2.FileDescriptorProto
    path: tuple[int, ...]
    proto: object


# ---------------------------------------------------------------- the check


def breaking_changes(old: descriptor_pb2.FileDescriptorSet, new: descriptor_pb2.FileDescriptorSet) -> list[Break]:
    """Every change from ``old`` (the release) to ``new`` that breaks a client or a
    stored message of ``old``; empty when ``new`` only adds."""
    old_idx, new_idx = _Index(old), _Index(new)
    breaks: list[Break] = []
    for full, before in old_idx.services.items():
        name = full.lstrip(".")
        after = new_idx.services.get(full)
        if after is None:
            breaks.append(_removed(before, f"service {name}", "service removed or renamed"))
        else:
            breaks += _service_breaks(name, before, after)
    for full, before in old_idx.messages.items():
        if before.proto.options.map_entry:  # type: ignore[attr-defined]
            continue  # compared as the map field's type, map<K, V>, where the field is
        name = full.lstrip(".")
        after = new_idx.messages.get(full)
        if after is None:
            breaks.append(_removed(before, f"message {name}", "message removed or renamed"))
        else:
            breaks += _message_breaks(name, before, after, old_idx, new_idx)
    for full, before in old_idx.enums.items():
        name = full.lstrip(".")
        after = new_idx.enums.get(full)
        if after is None:
            breaks.append(_removed(before, f"enum {name}", "enum removed or renamed"))
        else:
            breaks += _enum_breaks(name, before, after)
    return breaks


def _service_breaks(name: str, before: _Element, after: _Element) -> list[Break]:
    old_svc: descriptor_pb2.ServiceDescriptorProto = before.proto  # type: ignore[assignment]
    new_svc: descriptor_pb2.ServiceDescriptorProto = after.proto  # type: ignore[assignment]
    new_methods = {m.name: (j, m) for j, m in enumerate(new_svc.method)}
    breaks = []
    for j, m in enumerate(old_svc.method):
        element = f"method {name}.{m.name}"
        if m.name not in new_methods:
            breaks.append(_removed(_Element(before.file, (*before.path, _METHOD, j), m), element, "method removed or renamed"))
            continue
        k, n = new_methods[m.name]
        here = _location(after.file, (*after.path, _METHOD, k))
        for what, was, now in (
            ("request type", m.input_type, n.input_type),
            ("response type", m.output_type, n.output_type),
        ):
            if was != now:
                breaks.append(Break(here, element, f"{what} changed from {was.lstrip('.')} to {now.lstrip('.')}"))
        for what, was_stream, now_stream in (
            ("request", m.client_streaming, n.client_streaming),
            ("response", m.server_streaming, n.server_streaming),
        ):
            if was_stream != now_stream:
                change = f"{what} {'no longer' if was_stream else 'now'} streamed"
                breaks.append(Break(here, element, change))
    return breaks


def _message_breaks(name: str, before: _Element, after: _Element, old_idx: _Index, new_idx: _Index) -> list[Break]:
    old_msg: descriptor_pb2.DescriptorProto = before.proto  # type: ignore[assignment]
    new_msg: descriptor_pb2.DescriptorProto = after.proto  # type: ignore[assignment]
    new_by_number = {f.number: (j, f) for j, f in enumerate(new_msg.field)}
    new_by_name = {f.name: (j, f) for j, f in enumerate(new_msg.field)}
    breaks = []
    for j, f in enumerate(old_msg.field):
        element = f"field {name}.{f.name} ({f.number})"
        if f.number in new_by_number:
            k, g = new_by_number[f.number]
            here = _location(after.file, (*after.path, _FIELD, k))
            if g.name != f.name:
                breaks.append(Break(here, element, f"renamed to {g.name}"))
            was, now = _field_type(f, old_idx), _field_type(g, new_idx)
            if was != now:
                breaks.append(Break(here, element, f"type changed from {was} to {now}"))
            was, now = _cardinality(f, old_idx), _cardinality(g, new_idx)
            if was != now:
                breaks.append(Break(here, element, f"cardinality changed from {was} to {now}"))
            was, now = _oneof(f, old_msg), _oneof(g, new_msg)
            if was != now:
                breaks.append(Break(here, element, f"oneof membership changed from {was or 'none'} to {now or 'none'}"))
        elif f.name in new_by_name:
            k, g = new_by_name[f.name]
            here = _location(after.file, (*after.path, _FIELD, k))
            breaks.append(Break(here, element, f"number changed from {f.number} to {g.number}"))
        elif not (_in_ranges(f.number, new_msg.reserved_range, end_inclusive=False) and f.name in new_msg.reserved_name):
            removed = _Element(before.file, (*before.path, _FIELD, j), f)
            breaks.append(_removed(removed, element, "field removed (to retire a field, reserve both its number and its name)"))
    for k, g in enumerate(new_msg.field):
        here = _location(after.file, (*after.path, _FIELD, k))
        element = f"field {name}.{g.name} ({g.number})"
        if _in_ranges(g.number, old_msg.reserved_range, end_inclusive=False):
            breaks.append(Break(here, element, f"reuses number {g.number}, reserved in the release"))
        if g.name in old_msg.reserved_name:
            breaks.append(Break(here, element, f"reuses name {g.name}, reserved in the release"))
    return breaks


def _enum_breaks(name: str, before: _Element, after: _Element) -> list[Break]:
    old_enum: descriptor_pb2.EnumDescriptorProto = before.proto  # type: ignore[assignment]
    new_enum: descriptor_pb2.EnumDescriptorProto = after.proto  # type: ignore[assignment]
    new_by_name = {v.name: (j, v) for j, v in enumerate(new_enum.value)}
    new_by_number: dict[int, tuple[int, descriptor_pb2.EnumValueDescriptorProto]] = {}
    for j, v in enumerate(new_enum.value):
        new_by_number.setdefault(v.number, (j, v))  # aliases: the first name is the canonical one
    breaks = []
    for j, v in enumerate(old_enum.value):
        element = f"enum value {name}.{v.name} ({v.number})"
        if v.name in new_by_name:
            k, w = new_by_name[v.name]
            if w.number != v.number:
                here = _location(after.file, (*after.path, _VALUE, k))
                breaks.append(Break(here, element, f"number changed from {v.number} to {w.number}"))
        elif v.number in new_by_number:
            k, w = new_by_number[v.number]
            breaks.append(Break(_location(after.file, (*after.path, _VALUE, k)), element, f"renamed to {w.name}"))
        elif not (_in_ranges(v.number, new_enum.reserved_range, end_inclusive=True) and v.name in new_enum.reserved_name):
            removed = _Element(before.file, (*before.path, _VALUE, j), v)
            breaks.append(_removed(removed, element, "enum value removed (to retire a value, reserve both its number and its name)"))
    for k, w in enumerate(new_enum.value):
        here = _location(after.file, (*after.path, _VALUE, k))
        element = f"enum value {name}.{w.name} ({w.number})"
        if _in_ranges(w.number, old_enum.reserved_range, end_inclusive=True):
            breaks.append(Break(here, element, f"reuses number {w.number}, reserved in the release"))
        if w.name in old_enum.reserved_name:
            breaks.append(Break(here, element, f"reuses name {w.name}, reserved in the release"))
    return breaks


# ---------------------------------------------------------------- field properties


def _field_type(f: descriptor_pb2.FieldDescriptorProto, idx: _Index) -> str:
    """The field's type as a comparable string; a map shows its key and value types."""
    if f.type in (FDP.TYPE_MESSAGE, FDP.TYPE_ENUM, FDP.TYPE_GROUP):
        entry = idx.messages.get(f.type_name)
        entry_msg: descriptor_pb2.DescriptorProto | None = entry.proto if entry else None  # type: ignore[assignment]
        if entry_msg is not None and entry_msg.options.map_entry:
            key, value = entry_msg.field[0], entry_msg.field[1]
            return f"map<{_field_type(key, idx)}, {_field_type(value, idx)}>"
        return f.type_name.lstrip(".")
    return FDP.Type.Name(f.type).removeprefix("TYPE_").lower()


def _cardinality(f: descriptor_pb2.FieldDescriptorProto, idx: _Index) -> str:
    """repeated, map, required, optional (explicit presence) or singular."""
    if f.label == FDP.LABEL_REPEATED:
        return "map" if _field_type(f, idx).startswith("map<") else "repeated"
    if f.label == FDP.LABEL_REQUIRED:
        return "required"
    return "optional" if f.proto3_optional else "singular"


def _oneof(f: descriptor_pb2.FieldDescriptorProto, message: descriptor_pb2.DescriptorProto) -> str | None:
    """The real oneof the field belongs to (proto3 ``optional``'s synthetic one is presence,
    compared as cardinality)."""
    if not f.HasField("oneof_index") or f.proto3_optional:
        return None
    return message.oneof_decl[f.oneof_index].name


def _in_ranges(number: int, ranges: object, *, end_inclusive: bool) -> bool:
    # Message reserved ranges end exclusively, enum ones inclusively (descriptor.proto).
    return any(r.start <= number < r.end + (1 if end_inclusive else 0) for r in ranges)  # type: ignore[attr-defined]


# ---------------------------------------------------------------- indexing and locations


class _Index:
    """Services, messages (nested ones and map entries included) and enums of a set, by
    fully qualified name (``.pkg.Name``)."""

    def __init__(self, files: descriptor_pb2.FileDescriptorSet) -> None:
        self.services: dict[str, _Element] = {}
        self.messages: dict[str, _Element] = {}
        self.enums: dict[str, _Element] = {}
        for f in files.file:
            scope = f".{f.package}" if f.package else ""
            for i, s in enumerate(f.service):
                self.services[f"{scope}.{s.name}"] = _Element(f, (_SERVICE, i), s)
            for i, e in enumerate(f.enum_type):
                self.enums[f"{scope}.{e.name}"] = _Element(f, (_ENUM, i), e)
            for name, element in self._walk(f, scope, list(f.message_type), (_MESSAGE,)):
                self.messages[name] = element

    def _walk(
        self, f: descriptor_pb2.FileDescriptorProto, scope: str, msgs: list[descriptor_pb2.DescriptorProto], prefix: tuple[int, ...]
    ) -> Iterator[tuple[str, _Element]]:
        for i, m in enumerate(msgs):
            name, path = f"{scope}.{m.name}", (*prefix, i)
            yield name, _Element(f, path, m)
            for k, e in enumerate(m.enum_type):
                self.enums[f"{name}.{e.name}"] = _Element(f, (*path, _NESTED_ENUM, k), e)
            yield from self._walk(f, name, list(m.nested_type), (*path, _NESTED))


def _location(file: descriptor_pb2.FileDescriptorProto, path: tuple[int, ...]) -> str:
    """``file:line:column`` of the element at ``path`` (or of its nearest located parent: a
    map entry has no location of its own); just the file without source info."""
    locations = protogen.source_locations(file)
    for end in range(len(path), -1, -1):
        loc = locations.get(path[:end])
        if loc is not None and loc.span:
            return f"{file.name}:{loc.span[0] + 1}:{loc.span[1] + 1}"
    return file.name


def _removed(element: _Element, what: str, change: str) -> Break:
    return Break(f"{_location(element.file, element.path)} (release)", what, change)


# ---------------------------------------------------------------- releases


def release_files(releases_dir: Path = RELEASES_DIR) -> list[Path]:
    """The committed release descriptor sets, oldest first (by version number)."""
    found = [(tuple(int(x) for x in m.groups()), p) for p in releases_dir.glob("*.binpb") if (m := _RELEASE_NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def latest_release(releases_dir: Path = RELEASES_DIR) -> Path:
    """The newest release's descriptor set (what the current protos must stay compatible with)."""
    files = release_files(releases_dir)
    if not files:
        raise FileNotFoundError(f"no release descriptor set (v<major>.<minor>.<patch>.binpb) under {releases_dir}")
    return files[-1]


def load_release(path: Path) -> descriptor_pb2.FileDescriptorSet:
    return descriptor_pb2.FileDescriptorSet.FromString(path.read_bytes())


def check_current(releases_dir: Path = RELEASES_DIR) -> tuple[Path, list[Break]]:
    """The newest release and the breaking changes the current protos make to it."""
    release = latest_release(releases_dir)
    return release, breaking_changes(load_release(release), protogen.descriptor_set(source_info=True))


def descriptor_set_at(ref: str) -> descriptor_pb2.FileDescriptorSet:
    """The ``meridian.v1`` protos as they were at git revision ``ref``, compiled."""
    package = f"{protogen.PROTO_ROOT.name}/{protogen.PROTO_PACKAGE.as_posix()}"
    listing = subprocess.run(
        ["git", "ls-tree", "-r", "--name-only", ref, f"{package}/"],
        cwd=protogen.REPO_ROOT, check=True, capture_output=True, text=True,
    ).stdout.split()
    names = [n for n in listing if n.endswith(".proto")]
    if not names:
        raise FileNotFoundError(f"no .proto files under {package}/ at {ref}")
    with tempfile.TemporaryDirectory(prefix="meridian-release-") as tmp:
        root = Path(tmp)
        files = []
        for name in names:
            content = subprocess.run(["git", "show", f"{ref}:{name}"], cwd=protogen.REPO_ROOT, check=True, capture_output=True).stdout
            rel = Path(name).relative_to(protogen.PROTO_ROOT.name)
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_bytes(content)
            files.append(rel)
        return protogen.descriptor_set(root, sorted(files), source_info=True)


def write_release(version: str, ref: str | None = None, releases_dir: Path = RELEASES_DIR) -> Path:
    """Records the protos (current, or at git revision ``ref``) as release ``version``."""
    name = f"{version}.binpb"
    if not _RELEASE_NAME.match(name):
        raise ValueError(f"release version {version!r} is not v<major>.<minor>.<patch>")
    files = descriptor_set_at(ref) if ref else protogen.descriptor_set(source_info=True)
    releases_dir.mkdir(parents=True, exist_ok=True)
    out = releases_dir / name
    out.write_bytes(files.SerializeToString(deterministic=True))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("check", help="compare the current protos with the newest release (the default)")
    rel = sub.add_parser("release", help="record the protos as a release descriptor set under protos/releases/")
    rel.add_argument("version", help="v<major>.<minor>.<patch>")
    rel.add_argument("--ref", help="a git revision to take the protos from (default: the working tree)")
    args = parser.parse_args(argv)
    if args.command == "release":
        print(write_release(args.version, args.ref))
        return 0
    release, breaks = check_current()
    for b in breaks:
        print(b)
    print(f"{len(breaks)} breaking change(s) against {release.name}", file=sys.stderr)
    return 1 if breaks else 0


if __name__ == "__main__":
    sys.exit(main())
