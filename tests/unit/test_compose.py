"""docker-compose.yml and deploy/Dockerfile: the file validates with docker-compose
(no daemon needed) and the stack is wired the way the services expect: every service
present, health checks, build contexts, dependencies, tracing, and MERIDIAN_* variables
that name real flags and point at real services."""
from __future__ import annotations

import dataclasses
import importlib
import json
import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from meridian.cli import SERVICES
from meridian.config import env_name
from meridian.grpc_runtime import ServerConfig
from meridian.stack import FIXED_PORTS

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "deploy" / "Dockerfile"
MERIDIAN_SERVICES = sorted(SERVICES)
ALL_SERVICES = {"redis", "jaeger", "prometheus", "grafana", *MERIDIAN_SERVICES}  # the last two: profile observability
DOCKER_COMPOSE = shutil.which("docker-compose")

needs_compose = pytest.mark.skipif(
    DOCKER_COMPOSE is None,
    reason="docker-compose binary not found (deploy/install.sh installs Debian's docker-compose)",
)


def _compose(*args: str) -> subprocess.CompletedProcess[str]:
    assert DOCKER_COMPOSE is not None
    return subprocess.run(
        [DOCKER_COMPOSE, "-f", str(COMPOSE_FILE), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def config() -> dict:
    """The normalized configuration ``docker-compose config`` prints."""
    result = _compose("config")
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


def _config_class(name: str) -> type:
    module, cls, _, _ = SERVICES[name]
    return getattr(importlib.import_module(module), cls)


def _env(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):  # KEY=VALUE form
        env = dict(item.split("=", 1) for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def _depends_on(service: dict) -> dict[str, str]:
    deps = service.get("depends_on") or {}
    if isinstance(deps, list):
        return {name: "service_started" for name in deps}
    return {name: (spec or {}).get("condition", "service_started") for name, spec in deps.items()}


def _stages(dockerfile: Path) -> dict[str, tuple[str, str]]:
    """Each ``FROM <parent> AS <name>`` stage of a multi-stage file: name -> (parent, text)."""
    stages: dict[str, tuple[str, str]] = {}
    parts = re.split(r"^(FROM\s+\S+\s+AS\s+\S+)\s*$", dockerfile.read_text(), flags=re.MULTILINE)
    for header, body in zip(parts[1::2], parts[2::2]):
        _, parent, _, name = header.split()
        stages[name] = (parent, body)
    return stages


def _stage_chain(dockerfile: Path, target: str) -> list[str]:
    """The texts of ``target`` and every stage it builds on, the target's first."""
    stages = _stages(dockerfile)
    assert target in stages, f"{dockerfile}: no stage {target!r}"
    chain = []
    while target in stages:
        parent, body = stages[target]
        chain.append(body)
        target = parent
    return chain


def _entrypoint(dockerfile: Path, target: str) -> list[str]:
    found = re.findall(r"^ENTRYPOINT\s+(\[.*\])\s*$", _stage_chain(dockerfile, target)[0], flags=re.MULTILINE)
    assert len(found) == 1, f"{dockerfile} target {target}: expected one exec-form ENTRYPOINT, found {found}"
    return json.loads(found[0])


@needs_compose
def test_compose_file_validates() -> None:
    result = _compose("config", "-q")
    assert result.returncode == 0, f"docker-compose config -q failed:\n{result.stderr}"


@needs_compose
def test_all_services_present(config: dict) -> None:
    assert set(config["services"]) == ALL_SERVICES


@needs_compose
@pytest.mark.parametrize("name", MERIDIAN_SERVICES)
def test_meridian_service_builds_from_its_dockerfile(config: dict, name: str) -> None:
    service = config["services"][name]
    build = service.get("build")
    assert isinstance(build, dict), f"{name}: no build section"
    context = (REPO / build["context"]).resolve()
    dockerfile = (context / build.get("dockerfile", "Dockerfile")).resolve()
    assert dockerfile.is_file(), f"{name}: {dockerfile} does not exist"
    assert dockerfile == DOCKERFILE.resolve() and build.get("target") == name, build
    assert _entrypoint(dockerfile, name)[:3] == ["meridian", "serve", name]


@needs_compose
@pytest.mark.parametrize("name", MERIDIAN_SERVICES)
def test_meridian_service_has_grpc_healthcheck(config: dict, name: str) -> None:
    check = config["services"][name].get("healthcheck")
    assert check and not check.get("disable"), f"{name}: no healthcheck"
    test = check["test"]
    command = " ".join(test) if isinstance(test, list) else test
    assert "grpc_health" in command, f"{name}: healthcheck does not use grpc.health.v1: {command}"
    port = _env(config["services"][name]).get(env_name(name, "port"), str(FIXED_PORTS[name]))
    assert f":{port}" in command, f"{name}: healthcheck does not probe the service's port {port}"
    assert config["services"][name].get("stop_grace_period"), f"{name}: no stop_grace_period"


@needs_compose
def test_dependencies_wait_for_health(config: dict) -> None:
    services = config["services"]
    rollout = _depends_on(services["rollout"])
    trainer = _depends_on(services["trainer"])
    for dep in ("envsandbox", "weightsync", "redis"):
        assert rollout.get(dep) == "service_healthy", f"rollout -> {dep}: {rollout.get(dep)}"
    for dep in ("weightsync", "redis"):
        assert trainer.get(dep) == "service_healthy", f"trainer -> {dep}: {trainer.get(dep)}"
    assert services["redis"].get("healthcheck"), "redis needs a healthcheck for service_healthy"


@needs_compose
def test_tracing_goes_to_jaeger(config: dict) -> None:
    jaeger = config["services"]["jaeger"]
    assert jaeger["image"].startswith("jaegertracing/all-in-one")
    assert _env(jaeger).get("COLLECTOR_OTLP_ENABLED", "").lower() == "true"
    published = {str(p).split(":")[-1].split("/")[0] for p in jaeger.get("ports", [])}
    assert {"16686", "4317"} <= published, jaeger.get("ports")
    for name in MERIDIAN_SERVICES:
        endpoint = _env(config["services"][name]).get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
        assert urlsplit(endpoint).hostname == "jaeger" and urlsplit(endpoint).port == 4317, f"{name}: {endpoint!r}"


@needs_compose
@pytest.mark.parametrize("name", MERIDIAN_SERVICES)
def test_meridian_variables_name_real_flags(config: dict, name: str) -> None:
    """A typo in MERIDIAN_<SERVICE>_<FIELD> would be silently ignored by the service."""
    known = {env_name(name, f.name) for cls in (ServerConfig, _config_class(name)) for f in dataclasses.fields(cls)}
    known.update({"MERIDIAN_CACHE_DIR", "MERIDIAN_CREDENTIALS"})
    unknown = sorted(k for k in _env(config["services"][name]) if k.startswith("MERIDIAN_") and k not in known)
    assert not unknown, f"{name}: variables that set no flag: {unknown}"


@needs_compose
def test_addresses_point_at_services(config: dict) -> None:
    services = config["services"]

    def port_of(name: str) -> int:
        return int(_env(services[name]).get(env_name(name, "port"), FIXED_PORTS[name]))

    redis_command = " ".join(map(str, services["redis"].get("command") or []))
    redis_port = int(m.group(1)) if (m := re.search(r"--port (\d+)", redis_command)) else 6379
    wiring = {
        "rollout": {"envsandbox": "envsandbox", "weightsync": "weightsync"},
        "trainer": {"weightsync": "weightsync"},
    }
    for name, fields in wiring.items():
        env = _env(services[name])
        for field, target in fields.items():
            assert env.get(env_name(name, field)) == f"{target}:{port_of(target)}", f"{name}.{field}"
        url = urlsplit(env.get(env_name(name, "redis_url"), ""))
        assert (url.scheme, url.hostname, url.port) == ("redis", "redis", redis_port), f"{name}.redis_url"
    for name in MERIDIAN_SERVICES:
        assert port_of(name) == FIXED_PORTS[name]


@needs_compose
def test_volumes_for_weights_and_model_cache(config: dict) -> None:
    services = config["services"]

    def targets(name: str) -> dict[str, str]:
        out = {}
        for v in services[name].get("volumes", []):
            source, target = (v["source"], v["target"]) if isinstance(v, dict) else v.split(":")[:2]
            out[target] = source
        return out

    data_dir = _env(services["weightsync"]).get(env_name("weightsync", "data_dir"))
    assert data_dir and data_dir in targets("weightsync"), "weightsync data folder is not on a volume"
    caches = set()
    for name in ("trainer", "rollout"):
        cache = _env(services[name]).get("MERIDIAN_CACHE_DIR")
        assert cache and cache in targets(name), f"{name}: MERIDIAN_CACHE_DIR is not on a volume"
        caches.add(targets(name)[cache])
    assert len(caches) == 1, "trainer and rollout should share one model cache volume"


@pytest.mark.parametrize("name", MERIDIAN_SERVICES)
def test_dockerfile_entrypoint_serves_a_known_service(name: str) -> None:
    assert DOCKERFILE.is_file(), f"{DOCKERFILE} is missing"
    text = DOCKERFILE.read_text()
    chain = _stage_chain(DOCKERFILE, name)
    entry = _entrypoint(DOCKERFILE, name)
    assert entry[:2] == ["meridian", "serve"], entry
    assert entry[2] in SERVICES, f"{DOCKERFILE}: unknown service {entry[2]!r}"
    assert entry[2] == name
    assert entry[entry.index("--host") + 1] == "0.0.0.0", entry
    assert re.search(r"^FROM python:3\.11-slim-bookworm|^ARG PYTHON_IMAGE=python:3\.11-slim-bookworm", text, re.MULTILINE)
    assert any(re.search(r"^HEALTHCHECK\b", body, re.MULTILINE) for body in chain), f"{name}: no HEALTHCHECK"
    assert "grpc_health" in text
    # The health check probes the port the stage sets for the service.
    ports = re.findall(r"MERIDIAN_HEALTH_PORT=(\d+)", chain[0])
    assert ports == [str(FIXED_PORTS[name])], ports
    # Each image installs only its own extras: the engine for rollout and trainer only.
    copied = re.findall(r"^COPY --from=(\S+)", "\n".join(chain), flags=re.MULTILINE)
    venvs = [c for c in copied if c.startswith("venv")]
    assert len(venvs) == 1, venvs
    installs = _stage_chain(DOCKERFILE, venvs[0])[0]
    engine = name in ("trainer", "rollout")
    assert ("[engine]" in installs) == engine, f"{name}: engine extra {'missing' if engine else 'not needed'}"
    users = re.findall(r"^USER\s+(\S+)", chain[0], flags=re.MULTILINE)
    # envsandbox keeps root for its namespaces, mounts and sandbox uids; the others drop it.
    assert users and users[-1] == ("root" if name == "envsandbox" else "meridian"), users


def test_engine_images_have_a_cxx_compiler() -> None:
    """vLLM compiles its sampler at warm-up even in eager mode: without g++ rollout never serves."""
    runtime = _stage_chain(DOCKERFILE, "rollout")
    assert any(re.search(r"apt-get install[^\n]*\bg\+\+", body) for body in runtime), "no g++ in the rollout image"


def test_dockerignore_keeps_local_state_out() -> None:
    ignored = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()}
    for entry in (".git", ".venv", ".meridian", "**/__pycache__"):
        assert entry in ignored, f".dockerignore lacks {entry}"
