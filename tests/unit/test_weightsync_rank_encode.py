"""Rank-side encoding of a sharded publish: each rank encodes its part against its part of
the version before (``parts.PartEncoder``) and sends chunk payloads; the origin decodes them
onto its copy (``versions.decode_tensors``), checks them against the part hash and stores
the same bytes it would have encoded itself. A part it cannot take that way (another base,
other chunks, content that is not the part's) is refused with FAILED_PRECONDITION without
spoiling the other parts, and the rank sends it raw."""
from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import numpy as np
import pytest

from meridian import elementhash
from meridian.grpc_runtime import open_channel
from meridian.tensors import RawTensor
from meridian.v1 import weightsync_pb2 as pb
from meridian.v1 import weightsync_pb2_grpc as pb_grpc
from services.weightsync import client as weightsync
from services.weightsync import codec, parts
from services.weightsync.server import WeightSyncService
from services.weightsync.versions import Carried, Spare, decode_tensors, encode_tensors
from tests.conftest import serving
from tests.unit.test_weightsync_index_carry import CHUNK_BYTES, _versions
from tests.unit.test_weightsync_parts import _config, _header, _record_publish_errors, _split, _store_files, _until

Weights = dict[str, RawTensor]


# ---------------------------------------------------------------- the core


def _fingerprints(indexes: list[codec.ChunkIndex | None]) -> list[tuple[int, int, int] | None]:
    return [(i.start, i.threshold, i.fingerprint) if i is not None else None for i in indexes]


def test_decoding_a_ranks_payloads_gives_its_tensors_and_what_encoding_them_here_would_leave() -> None:
    versions = _versions(6)
    rank, origin = Carried(), Carried()
    for v in range(1, len(versions)):
        sent = encode_tensors(versions[v], versions[v - 1], CHUNK_BYTES, rank, threads=2)
        here = encode_tensors(versions[v], versions[v - 1], CHUNK_BYTES, origin)
        got = decode_tensors(sent.payloads, versions[v - 1], CHUNK_BYTES, origin, threads=2)
        assert sent.payloads == here.payloads, "a rank encodes what the origin would"
        for name, t in versions[v].items():
            assert np.array_equal(got.weights[name].bits, t.bits), f"version {v} {name}"
        assert got.encoded.payloads == sent.payloads and got.encoded.sha256 == here.sha256
        if v > 1:  # the first delta's payloads may need no index; the origin then builds it when one does
            for name, indexes in here.carried.indexes.items():
                assert _fingerprints(got.encoded.carried.indexes[name]) == _fingerprints(indexes), f"version {v} {name}"
            full = elementhash.many_tensor_sums([versions[v][n].bits for n in sorted(versions[v])])
            assert got.encoded.carried.sums == dict(zip(sorted(versions[v]), full)), "sums moved by the changes, not a pass"
        rank, origin = sent.carried, got.encoded.carried
        if v == 1:  # from here on the base's sums are known on both sides
            base_sums = dict(zip(sorted(versions[v]), elementhash.many_tensor_sums([versions[v][n].bits for n in sorted(versions[v])])))
            rank.sums, origin.sums = dict(base_sums), dict(base_sums)
    assert not np.array_equal(versions[-1]["emb"].bits, versions[-2]["emb"].bits)


def test_payloads_cut_otherwise_or_coded_on_another_base_are_refused() -> None:
    versions = _versions(3)
    sent = encode_tensors(versions[1], versions[0], CHUNK_BYTES)
    with pytest.raises(codec.CodecError, match="chunks"):
        decode_tensors(sent.payloads, versions[0], CHUNK_BYTES * 2)
    with pytest.raises(codec.CodecError, match="not in the base"):
        decode_tensors({"other": sent.payloads["emb"]}, versions[0], CHUNK_BYTES)
    swapped = dict(sent.payloads, emb=sent.payloads["emb"][::-1])
    with pytest.raises(codec.CodecError, match="chunk 0"):
        decode_tensors(swapped, versions[0], CHUNK_BYTES)
    # Coded against version 0, decoded on version 1: the index or the values do not fit.
    later = encode_tensors(versions[2], versions[1], CHUNK_BYTES)
    try:
        wrong = decode_tensors(later.payloads, versions[0], CHUNK_BYTES)
    except codec.CodecError:
        return
    assert any(not np.array_equal(wrong.weights[n].bits, versions[2][n].bits) for n in versions[2])


# ---------------------------------------------------------------- the origin


async def _status(address: str) -> pb.WeightSyncStatus:
    async with open_channel(address) as channel:
        return await pb_grpc.WeightSyncStub(channel).Status(pb.WeightSyncStatusRequest())


async def _publish_encoded(address: str, version: int, weights: Weights, encoders: list[parts.PartEncoder]) -> None:
    header = _header(version, weights)
    split = _split(weights, len(encoders))
    await asyncio.gather(*(weightsync.publish_part(address, header, i, len(encoders), split[i], enc) for i, enc in enumerate(encoders)))


def test_ranks_that_encode_their_parts_store_exactly_what_one_publish_stores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    versions = _versions(5, seed=4)
    # From the third version on the origin decodes into the buffers of the version before
    # the base, made the base by replaying its changes (no copy of the base): count them.
    given: list[str] = []
    buffer = Spare.buffer

    def counted(self: Spare, name: str, base: RawTensor) -> np.ndarray | None:
        got = buffer(self, name, base)
        if got is not None:
            given.append(name)
        return got

    monkeypatch.setattr(Spare, "buffer", counted)

    async def body() -> None:
        async with serving(WeightSyncService(_config(tmp_path / "single"))) as single:
            for v, w in enumerate(versions):
                await weightsync.publish(single, v, w)
        encoders = [parts.PartEncoder(threads=2) for _ in range(3)]
        async with serving(WeightSyncService(_config(tmp_path / "parted"))) as parted:
            for v, w in enumerate(versions):
                await _publish_encoded(parted, v, w, encoders)
                assert [e.last_encoded for e in encoders] == [v > 0] * 3, f"version {v}"
            status = await _status(parted)
            assert (status.encoded_parts, status.encoded_parts_refused) == (3 * (len(versions) - 1), 0)
            assert sorted(given) == sorted(list(versions[0]) * (len(versions) - 2)), "every tensor into a spare buffer from version 2 on"

    asyncio.run(body())
    single, parted = _store_files(tmp_path / "single"), _store_files(tmp_path / "parted")
    assert any("delta" in name for name in single) and single.keys() == parted.keys()
    for name in single:
        assert single[name] == parted[name], f"{name} differs"


def test_a_part_coded_on_another_base_is_refused_alone_and_sent_raw(tmp_path: Path) -> None:
    versions = _versions(3, seed=4)

    async def body() -> None:
        async with serving(WeightSyncService(_config(tmp_path / "single"))) as single:
            for v, w in enumerate(versions):
                await weightsync.publish(single, v, w)
        encoders = [parts.PartEncoder() for _ in range(2)]
        async with serving(WeightSyncService(_config(tmp_path / "parted"))) as parted:
            await _publish_encoded(parted, 0, versions[0], encoders)
            await _publish_encoded(parted, 1, versions[1], encoders)
            # Sabotage: rank 1's copy of its base drifts by one element (a rank that missed
            # an update, or a bug): what it encodes decodes, at the origin, to other tensors.
            name = sorted(encoders[1].base)[0]
            drifted = encoders[1].base[name].bits.copy()
            drifted[7] ^= np.uint16(1)
            encoders[1].base[name] = RawTensor("bf16", drifted.shape, drifted)
            await _publish_encoded(parted, 2, versions[2], encoders)
            assert [e.last_encoded for e in encoders] == [True, False], "rank 1's part went raw after the refusal"
            status = await _status(parted)
            assert (status.encoded_parts, status.encoded_parts_refused) == (3, 1)

    asyncio.run(body())
    assert _store_files(tmp_path / "single") == _store_files(tmp_path / "parted")


def test_an_encoded_part_refused_as_busy_keeps_its_base_and_goes_encoded_when_taken(tmp_path: Path) -> None:
    """A busy origin (another version's parts being assembled: here a lagging rank's
    retry of a version the trainer gave up) is not a refusal of the encoding: the part
    waits and goes encoded, the rank keeping its base (before, the busy answer was
    FAILED_PRECONDITION: the rank dropped its base, sent the part raw and was refused again)."""
    versions = _versions(3, seed=5)

    async def body() -> None:
        service = WeightSyncService(_config(tmp_path / "o", part_timeout_s=60.0))
        errors = _record_publish_errors(service)
        encoders = [parts.PartEncoder() for _ in range(2)]
        async with serving(service) as address:
            await _publish_encoded(address, 0, versions[0], encoders)
            stale = asyncio.create_task(weightsync.publish_part(address, _header(1, versions[1]), 1, 2, _split(versions[1], 2)[1]))
            await _until(lambda: service._pending is not None, "the lagging rank's version 1 being assembled")
            header2, split2 = _header(2, versions[2]), _split(versions[2], 2)
            rank0 = asyncio.create_task(weightsync.publish_part(address, header2, 0, 2, split2[0], encoders[0]))
            await _until(lambda: bool(errors), "rank 0's part refused while version 1 is assembled")
            assert "version 1 is being assembled" in str(errors[0]) and encoders[0].base_version == 0
            # Version 1 ends (a part with other version fields aborts it): rank 0's part gets in.
            other = _header(1, versions[2])
            with pytest.raises(grpc.aio.AioRpcError) as odd:
                await weightsync.publish_part(address, other, 0, 2, _split(versions[2], 2)[0], busy_timeout_s=0)
            assert odd.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(grpc.aio.AioRpcError) as gone:
                await stale
            assert gone.value.code() == grpc.StatusCode.ABORTED and not weightsync.origin_busy(gone.value)
            rank1 = await weightsync.publish_part(address, header2, 1, 2, split2[1], encoders[1])
            assert rank1 == await asyncio.wait_for(rank0, 30) and rank1.version == 2
            assert [e.last_encoded for e in encoders] == [True, True] and [e.base_version for e in encoders] == [2, 2]
            status = await _status(address)
            assert (status.latest_version, status.encoded_parts, status.encoded_parts_refused) == (2, 2, 0)

    asyncio.run(body())


async def _send(address: str, requests: list[pb.PublishRequest]) -> pb.PublishResponse:
    async with open_channel(address) as channel:
        return await pb_grpc.WeightSyncStub(channel).Publish(iter(requests))


def test_forged_or_malformed_encoded_parts_are_refused_and_lose_nothing(tmp_path: Path) -> None:
    versions = _versions(3, seed=4)
    header = _header(1, versions[1])
    split = [_split(v, 2) for v in versions]

    def part_requests(
        index: int, payloads: dict[str, list[bytes]], base_version: int = 0, chunk_bytes: int = 0, message_bytes: int = 1 << 20
    ) -> list[pb.PublishRequest]:
        coded = parts.part_header(header, index, 2, split[1][index])
        coded.part_encoded, coded.part_base_version = True, base_version
        coded.part_chunk_bytes = chunk_bytes or int(0.002 * (1 << 20))
        return list(weightsync.encoded_part_requests(coded, split[1][index], payloads, message_bytes))

    def encoded(index: int, new: Weights) -> dict[str, list[bytes]]:
        return encode_tensors(new, split[0][index], int(0.002 * (1 << 20))).payloads

    async def body() -> None:
        async with serving(WeightSyncService(_config(tmp_path / "o"))) as address:
            await weightsync.publish(address, 0, versions[0])
            refusals = []
            # Forged: part 0's header hashes version 1's tensors, its chunks decode to version 2's.
            forged = encoded(0, {n: versions[2][n] for n in split[1][0]})
            for requests in (part_requests(0, forged), part_requests(0, encoded(0, split[1][0]), base_version=5),
                             part_requests(0, encoded(0, split[1][0]), chunk_bytes=4096)):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await _send(address, requests)
                refusals.append(refused.value)
            assert all(r.code() == grpc.StatusCode.FAILED_PRECONDITION and "send the part raw" in (r.details() or "") for r in refusals)
            assert "hash" in (refusals[0].details() or "") and "coded against version 5" in (refusals[1].details() or "")
            assert "chunks of 4096" in (refusals[2].details() or "")
            # A raw piece in an encoded part's stream, and a tensor with a chunk too many:
            # malformed streams, refused as such.
            mixed = part_requests(1, encoded(1, split[1][1]))
            mixed.insert(2, pb.PublishRequest(piece=pb.TensorPiece(offset=0, data=b"\0\0")))
            name = sorted(split[1][1])[0]
            extra = encoded(1, split[1][1])
            extra[name] = [*extra[name], extra[name][-1]]
            # ... and a chunk payload larger than any chunk of the origin's size can be
            # (refused as it arrives, before it is held or decoded).
            oversized = encoded(1, split[1][1])
            oversized[name] = [oversized[name][0] + bytes(int(0.002 * (1 << 20)) + (4 << 10)), *oversized[name][1:]]
            for requests in (mixed, part_requests(1, extra), part_requests(1, oversized)):
                with pytest.raises(grpc.aio.AioRpcError) as bad:
                    await _send(address, requests)
                assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT, bad.value.details()
            assert "more than a chunk of" in (bad.value.details() or "")
            assert await weightsync.latest_version(address) == 0, "nothing refused was stored"
            # The version still goes in whole: both parts, honest and encoded (part 0 one
            # chunk per message, part 1 each tensor's chunks in one).
            honest = [part_requests(0, encoded(0, split[1][0]), message_bytes=1), part_requests(1, encoded(1, split[1][1]))]
            assert len(honest[0]) - 1 == sum(len(p) for p in encoded(0, split[1][0]).values()) and len(honest[1]) - 1 == len(split[1][1])
            await asyncio.gather(*(_send(address, requests) for requests in honest))
            assert await weightsync.latest_version(address) == 1
            got = await weightsync.manifest(address, 1)
            assert got.weights_hash == header.weights_hash
            status = await _status(address)
            assert (status.encoded_parts, status.encoded_parts_refused) == (2, 3)

    asyncio.run(body())
