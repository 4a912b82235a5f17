"""A discrete-event model of one policy version travelling origin -> relays -> subscribers.

Plans the frontier case (models up to 1T parameters, several regions) that cannot be run
here: how long until a version is served everywhere, where that time goes (the critical
path, by stage), and how many bytes each link carries per day. The model is a pure core:
stdlib only (a ``heapq`` event queue), deterministic, no I/O; ``main`` at the end is the
``meridian simulate weightsync`` command, and ``benchmarks/weightsync_simulation.py``
checks the model against real runs.

What travels is modelled from the real format: a version is the model's tensors cut into
chunks of at most ``chunk_bytes`` raw bf16 bytes (a chunk never spans two tensors, as in
``versions.encode_version``), each encoded to ``delta_fraction`` of its raw size. A
version is simulated as at most ``max_segments`` segments of consecutive chunks: costs
that are per chunk (messages, sha256) stay exact, only the pipelining granularity of the
big models is coarsened (one segment is <= 1/max_segments of the version).

Two modes:

``current`` -- the code as it is. The origin encodes the whole version before announcing
it, its tensors on one thread per core (``store.publish``: codec, the weights hash moved by
its changes, each chunk's sha256 on the thread that encoded it), or with ``rank_encode``
the trainer's ranks encode their parts and the origin decodes them in place into the
buffers of the version before (the Python of each chunk under the GIL), then writes it
with fsync on one thread; every peer then streams it through one asyncio event loop per
process:
the sender pays per chunk, per message (consecutive chunks held are coalesced into
``--message-kib`` messages) and per byte, the receiver per chunk (its checksum, the
bookkeeping, and the GIL-held Python part of decoding it). Those costs were measured apart
(``benchmarks/weightsync_send_cost.py``). The manifest (a reference per chunk, a
description per tensor) crosses each hop ahead of the chunks. Relays are cut-through: a chunk is passed on
once it arrived and passed its checksum. Receivers decode on a pool of one thread per
core while the next chunks arrive; a subscriber holds the version once every chunk is
decoded and the full-weights hash checked (``signed``: and the weights hashed for the
signature's content digest, each tensor as its last chunk is decoded; a verifying relay
holds the version's last chunk back until the version is checked and stored).

``pipelined`` -- the design target, not the code: the origin encodes chunk by chunk on
all its cores (the weights hash moved by the encoder's changes, no full pass) and sends
each chunk as soon as it is encoded; chunks are coalesced into messages of up to
``message_bytes``; per-message work, verification and decoding run on all cores of a
node; the flow-control window is the bandwidth-delay product (a link's ``window_bytes``
is ignored: links run at full rate); subscribers apply each chunk to the engine as it is
decoded.

Left out on purpose (see the README): congestion and packet loss, TCP slow start, other
traffic on the links, CPU or memory-bandwidth contention with the trainer or the engine,
the trainer -> origin upload of the raw weights (rank-encoded parts: their encoded bytes
through the origin's NIC are modelled), keyframe versions (1 in
``keyframe_every``: the origin also encodes a keyframe before announcing), late joiners
and catch-up, failures and retries, and versions overlapping one another (each version is
simulated alone; ``bytes_per_day`` says whether the links keep up with the version rate).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

MODES = ("current", "pipelined")
BF16_BYTES = 2
GBIT_S = 1e9 / 8  # bytes per second in one Gbit/s
MIB = 1 << 20
DAY_S = 86_400.0

#: What the service coalesces chunks into (``--message-kib``, 64 KiB).
CURRENT_MESSAGE_BYTES = 64 << 10
#: Steps of the critical path listed in a report (their seconds are all in the totals).
MAX_PATH_STEPS = 40


class SimulationError(ValueError):
    """An input the model cannot take (the message says which and why)."""


def _positive(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise SimulationError(f"{name} must be a positive finite number, got {value!r}")


def _non_negative(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise SimulationError(f"{name} must be a finite number >= 0, got {value!r}")


def _count(name: str, value: int, least: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise SimulationError(f"{name} must be an integer >= {least}, got {value!r}")


# ---------------------------------------------------------------- inputs


@dataclasses.dataclass(frozen=True)
class Link:
    """One direction of a link: bytes/s, one-way latency, and the flow-control window
    (bytes in flight before the sender waits for the receiver; None: it never limits)."""

    bandwidth_bytes_s: float
    latency_s: float
    window_bytes: float | None = None

    def __post_init__(self) -> None:
        _positive("link bandwidth", self.bandwidth_bytes_s)
        _non_negative("link latency", self.latency_s)
        if self.window_bytes is not None:
            _positive("link window", self.window_bytes)

    @classmethod
    def gbit(cls, gbit_s: float, latency_ms: float, window_bytes: float | None = None) -> Link:
        _positive("link Gbit/s", gbit_s)
        _non_negative("link latency ms", latency_ms)
        return cls(gbit_s * GBIT_S, latency_ms / 1e3, window_bytes)

    @property
    def rate(self) -> float:
        """Bytes/s a long transfer gets: the bandwidth, or one window per round trip."""
        if self.window_bytes is None or self.latency_s == 0:
            return self.bandwidth_bytes_s
        return min(self.bandwidth_bytes_s, self.window_bytes / (2 * self.latency_s))


@dataclasses.dataclass(frozen=True)
class Topology:
    """Region 0 holds the origin; every other region one relay (the region's head), fed
    over a WAN link from its parent in a tree of the heads (``region_fanout`` children per
    node; None: every relay pulls from the origin, as ``--role relay --upstream ORIGIN``
    does). In each region the head feeds ``local_relays`` relays over the LAN, which feed
    the region's subscribers (none: the head feeds them itself). ``origin_subscribers``:
    subscribers in the origin's region (None: ``subscribers_per_region``). A node's
    children share its NIC (``nic_bytes_s``, None: the LAN bandwidth)."""

    regions: int = 1
    subscribers_per_region: int = 1
    wan: Link = dataclasses.field(default_factory=lambda: Link.gbit(10, 50))
    lan: Link = dataclasses.field(default_factory=lambda: Link.gbit(100, 0.1))
    region_fanout: int | None = None
    local_relays: int = 0
    origin_subscribers: int | None = None
    nic_bytes_s: float | None = None

    def __post_init__(self) -> None:
        _count("regions", self.regions, 1)
        _count("subscribers per region", self.subscribers_per_region, 0)
        _count("local relays", self.local_relays, 0)
        if self.region_fanout is not None:
            _count("region fanout", self.region_fanout, 1)
        if self.origin_subscribers is not None:
            _count("origin subscribers", self.origin_subscribers, 0)
        if self.nic_bytes_s is not None:
            _positive("NIC bytes/s", self.nic_bytes_s)
        if self.subscriber_count == 0:
            raise SimulationError("the topology has no subscriber: nothing would be served")

    @property
    def subscriber_count(self) -> int:
        home = self.subscribers_per_region if self.origin_subscribers is None else self.origin_subscribers
        return home + self.subscribers_per_region * (self.regions - 1)


@dataclasses.dataclass(frozen=True)
class CodecRates:
    """Per-core speeds (bytes per second) and sizes the model runs on.

    ``encode``, ``decode`` (in place, as a subscriber applies a delta: decode + undo log +
    incremental weights-hash check; relays too), ``decode_copy`` (into fresh buffers; no longer charged)
    and ``weights_hash`` (the element hash of full weights; no longer charged: the origin moves it by the changes) are per raw
    bf16 byte; ``sha256`` and ``persist`` (write + fsync) per encoded byte.
    ``delta_fraction``: encoded bytes of a delta over raw bf16 bytes.
    ``send_chunk_s``, ``send_message_s``, ``send_byte_s``: what sending costs the sender's
    process per chunk, per gRPC message and per encoded byte (protobuf, HTTP/2 framing,
    copies), measured apart by ``benchmarks/weightsync_send_cost.py``.
    ``receive_chunk_s``: what the receiver's event loop spends per chunk (verify,
    bookkeeping, the hand-off to a decode thread), measured there too; ``decode_chunk_s``:
    the Python part of decoding one chunk in place, which holds the GIL, so a process's
    decode threads run it one at a time (measured by the benches: the same delta in 64x
    smaller chunks, the difference per extra chunk).
    ``message_overhead_s``: per chunk and per side, what all services in one process on
    the 2-core development machine lose to each other (GIL, cores, the link emulator) on
    top of those; fitted on real runs (``benchmarks/weightsync_simulation.py``) and only
    charged when ``single_process`` (one process per node at scale has its own cores).
    ``version_tensor_s``: what each receiver spends per tensor per version besides its
    chunks, under its GIL (the decoder's start of a version and its weights-hash check at
    the end; measured on the built-in model, 1.3 ms for 272 tensors).
    ``engine_apply``: raw-equivalent bytes/s a subscriber writes a decoded version into
    its inference engine (0: not modelled; served means held, verified, in memory).
    ``manifest_chunk_bytes``, ``manifest_tensor_bytes``: the size of a version's manifest
    on the wire per chunk (index, tensor name, size, sha256 in hex) and per tensor (name,
    dtype, shape), gzipped as Subscribe sends it, measured on the built-in model's
    manifests (45.8 KB for 285 chunks and 272 tensors, 13 % of a delta's bytes there;
    13.7 KB gzipped). It goes ahead of the chunks on every hop.
    ``source`` says where the figures come from."""

    encode_bytes_s: float
    decode_bytes_s: float
    decode_copy_bytes_s: float
    weights_hash_bytes_s: float
    sha256_bytes_s: float
    persist_bytes_s: float
    delta_fraction: float
    message_overhead_s: float
    receive_chunk_s: float = 6.5e-6
    decode_chunk_s: float = 31e-6
    send_chunk_s: float = 1.5e-6
    send_message_s: float = 48e-6
    send_byte_s: float = 0.31e-9
    version_tensor_s: float = 4.8e-6
    engine_apply_bytes_s: float = 0.0
    manifest_chunk_bytes: float = 44.0
    manifest_tensor_bytes: float = 4.2
    source: str = ""

    def __post_init__(self) -> None:
        for name in ("encode_bytes_s", "decode_bytes_s", "decode_copy_bytes_s", "weights_hash_bytes_s", "sha256_bytes_s", "persist_bytes_s"):
            _positive(name, getattr(self, name))
        _positive("delta_fraction", self.delta_fraction)
        if self.delta_fraction > 1.5:
            raise SimulationError(f"delta_fraction is encoded/raw bytes; {self.delta_fraction} is more than a keyframe costs")
        for name in (
            "message_overhead_s", "receive_chunk_s", "decode_chunk_s", "send_chunk_s", "send_message_s", "send_byte_s", "version_tensor_s",
            "manifest_chunk_bytes", "manifest_tensor_bytes",
        ):  # fmt: skip
            _non_negative(name, getattr(self, name))
        _non_negative("engine_apply_bytes_s", self.engine_apply_bytes_s)

    def replace(self, **changes: Any) -> CodecRates:
        return dataclasses.replace(self, **changes)


#: Figures measured on a 2-core development machine (an Intel Xeon, Sapphire Rapids, load
#: average 1.2-1.9) with the built-in SmolLM2-135M and real RL steps at lr 1e-6. From
#: ``meridian bench weightsync --json``: the delta size (codec format 3, median 0.127 % of
#: full bf16), encode (1.6 GB/s, one core), in-place decode per CPU second (8.9 GB/s), decode
#: into fresh buffers (6.2 GB/s), the Python part of decoding one chunk (31 us). sha256 with
#: the stdlib on 5 KB and 8 MiB buffers (1.6-1.8 GB/s), write + fsync of 1 MiB files
#: (1.3 GB/s); the full-weights element hash (``weights_hash``) 5.3 GB/s and the per-chunk
#: contention of all services in one process (33 us; 0-33 us in five runs) from
#: ``benchmarks/weightsync_simulation.py``; the event loops' send and receive costs from
#: ``benchmarks/weightsync_send_cost.py`` (the field defaults of :class:`CodecRates`).
DEFAULT_RATES = CodecRates(
    encode_bytes_s=1.6e9,
    decode_bytes_s=8.9e9,
    decode_copy_bytes_s=6.2e9,
    weights_hash_bytes_s=5.3e9,
    sha256_bytes_s=1.6e9,
    persist_bytes_s=1.3e9,
    delta_fraction=0.00127,
    message_overhead_s=33e-6,
    decode_chunk_s=31e-6,
    engine_apply_bytes_s=0.0,
    source="defaults measured on the development machine (see DEFAULT_RATES)",
)


def rates_from_bench(result: Mapping[str, Any], base: CodecRates = DEFAULT_RATES) -> CodecRates:
    """``base`` with the codec figures of a ``meridian bench weightsync --json`` result:
    encode/decode GB/s per core and our delta's share of the full bf16 bytes (medians)."""
    try:
        summary = result["summary"]
        changes = {
            "encode_bytes_s": float(summary["encode_gbps"]) * 1e9,
            # Per core: the CPU-time figure when there is one (robust to a shared machine).
            "decode_bytes_s": float(summary.get("decode_gbps_cpu") or summary["decode_gbps"]) * 1e9,
            "delta_fraction": float(summary["ours_pct_of_full"]) / 100,
        }
        if "decode_chunk_us" in summary:
            changes["decode_chunk_s"] = float(summary["decode_chunk_us"]) * 1e-6
        if "decode_copy_gbps" in summary:
            changes["decode_copy_bytes_s"] = float(summary["decode_copy_gbps"]) * 1e9
    except (KeyError, TypeError, ValueError) as exc:
        raise SimulationError(f"not a `meridian bench weightsync --json` result: missing or bad {exc}") from None
    return base.replace(**changes, source="meridian bench weightsync result (codec figures); defaults for the rest")


@dataclasses.dataclass(frozen=True)
class ModelLayout:
    """The tensors of a model, as ``(count, elements)`` groups of equal tensors (bf16).

    ``density``: per group, its delta's encoded bytes per raw byte relative to the whole
    version's (1: the average; None: every group at the average). Where it is known (a
    recorded model: a dense embedding delta is most of the bytes of a small share of the
    elements), the segments carry their own bytes and the transfer brings the decode work
    as unevenly as the real stream does."""

    name: str
    groups: tuple[tuple[int, int], ...]
    density: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if not self.groups:
            raise SimulationError(f"model {self.name!r} has no tensors")
        for count, numel in self.groups:
            _count("tensor count", count, 1)
            _count("tensor elements", numel, 1)
        if self.density is not None:
            if len(self.density) != len(self.groups):
                raise SimulationError(f"model {self.name!r}: {len(self.density)} densities for {len(self.groups)} groups")
            for d in self.density:
                _non_negative("density", d)

    @property
    def params(self) -> int:
        return sum(c * n for c, n in self.groups)

    @property
    def tensors(self) -> int:
        return sum(c for c, _ in self.groups)

    @property
    def raw_bytes(self) -> int:
        return BF16_BYTES * self.params

    def chunk_runs(self, chunk_bytes: int) -> Iterator[tuple[int, int, float]]:
        """``(chunks, raw bytes each, density)`` runs, in order: each tensor cut into
        chunks of at most ``chunk_bytes`` raw bytes (whole elements), as the encoder cuts
        it; the density of its group (see the class)."""
        per_chunk = max(1, chunk_bytes // BF16_BYTES)
        for g, (count, numel) in enumerate(self.groups):
            density = 1.0 if self.density is None else self.density[g]
            full, rest = divmod(numel, per_chunk)
            if full:
                yield count * full, per_chunk * BF16_BYTES, density
            if rest:
                yield count, rest * BF16_BYTES, density

    def chunks(self, chunk_bytes: int) -> int:
        return sum(n for n, _, _ in self.chunk_runs(chunk_bytes))


def _llama(name: str, hidden: int, layers: int, inter: int, kv_dim: int, vocab: int, tied: bool) -> ModelLayout:
    groups = [(1 if tied else 2, vocab * hidden), (1, hidden)]  # embeddings (+ head), final norm
    groups += [(2 * layers, hidden * hidden), (2 * layers, hidden * kv_dim), (3 * layers, hidden * inter), (2 * layers, hidden)]
    return ModelLayout(name, tuple(groups))


def _moe_1t() -> ModelLayout:
    """A DeepSeek-V3-style mixture of experts at 1T parameters (the shape of Kimi K2:
    61 layers, the first dense, 384 routed experts of 7168x2048 and one shared expert
    per layer, multi-head latent attention, 163840-token vocabulary)."""
    hidden, layers, experts, e_inter, vocab = 7168, 61, 384, 2048, 163_840
    attention = [(layers, hidden * 1536), (layers, 1536 * 64 * 192), (layers, hidden * 576), (layers, 512 * 64 * 256), (layers, 64 * 128 * hidden)]
    norms = [(2 * layers + 1, hidden), (layers, 1536), (layers, 512)]
    moe = layers - 1
    return ModelLayout(
        "1t",
        tuple(
            [(2, vocab * hidden)]
            + attention
            + norms
            + [(3, hidden * 18_432)]  # the dense first layer's MLP
            + [(moe * experts * 3, hidden * e_inter), (moe * 3, hidden * e_inter), (moe, experts * hidden)]  # experts, shared expert, router
        ),
    )


#: Named sizes: the built-in model's real shape, Llama-3-family dense shapes, and a 1T MoE.
PRESETS: dict[str, ModelLayout] = {
    "135m": _llama("135m", 576, 30, 1536, 192, 49_152, tied=True),
    "1b": _llama("1b", 2048, 16, 8192, 512, 128_256, tied=True),
    "8b": _llama("8b", 4096, 32, 14_336, 1024, 128_256, tied=False),
    "70b": _llama("70b", 8192, 80, 28_672, 1024, 128_256, tied=False),
    "405b": _llama("405b", 16_384, 126, 53_248, 1024, 128_256, tied=False),
    "1t": _moe_1t(),
}

_SUFFIX = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_params(text: str) -> float:
    """``"135m"``, ``"1.5B"``, ``"1t"``, ``"7e9"`` -> parameters."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?(?:e\d+)?)\s*([kmbgt]?)\s*", str(text).lower())
    if not m:
        raise SimulationError(f"model size {text!r}: expected a number with an optional k/m/b/t suffix (135m, 8b, 1t)")
    params = float(m.group(1)) * _SUFFIX[m.group(2)]
    if not 1e3 <= params <= 1e14:
        raise SimulationError(f"model size {text!r}: {params:.3g} parameters is outside 1e3..1e14")
    return params


def model_layout(size: str | float) -> ModelLayout:
    """A preset by name, or the nearest preset (in log size) scaled to ``size`` parameters
    (same tensor count, every tensor scaled alike)."""
    if isinstance(size, str) and size.strip().lower() in PRESETS:
        return PRESETS[size.strip().lower()]
    params = parse_params(size) if isinstance(size, str) else float(size)
    if not 1e3 <= params <= 1e14:
        raise SimulationError(f"model size {params:.3g} parameters is outside 1e3..1e14")
    base = min(PRESETS.values(), key=lambda p: abs(math.log(p.params / params)))
    scale = params / base.params
    label = size.strip().lower() if isinstance(size, str) else f"{params:.3g}"
    return ModelLayout(f"{label} (shape of {base.name}, scaled)", tuple((c, max(1, round(n * scale))) for c, n in base.groups))


@dataclasses.dataclass(frozen=True)
class SimConfig:
    """One simulated version: the model, who gets it over what, how fast nodes compute.

    ``cores``: cores of each node's process (for a model sharded over several hosts, the
    cores of all its hosts); ``origin_cores``: the origin's, where they differ (in the
    pipelined design the trainer's hosts encode their own shards; None: ``cores``).
    ``chunk_bytes``: the largest raw chunk (the service's
    ``--chunk-mb``). ``message_bytes``: chunks are coalesced into messages of up to this
    many encoded bytes (None: the service's ``--message-kib``, 64 KiB, in current mode;
    4 MiB in pipelined mode). ``version_interval_s``: one version per this many
    seconds, for the bytes per day. ``single_process``: every node runs in one process on
    ``cores`` cores, one event loop, and the inter-region links are the in-process link
    emulator (how the benches run the real services; for validation only). ``signed``:
    every receiver verifies the trainer's signature, so each also checks the signed
    content digest, a sha256 pass over the decoded weights (each tensor hashed as its last
    chunk is decoded), before it holds the version (a verifying relay passes the
    version's last chunk on only after that). ``rank_encode`` (current mode): the trainer
    is sharded and its ranks encode their parts on ``origin_cores`` cores (a sharded
    publish with :class:`~services.weightsync.parts.PartEncoder`); the origin decodes them.
    """

    model: ModelLayout
    topology: Topology
    rates: CodecRates = DEFAULT_RATES
    mode: str = "current"
    cores: int = 64
    origin_cores: int | None = None
    chunk_bytes: int = 4 * MIB
    message_bytes: int | None = None
    version_interval_s: float = 60.0
    max_segments: int = 256
    single_process: bool = False
    signed: bool = False
    rank_encode: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise SimulationError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        _count("cores", self.cores, 1)
        if self.origin_cores is not None:
            _count("origin cores", self.origin_cores, 1)
        _count("chunk bytes", self.chunk_bytes, BF16_BYTES)
        if self.message_bytes is not None:
            _count("message bytes", self.message_bytes, 1)
        _count("max segments", self.max_segments, 1)
        _positive("version interval", self.version_interval_s)


# ---------------------------------------------------------------- event engine


class _Resource:
    """``lanes`` identical servers (cores, a link); jobs start in the order they become
    ready (the engine hands them over in that order), each on the lane free first."""

    __slots__ = ("name", "lanes", "busy")

    def __init__(self, name: str, lanes: int) -> None:
        self.name = name
        self.lanes: list[tuple[float, int, _Job | None]] = [(0.0, i, None) for i in range(lanes)]
        self.busy = 0.0


class _Job:
    __slots__ = ("stage", "node", "resource", "duration", "width", "parts", "succ", "pending", "ready", "ready_from", "start", "end", "pred", "gap")

    def __init__(self, stage: str, node: str, resource: _Resource | None, duration: float, parts: Mapping[str, float] | None, width: int) -> None:
        self.stage = stage
        self.width = width  # independent pieces (chunks): lanes it can use at once
        self.node = node
        self.resource = resource
        self.duration = duration
        self.parts = parts  # how ``duration`` splits into stages (None: all ``stage``)
        self.succ: list[tuple[_Job, float, str]] = []
        self.pending = 0
        self.ready = 0.0
        self.ready_from: tuple[_Job, float, str] | None = None
        self.start = math.nan
        self.end = math.nan
        self.pred: _Job | None = None
        self.gap: tuple[float, str] = (0.0, "")  # delay between pred's end and this start


class _Graph:
    """Jobs with dependencies (an edge may carry a delay: the link latency), run by an
    event queue in time order; afterwards every job knows what held it up last."""

    def __init__(self) -> None:
        self.jobs: list[_Job] = []

    def job(
        self,
        stage: str,
        node: str,
        resource: _Resource | None,
        duration: float,
        parts: Mapping[str, float] | None = None,
        after: Sequence[_Job | None] = (),
        width: int = 1,
    ) -> _Job:
        """A job of ``duration`` seconds of one lane's work (the sum of ``parts`` when
        given) on ``resource`` (None: a delay or join that needs no resource)."""
        if parts is not None:
            duration = sum(parts.values())
        j = _Job(stage, node, resource, duration, parts, width)
        self.jobs.append(j)
        for dep in after:
            if dep is not None:
                self.edge(dep, j)
        return j

    @staticmethod
    def edge(dep: _Job, job: _Job, delay: float = 0.0, label: str = "") -> None:
        dep.succ.append((job, delay, label))
        job.pending += 1

    def run(self) -> None:
        queue: list[tuple[float, int, _Job]] = []
        seq = 0
        for j in self.jobs:
            if j.pending == 0:
                queue.append((0.0, seq, j))
                seq += 1
        heapq.heapify(queue)
        done = 0
        while queue:
            ready, _, j = heapq.heappop(queue)
            r = j.resource
            if r is None:
                start, j.pred, j.gap = ready, *self._from(j)
                end = start + j.duration
            else:
                start, end = self._place(j, r, ready)
            j.start, j.end = start, end
            done += 1
            for s, delay, label in j.succ:
                t = j.end + delay
                if s.ready_from is None or t > s.ready:
                    s.ready, s.ready_from = t, (j, delay, label)
                s.pending -= 1
                if s.pending == 0:
                    heapq.heappush(queue, (s.ready, seq, s))
                    seq += 1
        if done != len(self.jobs):
            raise RuntimeError("the job graph has a cycle")  # a bug in the graph builder

    def _place(self, j: _Job, r: _Resource, ready: float) -> tuple[float, float]:
        """Puts ``j`` on the lanes of ``r`` free first: its ``width`` independent pieces
        (chunks) spread over up to that many lanes, filled so they all end together (a
        thread pool taking chunks as threads come free). Returns (start, end)."""
        w = min(j.width, len(r.lanes))
        taken = [heapq.heappop(r.lanes) for _ in range(w)]  # ascending free times
        first_free, _, last = taken[0]
        if first_free > ready:  # waited for the resource: the job before it on that lane
            start, j.pred, j.gap = first_free, last, (0.0, "")
        else:
            start, j.pred, j.gap = ready, *self._from(j)
        # Water-filling: use the k earliest lanes such that all k end at the same time.
        starts = [max(ready, f) for f, _, _ in taken]
        used, acc, end = 1, starts[0], starts[0] + j.duration
        for k in range(2, w + 1):
            acc += starts[k - 1]
            t = (j.duration + acc) / k
            if t <= starts[k - 1]:
                break
            used, end = k, t
        for i, (f, lane, prev) in enumerate(taken):
            heapq.heappush(r.lanes, (end, lane, j) if i < used else (f, lane, prev))
        r.busy += j.duration
        return start, end

    @staticmethod
    def _from(j: _Job) -> tuple[_Job | None, tuple[float, str]]:
        if j.ready_from is None:
            return None, (0.0, "")
        dep, delay, label = j.ready_from
        return dep, (delay, label)


def _critical_path(last: _Job) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Seconds per stage along the chain of jobs that held ``last`` up, and the chain
    itself compressed to consecutive (stage, node) steps."""
    by_stage: dict[str, float] = {}
    steps: list[dict[str, Any]] = []

    def add(stage: str, node: str, seconds: float) -> None:
        if seconds <= 0:
            return
        by_stage[stage] = by_stage.get(stage, 0.0) + seconds
        # Runs of one stage merge (segments of a pipeline alternate between nodes).
        if steps and steps[-1]["stage"] == stage:
            steps[-1]["s"] += seconds
            if node not in steps[-1]["nodes"]:
                steps[-1]["nodes"].append(node)
        else:
            steps.append({"stage": stage, "nodes": [node], "s": seconds})

    chain: list[_Job] = []
    j: _Job | None = last
    while j is not None:
        chain.append(j)
        j = j.pred
    for j in reversed(chain):
        if j.gap[0] > 0:
            add(j.gap[1], j.node, j.gap[0])
        elapsed = j.end - j.start  # less than the duration when spread over lanes
        if j.parts and j.duration > 0:
            for stage, seconds in j.parts.items():
                add(stage, j.node, seconds * elapsed / j.duration)
        else:
            add(j.stage, j.node, elapsed)
    return by_stage, steps


# ---------------------------------------------------------------- the model


@dataclasses.dataclass
class _Node:
    name: str
    kind: str  # origin, relay, local-relay, subscriber
    region: int
    parent: _Node | None
    link: Link | None  # from the parent
    wan: bool = False
    children: list[_Node] = dataclasses.field(default_factory=list)


def _nodes(t: Topology) -> list[_Node]:
    origin = _Node("origin", "origin", 0, None, None)
    heads = [origin]
    fanout = t.region_fanout or max(1, t.regions - 1)
    for r in range(1, t.regions):
        parent = heads[(r - 1) // fanout]
        heads.append(_Node(f"relay-r{r}", "relay", r, parent, t.wan, wan=True))
    out = list(heads)
    for r, head in enumerate(heads):
        subs = t.subscribers_per_region if r or t.origin_subscribers is None else t.origin_subscribers
        feeders = [head]
        if t.local_relays and subs:
            feeders = [_Node(f"local-relay-r{r}.{i}", "local-relay", r, head, t.lan) for i in range(t.local_relays)]
            out += feeders
        for i in range(subs):
            out.append(_Node(f"subscriber-r{r}.{i}", "subscriber", r, feeders[i % len(feeders)], t.lan))
    for n in out:
        if n.parent is not None:
            n.parent.children.append(n)
    return out


def _segments(model: ModelLayout, chunk_bytes: int, max_segments: int) -> list[tuple[int, float, float]]:
    """The version as ``(chunks, raw bytes, encoded share)`` segments of consecutive
    chunks, about equal in raw bytes, at most ``max_segments`` (chunks are never split).
    The encoded share is the raw bytes weighted by their density: the segment's encoded
    bytes are it times the delta fraction."""
    runs = list(model.chunk_runs(chunk_bytes))
    target = model.raw_bytes / max_segments
    segs: list[tuple[int, float, float]] = []
    n_acc, raw_acc, enc_acc = 0, 0.0, 0.0
    for count, size, density in runs:
        left = count
        while left:
            # Whole chunks of this run that still fit the current segment (at least one).
            room = max(1, int((target - raw_acc) // size)) if raw_acc < target else 0
            take = min(left, room)
            if take == 0:
                segs.append((n_acc, raw_acc, enc_acc))
                n_acc, raw_acc, enc_acc = 0, 0.0, 0.0
                continue
            n_acc += take
            raw_acc += take * size
            enc_acc += take * size * density
            left -= take
            if raw_acc >= target * (1 - 1e-9):
                segs.append((n_acc, raw_acc, enc_acc))
                n_acc, raw_acc, enc_acc = 0, 0.0, 0.0
    if n_acc:
        segs.append((n_acc, raw_acc, enc_acc))
    return segs


def simulate(config: SimConfig) -> dict[str, Any]:
    """Runs one version through the topology; returns a JSON-ready report (seconds from
    the moment the origin holds the raw weights of the new version)."""
    c, t, rates = config, config.topology, config.rates
    pipelined = c.mode == "pipelined"
    nodes = _nodes(t)
    segs = _segments(c.model, c.chunk_bytes, c.max_segments)
    f = rates.delta_fraction
    raw_total = float(c.model.raw_bytes)
    enc_total = f * sum(share for _, _, share in segs)  # raw_total * f when the densities average 1
    chunks_total = sum(n for n, _, _ in segs)
    # Current: the manifest (every chunk's reference, every tensor's description) goes
    # ahead of the chunks on every hop. Pipelined: only the tensors' descriptions (known
    # before encoding), each chunk's reference travels with it.
    ref_bytes = rates.manifest_chunk_bytes
    manifest_total = c.model.tensors * rates.manifest_tensor_bytes + (0.0 if pipelined else chunks_total * ref_bytes)
    g = _Graph()

    message_bytes = c.message_bytes or (4 * MIB if pipelined else CURRENT_MESSAGE_BYTES)

    def receive_costs(n_chunks: int, msgs: int) -> dict[str, float]:
        """A receiver's event-loop work for ``n_chunks`` chunks in ``msgs`` messages."""
        if pipelined:
            return {"receive (per message)": msgs * rates.message_overhead_s}
        # The GIL-held part of decoding runs one chunk at a time, as the loop's work does.
        out = {"receive (per chunk)": n_chunks * rates.receive_chunk_s, "decode (per chunk, GIL)": n_chunks * rates.decode_chunk_s}
        if c.single_process:
            out["contention (per chunk)"] = n_chunks * rates.message_overhead_s
        return out

    def messages(n_chunks: int, enc: float) -> int:
        # Consecutive chunks held are coalesced; a chunk larger than a message goes alone.
        return max(1, min(n_chunks, math.ceil(enc / message_bytes)))

    # Resources per node. Current: one event loop per process; the codec work of the
    # origin's tensors on all its cores; decoding on all cores (the subscriber's default).
    decode_lanes = c.cores
    shared_loop = _Resource("loop", 1) if c.single_process else None
    # One process: every subscriber's decode threads share the machine's cores.
    shared_cpu = _Resource("cpu", c.cores) if c.single_process else None
    loop: dict[str, _Resource] = {}
    cpu: dict[str, _Resource] = {}
    nic: dict[str, _Resource] = {}
    wire: dict[str, _Resource] = {}
    for n in nodes:
        loop[n.name] = shared_loop or _Resource(f"{n.name}.loop", c.cores if pipelined else 1)
        # One process (validation): every receiver's decoding shares the machine's cores,
        # the relay's too (its decode threads run at nice 10, but decoding the same chunks
        # at the same time as the subscriber, measured, takes as long for both).
        cpu[n.name] = shared_cpu or _Resource(f"{n.name}.cpu", decode_lanes)
        nic[n.name] = _Resource(f"{n.name}.nic", 1)
        if n.wan:
            wire[n.name] = _Resource(f"{n.parent.name}->{n.name}", 1)  # type: ignore[union-attr]
    nic_rate = t.nic_bytes_s or t.lan.bandwidth_bytes_s

    # The origin: which job makes segment k available to send.
    have: dict[str, list[_Job]] = {}
    # Current: the origin's process encodes a version's tensors on one thread per core
    # (``--encode-threads``); pipelined: the trainer's hosts encode their own shards.
    encode_cpu = _Resource("origin.encode", (c.origin_cores or c.cores) if pipelined else c.cores)
    if pipelined:
        have["origin"] = [
            # The weights hash moves by the encoder's changes (as the subscriber's
            # decoder already does): no full pass over the weights.
            g.job(
                "encode",
                "origin",
                encode_cpu,
                0.0,
                {
                    "encode": raw / rates.encode_bytes_s,
                    "sha256": share * f / rates.sha256_bytes_s,
                },
                width=n_chunks,
            )
            for n_chunks, raw, share in segs
        ]
    elif c.rank_encode:
        # A sharded trainer's ranks encode their parts on the trainer's cores
        # (parts.PartEncoder) and send the chunks; the origin decodes each part in place into
        # the buffers of the version before (versions.Spare: brought to the base by replaying
        # its changes, no copy) on all its cores, the chunks' Python one at a time under its
        # process's GIL, and checks the part hashes from the element-hash sums moved by the
        # changes (no pass).
        ranks = _Resource("trainer.encode", c.origin_cores or c.cores)
        at_ranks = g.job("encode", "trainer", ranks, 0.0, {"encode": raw_total / rates.encode_bytes_s}, width=c.model.tensors)
        upload = g.job("NIC", "origin", nic["origin"], enc_total / nic_rate, after=(at_ranks,))
        gil = g.job("decode", "origin", loop["origin"], 0.0, {"decode (per chunk, GIL)": chunks_total * rates.decode_chunk_s}, after=(upload,))
        decoded = g.job(
            "decode", "origin", encode_cpu, 0.0,
            {"decode": raw_total / rates.decode_bytes_s, "sha256": enc_total / rates.sha256_bytes_s}, after=(upload,), width=c.model.tensors,
        )  # fmt: skip
        whole = g.job("persist", "origin", None, enc_total / rates.persist_bytes_s, after=(gil, decoded))
        have["origin"] = [whole] * len(segs)
    else:
        encoded = g.job(
            "encode",
            "origin",
            encode_cpu,
            0.0,
            {
                # The weights hash moves by the encoder's changes (versions.Carried): no
                # pass of its own since the store carries the element-hash sums. Each
                # tensor's chunks are hashed on the thread that encoded them.
                "encode": raw_total / rates.encode_bytes_s,
                "sha256": enc_total / rates.sha256_bytes_s,
            },
            width=c.model.tensors,
        )
        # The store writes and fsyncs the chunks one after another, then announces.
        whole = g.job("persist", "origin", None, enc_total / rates.persist_bytes_s, after=(encoded,))
        have["origin"] = [whole] * len(segs)
    available = have["origin"][-1] if not pipelined else None
    manifest_at: dict[str, _Job] = {"origin": available or g.job("manifest", "origin", None, 0.0)}

    served: dict[str, _Job] = {}
    complete: dict[str, _Job] = {}
    first_chunk: dict[str, _Job] = {}
    # Parents before children (the node list is built top-down).
    for n in nodes:
        if n.parent is None:
            continue
        p, link = n.parent, n.link
        assert link is not None
        rate = link.bandwidth_bytes_s if pipelined else link.rate
        hop = f"{p.name}->{n.name}"
        # The manifest takes the path the chunks take after it: the sender's NIC, then the link.
        sent = g.job("NIC", p.name, nic[p.name], manifest_total / nic_rate, after=(manifest_at[p.name],))
        if n.wan:
            sent = g.job("WAN transfer (manifest)", hop, wire[n.name], manifest_total / rate, after=(sent,))
        elif rate < nic_rate:
            sent = g.job("LAN transfer (manifest)", hop, None, manifest_total / rate - manifest_total / nic_rate, after=(sent,))
        manifest_at[n.name] = g.job("manifest", n.name, None, 0.0)
        g.edge(sent, manifest_at[n.name], link.latency_s, "WAN latency" if n.wan else "LAN latency")
        prev_send = None
        prev_recv: _Job | None = manifest_at[n.name]
        prev_wire: _Job | None = sent
        recvs: list[_Job] = []
        decodes: list[_Job] = []
        applies: list[_Job] = []
        for k, (n_chunks, raw, share) in enumerate(segs):
            enc = share * f
            on_wire = enc + (n_chunks * ref_bytes if pipelined else 0.0)
            msgs = messages(n_chunks, enc)
            send = g.job(
                "send",
                p.name,
                loop[p.name],
                0.0,
                {
                    "send (per chunk)": n_chunks * rates.send_chunk_s,
                    "send (per message)": msgs * rates.send_message_s,
                    "send (per byte)": enc * rates.send_byte_s,
                    **({"contention (per chunk)": n_chunks * rates.message_overhead_s} if c.single_process else {}),
                },
                after=(have[p.name][k], prev_send),
                width=msgs,
            )
            out = g.job("NIC", p.name, nic[p.name], on_wire / nic_rate, after=(send,))
            if n.wan and c.single_process:
                # The in-process link emulator (validation runs): it reads the next piece
                # only once the link is free, on the same event loop as everything else.
                read = g.job("link emulator (per piece)", p.name, loop[p.name], n_chunks * rates.message_overhead_s, after=(out, prev_wire))
                out = prev_wire = g.job("WAN transfer", hop, wire[n.name], on_wire / rate, after=(read,))
            elif n.wan:
                out = prev_wire = g.job("WAN transfer", hop, wire[n.name], on_wire / rate, after=(out, prev_wire))
            elif rate < nic_rate:  # a LAN slower than the NIC (or a small window)
                out = g.job("LAN transfer", hop, None, on_wire / rate - on_wire / nic_rate, after=(out, prev_wire))
            recv = g.job(
                "receive",
                n.name,
                loop[n.name],
                0.0,
                {
                    **receive_costs(n_chunks, msgs),
                    "sha256": enc / rates.sha256_bytes_s,
                },
                after=(prev_recv,),
                width=msgs,
            )
            g.edge(out, recv, link.latency_s, "WAN latency" if n.wan else "LAN latency")
            # Relays apply in place too (server._mirror_upstream), like subscribers.
            # A verifying receiver hashes each tensor as its last chunk is decoded
            # (``Decoder``): the signed content check runs alongside the decoding.
            dec_parts = {"decode": raw / rates.decode_bytes_s, **({"content sha256": raw / rates.sha256_bytes_s} if c.signed else {})}
            dec = g.job("decode", n.name, cpu[n.name], 0.0, dec_parts, after=(recv,), width=n_chunks)
            recvs.append(recv)
            decodes.append(dec)
            if pipelined and n.kind == "subscriber" and rates.engine_apply_bytes_s:
                applies.append(g.job("engine apply", n.name, cpu[n.name], raw / rates.engine_apply_bytes_s, after=(dec,), width=n_chunks))
            prev_send, prev_recv = send, recv
        first_chunk[n.name] = recvs[0]
        # A relay passes chunks on once they arrived and passed their checksum.
        have[n.name] = recvs
        held = g.job(
            "verify version", n.name, loop[n.name], 0.0, {"version (per tensor)": c.model.tensors * rates.version_tensor_s}, after=decodes + recvs[-1:]
        )
        if n.kind != "subscriber" and c.signed:
            # A verifying relay holds the version's last chunk back until the version
            # passed that check and is stored.
            complete[n.name] = g.job("persist", n.name, None, enc_total / rates.persist_bytes_s, after=(held,))
            have[n.name] = [*recvs[:-1], complete[n.name]]
        elif n.kind == "subscriber":
            if rates.engine_apply_bytes_s and not pipelined:
                held = g.job("engine apply", n.name, None, raw_total / rates.engine_apply_bytes_s, after=(held,))
            elif applies:
                held = g.job("engine apply", n.name, None, 0.0, after=[held, *applies])
            served[n.name] = held
        else:
            complete[n.name] = g.job("persist", n.name, None, enc_total / rates.persist_bytes_s, after=(held,))

    g.run()
    last = max(served.values(), key=lambda j: j.end)
    by_stage, steps = _critical_path(last)
    total = last.end
    start_s = available.end if available is not None else 0.0
    regions = []
    for r in range(t.regions):
        subs = [served[n.name].end for n in nodes if n.kind == "subscriber" and n.region == r]
        head = next(n for n in nodes if n.region == r and n.kind in ("origin", "relay"))
        regions.append(
            {
                "region": r,
                "head": head.name,
                "subscribers": len(subs),
                "first_chunk_at_head_s": first_chunk[head.name].end if head.name in first_chunk else None,
                "head_complete_s": complete[head.name].end if head.name in complete else None,
                "first_served_s": min(subs) if subs else None,
                "all_served_s": max(subs) if subs else None,
            }
        )
    wan_links = [n for n in nodes if n.wan]
    lan_links = [n for n in nodes if n.parent is not None and not n.wan]
    per_day = DAY_S / c.version_interval_s
    wire_total = enc_total + manifest_total + (chunks_total * ref_bytes if pipelined else 0.0)  # what each link carries
    wan_depth = max((_wan_depth(n) for n in nodes), default=0)
    # What the links alone allow: the bytes through the slowest link once, plus every
    # latency on the deepest path (cut-through relays).
    wan_rate = t.wan.bandwidth_bytes_s if pipelined else t.wan.rate
    bound = enc_total / wan_rate + t.wan.latency_s * wan_depth if wan_depth else enc_total / t.lan.rate + t.lan.latency_s
    busiest = max(
        (r for r in {id(x): x for x in [*loop.values(), *cpu.values(), *nic.values(), *wire.values(), encode_cpu]}.values()),
        key=lambda r: r.busy / len(r.lanes),
    )
    return {
        "mode": c.mode,
        "model": {
            "name": c.model.name,
            "params": c.model.params,
            "tensors": c.model.tensors,
            "raw_bytes": int(raw_total),
            "encoded_bytes": int(enc_total),
            "manifest_bytes": int(wire_total - enc_total),
            "chunks": chunks_total,
            "segments": len(segs),
            "chunk_mib": c.chunk_bytes / MIB,
        },
        "topology": {
            "regions": t.regions,
            "subscribers": t.subscriber_count,
            "relays": len(wan_links),
            "local_relays": sum(n.kind == "local-relay" for n in nodes),
            "wan_gbit_s": t.wan.bandwidth_bytes_s / GBIT_S,
            "wan_latency_ms": t.wan.latency_s * 1e3,
            "wan_rate_gbit_s": t.wan.rate / GBIT_S,
            "lan_gbit_s": t.lan.bandwidth_bytes_s / GBIT_S,
            "cores_per_node": c.cores,
            "origin_cores": c.origin_cores or c.cores,
            "single_process": c.single_process,
            "signed": c.signed,
        },
        "served_everywhere_s": total,
        "available_at_origin_s": start_s,
        "propagation_s": total - start_s,
        "link_bound_s": bound,
        "regions": regions,
        "where_the_time_goes": {k: v for k, v in sorted(by_stage.items(), key=lambda kv: -kv[1])},
        "critical_path": [{**s, "s": round(s["s"], 6)} for s in steps[:MAX_PATH_STEPS]],
        "busiest_resource": {"name": busiest.name, "busy_s": busiest.busy / len(busiest.lanes), "lanes": len(busiest.lanes)},
        "bytes_per_day": {
            "version_interval_s": c.version_interval_s,
            "per_wan_link": wire_total * per_day if wan_links else 0.0,
            "per_lan_link": wire_total * per_day if lan_links else 0.0,
            "origin_egress": wire_total * per_day * len(nodes[0].children),
            "wan_links": len(wan_links),
            "lan_links": len(lan_links),
            "wan_utilisation": (wire_total / t.wan.rate) / c.version_interval_s if wan_links else 0.0,
            "keeps_up": total - start_s <= c.version_interval_s,
        },
        "rates_source": rates.source,
    }


def _wan_depth(n: _Node) -> int:
    depth = 0
    while n.parent is not None:
        depth += n.wan
        n = n.parent
    return depth


# ---------------------------------------------------------------- figures and sweeps

#: The frontier case of the targets: a 1T-parameter version served in four regions over
#: 10 Gbit/s links. Latency: the worst of the planned 20-150 ms. Four subscribers per
#: region. Relays and subscribers: 128 cores (a 1T replica spans at least two 8-GPU
#: hosts, each decoding its own shard). The trainer is sharded over 16 hosts of 64 cores,
#: which encode their own parts (1024 cores; the origin decodes them). The service's flags
#: sized for a model this large: 32 MiB chunks (``--chunk-mb 32``: 70,000 chunks, not
#: 490,000, each with its per-chunk costs on every hop), 1 MiB messages (``--message-kib
#: 1024``), and in each region two relays under the head that feed two subscribers each
#: (a three-level tree: no node's event loop sends the version more than four times).
FRONTIER = {
    "params": "1t", "regions": 4, "wan_gbit_s": 10.0, "latency_ms": 150.0, "subscribers_per_region": 4, "cores": 128, "origin_cores": 1024,
    "rank_encode": True, "chunk_mib": 32.0, "message_kib": 1024, "local_relays": 2,
}  # fmt: skip
#: The same with the service's default flags, for comparison: the origin encodes (a sharded
#: publish sent raw), 4 MiB chunks, 64 KiB messages, each region's head feeds its subscribers.
FRONTIER_DEFAULTS = {"rank_encode": False, "chunk_mib": 4.0, "message_kib": 64, "local_relays": 0}
FRONTIER_TARGET_S = 15.0


def frontier_config(mode: str, rates: CodecRates = DEFAULT_RATES, **changes: Any) -> SimConfig:
    """The frontier case as a :class:`SimConfig` (``changes``: keys of :data:`FRONTIER`)."""
    unknown = set(changes) - set(FRONTIER)
    if unknown:
        raise SimulationError(f"unknown frontier parameters {sorted(unknown)}; known: {sorted(FRONTIER)}")
    p = {**FRONTIER, **changes}
    topology = Topology(
        regions=p["regions"], subscribers_per_region=p["subscribers_per_region"], wan=Link.gbit(p["wan_gbit_s"], p["latency_ms"]),
        local_relays=p["local_relays"],
    )  # fmt: skip
    return SimConfig(
        model_layout(p["params"]), topology, rates, mode=mode, cores=p["cores"], origin_cores=p["origin_cores"], max_segments=128,
        chunk_bytes=int(p["chunk_mib"] * MIB), message_bytes=int(p["message_kib"]) << 10, rank_encode=p["rank_encode"] and mode == "current",
    )  # fmt: skip


def _cores_for(target_s: float, rates: CodecRates, which: str) -> int | None:
    """The fewest ``which`` (``cores`` or ``origin_cores``, the other as in
    :data:`FRONTIER`; up to 2**16) with which the pipelined frontier case meets
    ``target_s``; None if no count does (something else is the limit)."""

    def meets(cores: int) -> bool:
        # 64 segments: within ~1 % of the reported figure at a quarter of the cost.
        config = dataclasses.replace(frontier_config("pipelined", rates, **{which: cores}), max_segments=64)
        return simulate(config)["served_everywhere_s"] <= target_s

    lo, hi = 0, None
    for k in range(17):
        if meets(2**k):
            hi = 2**k
            break
        lo = 2**k
    if hi is None:
        return None
    while hi - lo > max(1, hi // 32):  # to within ~3 %
        mid = (lo + hi) // 2
        if meets(mid):
            hi = mid
        else:
            lo = mid
    return hi


def frontier_figures(rates: CodecRates | Mapping[str, Any] | None = None, search_cores: bool = True) -> dict[str, Any]:
    """The simulated frontier figures for the bench: ``t_1t_4regions_10gbit_s`` is the
    current implementation, ``..._pipelined`` the pipelined design; ``rates`` a
    :class:`CodecRates`, a ``meridian bench weightsync --json`` result (its codec figures
    are used) or None (:data:`DEFAULT_RATES`). ``search_cores`` also finds the cores the
    pipelined design needs for the target (about twenty more simulations, seconds)."""
    if rates is None:
        rates = DEFAULT_RATES
    elif not isinstance(rates, CodecRates):
        rates = rates_from_bench(rates)
    out: dict[str, Any] = {"case": dict(FRONTIER), "target_s": FRONTIER_TARGET_S, "rates": dataclasses.asdict(rates)}
    for mode in MODES:
        r = simulate(frontier_config(mode, rates))
        out[mode] = {
            "served_everywhere_s": r["served_everywhere_s"],
            "propagation_s": r["propagation_s"],
            "link_bound_s": r["link_bound_s"],
            "encoded_bytes": r["model"]["encoded_bytes"],
            "where_the_time_goes": r["where_the_time_goes"],
            "wan_bytes_per_day_at_1_per_min": r["bytes_per_day"]["per_wan_link"],
        }
    # The same with signed versions (``meridian up``'s default): every receiver also
    # hashes the decoded weights once per version.
    signed = simulate(dataclasses.replace(frontier_config("current", rates), signed=True))
    out["current_signed"] = {"served_everywhere_s": signed["served_everywhere_s"], "where_the_time_goes": signed["where_the_time_goes"]}
    defaults = simulate(frontier_config("current", rates, **FRONTIER_DEFAULTS))
    out["current_default_flags"] = {
        "flags": dict(FRONTIER_DEFAULTS), "served_everywhere_s": defaults["served_everywhere_s"], "where_the_time_goes": defaults["where_the_time_goes"],
    }  # fmt: skip
    out["t_1t_4regions_10gbit_s"] = out["current"]["served_everywhere_s"]
    out["t_1t_4regions_10gbit_s_signed"] = signed["served_everywhere_s"]
    out["t_1t_4regions_10gbit_s_default_flags"] = defaults["served_everywhere_s"]
    out["t_1t_4regions_10gbit_s_pipelined"] = out["pipelined"]["served_everywhere_s"]
    if search_cores:
        # What the pipelined design needs to meet the target, one kind of node at a time
        # (None: no count of that kind does; the other is the limit).
        out["pipelined_origin_cores_for_target"] = _cores_for(FRONTIER_TARGET_S, rates, "origin_cores")
        out["pipelined_subscriber_cores_for_target"] = _cores_for(FRONTIER_TARGET_S, rates, "cores")
    return out


SWEEP = {"params": ("135m", "1b", "8b", "70b", "405b", "1t"), "regions": (1, 2, 3, 4), "wan_gbit_s": (1.0, 10.0), "latency_ms": (20.0, 150.0)}


def sweep_rows(base: SimConfig, modes: Sequence[str] = MODES) -> Iterator[dict[str, Any]]:
    """One compact row per point of :data:`SWEEP` and mode; everything else from ``base``."""
    for size in SWEEP["params"]:
        model = model_layout(size)
        for regions in SWEEP["regions"]:
            for gbit in SWEEP["wan_gbit_s"]:
                for latency in SWEEP["latency_ms"]:
                    topology = dataclasses.replace(base.topology, regions=regions, wan=dataclasses.replace(base.topology.wan, **_link_fields(gbit, latency)))
                    for mode in modes:
                        r = simulate(dataclasses.replace(base, model=model, topology=topology, mode=mode))
                        top = next(iter(r["where_the_time_goes"].items()), ("", 0.0))
                        yield {
                            "params": size,
                            "mode": mode,
                            "regions": regions,
                            "wan_gbit_s": gbit,
                            "latency_ms": latency,
                            "subscribers": r["topology"]["subscribers"],
                            "served_everywhere_s": r["served_everywhere_s"],
                            "propagation_s": r["propagation_s"],
                            "link_bound_s": r["link_bound_s"],
                            "encoded_bytes": r["model"]["encoded_bytes"],
                            "largest_stage": top[0],
                            "largest_stage_s": top[1],
                            "wan_bytes_per_day": r["bytes_per_day"]["per_wan_link"],
                            "keeps_up": r["bytes_per_day"]["keeps_up"],
                        }


def _link_fields(gbit: float, latency_ms: float) -> dict[str, float]:
    link = Link.gbit(gbit, latency_ms)
    return {"bandwidth_bytes_s": link.bandwidth_bytes_s, "latency_s": link.latency_s}


# ---------------------------------------------------------------- command line


def main(argv: Sequence[str]) -> int:
    """``meridian simulate weightsync [flags]``: prints the report as JSON (``--sweep``:
    one JSON row per line)."""
    import argparse
    import json
    import sys

    parser = argparse.ArgumentParser(
        prog="meridian simulate weightsync",
        description="Discrete-event model of one weight version going origin -> relays -> subscribers. "
        "Seconds count from the origin holding the raw weights. Modes: current (the code as it is; 'serial' is an alias) "
        "and pipelined (the design target). Always prints JSON.",
    )
    parser.add_argument("--params", default="1t", help=f"model size: a preset ({', '.join(PRESETS)}) or a count like 3b, 2.5e9 (default 1t)")
    parser.add_argument("--regions", type=int, default=4, help="regions, the origin's included (default 4)")
    parser.add_argument("--subscribers", type=int, default=4, help="subscribers (rollouts) per region (default 4)")
    parser.add_argument("--origin-subscribers", type=int, default=None, help="subscribers in the origin's region (default: --subscribers)")
    parser.add_argument("--link-gbit", type=float, default=10.0, help="inter-region link, Gbit/s per direction (default 10)")
    parser.add_argument("--latency-ms", type=float, default=50.0, help="inter-region one-way latency, ms (default 50)")
    parser.add_argument("--window-kib", type=float, default=None, help="flow-control window of the inter-region links, KiB (default: never limits)")
    parser.add_argument("--lan-gbit", type=float, default=100.0, help="in-region link and NIC, Gbit/s (default 100)")
    parser.add_argument("--lan-latency-ms", type=float, default=0.1, help="in-region one-way latency, ms (default 0.1)")
    parser.add_argument("--region-fanout", type=int, default=None, help="relays each node feeds across regions (default: all from the origin)")
    parser.add_argument("--local-relays", type=int, default=0, help="relays under each region's head that feed its subscribers (default 0)")
    parser.add_argument("--cores", type=int, default=64, help="cores of each relay and subscriber (default 64)")
    parser.add_argument(
        "--origin-cores", type=int, default=None, help="cores that encode: the trainer's, with --rank-encode or in pipelined mode (default: --cores)"
    )
    parser.add_argument(
        "--rank-encode", action="store_true", help="current mode: a sharded trainer whose ranks encode their parts (the origin decodes them)"
    )
    parser.add_argument("--chunk-mb", type=float, default=4.0, help="largest raw chunk, MiB, as the service's --chunk-mb (default 4)")
    parser.add_argument("--message-mb", type=float, default=None, help="encoded bytes coalesced per message, MiB (default: 1/16 in current mode, the service's --message-kib; 4 in pipelined mode)")
    parser.add_argument("--mode", choices=["current", "serial", "pipelined", "both"], default="both", help="which model (default both)")
    parser.add_argument("--version-every-s", type=float, default=60.0, help="one version per this many seconds, for bytes per day (default 60)")
    parser.add_argument("--rates-from", default=None, help="a `meridian bench weightsync --json` output: take its codec rates and delta size")
    parser.add_argument("--delta-pct", type=float, default=None, help="encoded delta, %% of full bf16 (overrides)")
    parser.add_argument("--encode-gbps", type=float, default=None, help="encode GB/s per core, raw bytes (overrides)")
    parser.add_argument("--decode-gbps", type=float, default=None, help="in-place decode GB/s per core, raw bytes (overrides)")
    parser.add_argument("--message-overhead-us", type=float, default=None, help="event-loop cost of one message per side, us (overrides)")
    parser.add_argument("--engine-apply-gbps", type=float, default=None, help="engine apply, raw-equivalent GB/s per subscriber (default: not modelled)")
    parser.add_argument(
        "--max-segments", type=int, default=None, help="simulate a version as at most this many segments of chunks (default 256; 64 with --sweep)"
    )
    parser.add_argument("--signed", action="store_true", help="receivers verify signed versions: each also hashes the decoded weights (the signed content digest)")
    parser.add_argument("--sweep", action="store_true", help="sizes 135m..1t x 1-4 regions x 1/10 Gbit/s x 20/150 ms; one JSON row per line")
    parser.add_argument("--frontier", action="store_true", help="the frontier figures (1T, 4 regions, 10 Gbit/s) for both modes")
    parser.add_argument("--json", action="store_true", help="accepted for symmetry with the benches; the output is always JSON")
    ns = parser.parse_args(list(argv))
    try:
        rates = DEFAULT_RATES
        if ns.rates_from:
            try:
                with open(ns.rates_from, encoding="utf-8") as fh:
                    rates = rates_from_bench(json.load(fh))
            except (OSError, json.JSONDecodeError) as exc:
                raise SimulationError(f"--rates-from {ns.rates_from}: {exc}") from None
        overrides = {
            "delta_fraction": None if ns.delta_pct is None else ns.delta_pct / 100,
            "encode_bytes_s": None if ns.encode_gbps is None else ns.encode_gbps * 1e9,
            "decode_bytes_s": None if ns.decode_gbps is None else ns.decode_gbps * 1e9,
            "message_overhead_s": None if ns.message_overhead_us is None else ns.message_overhead_us * 1e-6,
            "engine_apply_bytes_s": None if ns.engine_apply_gbps is None else ns.engine_apply_gbps * 1e9,
        }
        overrides = {k: v for k, v in overrides.items() if v is not None}
        if overrides:
            rates = rates.replace(**overrides, source=f"{rates.source}; overridden on the command line: {', '.join(sorted(overrides))}")
        if ns.frontier:
            print(json.dumps(frontier_figures(rates)))
            return 0
        window = None if ns.window_kib is None else ns.window_kib * 1024
        topology = Topology(
            regions=ns.regions,
            subscribers_per_region=ns.subscribers,
            origin_subscribers=ns.origin_subscribers,
            wan=Link.gbit(ns.link_gbit, ns.latency_ms, window),
            lan=Link.gbit(ns.lan_gbit, ns.lan_latency_ms),
            region_fanout=ns.region_fanout,
            local_relays=ns.local_relays,
        )
        modes = list(MODES) if ns.mode == "both" else ["current" if ns.mode == "serial" else ns.mode]
        base = SimConfig(
            model_layout(ns.params),
            topology,
            rates,
            mode=modes[0],
            cores=ns.cores,
            origin_cores=ns.origin_cores,
            chunk_bytes=_mib(ns.chunk_mb, "--chunk-mb"),
            message_bytes=None if ns.message_mb is None else _mib(ns.message_mb, "--message-mb"),
            signed=ns.signed,
            rank_encode=ns.rank_encode,
            version_interval_s=ns.version_every_s,
            max_segments=ns.max_segments or (64 if ns.sweep else 256),
        )
        if ns.sweep:
            for row in sweep_rows(base, modes):
                print(json.dumps(row), flush=True)
            return 0
        reports = {mode: simulate(dataclasses.replace(base, mode=mode)) for mode in modes}
    except SimulationError as exc:
        parser.error(str(exc))
    print(json.dumps(reports[modes[0]] if len(modes) == 1 else reports))
    sys.stdout.flush()
    return 0


def _mib(value: float, flag: str) -> int:
    if not (math.isfinite(value) and value > 0):
        raise SimulationError(f"{flag} must be > 0, got {value}")
    return max(BF16_BYTES, int(value * MIB))
