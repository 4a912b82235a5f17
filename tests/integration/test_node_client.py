"""A non-Python client of the public API: Node (@grpc/grpc-js, @grpc/proto-loader loading
the .proto files directly, tests/node_client/client.js) runs an episode group through
rollout and reads weightsync's status on the shared stack."""
from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from meridian import stack as stack_mod
from meridian.grpc_runtime import open_channel
from meridian.v1 import weightsync_pb2 as ws
from meridian.v1 import weightsync_pb2_grpc as ws_grpc

CLIENT_DIR = Path(__file__).resolve().parents[1] / "node_client"
TASK = "text/shout"
GROUP = 2

pytestmark = [pytest.mark.stack, pytest.mark.engine]


def run_node_client(stack: stack_mod.Stack, *extra: str, timeout_s: float = 600) -> dict[str, Any]:
    """Runs the Node client against ``stack`` and returns the JSON it printed."""
    node = shutil.which("node")
    if node is None:
        pytest.fail("node is not installed (make install installs it with apt)")
    if not (CLIENT_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir():
        pytest.fail(f"{CLIENT_DIR}/node_modules is missing: run `make install` (npm ci in {CLIENT_DIR.name})")
    argv = [
        node, str(CLIENT_DIR / "client.js"),
        "--rollout", stack.addresses["rollout"], "--weightsync", stack.addresses["weightsync"],
        "--task", TASK, "--group-size", str(GROUP), "--max-tokens", "16", *extra,
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, cwd=CLIENT_DIR)
    lines = done.stdout.strip().splitlines()
    assert lines, f"the Node client printed nothing (exit {done.returncode}): {done.stderr[-2000:]}"
    out = json.loads(lines[-1])
    assert done.returncode == 0 and "error" not in out, f"Node client failed: {out} {done.stderr[-2000:]}"
    return out


async def _weightsync_status(address: str) -> ws.WeightSyncStatus:
    async with open_channel(address) as channel:
        return await ws_grpc.WeightSyncStub(channel).Status(ws.WeightSyncStatusRequest())


@pytest.fixture(scope="module")
def node_result(stack: stack_mod.Stack) -> dict[str, Any]:
    # As any outside caller would: TLS trusting the stack's CA, the client certificate, and
    # the operator's token (RunEpisodes is the operator's), all from the credentials folder.
    assert stack.credentials, "the shared stack runs without credentials"
    return run_node_client(stack, "--credentials", stack.credentials, "--role", "operator", "--check-refusals")


def test_node_client_authenticates_over_tls(node_result: dict[str, Any]) -> None:
    assert node_result["secure"] is True and node_result["role"] == "operator"


def test_node_client_without_a_valid_token_is_refused(node_result: dict[str, Any]) -> None:
    refusals = node_result["refusals"]
    for call in ("rollout_run_episodes_without_token", "weightsync_status_without_token", "weightsync_status_unknown_token"):
        assert refusals[call]["code"] == "UNAUTHENTICATED", (call, refusals[call])
    # The server says what is missing, and never echoes a token back.
    assert "token" in refusals["weightsync_status_without_token"]["details"]
    assert "not-a-meridian-token" not in json.dumps(refusals)


def test_node_client_with_a_role_that_may_not_run_episodes_is_denied(stack: stack_mod.Stack) -> None:
    # A production caller's token is known but may not start RL episodes.
    with pytest.raises(AssertionError, match="PERMISSION_DENIED"):
        run_node_client(stack, "--credentials", stack.credentials, "--role", "production", timeout_s=120)


def test_node_client_runs_an_episode_group_through_rollout(node_result: dict[str, Any]) -> None:
    trajs = node_result["trajectories"]
    assert len(trajs) == GROUP, trajs
    assert len({t["group_id"] for t in trajs}) == 1 and trajs[0]["group_id"]
    assert len({t["trajectory_id"] for t in trajs}) == GROUP
    for t in trajs:
        assert t["task_id"] == TASK and t["group_size"] == GROUP
        assert t["prompt_tokens"] > 0 and t["completion_tokens"] > 0
        # One log-prob, loss-mask entry and policy version per completion token, as the contract says.
        assert t["logprobs"] == t["loss_mask"] == len(t["policy_versions"]) == t["completion_tokens"]
        # int64 arrives as decimal strings from proto-loader (longs: String): exact, and a version or -1.
        assert all(int(v) >= -1 for v in t["policy_versions"])
        assert 0.0 <= t["reward"] <= 1.0
        assert t["finish_reason"]


def test_node_client_reads_weightsync_status(stack: stack_mod.Stack, node_result: dict[str, Any]) -> None:
    status = node_result["weightsync_status"]
    python_view = asyncio.run(_weightsync_status(stack.addresses["weightsync"]))
    assert status["role"] == python_view.role == "origin"
    latest = int(status["latest_version"])
    assert latest >= 0, status  # the trainer publishes version 0 at start
    assert latest <= python_view.latest_version  # versions only move forward
    assert latest in [int(v) for v in status["versions"]]
    assert int(status["stored_bytes"]) > 0
