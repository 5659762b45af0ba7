"""The Grafana dashboard in infra/grafana/ as data: its PromQL queries, the metric names they read, and the names a
Prometheus text exposition (a live /metrics) declares. Shared by tests/infra/test_grafana.py (offline) and
tests/e2e/test_grafana_live.py (against a running stack)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import promql_parser
from prometheus_client.parser import text_string_to_metric_families

DASHBOARD = Path(__file__).resolve().parents[2] / "infra" / "grafana" / "tinkerflow.json"

# Grafana's built-in interval variables stand for a duration; any duration parses the same way.
_GRAFANA_DURATION = re.compile(r"\$(__rate_interval|__interval|__range)\b|\$\{(__rate_interval|__interval|__range)\}")
# What Prometheus stores besides a family's own name: a counter's samples end in _total (prometheus_client's parser
# gives the family without it), a histogram's in _bucket/_sum/_count; prometheus_client adds _created to both.
_SERIES_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "gauge": ("",),
    "info": ("_info",),
}


@dataclass(frozen=True)
class Query:
    panel: str
    ref_id: str
    expr: str


def load(path: Path = DASHBOARD) -> dict:
    return json.loads(path.read_text())


def panels(dashboard: dict) -> Iterator[dict]:
    """Every panel, the ones inside collapsed rows included."""
    for p in dashboard.get("panels", []):
        yield p
        yield from p.get("panels", [])


def queries(dashboard: dict) -> list[Query]:
    return [
        Query(p.get("title", ""), t.get("refId", ""), t["expr"])
        for p in panels(dashboard)
        for t in p.get("targets", [])
        if "expr" in t
    ]


def parse(expr: str):
    """The PromQL AST of a dashboard expression, Grafana's interval variables replaced by a duration."""
    return promql_parser.parse(_GRAFANA_DURATION.sub("5m", expr))


def metric_names(expr: str) -> set[str]:
    """Every metric name an expression selects: `name{...}` or `{__name__="name"}` (a regex __name__ matcher is
    refused: the test could not say which series it reads)."""
    names: set[str] = set()

    def visit(node) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            if node.name:
                names.add(node.name)
            for m in node.matchers.matchers:
                if m.name == "__name__":
                    if m.op != promql_parser.MatchOp.Equal:
                        raise ValueError(f"{expr!r}: a __name__ matcher other than = reads unknown series")
                    names.add(m.value)

    promql_parser.walk(parse(expr), pre_visit=visit)
    return names


def exported_names(exposition: str) -> set[str]:
    """The series names a Prometheus text exposition declares (its # TYPE lines, expanded by type, and its samples):
    a labelled family appears there before its first sample, so a query on it is answerable once work happens."""
    names: set[str] = set()
    for family in text_string_to_metric_families(exposition):
        names.update(family.name + suffix for suffix in _SERIES_SUFFIXES.get(family.type, ("",)))
        names.update(s.name for s in family.samples)
    return names


def missing_report(dashboard: dict, exported: set[str]) -> dict[str, list[str]]:
    """{metric name the dashboard queries but nobody exports: [panels that query it]}."""
    missing: dict[str, list[str]] = {}
    for q in queries(dashboard):
        for name in sorted(metric_names(q.expr) - exported):
            missing.setdefault(name, []).append(f"{q.panel} ({q.ref_id})")
    return missing
