"""The vLLM engine keeps the shape episodes and the OpenAI front door rely on."""
from __future__ import annotations

import inspect
from pathlib import Path

from services.rollout.engine import Engine, PolicyEngine


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
