"""The breaking-change check: each rule on a small synthetic proto pair (the change must be
flagged, with its location), additive changes pass, and the current protos keep the last
release's contract (this is what `make test` enforces)."""
from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

from meridian import proto_compat, protogen

BASE = """\
syntax = "proto3";
package demo.v1;

service Echo {
  rpc Say(SayRequest) returns (SayReply);
  rpc Watch(SayRequest) returns (stream SayReply);
}

service Spare {
  rpc Ping(SayReply) returns (SayReply);
}

enum Mood {
  MOOD_UNSPECIFIED = 0;
  MOOD_HAPPY = 1;
  MOOD_SAD = 2;
  reserved 7;
  reserved "MOOD_ANGRY";
}

enum Spin {
  SPIN_UNSPECIFIED = 0;
}

message SayRequest {
  string text = 1;
  int32 count = 2;
  repeated string tags = 3;
  oneof target {
    string user = 4;
    string room = 5;
  }
  Mood mood = 6;
  optional float temperature = 7;
  map<string, string> labels = 8;
  reserved 9, 20 to 22;
  reserved "old";
  message Inner {
    int64 id = 1;
  }
  Inner inner = 10;
}

message SayReply {
  string text = 1;
}

message Unused {
  bool flag = 1;
}
"""

FILE = "demo/v1/demo.proto"


def _compile(tmp_path: Path, text: str, label: str) -> descriptor_pb2.FileDescriptorSet:
    root = tmp_path / label
    (root / FILE).parent.mkdir(parents=True)
    (root / FILE).write_text(text)
    return protogen.descriptor_set(root, [Path(FILE)], source_info=True)


def _edit(old: str, new: str, text: str = BASE) -> str:
    assert old in text, f"edit target not in the base proto: {old!r}"
    return text.replace(old, new, 1)


def _breaks(tmp_path: Path, new_text: str) -> list[str]:
    old = _compile(tmp_path, BASE, "old")
    new = _compile(tmp_path, new_text, "new")
    return [str(b) for b in proto_compat.breaking_changes(old, new)]


def _line_of(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), start=1) if needle in line)


# (rule, the edit, the element the break names, what it says, a line of the new file it points at
# (None: a removal, pointed at in the release))
BREAKING = [
    ("service removed", ("service Spare {\n  rpc Ping(SayReply) returns (SayReply);\n}\n", ""), "service demo.v1.Spare", "service removed or renamed", None),
    ("service renamed", ("service Spare {", "service Extra {"), "service demo.v1.Spare", "service removed or renamed", None),
    ("method removed", ("  rpc Watch(SayRequest) returns (stream SayReply);\n", ""), "method demo.v1.Echo.Watch", "method removed or renamed", None),
    ("method renamed", ("rpc Say(", "rpc Speak("), "method demo.v1.Echo.Say", "method removed or renamed", None),
    ("request type", ("rpc Say(SayRequest)", "rpc Say(SayReply)"), "method demo.v1.Echo.Say", "request type changed from demo.v1.SayRequest to demo.v1.SayReply", "rpc Say("),
    ("response type", ("rpc Say(SayRequest) returns (SayReply)", "rpc Say(SayRequest) returns (SayRequest)"), "method demo.v1.Echo.Say", "response type changed", "rpc Say("),
    ("response streaming dropped", ("returns (stream SayReply)", "returns (SayReply)"), "method demo.v1.Echo.Watch", "response no longer streamed", "rpc Watch("),
    ("request streaming added", ("rpc Say(SayRequest)", "rpc Say(stream SayRequest)"), "method demo.v1.Echo.Say", "request now streamed", "rpc Say("),
    ("message removed", ("message Unused {\n  bool flag = 1;\n}\n", ""), "message demo.v1.Unused", "message removed or renamed", None),
    ("message renamed", ("message Unused {", "message Spared {"), "message demo.v1.Unused", "message removed or renamed", None),
    ("nested message renamed", ("message Inner {\n    int64 id = 1;\n  }\n  Inner inner", "message Core {\n    int64 id = 1;\n  }\n  Core inner"),
     "message demo.v1.SayRequest.Inner", "message removed or renamed", None),
    ("field removed", ("  int32 count = 2;\n", ""), "field demo.v1.SayRequest.count (2)", "field removed", None),
    ("field removed, only its number reserved", ("  int32 count = 2;\n", "  reserved 2;\n"), "field demo.v1.SayRequest.count (2)", "field removed", None),
    ("field renamed", ("int32 count = 2;", "int32 total = 2;"), "field demo.v1.SayRequest.count (2)", "renamed to total", "total = 2"),
    ("field number changed", ("int32 count = 2;", "int32 count = 11;"), "field demo.v1.SayRequest.count (2)", "number changed from 2 to 11", "count = 11"),
    ("scalar type changed", ("int32 count = 2;", "int64 count = 2;"), "field demo.v1.SayRequest.count (2)", "type changed from int32 to int64", "count = 2"),
    ("message type changed", ("Inner inner = 10;", "SayReply inner = 10;"), "field demo.v1.SayRequest.inner (10)", "type changed from demo.v1.SayRequest.Inner to demo.v1.SayReply", "inner = 10"),
    ("enum to int", ("Mood mood = 6;", "int32 mood = 6;"), "field demo.v1.SayRequest.mood (6)", "type changed from demo.v1.Mood to int32", "mood = 6"),
    ("map value type changed", ("map<string, string> labels", "map<string, int64> labels"), "field demo.v1.SayRequest.labels (8)",
     "type changed from map<string, string> to map<string, int64>", "labels = 8"),
    ("map key type changed", ("map<string, string> labels", "map<int32, string> labels"), "field demo.v1.SayRequest.labels (8)",
     "type changed from map<string, string> to map<int32, string>", "labels = 8"),
    ("map to repeated entries", ("map<string, string> labels = 8;", "repeated string labels = 8;"), "field demo.v1.SayRequest.labels (8)",
     "cardinality changed from map to repeated", "labels = 8"),
    ("singular to repeated", ("string text = 1;\n  int32", "repeated string text = 1;\n  int32"), "field demo.v1.SayRequest.text (1)",
     "cardinality changed from singular to repeated", "repeated string text"),
    ("repeated to singular", ("repeated string tags = 3;", "string tags = 3;"), "field demo.v1.SayRequest.tags (3)", "cardinality changed from repeated to singular", "tags = 3"),
    ("explicit presence dropped", ("optional float temperature = 7;", "float temperature = 7;"), "field demo.v1.SayRequest.temperature (7)",
     "cardinality changed from optional to singular", "temperature = 7"),
    ("explicit presence added", ("int32 count = 2;", "optional int32 count = 2;"), "field demo.v1.SayRequest.count (2)", "cardinality changed from singular to optional", "count = 2"),
    ("field moved out of its oneof", ("    string room = 5;\n  }\n", "  }\n  string room = 5;\n"), "field demo.v1.SayRequest.room (5)",
     "oneof membership changed from target to none", "room = 5"),
    ("field moved into a oneof", ("  int32 count = 2;\n  repeated string tags = 3;\n  oneof target {\n", "  repeated string tags = 3;\n  oneof target {\n    int32 count = 2;\n"),
     "field demo.v1.SayRequest.count (2)", "oneof membership changed from none to target", "count = 2"),
    ("enum removed", ("enum Spin {\n  SPIN_UNSPECIFIED = 0;\n}\n", ""), "enum demo.v1.Spin", "enum removed or renamed", None),
    ("enum value removed", ("  MOOD_SAD = 2;\n", ""), "enum value demo.v1.Mood.MOOD_SAD (2)", "enum value removed", None),
    ("enum value renamed", ("MOOD_SAD = 2;", "MOOD_GLUM = 2;"), "enum value demo.v1.Mood.MOOD_SAD (2)", "renamed to MOOD_GLUM", "MOOD_GLUM"),
    ("enum value number changed", ("MOOD_SAD = 2;", "MOOD_SAD = 3;"), "enum value demo.v1.Mood.MOOD_SAD (2)", "number changed from 2 to 3", "MOOD_SAD = 3"),
    ("reserved field number reused", ("reserved 9, 20 to 22;", "reserved 9;\n  bool again = 21;"), "field demo.v1.SayRequest.again (21)",
     "reuses number 21, reserved in the release", "again = 21"),
    ("reserved field name reused", ("reserved \"old\";", "string old = 12;"), "field demo.v1.SayRequest.old (12)",
     "reuses name old, reserved in the release", "old = 12"),
    ("reserved enum number reused", ("MOOD_SAD = 2;\n  reserved 7;", "MOOD_SAD = 2;\n  MOOD_CALM = 7;"), "enum value demo.v1.Mood.MOOD_CALM (7)",
     "reuses number 7, reserved in the release", "MOOD_CALM"),
    ("reserved enum name reused", ("MOOD_SAD = 2;\n  reserved 7;\n  reserved \"MOOD_ANGRY\";", "MOOD_SAD = 2;\n  MOOD_ANGRY = 8;\n  reserved 7;"),
     "enum value demo.v1.Mood.MOOD_ANGRY (8)", "reuses name MOOD_ANGRY, reserved in the release", "MOOD_ANGRY = 8"),
]


@pytest.mark.parametrize(("rule", "edit", "element", "change", "new_line"), BREAKING, ids=[case[0] for case in BREAKING])
def test_each_breaking_change_is_flagged_where_it_is(
    tmp_path: Path, rule: str, edit: tuple[str, str], element: str, change: str, new_line: str | None
) -> None:
    new_text = _edit(*edit)
    breaks = _breaks(tmp_path, new_text)
    hits = [b for b in breaks if f": {element}: " in b and change in b]
    assert hits, f"{rule}: not flagged; got {breaks}"
    if new_line is None:
        # A removal points at the element's line in the release.
        assert hits[0].startswith(f"{FILE}:") and " (release): " in hits[0], hits[0]
    else:
        assert hits[0].startswith(f"{FILE}:{_line_of(new_text, new_line)}:"), hits[0]


def test_removal_points_at_the_release_line(tmp_path: Path) -> None:
    [only] = _breaks(tmp_path, _edit("  int32 count = 2;\n", ""))
    assert only.startswith(f"{FILE}:{_line_of(BASE, 'int32 count = 2')}:3 (release): field demo.v1.SayRequest.count (2)")


ADDITIVE = [
    ("field added", ("  Inner inner = 10;\n", "  Inner inner = 10;\n  string extra = 11;\n  repeated int64 more = 12;\n  map<string, double> metrics = 13;\n")),
    ("field added to a oneof", ("    string room = 5;\n", "    string room = 5;\n    string team = 14;\n")),
    ("message added", ("message Unused {", "message Added {\n  int32 n = 1;\n}\n\nmessage Unused {")),
    ("nested message added", ("  message Inner {", "  message Extra {\n    bool on = 1;\n  }\n  message Inner {")),
    ("method added", ("  rpc Watch(", "  rpc Count(SayRequest) returns (stream SayReply);\n  rpc Watch(")),
    ("service added", ("service Spare {", "service More {\n  rpc Go(SayReply) returns (SayReply);\n}\n\nservice Spare {")),
    ("enum value added", ("MOOD_SAD = 2;", "MOOD_SAD = 2;\n  MOOD_CALM = 3;")),
    ("enum added", ("enum Spin {", "enum Color {\n  COLOR_UNSPECIFIED = 0;\n}\n\nenum Spin {")),
    ("field retired with its number and name reserved", ("  int32 count = 2;\n", "  reserved 2;\n  reserved \"count\";\n")),
    ("enum value retired with its number and name reserved", ("  MOOD_SAD = 2;\n", "  reserved 2;\n  reserved \"MOOD_SAD\";\n")),
    ("comments and layout changed", ("  string text = 1;\n  int32", "  // What to say.\n  string   text = 1;   // trailing\n\n  int32")),
    ("more reserved", ("reserved \"old\";", "reserved \"old\", \"older\";\n  reserved 30;")),
]


@pytest.mark.parametrize(("rule", "edit"), ADDITIVE, ids=[case[0] for case in ADDITIVE])
def test_additive_changes_pass(tmp_path: Path, rule: str, edit: tuple[str, str]) -> None:
    assert _breaks(tmp_path, _edit(*edit)) == []


def test_all_additive_changes_at_once_pass(tmp_path: Path) -> None:
    text = BASE
    for _, (old, new) in ADDITIVE[:8]:
        text = _edit(old, new, text)
    assert _breaks(tmp_path, text) == []


def test_identical_protos_pass(tmp_path: Path) -> None:
    assert _breaks(tmp_path, BASE) == []


def test_a_removed_map_field_is_one_break(tmp_path: Path) -> None:
    # Its entry message goes with it; that is not reported separately.
    breaks = _breaks(tmp_path, _edit("  map<string, string> labels = 8;\n", ""))
    assert len(breaks) == 1 and ": field demo.v1.SayRequest.labels (8): field removed" in breaks[0]


@pytest.mark.parametrize("edit", [("optional float temperature = 7;", "float temperature = 7;"), ("int32 count = 2;", "optional int32 count = 2;")])
def test_a_change_of_explicit_presence_is_one_break(tmp_path: Path, edit: tuple[str, str]) -> None:
    # proto3 `optional` is a synthetic oneof in the descriptor: it is presence (cardinality),
    # not a oneof the field joined or left.
    [only] = _breaks(tmp_path, _edit(*edit))
    assert "cardinality changed" in only


def test_several_breaks_are_all_reported(tmp_path: Path) -> None:
    text = _edit("int32 count = 2;", "int64 count = 2;")
    text = _edit("MOOD_SAD = 2;", "MOOD_GLUM = 2;", text)
    text = _edit("returns (stream SayReply)", "returns (SayReply)", text)
    assert len(_breaks(tmp_path, text)) == 3


# ---------------------------------------------------------------- releases


def test_latest_release_is_the_highest_version(tmp_path: Path) -> None:
    for name in ("v0.9.0.binpb", "v0.10.0.binpb", "v0.2.1.binpb", "notes.binpb", "v1.0.binpb"):
        (tmp_path / name).write_bytes(b"")
    assert [p.name for p in proto_compat.release_files(tmp_path)] == ["v0.2.1.binpb", "v0.9.0.binpb", "v0.10.0.binpb"]
    assert proto_compat.latest_release(tmp_path).name == "v0.10.0.binpb"
    with pytest.raises(FileNotFoundError):
        proto_compat.latest_release(tmp_path / "none")


def test_committed_release_holds_the_whole_api() -> None:
    release = proto_compat.load_release(proto_compat.latest_release())
    names = {f.name for f in release.file}
    assert {f"meridian/v1/{s}.proto" for s in ("common", "envsandbox", "rollout", "trainer", "weightsync")} <= names
    services = {s.name for f in release.file for s in f.service}
    assert services == {"EnvSandbox", "Rollout", "Trainer", "WeightSync"}
    # Source info is kept so a removal can point at its line in the release.
    assert all(f.source_code_info.location for f in release.file)


def test_current_protos_keep_the_last_release_compatible() -> None:
    # `make test` fails here on a breaking change to protos/meridian/v1 (see meridian/proto_compat.py).
    release, breaks = proto_compat.check_current()
    assert not breaks, f"breaking changes against {release.name}:\n" + "\n".join(map(str, breaks))


def test_check_reports_a_break_in_the_real_protos(tmp_path: Path) -> None:
    # The same check on a copy of the current protos with one field retyped: the guard is live.
    root = tmp_path / "protos"
    for rel in protogen.proto_files():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text((protogen.PROTO_ROOT / rel).read_text())
    target = root / "meridian/v1/rollout.proto"
    target.write_text(_edit("bool publish = 5;", "string publish = 5;", target.read_text()))
    new = protogen.descriptor_set(root, protogen.proto_files())
    breaks = proto_compat.breaking_changes(proto_compat.load_release(proto_compat.latest_release()), new)
    assert [b.element for b in breaks] == ["field meridian.v1.RunEpisodesRequest.publish (5)"]
    assert breaks[0].location.startswith("meridian/v1/rollout.proto:")


def test_release_v0_1_0_is_the_protos_of_6e8f3a4() -> None:
    # The recorded release is what `release v0.1.0 --ref 6e8f3a4` makes (where the history is here).
    import subprocess

    if subprocess.run(["git", "cat-file", "-e", "6e8f3a4^{commit}"], cwd=protogen.REPO_ROOT, capture_output=True).returncode != 0:
        pytest.skip("commit 6e8f3a4 is not in this checkout's history")
    committed = proto_compat.load_release(proto_compat.RELEASES_DIR / "v0.1.0.binpb")
    assert proto_compat.descriptor_set_at("6e8f3a4") == committed
