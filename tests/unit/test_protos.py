"""The committed meridian.v1 stubs match protos/, and the main messages round-trip."""
from __future__ import annotations

import math

import pytest

from meridian import protogen
from meridian.v1 import common_pb2, envsandbox_pb2, weightsync_pb2

COMMITTED = protogen.REPO_ROOT / protogen.PROTO_PACKAGE


# ---------------------------------------------------------------- drift check


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    out = tmp_path_factory.mktemp("protogen")
    files = protogen.generate(out)
    return {p.name: p.read_bytes() for p in files}


def test_generate_writes_three_files_per_proto(generated: dict[str, bytes]) -> None:
    stems = {p.stem for p in protogen.proto_files()}
    assert stems, "no .proto files found under protos/meridian/v1"
    want = {f"{s}{suffix}" for s in stems for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")}
    assert set(generated) == want


def test_committed_stubs_are_up_to_date(generated: dict[str, bytes]) -> None:
    # CI relies on this: edit a .proto without `make protos` and it fails here.
    stale = [name for name, content in sorted(generated.items()) if (COMMITTED / name).read_bytes() != content]
    assert not stale, f"stubs differ from protos/ (run `python -m meridian.protogen`): {stale}"


def test_no_orphan_committed_stubs(generated: dict[str, bytes]) -> None:
    # A stub whose .proto was deleted would otherwise linger, importable but unmaintained.
    committed = {p.name for p in COMMITTED.glob("*_pb2*.py*")}
    assert committed == set(generated)


# ---------------------------------------------------------------- round trips


def _full_trajectory() -> common_pb2.Trajectory:
    return common_pb2.Trajectory(
        trajectory_id="traj-1",
        task_id="python/add",
        group_id="group-7",
        group_size=4,
        prompt_token_ids=[1, 2, 3, 2**31 - 1],
        completion_token_ids=[10, 11, 12],
        logprobs=[-0.5, 0.0, -1.25],  # exactly representable in float32
        loss_mask=[1, 0, 1],
        policy_versions=[3, -1, 2**40],
        reward=0.75,
        truncated=True,
        finish_reason="length",
        timings=common_pb2.Timings(generate_s=1.5, sandbox_s=0.25, total_s=2.0, created_unix=1.7e9),
        trace_context={"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "tracestate": "k=v"},
        model="tiny",
        region="b",
    )


def test_trajectory_round_trip_keeps_every_field() -> None:
    traj = _full_trajectory()
    back = common_pb2.Trajectory.FromString(traj.SerializeToString())
    assert back == traj
    # Spot-check the fields whose encoding is least trivial.
    assert dict(back.trace_context) == dict(traj.trace_context)
    assert list(back.policy_versions) == [3, -1, 2**40]
    assert list(back.logprobs) == [-0.5, 0.0, -1.25]
    assert list(back.loss_mask) == [1, 0, 1]
    assert back.timings.created_unix == 1.7e9
    assert back.HasField("timings")
    # Every declared field was set, so this also catches a field added without a test.
    set_fields = {fd.name for fd, _ in back.ListFields()}
    assert set_fields == {fd.name for fd in common_pb2.Trajectory.DESCRIPTOR.fields}


def test_trajectory_float32_precision_of_logprobs() -> None:
    # logprobs are float32 on the wire: values survive to float32 precision only.
    traj = common_pb2.Trajectory(logprobs=[-0.1])
    back = common_pb2.Trajectory.FromString(traj.SerializeToString())
    assert math.isclose(back.logprobs[0], -0.1, rel_tol=1e-7)


def test_empty_trajectory_round_trip() -> None:
    empty = common_pb2.Trajectory()
    assert empty.SerializeToString() == b""
    assert common_pb2.Trajectory.FromString(b"") == empty


def test_manifest_round_trip() -> None:
    manifest = weightsync_pb2.Manifest(
        version=5,
        base_version=4,
        tensors=[
            weightsync_pb2.TensorMeta(name="a.weight", dtype=weightsync_pb2.DTYPE_BF16, shape=[2, 3]),
            weightsync_pb2.TensorMeta(name="b.bias", dtype=weightsync_pb2.DTYPE_FP32, shape=[]),
        ],
        chunks=[
            weightsync_pb2.ChunkRef(index=0, tensor="a.weight", size=12, sha256="ab" * 32),
            weightsync_pb2.ChunkRef(index=1, tensor="b.bias", size=4, sha256="cd" * 32),
        ],
        weights_hash="ef" * 32,
        codec="meridian-ctx-rice-v1",
        raw_bytes=16,
        encoded_bytes=16,
        trace_context={"traceparent": "00-abc-def-01"},
        signature=weightsync_pb2.VersionSignature(content_sha256="01" * 32, key_id="23" * 32, signature=bytes(range(64))),
    )
    back = weightsync_pb2.Manifest.FromString(manifest.SerializeToString())
    assert back == manifest
    assert back.signature.signature == bytes(range(64))
    assert [t.name for t in back.tensors] == ["a.weight", "b.bias"]
    assert list(back.tensors[0].shape) == [2, 3]
    assert back.base_version == 4


def test_keyframe_manifest_keeps_negative_base_version() -> None:
    back = weightsync_pb2.Manifest.FromString(weightsync_pb2.Manifest(version=0, base_version=-1).SerializeToString())
    assert back.base_version == -1


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("stdout", b"out\x00\xff"),
        ("stderr", b"err"),
        ("result", envsandbox_pb2.ExecResult(exit_code=-1, signal=9, timed_out=True, wall_seconds=0.5)),
    ],
)
def test_exec_chunk_oneof_round_trip(field: str, value: object) -> None:
    if field == "result":
        chunk = envsandbox_pb2.ExecChunk(result=value)
    else:
        chunk = envsandbox_pb2.ExecChunk(**{field: value})
    back = envsandbox_pb2.ExecChunk.FromString(chunk.SerializeToString())
    assert back.WhichOneof("payload") == field
    assert getattr(back, field) == value


def test_exec_chunk_oneof_last_assignment_wins() -> None:
    chunk = envsandbox_pb2.ExecChunk(stdout=b"x")
    chunk.result.exit_code = 3
    assert chunk.WhichOneof("payload") == "result"
    assert not chunk.HasField("stdout")
    back = envsandbox_pb2.ExecChunk.FromString(chunk.SerializeToString())
    assert back.WhichOneof("payload") == "result"
    assert back.result.exit_code == 3


def test_exec_chunk_empty_stdout_is_still_set() -> None:
    # An empty bytes member of a oneof is still "set" and survives the wire.
    back = envsandbox_pb2.ExecChunk.FromString(envsandbox_pb2.ExecChunk(stdout=b"").SerializeToString())
    assert back.WhichOneof("payload") == "stdout"
