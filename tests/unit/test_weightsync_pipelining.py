"""How Subscribe streams a version: consecutive chunks coalesced into messages of bounded
size, and on a relay only the chunks that have arrived (and passed their checksum), each
message sent as soon as there is something to send; the flow-control window options."""
from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import numpy as np
import pytest

from meridian.tensors import RawTensor
from meridian.v1 import weightsync_pb2 as pb
from services.weightsync.client import window_options
from services.weightsync.config import WeightSyncConfig
from services.weightsync.server import WeightSyncService
from services.weightsync.versions import Encoded, encode_version


def _version(n: int = 200_000, tensors: int = 24) -> Encoded:
    """A keyframe of ``tensors`` small tensors: one chunk each, of a few KiB."""
    rng = np.random.default_rng(0)
    weights = {
        f"t{i:02d}": RawTensor("bf16", (n // tensors,), (rng.normal(0, 0.02, n // tensors).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16))
        for i in range(tensors)
    }
    return encode_version(0, weights, None, -1, 1 << 22)


def _messages(items: list[bytes]) -> list[list[pb.ChunkData]]:
    parsed = [pb.WeightChunk.FromString(m) for m in items]
    return [list(m.batch.chunks) if m.HasField("batch") else [m.chunk] for m in parsed]


def test_chunks_are_coalesced_up_to_the_message_size(tmp_path: Path) -> None:
    enc = _version()
    sizes = [len(c) for c in enc.chunks]
    limit_kib = max(1, 3 * max(sizes) // 1024)
    service = WeightSyncService(WeightSyncConfig(data_dir=str(tmp_path), message_kib=limit_kib))

    async def main() -> list[bytes]:
        return [m async for m in service._send_chunks(enc, 2)]

    messages = _messages(asyncio.run(main()))
    assert [c.index for m in messages for c in m] == list(range(2, len(enc.chunks)))
    assert all(c.data == enc.chunks[c.index] for m in messages for c in m)
    assert 1 < len(messages) < len(enc.chunks) - 2
    assert all(sum(len(c.data) for c in m) <= limit_kib << 10 for m in messages)
    assert service.counters["chunks_sent"] == len(enc.chunks) - 2


def test_a_relay_sends_what_has_arrived_at_once(tmp_path: Path) -> None:
    """Cut-through: a message never waits to be filled, and holds only chunks that are here
    (a relay's incoming list grows only with chunks that passed their checksum)."""
    enc = _version()
    service = WeightSyncService(WeightSyncConfig(role="relay", upstream="127.0.0.1:1", data_dir=str(tmp_path), message_kib=1024))

    async def main() -> list[list[int]]:
        service._upstream_manifest(enc.manifest)
        incoming = service._incoming
        assert incoming is not None
        for i in range(3):
            service._upstream_chunk(enc.manifest, i, enc.chunks[i])
        stream = service._send_chunks(incoming, 0)
        got = [[c.index for c in m] for m in _messages([await anext(stream)])]
        # Nothing more has arrived: the stream waits instead of sending or ending.
        pending = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0.05)
        assert not pending.done()
        for i in range(3, 5):
            service._upstream_chunk(enc.manifest, i, enc.chunks[i])
        got += [[c.index for c in m] for m in _messages([await asyncio.wait_for(pending, 5)])]
        # A chunk out of order (not the next one) is never appended, so never sent.
        service._upstream_chunk(enc.manifest, 9, enc.chunks[9])
        assert len(incoming.chunks) == 5
        pending = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0.05)
        assert not pending.done()
        pending.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await pending
        await stream.aclose()
        return got

    assert asyncio.run(main()) == [[0, 1, 2], [3, 4]]


def test_window_options() -> None:
    assert window_options(0) == []
    assert dict(window_options(32 << 20)) == {"grpc.http2.bdp_probe": 0, "grpc.http2.lookahead_bytes": 32 << 20}


@pytest.mark.parametrize("kw", [{"message_kib": 0}, {"window_mib": -1.0}])
def test_config_refuses_bad_pipelining_settings(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        WeightSyncConfig(**kw)  # type: ignore[arg-type]
