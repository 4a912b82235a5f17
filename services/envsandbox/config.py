"""Configuration of the envsandbox service (flags and MERIDIAN_ENVSANDBOX_* variables)."""
from __future__ import annotations

import dataclasses

from meridian.config import opt


@dataclasses.dataclass
class EnvSandboxConfig:
    root: str = opt("", "folder for sandbox workspaces (empty: a fresh temporary folder)")
    tasks_dir: str = opt("", "extra folder of task JSON files loaded beside the built-in suite")
    max_sandboxes: int = opt(256, "live sandboxes at most; more answers RESOURCE_EXHAUSTED")
    default_ttl_s: float = opt(600.0, "time-to-live of a sandbox that asks for none")
    reap_interval_s: float = opt(5.0, "how often expired sandboxes are closed")

    def __post_init__(self) -> None:
        if self.max_sandboxes <= 0 or self.default_ttl_s <= 0 or self.reap_interval_s <= 0:
            raise ValueError("max_sandboxes, default_ttl_s and reap_interval_s must be positive")
