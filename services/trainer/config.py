"""Configuration of the trainer service (flags and MERIDIAN_TRAINER_* variables)."""
from __future__ import annotations

import dataclasses

from meridian.config import opt


@dataclasses.dataclass
class TrainerConfig:
    model: str = opt("builtin", "Hugging Face model folder, or 'builtin' for SmolLM2-135M-Instruct")
    weightsync: str = opt("127.0.0.1:50054", "weightsync origin to publish versions to")
    redis_url: str = opt("redis://127.0.0.1:6390/0", "Redis holding the trajectory stream")
    stream: str = opt("meridian:trajectories", "trajectory stream name")
    group: str = opt("trainer", "consumer group name (one per training job)")
    consumer: str = opt("trainer-0", "this process's consumer name within the group")
    groups_per_step: int = opt(1, "complete GRPO groups per optimizer step")
    lr: float = opt(1e-6, "AdamW learning rate")
    weight_decay: float = opt(0.0, "AdamW decoupled weight decay")
    max_grad_norm: float = opt(1.0, "gradient clipping norm (0: off)")
    clip_low: float = opt(0.2, "lower ratio clip epsilon")
    clip_high: float = opt(0.28, "upper ratio clip epsilon")
    max_policy_lag: int = opt(4, "samples older than this many versions are dropped")
    threads: int = opt(1, "torch CPU threads")
    seed: int = opt(0, "torch seed")

    def __post_init__(self) -> None:
        if self.groups_per_step <= 0 or self.lr <= 0 or self.threads <= 0:
            raise ValueError("groups_per_step, lr and threads must be positive")
        if self.clip_low < 0 or self.clip_high < 0 or self.max_policy_lag < 0:
            raise ValueError("clip bounds and max_policy_lag must be >= 0")
