"""The reliability harness's load scenarios, smoke size: floods of unique values, the soak, gRPC limits.

Runs ``loadtest/reliability_harness/flood.py`` and ``soak.py`` in this process (real
sidecar processes and redis-server underneath, everything stopped at the end) and
checks the invariants their rows promise:

* floods (memory backend): live counters stop exactly at ``--max-counters``, the rest
  are evicted and counted, RSS stays within the cap's budget, the process serves on;
  with the cap above the flood nothing is evicted;
* floods (sync mode): the cap evicts only counters Redis already holds, so Redis ends
  with exactly the hits the sidecar admitted, also when the cap is passed before any flush;
* soak: 70 % of the measured maximum held open loop without errors, p99 stable, RSS flat;
* gRPC limits: a message over 1 MiB is refused with RESOURCE_EXHAUSTED; more than
  1,000 streams on one connection are queued, not served, and harm nothing.

The smoke size (``Context.smoke``) floods 25,000 values instead of 100,000 and soaks for
9 s instead of 45 s: every cap is still passed many times over, and the checks are the
same; the report's figures come from ``python -m loadtest.reliability --quick`` or full runs.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.redis, pytest.mark.slow, pytest.mark.timeout(300)]


def harness() -> Any:
    """``loadtest.reliability_harness``, imported when a test needs it."""
    from loadtest import reliability_harness

    return reliability_harness


def has_redis() -> bool:
    return Path("/usr/bin/redis-server").exists() or shutil.which("redis-server") is not None


def by_scenario(rows: list[Any], part: str) -> list[Any]:
    found = [row for row in rows if part in row.scenario]
    assert found, f"no row about {part!r} in {[row.scenario for row in rows]}"
    return found


def explain(row: Any) -> str:
    return f"{row.area} / {row.scenario}: {row.notes}\nfigures: {row.figures}"


@pytest.fixture(scope="module")
def flood_rows(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Any]]:
    package = harness()
    from loadtest.reliability_harness import flood

    yield flood.run(package.Context(tmp_path_factory.mktemp("flood"), quick=True, smoke=True))


@pytest.fixture(scope="module")
def soak_rows(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Any]]:
    if not has_redis():
        pytest.skip("redis-server is not installed")
    package = harness()
    from loadtest.reliability_harness import soak

    yield soak.run(package.Context(tmp_path_factory.mktemp("soak"), quick=True, smoke=True))


def test_a_flood_of_unique_values_stops_at_the_memory_cap(flood_rows: list[Any]) -> None:
    rows = by_scenario(flood_rows, "memory")
    for row in rows:
        assert row.ok is True, explain(row)
        figures = row.figures
        for name in ("bytes_per_live_counter", "rss_before_mib", "rss_after_mib", "live_counters", "evictions"):
            assert name in figures, explain(row)
        assert figures["live_counters"] <= figures["max_counters"], explain(row)
        assert figures["bytes_per_live_counter"] > 0, explain(row)
    below, above = by_scenario(rows, "cap below")[0], by_scenario(rows, "cap above")[0]
    assert below.figures["live_counters"] == below.figures["max_counters"], explain(below)
    assert below.figures["evictions"] >= below.figures["values"] - below.figures["max_counters"], explain(below)
    assert above.figures["evictions"] == 0, explain(above)
    assert above.figures["live_counters"] >= above.figures["values"], explain(above)


def test_a_flood_in_sync_mode_evicts_only_what_redis_holds(flood_rows: list[Any]) -> None:
    rows = by_scenario(flood_rows, "sync mode")
    if all(row.ok is None for row in rows):
        pytest.skip(rows[0].notes)
    for row in rows:
        assert row.ok is True, explain(row)
        assert row.hits_lost == 0, explain(row)
        assert row.figures["redis_hits"] == row.figures["admitted_hits"], explain(row)


@pytest.mark.serial  # holds a load near the machine's maximum: other tests' CPU would cut it
def test_the_soak_holds_seventy_percent_of_the_maximum(soak_rows: list[Any]) -> None:
    row = by_scenario(soak_rows, "soak")[0]
    assert row.ok is True, explain(row)
    figures = row.figures
    assert figures["errors"] == 0, explain(row)
    assert figures["achieved_req_per_s"] >= 0.9 * figures["target_req_per_s"] > 0, explain(row)
    for name in ("p99_ms", "p99_first_third_ms", "p99_last_third_ms", "rss_growth_mib", "max_req_per_s"):
        assert name in figures, explain(row)


@pytest.mark.serial  # the soak's rows: one run of them, in the serial phase
def test_the_grpc_server_limits_are_in_effect(soak_rows: list[Any]) -> None:
    oversized = by_scenario(soak_rows, "over 1 MiB")[0]
    assert oversized.ok is True, explain(oversized)
    assert oversized.figures["refused"] == oversized.inputs > 0, explain(oversized)
    streams = by_scenario(soak_rows, "concurrent streams")[0]
    assert streams.ok is True, explain(streams)
    assert streams.figures["served"] == 1000, explain(streams)
