"""Subscribe's chunk messages are framed by hand (one copy of the payloads instead of
three): byte for byte what protobuf serialises, over the edge cases of the wire format."""
from __future__ import annotations

import itertools
import os

import pytest

from meridian.v1 import weightsync_pb2 as pb
from services.weightsync.chunk_messages import serialize_response, weight_chunk_message


def _protobuf(version: int, first: int, payloads: list[bytes]) -> bytes:
    chunks = [pb.ChunkData(version=version, index=first + i, data=p) for i, p in enumerate(payloads)]
    message = pb.WeightChunk(chunk=chunks[0]) if len(chunks) == 1 else pb.WeightChunk(batch=pb.ChunkBatch(chunks=chunks))
    return message.SerializeToString()


@pytest.mark.parametrize("version", [0, 1, 127, 128, 300, 2**40, -1])
def test_hand_framed_messages_are_what_protobuf_writes(version: int) -> None:
    sizes = [0, 1, 127, 128, 5300, 70_000]
    for first, count in itertools.product([0, 1, 127, 16_383, 2**31], [1, 2, 3, 6]):
        payloads = [os.urandom(sizes[(first + i) % len(sizes)]) for i in range(count)]
        got = weight_chunk_message(version, first, payloads)
        assert got == _protobuf(version, first, payloads), (version, first, count)
        parsed = pb.WeightChunk.FromString(got)
        chunks = list(parsed.batch.chunks) if count > 1 else [parsed.chunk]
        assert [(c.version, c.index, c.data) for c in chunks] == [(version, first + i, p) for i, p in enumerate(payloads)]


def test_the_response_serialiser_passes_framed_bytes_and_serialises_the_rest() -> None:
    framed = weight_chunk_message(3, 4, [b"abc"])
    assert serialize_response(framed) is framed
    manifest = pb.WeightChunk(manifest=pb.Manifest(version=3))
    assert serialize_response(manifest) == manifest.SerializeToString()
    with pytest.raises(ValueError):
        weight_chunk_message(3, 4, [])
