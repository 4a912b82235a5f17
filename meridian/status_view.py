"""``meridian status --watch``: the stack's status as a live terminal view, redrawn in
place with plain ANSI escapes every ``--interval`` seconds until Ctrl-C.

Each frame is :func:`meridian.stack.gather_status` (health, versions, admission, the
stream) plus figures from the services' metrics endpoints (see :mod:`meridian.metrics`):
rates such as tokens/s come from the difference between two scrapes, so they show from
the second frame on. :func:`render` is pure: a frame from a status dict and figures."""
from __future__ import annotations

import asyncio
import sys
import time
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TextIO

from prometheus_client.parser import text_string_to_metric_families

#: Move home, then clear to the end of the screen after the frame: redraws without flicker.
HOME, CLEAR_LINE, CLEAR_BELOW = "\x1b[H", "\x1b[K", "\x1b[J"

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str, timeout_s: float = 2.0) -> Samples:
    """One metrics endpoint's samples: (name, sorted labels) -> value; {} when it does not answer."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:  # noqa: S310 - the stack's own endpoints
            text = reply.read().decode()
    except OSError:
        return {}
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text) for s in f.samples}


def _total(samples: Iterable[Samples], name: str, **labels: str) -> float | None:
    found = [v for scrape in samples for (n, ls), v in scrape.items() if n == name and set(labels.items()) <= set(ls)]
    return sum(found) if found else None


def figures(current: Mapping[str, Samples], previous: Mapping[str, Samples] | None, elapsed_s: float) -> dict[str, float]:
    """The view's figures from every endpoint's samples (by process name); rates need the
    previous frame's samples and the seconds between the two."""
    now = list(current.values())
    out: dict[str, float] = {}

    def put(key: str, number: float | None) -> None:
        if number is not None:
            out[key] = number

    put("sandboxes", _total(now, "meridian_envsandbox_live_sandboxes"))
    put("sandboxes_reserved", _total(now, "meridian_envsandbox_reserved_sandboxes"))
    put("creates_waiting", _total(now, "meridian_envsandbox_waiting_creates"))
    put("exec_count", _total(now, "meridian_envsandbox_exec_seconds_count"))
    put("stale_dropped", _total(now, "meridian_trainer_stale_samples_total", action="dropped"))
    put("reward", _total(now, "meridian_trainer_reward_mean"))
    put("pass_ratio", _total(now, "meridian_trainer_pass_ratio"))
    put("trainer_waiting", _total(now, "meridian_trainer_trajectories_waiting"))
    lags = [v for scrape in now for (n, _), v in scrape.items() if n == "meridian_rollout_policy_lag_versions"]
    if lags:
        out["max_rollout_lag"] = max(lags)
    if previous is not None and elapsed_s > 0:
        before = list(previous.values())
        for key, name, labels in (
            ("production_tokens_s", "meridian_rollout_tokens_total", {"priority": "production"}),
            ("rl_tokens_s", "meridian_rollout_tokens_total", {"priority": "rl"}),
            ("sync_bytes_s", "meridian_weightsync_sent_bytes_total", {}),
        ):
            a, b = _total(before, name, **labels), _total(now, name, **labels)
            if a is not None and b is not None:
                out[key] = max(0.0, b - a) / elapsed_s  # a restarted service resets its counters
    return out


def render(status: Mapping[str, Any], figures: Mapping[str, float] | None = None, title: str = "meridian status") -> str:
    """One frame: a line per service, then admission, trainer, stream, regions and the
    metrics figures present in ``figures`` (a key that is absent is left out)."""
    figs = figures or {}
    lines = [title, "", f"{'SERVICE':<14}{'HEALTH':<14}{'ADDRESS':<24}VERSION"]
    for name, info in status.get("services", {}).items():
        version = str(info.get("policy_version", ""))
        lines.append(f"{name:<14}{info.get('health', '?'):<14}{info.get('address', ''):<24}{version}")
        if a := info.get("rl_admission"):
            lines.append(
                f"{'':<14}RL {a['running']}/{a['limit']} running, {a['preemptions']} preempted, "
                f"SLO attainment {a['slo_attainment']:.3f}, RL token share {a['rl_token_share']:.3f}"
            )
    lines.append("")
    if "production_tokens_s" in figs or "rl_tokens_s" in figs:
        lines.append(f"tokens/s      production {figs.get('production_tokens_s', 0.0):.1f}, rl {figs.get('rl_tokens_s', 0.0):.1f}")
    if "max_rollout_lag" in figs:
        lines.append(f"policy lag    {figs['max_rollout_lag']:.0f} version(s) behind the newest (worst rollout)")
    if "reward" in figs or "stale_dropped" in figs:
        parts = []
        if "reward" in figs:
            parts.append(f"last step reward {figs['reward']:.3f}, pass rate {figs.get('pass_ratio', 0.0):.3f}")
        if "stale_dropped" in figs:
            parts.append(f"{figs['stale_dropped']:.0f} stale samples dropped")
        if "trainer_waiting" in figs:
            parts.append(f"{figs['trainer_waiting']:.0f} trajectories waiting for their group")
        lines.append("trainer       " + "; ".join(parts))
    if "sandboxes" in figs:
        line = f"sandboxes     {figs['sandboxes']:.0f} live, {figs.get('exec_count', 0.0):.0f} commands run"
        # Shown only when nonzero: room held for forks, and clients waiting for room (envsandbox full).
        if figs.get("sandboxes_reserved"):
            line += f", {figs['sandboxes_reserved']:.0f} reserved for forks"
        if figs.get("creates_waiting"):
            line += f", {figs['creates_waiting']:.0f} Creates waiting for room"
        lines.append(line)
    if "sync_bytes_s" in figs:
        lines.append(f"weightsync    {figs['sync_bytes_s'] / 1e6:.2f} MB/s sent")
    stream = status.get("stream", {})
    if "error" in stream:
        lines.append(f"stream        unavailable: {stream['error']}")
    elif stream:
        lines.append(f"stream        {stream.get('name', '')}: {stream.get('groups', 0)} groups, {stream.get('pending', 0)} pending")
    for region, info in status.get("regions", {}).items():
        lines.append(f"region {region:<7}serves version {info.get('served_version')}, weightsync holds {info.get('weightsync_version')}, lag {info.get('lag_versions')}")
    return "\n".join(lines)


def draw(frame: str, out: TextIO) -> None:
    """Writes ``frame`` over the previous one: home, each line cleared to its end, then
    everything below cleared (a shorter frame leaves nothing of a longer one)."""
    out.write(HOME + "".join(line + CLEAR_LINE + "\n" for line in frame.split("\n")) + CLEAR_BELOW)
    out.flush()


def watch(
    gather: Callable[[], Any], endpoints: Mapping[str, str], interval_s: float, out: TextIO = sys.stdout, frames: int | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> int:
    """Redraws until Ctrl-C (or ``frames`` frames): ``gather()`` returns the status dict
    (a coroutine is run), ``endpoints`` maps process names to metrics URLs."""
    previous: dict[str, Samples] | None = None
    then = clock()
    drawn = 0
    out.write("\x1b[2J")  # a clean screen once; frames then overwrite in place
    try:
        while frames is None or drawn < frames:
            status = gather()
            if asyncio.iscoroutine(status):
                status = asyncio.run(status)
            current = {name: scrape(url) for name, url in endpoints.items()}
            now = clock()
            stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
            title = f"meridian status  {stamp} UTC  (every {interval_s:g} s; Ctrl-C to stop)"
            draw(render(status, figures(current, previous, now - then), title), out)
            previous, then = current, now
            drawn += 1
            if frames is None or drawn < frames:
                time.sleep(interval_s)
    except KeyboardInterrupt:
        pass
    out.write("\n")
    return 0
