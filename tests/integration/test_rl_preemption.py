"""An RL request preempted three times by production traffic, with a policy version
change while it waits: the completion assembled from its four segments is, token by
token, what one uninterrupted sampler would have handed the trainer -- no token lost
or repeated, each with the log-prob the engine computes for it in context and the
version that sampled it."""
from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from services.rollout.admission import AdmissionConfig
from services.rollout.engine import PRIORITY_RL, Delta, Engine, Sampling

pytestmark = pytest.mark.engine

HOOKS = Path(__file__).parent / "engine_hooks"
STEP_DELAY_S = 0.02  # each engine step sleeps first (see engine_hooks): 96 tokens take ~2 s
LENGTH = 96
# Tokens received before each preemption. Far apart: on a loaded machine one delta can
# carry a dozen tokens and an abort can take as many steps to land.
PREEMPT_AT = (6, 36, 66)


async def _preempt(engine: Engine, deltas: list[Delta], new_version: int | None) -> int:
    """Production arrives while RL may not run beside it: the RL request is aborted.
    While it waits, optionally a new version is served. Returns the tokens received by then."""
    engine.scheduler.controller.limit = 0
    before, resumed = engine.scheduler.preemptions, engine.rl_resumed
    async with engine.scheduler.production():
        assert engine.scheduler.preemptions == before + 1, "the running RL request should be preempted"
        # Production "runs" until the abort has landed: the preempted segment's stream
        # has ended (its last tokens handed over) and the request waits to resume.
        async with asyncio.timeout(120):
            while engine.rl_resumed == resumed:
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        received = sum(len(d.token_ids) for d in deltas)
        if new_version is not None:
            await engine.label_trial(new_version)
            await engine.settle_trial(new_version, accepted=True)
        assert sum(len(d.token_ids) for d in deltas) == received, "no RL tokens while production runs"
    return received


async def _scenario(engine: Engine, prompt: list[int]) -> tuple[list[Delta], list[float], int]:
    deltas: list[Delta] = []
    received = asyncio.Event()

    async def consume() -> None:
        sampling = Sampling(temperature=1.0, max_tokens=LENGTH, min_tokens=LENGTH, seed=3)
        async for delta in engine.generate(prompt, sampling, PRIORITY_RL, "rl-under-test"):
            deltas.append(delta)
            received.set()

    task = asyncio.create_task(consume())
    boundary = resumed_at = 0
    for i, at in enumerate(PREEMPT_AT):
        # The previous segment may stream more tokens until its abort lands (they count);
        # wait for enough tokens and for the resumed segment to have streamed some.
        while (got := sum(len(d.token_ids) for d in deltas)) < at or got == resumed_at:
            received.clear()
            await asyncio.wait_for(received.wait(), timeout=120)
        # A new version while the request first waits: its later tokens carry version 1.
        resumed_at = await _preempt(engine, deltas, 1 if i == 0 else None)
        boundary = resumed_at if i == 0 else boundary
    await asyncio.wait_for(task, timeout=300)
    tokens = [t for d in deltas for t in d.token_ids]
    scored = await engine.score(prompt + tokens)
    return deltas, scored, boundary


def test_a_trajectory_assembled_across_preemptions_is_exact(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The engine's processes start fresh with the test hooks on their path (the tiny
    # model would otherwise finish before a preemption could land).
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HOOKS), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("MERIDIAN_TEST_STEP_DELAY_S", str(STEP_DELAY_S))
    engine = Engine(tiny_model, max_model_len=512, kv_cache_gib=1, seed=0, admission=AdmissionConfig(max_rl=4, quiet_s=0.05, window_s=60))

    async def body() -> tuple[list[Delta], list[float], int]:
        await engine.start()
        assert engine.tokenizer is not None
        prompt = list(engine.tokenizer("Write a function that adds two numbers.")["input_ids"])
        deltas, scored, boundary = await _scenario(engine, prompt)
        # vLLM's socket files are in the engine's own folder, not loose in the temp folder.
        assert engine.ipc_dir and any(Path(engine.ipc_dir).iterdir())
        return deltas, scored[len(prompt):], boundary

    try:
        deltas, scored, boundary = asyncio.run(body())
    finally:
        ipc_dir = engine.ipc_dir
        engine.shutdown()
    assert not Path(ipc_dir).exists() and "VLLM_RPC_BASE_PATH" not in os.environ  # nothing left for the next engine

    tokens = [t for d in deltas for t in d.token_ids]
    logprobs = [lp for d in deltas for lp in d.logprobs]
    assert [d.finished for d in deltas].count(True) == 1 and deltas[-1].finished
    assert deltas[-1].finish_reason == "length"
    assert engine.scheduler.preemptions == 3 and engine.rl_resumed == 3
    # Every token once: exactly the requested length, each with one log-prob.
    assert len(tokens) == LENGTH and len(logprobs) == LENGTH
    # The version of each token: 0 up to the first preemption, 1 after it.
    versions = deltas[-1].all_versions
    assert versions is not None and len(versions) == LENGTH
    assert PREEMPT_AT[0] <= boundary < LENGTH and versions == [0] * boundary + [1] * (LENGTH - boundary)
    # Each sampled log-prob is the engine's log-prob of that token at that position
    # (teacher forcing over the whole assembled sequence): a lost or repeated token
    # would shift everything after it.
    # (Exact on this CPU; the bounds leave room for kernels whose prefill and decode
    # round differently in bf16.)
    diffs = [abs(a - b) for a, b in zip(logprobs, scored)]
    assert sum(diffs) / len(diffs) < 0.01 and max(diffs) < 0.1, list(zip(tokens, logprobs, scored))
