"""Every quota metric a doc names is one the quota service exposes, spelled as exposed
(counters with ``_total``): an operator copies the name into a query or an alert."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sidecar.quota.partition import PartitionCounts
from sidecar.quota.stats import Gauges, QuotaStats
from tests.docs.docs_support import pages

QUOTA_METRIC = re.compile(r"\bratelimit_sidecar_quota_[a-z0-9_]+")


def exposed_quota_metrics() -> set[str]:
    """The sample names the quota service's families expose: ``name_total`` for a counter."""
    names = set()
    gauges = Gauges(
        live_buckets=0, open_streams=0, report_lag_seconds=0.0, partition=PartitionCounts("deny", 0, 0, 0, 0, 0)
    )
    for family in QuotaStats().families(lambda: gauges):
        names.add(family.name + "_total" if family.type == "counter" else family.name)
    return names


@pytest.mark.parametrize("page", pages(), ids=lambda page: page.name)
def test_quota_metric_names_in_the_docs_are_exposed(page: Path) -> None:
    exposed = exposed_quota_metrics()
    text = page.read_text()
    unknown = sorted(
        f"line {text.count(chr(10), 0, found.start()) + 1}: {found.group()}"
        for found in QUOTA_METRIC.finditer(text)
        if found.group() not in exposed
    )
    assert unknown == [], f"not exposed (counters end in _total): {unknown}"
