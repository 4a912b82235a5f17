"""The expected span edges (meridian/trace_edges.py) checked on hand-made spans shaped like
the stack's: one trajectory's life, then the same spans with one thing broken."""
from __future__ import annotations

import dataclasses
import itertools

from meridian.trace_edges import EXPECTED_EDGES, check_edges, render_trajectory, trajectory_spans
from tests.integration.otlp_receiver import ReceivedSpan

ALL = [e.label for e in EXPECTED_EDGES]
_ids = itertools.count(1)


def _span(service: str, name: str, trace: str, parent: ReceivedSpan | None = None, kind: str = "INTERNAL",
          links: tuple[ReceivedSpan, ...] = (), start_ms: int = 0, ms: int = 1) -> ReceivedSpan:
    return ReceivedSpan(
        service=f"meridian-{service}", name=name, trace_id=trace, span_id=f"{next(_ids):016x}",
        parent_span_id=parent.span_id if parent else "", links=tuple((s.trace_id, s.span_id) for s in links),
        kind=kind, start_unix_ns=start_ms * 10**6, end_unix_ns=(start_ms + ms) * 10**6,
    )


def _rpc(caller: ReceivedSpan, method: str, callee: str, start_ms: int) -> list[ReceivedSpan]:
    client = _span(caller.service.removeprefix("meridian-"), method, caller.trace_id, caller, "CLIENT", start_ms=start_ms, ms=3)
    return [client, _span(callee, method, caller.trace_id, client, "SERVER", start_ms=start_ms + 1, ms=1)]


def _life(trace: str = "a" * 32, step_trace: str = "b" * 32, update_trace: str = "c" * 32) -> tuple[list[ReceivedSpan], ReceivedSpan]:
    """A group of two trajectories from RunEpisodes to the applied version, and a relay's stream."""
    root = _span("rollout", "/meridian.v1.Rollout/RunEpisodes", trace, kind="SERVER", ms=900)
    spans = [root, *_rpc(root, "/meridian.v1.EnvSandbox/Create", "envsandbox", 5)]
    episodes = []
    for i in range(2):
        ep = _span("rollout", "rollout.episode", trace, root, start_ms=10 + i, ms=500)
        episodes.append(ep)
        spans += [ep, *_rpc(ep, "/meridian.v1.EnvSandbox/RunTests", "envsandbox", 400 + i)]
    publish = _span("rollout", "rollout.publish_group", trace, root, "PRODUCER", tuple(episodes), start_ms=600)
    step = _span("trainer", "trainer.step", step_trace, links=tuple(episodes), start_ms=700, ms=2000)
    encode = _span("weightsync", "weightsync.encode", step_trace, step, start_ms=2800, ms=40)
    update = _span("rollout", "rollout.weight_update", update_trace, links=(step,), start_ms=3000, ms=300)
    relay_client = _span("weightsync", "/meridian.v1.WeightSync/Subscribe", "d" * 32, kind="CLIENT", start_ms=0, ms=5000)
    relay_server = _span("weightsync", "/meridian.v1.WeightSync/Subscribe", "d" * 32, relay_client, "SERVER", start_ms=1, ms=4990)
    spans += [publish, step, *_rpc(step, "/meridian.v1.WeightSync/Publish", "weightsync", 2750), encode, update, relay_client, relay_server]
    return spans, episodes[0]


def _replace(spans: list[ReceivedSpan], match: ReceivedSpan, **changes: object) -> list[ReceivedSpan]:
    return [dataclasses.replace(s, **changes) if s == match else s for s in spans]  # type: ignore[arg-type]


def _first(spans: list[ReceivedSpan], name: str, service: str = "") -> ReceivedSpan:
    return next(s for s in spans if s.name == name and (not service or s.service == f"meridian-{service}"))


def test_every_expected_edge_is_found_in_a_whole_trajectory() -> None:
    spans, episode = _life()
    report = check_edges(spans, episode.trace_id)
    assert report.missing == [] and report.present == ALL
    redis = report.evidence["rollout → Redis"]
    assert {ev.callee.span_id for ev in redis} == {s.span_id for s in spans if s.name == "rollout.episode"}
    (update,) = report.evidence["rollout → weightsync"]
    assert update.callee.name == "trainer.step" and update.caller.name == "rollout.weight_update"


def test_the_edge_list_names_each_required_edge_before_it() -> None:
    labels = [e.label for e in EXPECTED_EDGES]
    assert len(set(labels)) == len(labels)
    for i, edge in enumerate(EXPECTED_EDGES):
        assert not edge.requires or edge.requires in labels[:i], edge.label
        assert edge.doc and edge.how in ("rpc", "link")


def test_a_server_span_of_another_method_is_no_edge() -> None:
    """A CLIENT span's SERVER child must be the same call on the callee's side: a child of
    another name shows some other call (a span the instrumentation mis-parented), not this one."""
    spans, episode = _life()
    for s in [s for s in spans if s.service == "meridian-envsandbox"]:
        spans = _replace(spans, s, name="/meridian.v1.EnvSandbox/Close")
    for s in [s for s in spans if s.name.startswith("/meridian.v1.EnvSandbox/") and s.kind == "CLIENT"]:
        assert s.name != "/meridian.v1.EnvSandbox/Close"
    report = check_edges(spans, episode.trace_id)
    assert report.missing == ["rollout → envsandbox"]


def test_a_server_span_with_a_broken_parent_id_is_no_edge() -> None:
    spans, episode = _life()
    for s in [s for s in spans if s.service == "meridian-envsandbox"]:
        spans = _replace(spans, s, parent_span_id="f" * 16)
    report = check_edges(spans, episode.trace_id)
    assert report.missing == ["rollout → envsandbox"]


def test_a_server_span_in_another_trace_is_no_edge() -> None:
    spans, episode = _life()
    server = _first(spans, "/meridian.v1.WeightSync/Publish", "weightsync")
    spans = _replace(spans, server, trace_id="e" * 32)
    # Without its publish reaching weightsync, the applied version is no evidence either.
    assert check_edges(spans, episode.trace_id).missing == ["trainer → weightsync", "rollout → weightsync"]


def test_span_kinds_are_checked_when_known() -> None:
    spans, episode = _life()
    relay_server = [s for s in spans if s.name.endswith("/Subscribe") and s.kind == "SERVER"][0]
    assert check_edges(_replace(spans, relay_server, kind="CLIENT"), episode.trace_id).missing == ["weightsync relay → weightsync origin"]
    publish = _first(spans, "rollout.publish_group")
    missing = check_edges(_replace(spans, publish, kind="INTERNAL"), episode.trace_id).missing
    assert missing == ["rollout → Redis", "trainer → Redis"]


def test_a_broken_link_loses_the_edges_that_rest_on_it() -> None:
    spans, episode = _life()
    step = _first(spans, "trainer.step")
    broken = _replace(spans, step, links=(("a" * 32, "f" * 16),))
    # The step is no longer part of this trajectory's life, and neither is what hangs on it.
    assert check_edges(broken, episode.trace_id).missing == ["trainer → Redis", "trainer → weightsync", "rollout → weightsync"]
    # Over all spans the publish still happened; the hand-off from Redis did not show.
    assert check_edges(broken).missing == ["trainer → Redis"]
    update = _first(spans, "rollout.weight_update")
    assert check_edges(_replace(spans, update, links=()), episode.trace_id).missing == ["rollout → weightsync"]


def test_the_trainer_reads_from_redis_only_what_rollout_wrote_there() -> None:
    spans, episode = _life()
    spans = [s for s in spans if s.name != "rollout.publish_group"]
    assert check_edges(spans, episode.trace_id).missing == ["rollout → Redis", "trainer → Redis"]


def test_another_trajectory_does_not_stand_in_for_this_one() -> None:
    mine, episode = _life()
    other, _ = _life("1" * 32, "2" * 32, "3" * 32)
    strip = {"rollout.publish_group", "trainer.step", "rollout.weight_update", "/meridian.v1.WeightSync/Publish", "weightsync.encode"}
    spans = [s for s in mine if s.name not in strip] + other
    assert check_edges(spans).missing == []
    assert check_edges(spans, episode.trace_id).missing == ["rollout → Redis", "trainer → Redis", "trainer → weightsync", "rollout → weightsync"]


def test_a_trajectory_is_its_trace_plus_what_links_to_it() -> None:
    spans, episode = _life()
    life = trajectory_spans(spans, episode.trace_id)
    names = {s.name for s in spans if (s.trace_id, s.span_id) in life}
    assert "trainer.step" in names and "weightsync.encode" in names and "rollout.weight_update" in names
    assert "/meridian.v1.WeightSync/Subscribe" not in names


def test_render_shows_one_trajectory_as_a_tree() -> None:
    spans, episode = _life()
    text = render_trajectory(spans, episode.trace_id, episode.span_id)
    lines = text.splitlines()
    assert lines[0].startswith("/meridian.v1.Rollout/RunEpisodes") and lines[0].endswith("900.0 ms")
    step = next(i for i, line in enumerate(lines) if "⇢ trainer.step" in line)
    assert lines[step].startswith("    ⇢ trainer.step") and "trainer" in lines[step]
    assert any(line.startswith("      ⇢ rollout.weight_update") for line in lines)
    assert any(line.startswith("        /meridian.v1.WeightSync/Publish") and " weightsync " in line for line in lines)
    assert sum("another trajectory of the group, 2 spans below" in line for line in lines) == 1
    assert "Subscribe" not in text
