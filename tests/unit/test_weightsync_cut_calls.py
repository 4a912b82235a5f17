"""weightsync under calls cut off at random moments (a trainer's deadline, a subscriber
that goes away), over a real in-process origin: Publish, Subscribe, FetchChunk and
GetManifest each cut by a random deadline, a cut Publish retried in full as a trainer
does. No call answers INTERNAL/UNKNOWN, every retry is accepted, and afterwards the
origin holds exactly the versions published, each served bit-exact to a subscriber
starting from nothing or from any version it holds, and a subscriber that followed
throughout holds the latest."""
from __future__ import annotations

import asyncio
import contextlib
import random
from pathlib import Path
from typing import Any

import grpc

from meridian.tensors import RawTensor
from meridian.v1 import weightsync_pb2 as pb
from meridian.v1 import weightsync_pb2_grpc as pb_grpc
from services.weightsync import client
from services.weightsync.client import WeightSubscriber, publish_header, publish_requests
from tests.integration.test_weightsync_links import _collect, _service
from tests.synthetic_weights import chain, same

Weights = dict[str, RawTensor]
CALLS = 80
BROKEN = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}


def _copy(weights: Weights) -> Weights:
    return {k: RawTensor(t.dtype, t.shape, t.bits.copy()) for k, t in weights.items()}


async def _catch_up(origin: str, held: int, weights: Weights | None) -> tuple[int, Weights]:
    """What a subscriber holding ``held`` (-1: nothing) ends with when it has caught up."""
    sub = WeightSubscriber(origin, weights, held)
    try:
        last = None
        async for update in sub.updates(follow=False):
            last = update
    finally:
        await sub.close()
    assert last is not None, f"nothing served to a subscriber holding {held}"
    return last.version, last.weights


def test_calls_cut_off_at_random_moments_leave_the_origin_whole(tmp_path: Path, grpc_serving: Any) -> None:
    versions = chain(14, 400_000)
    rng = random.Random(5)
    broken: list[str] = []

    async def main() -> None:
        service = _service(tmp_path)
        async with grpc_serving(service) as origin, grpc.aio.insecure_channel(origin) as channel:
            stub = pb_grpc.WeightSyncStub(channel)
            await client.publish(origin, 0, versions[0])
            published = 0
            # A subscriber that follows throughout, as a rollout does: every version must
            # reach it, also one whose Publish was cut while it was stored.
            follower = WeightSubscriber(origin, _copy(versions[0]), 0)
            followed: list[tuple[int, Weights]] = []

            async def follow() -> None:
                async for update in follower.updates(follow=True):
                    followed.append((update.version, update.weights))

            following = asyncio.create_task(follow())
            for _ in range(CALLS):
                kind = rng.choice(["publish", "publish", "subscribe", "fetch", "manifest"])
                deadline_s = 10 ** rng.uniform(-3.5, -0.7)  # 0.3 ms to 200 ms
                held = rng.randint(0, published)
                try:
                    if kind == "publish" and published + 1 < len(versions):
                        v = published + 1
                        header = publish_header(v, versions[v])
                        try:
                            await stub.Publish(publish_requests(v, versions[v], header=header), timeout=deadline_s)
                        except (grpc.aio.AioRpcError, asyncio.CancelledError) as exc:
                            if isinstance(exc, grpc.aio.AioRpcError) and exc.code() in BROKEN:
                                raise
                            # grpc's client at times raises CancelledError, not DEADLINE_EXCEEDED,
                            # when a client-streaming call's deadline passes while it sends (no
                            # Publish of the services sets a deadline); this task was not cancelled.
                            if isinstance(exc, asyncio.CancelledError) and asyncio.current_task().cancelling():  # type: ignore[union-attr]
                                raise
                            # The trainer publishes the version again, in full: accepted
                            # whether or not the cut call stored it.
                            await client.publish(origin, v, versions[v])
                        published = v
                    elif kind == "subscribe":
                        sub = WeightSubscriber(origin, _copy(versions[held]), held)
                        try:
                            with contextlib.suppress(TimeoutError):
                                await asyncio.wait_for(_collect(sub, 1), deadline_s)
                        finally:
                            await sub.close()
                    elif kind == "fetch" and published > 0:
                        version = rng.randint(1, published)
                        manifest = await stub.GetManifest(pb.GetManifestRequest(version=version))
                        request = pb.FetchChunkRequest(version=version, base_version=manifest.base_version, index=rng.randrange(len(manifest.chunks)))
                        await stub.FetchChunk(request, timeout=deadline_s)
                    elif kind == "manifest":
                        await stub.GetManifest(pb.GetManifestRequest(version=held), timeout=deadline_s)
                except grpc.aio.AioRpcError as exc:
                    if exc.code() in BROKEN:
                        broken.append(f"{kind}: {exc.code().name} {exc.details()}")

            assert published >= 5, "too few versions got in to say anything"
            for _ in range(3000):
                if following.done() or (followed and followed[-1][0] == published):
                    break
                await asyncio.sleep(0.01)
            assert followed and followed[-1][0] == published, f"the follower stopped at {followed[-1][0] if followed else None}; {published} was published"
            assert same(followed[-1][1], versions[published])
            following.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await following
            await follower.close()
            assert service.store.latest == published
            # From nothing and from every earlier version: caught up to the latest, bit for bit.
            for held in [-1, *range(published)]:
                version, weights = await _catch_up(origin, held, versions[held] if held >= 0 else None)
                assert version == published and same(weights, versions[published]), held

    asyncio.run(main())
    assert broken == []
