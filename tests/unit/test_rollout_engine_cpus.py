"""--engine-cpus: the values a rollout and the local stack take, what each asks vLLM for,
and that the engine's start leaves the environment as it found it."""
from __future__ import annotations

import os

import pytest

from meridian.stack import StackConfig
from services.rollout import engine
from services.rollout.config import RolloutConfig


@pytest.mark.parametrize("cpus", ["auto", "none", "0", "0-3", "0-3,8,10-11"])
def test_valid_values_are_taken_by_the_rollout_and_the_stack(cpus: str) -> None:
    assert RolloutConfig(engine_cpus=cpus).engine_cpus == cpus
    assert StackConfig(engine_cpus=cpus).engine_cpus == cpus


@pytest.mark.parametrize("cpus", ["", "all", "0-", "-3", "3-1", "0,,1", "0 1", "nobind"])
def test_other_values_are_refused_by_name(cpus: str) -> None:
    for make in (RolloutConfig, StackConfig):
        with pytest.raises(ValueError, match="engine_cpus") as raised:
            make(engine_cpus=cpus)
        assert repr(cpus) in str(raised.value)


def test_each_value_asks_vllm_for_its_binding() -> None:
    assert engine.cpu_binding_env("auto") == {}  # vLLM's own, or what the user exported
    assert engine.cpu_binding_env("none") == {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    assert engine.cpu_binding_env("2-5,7") == {"VLLM_CPU_OMP_THREADS_BIND": "2-5,7"}


def test_the_start_environment_is_set_then_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
    with engine.engine_environment({"VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_RPC_BASE_PATH": "/run/x"}):
        assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "nobind" and os.environ["VLLM_RPC_BASE_PATH"] == "/run/x"
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and "VLLM_RPC_BASE_PATH" not in os.environ
