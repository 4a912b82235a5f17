"""The rollout's weight follower against a real (in-process) weightsync origin: what it
hands the updater after the engine rejected a version, and what a roll-back restores.
The updater is a recording stand-in (the real one writes into vLLM: see
tests/integration/test_served_weights.py); its decisions are scripted per version."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from meridian.tensors import Weights, weights_hash
from services.rollout.weight_changes import ChangeSet
from services.rollout.weight_follower import WeightFollower
from services.rollout.weight_updates import UpdateReport
from services.weightsync import client
from services.weightsync.config import WeightSyncConfig
from services.weightsync.server import WeightSyncService
from tests.conftest import free_port, serving
from tests.synthetic_weights import bf16_weights, copied, same, stepped


class Engine:
    """The served version, as the updater moves it."""

    def __init__(self, version: int) -> None:
        self.version = version


class ScriptedUpdater:
    """Accepts or rejects each version as scripted; records the change set it was given
    and the weights ``previous()`` rebuilds (what a roll-back would restore)."""

    def __init__(self, accept: dict[int, bool]) -> None:
        self.engine = Engine(0)
        self.accept = accept
        self.seen: list[tuple[ChangeSet, Weights]] = []

    async def update(self, changes: ChangeSet, truth: Weights, canary: Any, previous: Callable[[], Weights], trace_context: Any = None) -> UpdateReport:
        self.seen.append((changes, copied(previous())))
        accepted = self.accept[changes.version]
        if accepted:
            self.engine.version = changes.version
        return UpdateReport(changes.version, accepted, "delta", error="" if accepted else "scripted rejection")


async def _until(cond: Callable[[], bool], task: asyncio.Task[None], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if task.done():
            task.result()  # the follower ended: its exception says why
            raise AssertionError(f"the follower ended before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def _origin(folder: Path) -> WeightSyncService:
    # Two versions kept and a keyframe every other one: a subscriber three versions
    # behind finds its chain gone and is sent a keyframe of the latest.
    return WeightSyncService(WeightSyncConfig(data_dir=str(folder), chunk_mb=1 / 64, keep_versions=2, keyframe_every=2))


def test_a_keyframe_after_a_rejected_version_is_applied_from_the_served_one(tmp_path: Path) -> None:
    """The engine rejects version 1; while the follower is away, versions 2 to 4 are
    published and the deltas after 1 dropped, so on its return the origin sends version 4
    as a keyframe. The follower must hand the updater all of version 4, from version 0
    (the one served), with a roll-back to version 0 -- and not stop, which would stop the
    rollout service."""
    port = free_port()
    versions = {0: bf16_weights(0, 6_000)}
    for v in range(1, 5):
        versions[v] = stepped(versions[v - 1], v, frac=0.01)

    async def main() -> None:
        updater = ScriptedUpdater({1: False, 4: True})
        async with serving(_origin(tmp_path / "ws"), port=port) as origin:
            for v in (0, 1):
                await client.publish(origin, v, versions[v])
            follower = WeightFollower(origin, updater, copied(versions[0]), weights_hash(versions[0]))  # type: ignore[arg-type]
            task = asyncio.create_task(follower.run())
            await _until(lambda: len(updater.seen) == 1, task, "version 1")
        try:
            async with serving(_origin(tmp_path / "ws")) as elsewhere:  # the follower cannot see these arrive
                for v in (2, 3, 4):
                    await client.publish(elsewhere, v, versions[v])
            async with serving(_origin(tmp_path / "ws"), port=port):
                await _until(lambda: len(updater.seen) == 2, task, "version 4")
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        changes, previous = updater.seen[1]
        assert (changes.version, changes.base_version) == (4, 0)
        assert changes.is_full(len(versions[4])), "a keyframe replaces every tensor: each must travel whole"
        assert all(np.array_equal(changes.dense[n], t.bits) for n, t in versions[4].items())
        assert same(previous, versions[0]), "a roll-back of version 4 must restore version 0, the one served"
        assert updater.engine.version == 4 and follower.updates_rejected == 1 and follower.updates_applied == 1

    asyncio.run(main())


def test_after_an_accepted_version_the_next_one_starts_from_it(tmp_path: Path) -> None:
    """Version 1 is accepted, version 2 rejected. Version 2's change set starts from 1
    and holds only 2's elements; a roll-back of it restores 1, not 0 (restoring 0 would
    serve weights older than the label). The follower reports version 1's hash, the
    rejection, and a lag of one version."""
    versions = {0: bf16_weights(0, 6_000)}
    for v in (1, 2):
        versions[v] = stepped(versions[v - 1], v, frac=0.01)

    async def main() -> WeightFollower:
        updater = ScriptedUpdater({1: True, 2: False})
        async with serving(_origin(tmp_path / "ws")) as origin:
            await client.publish(origin, 0, versions[0])
            follower = WeightFollower(origin, updater, copied(versions[0]), weights_hash(versions[0]))  # type: ignore[arg-type]
            task = asyncio.create_task(follower.run())
            try:
                for v in (1, 2):  # one at a time: two at once may come as one compacted delta
                    await client.publish(origin, v, versions[v])
                    await _until(lambda v=v: len(updater.seen) == v, task, f"version {v}")
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        return follower

    follower = asyncio.run(main())
    updater = follower.updater
    changes, previous = updater.seen[1]  # type: ignore[attr-defined]
    assert (changes.version, changes.base_version) == (2, 1)
    for name, t in versions[2].items():
        changed = np.flatnonzero(t.bits != versions[1][name].bits)
        assert changes.positions()[name].tolist() == changed.tolist(), f"{name}: version 1's changes were written again"
    assert same(previous, versions[1]), "a roll-back of version 2 must restore version 1, the one served"
    assert updater.engine.version == 1 and follower.weights_hash == weights_hash(versions[1])
    assert (follower.updates_applied, follower.updates_rejected, follower.rejected_version) == (1, 1, 2)
    assert follower.last_update_error == "scripted rejection" and follower.lag() == 1
