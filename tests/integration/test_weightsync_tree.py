"""Weightsync through a three-level relay tree over real gRPC servers and emulated WAN links:

    origin --link OA--> relay A --link AB--> relay B --> subscribers S1, S2
                           \\--> subscriber S3 (or a late relay)

Every level streams chunk by chunk (a relay forwards each chunk once it passed its
checksum, before the version is stored); the tests check what the issue asks of that
tree: cut links, a corrupted chunk caught and fetched again at the hop where it broke
and never forwarded, late joiners, an origin killed and restarted, a relay restarted
mid-version, and fan-out (one copy per version per link)."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import signal
import subprocess
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from services.weightsync import client
from services.weightsync.client import VersionUpdate, WeightSubscriber
from services.weightsync.server import WeightSyncService
from services.weightsync.versions import encode_version
from meridian.link_emulator import LinkEmulator
from tests.integration.test_weightsync_links import (
    Weights,
    _collect,
    _service,
    _start_origin,
    _status,
    _until_serving,
    _wait_for,
    run,
)
from tests.synthetic_weights import bf16_weights, chain, same, stepped


@dataclasses.dataclass
class Tree:
    """Addresses and handles of one origin → A → B tree (the origin may be a subprocess)."""

    origin: str
    origin_service: WeightSyncService | None
    link_oa: LinkEmulator
    a: str
    a_service: WeightSyncService
    link_ab: LinkEmulator
    b: str
    b_service: WeightSyncService


@contextlib.asynccontextmanager
async def _tree(
    tmp_path: Path, grpc_serving: Any, origin: str | None = None, bandwidth: float = 0.0, latency_s: float = 0.0, **relay_kw: Any
) -> AsyncIterator[Tree]:
    """Starts the tree (an in-process origin unless ``origin`` is given); everything it
    started is stopped on exit, whatever happened inside."""
    async with contextlib.AsyncExitStack() as stack:
        origin_service = None
        if origin is None:
            origin_service = _service(tmp_path)
            origin = await stack.enter_async_context(grpc_serving(origin_service))
        link_oa = await stack.enter_async_context(LinkEmulator(origin, bandwidth=bandwidth, latency_s=latency_s))
        a_service = _service(tmp_path, "relay-a", role="relay", upstream=link_oa.address, **relay_kw)
        a = await stack.enter_async_context(grpc_serving(a_service))
        link_ab = await stack.enter_async_context(LinkEmulator(a, bandwidth=bandwidth, latency_s=latency_s))
        b_service = _service(tmp_path, "relay-b", role="relay", upstream=link_ab.address, **relay_kw)
        b = await stack.enter_async_context(grpc_serving(b_service))
        yield Tree(origin, origin_service, link_oa, a, a_service, link_ab, b, b_service)


@contextlib.asynccontextmanager
async def _following(subs: list[WeightSubscriber], count: int) -> AsyncIterator[list[asyncio.Task[list[VersionUpdate]]]]:
    """Each subscriber collecting ``count`` versions in a task; tasks and channels are
    closed on exit."""
    tasks = [asyncio.create_task(_collect(s, count)) for s in subs]
    try:
        yield tasks
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t
        for s in subs:
            await s.close()


async def _relays_hold(tree: Tree, version: int) -> None:
    """Cut-through: subscribers may finish a version before the relays stored it."""
    await _wait_for(lambda: tree.a_service.store.latest >= version and tree.b_service.store.latest >= version, f"both relays storing v{version}")


def _held(weights: Weights) -> Weights:
    return {k: dataclasses.replace(t, bits=t.bits.copy()) for k, t in weights.items()}


# ---------------------------------------------------------------- fan-out


def test_tree_fans_out_one_copy_per_link(tmp_path: Path, grpc_serving: Any) -> None:
    versions = chain(4, 200_000)

    async def main() -> None:
        async with _tree(tmp_path, grpc_serving, bandwidth=20e6, latency_s=0.01) as tree:
            assert tree.origin_service is not None
            await client.publish(tree.origin, 0, versions[0])
            subs = [WeightSubscriber(tree.b, None, -1), WeightSubscriber(tree.b, None, -1), WeightSubscriber(tree.a, None, -1)]
            async with _following(subs, 4) as tasks:
                await _wait_for(lambda: all(s.decoder.version == 0 for s in subs), "every subscriber on v0")
                for v in range(1, 4):
                    await client.publish(tree.origin, v, versions[v])
                results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
            await _relays_hold(tree, 3)
            for updates in results:
                assert [u.version for u in updates] == [0, 1, 2, 3]
                assert all(same(u.weights, versions[u.version]) for u in updates)
            store = tree.origin_service.store
            once = store.keyframes[0].size + sum(store.deltas[v].size for v in (1, 2, 3))
            origin_s, a_s, b_s = [await _status(x) for x in (tree.origin, tree.a, tree.b)]
            # Each link carried one copy of each version, however many are below it.
            assert origin_s.chunk_bytes_sent == once
            assert a_s.upstream_bytes == once and a_s.chunk_bytes_sent == 2 * once  # B and S3
            assert b_s.upstream_bytes == once and b_s.chunk_bytes_sent == 2 * once  # S1 and S2
            assert a_s.upstream_versions == b_s.upstream_versions == 4
            # Coalescing chunks into messages neither drops nor repeats one: each of B's two
            # leaves got every chunk of every version exactly once.
            assert b_s.chunks_sent == 2 * sum(len(e.manifest.chunks) for e in (store.keyframes[0], *(store.deltas[v] for v in (1, 2, 3))))

    run(main())


# ---------------------------------------------------------------- cut links


def test_tree_resumes_after_both_links_are_cut(tmp_path: Path, grpc_serving: Any) -> None:
    v0 = bf16_weights(0, 1_500_000)

    async def main() -> None:
        async with _tree(tmp_path, grpc_serving, bandwidth=4e6, latency_s=0.005) as tree:
            reply = await client.publish(tree.origin, 0, v0)
            subs = [WeightSubscriber(tree.b, None, -1), WeightSubscriber(tree.b, None, -1)]
            async with _following(subs, 1) as tasks:
                # Cut-through: the subscribers below B see chunks while the origin still sends.
                await _wait_for(lambda: all(s.stats.chunks >= 20 for s in subs), "the first chunks at the leaves")
                assert tree.link_ab.cut() >= 1
                carried_oa = tree.link_oa.bytes_down
                await _wait_for(lambda: tree.link_oa.bytes_down > carried_oa + 200_000, "more of the version reaching A")
                assert tree.link_oa.cut() >= 1
                results = await asyncio.wait_for(asyncio.gather(*tasks), 90)
            for (update,) in results:
                assert update.version == 0 and same(update.weights, v0)
            await _relays_hold(tree, 0)
            origin_s, a_s = await _status(tree.origin), await _status(tree.a)
            # Both relays resumed at their last good chunk instead of starting over.
            assert origin_s.resumed_streams >= 1 and a_s.resumed_streams >= 1
            # What a cut loses is what was in flight on the link, not the version: each link
            # carried the version once plus a part (gRPC counts bytes handed to the socket,
            # so the links' own counters are the ones to compare).
            for link in (tree.link_oa, tree.link_ab):
                assert reply.encoded_bytes <= link.bytes_down < 1.5 * reply.encoded_bytes
            assert a_s.upstream_bytes == reply.encoded_bytes
            assert all(s.stats.chunks == len(update.manifest.chunks) for s in subs)

    run(main())


# ---------------------------------------------------------------- corruption


def test_tree_corruption_is_caught_at_its_hop_and_never_forwarded(tmp_path: Path, grpc_serving: Any) -> None:
    """One chunk corrupted on each link: the relay right below the fault fetches it again
    from its own upstream before anything further down sees it. Forwarding a chunk before
    its checksum passed would make B (or the leaves) meet a bad chunk and fetch it again
    from A (or B), which the FetchChunk counters below would show."""
    v0, v1 = chain(2, 300_000)

    async def main() -> None:
        async with _tree(tmp_path, grpc_serving, bandwidth=20e6, latency_s=0.005) as tree:
            assert tree.origin_service is not None
            await client.publish(tree.origin, 0, v0)
            local = encode_version(1, v1, v0, 0, tree.origin_service.store.chunk_bytes)
            subs = [WeightSubscriber(tree.b, _held(v0), 0, in_place=True), WeightSubscriber(tree.b, None, -1)]
            async with _following(subs, 1) as tasks:
                await _wait_for(lambda: subs[1].decoder.version == 0 and tree.b_service.store.latest == 0, "the tree on v0")
                tasks[1].cancel()
                tasks[1] = asyncio.create_task(_collect(subs[1], 1))
                on_oa = tree.link_oa.corrupt_once(local.chunks[3][:16], after=0)
                on_ab = tree.link_ab.corrupt_once(local.chunks[7][:16], after=2)
                await client.publish(tree.origin, 1, v1)
                results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
            assert on_oa.fired and on_ab.fired
            for (update,) in results:
                assert update.version == 1 and same(update.weights, v1)
            await _relays_hold(tree, 1)
            origin_s, a_s, b_s = [await _status(x) for x in (tree.origin, tree.a, tree.b)]
            assert origin_s.chunk_fetches == 1, "A fetches the chunk broken on link OA again from the origin"
            assert a_s.chunk_fetches == 1, "B fetches the chunk broken on link AB again from A, and only that one"
            assert b_s.chunk_fetches == 0, "a leaf met a bad chunk: B forwarded one it had not verified"
            assert all(s.stats.refetched == 0 for s in subs)
            for service in (tree.a_service, tree.b_service):
                assert service.store.find(1, 0).chunks == local.chunks  # type: ignore[union-attr]

    run(main())


# ---------------------------------------------------------------- late joiners


def test_tree_late_joiners_get_the_smallest_catch_up(tmp_path: Path, grpc_serving: Any) -> None:
    versions = chain(6, 200_000)

    async def main() -> None:
        async with _tree(tmp_path, grpc_serving, keyframe_every=100) as tree:
            for v, w in enumerate(versions):
                await client.publish(tree.origin, v, w)
            await _relays_hold(tree, 5)
            b_store = tree.b_service.store
            chain_bytes = sum(b_store.deltas[v].size for v in range(2, 6))
            # A holder of v1 joining at the bottom of the tree: one compacted delta 1 -> 5.
            sub = WeightSubscriber(tree.b, _held(versions[1]), 1)
            try:
                (update,) = await _collect(sub, 1, follow=False)
            finally:
                await sub.close()
            assert (update.version, update.manifest.base_version) == (5, 1)
            assert same(update.weights, versions[5]) and update.manifest.encoded_bytes < chain_bytes
            assert (await _status(tree.b)).compacted_built == 1
            # A relay joining A late (holding nothing) starts from a keyframe of the latest,
            # then follows deltas as they come.
            async with grpc_serving(_service(tmp_path, "relay-c", role="relay", upstream=tree.a)) as c:
                leaf = WeightSubscriber(c, None, -1)
                async with _following([leaf], 2) as (task,):
                    await _wait_for(lambda: leaf.decoder.version == 5, "the late relay's subscriber on v5")
                    nxt = stepped(versions[5], 99)
                    await client.publish(tree.origin, 6, nxt)
                    updates = await asyncio.wait_for(task, 60)
                assert [(u.version, u.manifest.base_version) for u in updates] == [(5, -1), (6, 5)]
                assert same(updates[1].weights, nxt)

    run(main())


# ---------------------------------------------------------------- restarts


def test_tree_survives_an_origin_killed_and_restarted(tmp_path: Path, grpc_serving: Any, pick_port: Callable[[], int]) -> None:
    versions = chain(3, 100_000)
    data_dir, log = tmp_path / "origin", tmp_path / "origin.log"
    port = pick_port()
    address = f"127.0.0.1:{port}"
    procs: list[subprocess.Popen[bytes]] = []

    async def main() -> None:
        procs.append(_start_origin(data_dir, port, log))
        await _until_serving(address, procs[-1], log)
        await client.publish(address, 0, versions[0])
        async with _tree(tmp_path, grpc_serving, origin=address) as tree:
            subs = [WeightSubscriber(tree.b, None, -1), WeightSubscriber(tree.a, None, -1)]
            async with _following(subs, 3) as tasks:
                # Everyone on v0 first: a relay still empty when v1 comes gets only v1's keyframe.
                await _wait_for(lambda: all(s.decoder.version == 0 for s in subs), "the tree on v0")
                await client.publish(address, 1, versions[1])
                await _wait_for(lambda: all(s.decoder.version == 1 for s in subs), "the tree on v1")
                procs[-1].send_signal(signal.SIGKILL)
                procs[-1].wait(10)
                procs.append(_start_origin(data_dir, port, log))
                await _until_serving(address, procs[-1], log)
                await client.publish(address, 2, versions[2])
                results = await asyncio.wait_for(asyncio.gather(*tasks), 90)
            for updates in results:
                assert [u.version for u in updates] == [0, 1, 2]
                assert all(same(u.weights, versions[u.version]) for u in updates)
            await _relays_hold(tree, 2)
            assert (tree.b_service.store.deltas[2].manifest.base_version, tree.a_service.store.latest) == (1, 2)

    try:
        run(main())
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def test_leaves_recover_when_their_relay_dies_mid_version(tmp_path: Path, grpc_serving: Any, pick_port: Callable[[], int]) -> None:
    """B goes away while forwarding a version it has not stored yet (its leaves hold part
    of it); a new B on the same data folder holds only what was stored whole, and its
    leaf drops or resumes the partial version and ends bit-exact."""
    v0 = bf16_weights(0, 600_000)
    v1 = stepped(v0, 1, frac=0.2)  # a large delta: several hundred KB through a slow link

    async def main() -> None:
        async with _tree(tmp_path, grpc_serving) as tree:
            # B itself is replaced by one on a fixed port, fed through a slow link.
            port = pick_port()
            await tree.b_service.stop()
            tree.link_ab.set_link(bandwidth=1e6, latency_s=0.005)
            await client.publish(tree.origin, 0, v0)
            b_dir = "relay-b2"
            first_b = _service(tmp_path, b_dir, role="relay", upstream=tree.link_ab.address)
            leaf = WeightSubscriber(f"127.0.0.1:{port}", None, -1, in_place=True, max_attempts=40)
            async with _following([leaf], 2) as (task,):
                async with grpc_serving(first_b, port=port):
                    await _wait_for(lambda: leaf.decoder.version == 0 and first_b.store.latest == 0, "the leaf and B on v0")
                    await client.publish(tree.origin, 1, v1)
                    await _wait_for(lambda: leaf.decoder.manifest is not None and leaf.stats.chunks >= 8, "part of v1 at the leaf")
                    assert first_b.store.latest == 0, "B stored v1 before the test could stop it mid-version"
                # B is gone mid-version; a new one recovers what was stored whole (v0 only).
                second_b = _service(tmp_path, b_dir, role="relay", upstream=tree.link_ab.address)
                assert second_b.store.latest == 0
                async with grpc_serving(second_b, port=port):
                    updates = await asyncio.wait_for(task, 90)
                    await _wait_for(lambda: second_b.store.latest == 1, "the new B storing v1")
            assert [u.version for u in updates] == [0, 1] and same(updates[1].weights, v1)
            assert leaf.stats.reconnects >= 1

    run(main())
