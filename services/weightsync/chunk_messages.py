"""Subscribe's chunk messages, serialised by hand from the chunk payloads.

Every child of an origin or relay gets the same payloads. Built as protobuf objects, each
message copies every payload into a ``ChunkData``, again into the ``ChunkBatch``, and once
more when serialised, per child: about 0.5 ns per byte for 64 KiB messages and 2.6 ns for
1 MiB ones of ~5 KB chunks (the batch copy grows worse than linearly), which at a 1T
model's 2.6 GB per child and version was the largest cost on the sender's event loop. The
wire format of these messages is short to frame directly, with one copy of the payloads
(``bytes.join``), byte for byte what ``SerializeToString`` writes; a test checks that.
"""
from __future__ import annotations

from collections.abc import Sequence

from services.weightsync.codec.format import _uv_encode

# Field keys (field number << 3 | wire type) of weightsync.proto.
_CHUNK_DATA_VERSION = b"\x08"  # ChunkData.version, varint
_CHUNK_DATA_INDEX = b"\x10"  # ChunkData.index, varint
_CHUNK_DATA_DATA = b"\x1a"  # ChunkData.data, bytes
_BATCH_CHUNKS = b"\x0a"  # ChunkBatch.chunks, message
_WEIGHT_CHUNK_CHUNK = b"\x12"  # WeightChunk.chunk, message
_WEIGHT_CHUNK_BATCH = b"\x1a"  # WeightChunk.batch, message

_MASK64 = (1 << 64) - 1

# Lengths and indexes below 2**14 (two bytes) are most of what a message frames.
_SMALL = [_uv_encode(n) for n in range(1 << 14)]


def _varint(value: int) -> bytes:
    """A protobuf varint (the codec's LEB128); negative values as their 64-bit two's
    complement (int64)."""
    return _SMALL[value] if 0 <= value < 1 << 14 else _uv_encode(value & _MASK64)


def weight_chunk_message(version: int, first: int, payloads: Sequence[bytes]) -> bytes:
    """The serialised ``WeightChunk`` carrying chunks ``first``, ``first + 1``, ... of
    ``version`` with ``payloads``: one chunk in its ``chunk`` field, several in a ``batch``
    (what the server's Subscribe streams). Proto3 leaves zero fields out, and so does this."""
    if not payloads:
        raise ValueError("a chunk message carries at least one chunk")
    head = _CHUNK_DATA_VERSION + _varint(version) if version else b""
    key = _WEIGHT_CHUNK_CHUNK if len(payloads) == 1 else _BATCH_CHUNKS
    pieces: list[bytes] = []
    total = 0
    for index, payload in enumerate(payloads, first):
        # Everything of the chunk but its payload in one small bytes: one piece to join.
        fields = head + (_CHUNK_DATA_INDEX + _varint(index) if index else b"") + (_CHUNK_DATA_DATA + _varint(len(payload)) if payload else b"")
        lead = key + _varint(len(fields) + len(payload)) + fields
        pieces += (lead, payload)
        total += len(lead) + len(payload)
    if len(payloads) == 1:
        return b"".join(pieces)
    return b"".join([_WEIGHT_CHUNK_BATCH, _varint(total), *pieces])


def serialize_response(message: object) -> bytes:
    """Subscribe's response serialiser: messages serialised here already pass as they are,
    the others (manifests) through protobuf."""
    if isinstance(message, bytes):
        return message
    return message.SerializeToString()  # type: ignore[attr-defined]
