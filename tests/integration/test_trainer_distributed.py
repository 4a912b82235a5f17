"""Two CPU processes under torchrun (gloo) on the same batches, with DistributedDataParallel
and with FSDP2: the result matches one process on the same batches."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.trainer.config import TrainerConfig
from services.trainer.distributed import save_batches
from benchmarks.support.synthetic import fixed_groups

# Micro-batches of 2: each rank's 3 rows take two passes, the first without a gradient reduction.
SETTINGS = ["--lr", "1e-3", "--groups-per-step", "2", "--threads", "1", "--max-policy-lag", "8", "--micro-batch", "2"]


pytestmark = pytest.mark.engine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("data_parallel", ["ddp", "fsdp"])
def test_two_processes_match_one(tmp_path: Path, tiny_model: Path, data_parallel: str) -> None:
    from services.trainer.learner import Learner

    # Three trajectories per group: 6 per batch, so the two shards differ in size and length.
    groups = fixed_groups(tiny_model, 4, group_size=3, seed=3)
    batches = [groups[0:2], groups[2:4]]
    save_batches(tmp_path / "batches.pt", batches)
    out = tmp_path / "out"
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
        "--master-port", str(_free_port()), "-m", "services.trainer.distributed", "--model", str(tiny_model),
        "--replay", str(tmp_path / "batches.pt"), "--out", str(out), "--data-parallel", data_parallel, *SETTINGS,
    ]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["master_hash"] == ranks[1]["master_hash"], "ranks diverged"

    # One process, the whole batch in one pass.
    single = Learner(tiny_model, TrainerConfig(model=str(tiny_model), lr=1e-3, groups_per_step=2, threads=1, max_policy_lag=8, micro_batch=0))
    initial = single.master_weights()
    whole = single.local_elements()
    if data_parallel == "fsdp":
        # Each rank held about half the parameters, never a whole replica.
        assert sum(r["local_elements"] for r in ranks) == whole
        assert all(r["local_elements"] < 0.6 * whole for r in ranks), ranks
    else:
        assert all(r["local_elements"] == whole for r in ranks)
    losses = [single.step(b).loss for b in batches]
    result = torch.load(out / "result.pt", weights_only=False)
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(losses), rtol=1e-5, atol=1e-7)
    moved = 0
    final = single.master_weights()
    assert set(result["weights"]) == set(final)
    for name, want in final.items():
        got = result["weights"][name]
        # Summation order differs (two shards, then a reduction): equal to float tolerance.
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=name)
        moved += int(not torch.equal(want, initial[name]))
    assert moved > 0, "the steps should have changed the weights"
