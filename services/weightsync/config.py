"""Configuration of the weightsync service (flags and MERIDIAN_WEIGHTSYNC_* variables)."""
from __future__ import annotations

import dataclasses

from meridian.config import opt


@dataclasses.dataclass
class WeightSyncConfig:
    role: str = opt("origin", "origin (accepts Publish) or relay (mirrors --upstream)")
    data_dir: str = opt("", "folder where versions are stored (empty: a temporary folder, lost on exit)")
    upstream: str = opt("", "relay only: address of the weightsync this relay mirrors")
    keep_versions: int = opt(16, "published versions kept; older ones are deleted")
    chunk_mb: float = opt(4.0, "largest encoded chunk, MiB (bounds memory and re-fetch cost)")

    def __post_init__(self) -> None:
        if self.role not in ("origin", "relay"):
            raise ValueError(f"role must be origin or relay, got {self.role!r}")
        if self.role == "relay" and not self.upstream:
            raise ValueError("a relay needs --upstream")
        if self.keep_versions < 2 or self.chunk_mb <= 0:
            raise ValueError("keep_versions must be >= 2 and chunk_mb > 0")
