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
