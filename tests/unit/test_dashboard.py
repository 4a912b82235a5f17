"""deploy/: the Grafana dashboard's queries select only metrics Meridian exports (every
name in every panel's PromQL is in meridian.metrics.METRICS) and show every one of them;
the Grafana provisioning and the Prometheus scrape config fit each other and the
compose file's services and metrics settings."""
from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from meridian import metrics
from meridian.cli import SERVICES
from meridian.config import env_name
from tests import dashboard

DEPLOY = dashboard.REPO / "deploy"
PROVISIONING = DEPLOY / "grafana" / "provisioning"


def test_promql_metric_names() -> None:
    cases = {
        'sum by (priority) (rate(meridian_rollout_tokens_total{region=~"$region", priority!="x"}[1m]))': {"meridian_rollout_tokens_total"},
        "histogram_quantile(0.95, sum by (le, kind) (rate(meridian_envsandbox_exec_seconds_bucket[5m])))": {"meridian_envsandbox_exec_seconds_bucket"},
        "sum(rate(a_sum[5m])) / on (phase) group_left sum(rate(a_count[5m] offset 1h)) > bool 2": {"a_sum", "a_count"},
        'up{job="meridian"} == 0 or absent(meridian_service_up)': {"up", "meridian_service_up"},
        "label_replace(x, \"dst\", \"$1\", \"src\", \"(.*)\") * 1e3": {"x"},
        "rate(b[$__rate_interval]) and without (instance) c": {"b", "c"},
    }
    for expr, names in cases.items():
        assert dashboard.metric_names(expr) == names, expr


def test_dashboard_queries_name_only_exported_metrics() -> None:
    board = dashboard.load()
    exported = metrics.series_names()
    used = dashboard.referenced(board)
    assert used, "no PromQL found in the dashboard"
    unknown = {name: sorted(where) for name, where in used.items() if name not in exported}
    assert not unknown, f"dashboard queries select metrics Meridian does not export: {unknown}"


def test_every_metric_has_a_panel() -> None:
    used = set(dashboard.referenced(dashboard.load()))
    missing = sorted(name for name, spec in metrics.METRICS.items() if not set(spec.series()) & used)
    assert not missing, f"metrics with no panel on the dashboard: {missing}"


def test_dashboard_is_well_formed() -> None:
    board = dashboard.load()
    assert board["uid"] and board["title"] and board["schemaVersion"] >= 36
    panels = board["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    datasource = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yml").read_text())["datasources"][0]
    for p in panels:
        pos = p["gridPos"]
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24, p["title"]
        if p["type"] == "row":
            continue
        assert p["targets"], f"{p['title']}: no query"
        assert p["datasource"]["uid"] == datasource["uid"], p["title"]
        for t in p["targets"]:
            assert t["expr"].count("(") == t["expr"].count(")"), f"{p['title']}: unbalanced {t['expr']}"
            assert t["datasource"]["uid"] == datasource["uid"]
    assert datasource["type"] == "prometheus" and datasource["url"] == "http://prometheus:9090"


def test_sabotaged_metric_name_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A metric renamed in meridian.metrics (and not on the dashboard) fails the check above."""
    spec = metrics.ROLLOUT_TOKENS
    renamed = metrics.MetricSpec("meridian_rollout_generated_tokens_total", spec.kind, spec.help, spec.labels)
    monkeypatch.setitem(metrics.METRICS, spec.name, renamed)
    with pytest.raises(AssertionError, match="meridian_rollout_tokens_total"):
        test_dashboard_queries_name_only_exported_metrics()


# ---------------------------------------------------------------- compose, Prometheus, Grafana


@pytest.fixture(scope="module")
def compose() -> dict:
    docker_compose = shutil.which("docker-compose")
    if docker_compose is None:
        pytest.skip("docker-compose binary not found")
    result = subprocess.run([docker_compose, "-f", str(dashboard.REPO / "docker-compose.yml"), "config"], capture_output=True, text=True, timeout=120, cwd=dashboard.REPO)
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


def _mounts(service: dict) -> dict[str, str]:
    out = {}
    for v in service.get("volumes", []):
        source, target = (v["source"], v["target"]) if isinstance(v, dict) else v.split(":")[:2]
        out[target] = str(source)
    return out


def test_prometheus_scrapes_every_service_where_compose_serves_its_metrics(compose: dict) -> None:
    services = compose["services"]
    prometheus = services["prometheus"]
    assert "observability" in prometheus.get("profiles", [])
    mounts = _mounts(prometheus)
    assert mounts["/etc/prometheus/prometheus.yml"].endswith("deploy/prometheus/prometheus.yml")
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    targets = {t for group in job["static_configs"] for t in group["targets"]}
    expected = set()
    for name in SERVICES:
        env = {k: str(v) for k, v in (services[name].get("environment") or {}).items()}
        port = env[env_name(name, "metrics_port")]
        expected.add(f"{name}:{port}")
        # Served on the compose network: so over TLS, with the service's own certificate.
        assert env[env_name(name, "metrics_host")] == "0.0.0.0"
        assert env[env_name(name, "metrics_tls_cert")].endswith(f"/{name}.pem")
        assert env[env_name(name, "metrics_tls_key")].endswith(f"/{name}-key.pem")
    assert targets == expected
    assert job["scheme"] == "https"
    ca = job["tls_config"]["ca_file"]
    assert any(ca == target or ca.startswith(target + "/") for target in mounts), f"{ca} is not on a mount of the prometheus service"


def test_grafana_is_provisioned_with_the_datasource_and_the_dashboard(compose: dict) -> None:
    grafana = compose["services"]["grafana"]
    assert "observability" in grafana.get("profiles", [])
    mounts = _mounts(grafana)
    assert mounts["/etc/grafana/provisioning"].endswith("deploy/grafana/provisioning")
    provider = yaml.safe_load((PROVISIONING / "dashboards" / "meridian.yml").read_text())["providers"][0]
    folder = provider["options"]["path"]
    assert mounts[folder].endswith("deploy/grafana/dashboards")
    assert (dashboard.REPO / "deploy" / "grafana" / "dashboards" / "meridian.json").is_file()
    for name in ("grafana", "prometheus"):  # nothing here authenticates Grafana's viewers beyond its login
        for port in compose["services"][name].get("ports", []):
            host_ip = port.get("host_ip") if isinstance(port, dict) else str(port).split(":")[0]
            assert host_ip == "127.0.0.1", f"{name} publishes {port} beyond loopback"


def test_readme_documents_every_metric() -> None:
    readme = (dashboard.REPO / "README.md").read_text()
    section = readme[readme.index("\n## Metrics\n"):]
    section = section[: section.index("\n## ", 1)]
    missing = sorted(name for name in metrics.METRICS if f"`{name}`" not in section)
    assert not missing, f"README's Metrics section does not list: {missing}"
