"""Config dataclasses become flags whose defaults come from MERIDIAN_* variables."""
from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

import pytest

from meridian.config import add_config_args, config_from_args, env_name, opt, parse_bool, parse_config
from meridian.grpc_runtime import ServerConfig
from services.envsandbox.config import EnvSandboxConfig
from services.trainer.config import TrainerConfig
from services.weightsync.config import WeightSyncConfig


@dataclasses.dataclass
class Toy:
    name: str = opt("alpha", "a name")
    count: int = opt(3, "a count")
    ratio: float = opt(0.5, "a ratio")
    enabled: bool = opt(False, "a switch")
    derived: int = dataclasses.field(default=0, init=False)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # Tests must not pick up MERIDIAN_* variables from the developer's shell.
    for key in list(os.environ):
        if key.startswith("MERIDIAN_"):
            monkeypatch.delenv(key)


def test_env_name_upper_cases_and_replaces_dashes() -> None:
    assert env_name("toy", "max_count") == "MERIDIAN_TOY_MAX_COUNT"
    assert env_name("env-sandbox", "root") == "MERIDIAN_ENV_SANDBOX_ROOT"


def test_defaults_without_flags_or_env() -> None:
    cfg = parse_config(Toy, "toy", [])
    assert (cfg.name, cfg.count, cfg.ratio, cfg.enabled) == ("alpha", 3, 0.5, False)


def test_flags_are_parsed_and_typed() -> None:
    cfg = parse_config(Toy, "toy", ["--name", "beta", "--count", "7", "--ratio", "0.25", "--enabled", "yes"])
    assert cfg == Toy(name="beta", count=7, ratio=0.25, enabled=True)
    assert isinstance(cfg.count, int) and isinstance(cfg.ratio, float)


def test_underscored_field_becomes_dashed_flag() -> None:
    cfg = parse_config(TrainerConfig, "trainer", ["--groups-per-step", "3", "--max-policy-lag", "0"])
    assert cfg.groups_per_step == 3 and cfg.max_policy_lag == 0


def test_non_init_field_has_no_flag() -> None:
    parser = argparse.ArgumentParser()
    add_config_args(parser, Toy, "toy")
    with pytest.raises(SystemExit):
        parser.parse_args(["--derived", "1"])


def test_env_overrides_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MERIDIAN_TOY_COUNT", "42")
    monkeypatch.setenv("MERIDIAN_TOY_NAME", "from-env")
    monkeypatch.setenv("MERIDIAN_TOY_ENABLED", "on")
    cfg = parse_config(Toy, "toy", [])
    assert (cfg.name, cfg.count, cfg.enabled) == ("from-env", 42, True)


def test_flag_beats_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MERIDIAN_TOY_COUNT", "42")
    assert parse_config(Toy, "toy", ["--count", "5"]).count == 5


def test_env_of_another_section_is_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MERIDIAN_OTHER_COUNT", "42")
    assert parse_config(Toy, "toy", []).count == 3


def test_help_names_env_var_and_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MERIDIAN_TOY_COUNT", "9")
    parser = argparse.ArgumentParser()
    add_config_args(parser, Toy, "toy")
    text = parser.format_help()
    assert "MERIDIAN_TOY_COUNT" in text
    assert "a count" in text
    assert "default: 9" in text  # the env value is the effective default


@pytest.mark.parametrize("text", ["1", "true", "TRUE", " yes ", "On"])
def test_parse_bool_true(text: str) -> None:
    assert parse_bool(text) is True


@pytest.mark.parametrize("text", ["0", "false", "False", "no", "OFF", ""])
def test_parse_bool_false(text: str) -> None:
    assert parse_bool(text) is False


@pytest.mark.parametrize("text", ["2", "maybe", "y", "t", "enabled"])
def test_parse_bool_rejects_ambiguous(text: str) -> None:
    with pytest.raises(ValueError, match="not a boolean"):
        parse_bool(text)


def test_bad_bool_flag_is_an_argparse_error() -> None:
    with pytest.raises(SystemExit) as info:
        parse_config(Toy, "toy", ["--enabled", "maybe"])
    assert info.value.code == 2


@pytest.mark.parametrize(
    ("var", "value"),
    [("MERIDIAN_TOY_COUNT", "many"), ("MERIDIAN_TOY_RATIO", "half"), ("MERIDIAN_TOY_ENABLED", "perhaps")],
)
def test_invalid_env_value_exits_naming_the_variable(monkeypatch: pytest.MonkeyPatch, var: str, value: str) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(SystemExit) as info:
        parse_config(Toy, "toy", [])
    message = str(info.value.code)
    assert var in message and value in message


def test_unsupported_field_type_is_rejected() -> None:
    @dataclasses.dataclass
    class Bad:
        items: list = opt(None, "a list")  # type: ignore[type-arg]

    with pytest.raises(TypeError, match="unsupported config field type"):
        parse_config(Bad, "bad", [])


def test_config_from_args_runs_post_init_validation() -> None:
    parser = argparse.ArgumentParser()
    add_config_args(parser, ServerConfig, "server")
    namespace = parser.parse_args(["--port", "70000"])
    with pytest.raises(ValueError, match="port"):
        config_from_args(ServerConfig, namespace, "server")


# ---------------------------------------------------------------- real config classes


def test_server_config_defaults_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_config(ServerConfig, "server", []) == ServerConfig()
    monkeypatch.setenv("MERIDIAN_SERVER_PORT", "50051")
    monkeypatch.setenv("MERIDIAN_SERVER_GRACE_S", "0")
    cfg = parse_config(ServerConfig, "server", [])
    assert cfg.port == 50051 and cfg.grace_s == 0.0


@pytest.mark.parametrize("port", [0, 1, 65535])
def test_server_config_port_bounds_accepted(port: int) -> None:
    assert ServerConfig(port=port).port == port


@pytest.mark.parametrize("port", [-1, 65536])
def test_server_config_port_out_of_range(port: int) -> None:
    with pytest.raises(ValueError, match="port"):
        ServerConfig(port=port)


@pytest.mark.parametrize("kwargs", [{"grace_s": -0.1}, {"max_message_mb": 0}])
def test_server_config_rejects_bad_grace_or_size(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        ServerConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"port": 65536}, "port"), ({"grace_s": -0.1}, "grace_s"), ({"max_message_mb": 0}, "max_message_mb"), ({"max_concurrent_rpcs": 0}, "max_concurrent_rpcs")],
)
def test_server_config_refusals_name_the_field(kwargs: dict[str, float], field: str) -> None:
    """A server with a limit of 0 calls would refuse every call RESOURCE_EXHAUSTED while
    its health says SERVING: refused at start, with the setting to fix named."""
    with pytest.raises(ValueError, match=field):
        ServerConfig(**kwargs)  # type: ignore[arg-type]


def test_server_credentials_flag_beats_meridian_credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A flag is the more specific setting: one host serving two deployments (or a test
    beside an operator's shell) picks its folder with --credentials whatever the
    environment names."""
    monkeypatch.setenv("MERIDIAN_CREDENTIALS", str(tmp_path / "from-env"))
    assert ServerConfig(credentials=str(tmp_path / "from-flag")).credentials_folder() == tmp_path / "from-flag"
    assert ServerConfig().credentials_folder() == tmp_path / "from-env"


def test_weightsync_relay_needs_upstream() -> None:
    with pytest.raises(ValueError, match="upstream"):
        WeightSyncConfig(role="relay")
    assert WeightSyncConfig(role="relay", upstream="127.0.0.1:1").upstream == "127.0.0.1:1"


def test_weightsync_relay_without_upstream_from_env_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MERIDIAN_WEIGHTSYNC_ROLE", "relay")
    with pytest.raises(ValueError, match="upstream"):
        parse_config(WeightSyncConfig, "weightsync", [])


@pytest.mark.parametrize("kwargs", [{"role": "mirror"}, {"keep_versions": 1}, {"chunk_mb": 0.0}])
def test_weightsync_config_rejects(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        WeightSyncConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("kwargs", [{"groups_per_step": 0}, {"lr": 0.0}, {"threads": 0}, {"clip_low": -0.1}, {"max_policy_lag": -1}])
def test_trainer_config_rejects(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        TrainerConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("kwargs", [{"max_sandboxes": 0}, {"default_ttl_s": 0.0}, {"reap_interval_s": -1.0}])
def test_envsandbox_config_rejects(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        EnvSandboxConfig(**kwargs)  # type: ignore[arg-type]


def test_trainer_cpu_lists() -> None:
    from services.trainer.config import TrainerConfig, cpu_set

    assert cpu_set("") == set() and cpu_set("1") == {1} and cpu_set("0-2, 5") == {0, 1, 2, 5}
    for bad in ("a", "3-1", "-1", "1-x"):
        with pytest.raises(ValueError, match="cpus"):
            TrainerConfig(cpus=bad)


def test_trainer_device_is_one_of_the_known_settings() -> None:
    assert TrainerConfig().device == "auto"
    with pytest.raises(ValueError, match="device must be one of"):
        TrainerConfig(device="tpu")
