"""The reliability harness's fault scenarios, smoke size: Redis and replica faults under load.

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

The smoke size (``Context.smoke``) keeps every configuration and every fault, shortens the
phases around them and lets the four configurations' pairs meet each fault side by side, each
at a quarter of the rate (``fault_phases.Timing``: the machine carries the load of one
configuration, the near limits scale with the rate; the replica kill keeps the full rate);
the report's figures come from ``python -m loadtest.reliability --quick`` or full runs, one
configuration at a time.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


def real_run(test: Any) -> Any:
    """The marks of a test on the harness's rows: real processes, a fault timeline at 400 req/s on two
    replicas (alone: on one core the replicas, Redis and the load slip their sync intervals)."""
    for mark in (pytest.mark.redis, pytest.mark.slow, pytest.mark.alone, pytest.mark.timeout(420)):
        test = mark(test)
    return test


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

    yield faults.run(Context(tmp_path_factory.mktemp("faults"), quick=True, smoke=True))


@real_run
def test_every_configuration_meets_every_fault(rows: list[Any]) -> None:
    faults = faults_module()
    expected = {
        faults.row_name(mode, failure, fault) for mode, failure in faults.CONFIGURATIONS for fault in faults.FAULTS
    }
    seen = {row.scenario for row in rows}
    assert expected <= seen, f"missing rows: {sorted(expected - seen)}; got {sorted(seen)}"


@real_run
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


@real_run
def test_a_killed_replica_loses_at_most_its_unflushed_hits(rows: list[Any]) -> None:
    row = next(row for row in rows if "replica SIGKILLed" in row.scenario)
    assert row.ok is True, explain(row)
    assert row.hits_lost is not None, explain(row)
    assert 0 <= row.hits_lost <= row.figures["loss_bound"], explain(row)
    assert row.figures["victim_hits_admitted"] > 0 and row.figures["survivor_calls_after_kill"] > 0, explain(row)


def test_a_near_counter_may_fall_short_only_by_the_hits_the_kill_cut() -> None:
    counter = faults_module().NearCounter
    short = counter("near_b", limit=53, admitted=52, offered=90, lost=0)
    assert short.problems(cut_hits=1) == []  # the victim counted a hit whose answer the kill cut
    assert short.problems(cut_hits=0) == [
        "near_b: only 52 admitted of a limit of 53 (offered more; 0 hits in calls the kill cut)"
    ]
    assert counter("near_b", limit=53, admitted=40, offered=90, lost=0).problems(cut_hits=1)
    assert (
        counter("near_a", limit=13, admitted=5, offered=20, lost=0).problems(cut_hits=0) == []
    )  # offered < limit + 10
    # Above: the limit, sync mode's bound (floor(5 % of 53) = 2 with two replicas) and what was lost.
    assert counter("near_b", limit=53, admitted=56, offered=90, lost=1).problems(cut_hits=0) == []
    assert counter("near_b", limit=53, admitted=57, offered=90, lost=1).problems(cut_hits=9) == [
        "near_b: 57 admitted > limit 53 + bound 2 + lost"
    ]
