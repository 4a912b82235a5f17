"""docker-compose.yml, docker-compose.region-b.yml and deploy/Dockerfile: the files
validate with docker-compose (no daemon needed) and the stack is wired the way the services
expect: every service present, health checks, build contexts and build arguments from the
environment, dependencies, optional tracing, the envsandbox container's privileges and entry
point, region b's relay and rollout, and MERIDIAN_* variables that name real flags and point
at real services. deploy/compose-smoke builds and runs all of it for real (too slow here)."""
from __future__ import annotations

import dataclasses
import importlib
import json
import os
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
REGION_B_FILE = REPO / "docker-compose.region-b.yml"
SMOKE_FILE = REPO / "deploy" / "smoke" / "compose-smoke.yml"
ENTRYPOINT_SCRIPT = REPO / "deploy" / "envsandbox-entrypoint.sh"
DOCKERFILE = REPO / "deploy" / "Dockerfile"
MERIDIAN_SERVICES = sorted(SERVICES)
ALL_SERVICES = {"redis", "jaeger", "prometheus", "grafana", *MERIDIAN_SERVICES}  # jaeger: profile tracing; the last two: observability
REGION_B = {"envsandbox-b": "envsandbox", "weightsync-b": "weightsync", "rollout-b": "rollout"}  # service -> kind
DOCKER_COMPOSE = shutil.which("docker-compose")

needs_compose = pytest.mark.skipif(
    DOCKER_COMPOSE is None,
    reason="docker-compose binary not found (deploy/install.sh installs Debian's docker-compose)",
)


def _compose(*args: str, files: tuple[Path, ...] = (COMPOSE_FILE,), env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """docker-compose with ``files``, in an environment without any MERIDIAN_* setting
    (unless ``env`` adds one), so the defaults are what is checked."""
    assert DOCKER_COMPOSE is not None
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MERIDIAN_", "COMPOSE_"))}
    return subprocess.run(
        [DOCKER_COMPOSE, *(a for f in files for a in ("-f", str(f))), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**clean, **(env or {})},
    )


@pytest.fixture(scope="module")
def config() -> dict:
    """The normalized configuration ``docker-compose config`` prints."""
    result = _compose("config")
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


@pytest.fixture(scope="module")
def two_regions() -> dict:
    """docker-compose.yml with docker-compose.region-b.yml, normalized."""
    result = _compose("config", files=(COMPOSE_FILE, REGION_B_FILE))
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


def _stage_names(dockerfile: Path, target: str) -> list[str]:
    """``target`` and the stages it builds on (FROM), the target's first."""
    stages = _stages(dockerfile)
    names = []
    while target in stages:
        names.append(target)
        target = stages[target][0]
    return names


def _entrypoint(dockerfile: Path, target: str) -> list[str]:
    """The target's exec-form ENTRYPOINT from ``meridian serve`` on (a wrapper script that
    execs its arguments, like envsandbox's, may come first)."""
    found = re.findall(r"^ENTRYPOINT\s+(\[.*\])\s*$", _stage_chain(dockerfile, target)[0], flags=re.MULTILINE)
    assert len(found) == 1, f"{dockerfile} target {target}: expected one exec-form ENTRYPOINT, found {found}"
    entry = json.loads(found[0])
    assert "meridian" in entry, f"{dockerfile} target {target}: the entry point never runs meridian: {entry}"
    return entry[entry.index("meridian"):]


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
def test_tracing_is_optional_jaeger_in_a_profile(config: dict) -> None:
    """Jaeger runs only with --profile tracing; by default the services export nothing
    and depend on no collector; MERIDIAN_OTLP_ENDPOINT turns export on, to Jaeger."""
    jaeger = config["services"]["jaeger"]
    assert jaeger["image"].startswith("jaegertracing/all-in-one")
    assert jaeger.get("profiles") == ["tracing"], jaeger.get("profiles")
    assert _env(jaeger).get("COLLECTOR_OTLP_ENABLED", "").lower() == "true"
    published = {str(p).split(":")[-1].split("/")[0] for p in jaeger.get("ports", [])}
    assert {"16686", "4317"} <= published, jaeger.get("ports")
    for name in MERIDIAN_SERVICES:
        assert _env(config["services"][name]).get("OTEL_EXPORTER_OTLP_ENDPOINT", "") == "", f"{name} exports spans by default"
        assert "jaeger" not in _depends_on(config["services"][name]), f"{name} depends on jaeger"
    result = _compose("config", env={"MERIDIAN_OTLP_ENDPOINT": "http://jaeger:4317"})
    assert result.returncode == 0, result.stderr
    for name, service in yaml.safe_load(result.stdout)["services"].items():
        if name in MERIDIAN_SERVICES:
            endpoint = _env(service)["OTEL_EXPORTER_OTLP_ENDPOINT"]
            assert urlsplit(endpoint).hostname == "jaeger" and urlsplit(endpoint).port == 4317, f"{name}: {endpoint!r}"
            assert _env(service).get("OTEL_RESOURCE_ATTRIBUTES") == "meridian.region=a", name


@needs_compose
def test_build_inputs_default_public_and_settable_from_the_environment(config: dict) -> None:
    defaults = {"PYTHON_IMAGE": "python:3.11-slim-bookworm", "TORCH_INDEX_URL": "https://download.pytorch.org/whl/cpu", "TORCH_WHEELS": "deploy/wheels"}
    for name in MERIDIAN_SERVICES:
        build = config["services"][name]["build"]
        assert build.get("args") == defaults, f"{name}: {build.get('args')}"
        assert build.get("network", "default") == "default", f"{name}: {build.get('network')}"
    local = {"MERIDIAN_PYTHON_IMAGE": "meridian/python-base:local", "MERIDIAN_TORCH_INDEX_URL": "", "MERIDIAN_TORCH_WHEELS": "deploy/other-wheels", "MERIDIAN_BUILD_NETWORK": "host"}
    result = _compose("config", env=local)
    assert result.returncode == 0, result.stderr
    services = yaml.safe_load(result.stdout)["services"]
    for name in MERIDIAN_SERVICES:
        build = services[name]["build"]
        # An empty index URL stays empty (no extra index), not the default.
        assert build["args"] == {"PYTHON_IMAGE": "meridian/python-base:local", "TORCH_INDEX_URL": "", "TORCH_WHEELS": "deploy/other-wheels"}, f"{name}: {build['args']}"
        assert build["network"] == "host", name
    args = re.findall(r"^ARG\s+(\w+)=(\S*)", DOCKERFILE.read_text(), flags=re.MULTILINE)
    assert set(defaults.items()) <= set(args), f"deploy/Dockerfile's ARG defaults differ from compose's: {args}"
    assert (REPO / defaults["TORCH_WHEELS"]).is_dir(), "the default wheelhouse must exist in the build context"


@needs_compose
def test_envsandbox_container_can_isolate(config: dict) -> None:
    """The privileges the process backend's namespaces, mounts and cgroup remount need,
    and the entry point that remounts, checks and says so, as the image's."""
    box = config["services"]["envsandbox"]
    assert "SYS_ADMIN" in box.get("cap_add", []), box.get("cap_add")
    assert "apparmor=unconfined" in box.get("security_opt", []), box.get("security_opt")
    assert not box.get("privileged"), "privileged is more than the backend needs"
    assert _env(box).get(env_name("envsandbox", "backend")) == "process"
    entry = json.loads(re.findall(r"^ENTRYPOINT\s+(\[.*\])\s*$", _stage_chain(DOCKERFILE, "envsandbox")[0], flags=re.MULTILINE)[0])
    assert entry[0] == "envsandbox-entrypoint", entry
    assert re.search(r"^COPY deploy/envsandbox-entrypoint\.sh /usr/local/bin/envsandbox-entrypoint$", DOCKERFILE.read_text(), re.MULTILINE)
    script = ENTRYPOINT_SCRIPT.read_text()
    assert script.rstrip().endswith('exec "$@"'), "the entry point must exec the service"
    for needed in ("remount,rw", "cgroup2", "/sys/fs/cgroup/service/cgroup.procs", "unshare", "exit 78"):
        assert needed in script, f"{ENTRYPOINT_SCRIPT.name}: no {needed!r}"
    assert subprocess.run(["sh", "-n", str(ENTRYPOINT_SCRIPT)], capture_output=True).returncode == 0
    comments = " ".join(line for line in (COMPOSE_FILE.read_text() + DOCKERFILE.read_text()).splitlines() if line.lstrip().startswith("#"))
    assert "unshare --net" not in comments, "comments still say only `unshare --net` is used"


@needs_compose
def test_redis_command_works_with_any_redis_build(config: dict) -> None:
    command = [str(c) for c in config["services"]["redis"]["command"]]
    assert command[command.index("--protected-mode") + 1] == "no", command


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
    # TLS only: its plaintext port is off.
    assert re.search(r"--port 0\b", redis_command) and "--tls-auth-clients yes" in redis_command, redis_command
    redis_port = int(m.group(1)) if (m := re.search(r"--tls-port (\d+)", redis_command)) else 6379
    wiring = {
        "rollout": {"envsandbox": "envsandbox", "weightsync": "weightsync"},
        "trainer": {"weightsync": "weightsync"},
    }
    for name, fields in wiring.items():
        env = _env(services[name])
        for field, target in fields.items():
            assert env.get(env_name(name, field)) == f"{target}:{port_of(target)}", f"{name}.{field}"
        url = urlsplit(env.get(env_name(name, "redis_url"), ""))
        assert (url.scheme, url.hostname, url.port) == ("rediss", "redis", redis_port), f"{name}.redis_url"
    for name in MERIDIAN_SERVICES:
        assert port_of(name) == FIXED_PORTS[name]


CREDENTIALS = "/etc/meridian/credentials"
KUSTOMIZATION = REPO / "deploy" / "k8s" / "credentials" / "kustomization.yaml"
#: What a compose container reads beyond its Kubernetes Secret: the healthcheck's client
#: certificate (health answers without a token).
HEALTHCHECK_FILES = {"client.pem", "client-key.pem"}


def _credential_files(service: dict) -> set[str]:
    """The credential files a compose service mounts (each file alone, never the folder)."""
    files = set()
    for v in service.get("volumes", []):
        target = str(v["target"] if isinstance(v, dict) else v.split(":")[1])
        assert target != CREDENTIALS, "the whole credentials folder is mounted"
        if target.startswith(CREDENTIALS + "/"):
            files.add(target.removeprefix(CREDENTIALS + "/"))
    return files


@needs_compose
def test_each_service_mounts_only_the_credentials_it_reads(two_regions: dict) -> None:
    """The compose containers hold what the Kubernetes Secrets hold (one list of which
    service reads which file), plus the healthcheck's client files: only the trainer has
    the signing key, no container the CA's key (a relay or an envsandbox host that is
    broken into cannot sign a version)."""
    secrets = {g["name"]: set(g["files"]) for g in yaml.safe_load(KUSTOMIZATION.read_text())["secretGenerator"]}
    services = two_regions["services"]
    for name in ("envsandbox", "weightsync", "trainer", "rollout", "envsandbox-b", "weightsync-b", "rollout-b"):
        kind = name.removesuffix("-b")
        assert _credential_files(services[name]) == secrets[f"meridian-{kind}-credentials"] | HEALTHCHECK_FILES, name
        assert _env(services[name]).get("MERIDIAN_CREDENTIALS") == CREDENTIALS, name
    assert _credential_files(services["redis"]) == secrets["meridian-redis-credentials"] | HEALTHCHECK_FILES
    assert _credential_files(services["prometheus"]) == {"ca.pem"}  # it checks the metrics endpoints' certificates
    holders = {name for name, service in services.items() if "signing-key.pem" in _credential_files(service)}
    assert holders == {"trainer"}
    assert not any("ca-key.pem" in _credential_files(service) for service in services.values())


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
    # Its one virtual environment is copied from a venv-* stage or built on (the engine's:
    # several GB, not stored twice).
    copied = re.findall(r"^COPY --from=(\S+)", "\n".join(chain), flags=re.MULTILINE)
    venvs = [c for c in copied if c.startswith("venv")] + [s for s in _stage_names(DOCKERFILE, name) if s.startswith("venv-")]
    assert len(venvs) == 1, venvs
    installs = "\n".join(_stage_chain(DOCKERFILE, venvs[0]))
    engine = name in ("trainer", "rollout")
    installs_engine = "/requirements/engine.txt" in installs or "'.[engine]'" in installs
    assert installs_engine == engine, f"{name}: engine extra {'missing' if engine else 'not needed'}"
    users = re.findall(r"^USER\s+(\S+)", chain[0], flags=re.MULTILINE)
    # envsandbox keeps root for its namespaces, mounts and sandbox uids; the others drop it.
    assert users and users[-1] == ("root" if name == "envsandbox" else "meridian"), users


def test_engine_images_have_a_cxx_compiler() -> None:
    """vLLM compiles its sampler at warm-up even in eager mode: without g++ rollout never serves."""
    runtime = _stage_chain(DOCKERFILE, "rollout")
    assert any(re.search(r"apt-get install[^\n]*\bg\+\+", body) for body in runtime), "no g++ in the rollout image"


def test_engine_images_have_python_headers() -> None:
    """torch's inductor compiles vLLM's sampler against Python.h at warm-up: the engine
    image checks for it at build time, and the locally built base installs the headers."""
    runtime = "\n".join(_stage_chain(DOCKERFILE, "rollout"))
    assert "Python.h" in runtime and "sysconfig.get_paths()['include']" in runtime, "the engine image does not check for Python.h"
    base_image = (REPO / "deploy" / "base-image").read_text()
    assert re.search(r"--include=\S*libpython3\.11-dev", base_image), "deploy/base-image installs no Python headers"


def test_dockerignore_keeps_local_state_out() -> None:
    ignored = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()}
    for entry in (".git", ".venv", ".meridian", "**/__pycache__"):
        assert entry in ignored, f".dockerignore lacks {entry}"


# ------------------------------------------------------------------ region b (override file)


@needs_compose
def test_region_b_override_validates() -> None:
    for files in ((COMPOSE_FILE, REGION_B_FILE), (COMPOSE_FILE, REGION_B_FILE, SMOKE_FILE)):
        result = _compose("config", "-q", files=files)
        assert result.returncode == 0, f"{[f.name for f in files]}: {result.stderr}"


@needs_compose
def test_region_b_adds_its_three_services_and_changes_none(config: dict, two_regions: dict) -> None:
    assert set(two_regions["services"]) == ALL_SERVICES | set(REGION_B)

    def same_order(service: dict) -> dict:  # merging files may reorder these lists
        return {**service, **{k: sorted(map(str, service.get(k, []))) for k in ("volumes", "ports", "cap_add", "security_opt")}}

    for name, service in config["services"].items():
        assert same_order(two_regions["services"][name]) == same_order(service), f"region b's file changes {name}"


@needs_compose
@pytest.mark.parametrize("name", sorted(REGION_B))
def test_region_b_service_runs_region_a_image_healthy(two_regions: dict, name: str) -> None:
    kind = REGION_B[name]
    services = two_regions["services"]
    service, twin = services[name], services[kind]
    assert service["image"] == twin["image"] and "build" not in service, f"{name}: not {kind}'s image"
    check = service.get("healthcheck") or {}
    assert "grpc_health" in " ".join(check.get("test", [])) and f":{FIXED_PORTS[kind]}" in " ".join(check.get("test", [])), name
    env = _env(service)
    assert env.get("OTEL_RESOURCE_ATTRIBUTES") == "meridian.region=b", name
    assert env.get(env_name(kind, "port")) == str(FIXED_PORTS[kind]), name
    assert env.get("MERIDIAN_CREDENTIALS") == "/etc/meridian/credentials", name
    assert _credential_files(service) == _credential_files(twin), f"{name}: not {kind}'s credential files"
    # Same privileges as region a's (the sandbox host's especially).
    assert sorted(service.get("cap_add", [])) == sorted(twin.get("cap_add", [])), name
    assert sorted(service.get("security_opt", [])) == sorted(twin.get("security_opt", [])), name
    known = {env_name(kind, f.name) for cls in (ServerConfig, _config_class(kind)) for f in dataclasses.fields(cls)}
    known.update({"MERIDIAN_CACHE_DIR", "MERIDIAN_CREDENTIALS"})
    unknown = sorted(k for k in env if k.startswith("MERIDIAN_") and k not in known)
    assert not unknown, f"{name}: variables that set no flag: {unknown}"


@needs_compose
def test_region_b_wiring(two_regions: dict) -> None:
    """The relay mirrors region a's origin; region b's rollout samples against its own
    envsandbox and relay, sends trajectories to region a's Redis, and says it is region b;
    everything is verified with the trainer's public key."""
    services = two_regions["services"]
    relay, rollout = _env(services["weightsync-b"]), _env(services["rollout-b"])
    assert relay[env_name("weightsync", "role")] == "relay"
    assert relay[env_name("weightsync", "upstream")] == f"weightsync:{FIXED_PORTS['weightsync']}"
    assert _env(services["weightsync"])[env_name("weightsync", "role")] == "origin"
    assert rollout[env_name("rollout", "envsandbox")] == f"envsandbox-b:{FIXED_PORTS['envsandbox']}"
    assert rollout[env_name("rollout", "weightsync")] == f"weightsync-b:{FIXED_PORTS['weightsync']}"
    assert rollout[env_name("rollout", "redis_url")] == _env(services["trainer"])[env_name("trainer", "redis_url")]
    assert rollout[env_name("rollout", "region")] == "b" and _env(services["rollout"])[env_name("rollout", "region")] == "a"
    public = "/etc/meridian/credentials/signing-pub.pem"
    assert _env(services["trainer"])[env_name("trainer", "signing_key")] == "/etc/meridian/credentials/signing-key.pem"
    for name, kind in (("weightsync", "weightsync"), ("weightsync-b", "weightsync"), ("rollout", "rollout"), ("rollout-b", "rollout")):
        assert _env(services[name]).get(env_name(kind, "verify_key")) == public, f"{name} does not verify versions"
    assert _depends_on(services["weightsync-b"]).get("weightsync") == "service_healthy"
    for dep in ("envsandbox-b", "weightsync-b", "redis"):
        assert _depends_on(services["rollout-b"]).get(dep) == "service_healthy", f"rollout-b -> {dep}"
    assert relay[env_name("weightsync", "data_dir")] in {
        str(v["target"] if isinstance(v, dict) else v.split(":")[1]) for v in services["weightsync-b"]["volumes"]
    }, "the relay's versions are not on a volume"


@needs_compose
def test_two_regions_publish_no_port_twice(two_regions: dict) -> None:
    seen: dict[str, str] = {}
    for name, service in two_regions["services"].items():
        for port in service.get("ports", []):
            published = f"{port['host_ip']}:{port['published']}" if isinstance(port, dict) else ":".join(str(port).split(":")[:-1])
            assert published not in seen, f"{name} and {seen.get(published)} both publish {published}"
            assert published.startswith("127.0.0.1:"), f"{name} publishes {published} beyond loopback"
            seen[published] = name
