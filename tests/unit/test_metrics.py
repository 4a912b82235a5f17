"""meridian/metrics.py: the metric list's conventions, per-service registries with the
common labels, sources read on the service's loop (and what a scrape serves when they
fail), the endpoint's settings and HTTP(S) serving, the Status -> metrics mappings, and
the real weightsync (origin and relay) and envsandbox services scraped after traffic."""
from __future__ import annotations

import asyncio
import datetime
import ssl
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from meridian import metrics
from meridian.grpc_runtime import ServerConfig
from meridian.tensors import RawTensor
from meridian.v1 import envsandbox_pb2 as es
from meridian.v1 import envsandbox_pb2_grpc as es_grpc
from meridian.v1 import rollout_pb2, trainer_pb2, weightsync_pb2
from services.envsandbox.config import EnvSandboxConfig
from services.envsandbox.server import EnvSandboxService
from services.weightsync import client
from services.weightsync.config import WeightSyncConfig
from services.weightsync.server import WeightSyncService

TIMEOUT_S = 60.0


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A scrape's samples: (name, sorted labels) -> value."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def one(scrape: dict, name: str, **labels: str) -> float:
    """The value of the one sample named ``name`` whose labels include ``labels``."""
    found = [v for (n, ls), v in scrape.items() if n == name and set(labels.items()) <= set(ls)]
    assert len(found) == 1, f"{name} {labels}: {len(found)} samples in {sorted(k for k in scrape if k[0] == name)}"
    return found[0]


async def scrape(registry: metrics.ServiceMetrics) -> dict:
    # A scrape runs off the service's loop (the endpoint's thread), as in production.
    return samples((await asyncio.to_thread(generate_latest, registry.registry)).decode())


def fetch(url: str, context: ssl.SSLContext | None = None) -> str:
    with urllib.request.urlopen(url, timeout=10, context=context) as reply:  # noqa: S310 - a loopback test URL
        return reply.read().decode()


# ---------------------------------------------------------------- the list


def test_metric_names_follow_prometheus_conventions() -> None:
    assert len(metrics.METRICS) >= 40
    for name, spec in metrics.METRICS.items():
        assert name == spec.name and name.startswith("meridian_"), name
        assert (spec.kind == "counter") == name.endswith("_total"), name
        assert not set(spec.labels) & set(metrics.COMMON_LABELS), f"{name}: service and region are added to every sample"
    with pytest.raises(ValueError, match="_total"):
        metrics.MetricSpec("meridian_x_seconds_total", "gauge", "a gauge named like a counter")
    with pytest.raises(ValueError, match="meridian_"):
        metrics.MetricSpec("x_total", "counter", "no prefix")
    assert {"meridian_envsandbox_exec_seconds_bucket", "meridian_rollout_tokens_total"} <= metrics.series_names()


def test_values_must_carry_exactly_their_labels() -> None:
    with pytest.raises(ValueError, match="priority"):
        metrics.value(metrics.ROLLOUT_TOKENS, 1)
    with pytest.raises(ValueError):
        metrics.value(metrics.ROLLOUT_VERSION, 1, priority="rl")


# ---------------------------------------------------------------- registries


def test_registry_labels_every_sample_and_keeps_services_apart() -> None:
    async def main() -> None:
        async def rollout_source() -> list[metrics.Value]:
            return [metrics.value(metrics.ROLLOUT_TOKENS, 7, priority="rl"), metrics.value(metrics.ROLLOUT_VERSION, 3)]

        a = metrics.ServiceMetrics("rollout", rollout_source)
        b = metrics.ServiceMetrics("envsandbox")  # the same histogram in two registries of one process
        a.bind(asyncio.get_running_loop(), "eu")
        b.bind(asyncio.get_running_loop())
        a.observe(metrics.SANDBOX_EXEC_SECONDS, 0.3, kind="exec")
        b.observe(metrics.SANDBOX_EXEC_SECONDS, 2.0, kind="tests")
        got_a, got_b = await scrape(a), await scrape(b)
        assert one(got_a, "meridian_rollout_tokens_total", priority="rl", service="rollout", region="eu") == 7
        assert one(got_a, "meridian_rollout_policy_version") == 3
        assert one(got_a, "meridian_service_up") == 1
        assert one(got_a, "meridian_envsandbox_exec_seconds_count", kind="exec") == 1
        assert one(got_b, "meridian_envsandbox_exec_seconds_sum", kind="tests", service="envsandbox", region="local") == 2.0
        assert not any(n == "meridian_rollout_tokens_total" for n, _ in got_b)
        for name, labels in [*got_a, *got_b]:
            assert {"service", "region"} <= dict(labels).keys(), name
            assert name in metrics.series_names(), f"{name} is exported but not in METRICS"

    asyncio.run(main())


def test_a_failing_or_stuck_source_still_serves_the_histograms(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics, "SOURCE_TIMEOUT_S", 0.3)

    async def main() -> None:
        async def broken() -> list[metrics.Value]:
            raise RuntimeError("redis is gone")

        async def stuck() -> list[metrics.Value]:
            await asyncio.sleep(30)
            return []

        for source in (broken, stuck):
            m = metrics.ServiceMetrics("trainer", source)
            m.bind(asyncio.get_running_loop())
            m.observe(metrics.TRAINER_STEP_SECONDS, 1.5, phase="learn")
            got = await scrape(m)
            assert one(got, "meridian_metrics_source_errors_total") == 1
            assert one(got, "meridian_trainer_step_seconds_count", phase="learn") == 1
            assert one(got, "meridian_service_up") == 1

    asyncio.run(main())


def test_a_scrape_on_the_services_own_loop_is_refused() -> None:
    async def main() -> None:
        async def source() -> list[metrics.Value]:
            return []

        m = metrics.ServiceMetrics("rollout", source)
        m.bind(asyncio.get_running_loop())
        with pytest.raises(RuntimeError, match="own event loop"):
            generate_latest(m.registry)

    asyncio.run(main())


# ---------------------------------------------------------------- endpoint settings and serving


def test_endpoint_settings() -> None:
    assert ServerConfig().metrics_port == metrics.METRICS_OFF  # off unless asked for
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.5"):
        metrics.check_endpoint(host, 0)
    for host in ("0.0.0.0", "10.1.2.3", "::", "metrics.example"):
        with pytest.raises(ValueError, match="TLS"):
            metrics.check_endpoint(host, 9100)
        with pytest.raises(ValueError, match="TLS"):
            ServerConfig(metrics_host=host, metrics_port=9100)
        metrics.check_endpoint(host, 9100, "cert.pem", "key.pem")
        metrics.check_endpoint(host, metrics.METRICS_OFF)  # off: nothing listens
    with pytest.raises(ValueError, match="both"):
        metrics.check_endpoint("127.0.0.1", 0, "cert.pem", "")
    for port in (-2, 65536):
        with pytest.raises(ValueError, match="metrics_port"):
            ServerConfig(metrics_port=port)


def test_endpoint_serves_http_on_a_free_port_and_closes() -> None:
    async def main() -> None:
        m = metrics.ServiceMetrics("weightsync")
        config = ServerConfig(metrics_port=0, metrics_region="b")
        assert metrics.start_endpoint("weightsync", object(), ServerConfig(), asyncio.get_running_loop()) is None
        endpoint = metrics.start_endpoint("weightsync", type("Svc", (), {"metrics": m})(), config, asyncio.get_running_loop())
        assert endpoint is not None and endpoint.port > 0 and endpoint.url.startswith("http://127.0.0.1:")
        try:
            got = samples(await asyncio.to_thread(fetch, endpoint.url))
            assert one(got, "meridian_service_up", service="weightsync", region="b") == 1
        finally:
            endpoint.close()
        with pytest.raises(OSError):
            await asyncio.to_thread(fetch, endpoint.url)

    asyncio.run(main())


@pytest.mark.parametrize(("flag", "own", "label"), [("eu", "b", "eu"), ("", "b", "b"), ("", "", "local")])
def test_the_region_label_is_the_flag_else_the_services_region_else_local(flag: str, own: str, label: str) -> None:
    """--metrics-region is how an operator relabels a service (a region's second rollout
    pool, say); it must win over the service's own --region, which is only the default."""
    async def main() -> None:
        m = metrics.ServiceMetrics("rollout")
        service = type("Svc", (), {"metrics": m, "config": type("Cfg", (), {"region": own})()})()
        endpoint = metrics.start_endpoint("rollout", service, ServerConfig(metrics_port=0, metrics_region=flag), asyncio.get_running_loop())
        assert endpoint is not None
        try:
            got = samples(await asyncio.to_thread(fetch, endpoint.url))
            assert one(got, "meridian_service_up", service="rollout", region=label) == 1
        finally:
            endpoint.close()

    asyncio.run(main())


def test_an_endpoint_that_cannot_start_leaves_the_service_running(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        missing = ServerConfig(metrics_port=0, metrics_host="0.0.0.0", metrics_tls_cert=str(tmp_path / "absent.pem"), metrics_tls_key=str(tmp_path / "absent-key.pem"))
        assert metrics.start_endpoint("rollout", object(), missing, loop) is None
        taken = metrics.start_endpoint("rollout", object(), ServerConfig(metrics_port=0), loop)
        assert taken is not None
        try:
            assert metrics.start_endpoint("rollout", object(), ServerConfig(metrics_port=taken.port), loop) is None
        finally:
            taken.close()

    asyncio.run(main())
    assert capsys.readouterr().out.count("meridian rollout metrics unavailable:") == 2


def _self_signed(folder: Path) -> tuple[str, str]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "metrics-test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key()).serial_number(1)
        .not_valid_before(now - datetime.timedelta(minutes=1)).not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "metrics.pem", folder / "metrics-key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return str(cert_path), str(key_path)


def test_endpoint_serves_https_with_a_certificate(tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    m = metrics.ServiceMetrics("envsandbox")
    endpoint = metrics.serve(m, "127.0.0.1", 0, cert, key)
    try:
        assert endpoint.url.startswith("https://")
        context = ssl.create_default_context(cafile=cert)
        context.check_hostname = False  # the test certificate names localhost
        assert "meridian_service_up" in fetch(endpoint.url, context)
        with pytest.raises(Exception):  # noqa: B017 - plaintext to a TLS endpoint fails one way or another
            fetch(endpoint.url.replace("https://", "http://"))
    finally:
        endpoint.close()


# ---------------------------------------------------------------- Status -> metrics


def test_rollout_values_from_status() -> None:
    status = rollout_pb2.RolloutStatus(
        policy_version=3, latest_published_version=5, rl_tokens=40, production_tokens=60, rl_running=2, production_in_flight=1,
        rl_preemptions=4, rl_concurrency_limit=8, slo_attainment=0.9, updates_applied=3, updates_rejected=1, last_apply_ms=250,
        sandboxes_held=9, groups_waiting_for_sandboxes=2, sandbox_budget=64,
    )
    got = {(v.spec.name, v.labels): v.value for v in metrics.rollout_values(status, backlog=12)}
    assert got[("meridian_rollout_tokens_total", (("priority", "rl"),))] == 40
    assert got[("meridian_rollout_tokens_total", (("priority", "production"),))] == 60
    assert got[("meridian_rollout_policy_lag_versions", ())] == 2
    assert got[("meridian_rollout_stream_backlog_groups", ())] == 12
    assert got[("meridian_rollout_last_apply_seconds", ())] == 0.25
    assert got[("meridian_rollout_weight_updates_total", (("outcome", "rejected"),))] == 1
    assert got[("meridian_rollout_sandboxes_held", ())] == 9 and got[("meridian_rollout_groups_waiting_for_sandboxes", ())] == 2
    assert got[("meridian_rollout_sandbox_budget", ())] == 64
    # No weightsync (latest -1): nothing to lag behind.
    alone = {v.spec.name: v.value for v in metrics.rollout_values(rollout_pb2.RolloutStatus(policy_version=0, latest_published_version=-1), 0)}
    assert alone["meridian_rollout_policy_lag_versions"] == 0


def test_trainer_values_and_step_times() -> None:
    def step(n: int, published: bool) -> trainer_pb2.StepMetrics:
        return trainer_pb2.StepMetrics(step=n, step_seconds=n, commit_seconds=0.1, publish_seconds=0.5 * n, published=published, reward_mean=0.25, pass_rate=0.5)

    status = trainer_pb2.TrainerStatus(step=2, dropped_stale_total=5, downweighted_stale_total=2, recent_steps=[step(1, True), step(2, False)])
    got = {(v.spec.name, v.labels): v.value for v in metrics.trainer_values(status, stream_entries=9, stream_pending=4)}
    assert got[("meridian_trainer_stale_samples_total", (("action", "dropped"),))] == 5
    assert got[("meridian_trainer_stream_pending_entries", ())] == 4
    assert got[("meridian_trainer_pass_ratio", ())] == 0.5
    assert ("meridian_trainer_pass_ratio", ()) not in {(v.spec.name, v.labels) for v in metrics.trainer_values(trainer_pb2.TrainerStatus(), 0, 0)}
    # The loss gauge is the last step that trained: a later one with nothing to train
    # (or a skipped one) reports loss 0 and leaves it.
    steps = [trainer_pb2.StepMetrics(step=1, loss=0.7, stepped=True), trainer_pb2.StepMetrics(step=2, loss=0.0, stepped=False)]
    gauges = {v.spec.name: v.value for v in metrics.trainer_values(trainer_pb2.TrainerStatus(recent_steps=steps, skipped_steps_total=3, publishes_given_up_total=2), 0, 0)}
    assert gauges["meridian_trainer_loss"] == 0.7 and gauges["meridian_trainer_skipped_steps_total"] == 3
    assert gauges["meridian_trainer_publishes_given_up_total"] == 2

    async def main() -> None:
        m = metrics.ServiceMetrics("trainer")
        m.bind(asyncio.get_running_loop())
        observer = metrics.StepObserver(m)
        observer.update(status.recent_steps)
        observer.update(status.recent_steps)  # seen again: not counted again
        observer.update([step(1, True), step(2, True), step(3, False)])  # step 2's publish finished
        got = await scrape(m)
        assert one(got, "meridian_trainer_step_seconds_count", phase="learn") == 3
        assert one(got, "meridian_trainer_step_seconds_sum", phase="learn") == 6
        assert one(got, "meridian_trainer_step_seconds_count", phase="publish") == 2
        assert one(got, "meridian_trainer_step_seconds_sum", phase="publish") == 1.5

    asyncio.run(main())


def test_trainer_step_gauges_are_the_last_steps() -> None:
    """Status lists the recent steps oldest first: the reward, pass rate and lag gauges show
    the newest, or a dashboard shows a learning curve running late by the whole window."""
    steps = [trainer_pb2.StepMetrics(step=n, reward_mean=n / 10, pass_rate=n / 20, policy_lag_mean=n, policy_lag_max=2 * n) for n in (1, 2, 3)]
    got = {(v.spec.name, v.labels): v.value for v in metrics.trainer_values(trainer_pb2.TrainerStatus(step=3, recent_steps=steps), 0, 0)}
    assert got[("meridian_trainer_reward_mean", ())] == 0.3 and got[("meridian_trainer_pass_ratio", ())] == 0.15
    assert got[("meridian_trainer_sample_policy_lag_versions", (("stat", "mean"),))] == 3
    assert got[("meridian_trainer_sample_policy_lag_versions", (("stat", "max"),))] == 6


# ---------------------------------------------------------------- real services


def _weights(seed: int) -> dict[str, RawTensor]:
    rng = np.random.default_rng(seed)
    return {"emb": RawTensor("bf16", (64, 8), rng.integers(0x3C00, 0x3F00, 512, dtype=np.uint16))}


def test_weightsync_origin_and_relay_export_versions_bytes_and_propagation(tmp_path: Path, grpc_serving) -> None:  # type: ignore[no-untyped-def]
    origin = WeightSyncService(WeightSyncConfig(role="origin", data_dir=str(tmp_path / "origin"), chunk_mb=0.0005))

    async def main() -> None:
        loop = asyncio.get_running_loop()
        async with grpc_serving(origin) as upstream:
            relay = WeightSyncService(WeightSyncConfig(role="relay", upstream=upstream, data_dir=str(tmp_path / "relay"), chunk_mb=0.0005))
            async with grpc_serving(relay):
                origin.metrics.bind(loop, "a")
                relay.metrics.bind(loop, "b")
                await client.publish(upstream, 0, _weights(0))
                deadline = time.monotonic() + 30
                while relay.store.latest < 0:
                    assert time.monotonic() < deadline, "the relay never received version 0"
                    await asyncio.sleep(0.05)
                at_origin, at_relay = await scrape(origin.metrics), await scrape(relay.metrics)
        assert one(at_origin, "meridian_weightsync_latest_version", region="a") == 0
        assert one(at_origin, "meridian_weightsync_propagation_seconds_count", region="a") == 1
        assert one(at_origin, "meridian_weightsync_sent_bytes_total") > 0  # what the relay pulled
        assert one(at_relay, "meridian_weightsync_latest_version", region="b") == 0
        assert one(at_relay, "meridian_weightsync_propagation_seconds_count", region="b") == 1
        assert one(at_relay, "meridian_weightsync_upstream_bytes_total") == one(at_origin, "meridian_weightsync_sent_bytes_total")
        assert one(at_relay, "meridian_weightsync_stored_bytes") > 0

    asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))


def test_envsandbox_exports_live_sandboxes_and_exec_latency(tmp_path: Path, grpc_serving) -> None:  # type: ignore[no-untyped-def]
    service = EnvSandboxService(EnvSandboxConfig(root=str(tmp_path / "sandboxes")))

    async def main() -> None:
        service.metrics.bind(asyncio.get_running_loop())
        async with grpc_serving(service) as address:
            async with grpc.aio.insecure_channel(address) as channel:
                stub = es_grpc.EnvSandboxStub(channel)
                info = await stub.Create(es.CreateRequest(task_id="python/add"))
                async for _ in stub.Exec(es.ExecRequest(sandbox_id=info.sandbox_id, argv=["true"])):
                    pass
                await stub.RunTests(es.RunTestsRequest(sandbox_id=info.sandbox_id))
                got = await scrape(service.metrics)
        assert one(got, "meridian_envsandbox_live_sandboxes", service="envsandbox") == 1
        assert one(got, "meridian_envsandbox_max_sandboxes") == service.config.max_sandboxes
        assert one(got, "meridian_envsandbox_exec_seconds_count", kind="exec") == 1
        assert one(got, "meridian_envsandbox_exec_seconds_count", kind="tests") == 1
        assert one(got, "meridian_envsandbox_exec_seconds_sum", kind="tests") > 0

    asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))


def test_status_protos_still_have_the_fields_the_mappings_read() -> None:
    """The mappings read Status fields by name: a renamed field must fail here, not at a scrape."""
    for message, fields in [
        (rollout_pb2.RolloutStatus, ["production_tokens", "rl_tokens", "production_in_flight", "rl_running", "rl_concurrency_limit", "rl_preemptions",
                                     "slo_attainment", "policy_version", "latest_published_version", "episodes_completed", "rl_trajectories_published",
                                     "updates_applied", "updates_rejected", "last_apply_ms"]),
        (trainer_pb2.TrainerStatus, ["step", "policy_version", "trajectories_consumed", "trajectories_pending", "dropped_stale_total",
                                     "downweighted_stale_total", "dropped_groups_total", "skipped_steps_total", "publishes_given_up_total", "dead_lettered", "duplicates_skipped", "checkpoint_step", "recent_steps"]),
        (trainer_pb2.StepMetrics, ["step", "step_seconds", "commit_seconds", "publish_seconds", "published", "reward_mean", "pass_rate", "loss",
                                   "policy_lag_mean", "policy_lag_max"]),
        (weightsync_pb2.WeightSyncStatus, ["latest_version", "stored_bytes", "chunk_bytes_sent", "chunks_sent", "upstream_bytes", "upstream_versions", "chunk_fetches"]),
    ]:
        missing = [f for f in fields if f not in message.DESCRIPTOR.fields_by_name]
        assert not missing, f"{message.DESCRIPTOR.name}: {missing}"
