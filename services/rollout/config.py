"""Configuration of the rollout service (flags and MERIDIAN_ROLLOUT_* variables)."""
from __future__ import annotations

import dataclasses

from meridian.config import opt


@dataclasses.dataclass
class RolloutConfig:
    model: str = opt("builtin", "Hugging Face model folder, or 'builtin' for SmolLM2-135M-Instruct")
    envsandbox: str = opt("127.0.0.1:50052", "envsandbox address")
    weightsync: str = opt("", "weightsync address to take new policy versions from (empty: none)")
    redis_url: str = opt("redis://127.0.0.1:6390/0", "Redis holding the trajectory stream")
    stream: str = opt("meridian:trajectories", "trajectory stream name")
    group_size: int = opt(4, "samples per task (GRPO group) when a request asks for none")
    max_tokens: int = opt(128, "generated tokens per sample when a request asks for none")
    temperature: float = opt(1.0, "RL sampling temperature when a request gives none")
    max_model_len: int = opt(2048, "longest prompt + completion, tokens")
    kv_cache_gib: float = opt(1.0, "CPU KV cache size, GiB")
    seed: int = opt(0, "engine seed")

    def __post_init__(self) -> None:
        if self.group_size <= 0 or self.max_tokens <= 0 or self.max_model_len <= 0:
            raise ValueError("group_size, max_tokens and max_model_len must be positive")
        if self.kv_cache_gib <= 0:
            raise ValueError("kv_cache_gib must be positive")
