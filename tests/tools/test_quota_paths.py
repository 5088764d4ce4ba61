"""A short run of ``python -m loadtest.quota_paths``: five variants, a table, a plot, all children gone."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.support.tools import run_tool

pytestmark = [
    pytest.mark.slow,
    pytest.mark.envoy,
    pytest.mark.skipif(shutil.which("wrk") is None, reason="no wrk (apt-get install wrk; scripts/bootstrap does)"),
    pytest.mark.skipif(shutil.which("taskset") is None, reason="no taskset (util-linux)"),
]


def test_a_short_run_reports_five_variants_and_plots_them(tmp_path: Path) -> None:
    plot = tmp_path / "paths.png"
    argv = ["--rounds", "1", "--duration", "1", "--warmup", "0", "--connections", "4", "--plot", str(plot)]
    result, output = run_tool("quota_paths", argv, timeout=90)
    assert result.returncode == 0, output
    rows = [line for line in result.stdout.splitlines() if line.startswith("| (")]
    assert [row.split(" | ")[0] for row in rows] == ["| (a) Envoy alone", "| (b) Envoy + local_ratelimit",
                                                       "| (b') Envoy + local_ratelimit, a bucket per client",
                                                       "| (c) Envoy + rate_limit_quota + sidecar",
                                                       "| (d) Envoy + ratelimit filter + sidecar"]  # fmt: skip
    cells = [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]
    assert cells[1][2] == "1.00"  # (b) is the first reference
    assert cells[2][8] == "1.00"  # (b') the second: x (b') of itself
    # Quota mode's ratio to both baselines, in one line each.
    assert "(c) Envoy + rate_limit_quota + sidecar: x (b) one bucket " in output
    assert "; x (b') a bucket per client " in output
    # A quota figure is never given without saying whether the sidecar served the stream.
    assert "quota stream: ANSWERED" in output or "quota stream: NOT answered" in output
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
