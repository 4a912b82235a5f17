"""Weightsync over real gRPC servers and the emulated WAN link (meridian/link_emulator.py):
resume after a cut, a corrupted chunk fetched again (and its refetch checked again),
chunks out of order refused, late joiners each caught up from their own version, relay
fan-out (forwarding only verified chunks, re-serving a version still arriving only to
holders of its base), an origin restarted with SIGKILL, and the send and upstream caps."""
from __future__ import annotations

import asyncio
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest

from meridian.errors import DataLoss
from meridian.grpc_runtime import check_health
from meridian.v1 import weightsync_pb2 as pb
from meridian.v1 import weightsync_pb2_grpc as pb_grpc
from services.weightsync import client, codec
from services.weightsync.client import VersionUpdate, WeightSubscriber
from services.weightsync.config import WeightSyncConfig
from meridian.link_emulator import LinkEmulator
from services.weightsync.server import WeightSyncService
from services.weightsync.versions import encode_version
from meridian.tensors import RawTensor
from tests.synthetic_weights import bf16_weights, chain, same, stepped

T = TypeVar("T")
Weights = dict[str, RawTensor]
REPO = Path(__file__).resolve().parents[2]


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def _service(tmp_path: Path, name: str = "origin", **kw: Any) -> WeightSyncService:
    kw.setdefault("chunk_mb", 1 / 64)  # 16 KiB chunks: every version spans many
    return WeightSyncService(WeightSyncConfig(data_dir=str(tmp_path / name), **kw))


async def _status(address: str) -> pb.WeightSyncStatus:
    async with grpc.aio.insecure_channel(address) as channel:
        return await pb_grpc.WeightSyncStub(channel).Status(pb.WeightSyncStatusRequest(), timeout=10)


async def _wait_for(cond: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def _collect(sub: WeightSubscriber, count: int, follow: bool = True) -> list[VersionUpdate]:
    out = []
    stream = sub.updates(follow=follow)
    try:
        async for update in stream:
            out.append(update)
            if len(out) == count:
                break
    finally:
        await stream.aclose()
    return out


# ---------------------------------------------------------------- cut, corruption


def test_cut_mid_transfer_resumes_from_last_good_chunk(tmp_path: Path, grpc_serving: Any) -> None:
    v0 = bf16_weights(0, 1_500_000)

    async def main() -> None:
        async with grpc_serving(_service(tmp_path)) as origin:
            reply = await client.publish(origin, 0, v0)
            async with LinkEmulator(origin, bandwidth=4e6, latency_s=0.005) as link:
                sub = WeightSubscriber(link.address, None, -1)
                try:
                    task = asyncio.create_task(_collect(sub, 1, follow=False))
                    await _wait_for(lambda: sub.stats.chunks >= 40 or task.done(), "the first chunks")
                    assert not task.done(), "the transfer ended before the cut"
                    received_before, carried_before = sub.stats.chunk_bytes, link.bytes_down
                    assert link.cut() >= 1
                    (update,) = await asyncio.wait_for(task, 60)
                finally:
                    await sub.close()
                carried_after = link.bytes_down - carried_before
            assert update.version == 0 and same(update.weights, v0)
            nchunks = len(update.manifest.chunks)
            assert sub.stats.resumed == 1 and sub.stats.reconnects >= 1
            # Every chunk passed the subscriber exactly once: the resumed stream began at
            # the first chunk it lacked.
            assert sub.stats.chunks == nchunks
            assert (await _status(origin)).resumed_streams == 1
            # After the cut the link carried the rest of the version plus what was in
            # flight, not the whole version again (which would be >= encoded_bytes).
            assert carried_after < reply.encoded_bytes - received_before / 2

    run(main())


@pytest.mark.parametrize("in_place", [False, True])
def test_corrupted_chunk_is_fetched_again(tmp_path: Path, grpc_serving: Any, in_place: bool) -> None:
    v0, v1 = chain(2, 300_000)
    held = {k: RawTensor(t.dtype, t.shape, t.bits.copy()) for k, t in v0.items()}

    async def main() -> None:
        service = _service(tmp_path)
        async with grpc_serving(service) as origin:
            await client.publish(origin, 0, v0)
            await client.publish(origin, 1, v1)
            # The origin's delta is deterministic: recompute it to find chunk 3's header bytes.
            local = encode_version(1, v1, v0, 0, service.store.chunk_bytes)
            manifest = service.store.manifest(1)
            assert [c.sha256 for c in manifest.chunks] == [c.sha256 for c in local.manifest.chunks]
            async with LinkEmulator(origin) as link:
                rule = link.corrupt_once(local.chunks[3][:16], after=3)
                sub = WeightSubscriber(link.address, held, 0, in_place=in_place)
                try:
                    (update,) = await _collect(sub, 1, follow=False)
                finally:
                    await sub.close()
            assert rule.fired
            assert update.version == 1 and same(update.weights, v1)
            # In place: the held buffers became v1 and the undo log gives v0 back.
            assert same(held, v1 if in_place else v0)
            assert (update.undo is not None) == in_place
            if update.undo is not None:
                assert same(update.undo.previous_weights(update.weights), v0)
            assert sub.stats.refetched == 1
            assert (await _status(origin)).chunk_fetches == 1

    run(main())


def _fetch_reply_prefix(version: int, index: int, payload: bytes) -> bytes:
    """The first bytes of the FetchChunk reply carrying ``payload`` as the link sees them:
    gRPC's 5-byte message prefix, then the ChunkData's own fields. A Subscribe stream
    carries the same chunk inside a WeightChunk, never behind this prefix."""
    reply = pb.ChunkData(version=version, index=index, data=payload).SerializeToString()
    return b"\x00" + struct.pack(">I", len(reply)) + reply[:24]


def test_a_refetched_chunk_is_checked_again_before_it_is_taken(tmp_path: Path, grpc_serving: Any) -> None:
    """A chunk fetched again after a checksum failure is checked like the streamed one:
    when the link corrupts the FetchChunk reply too, the subscriber fetches it once more
    instead of decoding bytes its manifest does not list, and ends bit-exact."""
    v0, v1 = chain(2, 300_000)

    async def main() -> None:
        service = _service(tmp_path)
        async with grpc_serving(service) as origin:
            await client.publish(origin, 0, v0)
            await client.publish(origin, 1, v1)
            local = encode_version(1, v1, v0, 0, service.store.chunk_bytes)
            assert [c.sha256 for c in service.store.manifest(1).chunks] == [c.sha256 for c in local.manifest.chunks]
            async with LinkEmulator(origin) as link:
                in_stream = link.corrupt_once(local.chunks[3][:16], after=3)
                in_reply = link.corrupt_once(_fetch_reply_prefix(1, 3, local.chunks[3]))
                sub = WeightSubscriber(link.address, v0, 0)
                try:
                    (update,) = await _collect(sub, 1, follow=False)
                finally:
                    await sub.close()
            assert in_stream.fired and in_reply.fired
            assert update.version == 1 and same(update.weights, v1)
            assert sub.stats.refetched == 2  # the corrupted reply, then a good one
            assert (await _status(origin)).chunk_fetches == 2

    run(main())


class _SwappingOrigin(WeightSyncService):
    """A real origin whose Subscribe streams carry every chunk in a message of its own,
    with chunks 1 and 2 of each version swapped (a faulty or hostile upstream)."""

    async def Subscribe(self, request: pb.SubscribeRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.WeightChunk | bytes]:
        held: pb.ChunkData | None = None
        async for item in super().Subscribe(request, context):
            if not isinstance(item, bytes):
                yield item  # a manifest
                continue
            message = pb.WeightChunk.FromString(item)
            for chunk in message.batch.chunks if message.HasField("batch") else [message.chunk]:
                if chunk.index == 1:
                    held = chunk
                    continue
                yield pb.WeightChunk(chunk=chunk)
                if chunk.index == 2 and held is not None:
                    yield pb.WeightChunk(chunk=held)
                    held = None


def test_chunks_out_of_order_are_refused_and_the_held_version_kept(tmp_path: Path, grpc_serving: Any) -> None:
    """A subscriber takes a version's chunks only in order (its resume point is the next
    chunk): an upstream that sends chunk 2 before chunk 1 is refused with DATA_LOSS
    naming both, and an in-place subscriber still holds its version, bit for bit."""
    v0, v1 = chain(2, 300_000)
    held = {k: RawTensor(t.dtype, t.shape, t.bits.copy()) for k, t in v0.items()}

    async def main() -> None:
        origin_service = _SwappingOrigin(WeightSyncConfig(data_dir=str(tmp_path / "origin"), chunk_mb=1 / 64))
        async with grpc_serving(origin_service) as origin:
            await client.publish(origin, 0, v0)
            await client.publish(origin, 1, v1)
            assert len(origin_service.store.manifest(1).chunks) > 3
            sub = WeightSubscriber(origin, held, 0, in_place=True)
            try:
                with pytest.raises(DataLoss, match="chunk 2 arrived, 1 expected"):
                    await _collect(sub, 1, follow=False)
            finally:
                await sub.close()
            assert sub.decoder.version == 0
            assert same(held, v0) and same(sub.decoder.weights, v0)

    run(main())


def test_manifests_cross_the_link_compressed_and_chunks_as_they_are(tmp_path: Path, grpc_serving: Any) -> None:
    """A manifest is a sha256 and a tensor name per chunk, gzipped by Subscribe; the
    chunks are compressed already and go as they are. With 4 KiB chunks and few changes
    the manifest is several times the delta's bytes, so what the link carries shows it."""
    v0 = bf16_weights(0, 1_500_000)
    v1 = stepped(v0, 1, frac=0.0005)

    async def main() -> None:
        async with grpc_serving(_service(tmp_path, chunk_mb=1 / 256)) as origin:
            await client.publish(origin, 0, v0)
            reply = await client.publish(origin, 1, v1)
            async with LinkEmulator(origin) as link:
                sub = WeightSubscriber(link.address, v0, 0)
                try:
                    (update,) = await asyncio.wait_for(_collect(sub, 1, follow=False), 60)
                finally:
                    await sub.close()
                carried = link.bytes_down
            assert update.version == 1 and same(update.weights, v1)
            manifest = pb.WeightChunk(manifest=update.manifest).ByteSize()
            assert manifest > 2 * reply.encoded_bytes  # else the check below would be noise
            # These manifests gzip to ~0.5 (their sha256s are random hex; a real model's
            # long, repeated tensor names take it to ~0.3), and HTTP/2 adds ~7 KB here:
            # ~56 KB carried. Uncompressed: ~85 KB, the delta and the manifest in full.
            assert reply.encoded_bytes < carried < reply.encoded_bytes + 0.75 * manifest

    run(main())


# ---------------------------------------------------------------- late joiners


async def _join(origin: str, held: int, weights: Weights | None) -> list[VersionUpdate]:
    """What a late joiner holding ``held`` (-1: nothing) is sent first."""
    sub = WeightSubscriber(origin, weights, held)
    try:
        return await _collect(sub, 1, follow=False)
    finally:
        await sub.close()


def test_late_joiner_gets_the_smallest_catch_up(tmp_path: Path, grpc_serving: Any) -> None:
    versions = chain(6, 200_000)

    async def main() -> None:
        service = _service(tmp_path, keyframe_every=100)
        async with grpc_serving(service) as origin:
            for v, w in enumerate(versions):
                await client.publish(origin, v, w)
            chain_bytes = sum(service.store.deltas[v].size for v in range(2, 6))
            # Holder of v1, four versions behind: one compacted delta 1 -> 5 beats the chain.
            updates = await _join(origin, 1, versions[1])
            assert [(u.version, u.manifest.base_version) for u in updates] == [(5, 1)]
            assert same(updates[0].weights, versions[5])
            assert updates[0].manifest.encoded_bytes < chain_bytes
            status = await _status(origin)
            assert status.compacted_built == 1
            # Holder of v4 gets the one delta; a newcomer a keyframe of the latest.
            for held, weights, want in ((4, versions[4], [(5, 4)]), (-1, None, [(5, -1)])):
                got = await _join(origin, held, weights)
                assert [(u.version, u.manifest.base_version) for u in got] == want
                assert same(got[0].weights, versions[5])

    run(main())


def test_late_joiners_at_different_versions_each_get_a_delta_from_their_own(tmp_path: Path, grpc_serving: Any) -> None:
    """The compacted deltas kept for late joiners are per (latest, base): a joiner holding
    v2 after one holding v1 gets the latest compacted against v2, not the cached delta
    against v1 (which its decoder would refuse), and both end bit-exact."""
    versions = chain(6, 200_000)

    async def main() -> None:
        service = _service(tmp_path, keyframe_every=100)
        async with grpc_serving(service) as origin:
            for v, w in enumerate(versions):
                await client.publish(origin, v, w)
            for built, held in enumerate((1, 2, 1), start=1):
                updates = await _join(origin, held, versions[held])
                assert [(u.version, u.manifest.base_version) for u in updates] == [(5, held)]
                assert same(updates[0].weights, versions[5])
                # Built once per base; the third joiner (v1 again) is served from the cache.
                assert (await _status(origin)).compacted_built == min(built, 2)

    run(main())


@pytest.mark.parametrize("start", ["empty", "handed_weights"])
def test_the_first_delta_finds_its_position_indexes_built(tmp_path: Path, grpc_serving: Any, monkeypatch: pytest.MonkeyPatch, start: str) -> None:
    """A subscriber that starts empty gets a keyframe first and builds the position
    indexes of its chunks on its decode threads while it waits for the next version; one
    handed weights and the origin's chunk size builds them (and its hash sums) as soon as
    it follows. Either way decoding the first delta builds none (each build is a pass over
    its chunk) and still ends bit-exact."""
    versions = chain(2, 200_000)
    chunk_mb = 1 / 64
    decoding = threading.local()
    builds_while_decoding: list[int] = []
    needed: list[bool] = []
    real_build, real_ensure = codec.build_index, codec.ensure_index

    def counted_build(*args: Any, **kw: Any) -> codec.ChunkIndex:
        # The subscriber's decode threads only: the origin's service warms up on its own.
        if getattr(decoding, "chunk", False) and threading.current_thread().name.startswith("ws-decode"):
            builds_while_decoding.append(1)
        return real_build(*args, **kw)

    def recorded_ensure(payload: bytes, *args: Any, **kw: Any) -> codec.ChunkIndex | None:
        needed.append(codec._payload_index(payload, codec.parse_header(payload)) is not None)
        decoding.chunk = True
        try:
            return real_ensure(payload, *args, **kw)
        finally:
            decoding.chunk = False

    monkeypatch.setattr(codec, "build_index", counted_build)
    monkeypatch.setattr(codec, "ensure_index", recorded_ensure)

    async def main() -> None:
        async with grpc_serving(_service(tmp_path, chunk_mb=chunk_mb)) as origin:
            await client.publish(origin, 0, versions[0])
            if start == "empty":
                sub = WeightSubscriber(origin, None, -1, in_place=True)
            else:
                held = {k: RawTensor(t.dtype, t.shape, t.bits.copy()) for k, t in versions[0].items()}
                sub = WeightSubscriber(origin, held, 0, in_place=True, origin_chunk_bytes=int(chunk_mb * (1 << 20)))
            stream = sub.updates(follow=True)
            try:
                if start == "empty":
                    first = await anext(stream)
                    assert (first.version, first.manifest.base_version) == (0, -1)
                await client.publish(origin, 1, versions[1])
                update = await anext(stream)
            finally:
                await stream.aclose()
                await sub.close()
        assert (update.version, update.manifest.base_version) == (1, 0)
        assert same(update.weights, versions[1])
        assert any(needed), "no chunk of the delta was coded over a position index: the test proves nothing"
        assert builds_while_decoding == [], f"the first delta built {len(builds_while_decoding)} position indexes while it arrived"

    run(main())


def test_an_origin_prepares_its_next_delta_after_a_keyframe(tmp_path: Path, grpc_serving: Any) -> None:
    """After its first version (a keyframe) an origin builds the next delta's position
    indexes in the background, so that Publish does not; the versions stay exact."""
    versions = chain(2, 200_000)

    async def main() -> None:
        service = _service(tmp_path)
        async with grpc_serving(service) as origin:
            await client.publish(origin, 0, versions[0])
            await _wait_for(lambda: bool(service.store.carried.indexes), "the origin's indexes for the next delta")
            assert service.store.carried.sums.keys() == versions[0].keys()
            await client.publish(origin, 1, versions[1])
            sub = WeightSubscriber(origin, None, -1)
            try:
                (update,) = await _collect(sub, 1, follow=False)
            finally:
                await sub.close()
        assert update.version == 1 and same(update.weights, versions[1])

    run(main())


# ---------------------------------------------------------------- relay fan-out


def test_relay_pulls_each_version_once_for_all_its_subscribers(tmp_path: Path, grpc_serving: Any) -> None:
    versions = chain(3, 200_000)

    async def main() -> None:
        origin_service = _service(tmp_path)
        async with grpc_serving(origin_service) as origin:
            await client.publish(origin, 0, versions[0])
            async with LinkEmulator(origin, bandwidth=20e6, latency_s=0.02) as link:
                async with grpc_serving(_service(tmp_path, "relay", role="relay", upstream=link.address)) as relay:
                    subs = [WeightSubscriber(relay, None, -1) for _ in range(2)]
                    try:
                        tasks = [asyncio.create_task(_collect(s, 3)) for s in subs]
                        await _wait_for(lambda: all(s.decoder.version == 0 for s in subs), "both subscribers on v0")
                        for v in (1, 2):
                            await client.publish(origin, v, versions[v])
                        results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
                    finally:
                        for s in subs:
                            await s.close()
                    # Cut-through: subscribers may finish a version before the relay stored it.
                    deadline = time.monotonic() + 30
                    while (relay_status := await _status(relay)).upstream_versions < 3 and time.monotonic() < deadline:
                        await asyncio.sleep(0.05)
            for updates in results:
                assert [u.version for u in updates] == [0, 1, 2]
                assert all(same(u.weights, versions[u.version]) for u in updates)
            origin_status = await _status(origin)
            store = origin_service.store
            once = store.keyframes[0].size + store.deltas[1].size + store.deltas[2].size
            # One copy per version crossed the link, however many subscribers the relay has.
            assert origin_status.chunk_bytes_sent == once
            assert relay_status.upstream_versions == 3 and relay_status.upstream_bytes == once
            assert relay_status.chunk_bytes_sent == 2 * once
            assert link.bytes_down >= once

    run(main())


def test_a_relay_forwards_only_chunks_it_has_verified(tmp_path: Path, grpc_serving: Any) -> None:
    """A chunk corrupted between origin and relay is fetched again by the relay before
    anything downstream sees it: the relay's subscriber never meets a bad chunk."""
    v0, v1 = chain(2, 300_000)

    async def main() -> None:
        origin_service = _service(tmp_path)
        async with grpc_serving(origin_service) as origin:
            await client.publish(origin, 0, v0)
            local = encode_version(1, v1, v0, 0, origin_service.store.chunk_bytes)
            async with LinkEmulator(origin) as link:
                relay_service = _service(tmp_path, "relay", role="relay", upstream=link.address)
                async with grpc_serving(relay_service) as relay:
                    sub = WeightSubscriber(relay, None, -1)
                    try:
                        task = asyncio.create_task(_collect(sub, 2))
                        await _wait_for(lambda: sub.decoder.version == 0, "the subscriber on v0")
                        rule = link.corrupt_once(local.chunks[3][:16], after=0)
                        await client.publish(origin, 1, v1)
                        updates = await asyncio.wait_for(task, 60)
                    finally:
                        await sub.close()
                    # Cut-through: the subscriber may finish before the relay stored the version.
                    await _wait_for(lambda: relay_service.store.find(1, 0) is not None, "the relay storing v1")
                    relay_chunks = relay_service.store.find(1, 0).chunks  # type: ignore[union-attr]
            assert rule.fired
            assert [u.version for u in updates] == [0, 1] and same(updates[1].weights, v1)
            assert sub.stats.refetched == 0, "the relay passed a corrupted chunk on"
            assert (await _status(origin)).chunk_fetches == 1  # the relay fetched chunk 3 again
            assert relay_chunks == local.chunks

    run(main())


def test_a_relay_serves_the_version_it_is_receiving_only_to_holders_of_its_base(tmp_path: Path, grpc_serving: Any) -> None:
    """A relay re-serves the version still arriving from upstream (cut-through) only to a
    subscriber holding that version's base: one that holds the arriving version already
    (it got it elsewhere) is sent nothing it cannot apply, and gets the next delta."""
    v0 = bf16_weights(0, 600_000)
    v1 = stepped(v0, 1, frac=0.2)  # a large delta (~74 kB): seconds through the slow link below
    v2 = stepped(v1, 2)

    async def main() -> None:
        async with grpc_serving(_service(tmp_path)) as origin:
            await client.publish(origin, 0, v0)
            async with LinkEmulator(origin) as link:
                relay_service = _service(tmp_path, "relay", role="relay", upstream=link.address)
                async with grpc_serving(relay_service) as relay:
                    await _wait_for(lambda: relay_service.store.latest == 0, "the relay storing v0")
                    link.set_link(bandwidth=3e4)  # v1 is ~74 kB: over 2 s
                    await client.publish(origin, 1, v1)
                    await _wait_for(lambda: 1 in relay_service.available_at, "v1's manifest at the relay")
                    # A subscriber that holds v1 already, while the relay still receives it.
                    sub = WeightSubscriber(relay, {k: RawTensor(t.dtype, t.shape, t.bits.copy()) for k, t in v1.items()}, 1)
                    try:
                        task = asyncio.create_task(_collect(sub, 1))
                        await asyncio.sleep(0.3)
                        assert relay_service.store.latest == 0, "the relay stored v1 before the subscriber could ask it mid-version"
                        assert not task.done(), "the subscriber got (or was refused) something while the relay received v1"
                        link.set_link(bandwidth=0.0)
                        await client.publish(origin, 2, v2)
                        (update,) = await asyncio.wait_for(task, 60)
                    finally:
                        await sub.close()
            assert (update.version, update.manifest.base_version) == (2, 1)
            assert same(update.weights, v2)
            assert sub.stats.reconnects == 0

    run(main())


# ---------------------------------------------------------------- origin restart


def _start_origin(data_dir: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with open(log, "ab") as fh:
        return subprocess.Popen(
            [sys.executable, "-m", "meridian.cli", "serve", "weightsync", "--insecure", "true", "--data-dir", str(data_dir), "--port", str(port),
             "--chunk-mb", "0.015625"],
            cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT,
        )


async def _until_serving(address: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 60
    while await check_health(address) != "SERVING":
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"origin did not start:\n{log.read_text()[-2000:]}")
        await asyncio.sleep(0.1)


def test_origin_killed_and_restarted_loses_nothing(tmp_path: Path, pick_port: Callable[[], int]) -> None:
    versions = chain(3, 100_000)
    data_dir, log = tmp_path / "origin", tmp_path / "origin.log"
    port = pick_port()
    address = f"127.0.0.1:{port}"
    procs: list[subprocess.Popen[bytes]] = []

    async def main() -> None:
        procs.append(_start_origin(data_dir, port, log))
        await _until_serving(address, procs[-1], log)
        await client.publish(address, 0, versions[0])
        await client.publish(address, 1, versions[1])
        sub = WeightSubscriber(address, None, -1, max_attempts=40)
        stream = sub.updates(follow=True)
        try:
            first = await anext(stream)
            assert first.version == 1 and same(first.weights, versions[1])
            procs[-1].send_signal(signal.SIGKILL)
            procs[-1].wait(10)
            procs.append(_start_origin(data_dir, port, log))
            await _until_serving(address, procs[-1], log)
            status = await _status(address)
            assert status.latest_version == 1 and list(status.versions) == [0, 1]
            await client.publish(address, 2, versions[2])
            second = await asyncio.wait_for(anext(stream), 60)
            assert (second.version, second.manifest.base_version) == (2, 1)
            assert same(second.weights, versions[2])
            assert sub.stats.reconnects >= 1
        finally:
            await stream.aclose()
            await sub.close()

    try:
        run(main())
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


# ---------------------------------------------------------------- bandwidth


def test_send_cap_limits_the_link(tmp_path: Path, grpc_serving: Any) -> None:
    v0 = bf16_weights(0, 600_000)
    cap_mib_s = 1.0

    async def main() -> None:
        async with grpc_serving(_service(tmp_path, send_mib_s=cap_mib_s)) as origin:
            reply = await client.publish(origin, 0, v0)
            async with LinkEmulator(origin) as link:
                sub = WeightSubscriber(link.address, None, -1)
                try:
                    start = time.monotonic()
                    (update,) = await _collect(sub, 1, follow=False)
                    elapsed = time.monotonic() - start
                finally:
                    await sub.close()
                carried = link.bytes_down
        assert same(update.weights, v0)
        assert carried >= reply.encoded_bytes
        # Loose lower bound only: the cap must have held the transfer back.
        minimum = (reply.encoded_bytes - 64 * 1024) / (cap_mib_s * (1 << 20))
        assert elapsed >= 0.5 * minimum

    run(main())


def test_upstream_cap_limits_what_a_relay_pulls(tmp_path: Path, grpc_serving: Any) -> None:
    """A relay's ``upstream_mib_s`` caps what it reads from its upstream: pulling a
    version takes at least about its encoded size over the cap (the origin sends
    uncapped), and the version still arrives whole."""
    v0 = bf16_weights(0, 600_000)
    cap_mib_s = 0.5

    async def main() -> None:
        async with grpc_serving(_service(tmp_path)) as origin:
            relay_service = _service(tmp_path, "relay", role="relay", upstream=origin, upstream_mib_s=cap_mib_s)
            async with grpc_serving(relay_service) as relay:
                start = time.monotonic()
                reply = await client.publish(origin, 0, v0)
                await _wait_for(lambda: relay_service.store.latest == 0, "the relay storing v0", timeout_s=60)
                elapsed = time.monotonic() - start
                status = await _status(relay)
        assert same(relay_service.store.weights, v0)
        assert status.upstream_bytes == reply.encoded_bytes
        # Loose lower bound only (the bucket starts with a 64 KiB burst): the cap held it back.
        minimum = (reply.encoded_bytes - 64 * 1024) / (cap_mib_s * (1 << 20))
        assert elapsed >= 0.5 * minimum

    run(main())


def test_link_emulator_adds_latency_and_limits_bandwidth() -> None:
    payload = b"x" * 400_000

    async def main() -> None:
        async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
            writer.close()

        server = await asyncio.start_server(echo, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            async with LinkEmulator(f"127.0.0.1:{port}", bandwidth=1e6, latency_s=0.1) as link:
                reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
                start = time.monotonic()
                writer.write(b"ping")
                assert await reader.readexactly(4) == b"ping"
                rtt = time.monotonic() - start
                start = time.monotonic()
                writer.write(payload)
                await reader.readexactly(len(payload))
                bulk = time.monotonic() - start
                writer.close()
                assert link.bytes_up >= len(payload) + 4 and link.bytes_down >= len(payload) + 4
        finally:
            server.close()
        assert rtt >= 0.5 * 0.2
        assert bulk >= 0.5 * len(payload) / 1e6

    run(main())
