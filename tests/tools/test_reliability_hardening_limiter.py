"""``loadtest.reliability_harness.hardening_limiter``: the issue 21 attacks on the limiter hold.

Runs the area at its smoke size (real sidecars and redis-server; smaller floods than quick) and checks every row held
with the figures it reports: at most 105 of 100 hits for a repeated descriptor across two
sync replicas, live counters at the cap and flat call times for a unique-value flood
during an outage, and 50 of 50 hits in Redis after a SIGTERM during a short outage.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytestmark = [pytest.mark.redis, pytest.mark.slow, pytest.mark.timeout(300)]


def test_every_attack_row_holds(tmp_path: Path) -> None:
    if not Path("/usr/bin/redis-server").exists() and shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    from loadtest.reliability_harness import Context
    from loadtest.reliability_harness.hardening_limiter import BOUND, OUTAGE_HITS, SYNC_CAP, run

    rows = run(Context(tmp_path, quick=True, smoke=True))
    assert [row.ok for row in rows] == [True] * 5, [(row.scenario, row.notes) for row in rows]
    repeats, sync_flood, strict_flood, *shutdowns = rows
    assert max(repeats.figures["admitted_64x1"], repeats.figures["admitted_19x5"]) <= BOUND
    assert sync_flood.figures["counters"] <= SYNC_CAP
    assert strict_flood.figures["last_ms"] <= max(3 * strict_flood.figures["first_ms"], 10)
    for row in shutdowns:
        assert row.hits_lost == 0
        assert row.figures["redis"] == OUTAGE_HITS
