"""Readers on the event loop see one state of the store, whatever a store thread is
doing: a store step (see ``WeightSyncService._store_step``) runs on a thread under the
store lock, while Status, GetManifest, FetchChunk, Subscribe and a sharded publish's
first part read the store on the loop without that lock. The thread is paused after each
of its attribute writes, the readers run on the loop right there, and what they saw must
be the state before the step or the state after it, never a mix (a mix of the latest
weights and the previous version's position indexes aborted the next sharded version
with a 'stale index' error)."""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from meridian.tensors import RawTensor
from meridian.v1 import weightsync_pb2 as pb
from services.weightsync import client as weightsync
from services.weightsync import parts
from services.weightsync.config import WeightSyncConfig
from services.weightsync.server import WeightSyncService
from services.weightsync.store import VersionStore
from tests.conftest import serving

Weights = dict[str, RawTensor]
#: Bounds the wait for the loop's readers, so that a broken test fails instead of hanging.
WAIT_S = 30.0


def _weights(seed: int) -> Weights:
    rng = np.random.default_rng(seed)
    return {f"t{i}": RawTensor("bf16", (64, 32), rng.integers(0x3C00, 0x3F00, size=64 * 32, dtype=np.uint16)) for i in range(3)}


def _changed(weights: Weights, step: int) -> Weights:
    out = {}
    for name, t in weights.items():
        bits = t.bits.copy()
        bits[step::97] += np.uint16(1)  # a sparse change, like a training step
        out[name] = RawTensor(t.dtype, t.shape, bits)
    return out


class _PausedWrites(VersionStore):
    """A store whose attribute writes made on a thread other than the loop's each run
    ``on_write`` on the loop before the thread goes on (set ``loop`` and ``on_write`` to
    arm it): the loop's readers then run at every point where a real thread switch could
    let them in."""

    loop: asyncio.AbstractEventLoop | None = None
    on_write: Callable[[str], Any] | None = None

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        loop, on_write = type(self).loop, type(self).on_write
        if loop is None or on_write is None or threading.current_thread() is threading.main_thread():
            return
        asyncio.run_coroutine_threadsafe(on_write(name), loop).result(WAIT_S)


def _head(store: VersionStore) -> tuple[int, object, object]:
    """What a new sharded version is coded against: the latest version, its weights, and
    what its encoding left for coding the next (position indexes, element-hash sums)."""
    return store.latest, store.weights, store.carried


def _same(state: tuple[int, object, object], head: tuple[int, object, object]) -> bool:
    return state[0] == head[0] and state[1] is head[1] and state[2] is head[2]


def _described(state: tuple[int, object, object], before: tuple[int, object, object], after: tuple[int, object, object]) -> str:
    def of(i: int) -> str:
        return next((f"version {h[0]}" for h in (before, after) if state[i] is h[i]), "neither version")

    return f"latest {state[0]}, the weights of {of(1)}, the carried indexes and sums of {of(2)}"


def test_readers_on_the_loop_see_the_store_before_or_after_a_store_step_never_between(tmp_path: Path) -> None:
    w0 = _weights(0)
    w1 = _changed(w0, 1)
    w2 = _changed(w1, 2)
    w3 = _changed(w2, 3)
    part = parts.part_header(weightsync.publish_header(3, w3), 0, 2, {"t0": w3["t0"]})

    async def body() -> None:
        service = WeightSyncService(WeightSyncConfig(role="origin", data_dir=str(tmp_path), chunk_mb=0.001, keep_versions=2, keyframe_every=2))
        service.store.__class__ = _PausedWrites
        seen: list[tuple[str, tuple[int, object, object]]] = []
        problems: list[str] = []

        async def read(write: str) -> None:
            # The first part of version 3 arriving now: what it would be coded against.
            pending = service._join_part(part)
            seen.append((write, (pending.base_version, pending.base, pending.base_carried)))
            assert pending.timer is not None
            pending.timer.cancel()
            service._pending = None
            status = await service.Status(pb.WeightSyncStatusRequest(), None)  # type: ignore[arg-type]
            if status.latest_version not in status.versions:
                problems.append(f"after {write}: Status lists {list(status.versions)} without its latest {status.latest_version}")
            manifest = await service.GetManifest(pb.GetManifestRequest(version=-1), None)  # type: ignore[arg-type]
            if manifest.version != status.latest_version:
                problems.append(f"after {write}: GetManifest(-1) gave version {manifest.version}, Status latest {status.latest_version}")

        async with serving(service) as address:
            await weightsync.publish(address, 0, w0)
            await weightsync.publish(address, 1, w1)
            before = _head(service.store)
            _PausedWrites.loop, _PausedWrites.on_write = asyncio.get_running_loop(), read
            try:
                await weightsync.publish(address, 2, w2)  # a delta and a keyframe; version 0's keyframe is pruned
            finally:
                _PausedWrites.loop = _PausedWrites.on_write = None
            after = _head(service.store)
        assert after[0] == 2 and before[0] == 1
        assert any(_same(state, after) for _, state in seen), "no reader ran after the store step's last write"
        mixed = [f"after the store thread wrote {write!r}: {_described(state, before, after)}" for write, state in seen if not any(_same(state, h) for h in (before, after))]
        assert not mixed, "a part joining mid-step saw a mix of two versions:\n" + "\n".join(mixed)
        assert problems == []

    asyncio.run(body())
