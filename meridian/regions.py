"""Several regions in one local stack (``meridian up --regions a,b``).

The first region is the home region: Redis (the trajectory stream), the trainer, the
weightsync origin, an envsandbox and a rollout. Every other region gets what a remote
cluster has: its own envsandbox, a weightsync relay whose upstream is the origin seen
through an emulated WAN link (``meridian link``: bandwidth and latency, cut and restored
by signals), and a rollout that takes its versions from that relay, runs its episodes
in its own sandboxes and writes its trajectories to the home region's stream (each
trajectory names its region, so the trainer reports whose samples it trained on).

This module plans the remote processes and reads a multi-region stack's state; the
stack launcher (:mod:`meridian.stack`) starts and stops them."""
from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path
from typing import Any

_NAME = re.compile(r"^[a-z][a-z0-9]{0,15}$")


def parse_regions(text: str) -> list[str]:
    """Region names from ``a,b,...``: lower-case letters and digits, unique, at least one."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ValueError("regions must name at least one region, e.g. 'a' or 'a,b'")
    bad = [n for n in names if not _NAME.match(n)]
    if bad:
        raise ValueError(f"region names must be 1-16 lower-case letters or digits starting with a letter, got {bad}")
    if len(set(names)) != len(names):
        raise ValueError(f"region names must be unique, got {names}")
    return names


def label(service: str, region: str) -> str:
    """The stack's name for a remote region's copy of a service (``rollout-b``)."""
    return f"{service}-{region}"


@dataclasses.dataclass(frozen=True)
class RemoteProcess:
    """One process of a remote region: its stack label, the name it prints when it
    listens, and its command line (addresses it needs are filled in when it starts)."""

    label: str
    listens_as: str
    argv: list[str]


def link_argv(region: str, origin: str, host: str, run_dir: Path, mbit_s: float, latency_ms: float) -> RemoteProcess:
    """The emulated link from ``region`` to the origin."""
    argv = [
        sys.executable, "-m", "meridian.cli", "link", "--target", origin, "--host", host, "--port", "0",
        "--mbit-s", str(mbit_s), "--latency-ms", str(latency_ms), "--stats-file", str(stats_path(run_dir, region)),
    ]
    return RemoteProcess(label("link", region), "link", argv)


def stats_path(run_dir: Path, region: str) -> Path:
    """Where ``region``'s link process writes its counters."""
    return run_dir / f"{label('link', region)}.json"


def relay_args(region: str, upstream: str, run_dir: Path) -> list[str]:
    """Flags of ``region``'s weightsync relay (its upstream: the link's address)."""
    return ["--role", "relay", "--upstream", upstream, "--data-dir", str(run_dir / label("weightsync", region))]


def rollout_args(region: str, model: str, redis_url: str, relay: str, envsandbox: str) -> list[str]:
    """Flags of ``region``'s rollout: versions from its relay, episodes in its own
    sandboxes, trajectories to the home region's stream. No OpenAI API of its own."""
    return ["--model", model, "--redis-url", redis_url, "--weightsync", relay, "--envsandbox", envsandbox, "--region", region]


def remote_regions(addresses: dict[str, str]) -> list[str]:
    """The remote regions a stack's state names (from its ``rollout-<region>`` entries)."""
    return [name.split("-", 1)[1] for name in addresses if name.startswith("rollout-")]


async def region_status(run_dir: Path, addresses: dict[str, str], home: str, status_of: Any) -> dict[str, dict[str, Any]]:
    """Per region: the version its rollout serves, the newest version its weightsync
    holds, the rollout's lag behind the origin, and (remote regions) the link's figures.
    ``status_of(service, address)`` returns a service's Status reply, or None when it
    cannot be reached."""
    origin = await status_of("weightsync", addresses.get("weightsync", ""))
    latest = origin.latest_version if origin is not None else None
    out: dict[str, dict[str, Any]] = {}
    for region in [home, *remote_regions(addresses)]:
        suffix = "" if region == home else f"-{region}"
        rollout = await status_of("rollout", addresses.get(f"rollout{suffix}", ""))
        sync = origin if region == home else await status_of("weightsync", addresses.get(f"weightsync{suffix}", ""))
        entry: dict[str, Any] = {
            "served_version": rollout.policy_version if rollout is not None else None,
            "weightsync_version": sync.latest_version if sync is not None else None,
            "lag_versions": (latest - rollout.policy_version) if rollout is not None and latest is not None else None,
        }
        if region != home:
            from meridian.link_emulator import read_stats

            entry["link"] = read_stats(stats_path(run_dir, region))
        out[region] = entry
    return out
