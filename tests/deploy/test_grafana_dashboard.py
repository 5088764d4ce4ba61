"""The Grafana dashboard only queries metrics the sidecar exports, with labels they carry."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from sidecar.metrics import LimiterSnapshot, RuleStats, ServiceStats, SidecarCollector, render

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "ratelimit-sidecar.json"
METRIC_NAME = re.compile(r"\b((?:ratelimit|process)_[a-z_]+)")
GROUPING = re.compile(r"by \(([^)]*)\)")
PROMQL_LABELS = {"le", "job", "instance"}
"""Added by Prometheus (job, instance) or by histograms (le)."""


def exported(snapshot: LimiterSnapshot) -> dict[str, set[str]]:
    """Every series name a Redis-backed sidecar exports, with its label names."""
    stats = ServiceStats(rules=RuleStats())
    stats.rules.record(stats.rules.row("d.k", "d"), 1, False, shadow=False, count=1, limit=2)
    stats.error("internal")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SidecarCollector(stats, lambda: snapshot))
    names: dict[str, set[str]] = {"process_resident_memory_bytes": set()}
    for family in text_string_to_metric_families(render(registry).decode()):
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(sample.labels)
    return names


def expressions() -> list[str]:
    document = json.loads(DASHBOARD.read_text())
    found = [target["expr"] for panel in document["panels"] for target in panel["targets"]]
    found += [variable["query"] for variable in document["templating"]["list"] if variable["type"] == "query"]
    return found


def test_every_queried_metric_is_exported_with_the_grouped_labels(redis_snapshot: LimiterSnapshot) -> None:
    names = exported(redis_snapshot)
    queries = expressions()
    assert len(queries) >= 15
    for query in queries:
        used = METRIC_NAME.findall(query)
        assert used, query
        for name in used:
            assert name in names, f"{name} is not exported (query: {query})"
        for grouping in GROUPING.findall(query):
            for label in (part.strip() for part in grouping.split(",")):
                carriers = [name for name in used if label in names[name]]
                assert label in PROMQL_LABELS or carriers, f"no metric in {query!r} has label {label!r}"


def test_panels_do_not_overlap() -> None:
    document = json.loads(DASHBOARD.read_text())
    cells: set[tuple[int, int]] = set()
    for panel in document["panels"]:
        grid = panel["gridPos"]
        mine = {(grid["x"] + dx, grid["y"] + dy) for dx in range(grid["w"]) for dy in range(grid["h"])}
        assert not mine & cells, panel["title"]
        assert grid["x"] + grid["w"] <= 24
        cells |= mine
