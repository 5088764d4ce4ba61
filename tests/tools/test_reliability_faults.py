"""The reliability harness's fault scenarios, quick size: Redis and replica faults under load.

Runs ``loadtest/reliability_harness/faults.py`` in this process: two real sidecar
processes per configuration (sync mode with each ``--redis-failure-mode``, strict mode)
on one real redis-server behind a fault-injecting TCP proxy, continuous gRPC load, and
every fault mid-load (Redis killed and restarted, paused, stalled past the background
timeout, slow, unreachable), then a replica SIGKILLed. It checks what the rows promise:

* every call answered, and the sidecars' decision times measured (their p99 against
  Envoy's 25 ms deadline is a goal the report shows, not asserted here: a loaded machine
  misses it by itself);
* after recovery, Redis holds every hit the replicas admitted (``hits_lost`` 0); only
  faults that cut connections may leave hits counted twice (documented ambiguity);
* the SIGKILLed replica's loss is at most what it admitted in its last two sync
  intervals, and the survivor kept its limits.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.redis, pytest.mark.slow, pytest.mark.serial, pytest.mark.timeout(420)]


def faults_module() -> Any:
    """``loadtest.reliability_harness.faults``, imported when a test needs it."""
    from loadtest.reliability_harness import faults

    return faults


def explain(row: Any) -> str:
    return f"{row.area} / {row.scenario}: {row.notes}\nfigures: {row.figures}"


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Any]]:
    if not Path("/usr/bin/redis-server").exists() and shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    faults = faults_module()
    from loadtest.reliability_harness import Context

    yield faults.run(Context(tmp_path_factory.mktemp("faults"), quick=True))


def test_every_configuration_meets_every_fault(rows: list[Any]) -> None:
    faults = faults_module()
    expected = {
        faults.row_name(mode, failure, fault) for mode, failure in faults.CONFIGURATIONS for fault in faults.FAULTS
    }
    seen = {row.scenario for row in rows}
    assert expected <= seen, f"missing rows: {sorted(expected - seen)}; got {sorted(seen)}"


def test_every_call_is_answered_and_redis_holds_every_admitted_hit(rows: list[Any]) -> None:
    checked = [row for row in rows if "replica SIGKILLed" not in row.scenario]
    assert checked
    for row in checked:
        assert row.ok is True, explain(row)
        assert row.hits_lost == 0, explain(row)
        figures = row.figures
        for name in ("p99_ms", "max_ms", "server_p99_bucket_ms", "calls_during_fault", "hits_admitted", "redis_hits"):
            assert name in figures, explain(row)
        assert figures["errors"] == 0, explain(row)
        assert figures["calls_during_fault"] > 0 and figures["hits_admitted"] > 0, explain(row)
        assert figures["server_p99_bucket_ms"] > 0, explain(row)
        assert figures["hits_lost_at_drain"] == 0, explain(row)


def test_a_killed_replica_loses_at_most_its_unflushed_hits(rows: list[Any]) -> None:
    row = next(row for row in rows if "replica SIGKILLed" in row.scenario)
    assert row.ok is True, explain(row)
    assert row.hits_lost is not None, explain(row)
    assert 0 <= row.hits_lost <= row.figures["loss_bound"], explain(row)
    assert row.figures["victim_hits_admitted"] > 0 and row.figures["survivor_calls_after_kill"] > 0, explain(row)
