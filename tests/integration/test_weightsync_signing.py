"""Signed policy versions over real gRPC servers: an origin with a verify key refuses
Publish streams the trainer's key did not sign; a relay and rollout's weight follower,
fed by a forged upstream (a weightsync holding a self-consistent version with valid
chunk checksums and a weights hash matching its forged weights), refuse it and keep the
version they hold."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from meridian.tensors import RawTensor, weights_hash
from meridian.v1 import weightsync_pb2 as pb
from meridian.v1 import weightsync_pb2_grpc as pb_grpc
from services.rollout.weight_changes import ChangeSet
from services.rollout.weight_follower import WeightFollower
from services.rollout.weight_updates import UpdateReport
from services.weightsync import client
from services.weightsync.client import WeightSubscriber
from services.weightsync.config import WeightSyncConfig
from services.weightsync.server import WeightSyncService
from services.weightsync.signing import Signer, Verifier, generate_signing_key
from tests.integration.test_weightsync_links import _status, _wait_for
from tests.synthetic_weights import bf16_weights, copied, same, stepped

Weights = dict[str, RawTensor]
CANARY = pb.Canary(sequences=[pb.CanarySequence(token_ids=[3, 4], logprobs=[0.0, -0.75])])
#: How a forged upstream's version 1 was made (see :func:`_forge`).
FORGERIES = ["unsigned", "attacker key", "forged weights under the trainer's signature"]


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    folder = tmp_path_factory.mktemp("signing")
    generate_signing_key(folder / "signing-key.pem", folder / "signing-pub.pem")
    generate_signing_key(folder / "attacker-key.pem", folder / "attacker-pub.pem")
    return SimpleNamespace(
        trainer=Signer.load(folder / "signing-key.pem"), attacker=Signer.load(folder / "attacker-key.pem"), public=str(folder / "signing-pub.pem")
    )


def _service(tmp_path: Path, name: str, **kw: Any) -> WeightSyncService:
    return WeightSyncService(WeightSyncConfig(data_dir=str(tmp_path / name), chunk_mb=1 / 64, **kw))


def _header(version: int, weights: Weights, signature: pb.VersionSignature | None) -> pb.PublishHeader:
    return pb.PublishHeader(version=version, weights_hash=weights_hash(weights), canary=CANARY, signature=signature)


async def _publish(address: str, version: int, weights: Weights, header: pb.PublishHeader) -> pb.PublishResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        return await pb_grpc.WeightSyncStub(channel).Publish(client.publish_requests(version, weights, header=header))


async def _genuine(upstream: str, keys: SimpleNamespace, v0: Weights) -> None:
    """The trainer's version 0, as it reached the forger."""
    await _publish(upstream, 0, v0, _header(0, v0, keys.trainer.sign(0, weights_hash(v0), v0, CANARY)))


async def _forge(upstream: str, keys: SimpleNamespace, v0: Weights, forgery: str) -> None:
    """Publishes to a weightsync that checks nothing a forged version 1 on top of ``v0``:
    self-consistent (valid chunk checksums, a weights hash matching the forged weights),
    and unsigned, signed with an attacker's key, or carrying a trainer signature whose
    content digest is not the forged weights' (what a forger who steered the additive
    weights hash to the signed one would send)."""
    forged = stepped(v0, 66, frac=0.01)
    if forgery == "unsigned":
        signature = None
    elif forgery == "attacker key":
        signature = keys.attacker.sign(1, weights_hash(forged), forged, CANARY)
    else:
        signature = keys.trainer.sign(1, weights_hash(forged), stepped(v0, 1, frac=0.01), CANARY)
    await _publish(upstream, 1, forged, _header(1, forged, signature))


# ---------------------------------------------------------------- origin


def test_origin_with_a_verify_key_refuses_unsigned_and_badly_signed_publish(tmp_path: Path, grpc_serving: Any, keys: SimpleNamespace) -> None:
    v0 = bf16_weights(0, 60_000)
    other = stepped(v0, 5, frac=0.01)

    async def main() -> None:
        async with grpc_serving(_service(tmp_path, "origin", verify_key=keys.public)) as origin:
            refused = {
                "unsigned": (v0, _header(0, v0, None)),
                "attacker key": (v0, _header(0, v0, keys.attacker.sign(0, weights_hash(v0), v0, CANARY))),
                # A link between trainer and origin keeps the signed header, swaps the tensors.
                "tensors swapped": (other, _header(0, v0, keys.trainer.sign(0, weights_hash(v0), v0, CANARY))),
                # ... or keeps the tensors and edits a covered field of the header.
                "canary edited": (v0, pb.PublishHeader(
                    version=0, weights_hash=weights_hash(v0), canary=pb.Canary(), signature=keys.trainer.sign(0, weights_hash(v0), v0, CANARY)
                )),
                # Signed by the trainer's key over an empty weights hash: the manifest would
                # carry the store's own hash, which that signature does not cover, so no
                # verifying receiver could take the version.
                "weights hash left out": (v0, pb.PublishHeader(version=0, canary=CANARY, signature=keys.trainer.sign(0, "", v0, CANARY))),
            }
            for what, (weights, header) in refused.items():
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await _publish(origin, 0, weights, header)
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, what
                assert "version 0" in (err.value.details() or ""), what
            assert (await _status(origin)).latest_version == -1, "a refused Publish was stored"
            # The trainer's path: client.publish with its signer.
            reply = await client.publish(origin, 0, v0, canary=CANARY, signer=keys.trainer)
            assert reply.version == 0
            manifest = await client.manifest(origin, 0)
            Verifier.load(keys.public).check_manifest(manifest)
            assert manifest.signature.key_id == keys.trainer.key_id

    asyncio.run(main())


# ---------------------------------------------------------------- relay


@pytest.mark.parametrize("forgery", FORGERIES)
def test_relay_refuses_a_forged_version_from_upstream_and_keeps_serving_the_previous(
    tmp_path: Path, grpc_serving: Any, keys: SimpleNamespace, forgery: str, caplog: pytest.LogCaptureFixture
) -> None:
    v0 = bf16_weights(0, 60_000)

    async def main() -> None:
        async with grpc_serving(_service(tmp_path, "forger")) as upstream:
            await _genuine(upstream, keys, v0)
            relay_service = _service(tmp_path, "relay", role="relay", upstream=upstream, verify_key=keys.public)
            async with grpc_serving(relay_service) as relay:
                # A subscriber that checks nothing itself: what it gets is what the relay serves.
                seen: list[int] = []
                sub = WeightSubscriber(relay, None, -1, on_manifest=lambda m: seen.append(m.version))
                got: list[int] = []

                async def follow() -> None:
                    async for update in sub.updates(follow=True):
                        got.append(update.version)

                task = asyncio.create_task(follow())
                try:
                    await _wait_for(lambda: got == [0], "version 0 at the relay's subscriber")
                    await _forge(upstream, keys, v0, forgery)
                    await _wait_for(lambda: "version 1" in caplog.text, "the relay's refusal")
                    await asyncio.sleep(0.5)  # the relay retries upstream meanwhile
                    status = await _status(relay)
                finally:
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                    await sub.close()
                assert status.latest_version == 0 and list(status.versions) == [0], "the forged version was stored"
                assert got == [0], "the relay served the forged version to completion"
                if forgery != "forged weights under the trainer's signature":
                    # Its manifest failed: nothing of version 1 was announced or served.
                    assert seen == [0]
                assert same(relay_service.store.weights, v0)

    with caplog.at_level(logging.ERROR, logger="services.weightsync.server"):
        asyncio.run(main())
    assert "still serving version 0" in caplog.text


def test_relay_with_a_verify_key_takes_signed_versions(tmp_path: Path, grpc_serving: Any, keys: SimpleNamespace) -> None:
    """The control: the same relay passes genuine versions, deltas and keyframes alike."""
    versions = [bf16_weights(0, 60_000)]
    versions += [stepped(versions[-1], v, frac=0.01) for v in (1, 2)]

    async def main() -> None:
        async with grpc_serving(_service(tmp_path, "origin", verify_key=keys.public)) as origin:
            await client.publish(origin, 0, versions[0], canary=CANARY, signer=keys.trainer)
            async with grpc_serving(_service(tmp_path, "relay", role="relay", upstream=origin, verify_key=keys.public)) as relay:
                sub = WeightSubscriber(relay, None, -1, verifier=Verifier.load(keys.public))
                got: list[tuple[int, Weights]] = []

                async def follow() -> None:
                    async for update in sub.updates(follow=True):
                        got.append((update.version, copied(update.weights)))

                task = asyncio.create_task(follow())
                try:
                    await _wait_for(lambda: len(got) == 1, "version 0")
                    for v in (1, 2):
                        await client.publish(origin, v, versions[v], canary=CANARY, signer=keys.trainer)
                    await _wait_for(lambda: len(got) == 3, "versions 1 and 2")
                finally:
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                    await sub.close()
                assert [v for v, _ in got] == [0, 1, 2] and all(same(w, versions[v]) for v, w in got)

    asyncio.run(main())


# ---------------------------------------------------------------- rollout


class _FakeUpdater:
    """Stands in for rollout's WeightUpdater (which writes into vLLM): records what the
    weight follower decided to apply, and accepts it."""

    def __init__(self) -> None:
        self.engine = SimpleNamespace(version=0)
        self.applied: list[tuple[int, Weights]] = []

    async def update(self, changes: ChangeSet, truth: Weights, canary: Any, previous: Any, trace_context: Any = None) -> UpdateReport:
        self.applied.append((changes.version, copied(truth)))
        self.engine.version = changes.version
        return UpdateReport(changes.version, True, "fake")


async def _follow_until(follower: WeightFollower, cond: Callable[[], bool], what: str) -> None:
    task = asyncio.create_task(follower.run())
    try:
        await _wait_for(cond, what)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@pytest.mark.parametrize("forgery", FORGERIES)
def test_rollout_follower_refuses_a_forged_version_and_keeps_its_served_one(
    tmp_path: Path, grpc_serving: Any, keys: SimpleNamespace, forgery: str
) -> None:
    v0 = bf16_weights(0, 60_000)

    async def main() -> None:
        async with grpc_serving(_service(tmp_path, "forger")) as upstream:
            await _genuine(upstream, keys, v0)
            await _forge(upstream, keys, v0, forgery)
            held = copied(v0)
            updater = _FakeUpdater()
            follower = WeightFollower(upstream, updater, held, weights_hash(v0), Verifier.load(keys.public))  # type: ignore[arg-type]
            await _follow_until(follower, lambda: follower.updates_rejected >= 1, "the follower's refusal")
            assert updater.applied == [], "a forged version reached the engine"
            assert updater.engine.version == 0 and follower.weights_hash == weights_hash(v0)
            assert "version 1" in follower.last_update_error
            assert same(held, v0), "the refused version was left in the held weights"

    asyncio.run(main())


def test_rollout_follower_with_a_verify_key_applies_signed_versions(tmp_path: Path, grpc_serving: Any, keys: SimpleNamespace) -> None:
    """The control: the same follower applies a version the trainer signed."""
    v0 = bf16_weights(0, 60_000)
    v1 = stepped(v0, 1, frac=0.01)

    async def main() -> None:
        async with grpc_serving(_service(tmp_path, "origin")) as origin:
            for v, w in ((0, v0), (1, v1)):
                await client.publish(origin, v, w, canary=CANARY, signer=keys.trainer)
            updater = _FakeUpdater()
            follower = WeightFollower(origin, updater, copied(v0), weights_hash(v0), Verifier.load(keys.public))  # type: ignore[arg-type]
            await _follow_until(follower, lambda: bool(updater.applied), "version 1 applied")
            assert [v for v, _ in updater.applied] == [1] and same(updater.applied[0][1], v1)
            assert follower.updates_rejected == 0

    asyncio.run(main())


# ---------------------------------------------------------------- meridian up


def test_meridian_up_signs_versions_and_every_receiver_verifies(stack: Any) -> None:
    """Under `meridian up` signing is on with no step of the user's: the trainer signs with
    the credentials folder's key, the origin and the rollout verify with its public key,
    and the versions weightsync serves verify."""
    folder = Path(stack.credentials)
    verifier = Verifier.load(folder / "signing-pub.pem")

    def argv(name: str) -> list[str]:
        return Path(f"/proc/{stack.pids[name]}/cmdline").read_bytes().decode().split("\0")

    for name, flag, file in (("trainer", "--signing-key", "signing-key.pem"), ("weightsync", "--verify-key", "signing-pub.pem"), ("rollout", "--verify-key", "signing-pub.pem")):
        args = argv(name)
        assert flag in args and args[args.index(flag) + 1] == str(folder / file), (name, args)
    manifest = asyncio.run(client.manifest(stack.addresses["weightsync"], -1))
    verifier.check_manifest(manifest)
    assert manifest.signature.key_id == verifier.key_id
