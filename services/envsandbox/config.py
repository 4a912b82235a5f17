"""Configuration of the envsandbox service (flags and MERIDIAN_ENVSANDBOX_* variables)."""
from __future__ import annotations

import dataclasses

from meridian.config import opt

BACKENDS = ("process", "docker")
#: Distinct sandbox uids, on either backend: one per live sandbox (sandbox.SANDBOX_UID ..
#: + UID_POOL - 1), so ``max_sandboxes`` can be no larger.
UID_POOL = 4096


@dataclasses.dataclass
class EnvSandboxConfig:
    backend: str = opt("process", "sandbox backend: process (namespaces + cgroups, no daemon) or docker")
    root: str = opt("", "folder for the service's sandbox state (empty: a fresh temporary folder)")
    tasks_dir: str = opt("", "extra folder of tasks loaded beside the built-in suite: task *.json files and SWE-bench-style *.jsonl files")
    max_sandboxes: int = opt(256, f"live sandboxes at most (up to {UID_POOL}), counting those still being torn down and the slots "
                                  "Creates reserved for their forks; a Create past it waits in line up to its wait_seconds, else answers RESOURCE_EXHAUSTED")
    max_create_wait_s: float = opt(600.0, "the longest a Create waits in line for room (its wait_seconds is cut to this)")
    default_ttl_s: float = opt(600.0, "time-to-live of a sandbox that asks for none")
    reap_interval_s: float = opt(5.0, "how often expired sandboxes are closed")
    docker_host: str = opt("", "docker backend: daemon address, e.g. unix:///run/docker.sock (empty: DOCKER_HOST or the default)")
    docker_image: str = opt("", "docker backend: image to run (empty: build the minimal base image locally)")

    def __post_init__(self) -> None:
        if self.max_sandboxes <= 0 or self.default_ttl_s <= 0 or self.reap_interval_s <= 0:
            raise ValueError("max_sandboxes, default_ttl_s and reap_interval_s must be positive")
        if self.max_sandboxes > UID_POOL:
            raise ValueError(f"max_sandboxes must be at most {UID_POOL}: each live sandbox runs as a uid of its own from a pool that large, got {self.max_sandboxes}")
        if not 0 <= self.max_create_wait_s < float("inf"):
            raise ValueError(f"max_create_wait_s must be finite and >= 0, got {self.max_create_wait_s}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
