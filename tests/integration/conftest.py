"""Fixtures for tests that run the real stack: a tiny model and an OTLP receiver."""
from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.otlp_receiver import OtlpReceiver

#: API keys of the shared stack's rollout and their traffic classes, beside the credentials' own
#: (meridian up makes them in the run folder; the fixture's process calls as the operator).
CALLER_KEYS = {"test-production-key": "production", "test-rl-key": "rl"}


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """A tiny random Llama with the built-in tokenizer, cached across runs."""
    from meridian.model_store import cache_dir, make_tiny_model

    return make_tiny_model(cache_dir() / "models" / "tiny-llama-test")


@pytest.fixture(scope="session")
def otlp() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as receiver:
        yield receiver


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, otlp: OtlpReceiver):  # type: ignore[no-untyped-def]
    """The whole local stack on free ports with the tiny model, shared by the tests that
    need it (starting vLLM costs most of a minute). Its teardown checks that stopping
    leaves no process of any service's group behind."""
    from meridian import stack as stack_mod

    run_dir = tmp_path_factory.mktemp("stack")
    config = stack_mod.StackConfig(run_dir=str(run_dir), model=str(tiny_model), ports="auto", ready_timeout_s=600)
    keys = run_dir / "caller-classes.json"
    keys.write_text(json.dumps(CALLER_KEYS))
    # A large step size so one update visibly moves the tiny model's outputs.
    # The rollout's engine on the last CPU this process may use, which vLLM's own binding
    # (the first cores) never picks alone: test_rollout checks the worker is bound there.
    last_cpu = str(max(os.sched_getaffinity(0)))
    extra = {"trainer": ["--lr", "1e-2", "--max-grad-norm", "0"], "rollout": ["--caller-classes", str(keys), "--engine-cpus", last_cpu]}
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": otlp.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "200"}
    with started_stack(config, extra, env) as running:
        yield running


@contextlib.contextmanager
def started_stack(config: Any, extra_args: dict[str, list[str]] | None = None, env: dict[str, str] | None = None) -> Iterator[Any]:
    """A local stack (``meridian.stack.start``) that is stopped on exit, with a check that
    stopping left no process of any group behind."""
    from meridian import stack as stack_mod

    running = stack_mod.start(config, extra_args=extra_args, env=env)
    pids = dict(running.pids)
    try:
        yield running
    finally:
        running.stop(config.stop_timeout_s)
    # stop() returns only once every group is empty: checked at once, no grace period.
    survivors = {name: members for name, pid in pids.items() if (members := stack_mod.group_members(pid))}
    assert not survivors, f"processes left behind after stop: {survivors}"
