"""The span edges a trajectory's life must show in its traces, listed in one place, the
check that finds them in received spans, and a text rendering of one trajectory's trace.

An *edge* is a dependency between two parts of the stack as spans record it. Every
service names its spans' resource ``meridian-<service>`` (:func:`meridian.telemetry.setup_tracing`)
and two kinds of evidence exist:

``rpc``
    A gRPC call: the caller's CLIENT span (named by the method, ``/meridian.v1.<Service>/<Method>``,
    by the gRPC instrumentation) has, in the same trace, a child SERVER span of the same name in
    the callee's service (the server interceptor continues the context the client sent). A
    server span whose parent id is not the client span's id is no evidence.
``link``
    A hand-off through stored data, where the receiver starts its own span linked to the
    sender's context instead of becoming its child: the caller's span carries a span link that
    resolves to a received span of the named kind. Redis carries trajectories this way (each
    trajectory holds its episode span's ``traceparent``), and so does a weight version (its
    manifest holds the ``traceparent`` of the trainer step that published it). A link-edge may
    also *require* another edge: the linked span must then be directly related to that edge's
    evidence (the evidence's caller span is its child, or links to it), so that e.g. the trainer
    counts as reading from Redis only when it links an episode that rollout wrote to Redis.

:data:`EXPECTED_EDGES` lists them; :func:`check_edges` reports each one's evidence (or its
absence) in a list of spans, optionally restricted to one trajectory
(:func:`trajectory_spans`: the trace of its episode, plus every span linked to a span already
included, plus their descendants); :func:`render_trajectory` prints that set as an indented tree.

The span records only need the fields of :class:`SpanRecord` (the test OTLP receiver's records
have them); ``kind`` is the OTLP span kind's name without its prefix (``CLIENT``, ``SERVER``,
``PRODUCER``, ...), or ``""`` when unknown, in which case kinds are not checked.
"""
from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Sequence
from typing import Protocol

RPC = "rpc"
LINK = "link"

SpanKey = tuple[str, str]  # (trace_id, span_id), lowercase hex


class SpanRecord(Protocol):
    """What the check reads of a received span."""

    @property
    def service(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def trace_id(self) -> str: ...
    @property
    def span_id(self) -> str: ...
    @property
    def parent_span_id(self) -> str: ...
    @property
    def links(self) -> tuple[tuple[str, str], ...]: ...
    @property
    def kind(self) -> str: ...
    @property
    def start_unix_ns(self) -> int: ...
    @property
    def end_unix_ns(self) -> int: ...


@dataclasses.dataclass(frozen=True)
class Edge:
    """One expected edge.

    ``rpc``: ``caller_span`` is a method name prefix; the callee side is the SERVER span of the
    same name in ``callee_service``. ``link``: ``caller_span`` is the exact name of the span that
    carries the link, ``callee_span`` the exact name of the span it must resolve to (in
    ``callee_service``), ``caller_kind`` the caller span's kind when it must have one, and
    ``requires`` the label of the edge the linked span must be directly related to.
    ``per_trajectory``: the edge belongs to each trajectory's life (checked inside
    :func:`trajectory_spans` when a trajectory is given); otherwise it is a standing edge (a
    long-lived stream) checked over all spans.
    """

    caller: str
    callee: str
    how: str
    caller_service: str
    caller_span: str
    callee_service: str
    callee_span: str = ""
    caller_kind: str = ""
    requires: str = ""
    per_trajectory: bool = True
    doc: str = ""

    @property
    def label(self) -> str:
        return f"{self.caller} → {self.callee}"


EXPECTED_EDGES: tuple[Edge, ...] = (
    Edge(
        "rollout", "envsandbox", RPC, "meridian-rollout", "/meridian.v1.EnvSandbox/", "meridian-envsandbox",
        doc="an episode's sandbox calls (GetTask, Create, Fork, Exec, WriteFiles, RunTests, Close) under the episode's trace",
    ),
    Edge(
        "rollout", "Redis", LINK, "meridian-rollout", "rollout.publish_group", "meridian-rollout", "rollout.episode", caller_kind="PRODUCER",
        doc="the XADD of a group: a PRODUCER span (messaging.system redis) linked to the episode span of every trajectory it wrote",
    ),
    Edge(
        "trainer", "Redis", LINK, "meridian-trainer", "trainer.step", "meridian-rollout", "rollout.episode", requires="rollout → Redis",
        doc="the step trained on groups read from the stream: trainer.step links to the episode contexts inside the entries, "
        "counted only for an episode that a rollout → Redis span wrote",
    ),
    Edge(
        "trainer", "weightsync", RPC, "meridian-trainer", "/meridian.v1.WeightSync/Publish", "meridian-weightsync",
        doc="the step's new version published to the origin, a child of trainer.step",
    ),
    Edge(
        "rollout", "weightsync", LINK, "meridian-rollout", "rollout.weight_update", "meridian-trainer", "trainer.step", requires="trainer → weightsync",
        doc="a version received over Subscribe and applied: rollout.weight_update links to the trainer step named in the version's manifest, "
        "counted only when that step's Publish reached weightsync",
    ),
    Edge(
        "weightsync relay", "weightsync origin", RPC, "meridian-weightsync", "/meridian.v1.WeightSync/Subscribe", "meridian-weightsync",
        per_trajectory=False,
        doc="a relay's upstream subscription (a weightsync calling a weightsync is a relay); the stream's spans end, and are exported, "
        "when the stream does",
    ),
)


@dataclasses.dataclass(frozen=True)
class Evidence:
    """The two spans that show an edge: the caller's span and the server span (rpc) or the linked span (link)."""

    edge: Edge
    caller: SpanRecord
    callee: SpanRecord


@dataclasses.dataclass(frozen=True)
class EdgeReport:
    """:func:`check_edges`'s answer: every edge's evidence (empty when missing)."""

    evidence: dict[str, list[Evidence]]

    @property
    def present(self) -> list[str]:
        return [label for label, found in self.evidence.items() if found]

    @property
    def missing(self) -> list[str]:
        return [label for label, found in self.evidence.items() if not found]


def _key(span: SpanRecord) -> SpanKey:
    return (span.trace_id, span.span_id)


def _kind_ok(span: SpanRecord, kind: str) -> bool:
    return not kind or not span.kind or span.kind == kind


class _Index:
    """Spans by id, children by parent, linkers by linked span."""

    def __init__(self, spans: Iterable[SpanRecord]) -> None:
        self.spans = list(spans)
        self.by_key: dict[SpanKey, SpanRecord] = {}
        self.children: dict[SpanKey, list[SpanRecord]] = collections.defaultdict(list)
        self.linkers: dict[SpanKey, list[SpanRecord]] = collections.defaultdict(list)
        for s in self.spans:
            self.by_key[_key(s)] = s
            if s.parent_span_id:
                self.children[(s.trace_id, s.parent_span_id)].append(s)
            for link in s.links:
                self.linkers[link].append(s)

    def parent(self, span: SpanRecord) -> SpanRecord | None:
        return self.by_key.get((span.trace_id, span.parent_span_id)) if span.parent_span_id else None


def _related(span: SpanRecord, evidence: Iterable[Evidence]) -> bool:
    """True if some evidence's caller span is a child of ``span`` or links to it."""
    key = _key(span)
    for ev in evidence:
        caller = ev.caller
        if (caller.trace_id, caller.parent_span_id) == key or key in caller.links:
            return True
    return False


def _find(index: _Index, edge: Edge, found: dict[str, list[Evidence]], scope: set[SpanKey] | None) -> list[Evidence]:
    out: list[Evidence] = []
    for s in index.spans:
        if s.service != edge.caller_service or (scope is not None and _key(s) not in scope):
            continue
        if edge.how == RPC:
            if not s.name.startswith(edge.caller_span) or not _kind_ok(s, "CLIENT"):
                continue
            out += [
                Evidence(edge, s, c)
                for c in index.children.get(_key(s), [])
                if c.service == edge.callee_service and c.name == s.name and _kind_ok(c, "SERVER")
            ]
        elif edge.how == LINK:
            if s.name != edge.caller_span or not _kind_ok(s, edge.caller_kind):
                continue
            for link in s.links:
                target = index.by_key.get(link)
                if target is None or target.service != edge.callee_service or target.name != edge.callee_span:
                    continue
                if edge.requires and not _related(target, found.get(edge.requires, [])):
                    continue
                out.append(Evidence(edge, s, target))
        else:
            raise ValueError(f"edge {edge.label}: unknown kind of evidence {edge.how!r}")
    return out


def trajectory_spans(spans: Iterable[SpanRecord], trace_id: str) -> set[SpanKey]:
    """One trajectory's life: every span of its episode's trace ``trace_id``, then, repeatedly,
    every span that links to a span already in the set and every child of one in it."""
    index = _Index(spans)
    members = {_key(s) for s in index.spans if s.trace_id == trace_id}
    frontier = list(members)
    while frontier:
        key = frontier.pop()
        for nxt in (*index.children.get(key, ()), *index.linkers.get(key, ())):
            k = _key(nxt)
            if k not in members:
                members.add(k)
                frontier.append(k)
    return members


def check_edges(spans: Iterable[SpanRecord], trace_id: str = "", edges: Sequence[Edge] = EXPECTED_EDGES) -> EdgeReport:
    """Which of ``edges`` the spans show. With ``trace_id`` (a trajectory's episode trace),
    per-trajectory edges count only inside :func:`trajectory_spans`; standing edges anywhere.
    Edges are checked in order, so a ``requires`` must come earlier in ``edges``."""
    spans = list(spans)
    index = _Index(spans)
    scope = trajectory_spans(spans, trace_id) if trace_id else None
    found: dict[str, list[Evidence]] = {}
    for edge in edges:
        found[edge.label] = _find(index, edge, found, scope if edge.per_trajectory else None)
    return EdgeReport(found)


def _short(service: str) -> str:
    return service.removeprefix("meridian-")


def render_trajectory(spans: Iterable[SpanRecord], trace_id: str, focus_span_id: str = "") -> str:
    """One trajectory's life (:func:`trajectory_spans`) as an indented tree: span name, service
    (and span kind unless internal) and duration per line, children by start time. A span linked to spans of the tree (and
    not their child) hangs under the one it links to, marked ``⇢``. With ``focus_span_id``
    (the trajectory's episode span) other spans of the same name -- the group's other
    trajectories -- are shown as one line each, without their children."""
    spans = list(spans)
    index = _Index(spans)
    members = trajectory_spans(spans, trace_id)
    focus = index.by_key.get((trace_id, focus_span_id)) if focus_span_id else None
    placed_under: dict[SpanKey, list[SpanRecord]] = collections.defaultdict(list)
    roots: list[SpanRecord] = []
    for key in members:
        s = index.by_key[key]
        parent = index.parent(s)
        if parent is not None and _key(parent) in members:
            placed_under[_key(parent)].append(s)
            continue
        anchors = [index.by_key[k] for k in s.links if k in members and k != key]
        if anchors:
            preferred = [a for a in anchors if focus is not None and _key(a) == _key(focus)]
            anchor = (preferred or sorted(anchors, key=lambda a: a.start_unix_ns))[0]
            placed_under[_key(anchor)].append(s)
        else:
            roots.append(s)

    rows: list[tuple[str, str, float]] = []

    def subtree_size(s: SpanRecord) -> int:
        return 1 + sum(subtree_size(c) for c in placed_under.get(_key(s), []))

    def walk(s: SpanRecord, depth: int, via_link: bool) -> None:
        label = ("⇢ " if via_link else "") + s.name
        ms = max(0, s.end_unix_ns - s.start_unix_ns) / 1e6
        collapsed = focus is not None and s.name == focus.name and _key(s) != _key(focus)
        if collapsed:
            label += f"  (another trajectory of the group, {subtree_size(s) - 1} spans below)"
        kind = s.kind.lower() if s.kind and s.kind != "INTERNAL" else ""
        rows.append(("  " * depth + label, f"{_short(s.service)} {kind}".rstrip(), ms))
        if collapsed:
            return
        for c in sorted(placed_under.get(_key(s), []), key=lambda c: (c.start_unix_ns, c.name)):
            walk(c, depth + 1, c.trace_id != s.trace_id or c.parent_span_id != s.span_id)

    for r in sorted(roots, key=lambda r: r.start_unix_ns):
        walk(r, 0, False)
    width = max((len(label) for label, _, _ in rows), default=0)
    service_width = max((len(svc) for _, svc, _ in rows), default=0)
    return "\n".join(f"{label.ljust(width)}  {svc.ljust(service_width)}  {ms:9.1f} ms" for label, svc, ms in rows)
