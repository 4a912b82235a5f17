"""The trainer service itself under torchrun with two CPU ranks (gloo, FSDP2), trained from a
real Redis stream, publishing every version in parts to a real weightsync origin (each rank
encoding its own part from version 1 on: the origin's Status counts the encoded parts):

- the origin's store holds byte for byte what one process publishing the same weights
  (the bf16 view of each checkpoint's masters, signed with the same key, its canary
  computed by a single-process learner) stores: so the parts are current, complete and
  assembled right, and the canary computed through the sharded model is the
  single-process canary, bit for bit;
- each rank gathered exactly the tensors the partition gives it for every version, rank 0
  less than the whole model;
- the job stops cleanly (rank 0 drains its publish, the other rank its part sender)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from meridian.grpc_runtime import open_channel
from meridian.tensors import RawTensor, from_torch, weights_hash
from meridian.v1 import weightsync_pb2 as pb
from meridian.v1 import weightsync_pb2_grpc as pb_grpc
from meridian.trajectory_transport import RedisGroupTransport, TransportConfig
from services.trainer import checkpoint as ckpt
from services.trainer.config import TrainerConfig
from services.weightsync import client as weightsync
from services.weightsync import parts
from services.weightsync.config import WeightSyncConfig
from services.weightsync.server import WeightSyncService
from services.weightsync.signing import Signer, generate_signing_key
from benchmarks.support.synthetic import fixed_groups
from tests.conftest import free_port, serving

STREAM = "meridian:trajectories"
GROUPS, PER_STEP = 6, 2
STEPS = GROUPS // PER_STEP
# CPU ranks (gloo) even where a GPU is, as the single process they are compared with.
SETTINGS = {"lr": 1e-3, "groups_per_step": PER_STEP, "threads": 1, "max_policy_lag": 8, "micro_batch": 2, "device": "cpu"}
TIMEOUT_S = 300

pytestmark = pytest.mark.engine


def _flags(settings: dict[str, object]) -> list[str]:
    return [part for k, v in settings.items() for part in ("--" + k.replace("_", "-"), str(v))]


def _origin(root: Path, key: Path) -> WeightSyncService:
    # Small chunks: several per tensor, so chunk order within and across tensors counts.
    return WeightSyncService(WeightSyncConfig(role="origin", data_dir=str(root), chunk_mb=0.01, verify_key=str(key), part_timeout_s=600))


def _store_files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _workers(torchrun_pid: int) -> dict[int, int]:
    """torchrun's running workers: {rank: pid} (each worker's environment names its RANK)."""
    try:
        children = Path(f"/proc/{torchrun_pid}/task/{torchrun_pid}/children").read_text().split()
    except OSError:
        return {}
    out = {}
    for pid in map(int, children):
        try:
            env = dict(item.split(b"=", 1) for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in item)
        except OSError:
            continue
        if b"RANK" in env:
            out[int(env[b"RANK"])] = pid
    return out


async def _stop(proc: asyncio.subprocess.Process) -> None:
    """Ends a torchrun that did not stop by itself, and its workers: they run in sessions of
    their own, so killing torchrun's process group would leave them behind."""
    workers = _workers(proc.pid)
    proc.terminate()  # torchrun passes SIGTERM on to the workers and waits for them
    try:
        await asyncio.wait_for(proc.wait(), 60)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
    for pid in workers.values():
        with contextlib.suppress(OSError):  # gone already (and its pid not taken since: checked)
            if b"services.trainer.distributed" in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)


async def _wait(what: str, check, proc: asyncio.subprocess.Process, log: Path, deadline: float) -> None:  # type: ignore[no-untyped-def]
    while not await check():
        text = log.read_text(errors="replace")
        assert proc.returncode is None, f"the trainer exited ({proc.returncode}) before {what}:\n{text[-4000:]}"
        # A version the origin refused or never stored will not come: fail now, not at the deadline.
        assert "was not published" not in text and "CommitRefused" not in text, f"a version was not published:\n{text[-4000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{log.read_text(errors='replace')[-4000:]}"
        await asyncio.sleep(0.5)


def test_fsdp_trainer_service_publishes_parts_that_store_like_one_process(tmp_path: Path, tiny_model: Path, redis_url: str) -> None:
    from services.trainer.learner import Learner

    generate_signing_key(tmp_path / "key", tmp_path / "key.pub")
    groups = fixed_groups(tiny_model, GROUPS, group_size=3, seed=3)
    ckpt_dir, part_log, log = tmp_path / "checkpoints", tmp_path / "parts", tmp_path / "trainer.log"

    async def sharded() -> dict[int, dict[str, str]]:
        stream = RedisGroupTransport(TransportConfig(url=redis_url, stream=STREAM))
        try:
            for group in groups:
                await stream.publish_group(group)
        finally:
            await stream.close()
        async with serving(_origin(tmp_path / "sharded", tmp_path / "key.pub")) as address:
            argv = [
                sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                "--master-port", str(free_port()), "-m", "services.trainer.distributed", "--insecure", "true", "--port", "0",
                "--model", str(tiny_model), "--data-parallel", "fsdp", "--redis-url", redis_url, "--weightsync", address,
                "--signing-key", str(tmp_path / "key"), "--checkpoint-dir", str(ckpt_dir), "--checkpoint-every", "1",
                "--keep-checkpoints", "20", "--part-log", str(part_log), *_flags(SETTINGS),
            ]
            proc = await asyncio.create_subprocess_exec(*argv, stdout=log_fh, stderr=asyncio.subprocess.STDOUT)
            deadline = time.monotonic() + TIMEOUT_S
            try:

                async def settled() -> bool:
                    path = ckpt.latest_checkpoint(ckpt_dir)
                    return await weightsync.latest_version(address) >= STEPS and path is not None and ckpt.read_meta(path)["step"] >= STEPS

                await _wait(f"version {STEPS} and its checkpoint", settled, proc, log, deadline)
                # A clean stop: SIGTERM to rank 0, which drains its publish and tells the
                # other rank to stop; that rank finishes its part sender first.
                rank0 = _workers(proc.pid).get(0)
                assert rank0 is not None, "rank 0 is not running"
                os.kill(rank0, signal.SIGTERM)
                rc = await asyncio.wait_for(proc.wait(), 120)
            finally:
                if proc.returncode is None:
                    await _stop(proc)
            assert rc == 0, log.read_text(errors="replace")[-4000:]
            assert await weightsync.latest_version(address) == STEPS
            # Versions 1.. came from both ranks as chunks they encoded themselves (a part
            # retried after a transient error counts again).
            async with open_channel(address) as channel:
                status = await pb_grpc.WeightSyncStub(channel).Status(pb.WeightSyncStatusRequest())
            assert status.encoded_parts >= 2 * STEPS and status.encoded_parts_refused == 0, status
            return {v: dict((await weightsync.manifest(address, v)).trace_context) for v in range(STEPS + 1)}

    with open(log, "wb") as log_fh:
        traces = asyncio.run(sharded())

    # The weights of every version: the bf16 view of the masters its checkpoint holds.
    single = Learner(tiny_model, TrainerConfig(model=str(tiny_model), **SETTINGS))  # type: ignore[arg-type]
    names = [name for name, _ in single.module.named_parameters()]
    versions: dict[int, dict[str, RawTensor]] = {}
    for path in ckpt.complete_checkpoints(ckpt_dir):
        state, meta = ckpt.load_checkpoint(path)
        versions[int(meta["version"])] = {n: from_torch(state["model"][n].to(torch.bfloat16)) for n in names}
    assert sorted(versions) == list(range(STEPS + 1)), sorted(versions)
    assert len({weights_hash(versions[v]) for v in versions}) == STEPS + 1, "every step should change the weights"
    signer = Signer.load(tmp_path / "key")

    async def one_process() -> None:
        async with serving(_origin(tmp_path / "single", tmp_path / "key.pub")) as address:
            for v in range(STEPS + 1):
                # The single-process canary on the same bf16 weights (the learner's forward pass).
                await weightsync.publish(address, v, versions[v], traces[v], canary=single.canary(versions[v]), signer=signer)

    asyncio.run(one_process())
    want, got = _store_files(tmp_path / "single"), _store_files(tmp_path / "sharded")
    assert sum("delta" in name for name in want) >= STEPS, "versions 1.. should be deltas"
    assert want.keys() == got.keys()
    for name in sorted(want):
        # A manifest differs when the canary, the signature, a hash or a part's tensors do.
        assert got[name] == want[name], f"{name}: the sharded trainer stored other bytes than one process publishing the same weights"

    # Each rank gathered, for every version, only the whole tensors the partition gives it.
    sizes = {n: t.nbytes for n, t in versions[0].items()}
    total = sum(sizes.values())
    split = parts.partition(sizes, 2)
    for rank in (0, 1):
        lines = [json.loads(line) for line in (part_log / f"parts-rank-{rank}.jsonl").read_text().splitlines()]
        assert [line["version"] for line in lines] == list(range(STEPS + 1)), lines
        for line in lines:
            assert (line["part"], line["parts"]) == (rank, 2)
            assert line["tensors"] == split[rank]
            assert line["gathered_bytes"] == sum(sizes[n] for n in split[rank]) < total
