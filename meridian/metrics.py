"""Prometheus metrics shared by every service: the one list of metric names, a registry
per service, and the HTTP endpoint :func:`meridian.grpc_runtime.run_server` starts.

Most figures are read, at scrape time, from the state each service already keeps for
its gRPC ``Status`` (a service hands :class:`ServiceMetrics` an async *source* that runs
on the service's event loop and returns samples); histograms, which need every
observation, are fed by one ``observe`` call where the event happens.

Every sample carries the labels ``service`` and ``region`` (``--region``, ``local`` by
default), added at exposition. Names follow Prometheus conventions: the ``meridian_``
prefix, the unit in the name, counters ending in ``_total``.

The endpoint is off unless ``--metrics-port`` is set (0: a free port, printed as
``meridian <service> metrics on <host>:<port>``); it listens on 127.0.0.1 by default and
refuses a non-loopback address unless it is served with TLS (``--metrics-tls-cert`` and
``--metrics-tls-key``). An endpoint that cannot start (port taken, certificate missing)
is logged and left out: the service runs on without it."""
from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import logging
import threading
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

log = logging.getLogger(__name__)

#: ``--metrics-port`` value that turns the endpoint off (the default).
METRICS_OFF = -1
#: The labels every sample carries.
COMMON_LABELS = ("service", "region")
#: How long a scrape waits for the service's event loop to hand over its figures.
SOURCE_TIMEOUT_S = 2.0

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


@dataclasses.dataclass(frozen=True)
class MetricSpec:
    """One metric: its exposed name, Prometheus type, help text and own labels (beside
    ``service`` and ``region``); histograms give their buckets."""

    name: str
    kind: str  # counter | gauge | histogram
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not self.name.startswith("meridian_"):
            raise ValueError(f"{self.name}: metric names start with meridian_")
        if self.kind not in ("counter", "gauge", "histogram"):
            raise ValueError(f"{self.name}: unknown kind {self.kind!r}")
        if (self.kind == "counter") != self.name.endswith("_total"):
            raise ValueError(f"{self.name}: counters, and only counters, end in _total")
        if self.kind == "histogram" and not self.buckets:
            raise ValueError(f"{self.name}: a histogram needs buckets")

    def series(self) -> tuple[str, ...]:
        """The sample names a scrape shows for this metric."""
        if self.kind == "histogram":
            return (f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count")
        return (self.name,)


def _spec(name: str, kind: str, help: str, labels: Sequence[str] = (), buckets: Sequence[float] = ()) -> MetricSpec:  # noqa: A002
    return MetricSpec(name, kind, help, tuple(labels), tuple(buckets))


# ---------------------------------------------------------------- the metrics (README: Metrics)

SERVICE_UP = _spec("meridian_service_up", "gauge", "1 while the service answers scrapes")
SOURCE_ERRORS = _spec("meridian_metrics_source_errors_total", "counter", "scrapes whose figures the service could not hand over in time (the histograms were still served)")

ROLLOUT_TOKENS = _spec("meridian_rollout_tokens_total", "counter", "tokens generated, by priority class (production, rl); rate() is tokens/s", ["priority"])
ROLLOUT_IN_FLIGHT = _spec("meridian_rollout_requests_in_flight", "gauge", "generation requests running on the engine, by priority class", ["priority"])
ROLLOUT_RL_LIMIT = _spec("meridian_rollout_rl_concurrency_limit", "gauge", "RL requests the admission controller lets run now")
ROLLOUT_PREEMPTIONS = _spec("meridian_rollout_preemptions_total", "counter", "RL requests preempted for production traffic")
ROLLOUT_SLO = _spec("meridian_rollout_slo_attainment_ratio", "gauge", "fraction of recent production latency windows that met the TTFT/ITL targets")
ROLLOUT_VERSION = _spec("meridian_rollout_policy_version", "gauge", "policy version the engine serves")
ROLLOUT_LAG = _spec("meridian_rollout_policy_lag_versions", "gauge", "newest published version minus the version this rollout serves")
ROLLOUT_BACKLOG = _spec("meridian_rollout_stream_backlog_groups", "gauge", "trajectory groups the trainer has not consumed yet (undelivered plus pending), as the RL workers see it")
ROLLOUT_EPISODES = _spec("meridian_rollout_episodes_total", "counter", "episodes completed and kept")
ROLLOUT_SANDBOXES = _spec("meridian_rollout_sandboxes_held", "gauge", "envsandbox sandboxes the rollout's groups hold (of its sandbox budget)")
ROLLOUT_BUDGET = _spec("meridian_rollout_sandbox_budget", "gauge", "the rollout's sandbox budget now: --sandbox-budget, or envsandbox's --max-sandboxes where that is lower")
ROLLOUT_WAITING = _spec("meridian_rollout_groups_waiting_for_sandboxes", "gauge", "groups waiting for room in the rollout's sandbox budget")
ROLLOUT_PUBLISHED = _spec("meridian_rollout_rl_trajectories_published_total", "counter", "trajectories the background RL workers published")
ROLLOUT_UPDATES = _spec("meridian_rollout_weight_updates_total", "counter", "policy versions applied or rejected (canary), by outcome", ["outcome"])
ROLLOUT_APPLY = _spec("meridian_rollout_last_apply_seconds", "gauge", "seconds the last policy update took to apply to the engine")

TRAINER_STEPS = _spec("meridian_trainer_steps_total", "counter", "optimizer steps taken (continues from the checkpoint after a restart)")
TRAINER_VERSION = _spec("meridian_trainer_policy_version", "gauge", "policy version of the trainer's weights")
TRAINER_CONSUMED = _spec("meridian_trainer_trajectories_consumed_total", "counter", "trajectories trained on")
TRAINER_WAITING = _spec("meridian_trainer_trajectories_waiting", "gauge", "trajectories read and waiting for the rest of their group")
TRAINER_STREAM = _spec("meridian_trainer_stream_entries", "gauge", "entries in the trajectory stream (queue length)")
TRAINER_PENDING = _spec("meridian_trainer_stream_pending_entries", "gauge", "stream entries delivered to the trainer's group and not acked yet")
TRAINER_STALE = _spec("meridian_trainer_stale_samples_total", "counter", "samples older than the staleness bound, by action (dropped, downweighted)", ["action"])
TRAINER_FLAT = _spec("meridian_trainer_dropped_groups_total", "counter", "groups skipped because all their rewards were equal")
TRAINER_DEAD = _spec("meridian_trainer_dead_lettered_total", "counter", "stream entries moved to the dead-letter stream (malformed, untrainable, or a batch whose step kept failing)")
TRAINER_SKIPPED = _spec("meridian_trainer_skipped_steps_total", "counter", "steps whose optimizer update was skipped for a non-finite loss or gradient norm")
TRAINER_GAVE_UP = _spec("meridian_trainer_publishes_given_up_total", "counter", "publishes that gave up (the weights could not be prepared, or weightsync was unreachable for every retry); the version is sent again later")
TRAINER_DUPLICATES = _spec("meridian_trainer_duplicates_skipped_total", "counter", "deliveries of a group already trained on or held")
TRAINER_STEP_SECONDS = _spec(
    "meridian_trainer_step_seconds", "histogram", "time per training step, by phase (learn: the learner's step; commit: the loop's wait for weights, canary and checkpoint copy; publish: the background publish)",
    ["phase"], _LATENCY_BUCKETS,
)
TRAINER_REWARD = _spec("meridian_trainer_reward_mean", "gauge", "mean reward of the last step's trajectories")
TRAINER_PASS = _spec("meridian_trainer_pass_ratio", "gauge", "fraction of the last step's trajectories that passed every test")
TRAINER_LOSS = _spec("meridian_trainer_loss", "gauge", "loss of the last step that trained (a step with nothing to train, or skipped, leaves it)")
TRAINER_LAG = _spec("meridian_trainer_sample_policy_lag_versions", "gauge", "policy lag of the last step's samples (trainer version minus the sample's oldest), by stat (mean, max)", ["stat"])
TRAINER_CHECKPOINT = _spec("meridian_trainer_checkpoint_step", "gauge", "step of the newest durable checkpoint (-1: none)")

WEIGHTSYNC_VERSION = _spec("meridian_weightsync_latest_version", "gauge", "newest policy version held (-1: none)")
WEIGHTSYNC_STORED = _spec("meridian_weightsync_stored_bytes", "gauge", "encoded bytes on disk")
WEIGHTSYNC_SENT = _spec("meridian_weightsync_sent_bytes_total", "counter", "encoded chunk bytes sent to subscribers and relays (Subscribe and FetchChunk)")
WEIGHTSYNC_CHUNKS = _spec("meridian_weightsync_sent_chunks_total", "counter", "chunks sent by Subscribe")
WEIGHTSYNC_RECEIVED = _spec("meridian_weightsync_upstream_bytes_total", "counter", "relay: encoded bytes received from its upstream")
WEIGHTSYNC_UPSTREAM_VERSIONS = _spec("meridian_weightsync_upstream_versions_total", "counter", "relay: versions received whole from its upstream")
WEIGHTSYNC_FETCHES = _spec("meridian_weightsync_chunk_fetches_total", "counter", "FetchChunk calls answered (chunks fetched again)")
WEIGHTSYNC_PROPAGATION = _spec(
    "meridian_weightsync_propagation_seconds", "histogram",
    "seconds until a new version is held whole here: on a relay from its manifest's arrival from upstream, on the origin from the start of its Publish",
    (), _LATENCY_BUCKETS,
)

SANDBOX_LIVE = _spec("meridian_envsandbox_live_sandboxes", "gauge", "sandboxes alive now")
SANDBOX_MAX = _spec("meridian_envsandbox_max_sandboxes", "gauge", "sandboxes allowed at once")
SANDBOX_RESERVED = _spec("meridian_envsandbox_reserved_sandboxes", "gauge", "slots live sandboxes hold for forks not made yet (CreateRequest.fork_reserve); they count against the limit")
SANDBOX_WAITING = _spec("meridian_envsandbox_waiting_creates", "gauge", "Creates waiting in line for room under the live sandbox limit")
SANDBOX_EXPIRED = _spec("meridian_envsandbox_sandboxes_expired_total", "counter", "sandboxes envsandbox closed itself, by reason (lease: their client stopped renewing them, e.g. a killed rollout; ttl: their time-to-live ran out)", ["reason"])
SANDBOX_EXEC_SECONDS = _spec("meridian_envsandbox_exec_seconds", "histogram", "wall-clock seconds of commands run in sandboxes, by kind (exec: Exec; tests: RunTests)", ["kind"], _LATENCY_BUCKETS)

#: Every metric a Meridian service exports, by name: the specs defined above (the
#: dashboard test and the README check against it).
METRICS: dict[str, MetricSpec] = {s.name: s for s in globals().copy().values() if isinstance(s, MetricSpec)}


def series_names() -> set[str]:
    """Every sample name a scrape may show (histograms as their _bucket/_sum/_count)."""
    return {name for spec in METRICS.values() for name in spec.series()}


# ---------------------------------------------------------------- registry


@dataclasses.dataclass(frozen=True)
class Value:
    """One sample a source hands over: ``spec`` with ``labels`` (its own) at ``value``."""

    spec: MetricSpec
    value: float
    labels: tuple[tuple[str, str], ...] = ()


def value(spec: MetricSpec, number: float, **labels: str) -> Value:
    """A sample of ``spec``; ``labels`` must be exactly the spec's own."""
    if set(labels) != set(spec.labels):
        raise ValueError(f"{spec.name} takes labels {spec.labels}, got {sorted(labels)}")
    return Value(spec, float(number), tuple(sorted(labels.items())))


Source = Callable[[], Awaitable[Iterable[Value]]]


class ServiceMetrics:
    """One service's metrics: a registry of its own (several services may share a
    process in tests), the histograms it observes, and the source it reads its other
    figures from at scrape time. :meth:`bind` gives it the event loop the source runs on."""

    def __init__(self, service: str, source: Source | None = None, region: str = "local") -> None:
        self.service = service
        self.region = region
        self.source = source
        self.loop: asyncio.AbstractEventLoop | None = None
        self.source_errors = 0
        self._histograms = CollectorRegistry(auto_describe=False)
        self._made: dict[str, Histogram] = {}
        self._lock = threading.Lock()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Exposition(self))

    def bind(self, loop: asyncio.AbstractEventLoop, region: str | None = None) -> None:
        """Runs the source on ``loop`` from now on (and labels samples with ``region``)."""
        self.loop = loop
        if region is not None:
            self.region = region

    def observe(self, spec: MetricSpec, number: float, **labels: str) -> None:
        """Adds one observation to histogram ``spec`` (thread-safe, cheap)."""
        if spec.kind != "histogram":
            raise ValueError(f"{spec.name} is a {spec.kind}, not a histogram")
        with self._lock:
            histogram = self._made.get(spec.name)
            if histogram is None:
                histogram = self._made[spec.name] = Histogram(spec.name, spec.help, spec.labels, registry=self._histograms, buckets=spec.buckets)
        (histogram.labels(**labels) if spec.labels else histogram).observe(number)

    def _read_source(self) -> list[Value]:
        """The source's values, run on the service's loop; [] when it cannot answer in time."""
        loop = self.loop
        if self.source is None:
            return []
        if loop is None or loop.is_closed():
            return []
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:  # the source would wait for the loop this scrape holds
            raise RuntimeError(f"{self.service}: metrics scraped on the service's own event loop; scrape from another thread")
        future = asyncio.run_coroutine_threadsafe(_as_list(self.source), loop)
        try:
            return future.result(SOURCE_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - a scrape serves what it has
            future.cancel()
            self.source_errors += 1
            log.warning("%s: metrics source failed: %r", self.service, exc)
            return []

    def families(self) -> list[Metric]:
        """Every metric family of this service, without the common labels."""
        values = self._read_source()
        out: dict[str, Metric] = {}
        for spec, number in ((SERVICE_UP, 1.0), (SOURCE_ERRORS, float(self.source_errors))):
            _add(out, value(spec, number))
        for v in values:
            _add(out, v)
        out.update({m.name: m for m in self._histograms.collect()})
        return list(out.values())


async def _as_list(source: Source) -> list[Value]:
    return list(await source())


def _add(families: dict[str, Metric], v: Value) -> None:
    spec = v.spec
    if METRICS.get(spec.name) is not spec:
        raise ValueError(f"{spec.name} is not in meridian.metrics.METRICS")
    if spec.kind == "histogram":
        raise ValueError(f"{spec.name}: histograms are observed, not handed over")
    # prometheus_client names a counter family without its _total; its sample keeps it.
    family_name = spec.name.removesuffix("_total") if spec.kind == "counter" else spec.name
    family = families.get(family_name)
    if family is None:
        family = families[family_name] = Metric(family_name, spec.help, spec.kind)
    family.add_sample(spec.name, dict(v.labels), v.value)


class _Exposition(Collector):
    """Adds ``service`` and ``region`` to every sample of a :class:`ServiceMetrics`."""

    def __init__(self, metrics: ServiceMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        common = {"service": self.metrics.service, "region": self.metrics.region}
        for family in self.metrics.families():
            labelled = Metric(family.name, family.documentation, family.type, family.unit)
            # Creation timestamps are left out: every exposed series is one of METRICS'.
            labelled.samples = [s._replace(labels={**s.labels, **common}) for s in family.samples if isinstance(s, Sample) and not s.name.endswith("_created")]
            yield labelled


# ---------------------------------------------------------------- endpoint


def is_loopback(host: str) -> bool:
    """True for localhost and loopback addresses (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name other than localhost may resolve anywhere


def check_endpoint(host: str, port: int, tls_cert: str = "", tls_key: str = "") -> None:
    """Refuses settings the endpoint must not run with (raises ValueError)."""
    if not METRICS_OFF <= port < 65536:
        raise ValueError(f"metrics_port must be -1 (off), 0 (a free port) or a port, got {port}")
    if bool(tls_cert) != bool(tls_key):
        raise ValueError("metrics TLS needs both metrics_tls_cert and metrics_tls_key")
    if port != METRICS_OFF and not is_loopback(host) and not tls_cert:
        raise ValueError(f"metrics_host {host!r} is not a loopback address: serving metrics there needs TLS (metrics_tls_cert and metrics_tls_key)")


@dataclasses.dataclass
class Endpoint:
    """A running metrics endpoint (an HTTP server on a daemon thread)."""

    host: str
    port: int
    scheme: str
    _server: Any

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def serve(metrics: ServiceMetrics, host: str, port: int, tls_cert: str = "", tls_key: str = "") -> Endpoint:
    """Serves ``metrics`` on ``host:port`` (0: a free port) until :meth:`Endpoint.close`."""
    check_endpoint(host, port, tls_cert, tls_key)
    if port == METRICS_OFF:
        raise ValueError("the metrics endpoint is off (metrics_port -1)")
    server, _ = start_http_server(port, addr=host, registry=metrics.registry, certfile=tls_cert or None, keyfile=tls_key or None)
    return Endpoint(host, int(server.server_port), "https" if tls_cert else "http", server)


def start_endpoint(name: str, service: object, config: Any, loop: asyncio.AbstractEventLoop) -> Endpoint | None:
    """Starts ``service``'s endpoint as ``config`` (a ServerConfig) sets it, or None when
    it is off. The service's ``metrics`` (a :class:`ServiceMetrics`) is served; a service
    without one exports the common metrics only. Prints the line the stack launcher reads."""
    if config.metrics_port == METRICS_OFF:
        return None
    registry = getattr(service, "metrics", None) or ServiceMetrics(name)
    region = config.metrics_region or getattr(getattr(service, "config", None), "region", "") or "local"
    registry.bind(loop, region)
    try:
        endpoint = serve(registry, config.metrics_host, config.metrics_port, config.metrics_tls_cert, config.metrics_tls_key)
    except OSError as exc:
        # Metrics never take a service down: a taken port or a missing certificate leaves
        # it serving without them (and its scrape target down, which is what alerts see).
        log.error("%s: metrics endpoint on %s:%d not started: %s", name, config.metrics_host, config.metrics_port, exc)
        print(f"meridian {name} metrics unavailable: {exc}", flush=True)
        return None
    # The stack launcher reads this line to learn the port; keep its shape stable.
    print(f"meridian {name} metrics on {endpoint.host}:{endpoint.port}", flush=True)
    return endpoint


# ---------------------------------------------------------------- sources: Status -> values


def rollout_values(status: Any, backlog: int) -> list[Value]:
    """A rollout's figures from its ``RolloutStatus`` and the stream backlog it watches."""
    latest = status.latest_published_version
    return [
        value(ROLLOUT_TOKENS, status.production_tokens, priority="production"),
        value(ROLLOUT_TOKENS, status.rl_tokens, priority="rl"),
        value(ROLLOUT_IN_FLIGHT, status.production_in_flight, priority="production"),
        value(ROLLOUT_IN_FLIGHT, status.rl_running, priority="rl"),
        value(ROLLOUT_RL_LIMIT, status.rl_concurrency_limit),
        value(ROLLOUT_PREEMPTIONS, status.rl_preemptions),
        value(ROLLOUT_SLO, status.slo_attainment),
        value(ROLLOUT_VERSION, status.policy_version),
        # Without a weightsync (latest -1) nothing newer exists: no lag.
        value(ROLLOUT_LAG, max(0, latest - status.policy_version) if latest >= 0 else 0),
        value(ROLLOUT_BACKLOG, backlog),
        value(ROLLOUT_EPISODES, status.episodes_completed),
        value(ROLLOUT_SANDBOXES, status.sandboxes_held),
        value(ROLLOUT_BUDGET, status.sandbox_budget),
        value(ROLLOUT_WAITING, status.groups_waiting_for_sandboxes),
        value(ROLLOUT_PUBLISHED, status.rl_trajectories_published),
        value(ROLLOUT_UPDATES, status.updates_applied, outcome="applied"),
        value(ROLLOUT_UPDATES, status.updates_rejected, outcome="rejected"),
        value(ROLLOUT_APPLY, status.last_apply_ms / 1000),
    ]


def trainer_values(status: Any, stream_entries: int, stream_pending: int) -> list[Value]:
    """A trainer's figures from its ``TrainerStatus`` (the last step's, when it has one)
    and the trajectory stream's length and pending entries."""
    out = [
        value(TRAINER_STEPS, status.step),
        value(TRAINER_VERSION, status.policy_version),
        value(TRAINER_CONSUMED, status.trajectories_consumed),
        value(TRAINER_WAITING, status.trajectories_pending),
        value(TRAINER_STREAM, stream_entries),
        value(TRAINER_PENDING, stream_pending),
        value(TRAINER_STALE, status.dropped_stale_total, action="dropped"),
        value(TRAINER_STALE, status.downweighted_stale_total, action="downweighted"),
        value(TRAINER_FLAT, status.dropped_groups_total),
        value(TRAINER_SKIPPED, status.skipped_steps_total),
        value(TRAINER_GAVE_UP, status.publishes_given_up_total),
        value(TRAINER_DEAD, status.dead_lettered),
        value(TRAINER_DUPLICATES, status.duplicates_skipped),
        value(TRAINER_CHECKPOINT, status.checkpoint_step),
    ]
    if status.recent_steps:
        last = status.recent_steps[-1]
        out += [
            value(TRAINER_REWARD, last.reward_mean),
            value(TRAINER_PASS, last.pass_rate),
            value(TRAINER_LAG, last.policy_lag_mean, stat="mean"),
            value(TRAINER_LAG, last.policy_lag_max, stat="max"),
        ]
    # A step that trained nothing (every group flat or stale) reports loss 0: the gauge
    # would dive to 0 on it.
    trained = [s for s in status.recent_steps if s.stepped]
    if trained:
        out.append(value(TRAINER_LOSS, trained[-1].loss))
    return out


class StepObserver:
    """Feeds the trainer's step-time histogram from the steps its ``Status`` reports:
    each step's learn and commit times once, its publish time once it is published
    (publishes finish in version order, one at a time)."""

    def __init__(self, metrics: ServiceMetrics) -> None:
        self.metrics = metrics
        self.learned = -1
        self.published = -1

    def update(self, steps: Iterable[Any]) -> None:
        for s in steps:
            if s.step > self.learned:
                self.learned = s.step
                self.metrics.observe(TRAINER_STEP_SECONDS, s.step_seconds, phase="learn")
                self.metrics.observe(TRAINER_STEP_SECONDS, s.commit_seconds, phase="commit")
            if s.published and s.step > self.published:
                self.published = s.step
                self.metrics.observe(TRAINER_STEP_SECONDS, s.publish_seconds, phase="publish")


def weightsync_values(status: Any) -> list[Value]:
    """A weightsync's figures from its ``WeightSyncStatus``."""
    return [
        value(WEIGHTSYNC_VERSION, status.latest_version),
        value(WEIGHTSYNC_STORED, status.stored_bytes),
        value(WEIGHTSYNC_SENT, status.chunk_bytes_sent),
        value(WEIGHTSYNC_CHUNKS, status.chunks_sent),
        value(WEIGHTSYNC_RECEIVED, status.upstream_bytes),
        value(WEIGHTSYNC_UPSTREAM_VERSIONS, status.upstream_versions),
        value(WEIGHTSYNC_FETCHES, status.chunk_fetches),
    ]


def envsandbox_values(live: int, capacity: int, reserved: int, waiting: int, expired: Mapping[str, int]) -> list[Value]:
    """An envsandbox's figures: sandboxes alive and allowed, slots reserved for forks,
    Creates waiting for room, and the sandboxes it closed itself (``expired``: reason -> count)."""
    return [
        value(SANDBOX_LIVE, live), value(SANDBOX_MAX, capacity), value(SANDBOX_RESERVED, reserved), value(SANDBOX_WAITING, waiting),
        *(value(SANDBOX_EXPIRED, n, reason=r) for r, n in sorted(expired.items())),
    ]
