"""docs/api.md is the reference generated from the .proto files (a .proto edit without
`make protos` fails here), and the renderer says what each .proto says, comments included."""
from __future__ import annotations

from pathlib import Path

import pytest

from meridian import api_reference, protogen

DEMO = """\
syntax = "proto3";
package demo.v1;

// A note about the whole file.

// Says things back.
service Echo {
  // One reply per request.
  rpc Say(SayRequest) returns (SayReply);
  rpc Upload(stream SayRequest) returns (stream SayReply);  // both ways streamed
}

// Moods a caller may be in.
enum Mood {
  MOOD_UNSPECIFIED = 0;
  MOOD_SAD = 2;  // not happy
  reserved 5 to 7;
}

// What to say.
message SayRequest {
  string text = 1;                 // what to say | verbatim, <raw>
  repeated int64 counts = 2;
  oneof target {
    string user = 3;
  }
  optional float temperature = 4;
  map<string, Mood> moods = 5;
  Inner inner = 6;
  reserved 9, 20 to 22;
  reserved "old";
  message Inner {
    bytes blob = 1;
  }
}

message SayReply {}
"""


@pytest.fixture(scope="module")
def demo_md(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("protos")
    (root / "demo/v1").mkdir(parents=True)
    (root / "demo/v1/demo.proto").write_text(DEMO)
    return api_reference.render(protogen.descriptor_set(root, [Path("demo/v1/demo.proto")]), prefix="demo/")


def test_committed_reference_is_up_to_date() -> None:
    # CI relies on this: edit a .proto without `make protos` and it fails here.
    assert api_reference.REFERENCE_PATH.exists(), "docs/api.md is missing (run `make protos`)"
    committed = api_reference.REFERENCE_PATH.read_text()
    assert committed == api_reference.generate(), "docs/api.md differs from protos/ (run `make protos`)"


def test_reference_covers_every_service_method_message_and_enum() -> None:
    text = api_reference.generate()
    files = protogen.descriptor_set()
    for f in files.file:
        for service in f.service:
            assert f"### service `meridian.v1.{service.name}`" in text
            for method in service.method:
                assert f"| `{method.name}` |" in text, method.name
        for message in f.message_type:
            assert f"### message `meridian.v1.{message.name}`" in text
        for enum in f.enum_type:
            assert f"### enum `meridian.v1.{enum.name}`" in text
    assert "stream [`GenerateChunk`](#meridian.v1.GenerateChunk)" in text
    assert "Streams generated tokens with their log-probs" in text  # a method's comment


def test_services_show_streaming_and_comments(demo_md: str) -> None:
    assert "Says things back." in demo_md
    assert "| `Say` | [`SayRequest`](#demo.v1.SayRequest) | [`SayReply`](#demo.v1.SayReply) | One reply per request. |" in demo_md
    assert "| `Upload` | stream [`SayRequest`](#demo.v1.SayRequest) | stream [`SayReply`](#demo.v1.SayReply) | both ways streamed |" in demo_md


def test_messages_show_numbers_types_cardinality_and_comments(demo_md: str) -> None:
    assert "What to say." in demo_md
    # Pipes and angle brackets in comments stay text in a Markdown table.
    assert "| `text` | 1 | `string` | singular | what to say \\| verbatim, &lt;raw&gt; |" in demo_md
    assert "| `counts` | 2 | `int64` | repeated |  |" in demo_md
    assert "| `user` | 3 | `string` | oneof `target` |  |" in demo_md
    assert "| `temperature` | 4 | `float` | optional |  |" in demo_md
    assert "| `moods` | 5 | map&lt;`string`, [`Mood`](#demo.v1.Mood)&gt; | map |  |" in demo_md
    assert "| `inner` | 6 | [`SayRequest.Inner`](#demo.v1.SayRequest.Inner) | singular |  |" in demo_md
    assert "Reserved (never to be reused): numbers 9, 20 to 22; names `old`." in demo_md
    assert "### message `demo.v1.SayRequest.Inner`" in demo_md
    assert "MoodsEntry" not in demo_md  # a map's entry type is shown as map<K, V>, not as a message
    assert "### message `demo.v1.SayReply`\n\nNo fields." in demo_md


def test_enums_show_values_numbers_and_comments(demo_md: str) -> None:
    assert "Moods a caller may be in." in demo_md
    assert "| `MOOD_SAD` | 2 | not happy |" in demo_md
    assert "Reserved (never to be reused): numbers 5 to 7." in demo_md


def test_detached_comments_are_kept(demo_md: str) -> None:
    assert "A note about the whole file." in demo_md


def test_check_mode_reports_a_stale_file(tmp_path: Path) -> None:
    stale = tmp_path / "api.md"
    stale.write_text("old\n")
    assert api_reference.main(["--out", str(stale), "--check"]) == 1
    assert api_reference.main(["--out", str(stale)]) == 0
    assert api_reference.main(["--out", str(stale), "--check"]) == 0
