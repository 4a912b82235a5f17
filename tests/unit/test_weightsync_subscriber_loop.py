"""A subscriber's one full pass over the weights it was handed (the element-hash sums its
first delta needs) runs off the event loop: a relay forwards to its own subscribers on
that loop, and builds a new subscriber at every reconnect upstream."""
from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import numpy as np
import pytest

from meridian import elementhash
from meridian.tensors import RawTensor
from meridian.v1 import weightsync_pb2 as pb
from services.weightsync import client as weightsync
from services.weightsync.config import WeightSyncConfig
from services.weightsync.server import WeightSyncService
from services.weightsync.signing import Signer, Verifier, generate_signing_key
from tests.conftest import serving

Weights = dict[str, RawTensor]
PASS_S = 0.5  # how long the stand-in full pass blocks whichever thread runs it


def _weights(seed: int) -> Weights:
    rng = np.random.default_rng(seed)
    return {f"t{i}": RawTensor("bf16", (64, 32), rng.integers(0x3C00, 0x3F00, size=64 * 32, dtype=np.uint16)) for i in range(4)}


def _changed(weights: Weights) -> Weights:
    out = {}
    for name, t in weights.items():
        bits = t.bits.copy()
        bits[::97] += np.uint16(1)  # a sparse change, like a training step
        out[name] = RawTensor(t.dtype, t.shape, bits)
    return out


class LoopLag:
    """The longest the event loop went without running a 10 ms ticker, while open."""

    def __init__(self) -> None:
        self.worst = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            before = loop.time()
            await asyncio.sleep(0.01)
            self.worst = max(self.worst, loop.time() - before - 0.01)

    async def __aenter__(self) -> LoopLag:
        self._task = asyncio.create_task(self._tick())
        await asyncio.sleep(0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


def test_the_first_deltas_full_pass_does_not_block_the_event_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    w0 = _weights(0)
    w1 = _changed(w0)
    passes: list[float] = []
    real = elementhash.many_tensor_sums

    def slow_sums(arrays: list[np.ndarray]) -> list[elementhash.Sums]:
        # A model large enough that one pass over it takes PASS_S.
        passes.append(PASS_S)
        time.sleep(PASS_S)
        return real(arrays)

    async def body() -> None:
        async with serving(WeightSyncService(WeightSyncConfig(role="origin", data_dir=str(tmp_path), chunk_mb=0.002))) as address:
            await weightsync.publish(address, 0, w0)
            await weightsync.publish(address, 1, w1)
            monkeypatch.setattr(elementhash, "many_tensor_sums", slow_sums)
            subscriber = weightsync.WeightSubscriber(address, w0, 0, decode_threads=2)
            try:
                async with LoopLag() as lag:
                    updates = [u async for u in subscriber.updates(follow=False)]
            finally:
                await subscriber.close()
        assert passes == [PASS_S], "the first delta made its one full pass"
        assert [u.version for u in updates] == [1]
        assert all(np.array_equal(updates[0].weights[n].bits, w1[n].bits) for n in w1), "the delta decoded and verified"
        assert lag.worst < 0.15, f"the event loop stalled {lag.worst:.2f} s during the full pass"

    asyncio.run(body())


def test_a_verifying_subscribers_first_delta_is_checked_once(tmp_path: Path) -> None:
    """The signature check of a subscriber's first delta (an Ed25519 verification over
    every tensor's name, dtype and shape) is made once, before the full pass, and not
    again when the version begins; so is every later version's."""
    generate_signing_key(tmp_path / "key.pem", tmp_path / "pub.pem")
    signer, verifier = Signer.load(tmp_path / "key.pem"), Verifier.load(tmp_path / "pub.pem")
    checked: list[int] = []
    real = verifier.check_manifest

    def counting(manifest: pb.Manifest) -> None:
        checked.append(manifest.version)
        real(manifest)

    verifier.check_manifest = counting  # type: ignore[method-assign]
    w0 = _weights(0)
    w1 = _changed(w0)
    w2 = _changed(w1)

    async def body() -> None:
        async with serving(WeightSyncService(WeightSyncConfig(role="origin", data_dir=str(tmp_path / "o"), chunk_mb=0.002))) as address:
            for version, weights in enumerate((w0, w1)):
                await weightsync.publish(address, version, weights, signer=signer)
            subscriber = weightsync.WeightSubscriber(address, w0, 0, decode_threads=2, verifier=verifier)
            try:
                updates = [u.version async for u in subscriber.updates(follow=False)]  # the first delta
                await weightsync.publish(address, 2, w2, signer=signer)
                updates += [u.version async for u in subscriber.updates(follow=False)]  # a later one
            finally:
                await subscriber.close()
        assert updates == [1, 2]
        assert checked == [1, 2], f"signature checks made per version: {checked}"

    asyncio.run(body())
