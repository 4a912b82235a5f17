"""Sharded publish: the partition rule, digests combined from parts, and a real
in-process origin assembling one version from parts that arrive in any order, into the
same store a single Publish of the same weights gives; a missing part times out, and a
duplicate, foreign or inconsistent part is refused with its status."""
from __future__ import annotations

import asyncio
import itertools
import random
import threading
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from meridian.grpc_runtime import ended_while_sending
from meridian.tensors import RawTensor, weights_hash
from meridian.v1 import weightsync_pb2 as pb
from services.weightsync import client as weightsync
from services.weightsync import parts
from services.weightsync.config import WeightSyncConfig
from services.weightsync.server import WeightSyncService
from services.weightsync.signing import Signer, Verifier, content_digest, generate_signing_key
from tests.conftest import serving

Weights = dict[str, RawTensor]


def _weights(seed: int, shift: int = 0) -> Weights:
    rng = np.random.default_rng(seed)
    shapes = {"embed": (96, 32), "layers.0.attn": (32, 32), "layers.0.mlp": (32, 64), "layers.1.attn": (32, 32), "layers.1.mlp": (32, 64), "norm": (32,)}
    out = {}
    for name, shape in shapes.items():
        bits = rng.integers(0x3C00, 0x3F00, size=int(np.prod(shape)), dtype=np.uint16)
        bits[: shift * 7 : 3] += np.uint16(shift)  # a sparse change per version, like a training step
        out[name] = RawTensor("bf16", shape, bits)
    return out


def _split(weights: Weights, count: int) -> list[Weights]:
    names = parts.partition({n: t.nbytes for n, t in weights.items()}, count)
    return [{n: weights[n] for n in ns} for ns in names]


def _header(version: int, weights: Weights, signer: Signer | None = None) -> pb.PublishHeader:
    digests: dict[str, parts.TensorDigest] = {}
    for part in _split(weights, 3):
        digests.update(parts.tensor_digests(part))
    return weightsync.version_header_from_digests(version, digests, {}, {}, pb.Canary(), signer)


def _store_files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------- partition and digests


def test_partition_is_deterministic_balanced_and_covers_every_tensor_once() -> None:
    rng = random.Random(0)
    sizes = {f"t{i:03d}": rng.choice([4, 64, 1000, 4096, 50_000]) for i in range(200)}
    for count in (1, 2, 3, 7):
        split = parts.partition(sizes, count)
        assert len(split) == count
        flat = [n for names in split for n in names]
        assert sorted(flat) == sorted(sizes) and len(flat) == len(set(flat)), "every tensor in exactly one part"
        assert all(names == sorted(names) for names in split)
        shuffled = dict(rng.sample(list(sizes.items()), len(sizes)))
        assert parts.partition(shuffled, count) == split, "depends on names and sizes, not order"
        loads = [sum(sizes[n] for n in names) for names in split]
        assert max(loads) - min(loads) <= max(sizes.values())
    assert parts.partition({"a": 1}, 3) == [["a"], [], []]


def test_digests_from_parts_equal_the_whole_versions_hash_content_and_signature(tmp_path: Path) -> None:
    generate_signing_key(tmp_path / "k", tmp_path / "k.pub")
    signer = Signer.load(tmp_path / "k")
    weights = _weights(1)
    header = _header(5, weights, signer)
    whole = weightsync.publish_header(5, weights, {}, {}, pb.Canary(), signer)
    assert header.weights_hash == whole.weights_hash == weights_hash(weights)
    assert header.signature.content_sha256 == content_digest(weights)
    # Ed25519 is deterministic: the same signed bytes give the same signature bytes.
    assert header.signature.signature == whole.signature.signature
    Verifier.load(tmp_path / "k.pub").check(5, header.weights_hash, [t.meta(n) for n, t in weights.items()], pb.Canary(), header.signature)


# ---------------------------------------------------------------- the origin


async def _publish_parts(address: str, version: int, weights: Weights, count: int, order: list[int], header: pb.PublishHeader | None = None) -> list[pb.PublishResponse]:
    header = header or _header(version, weights)
    split = _split(weights, count)

    async def one(index: int, delay: float) -> pb.PublishResponse:
        await asyncio.sleep(delay)
        return await weightsync.publish_part(address, header, index, count, split[index])

    return list(await asyncio.gather(*(one(i, 0.05 * rank) for rank, i in enumerate(order))))


def _config(root: Path, **kw: object) -> WeightSyncConfig:
    return WeightSyncConfig(role="origin", data_dir=str(root), keyframe_every=2, chunk_mb=0.002, **kw)  # type: ignore[arg-type]


def test_parts_in_any_order_store_exactly_what_one_publish_stores(tmp_path: Path) -> None:
    versions = [_weights(2, shift) for shift in range(4)]

    async def body() -> None:
        async with serving(WeightSyncService(_config(tmp_path / "single"))) as single:
            for v, w in enumerate(versions):
                await weightsync.publish(single, v, w)
        orders = itertools.cycle([[2, 0, 1], [0, 1, 2], [1, 2, 0], [2, 1, 0]])
        async with serving(WeightSyncService(_config(tmp_path / "parted"))) as parted:
            for v, w in enumerate(versions):
                replies = await _publish_parts(parted, v, w, 3, next(orders))
                assert {r.version for r in replies} == {v} and len({r.encoded_bytes for r in replies}) == 1
            # An identical republish of a held version, in parts, is accepted and changes nothing.
            await _publish_parts(parted, 3, versions[3], 3, [1, 0, 2])

    asyncio.run(body())
    single, parted = _store_files(tmp_path / "single"), _store_files(tmp_path / "parted")
    assert len(single) >= 4 * 3 and single.keys() == parted.keys()
    for name in single:
        assert single[name] == parted[name], f"{name} differs"


def test_more_parts_than_tensors_leaves_empty_parts_that_still_complete_the_version(tmp_path: Path) -> None:
    weights = {n: t for n, t in _weights(9).items() if n in ("embed", "norm")}

    async def body() -> None:
        async with serving(WeightSyncService(_config(tmp_path / "parted"))) as parted:
            await _publish_parts(parted, 0, weights, 4, [3, 1, 0, 2])
        async with serving(WeightSyncService(_config(tmp_path / "single"))) as single:
            await weightsync.publish(single, 0, weights)

    asyncio.run(body())
    assert _store_files(tmp_path / "parted") == _store_files(tmp_path / "single")


def test_a_missing_part_times_out_and_every_waiting_part_hears_it(tmp_path: Path) -> None:
    weights = _weights(3)

    async def body() -> None:
        async with serving(WeightSyncService(_config(tmp_path / "o", part_timeout_s=0.5))) as address:
            header = _header(0, weights)
            split = _split(weights, 3)
            calls = [weightsync.publish_part(address, header, i, 3, split[i]) for i in (0, 2)]
            # Bounded here: an origin that never gives up would otherwise hang the test.
            results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 30)
            for exc in results:
                assert isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED, exc
                assert "[1]" in exc.details() and "part_timeout_s" in exc.details()
            assert await weightsync.latest_version(address) == -1
            # Nothing of it stayed: the whole version published again goes through.
            await _publish_parts(address, 0, weights, 3, [0, 1, 2], header)
            assert await weightsync.latest_version(address) == 0

    asyncio.run(body())


def _record_pendings(service: WeightSyncService) -> list[Any]:
    """The versions being assembled that parts joined, in order (wraps ``_join_part``)."""
    joined: list[Any] = []
    join = service._join_part

    def recording(header: pb.PublishHeader) -> Any:
        pending = join(header)
        joined.append(pending)
        return pending

    service._join_part = recording  # type: ignore[method-assign]
    return joined


async def _until(condition: Any, what: str) -> None:
    """Waits for ``condition()`` on the loop, failing (not hanging) after 30 s."""
    for _ in range(1500):
        if condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"never happened: {what}")


def _outcome(results: list[Any]) -> list[str]:
    return [r.code().name if isinstance(r, grpc.aio.AioRpcError) else f"version {r.version}" for r in results]


def test_a_part_timeout_due_as_the_last_part_completes_the_version_does_not_fail_the_stored_version(tmp_path: Path) -> None:
    """The part timeout falls due in the loop turn in which the last part is in: its
    callback is already queued behind that part's step (the loop takes every due timer
    before it runs what is ready). The version is then stored and every part answered
    with it; before, the timeout aborted the version after its store step was started,
    the other parts heard DEADLINE_EXCEEDED and the version was stored anyway."""
    weights = _weights(12)

    async def body() -> None:
        service = WeightSyncService(_config(tmp_path / "o", part_timeout_s=60.0))
        joined = _record_pendings(service)
        loop = asyncio.get_running_loop()
        to_completion = service._to_completion

        def timeout_due(step: Any, holding: Any = None) -> Any:
            pending = joined[-1]
            timer = pending.timer
            # What the loop does with a timer handle it already queued: runs it unless cancelled.
            loop.call_soon(lambda: timer.cancelled() or service._expire(pending))
            return to_completion(step, holding)

        service._to_completion = timeout_due  # type: ignore[method-assign]
        async with serving(service) as address:
            header, split = _header(0, weights), _split(weights, 2)
            first = asyncio.create_task(weightsync.publish_part(address, header, 0, 2, split[0]))
            await _until(lambda: bool(joined) and 0 in joined[-1].done, "part 0 received and encoded")
            last = weightsync.publish_part(address, header, 1, 2, split[1])
            results = await asyncio.wait_for(asyncio.gather(first, last, return_exceptions=True), 30)
            latest = await _latest(address)
        assert latest == 0 and _outcome(results) == ["version 0", "version 0"], (
            f"version stored: {latest == 0}; parts answered {_outcome(results)}"
        )

    asyncio.run(body())


def test_a_version_that_timed_out_while_its_last_part_encoded_is_not_stored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The other side of the race: the timeout comes first (the last part is still being
    encoded), every part hears DEADLINE_EXCEEDED, and the part that then finishes does
    not store the version."""
    from services.weightsync import server

    weights = _weights(13)
    release = threading.Event()
    encode = server.encode_tensors

    def held_encode(*args: Any, **kw: Any) -> Any:
        release.wait(30)
        return encode(*args, **kw)

    monkeypatch.setattr(server, "encode_tensors", held_encode)

    async def body() -> None:
        service = WeightSyncService(_config(tmp_path / "o", part_timeout_s=0.3))
        joined = _record_pendings(service)
        async with serving(service) as address:
            header, split = _header(0, weights), _split(weights, 2)
            calls = asyncio.gather(*(weightsync.publish_part(address, header, i, 2, split[i]) for i in (0, 1)), return_exceptions=True)
            try:
                await _until(lambda: len(joined) == 2, "both parts joined")
                await asyncio.wait_for(asyncio.wait({joined[0].result}), 30)  # the timeout aborted it
            finally:
                release.set()
            results = await asyncio.wait_for(calls, 30)
            assert _outcome(results) == ["DEADLINE_EXCEEDED", "DEADLINE_EXCEEDED"]
            assert await _latest(address) == -1

    asyncio.run(body())


def test_parts_encoded_against_a_version_that_is_no_longer_the_latest_are_aborted(tmp_path: Path) -> None:
    """The parts of a version are encoded against the latest version when the first came.
    If a whole-version Publish stores a newer one meanwhile, the assembled version's
    deltas no longer apply to the latest: every part hears ABORTED (publish again) and
    nothing of it is stored; published again, it goes in as a delta on the new latest."""
    w0, w1, w2 = _weights(14), _weights(14, 1), _weights(14, 2)

    async def body() -> None:
        service = WeightSyncService(_config(tmp_path / "o", part_timeout_s=60.0))
        joined = _record_pendings(service)
        async with serving(service) as address:
            await weightsync.publish(address, 0, w0)
            header2, split2 = _header(2, w2), _split(w2, 2)
            first = asyncio.create_task(weightsync.publish_part(address, header2, 0, 2, split2[0]))
            await _until(lambda: bool(joined) and 0 in joined[-1].done, "part 0 of version 2 received and encoded (on version 0)")
            assert joined[-1].base_version == 0
            await weightsync.publish(address, 1, w1)  # the latest moves on under the pending parts
            last = weightsync.publish_part(address, header2, 1, 2, split2[1])
            results = await asyncio.wait_for(asyncio.gather(first, last, return_exceptions=True), 30)
            assert _outcome(results) == ["ABORTED", "ABORTED"]
            assert all("publish it again" in r.details() for r in results)
            assert await _latest(address) == 1
            await _publish_parts(address, 2, w2, 2, [1, 0], header2)
            manifest = await weightsync.manifest(address, 2)
            assert (manifest.base_version, manifest.weights_hash) == (1, weights_hash(w2))

    asyncio.run(body())


def test_parts_that_change_the_tensor_set_are_refused_like_a_whole_publish(tmp_path: Path) -> None:
    """A version assembled from parts is checked like a whole Publish: one whose tensor
    names differ from the version before (a tensor missing) is INVALID_ARGUMENT for every
    part, nothing of it is stored, and the complete version goes in afterwards."""
    w0, w1 = _weights(15), _weights(15, 1)
    fewer = {n: t for n, t in w1.items() if n != "norm"}

    async def body() -> None:
        async with serving(WeightSyncService(_config(tmp_path / "o", part_timeout_s=60.0))) as address:
            await _publish_parts(address, 0, w0, 2, [0, 1])
            calls = [weightsync.publish_part(address, _header(1, fewer), i, 2, part) for i, part in enumerate(_split(fewer, 2))]
            results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 30)
            assert _outcome(results) == ["INVALID_ARGUMENT", "INVALID_ARGUMENT"]
            assert all("changes the tensor set" in r.details() and "norm" in r.details() for r in results)
            assert await _latest(address) == 0
            await _publish_parts(address, 1, w1, 2, [1, 0])
            assert (await weightsync.manifest(address, 1)).weights_hash == weights_hash(w1)

    asyncio.run(body())


def test_duplicate_foreign_and_inconsistent_parts_are_refused(tmp_path: Path) -> None:
    weights, other = _weights(4), _weights(5)

    async def body() -> None:
        async with serving(WeightSyncService(_config(tmp_path / "o", part_timeout_s=2.0))) as address:
            header = _header(0, weights)
            split = _split(weights, 2)
            broken = asyncio.create_task(weightsync.publish_part(address, header, 0, 2, split[0]))
            await asyncio.sleep(0.3)
            # Its sender's stream breaks while the part waits for the others: sent again, the
            # same part joins the version instead of being refused as a duplicate.
            broken.cancel()
            first = asyncio.create_task(weightsync.publish_part(address, header, 0, 2, split[0]))
            again = asyncio.create_task(weightsync.publish_part(address, header, 0, 2, split[0]))
            await asyncio.sleep(0.3)
            # The same index with other contents is refused.
            changed = {**split[0], "extra": RawTensor("bf16", (2,), np.zeros(2, np.uint16))}
            with pytest.raises(grpc.aio.AioRpcError) as dup:
                await weightsync.publish_part(address, header, 0, 2, changed)
            assert dup.value.code() == grpc.StatusCode.ALREADY_EXISTS and "other contents" in dup.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as foreign:
                await weightsync.publish_part(address, _header(1, other), 1, 2, _split(other, 2)[1], busy_timeout_s=0)
            # (Refused at its header, possibly while its chunks were still being written:
            # then grpcio's client reports its own INTERNAL instead, grpc/grpc#36066.)
            assert ended_while_sending(foreign.value) or (weightsync.origin_busy(foreign.value) and "version 0 is being assembled" in foreign.value.details())
            # The pending version is untouched by either: its second part completes it.
            await weightsync.publish_part(address, header, 1, 2, split[1])
            assert (await first).version == 0 and (await again).version == 0

            # A part whose version fields differ (another weights hash) aborts the version.
            header1 = _header(1, other)
            split1 = _split(other, 2)
            waiting = asyncio.create_task(weightsync.publish_part(address, header1, 0, 2, split1[0]))
            await asyncio.sleep(0.3)
            with pytest.raises(grpc.aio.AioRpcError) as odd:
                await weightsync.publish_part(address, _header(1, _weights(6)), 1, 2, _split(_weights(6), 2)[1])
            assert odd.value.code() == grpc.StatusCode.INVALID_ARGUMENT or ended_while_sending(odd.value)
            with pytest.raises(grpc.aio.AioRpcError) as aborted:
                await waiting
            assert aborted.value.code() == grpc.StatusCode.ABORTED and "version fields" in aborted.value.details()

            # A part whose bytes are not what its header's part hash says (a stale tensor).
            stale = dict(split1[1])
            name = sorted(stale)[0]
            stale_header = parts.part_header(header1, 1, 2, split1[1])
            bad = RawTensor(stale[name].dtype, stale[name].shape, stale[name].bits + np.uint16(1))
            requests = list(weightsync.publish_requests(1, {**stale, name: bad}, header=stale_header))
            waiting = asyncio.create_task(weightsync.publish_part(address, header1, 0, 2, split1[0]))
            await asyncio.sleep(0.3)
            async with weightsync.open_channel(address) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as corrupt:
                    await weightsync.pb_grpc.WeightSyncStub(channel).Publish(iter(requests))
            assert corrupt.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "hash to" in corrupt.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as aborted:
                await waiting
            assert aborted.value.code() == grpc.StatusCode.ABORTED
            assert await weightsync.latest_version(address) == 0

    asyncio.run(body())


def _record_publish_errors(service: WeightSyncService) -> list[Exception]:
    """The errors the origin's Publish calls ended with, in order (set before ``register``)."""
    errors: list[Exception] = []
    publish = service.Publish

    async def recording(request_iterator: Any, context: Any) -> pb.PublishResponse:
        try:
            return await publish(request_iterator, context)
        except Exception as exc:
            errors.append(exc)
            raise

    service.Publish = recording  # type: ignore[method-assign]
    return errors


def test_a_part_of_another_version_is_refused_as_busy_and_sent_again_until_the_origin_takes_it(tmp_path: Path) -> None:
    """While one version's parts are assembled, a part of another is refused with ABORTED
    marked busy (retrying can succeed; FAILED_PRECONDITION made the trainer give the
    version up as refused), and publish_part sends it again until the origin takes it."""
    w0, w1 = _weights(14), _weights(14, 1)

    async def body() -> None:
        service = WeightSyncService(_config(tmp_path / "o", part_timeout_s=60.0))
        errors = _record_publish_errors(service)
        async with serving(service) as address:
            header0, split0 = _header(0, w0), _split(w0, 2)
            header1, split1 = _header(1, w1), _split(w1, 2)
            first = asyncio.create_task(weightsync.publish_part(address, header0, 0, 2, split0[0]))
            await _until(lambda: service._pending is not None, "version 0 being assembled")
            # No time to wait: the refusal comes back as it is, unless grpcio's client lost it
            # to a write still under way (its own INTERNAL: grpc/grpc#36066); the origin's
            # answer is read where it was made.
            with pytest.raises(grpc.aio.AioRpcError) as busy:
                await weightsync.publish_part(address, header1, 0, 2, split1[0], busy_timeout_s=0)
            (refusal,) = errors
            assert "version 0 is being assembled (" in str(refusal) and "send this part again" in str(refusal)
            if not ended_while_sending(busy.value):
                assert busy.value.code() == grpc.StatusCode.ABORTED and weightsync.origin_busy(busy.value), busy.value
                assert busy.value.details() == str(refusal)
            # With time to wait, version 1's parts are sent again until version 0 is stored.
            later = asyncio.gather(*(weightsync.publish_part(address, header1, i, 2, split1[i]) for i in (0, 1)))
            await _until(lambda: len(errors) >= 3, "both parts of version 1 refused while version 0 is assembled")
            await weightsync.publish_part(address, header0, 1, 2, split0[1])
            replies = await asyncio.wait_for(later, 30)
            assert [r.version for r in replies] == [1, 1] and (await first).version == 0
            assert await _latest(address) == 1
            assert all("version 0 is being assembled" in str(e) for e in errors), errors

    asyncio.run(body())


def _other_contents(part: Weights) -> Weights:
    name = sorted(part)[0]
    t = part[name]
    return {**part, name: RawTensor(t.dtype, t.shape, t.bits + np.uint16(1))}


async def _latest(address: str) -> int:
    return await weightsync.latest_version(address)


def test_a_late_retry_of_a_stored_versions_part_is_answered_from_the_store_and_holds_nothing_up(tmp_path: Path) -> None:
    w0, w1, w2 = _weights(10), _weights(10, 1), _weights(10, 2)

    async def body() -> None:
        async with serving(WeightSyncService(_config(tmp_path / "o", part_timeout_s=60.0))) as address:
            await _publish_parts(address, 0, w0, 3, [0, 1, 2])
            stored = await _publish_parts(address, 1, w1, 3, [2, 0, 1])
            header1, split1 = _header(1, w1), _split(w1, 3)
            # A rank's retry of its part, after every part was in and the version stored
            # (its stream broke while it waited for the answer): the same answer, at once.
            again = await asyncio.wait_for(weightsync.publish_part(address, header1, 1, 3, split1[1]), 5)
            assert again == stored[0]
            # Other contents under the held version: refused as a republish of other weights is.
            with pytest.raises(grpc.aio.AioRpcError) as other:
                await asyncio.wait_for(weightsync.publish_part(address, header1, 1, 3, _other_contents(split1[1])), 5)
            assert other.value.code() == grpc.StatusCode.ALREADY_EXISTS and "other contents" in other.value.details()
            # A part of a version older than the newest: checked against it too.
            old = await asyncio.wait_for(weightsync.publish_part(address, _header(0, w0), 2, 3, _split(w0, 3)[2]), 5)
            assert old.version == 0
            # None of them opened a version: the next version's parts are taken at once.
            replies = await asyncio.wait_for(_publish_parts(address, 2, w2, 3, [1, 2, 0]), 10)
            assert {r.version for r in replies} == {2} and await _latest(address) == 2

    asyncio.run(body())


def test_a_part_retried_while_its_version_is_being_stored_gets_that_versions_answer(tmp_path: Path) -> None:
    w0, w1 = _weights(11), _weights(11, 1)
    storing, release = threading.Event(), threading.Event()

    async def body() -> None:
        service = WeightSyncService(_config(tmp_path / "o", part_timeout_s=60.0))
        real = service.store.publish_assembled

        def slow_store(*args: object, **kw: object) -> object:
            storing.set()
            release.wait(10)
            return real(*args, **kw)  # type: ignore[arg-type]

        service.store.publish_assembled = slow_store  # type: ignore[method-assign]
        async with serving(service) as address:
            header0, split0 = _header(0, w0), _split(w0, 2)
            both = asyncio.gather(*(weightsync.publish_part(address, header0, i, 2, split0[i]) for i in (0, 1)))
            assert await asyncio.to_thread(storing.wait, 10)
            # Every part is in and the store step runs: a retry of part 0 comes now.
            retry = asyncio.create_task(weightsync.publish_part(address, header0, 0, 2, split0[0]))
            await asyncio.sleep(0.3)
            release.set()
            replies = await asyncio.wait_for(both, 10)
            assert await asyncio.wait_for(retry, 5) == replies[0]
            replies = await asyncio.wait_for(_publish_parts(address, 1, w1, 2, [1, 0]), 10)
            assert {r.version for r in replies} == {1} and await _latest(address) == 1

    asyncio.run(body())


def test_signed_parts_verify_at_an_origin_with_the_key(tmp_path: Path) -> None:
    """A verifying origin stores signed parts and refuses unsigned ones (PERMISSION_DENIED);
    a part of a version it holds is answered from the store only under that version's own
    signature (Ed25519 is deterministic: identical contents carry exactly that one)."""
    generate_signing_key(tmp_path / "k", tmp_path / "k.pub")
    signer = Signer.load(tmp_path / "k")
    weights = _weights(7)

    async def body() -> None:
        async with serving(WeightSyncService(_config(tmp_path / "o", verify_key=str(tmp_path / "k.pub")))) as address:
            await _publish_parts(address, 0, weights, 2, [1, 0], _header(0, weights, signer))
            manifest = await weightsync.manifest(address, 0)
            assert manifest.signature.content_sha256 == content_digest(weights)
            # A part of the held version sent again (a rank's late retry) is answered from the
            # store, but at a verifying origin only under the held version's own signature:
            # the same tensors unsigned, or signed with another key, are refused.
            split = _split(weights, 2)
            again = await weightsync.publish_part(address, _header(0, weights, signer), 1, 2, split[1])
            assert again.version == 0
            generate_signing_key(tmp_path / "other", tmp_path / "other.pub")
            for what, header in (("unsigned", _header(0, weights)), ("another key", _header(0, weights, Signer.load(tmp_path / "other")))):
                with pytest.raises(grpc.aio.AioRpcError) as retry:
                    await weightsync.publish_part(address, header, 1, 2, split[1])
                assert retry.value.code() == grpc.StatusCode.PERMISSION_DENIED, what
                assert "not the held version's" in (retry.value.details() or ""), what
            assert await weightsync.manifest(address, 0) == manifest
            unsigned = _header(1, _weights(8))
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await _publish_parts(address, 1, _weights(8), 2, [0, 1], unsigned)
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED

    asyncio.run(body())


def test_a_rank_encodes_on_its_share_of_the_cores_it_may_use(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rank on a host encodes at once: each takes its share of the cores its
    affinity allows, not the host's count (8 ranks x 64 threads on 64 cores before)."""
    import os

    from services.trainer.shard_publish import PartSender

    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert parts.rank_encode_threads() == 8
    for local, threads in (("4", 2), ("16", 1), ("", 8), ("x", 8)):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
        assert parts.rank_encode_threads() == threads, local
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    sender = PartSender("127.0.0.1:1", (), frozenset())
    try:
        assert sender.encoder.threads == 4
    finally:
        sender.close()


def test_a_refusal_grpcios_client_lost_is_heard_by_sending_the_part_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The origin refuses a part at its header, often while its chunks are still being
    written; grpcio's asyncio client then reports its own INTERNAL and loses the refusal
    (grpc/grpc#36066, about 1 call in 40 here). publish_part sends the part again, as it
    does a busy refusal, within its busy timeout; with none, the error is raised as it came."""
    from grpc.aio import Metadata

    from meridian.grpc_runtime import CLIENT_WRITE_RACE

    weights = _weights(3)
    sent: list[int] = []

    async def lost_once(*args: Any) -> pb.PublishResponse:
        sent.append(len(sent))
        if len(sent) == 1:
            raise grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, Metadata(), Metadata(), details=CLIENT_WRITE_RACE)
        return pb.PublishResponse(version=0)

    monkeypatch.setattr(weightsync, "_send_part", lost_once)
    # Nothing listens there: the channel is never used, every try goes through lost_once.
    reply = asyncio.run(weightsync.publish_part("127.0.0.1:1", _header(0, weights), 0, 1, weights))
    assert reply.version == 0 and sent == [0, 1]
    sent.clear()
    with pytest.raises(grpc.aio.AioRpcError) as lost:
        asyncio.run(weightsync.publish_part("127.0.0.1:1", _header(0, weights), 0, 1, weights, busy_timeout_s=0))
    assert ended_while_sending(lost.value) and sent == [0]
