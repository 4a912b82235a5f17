"""Groups of episodes against a real envsandbox (in-process gRPC, real sandboxes) that
holds fewer sandboxes than the groups ask for at once: under the rollout's sandbox
budget they run in waves and every episode is scored; without it the same groups are
refused (RESOURCE_EXHAUSTED), which is what a large RunEpisodes used to get. Two
rollouts sharing one envsandbox, each with the whole limit as its budget, run every
group too: their groups wait in envsandbox's line, and a group's forks keep the room its
Create reserved."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from transformers import AutoTokenizer

from meridian.v1 import common_pb2
from meridian.v1 import envsandbox_pb2 as sbx
from meridian.v1 import envsandbox_pb2_grpc as sbx_grpc
from services.envsandbox.config import EnvSandboxConfig
from services.envsandbox.server import EnvSandboxService
from services.rollout.engine import Delta, Sampling
from services.rollout.episodes import EpisodeLimits, gather_or_cancel, run_group
from services.rollout.sandbox_budget import SandboxBudget
from tests.conftest import serving

pytestmark = pytest.mark.engine

#: envsandbox's --max-sandboxes here; GROUPS groups of GROUP_SIZE ask for 15 at once.
CAPACITY, GROUPS, GROUP_SIZE = 6, 5, 2


class Answers:
    """Stands in for the engine: every episode answers python/add correctly, in plain text."""

    version = 3

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    async def generate(self, prompt_ids: list[int], sampling: Sampling, priority: int, request_id: str = "") -> AsyncIterator[Delta]:
        text = "def add(a, b):\n    return a + b\n"
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        await asyncio.sleep(0.05)  # long enough for groups to overlap
        yield Delta(ids, [-0.5] * len(ids), self.version, text, True, "stop", all_versions=[self.version] * len(ids))


def _groups(
    tmp_path: Path, tiny_model: Path, budgets: list[SandboxBudget | None], wait_s: float = 0.0
) -> tuple[list[list[common_pb2.Trajectory]], int]:
    """The groups' trajectories and the most sandboxes envsandbox held at once. Group i
    runs under ``budgets[i % len(budgets)]``: one budget per rollout sharing envsandbox."""
    policy = Answers(AutoTokenizer.from_pretrained(tiny_model))

    async def run() -> tuple[list[list[common_pb2.Trajectory]], int]:
        service = EnvSandboxService(EnvSandboxConfig(root=str(tmp_path / "sandboxes"), max_sandboxes=CAPACITY))
        peak = 0

        async def watch() -> None:
            nonlocal peak
            while True:
                peak = max(peak, len(service.sandboxes.list()))
                await asyncio.sleep(0.002)

        async with serving(service) as address, grpc.aio.insecure_channel(address) as channel:
            stub = sbx_grpc.EnvSandboxStub(channel)
            task = await stub.GetTask(sbx.GetTaskRequest(task_id="python/add"))
            watcher = asyncio.create_task(watch())
            try:
                groups = await asyncio.wait_for(
                    gather_or_cancel([
                        run_group(
                            policy, stub, task, GROUP_SIZE, Sampling(max_tokens=64), "m", EpisodeLimits(max_turns=2),  # type: ignore[arg-type]
                            budget=budgets[i % len(budgets)], sandbox_wait_s=wait_s,
                        )
                        for i in range(GROUPS)
                    ]),
                    120,
                )
            finally:
                watcher.cancel()
            assert len(service.sandboxes.list()) == 0, "a group left a sandbox behind"
            assert (service.sandboxes.slots.held, service.sandboxes.slots.waiting) == (0, 0)
            return groups, peak

    return asyncio.run(run())


def test_groups_past_envsandboxs_capacity_run_in_waves_under_the_budget(tmp_path: Path, tiny_model: Path) -> None:
    budget = SandboxBudget(CAPACITY)
    groups, peak = _groups(tmp_path / "budget", tiny_model, [budget])
    assert len(groups) == GROUPS and all(len(g) == GROUP_SIZE for g in groups)
    assert all(t.reward == 1.0 for g in groups for t in g)
    assert peak <= CAPACITY and (budget.held, budget.waiting) == (0, 0)

    # Without the budget the groups ask for GROUPS * (GROUP_SIZE + 1) sandboxes at once.
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        _groups(tmp_path / "none", tiny_model, [None])
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_two_rollouts_sharing_envsandbox_each_with_the_whole_limit_run_every_group(tmp_path: Path, tiny_model: Path) -> None:
    """Each rollout reads envsandbox's limit and takes all of it as its budget: together
    they ask for twice the room. Waiting in envsandbox's line, every group runs and is
    scored, and envsandbox never holds more than its limit."""
    budgets: list[SandboxBudget | None] = [SandboxBudget(CAPACITY), SandboxBudget(CAPACITY)]
    groups, peak = _groups(tmp_path / "shared", tiny_model, budgets, wait_s=60)
    assert len(groups) == GROUPS and all(len(g) == GROUP_SIZE for g in groups)
    assert all(t.reward == 1.0 for g in groups for t in g)
    assert peak <= CAPACITY

    # Not waiting, the groups that find envsandbox full fail: what sharing it did before.
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        _groups(tmp_path / "no-wait", tiny_model, [SandboxBudget(CAPACITY), SandboxBudget(CAPACITY)])
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
