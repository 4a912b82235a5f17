"""Two CPU processes under torchrun (gloo) on the same batches, replicated (``ddp``) and
with FSDP2: the result matches one process on the same batches. Two ranks whose steps fail
on one rank or on both, or are skipped for a non-finite loss, go through each alike."""
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
# CPU ranks (gloo) even where a GPU is, as the single process they are compared with; the
# GPU path is test_trainer_cuda's.
SETTINGS = ["--lr", "1e-3", "--groups-per-step", "2", "--threads", "1", "--max-policy-lag", "8", "--micro-batch", "2", "--device", "cpu"]


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


#: Seconds a rank waits in a collective before it fails: a rank left behind by the others
#: ends with an error instead of hanging the test.
COLLECTIVE_TIMEOUT_S = 120


def _run_ranks(tmp_path: Path, tiny_model: Path, data_parallel: str, flaky_at: str) -> list[subprocess.CompletedProcess[str]]:
    """Both ranks of tests/integration/trainer_rank_faults.py, each its own process (killed
    if still running at the end); returns their exit codes and output."""
    port = _free_port()
    procs = []
    try:
        for rank in (0, 1):
            argv = [
                sys.executable, "-m", "tests.integration.trainer_rank_faults", "--rank", str(rank), "--world", "2", "--port", str(port),
                "--collective-timeout-s", str(COLLECTIVE_TIMEOUT_S), "--model", str(tiny_model), "--out", str(tmp_path / "out"),
                "--data-parallel", data_parallel, "--flaky-at", flaky_at,
            ]
            procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        done = []
        for proc in procs:
            out, _ = proc.communicate(timeout=4 * COLLECTIVE_TIMEOUT_S + 600)
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out))
        return done
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.parametrize(("data_parallel", "flaky_at"), [("ddp", "forward"), ("fsdp", "prepare")])
def test_a_failed_retried_dead_lettered_or_skipped_step_is_taken_by_every_rank_alike(tmp_path: Path, tiny_model: Path, data_parallel: str, flaky_at: str) -> None:
    """Rank 0's loop retries a batch whose step failed on rank 0 alone and one whose step
    failed on rank 1 alone, dead-letters one whose step fails on every rank, and skips one
    whose loss is not finite: the other rank goes through each with it (it died, or was
    left in a collective rank 0 never joined, before), and both end with the same weights.
    Under FSDP the forward and backward passes are collectives, so the one-rank faults
    there are in building the batch."""
    ranks = _run_ranks(tmp_path, tiny_model, data_parallel, flaky_at)
    logs = "\n".join(f"--- rank {r}, exit {run.returncode}:\n{run.stdout[-6000:]}" for r, run in enumerate(ranks))
    assert [run.returncode for run in ranks] == [0, 0], logs
    lead, other = (json.loads((tmp_path / "out" / f"rank-{r}.json").read_text()) for r in (0, 1))
    assert lead["tries"] == ["flaky", "flaky", "poison", "poison", "poison", "nonfinite", "good", "good"], logs
    assert lead["dead_lettered"] == ["poison-0", "poison-1"], logs
    counters = lead["counters"]
    assert (counters["failed_batches"], counters["skipped_steps"]) == (1, 1), counters
    # The flaky batch trained on its retry, the non-finite one was skipped, the good one trained.
    assert [(s["step"], s["stepped"]) for s in lead["steps"]] == [(1, True), (1, False), (2, True)], lead["steps"]
    assert (lead["step_count"], lead["version"]) == (other["step_count"], other["version"]) == (2, 2)
    assert lead["master_hash"] == other["master_hash"], "the ranks' weights diverged"
    assert lead["master_hash"] != lead["initial_hash"], "the two good steps should have changed the weights"
