"""The vLLM engine keeps the shape episodes and the OpenAI front door rely on."""
from __future__ import annotations

import inspect
from pathlib import Path

from services.rollout.engine import PRIORITY_PRODUCTION, PRIORITY_RL, Engine, PolicyEngine


def test_vllm_engine_satisfies_the_policy_engine_protocol() -> None:
    engine = Engine(Path("/nonexistent"), max_model_len=64, kv_cache_gib=1, seed=0)  # not started: no vLLM import
    assert isinstance(engine, PolicyEngine)
    assert inspect.isasyncgenfunction(Engine.generate)
    assert inspect.iscoroutinefunction(Engine.score)


def test_an_object_missing_generation_is_not_a_policy_engine() -> None:
    class NoGenerate:
        version = 0
        tokenizer = None

        def prompt_problem(self, ids: list[int]) -> str:
            return ""

        async def score(self, token_ids: list[int]) -> list[float]:
            return []

    assert not isinstance(NoGenerate(), PolicyEngine)


class _CountingTokenizer:
    """len() is a call into the tokenizer library: counted."""

    def __init__(self) -> None:
        self.lens = 0

    def __len__(self) -> int:
        self.lens += 1
        return 100


def test_prompt_problem_counts_before_it_reads_and_asks_the_vocabulary_once() -> None:
    engine = Engine(Path("/nonexistent"), max_model_len=64, kv_cache_gib=1, seed=0)
    engine.tokenizer = tokenizer = _CountingTokenizer()  # type: ignore[assignment]
    # Far too long, and full of bad ids: refused for its length without reading them.
    assert engine.prompt_problem(range(-1, 10_000_000)) == "prompt is 10000001 tokens; the model takes at most 63"
    assert tokenizer.lens == 0
    assert engine.prompt_problem([1, 2, 100, -3, 7] * 10) == "token ids outside the vocabulary (size 100): [100, -3, 100, -3, 100]"
    assert tokenizer.lens == 1
    assert engine.prompt_problem(list(range(63))) == ""


def test_an_rl_callers_score_is_admitted_like_its_generations() -> None:
    """Score by a caller of class rl takes an RL slot (and gives it back) and runs at RL
    priority; a production caller's does not wait for admission."""
    import asyncio

    engine = Engine(Path("/nonexistent"), max_model_len=64, kv_cache_gib=1, seed=0)
    events: list[str] = []

    class Scheduler:
        async def admit_rl(self) -> str:
            events.append("admit")
            return "ticket"

        def release(self, ticket: str) -> None:
            events.append(f"release {ticket}")

    async def score_now(token_ids: list[int], priority: int = PRIORITY_PRODUCTION) -> list[float]:
        events.append(f"score at {priority}")
        return [0.0] * len(token_ids)

    engine.scheduler = Scheduler()  # type: ignore[assignment]
    engine.score_now = score_now  # type: ignore[method-assign]
    asyncio.run(engine.score([1, 2], priority=PRIORITY_RL))
    assert events == ["admit", f"score at {PRIORITY_RL}", "release ticket"]
    events.clear()
    asyncio.run(engine.score([1, 2]))
    assert events == [f"score at {PRIORITY_PRODUCTION}"]
