"""``meridian train``: an RL job on a running stack (``--rollout`` and ``--trainer``), or
on a local stack it starts and stops. Prints live progress (trainer steps, trained
samples per second, reward, policy lag, the version rollout serves) and writes a report
folder at the end (``summary.json`` and, with matplotlib, ``training.png``).

Two modes:
- ``async`` (the default, the pipeline): ``--in-flight`` samplers keep RL episodes
  running on rollout while the trainer steps on complete groups as they arrive and
  publishes in the background; samplers pause while two batches wait untrained, so
  samples stay within the staleness bound;
- ``sync``: sample a batch, wait for the trainer's step and for rollout to serve it,
  repeat (for comparison).

Trainer settings (learning rate, staleness bound, groups per step) and the task folder
apply when this command starts the stack; a running stack keeps its own.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import json
import shlex
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from meridian import stack as stack_mod
from meridian.config import add_config_args, config_from_args, opt

# python_function tasks of the training split that the built-in 135M model solves some of
# the time (pass rates 0.125-0.875 over 8 samples at temperature 0.6): every GRPO group
# has reward variance to learn from. Tasks it never solves (clamp, gcd, fizzbuzz, ...)
# would give flat groups, samples that cost a step's time and carry no gradient.
TRAIN_TASKS = (
    "python/average,python/factorial,python/max_of_list,python/min_max,python/remove_duplicates,python/last_element,"
    "python/add,python/char_frequency,python/count_words,python/square,python/multiply,python/sum_of_squares"
)
MODES = ("async", "sync")
POLL_S = 0.25


@dataclasses.dataclass
class TrainConfig:
    steps: int = opt(8, "trainer steps (new policy versions) to run")
    mode: str = opt("async", "async: sampling beside training (the pipeline); sync: sample, then train, alternating")
    model: str = opt("builtin", "model folder, or 'builtin' for SmolLM2-135M-Instruct (when this command starts the stack)")
    tasks_per_step: int = opt(2, "GRPO groups per trainer step")
    group_size: int = opt(6, "samples per task")
    max_tokens: int = opt(128, "generated tokens per model turn")
    lr: float = opt(1e-5, "trainer learning rate (when this command starts the stack)")
    max_policy_lag: int = opt(4, "staleness bound in versions (when this command starts the stack; the trainer's own default)")
    train_tasks: str = opt(TRAIN_TASKS, "comma-separated training task ids, cycled through (empty: the server picks)")
    tasks_dir: str = opt("", "folder of your own task files (JSON, SWE-bench JSONL) for envsandbox (when this command starts the stack)")
    temperature: float = opt(0.6, "sampling temperature of the training episodes")
    in_flight: int = opt(2, "async: RunEpisodes requests kept running at once")
    rollout: str = opt("", "rollout address of a running stack, or several comma-separated (one per region; empty: start a local stack)")
    trainer: str = opt("", "trainer address of a running stack")
    step_timeout_s: float = opt(600.0, "seconds without a new trainer step before the job gives up")
    run_dir: str = opt("", "stack run folder when this command starts the stack (empty: a temporary one, emptied but for its logs and report once the stack stops)")
    trainer_flags: str = opt("", "more trainer flags when this command starts the stack, e.g. '--autocast-bf16 true --attention eager' (they override this job's)")
    report_dir: str = opt("", "report folder (empty: <run_dir>/report, or ./meridian-report on a running stack)")
    regions: str = opt("a", "regions of the stack this command starts (see meridian up --regions): each region's rollout samples for the job")
    link_mbit_s: float = opt(100.0, "emulated inter-region link bandwidth, Mbit/s (when this command starts a multi-region stack)")
    link_latency_ms: float = opt(50.0, "emulated inter-region link one-way latency, ms (when this command starts a multi-region stack)")
    retry_s: float = opt(180.0, "seconds the job keeps retrying a call to a service that is restarting (UNAVAILABLE) before it gives up")
    retry_codes: str = opt("UNAVAILABLE", "comma-separated gRPC status codes the job retries with backoff")

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.steps <= 0 or self.tasks_per_step <= 0 or self.group_size < 2 or self.in_flight <= 0:
            raise ValueError("steps, tasks_per_step and in_flight must be positive, group_size >= 2")
        if self.temperature < 0 or self.max_policy_lag < 0 or self.lr <= 0:
            raise ValueError("temperature and max_policy_lag must be >= 0, lr > 0")
        if bool(self.rollout) != bool(self.trainer):
            raise ValueError("a running stack needs both --rollout and --trainer")

    def trainer_args(self) -> list[str]:
        """The trainer flags this job needs when it starts the stack."""
        own = ["--lr", repr(self.lr), "--groups-per-step", str(self.tasks_per_step), "--max-policy-lag", str(self.max_policy_lag), "--threads", "2"]
        return own + shlex.split(self.trainer_flags)  # the last of a repeated flag wins


def task_ids(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


RETRY_PAUSES_S = (0.25, 0.5, 1.0, 2.0, 4.0)


async def retrying(call: Callable[[], Awaitable[Any]], codes: frozenset[str], within_s: float, what: str) -> Any:
    """``call()``, again with backoff while it fails with one of ``codes`` (a service
    being restarted refuses connections meanwhile), for up to ``within_s`` seconds."""
    import grpc

    deadline = time.monotonic() + within_s
    attempt = 0
    while True:
        try:
            return await call()
        except grpc.aio.AioRpcError as exc:
            if exc.code().name not in codes or time.monotonic() > deadline:
                raise
            pause = RETRY_PAUSES_S[min(attempt, len(RETRY_PAUSES_S) - 1)]
            attempt += 1
            print(f"{what}: {exc.code().name} ({exc.details()}); retrying in {pause:.2f} s", file=sys.stderr, flush=True)
            await asyncio.sleep(pause)


async def service_status(address: str, kind: str) -> Any:
    """``Status`` of a rollout or trainer."""
    from meridian.grpc_runtime import open_channel
    from meridian.v1 import rollout_pb2, rollout_pb2_grpc, trainer_pb2, trainer_pb2_grpc

    async with open_channel(address) as channel:
        if kind == "rollout":
            return await rollout_pb2_grpc.RolloutStub(channel).Status(rollout_pb2.RolloutStatusRequest(), timeout=10)
        return await trainer_pb2_grpc.TrainerStub(channel).Status(trainer_pb2.TrainerStatusRequest(), timeout=10)


class Job:
    """One RL job's sampling and its view of the trainer's progress."""

    def __init__(self, addresses: dict[str, str], config: TrainConfig, progress: bool) -> None:
        self.addresses = addresses
        # The home region's rollout first, then each remote region's (``rollout-<region>``).
        self.rollouts = [addresses["rollout"], *(a for name, a in addresses.items() if name.startswith("rollout-"))]
        self.config = config
        self.progress = progress
        self.tasks = task_ids(config.train_tasks)
        self._next_task = 0
        self.sampled = 0  # trajectories published by this job
        self.rewards: list[float] = []
        self.sample_seconds: list[float] = []  # each RunEpisodes request, start to reply
        self.consumed = 0  # trajectories the trainer consumed since the job started
        self.started = 0.0
        self.retry_codes = frozenset(c.strip().upper() for c in config.retry_codes.split(",") if c.strip())
        #: ids of the trajectories each RunEpisodes reply said it published
        self.published_ids: list[str] = []
        #: RunEpisodes requests running now, by rollout address
        self.in_flight: collections.Counter[str] = collections.Counter()

    async def _status(self, address: str, kind: str) -> Any:
        """``Status`` of a rollout or trainer, retried while it restarts, and (a read, safe
        to repeat) when it times out on a loaded machine: a demo lost its last evaluation
        to one Status call that took over 10 s at load 31."""
        codes = self.retry_codes | {"DEADLINE_EXCEEDED"}
        return await retrying(lambda: service_status(address, kind), codes, self.config.retry_s, f"{kind} {address} Status")

    def _pick(self, n: int) -> list[str]:
        if not self.tasks:
            return []
        picked = [self.tasks[(self._next_task + i) % len(self.tasks)] for i in range(n)]
        self._next_task += n
        return picked

    async def _sample(self, rollout: Any, groups: int, address: str = "") -> None:
        from meridian.v1 import rollout_pb2

        picked = self._pick(groups)
        started = time.monotonic()
        request = rollout_pb2.RunEpisodesRequest(
            task_ids=picked,
            num_tasks=0 if picked else groups,
            group_size=self.config.group_size,
            publish=True,
            sampling=rollout_pb2.SamplingParams(max_tokens=self.config.max_tokens, temperature=self.config.temperature),
        )

        async def call() -> Any:
            self.in_flight[address] += 1
            try:
                # a stalled rollout ends the job with its error
                return await rollout.RunEpisodes(request, timeout=self.config.step_timeout_s)
            finally:
                self.in_flight[address] -= 1

        # A rollout restarted mid-request may have published some groups already: the
        # retry samples new ones (new ids); the trainer trains on all of them.
        reply = await retrying(call, self.retry_codes, self.config.retry_s, f"RunEpisodes on {address or 'rollout'}")
        self.sample_seconds.append(time.monotonic() - started)
        self.sampled += len(reply.trajectories)
        self.published_ids.extend(t.trajectory_id for t in reply.trajectories)
        self.rewards.extend(t.reward for t in reply.trajectories)

    async def _sampler(self, rollout: Any) -> None:
        """Async mode: one group per request, pausing while two batches wait untrained."""
        backlog = 2 * self.config.tasks_per_step * self.config.group_size
        while True:
            if self.sampled - self.consumed >= backlog:
                await asyncio.sleep(POLL_S)
                continue
            await self._sample(rollout, 1, getattr(rollout, "address", ""))

    async def run(self) -> dict[str, Any]:
        """Runs ``steps`` trainer steps; returns the summary."""
        from meridian.grpc_runtime import open_channel
        from meridian.v1 import rollout_pb2_grpc

        cfg = self.config
        first = await self._status(self.addresses["trainer"], "trainer")
        start_step, consumed0 = first.step, first.trajectories_consumed
        start_version = (await self._served())[0]
        self.started = time.monotonic()
        async with contextlib.AsyncExitStack() as channels:
            stubs = [rollout_pb2_grpc.RolloutStub(await channels.enter_async_context(open_channel(a))) for a in self.rollouts]
            for stub, address in zip(stubs, self.rollouts):
                stub.address = address  # type: ignore[attr-defined]  # what in_flight counts by
            # Every region samples: at least one request in flight per rollout.
            in_flight = max(cfg.in_flight, len(stubs))
            samplers = [asyncio.create_task(self._sampler(stubs[i % len(stubs)])) for i in range(in_flight)] if cfg.mode == "async" else []
            try:
                trainer, served = await self._follow(stubs, start_step, consumed0, samplers)
            finally:
                for task in samplers:
                    task.cancel()
                await asyncio.gather(*samplers, return_exceptions=True)
        served_by_region = await self._served_by_region()
        seconds = time.monotonic() - self.started
        steps = [m for m in trainer.recent_steps if m.step > start_step and m.stepped]
        trained = sum(m.trajectories for m in steps)
        return {
            "mode": cfg.mode,
            "steps": len(steps),
            "seconds": round(seconds, 1),
            "trained_samples": trained,
            "samples_per_s": round(trained / seconds, 3) if seconds else 0.0,
            "trajectories_sampled": self.sampled,
            "trajectories_consumed": trainer.trajectories_consumed - consumed0,
            "sample_reward_mean": round(sum(self.rewards) / len(self.rewards), 4) if self.rewards else None,
            "policy_version_start": start_version,
            "policy_version_end": served,
            "dropped_stale_total": trainer.dropped_stale_total - first.dropped_stale_total,
            "model": trainer.model,
            "served_by_region": served_by_region,
            "trained_by_region": dict(sum((collections.Counter(dict(m.trajectories_by_region)) for m in steps), collections.Counter())),
            "trainer_steps": [step_summary(m) for m in steps],
            "sample_seconds": [round(x, 3) for x in self.sample_seconds],
        }

    async def _served(self) -> list[int]:
        """The policy version each rollout serves (home region first)."""
        return [(await self._status(a, "rollout")).policy_version for a in self.rollouts]

    async def _served_by_region(self) -> dict[str, int]:
        replies = [await self._status(a, "rollout") for a in self.rollouts]
        return {r.region or f"rollout{i}": r.policy_version for i, r in enumerate(replies)}

    async def _sample_everywhere(self, stubs: list[Any], groups: int) -> None:
        """Sync mode: ``groups`` groups spread over the regions' rollouts, at once."""
        shares = [groups // len(stubs) + (1 if i < groups % len(stubs) else 0) for i in range(len(stubs))]
        await asyncio.gather(*(self._sample(stub, n, stub.address) for stub, n in zip(stubs, shares) if n))

    async def _follow(self, stubs: list[Any], start_step: int, consumed0: int, samplers: list[asyncio.Task[None]]) -> tuple[Any, int]:
        """Waits for ``steps`` trainer steps served by every region's rollout (sampling,
        in sync mode); prints a line per step. Returns the last trainer status and the
        version every rollout serves (the lowest)."""
        cfg = self.config
        reported = start_step
        last_progress = time.monotonic()
        while True:
            if cfg.mode == "sync":
                await self._sample_everywhere(stubs, cfg.tasks_per_step)
            while True:
                for task in samplers:
                    if task.done():
                        task.result()  # a sampler's failure ends the job with its error
                trainer = await self._status(self.addresses["trainer"], "trainer")
                served = min(await self._served())
                self.consumed = trainer.trajectories_consumed - consumed0
                if trainer.step > reported:
                    reported = trainer.step
                    last_progress = time.monotonic()
                    self._report(trainer, served, start_step)
                stepped = trainer.step - start_step >= cfg.steps
                if stepped and served >= trainer.policy_version:
                    return trainer, served
                if stepped:
                    # Enough steps: stop feeding the trainer, or a trainer that steps
                    # faster than rollout applies versions is never caught up with.
                    for task in samplers:
                        task.cancel()
                    await asyncio.gather(*samplers, return_exceptions=True)
                    samplers = []
                if cfg.mode == "sync" and self.consumed >= self.sampled and served >= trainer.policy_version:
                    break  # this batch is trained (or was flat) and served: sample the next
                if time.monotonic() - last_progress > cfg.step_timeout_s:
                    raise TimeoutError(f"no trainer step for {cfg.step_timeout_s:.0f} s (trainer at step {trainer.step}, rollout serves version {served})")
                await asyncio.sleep(POLL_S)

    def _report(self, trainer: Any, served: int, start_step: int) -> None:
        if not self.progress:
            return
        last = trainer.recent_steps[-1] if trainer.recent_steps else None
        seconds = time.monotonic() - self.started
        trained = sum(m.trajectories for m in trainer.recent_steps if m.step > start_step and m.stepped)
        detail = f"reward {last.reward_mean:.3f}, lag {last.policy_lag_mean:.2f}, stale dropped {last.dropped_stale}" if last else ""
        done = trainer.step - start_step
        # Past the steps asked for: groups sampled before the job stopped sampling, trained.
        count = f"{done}/{self.config.steps}" if done <= self.config.steps else f"{done} ({self.config.steps} asked; groups already sampled)"
        print(
            f"step {count} (version {trainer.policy_version}): "
            f"{trained / seconds:.2f} trained samples/s, {detail}, rollout serves version {served} [{seconds:.0f} s]",
            file=sys.stderr,
            flush=True,
        )


def step_summary(m: Any) -> dict[str, Any]:
    """One trainer step as the report keeps it."""
    return {
        "step": m.step,
        "policy_version": m.policy_version,
        "reward_mean": m.reward_mean,
        "pass_rate": m.pass_rate,
        "policy_lag_mean": m.policy_lag_mean,
        "trajectories": m.trajectories,
        "dropped_stale": m.dropped_stale,
        "downweighted_stale": m.downweighted_stale,
        "weightsync_encoded_bytes": m.weightsync_encoded_bytes,
        "weightsync_raw_bytes": m.weightsync_raw_bytes,
        "loss": m.loss,
        "grad_norm": m.grad_norm,
        "step_seconds": m.step_seconds,
        "commit_seconds": m.commit_seconds,
        "publish_seconds": m.publish_seconds,
        "peak_rss_mb": m.peak_rss_mb,
    }


def write_report(report_dir: Path, summary: dict[str, Any], title: str) -> Path:
    """Writes summary.json and training.png: reward, pass rate, policy lag, weight-sync
    bytes and the loss per step, and (from ``meridian demo``) the held-out pass rate by
    policy version."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report_dir.mkdir(parents=True, exist_ok=True)
    (report_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    steps = summary["trainer_steps"]
    x = [s["step"] for s in steps]
    fig, axes = plt.subplots(2, 3, figsize=(14, 7))
    panels = [
        ("reward (mean of the batch)", "reward_mean", axes[0][0]),
        ("pass rate (reward 1)", "pass_rate", axes[0][1]),
        ("policy lag (versions, mean)", "policy_lag_mean", axes[1][0]),
        ("weight-sync bytes (encoded)", "weightsync_encoded_bytes", axes[1][1]),
        ("loss", "loss", axes[1][2]),
    ]
    for name, key, ax in panels:
        ax.plot(x, [s[key] for s in steps], marker="o")
        ax.set_title(name)
        ax.set_xlabel("trainer step")
        ax.grid(alpha=0.3)
    _held_out_panel(axes[0][2], summary)
    fig.suptitle(title)
    fig.tight_layout()
    path = report_dir / "training.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _held_out_panel(ax: Any, summary: dict[str, Any]) -> None:
    """Held-out pass@1 by the policy version that generated the samples (marker area:
    samples; adjusted for which tasks each version drew when the curve has that, with a
    running mean over 5 versions), with the before and after evaluations as the endpoints."""
    ax.set_title("held-out pass@1 by policy version")
    ax.set_xlabel("policy version")
    ax.grid(alpha=0.3)
    curve = summary.get("eval_curve") or []
    if curve:
        key = "pass_at_1_adjusted" if all("pass_at_1_adjusted" in p for p in curve) else "pass_rate"
        versions, rates = [p["policy_version"] for p in curve], [p[key] for p in curve]
        ax.scatter(versions, rates, s=[4 * p["samples"] for p in curve], alpha=0.5, label="during training" + (" (task-adjusted)" if key != "pass_rate" else ""))
        mean = [sum(rates[max(0, i - 4) : i + 1]) / len(rates[max(0, i - 4) : i + 1]) for i in range(len(rates))]
        ax.plot(versions, mean, color="tab:blue", label="running mean (5 versions)")
    ends = [(summary.get("policy_version_start"), summary.get("eval_before")), (summary.get("policy_version_end"), summary.get("eval_after"))]
    ends = [(v, e) for v, e in ends if v is not None and e]
    if ends:
        ax.plot([v for v, _ in ends], [e["pass_at_1"] for _, e in ends], "s--", color="tab:red", label="before / after (pass@1)")
    if curve or ends:
        ax.legend(fontsize=8)


def start_stack(config: TrainConfig, run_dir: str) -> tuple[stack_mod.Stack, stack_mod.StackConfig]:
    """A local stack with the job's trainer settings and task folder."""
    stack_config = stack_mod.StackConfig(
        run_dir=run_dir, model=config.model, ports="auto", regions=config.regions, link_mbit_s=config.link_mbit_s, link_latency_ms=config.link_latency_ms
    )
    extra = {"trainer": config.trainer_args()}
    if config.tasks_dir:
        extra["envsandbox"] = ["--tasks-dir", str(Path(config.tasks_dir).resolve())]
    print(f"starting the local stack in {run_dir} (model {config.model}) ...", file=sys.stderr, flush=True)
    return stack_mod.start(stack_config, extra_args=extra), stack_config


def run_job(config: TrainConfig, body: Callable[[dict[str, str]], Awaitable[dict[str, Any]]], prefix: str) -> tuple[dict[str, Any], Path]:
    """Runs ``body`` (addresses -> summary) on the running stack the config names, or on a
    local stack started (in a ``prefix`` run folder) and stopped around it; returns the
    summary and the report folder. A temporary run folder (no ``run_dir``) keeps only the
    stack's logs and the report."""
    if config.rollout:
        first, *others = task_ids(config.rollout)
        addresses = {"rollout": first, "trainer": config.trainer, **{f"rollout-{i + 2}": a for i, a in enumerate(others)}}
        summary = asyncio.run(body(addresses))
        return summary, Path(config.report_dir or "meridian-report")
    run_dir = config.run_dir or tempfile.mkdtemp(prefix=prefix)
    stack, stack_config = start_stack(config, run_dir)
    try:
        summary = asyncio.run(body(stack.addresses))
    finally:
        stack.stop(stack_config.stop_timeout_s)
        if not config.run_dir:  # a folder of its own: what is left to read is the logs and the report
            stack_mod.empty_temporary_run_dir(Path(run_dir), keep=frozenset({"report"}))
    return summary, Path(config.report_dir or Path(run_dir) / "report")


def print_summary(summary: dict[str, Any], as_json: bool, heading: str) -> None:
    """One JSON object, or the summary without its per-step list."""
    if as_json:
        print(json.dumps(summary))
        return
    print(f"\n{heading}")
    for key, value in summary.items():
        if key != "trainer_steps":
            print(f"  {key:<22} {value}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="meridian train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(parser, TrainConfig, "train")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    ns = parser.parse_args(argv)
    try:
        config = config_from_args(TrainConfig, ns, "train")
    except ValueError as exc:
        parser.error(str(exc))
    if config.rollout:
        # A running stack started from this run folder (or the default one): call it as
        # its operator with nothing to set (elsewhere: MERIDIAN_CREDENTIALS).
        stack_mod.Stack.load(Path(config.run_dir or stack_mod.StackConfig.run_dir).resolve())
    summary, report_dir = run_job(config, lambda addresses: Job(addresses, config, progress=True).run(), "meridian-train-")
    plot = write_report(report_dir, summary, f"meridian train ({summary['model']}, {config.mode}): {summary['samples_per_s']} trained samples/s")
    print(f"report: {plot} and {report_dir / 'summary.json'}", file=sys.stderr, flush=True)
    print_summary(summary, ns.json, "Meridian train summary")
    return 0
