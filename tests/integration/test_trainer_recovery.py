"""The trainer against a real redis-server and a real weightsync, as `meridian serve
trainer` subprocesses: kill -9 at random moments, duplicate deliveries, a dead
consumer's pending entries, poison entries. Each run must end with exactly the weights,
step for step, of an uninterrupted run of the same learner on the same trajectories (on
the same device: a GPU where there is one)."""
from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from meridian.grpc_runtime import open_channel
from meridian.trajectory_transport import DEAD_LETTER_SUFFIX, RedisGroupTransport, TransportConfig
from meridian.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc, weightsync_pb2, weightsync_pb2_grpc
from services.trainer import checkpoint as ckpt
from services.trainer.config import TrainerConfig
from benchmarks.support.synthetic import fixed_groups
from tests.integration.plain_grpo import PlainGrpo, relative_distance

STREAM = "meridian:trajectories"
GROUPS = 12
GROUP_SIZE = 2
PER_STEP = 2
MAX_LAG = 2
# Group i's tokens come from this policy version: with max_policy_lag 2, groups 8 and
# 10 (version 0, trained at version 4 and 5) are dropped as stale; every 5th group has
# equal rewards and is skipped, so the batch of groups 8 and 9 makes no step at all.
# Those paths are replayed after crashes too.
VERSIONS = [0, 0, 0, 0, 1, 1, 2, 2, 0, 3, 0, 4]
FLAT_EVERY = 5
SETTINGS = {
    "lr": 1e-3,
    "groups_per_step": PER_STEP,
    "max_policy_lag": MAX_LAG,
    "publish_every": 1,
    "checkpoint_every": 2,  # steps published before their checkpoint: replayed after a crash
    "checkpoint_idle_s": 0.5,
    "keep_checkpoints": 50,
    "claim_idle_ms": 500,
    "claim_every_s": 0.5,
    "threads": 1,
    "tis_cap": 2.0,
}
TIMEOUT_S = 90
PLAIN_TOLERANCE = 1e-3  # relative distance to the plain loop (see test_learner_reference)


pytestmark = pytest.mark.engine


def _flags(settings: dict[str, Any]) -> list[str]:
    return [part for k, v in settings.items() for part in ("--" + k.replace("_", "-"), str(v))]


@pytest.fixture(scope="module")
def groups(tiny_model: Path) -> list[list[common_pb2.Trajectory]]:
    return fixed_groups(tiny_model, GROUPS, GROUP_SIZE, versions=VERSIONS, flat_every=FLAT_EVERY)


@pytest.fixture(scope="module")
def reference(tiny_model: Path, groups: list[list[common_pb2.Trajectory]]) -> list[dict[str, Any]]:
    """The uninterrupted run: the learner in this process over the groups in stream order."""
    from services.trainer.learner import Learner, resolve_device
    from meridian.tensors import weights_hash

    config = TrainerConfig(model=str(tiny_model), **SETTINGS)  # type: ignore[arg-type]
    # On the device the trainers pick (a GPU where there is one), so a GPU machine checks
    # the service's GPU path end to end, kills and all, against a GPU run of the same steps.
    learner = Learner(tiny_model, config, resolve_device(config.device))
    # An independent loop checks the reference itself, so a learner defect that the
    # restarted trainers would share cannot pass as "identical to the reference".
    plain = PlainGrpo(tiny_model, lr=SETTINGS["lr"], max_policy_lag=MAX_LAG, tis_cap=SETTINGS["tis_cap"])
    start = plain.parameters()
    history = []
    for i in range(0, len(groups), PER_STEP):
        stepped = learner.step(groups[i : i + PER_STEP]).stepped
        assert stepped == plain.step(groups[i : i + PER_STEP])
        if stepped:
            ours = {name: p.detach().cpu() for name, p in learner.module.named_parameters()}
            assert relative_distance(ours, plain.parameters(), start) < PLAIN_TOLERANCE
            history.append({"step": learner.step_count, "version": learner.version, "master_hash": learner.master_hash(), "bf16": weights_hash(learner.policy_weights())})
    assert 3 <= len(history) < GROUPS // PER_STEP, "the fixture should exercise skipped batches and real steps"
    return history


# ---------------------------------------------------------------- processes


def _spawn(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as fh:
        return subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)


def _address(proc: subprocess.Popen[bytes], log: Path, name: str, timeout_s: float = 60) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = re.search(rf"meridian {name} listening on ([\d.]+:\d+)", log.read_text(errors="replace"))
        if m:
            return m.group(1)
        assert proc.poll() is None, f"{name} exited early:\n{log.read_text()[-3000:]}"
        time.sleep(0.1)
    raise TimeoutError(f"{name} did not listen:\n{log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
    """Signals exactly the process group this test started, and reaps it."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


class Job:
    """One training job: a weightsync, a checkpoint folder, trainer processes over time."""

    def __init__(self, tmp: Path, redis_url: str, model: Path) -> None:
        self.tmp, self.redis_url, self.model = tmp, redis_url, model
        self.ckpt_dir = tmp / "checkpoints"
        self.procs: list[subprocess.Popen[bytes]] = []
        log = tmp / "weightsync.log"
        ws = _spawn([sys.executable, "-m", "meridian.cli", "serve", "weightsync", "--insecure", "true", "--port", "0", "--data-dir", str(tmp / "ws"), "--keep-versions", "50"], log)
        self.procs.append(ws)
        self.weightsync = _address(ws, log, "weightsync")
        self.trainer_address = ""
        self._n = 0

    def start_trainer(self, consumer: str = "trainer-0", **overrides: Any) -> subprocess.Popen[bytes]:
        self._n += 1
        log = self.tmp / f"trainer-{self._n}.log"
        argv = [
            sys.executable, "-m", "meridian.cli", "serve", "trainer", "--insecure", "true", "--port", "0", "--model", str(self.model),
            "--redis-url", self.redis_url, "--weightsync", self.weightsync, "--checkpoint-dir", str(self.ckpt_dir),
            "--consumer", consumer, *_flags({**SETTINGS, **overrides}),
        ]
        proc = _spawn(argv, log)
        self.procs.append(proc)
        self.trainer_address = _address(proc, log, "trainer")
        self.trainer_log = log
        return proc

    def checkpoint_step(self) -> int:
        path = ckpt.latest_checkpoint(self.ckpt_dir)
        return ckpt.read_meta(path)["step"] if path else 0

    def wait_step(self, proc: subprocess.Popen[bytes], step: int) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        while self.checkpoint_step() < step:
            assert proc.poll() is None, f"trainer exited:\n{self.trainer_log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no checkpoint of step {step}:\n{self.trainer_log.read_text()[-3000:]}"
            time.sleep(0.05)

    def status(self) -> trainer_pb2.TrainerStatus:
        async def call() -> trainer_pb2.TrainerStatus:
            async with open_channel(self.trainer_address) as ch:
                return await trainer_pb2_grpc.TrainerStub(ch).Status(trainer_pb2.TrainerStatusRequest(), timeout=10)

        return asyncio.run(call())

    def wait_settled(self, proc: subprocess.Popen[bytes], step: int) -> trainer_pb2.TrainerStatus:
        """Waits for the last step's checkpoint, every entry acked, and the trainer's
        version published (publishes run beside checkpoints: either may finish first)."""
        self.wait_step(proc, step)
        deadline = time.monotonic() + TIMEOUT_S
        while stream_call(self.redis_url, lambda s: s.pending()) > 0:
            assert time.monotonic() < deadline, "entries stay pending"
            time.sleep(0.05)
        while self.latest_version() < (status := self.status()).policy_version:
            assert time.monotonic() < deadline, f"version {status.policy_version} is not published"
            time.sleep(0.05)
        return status

    def latest_version(self) -> int:
        async def call() -> int:
            async with open_channel(self.weightsync) as ch:
                return (await weightsync_pb2_grpc.WeightSyncStub(ch).Status(weightsync_pb2.WeightSyncStatusRequest(), timeout=10)).latest_version

        return asyncio.run(call())

    def manifest_hashes(self, versions: list[int]) -> list[str]:
        async def call() -> list[str]:
            async with open_channel(self.weightsync) as ch:
                stub = weightsync_pb2_grpc.WeightSyncStub(ch)
                return [(await stub.GetManifest(weightsync_pb2.GetManifestRequest(version=v))).weights_hash for v in versions]

        return asyncio.run(call())

    def history(self) -> list[dict[str, Any]]:
        path = ckpt.latest_checkpoint(self.ckpt_dir)
        assert path is not None
        return ckpt.read_meta(path)["history"]

    def close(self) -> None:
        for proc in reversed(self.procs):
            _stop(proc)


@pytest.fixture
def job(tmp_path: Path, redis_url: str, tiny_model: Path) -> Iterator[Job]:
    j = Job(tmp_path, redis_url, tiny_model)
    try:
        yield j
    finally:
        j.close()


def stream_call(url: str, body: Any) -> Any:
    async def main() -> Any:
        stream = RedisGroupTransport(TransportConfig(url=url, stream=STREAM))
        try:
            return await body(stream)
        finally:
            await stream.close()

    return asyncio.run(main())


Item = list[common_pb2.Trajectory] | dict[bytes, bytes]


def produce(url: str, items: list[Item]) -> None:
    """Publishes whole groups (or raw field dicts, for poison entries) in order."""

    async def body(stream: RedisGroupTransport) -> None:
        for item in items:
            if isinstance(item, list):
                await stream.publish_group(item)
            else:
                await stream.redis.xadd(STREAM, item)

    stream_call(url, body)


def assert_same_as_reference(job: Job, reference: list[dict[str, Any]]) -> None:
    history = job.history()
    assert [(h["step"], h["version"], h["master_hash"]) for h in history] == [(r["step"], r["version"], r["master_hash"]) for r in reference]
    # The versions weightsync serves are exactly the reference's bf16 weights.
    assert job.manifest_hashes([r["version"] for r in reference]) == [r["bf16"] for r in reference]


# ---------------------------------------------------------------- the cases


def test_kill_9_at_random_moments_then_resume_gives_identical_weights(job: Job, groups: list[list[common_pb2.Trajectory]], reference: list[dict[str, Any]]) -> None:
    rng = random.Random(6)
    last = reference[-1]["step"]
    produce(job.redis_url, list(groups[: GROUPS // 2]))
    kills = sorted(rng.sample(range(0, last), 3))
    for i, after_step in enumerate(kills):
        proc = job.start_trainer()
        if after_step > 0:
            job.wait_step(proc, after_step)
        time.sleep(rng.uniform(0.0, 0.4))  # mid-step, mid-checkpoint, mid-publish or idle
        _stop(proc, signal.SIGKILL)
        if i == 0:
            produce(job.redis_url, list(groups[GROUPS // 2 :]))
    proc = job.start_trainer()
    status = job.wait_settled(proc, last)
    assert status.resumed_from_step >= kills[-1]
    assert_same_as_reference(job, reference)
    assert status.trajectories_consumed == GROUPS * GROUP_SIZE


def test_kill_between_publishes_and_the_checkpoint_that_covers_them(job: Job, groups: list[list[common_pb2.Trajectory]], reference: list[dict[str, Any]]) -> None:
    """Versions go out before their checkpoint; after a crash the replay publishes them
    again, byte for byte, and weightsync accepts them as the same versions."""
    produce(job.redis_url, list(groups))
    # No checkpoint but the initial one while this trainer lives: every version it
    # publishes is uncovered when it dies.
    proc = job.start_trainer(checkpoint_every=1000, checkpoint_idle_s=3600)
    deadline = time.monotonic() + TIMEOUT_S
    while job.latest_version() < 3:
        assert proc.poll() is None and time.monotonic() < deadline, job.trainer_log.read_text()[-3000:]
        time.sleep(0.05)
    _stop(proc, signal.SIGKILL)
    assert ckpt.latest_checkpoint(job.ckpt_dir) is not None and job.checkpoint_step() == 0 and job.latest_version() >= 3
    proc = job.start_trainer()
    status = job.wait_settled(proc, reference[-1]["step"])
    assert status.resumed_from_step == 0
    assert_same_as_reference(job, reference)
    assert "republished with identical weights" in (job.tmp / "weightsync.log").read_text()


def test_duplicate_deliveries_change_nothing(job: Job, groups: list[list[common_pb2.Trajectory]], reference: list[dict[str, Any]]) -> None:
    items: list[Item] = []
    for i, group in enumerate(groups):
        items.append(group)
        if i == 3:
            items.append(groups[0])  # a group again, after it was trained on
        if i == 6:
            items.append(groups[6])  # a second copy while the first waits for its step partner
    produce(job.redis_url, items)
    proc = job.start_trainer()
    job.wait_step(proc, reference[-1]["step"])
    produce(job.redis_url, [groups[7]])  # and once more after everything was trained
    status = job.wait_settled(proc, reference[-1]["step"])
    assert status.duplicates_skipped == 3
    assert status.trajectories_consumed == GROUPS * GROUP_SIZE
    assert_same_as_reference(job, reference)


def test_dead_consumers_pending_entries_are_claimed(job: Job, groups: list[list[common_pb2.Trajectory]], reference: list[dict[str, Any]]) -> None:
    # Consumer a trains a few steps and also holds a group waiting for its step partner when it dies.
    produce(job.redis_url, list(groups[:7]))
    a = job.start_trainer("trainer-a")
    job.wait_step(a, 3)  # groups 0-5 trained and acked; group 6 waits in a's hands, pending
    time.sleep(0.3)
    _stop(a, signal.SIGKILL)
    held_by_a = stream_call(job.redis_url, lambda s: s.redis.xpending_range(STREAM, "trainer", "-", "+", 100, "trainer-a"))
    assert [e["message_id"] for e in held_by_a], "the dead consumer should leave entries pending"
    time.sleep(SETTINGS["claim_idle_ms"] / 1000 + 0.2)
    b = job.start_trainer("trainer-b")
    produce(job.redis_url, list(groups[7:]))
    status = job.wait_settled(b, reference[-1]["step"])
    assert status.claimed >= 1
    assert stream_call(job.redis_url, lambda s: s.redis.xpending_range(STREAM, "trainer", "-", "+", 100, "trainer-a")) == []
    assert_same_as_reference(job, reference)


def test_poison_entries_go_to_the_dead_letter_stream(job: Job, groups: list[list[common_pb2.Trajectory]], reference: list[dict[str, Any]]) -> None:
    bad_tokens = common_pb2.TrajectoryGroup(group_id="poison", trajectories=groups[2])
    for t in bad_tokens.trajectories:
        t.group_id = "poison"
    bad_tokens.trajectories[0].logprobs.pop()
    old_format = groups[3][0].SerializeToString()
    poison = [{b"other": b"x"}, {b"group": b"\x0a\x7fshort"}, {b"group": bad_tokens.SerializeToString()}, {b"trajectory": old_format}]
    items: list[Item] = []
    for i, group in enumerate(groups):
        items.append(group)
        if i < len(poison):
            items.append(poison[i])
    produce(job.redis_url, items)
    proc = job.start_trainer()
    status = job.wait_settled(proc, reference[-1]["step"])
    assert status.dead_lettered == 4
    dead = stream_call(job.redis_url, lambda s: s.redis.xrange(STREAM + DEAD_LETTER_SUFFIX))
    reasons = [fields[b"reason"].decode() for _, fields in dead]
    assert len(reasons) == 4
    assert "no 'group'" in reasons[0] and "does not parse" in reasons[1] and "per-token" in reasons[2]
    assert "format before groups" in reasons[3]  # an entry of the earlier format is not stuck
    assert all(fields[b"source_id"] for _, fields in dead)
    assert_same_as_reference(job, reference)
