"""Two CPU ranks under torchrun (gloo, FSDP2) each publish their part of a version, the
second one encoded by the ranks themselves; the origin's store then holds byte for byte
what a single-process publish of the same weights (signed with the same key) stores, and
no rank gathered the whole model."""
from __future__ import annotations

import asyncio
import json
import socket
import sys
from pathlib import Path

import pytest
import torch

from meridian.grpc_runtime import open_channel
from meridian.tensors import Weights, from_torch
from meridian.v1 import weightsync_pb2 as pb
from meridian.v1 import weightsync_pb2_grpc as pb_grpc
from services.trainer.config import TrainerConfig
from services.trainer.distributed import save_batches
from services.weightsync import client as weightsync
from services.weightsync import parts
from services.weightsync.config import WeightSyncConfig
from services.weightsync.server import WeightSyncService
from services.weightsync.signing import Signer, generate_signing_key
from benchmarks.support.synthetic import fixed_groups
from tests.conftest import serving

# CPU ranks (gloo) even where a GPU is, as the single process they are compared with; the
# GPU path is test_trainer_cuda's.
SETTINGS = ["--lr", "1e-3", "--groups-per-step", "2", "--threads", "1", "--max-policy-lag", "8", "--micro-batch", "2", "--device", "cpu"]

pytestmark = pytest.mark.engine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def origin(root: Path, key: Path) -> WeightSyncService:
    # Small chunks: several per tensor, so chunk order within and across tensors counts.
    return WeightSyncService(WeightSyncConfig(role="origin", data_dir=str(root), chunk_mb=0.01, verify_key=str(key), part_timeout_s=600))


def store_files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def store_of_one_process(root: Path, key: Path, versions: list[Weights]) -> dict[str, bytes]:
    """What an origin at ``root`` stores when one process publishes ``versions`` (0, 1, ...)
    signed with the private ``key`` (``key.pub`` beside it verifies)."""
    signer = Signer.load(key)

    async def publish() -> None:
        async with serving(origin(root, key.with_suffix(".pub"))) as address:
            for version, weights in enumerate(versions):
                await weightsync.publish(address, version, weights, signer=signer)

    asyncio.run(publish())
    return store_files(root)


async def run_ranks(argv: list[str], timeout_s: float = 400) -> None:
    """Runs a torchrun command line to its end (killed past ``timeout_s``); it must succeed."""
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        _, stderr = await asyncio.wait_for(proc.communicate(), timeout_s)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, stderr.decode()[-4000:]


def test_two_ranks_publish_parts_that_store_like_one_process(tmp_path: Path, tiny_model: Path) -> None:
    from services.trainer.learner import Learner

    generate_signing_key(tmp_path / "key", tmp_path / "key.pub")
    groups = fixed_groups(tiny_model, 4, group_size=3, seed=3)
    save_batches(tmp_path / "batches.pt", [groups[0:2], groups[2:4]])
    out = tmp_path / "out"

    async def sharded() -> None:
        async with serving(origin(tmp_path / "sharded", tmp_path / "key.pub")) as address:
            argv = [
                sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                "--master-port", str(free_port()), "-m", "services.trainer.distributed", "--model", str(tiny_model),
                "--replay", str(tmp_path / "batches.pt"), "--out", str(out), "--data-parallel", "fsdp",
                "--publish-to", address, "--signing-key", str(tmp_path / "key"), *SETTINGS,
            ]
            await run_ranks(argv)
            assert await weightsync.latest_version(address) == 1
            # Version 1 came from both ranks as chunks they encoded (version 0 raw: no base).
            async with open_channel(address) as channel:
                status = await pb_grpc.WeightSyncStub(channel).Status(pb.WeightSyncStatusRequest())
            assert (status.encoded_parts, status.encoded_parts_refused) == (2, 0)

    asyncio.run(sharded())

    # One process publishes the same weights: the starting ones and the replay's result, in bf16.
    start = Learner(tiny_model, TrainerConfig(model=str(tiny_model), lr=1e-3, groups_per_step=2, threads=1, max_policy_lag=8)).policy_weights()
    final = {name: from_torch(t.to(torch.bfloat16)) for name, t in torch.load(out / "result.pt", weights_only=False)["weights"].items()}
    want, got = store_of_one_process(tmp_path / "single", tmp_path / "key", [start, final]), store_files(tmp_path / "sharded")
    assert any("delta" in name for name in want), "version 1 should be a delta on version 0"
    assert want.keys() == got.keys()
    for name in want:
        assert got[name] == want[name], f"{name}: the sharded publish stored other bytes than one process"

    # Each rank gathered and sent only the whole tensors the partition gave it, together all
    # of them and neither rank all of them. (Parts are whole tensors: in the tiny model the
    # embedding is most of the bytes, so the parts cannot be even; see the README.)
    total = sum(t.nbytes for t in final.values())
    split = parts.partition({n: t.nbytes for n, t in final.items()}, 2)
    shares = [sum(final[n].nbytes for n in names) for names in split]
    sent = [json.loads((out / f"rank-{r}.json").read_text())["published_bytes"] for r in (0, 1)]
    assert [json.loads((out / f"rank-{r}.json").read_text())["published_encoded"] for r in (0, 1)] == [[False, True]] * 2
    for version in (0, 1):
        assert [sent[0][version], sent[1][version]] == shares, sent
        assert sum(shares) == total and all(0 < s < total for s in shares)
