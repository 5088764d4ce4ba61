"""``python -m loadtest.envoy_latency`` runs all three variants for real and reports sane figures.

A tiny run (one round, one second per variant, 50 requests/s) through real Envoys, sidecars,
redis-server and the sample app. Nothing about speed is asserted: only that the table has every
variant, that every request was answered 200 (the load stays under every limit) and that the
figures are consistent.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.support.tools import run_tool

pytestmark = [pytest.mark.envoy, pytest.mark.redis]


@pytest.mark.slow
def test_envoy_latency_reports_every_variant(tmp_path: Path) -> None:
    report = tmp_path / "latency.json"
    argv = ["--rate", "50", "--duration", "1", "--warmup", "0.5", "--rounds", "1", "--json", str(report)]
    result, output = run_tool("envoy_latency", argv, timeout=150)
    assert result.returncode == 0, output

    table = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| variant (50 req/s, median of 1 rounds x 1 s) | requests | 200 | 429 |"), output
    labels = [row.split(" | ")[0].removeprefix("| ") for row in table[1:]]
    assert labels == [
        "(a) Envoy, no rate-limit filter",
        "(b) Envoy + filter + sidecar (memory)",
        "(c) Envoy + filter + sidecar (sync, Redis)",
    ], output
    assert "Reproduce: `python -m loadtest.envoy_latency --rate 50.0 --duration 1.0 --warmup 0.5" in result.stdout

    document = json.loads(report.read_text())
    summary = document["summary"]
    assert set(summary) == {"no_filter", "memory", "sync_redis"}, output
    for variant, row in summary.items():
        assert row["sent"] == 50, (variant, row)
        assert row["statuses"] == {"200": 50} and row["errors"] == {}, (variant, row)
        assert 0 < row["p50_ms"] <= row["p90_ms"] <= row["p99_ms"] <= row["max_ms"] < 2000, (variant, row)
        assert row["connections"] >= 1, (variant, row)
        assert row["server_cpu_us_per_request"] is not None and row["server_cpu_us_per_request"] > 0, (variant, row)
    assert summary["no_filter"]["added_p50_ms"] is None
    for variant in ("memory", "sync_redis"):
        for key in ("added_p50_ms", "added_p90_ms", "added_p99_ms"):
            value = summary[variant][key]
            assert value is not None and math.isfinite(value) and abs(value) < 2000, (variant, key, value)
    assert len(document["runs"]) == 3
