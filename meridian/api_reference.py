"""Writes the API reference, ``docs/api.md``, from the ``meridian.v1`` .proto files.

The .proto files are the public API; this renders what they say, comments included:
each service's methods (streaming, request and response types), each message's fields
(number, type, cardinality, oneof, comment, reserved numbers and names) and each enum's
values. Run as ``python -m meridian.api_reference`` (``make protos`` runs it too); a test
renders it again and compares, so a .proto edit without a new reference fails.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import descriptor_pb2

from meridian import protogen

REFERENCE_PATH = protogen.REPO_ROOT / "docs" / "api.md"

FDP = descriptor_pb2.FieldDescriptorProto
# Descriptor path components (descriptor.proto field numbers), as source info uses them.
_MESSAGE, _ENUM, _SERVICE = 4, 5, 6
_FIELD, _NESTED, _NESTED_ENUM = 2, 3, 4
_VALUE, _METHOD = 2, 2

SCALARS = {
    FDP.TYPE_DOUBLE: "double", FDP.TYPE_FLOAT: "float", FDP.TYPE_INT64: "int64", FDP.TYPE_UINT64: "uint64",
    FDP.TYPE_INT32: "int32", FDP.TYPE_FIXED64: "fixed64", FDP.TYPE_FIXED32: "fixed32", FDP.TYPE_BOOL: "bool",
    FDP.TYPE_STRING: "string", FDP.TYPE_BYTES: "bytes", FDP.TYPE_UINT32: "uint32", FDP.TYPE_SFIXED32: "sfixed32",
    FDP.TYPE_SFIXED64: "sfixed64", FDP.TYPE_SINT32: "sint32", FDP.TYPE_SINT64: "sint64",
}

HEADER = """\
# meridian.v1 API reference

<!-- Generated from protos/meridian/v1/*.proto by `make protos` (python -m meridian.api_reference).
     Do not edit by hand: a test renders it again and compares. -->

Meridian's public API: the gRPC contracts of its four services, package `meridian.v1`,
rendered from the `.proto` files under `protos/meridian/v1/` with their comments. Clients
in any language can load those files directly (the Node client test does). A method's gRPC
path is `/meridian.v1.<Service>/<Method>`; every service also answers the standard health
service (`grpc.health.v1`) and server reflection. Changes are checked against the last
release's descriptors (`protos/releases/`) by `make test`: fields, messages, methods and
enum values may be added; nothing may be removed, renamed, renumbered or retyped.
"""


@dataclass(frozen=True)
class _Ctx:
    """What rendering one file needs: its package, comments and the messages of the
    whole set (to recognise map entries and link types)."""

    package: str
    locations: dict[tuple[int, ...], descriptor_pb2.SourceCodeInfo.Location]
    messages: dict[str, descriptor_pb2.DescriptorProto]
    linkable: frozenset[str]


def render(files: descriptor_pb2.FileDescriptorSet, prefix: str = "meridian/v1/") -> str:
    """The Markdown reference of the files in ``files`` whose name starts with ``prefix``
    (their imports are only linked to)."""
    messages = dict(_all_messages(files))
    linkable = frozenset(messages) | frozenset(name for name, _ in _all_enums(files))
    chosen = [f for f in files.file if f.name.startswith(prefix)]
    out = [HEADER, _contents(chosen)]
    for f in chosen:
        ctx = _Ctx(f.package, protogen.source_locations(f), messages, linkable)
        out.append(_file_section(f, ctx))
    return "\n".join(out).rstrip() + "\n"


def generate() -> str:
    """The reference for the current .proto files."""
    return render(protogen.descriptor_set(source_info=True))


# ---------------------------------------------------------------- walking the set


def _all_messages(files: descriptor_pb2.FileDescriptorSet) -> Iterator[tuple[str, descriptor_pb2.DescriptorProto]]:
    def walk(scope: str, msgs: list[descriptor_pb2.DescriptorProto]) -> Iterator[tuple[str, descriptor_pb2.DescriptorProto]]:
        for m in msgs:
            yield f"{scope}.{m.name}", m
            yield from walk(f"{scope}.{m.name}", list(m.nested_type))

    for f in files.file:
        yield from walk(f".{f.package}" if f.package else "", list(f.message_type))


def _all_enums(files: descriptor_pb2.FileDescriptorSet) -> Iterator[tuple[str, descriptor_pb2.EnumDescriptorProto]]:
    for f in files.file:
        scope = f".{f.package}" if f.package else ""
        for e in f.enum_type:
            yield f"{scope}.{e.name}", e
        for name, m in _all_messages(descriptor_pb2.FileDescriptorSet(file=[f])):
            for e in m.enum_type:
                yield f"{name}.{e.name}", e


# ---------------------------------------------------------------- Markdown


def _anchor(full_name: str) -> str:
    return full_name.lstrip(".")


def _type_ref(type_name: str, ctx: _Ctx) -> str:
    """A message or enum type as a link when it is in the set, relative to the package."""
    short = type_name.removeprefix(f".{ctx.package}.") if ctx.package else type_name.lstrip(".")
    if type_name in ctx.linkable:
        return f"[`{short}`](#{_anchor(type_name)})"
    return f"`{short.lstrip('.')}`"


def _escape(text: str) -> str:
    # Comments are prose, not Markdown: angle brackets would vanish as HTML, pipes split cells.
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _cell(text: str) -> str:
    return " ".join(_escape(text).split()).replace("|", "\\|")


def _comment_lines(raw: str) -> list[str]:
    return [line[1:] if line.startswith(" ") else line for line in raw.rstrip("\n").split("\n")]


def _comment(ctx: _Ctx, path: tuple[int, ...]) -> str:
    """An element's leading and trailing comments, as one text (empty when it has none)."""
    loc = ctx.locations.get(path)
    if loc is None:
        return ""
    parts = [c for c in (loc.leading_comments, loc.trailing_comments) if c.strip()]
    return "\n".join("\n".join(_comment_lines(c)).strip() for c in parts)


def _detached(ctx: _Ctx, path: tuple[int, ...]) -> list[str]:
    """Comments separated by a blank line from the element after them: notes about the
    file or section rather than about the element."""
    loc = ctx.locations.get(path)
    if loc is None:
        return []
    return ["\n".join(_comment_lines(c)).strip() for c in loc.leading_detached_comments if c.strip()]


def _paragraph(text: str) -> str:
    return _escape(text) + "\n" if text else ""


def _contents(files: list[descriptor_pb2.FileDescriptorProto]) -> str:
    lines = ["## Contents", ""]
    for f in files:
        scope = f".{f.package}" if f.package else ""
        services = ", ".join(f"[`{s.name}`](#{_anchor(f'{scope}.{s.name}')})" for s in f.service)
        lines.append(f"- [`{f.name}`](#{f.name.replace('/', '').replace('.', '')})" + (f": service {services}" if services else ""))
    return "\n".join(lines) + "\n"


def _file_section(f: descriptor_pb2.FileDescriptorProto, ctx: _Ctx) -> str:
    out = [f"## {f.name}\n"]
    out += [_paragraph(d) for d in _detached(ctx, (2,)) + _detached(ctx, (12,))]
    scope = f".{f.package}" if f.package else ""
    for i, service in enumerate(f.service):
        out.append(_service(service, f"{scope}.{service.name}", (_SERVICE, i), ctx))
    for i, message in enumerate(f.message_type):
        out.extend(_message(message, f"{scope}.{message.name}", (_MESSAGE, i), ctx))
    for i, enum in enumerate(f.enum_type):
        out.append(_enum(enum, f"{scope}.{enum.name}", (_ENUM, i), ctx))
    return "\n".join(out)


def _heading(kind: str, full_name: str, path: tuple[int, ...], ctx: _Ctx) -> list[str]:
    notes = [_paragraph(d) for d in _detached(ctx, path)]
    comment = _comment(ctx, path)
    lines = [*notes, f'<a id="{_anchor(full_name)}"></a>', "", f"### {kind} `{_anchor(full_name)}`", ""]
    return [*lines, _paragraph(comment)] if comment else lines


def _service(service: descriptor_pb2.ServiceDescriptorProto, full_name: str, path: tuple[int, ...], ctx: _Ctx) -> str:
    lines = _heading("service", full_name, path, ctx)
    lines += ["| method | request | response | description |", "| --- | --- | --- | --- |"]
    for j, method in enumerate(service.method):
        request = ("stream " if method.client_streaming else "") + _type_ref(method.input_type, ctx)
        response = ("stream " if method.server_streaming else "") + _type_ref(method.output_type, ctx)
        comment = _cell(_comment(ctx, (*path, _METHOD, j)))
        lines.append(f"| `{method.name}` | {request} | {response} | {comment} |")
    return "\n".join(lines) + "\n"


def _field_type(field: descriptor_pb2.FieldDescriptorProto, ctx: _Ctx) -> str:
    if field.type in (FDP.TYPE_MESSAGE, FDP.TYPE_ENUM):
        entry = ctx.messages.get(field.type_name)
        if entry is not None and entry.options.map_entry:
            key, value = entry.field[0], entry.field[1]
            return f"map&lt;{_field_type(key, ctx)}, {_field_type(value, ctx)}&gt;"
        return _type_ref(field.type_name, ctx)
    return f"`{SCALARS[field.type]}`"


def _cardinality(field: descriptor_pb2.FieldDescriptorProto, message: descriptor_pb2.DescriptorProto, ctx: _Ctx) -> str:
    if field.label == FDP.LABEL_REPEATED:
        entry = ctx.messages.get(field.type_name)
        return "map" if entry is not None and entry.options.map_entry else "repeated"
    if field.proto3_optional:
        return "optional"
    if field.HasField("oneof_index"):
        return f"oneof `{message.oneof_decl[field.oneof_index].name}`"
    if field.label == FDP.LABEL_REQUIRED:
        return "required"
    return "singular"


def _message(message: descriptor_pb2.DescriptorProto, full_name: str, path: tuple[int, ...], ctx: _Ctx) -> list[str]:
    if message.options.map_entry:
        return []  # rendered as map<K, V> on the field that uses it
    lines = _heading("message", full_name, path, ctx)
    if message.field:
        lines += ["| field | number | type | cardinality | description |", "| --- | --- | --- | --- | --- |"]
        for j, field in enumerate(message.field):
            ftype = _field_type(field, ctx)
            comment = _cell(_comment(ctx, (*path, _FIELD, j)))
            lines.append(f"| `{field.name}` | {field.number} | {ftype} | {_cardinality(field, message, ctx)} | {comment} |")
        lines.append("")
    else:
        lines += ["No fields.", ""]
    lines += _reserved(message.reserved_range, message.reserved_name, exclusive_end=True)
    out = ["\n".join(lines)]
    for k, nested in enumerate(message.nested_type):
        out.extend(_message(nested, f"{full_name}.{nested.name}", (*path, _NESTED, k), ctx))
    for k, enum in enumerate(message.enum_type):
        out.append(_enum(enum, f"{full_name}.{enum.name}", (*path, _NESTED_ENUM, k), ctx))
    return out


def _reserved(ranges: object, names: object, *, exclusive_end: bool) -> list[str]:
    """One line listing reserved numbers and names (message ranges end exclusively, enum
    ranges inclusively)."""
    spans = []
    for r in ranges:  # type: ignore[attr-defined]
        last = r.end - 1 if exclusive_end else r.end
        spans.append(str(r.start) if last == r.start else f"{r.start} to {last}")
    parts = []
    if spans:
        parts.append("numbers " + ", ".join(spans))
    if names:
        parts.append("names " + ", ".join(f"`{n}`" for n in names))  # type: ignore[attr-defined]
    return [f"Reserved (never to be reused): {'; '.join(parts)}.", ""] if parts else []


def _enum(enum: descriptor_pb2.EnumDescriptorProto, full_name: str, path: tuple[int, ...], ctx: _Ctx) -> str:
    lines = _heading("enum", full_name, path, ctx)
    lines += ["| value | number | description |", "| --- | --- | --- |"]
    for j, value in enumerate(enum.value):
        lines.append(f"| `{value.name}` | {value.number} | {_cell(_comment(ctx, (*path, _VALUE, j)))} |")
    lines.append("")
    lines += _reserved(enum.reserved_range, enum.reserved_name, exclusive_end=False)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REFERENCE_PATH, help="where to write the reference (default: docs/api.md)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when the file differs from the .proto files")
    args = parser.parse_args(argv)
    text = generate()
    if args.check:
        current = args.out.read_text() if args.out.exists() else ""
        if current != text:
            print(f"{args.out} is out of date: run `make protos`", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
