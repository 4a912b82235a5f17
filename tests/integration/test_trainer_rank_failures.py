"""Two-rank trainers (gloo) where rank 1 alone fails once, somewhere a failure used to hang
the other rank, leave the ranks' weights different or kill the follower unnoticed
(tests/integration/trainer_rank_faults.py ``--fault``). Either the ranks go on together,
rank 0 naming the follower's error, or every rank stops with the error within a bound
(a few collective timeouts), rank 0's training loop ending the way the service reports
(``the training loop stopped: GroupFailed: ...``)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_trainer_distributed import _free_port

pytestmark = pytest.mark.engine

#: Seconds a rank waits in a collective (and twice that in the agreement after a phase).
TIMEOUT_S = 5
#: Generous: a stopped group is done within a few timeouts of the fault, not hung.
BOUND_S = 8 * TIMEOUT_S


def _run(tmp_path: Path, tiny_model: Path, data_parallel: str, fault: str) -> tuple[list[int], list[dict[str, Any]], str]:
    """Both ranks under ``--fault``; their exit codes, their summaries and their output."""
    port = _free_port()
    out = tmp_path / "out"
    procs = []
    try:
        for rank in (0, 1):
            argv = [
                sys.executable, "-m", "tests.integration.trainer_rank_faults", "--rank", str(rank), "--world", "2", "--port", str(port),
                "--collective-timeout-s", str(TIMEOUT_S), "--model", str(tiny_model), "--out", str(out),
                "--data-parallel", data_parallel, "--fault", fault, "--bound-s", str(BOUND_S),
            ]
            procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        # Start-up (imports, the model) takes most of this on a slow machine.
        outputs = [proc.communicate(timeout=BOUND_S + 240)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    logs = "\n".join(f"--- rank {r}, exit {p.returncode}:\n{o[-6000:]}" for r, (p, o) in enumerate(zip(procs, outputs)))
    summaries = []
    for rank in (0, 1):
        path = out / f"rank-{rank}.json"
        assert path.exists(), f"rank {rank} wrote no summary\n{logs}"
        summaries.append(json.loads(path.read_text()))
    return [p.returncode for p in procs], summaries, logs


def _stopped_everywhere(codes: list[int], ranks: list[dict[str, Any]], logs: str, *named: str) -> None:
    """Every rank raised GroupFailed naming rank 1's injected fault and ``named``, within the
    bound; the follower exited 1."""
    for rank, summary in enumerate(ranks):
        error = summary["error"]
        assert error.startswith("GroupFailed: "), f"rank {rank}: {error!r}\n{logs}"
        for text in ("rank 1 (OSError: rank 1: an injected fault", *named):
            assert text in error, f"rank {rank}: {text!r} not in {error!r}"
        assert summary["seconds"] < BOUND_S, f"rank {rank} took {summary['seconds']:.1f} s to stop"
    assert codes[1] == 1, logs


def test_a_rank_failing_inside_fsdp_collectives_stops_every_rank_within_the_timeout(tmp_path: Path, tiny_model: Path) -> None:
    """Rank 1 raises in the forward pass of a decoder layer while rank 0 is in FSDP's
    all-gathers of that pass: rank 0 leaves them after the collective timeout (it waited
    for 7 days before), and both ranks stop, naming rank 1's error; rank 0's loop ends
    (the service would report it) instead of retrying on a broken process group."""
    codes, (lead, other), logs = _run(tmp_path, tiny_model, "fsdp", "layer")
    _stopped_everywhere(codes, [lead, other], logs, "in the forward and backward passes", "unusable")
    assert lead["reason"].startswith("the training loop stopped: GroupFailed: "), lead
    assert lead["steps"] == [] and lead["step_count"] == other["step_count"] == 0, (lead, other)


def test_an_optimizer_step_failing_on_one_rank_stops_every_rank(tmp_path: Path, tiny_model: Path) -> None:
    """Rank 1's optimizer step raises, rank 0's went through: their weights differ, so
    neither trains on (before, rank 1 died and rank 0 trained on alone, unaware)."""
    codes, (lead, other), logs = _run(tmp_path, tiny_model, "ddp", "optimizer")
    _stopped_everywhere(codes, [lead, other], logs, "in the optimizer step", "may now differ")
    assert lead["reason"].startswith("the training loop stopped: GroupFailed: "), lead
    assert lead["steps"] == [], lead  # the loop reported no step


@pytest.mark.parametrize("data_parallel", ["ddp", "fsdp"])
def test_a_restore_failing_on_a_follower_is_reported_to_rank_0_and_stops_every_rank(tmp_path: Path, tiny_model: Path, data_parallel: str) -> None:
    """Rank 1's load_state raises: rank 0 hears of it (its load_state raises, naming rank 1
    and the command; before, it returned and the follower died alone), and, the ranks'
    states being different, every rank stops."""
    codes, ranks, logs = _run(tmp_path, tiny_model, data_parallel, "load_state")
    _stopped_everywhere(codes, ranks, logs, "'load_state'")


def test_a_part_failing_on_a_follower_is_reported_to_rank_0_and_the_ranks_train_on(tmp_path: Path, tiny_model: Path) -> None:
    """Rank 1 fails after preparing its part of a version (its part log cannot be written):
    rank 0's prepare_part raises, naming rank 1, the version and the error (before, it
    returned and the follower died); the weights were not touched and the process group
    still works, so both ranks go on to the next step together and end equal."""
    codes, (lead, other), logs = _run(tmp_path, tiny_model, "fsdp", "part_log")
    assert codes == [0, 0], logs
    error = lead["error"]
    assert error.startswith("RankFailed: "), f"{error!r}\n{logs}"
    assert "preparing the parts of version 1 on rank 1 (OSError: rank 1: an injected fault in part_log)" in error, error
    assert other["error"] == "", other
    assert lead["step_count"] == other["step_count"] == 1, (lead, other)
    assert lead["master_hash"] == other["master_hash"], "the ranks' weights diverged"
