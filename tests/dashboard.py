"""The Grafana dashboard's PromQL, read for tests: every expression of every panel (and
of the template variables) and the metric names each one selects."""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "meridian.json"

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")  # label matchers (strings already removed)
_RANGE = re.compile(r"\[[^\]]*\]")  # range and subquery durations
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset", "atan2", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers that are not functions
    (followed by ``(``), keywords, label names in matchers or groupings, strings,
    durations or Grafana variables (``$region``)."""
    text = _STRING.sub('""', expr)
    text = _MATCHERS.sub("", text)
    text = _RANGE.sub("", text)
    text = _GROUPING.sub("", text)
    text = re.sub(r"\$\{?\w+\}?", "", text)  # Grafana variables, e.g. $__rate_interval
    names = set()
    for m in _IDENT.finditer(text):
        rest = text[m.end():].lstrip()
        if rest.startswith("(") or m.group().lower() in _KEYWORDS:
            continue
        if re.fullmatch(r"\d+[smhdwy]", m.group()) or (m.start() and text[m.start() - 1].isdigit()):
            continue  # a number such as 1e3
        names.add(m.group())
    return names


def load(path: Path = DASHBOARD) -> dict[str, Any]:
    return json.loads(path.read_text())


def _panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in items:
        yield panel
        yield from _panels(panel.get("panels", []))  # a collapsed row holds its panels


def expressions(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every target of every panel and every query variable."""
    for panel in _panels(dashboard.get("panels", [])):
        for target in panel.get("targets", []):
            yield f"panel {panel.get('title')!r} target {target.get('refId')}", target["expr"]
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") == "query":
            query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
            # label_values(metric, label): the first argument selects a metric.
            if m := re.fullmatch(r"\s*label_values\(\s*([^,]+),\s*\w+\s*\)\s*", query):
                yield f"variable {variable['name']!r}", m.group(1)
            else:
                yield f"variable {variable['name']!r}", query


def referenced(dashboard: dict[str, Any]) -> dict[str, set[str]]:
    """Metric name -> where the dashboard uses it."""
    out: dict[str, set[str]] = {}
    for where, expr in expressions(dashboard):
        for name in metric_names(expr):
            out.setdefault(name, set()).add(where)
    return out
