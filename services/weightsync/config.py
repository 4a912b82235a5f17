"""Configuration of the weightsync service (flags and MERIDIAN_WEIGHTSYNC_* variables)."""
from __future__ import annotations

import dataclasses

from meridian.config import opt

#: The origin's default chunk size (``chunk_mb``); a follower that cannot ask assumes it.
DEFAULT_CHUNK_MB = 4.0


@dataclasses.dataclass
class WeightSyncConfig:
    role: str = opt("origin", "origin (accepts Publish) or relay (mirrors --upstream)")
    data_dir: str = opt("", "folder where versions are stored (empty: a temporary folder, lost on exit)")
    upstream: str = opt("", "relay only: address of the weightsync this relay mirrors")
    keep_versions: int = opt(16, "published versions kept; older ones are deleted")
    chunk_mb: float = opt(DEFAULT_CHUNK_MB, "largest chunk of raw tensor bytes, MiB, before encoding (bounds memory and re-fetch cost; a model of hundreds of billions of parameters wants more, e.g. 32: fewer chunks, each with its own per-chunk costs)")
    encode_threads: int = opt(0, "threads the origin encodes a version on, over its tensors (0: one per CPU core this process may run on); keyframes and late joiners' deltas too")
    keyframe_every: int = opt(8, "a keyframe is stored beside every Nth version (recovery starts there)")
    send_mib_s: float = opt(0.0, "cap on what this server sends to subscribers, MiB/s in total (0: none)")
    upstream_mib_s: float = opt(0.0, "relay only: cap on what it reads from its upstream, MiB/s (0: none)")
    message_kib: int = opt(64, "Subscribe coalesces consecutive chunks already held into messages of up to this many KiB (per-message costs dominate a delta's small chunks)")
    window_mib: float = opt(32.0, "relay only: HTTP/2 flow-control window of its upstream stream, MiB, sized to the link's bandwidth-delay product (32: 1 Gbit/s at 200 ms round trip; 0: gRPC's adaptive window, which grows over several round trips)")
    max_subscribe_streams: int = opt(256, "Subscribe streams open at once (followers, relays, catch-ups); more answer RESOURCE_EXHAUSTED")
    max_publish_gib: float = opt(16.0, "tensor bytes one Publish may declare, GiB; a declaration past it answers RESOURCE_EXHAUSTED before anything is allocated")
    max_publish_total_gib: float = opt(32.0, "tensor bytes all Publish streams in flight may declare together, GiB; past it RESOURCE_EXHAUSTED")
    part_timeout_s: float = opt(120.0, "sharded publish: how long the origin waits, from a version's first part, for all its parts to be received and encoded; past it the version is aborted and every part answered DEADLINE_EXCEEDED")
    verify_key: str = opt("", "Ed25519 public key (PEM) versions must be signed with: an origin refuses an unsigned or badly signed Publish (PERMISSION_DENIED), a relay refuses such a version from upstream (not stored, not served) and keeps serving the previous one (empty: no check)")

    def __post_init__(self) -> None:
        if self.role not in ("origin", "relay"):
            raise ValueError(f"role must be origin or relay, got {self.role!r}")
        if self.role == "relay" and not self.upstream:
            raise ValueError("a relay needs --upstream")
        if self.keep_versions < 2 or self.chunk_mb <= 0 or self.keyframe_every < 1:
            raise ValueError("keep_versions must be >= 2, chunk_mb > 0 and keyframe_every >= 1")
        if self.send_mib_s < 0 or self.upstream_mib_s < 0:
            raise ValueError("send_mib_s and upstream_mib_s must be >= 0 (0: no cap)")
        if self.encode_threads < 0:
            raise ValueError(f"encode_threads must be >= 0 (0: one per CPU core this process may run on), got {self.encode_threads}")
        if self.message_kib < 1 or self.window_mib < 0:
            raise ValueError("message_kib must be >= 1 and window_mib >= 0")
        if self.max_subscribe_streams < 1:
            raise ValueError(f"max_subscribe_streams must be >= 1, got {self.max_subscribe_streams}")
        if self.part_timeout_s <= 0:
            raise ValueError(f"part_timeout_s must be > 0, got {self.part_timeout_s}")
        if not 0 < self.max_publish_gib <= self.max_publish_total_gib:
            raise ValueError("max_publish_gib must be > 0 and at most max_publish_total_gib")
