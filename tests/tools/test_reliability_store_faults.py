"""The ``store-faults`` reliability area (issue 31) in its quick size, and its pieces.

The quick size runs two rows, strict mode only, on a real 6-node Redis Cluster (3 masters
with a replica each) and two real sidecars: the hot key's master SIGKILLed, and the hot
key's slot held in migration. Figures (stalls, the hot key against its bound, hits lost,
failure-mode decisions, recovery times) are the report's business, printed as goals; this
checks what must hold and what the rows promise to measure: every call answered (none
fails but by its 25 ms deadline, every probe call with a 5 s deadline answered), both
sidecars serving after the fault, a promotion seen, keys migrated, the write probe
acknowledged.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest.reliability import AREAS, table
from loadtest.reliability_harness import Context, store_faults, store_rows
from loadtest.reliability_harness.store_rows import Run, Traffic, recovery, split_decisions
from loadtest.reliability_harness.store_topology import Fault, Keys, store_events
from loadtest.reliability_harness.support import OK, CounterNames, Row

MEASURED = (
    "calls",
    "answered",
    "late_calls",
    "stall_ms",
    "hot_max_window",
    "hot_bound",
    "spread_lost_failed_shard",
    "spread_lost_healthy_shards",
    "spread_doubled",
    "replication_acknowledged",
    "replication_lost",
    "promotion_s",
    "redis_decided_again_s",
    "failure_decisions",
    "calls_failed_shard",
    "calls_healthy_shards",
    "healthy_decisions_at_least",
    "store_marked_down",
    "healthy_masters_marked_down",
)


def explain(row: Row) -> str:
    return f"{row.scenario}: {row.notes}\nfigures: {row.figures}"


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Row]]:
    if not Path("/usr/bin/redis-server").exists() and shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    yield store_faults.run(Context(tmp_path_factory.mktemp("store-faults"), quick=True))


@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.redis
@pytest.mark.timeout(300)
def test_every_quick_row_answers_every_call_and_serves_after_the_fault(rows: list[Row]) -> None:
    quick = store_rows.QUICK
    assert [row.scenario for row in rows] == [
        store_rows.row_name(mode, fault) for mode in quick.modes for fault in quick.faults
    ]
    for row in rows:
        figures = row.figures
        assert figures, explain(row)
        for name in MEASURED:
            assert name in figures, (name, explain(row))
        assert row.ok is True, explain(row)
        assert figures["errors"] == 0 and figures["probe_errors"] == 0, explain(row)
        assert figures["serving_after"] == 1, explain(row)
        assert figures["calls"] > 0 and figures["probe_calls"] > 0, explain(row)
        assert figures["answered"] + figures["late_calls"] == figures["calls"], explain(row)
        assert figures["replication_acknowledged"] > 0, explain(row)
        assert figures["promotion_s"] >= 0, f"the heir never served the slot: {explain(row)}"
        assert figures["hot_bound"] == store_rows.BOUNDS["strict"]
    migration = next(row for row in rows if "migration" in row.scenario)
    assert "keys MIGRATEd" in migration.notes, explain(migration)
    assert "| store faults | strict mode: Cluster" in table(rows)


def test_the_area_is_in_the_report() -> None:
    assert AREAS["store-faults"] == store_faults.__name__


def test_the_slot_keys_share_the_hot_keys_slot(tmp_path: Path) -> None:
    (tmp_path / "store.yaml").write_text(store_rows.CONFIG)
    keys = Keys.choose(CounterNames(tmp_path, store_rows.DOMAIN), 3, seed=7)
    traffic = Traffic(keys, "t", 1, with_slot_keys=True)
    in_slot = [payload for payload, slot in enumerate(traffic.slots) if slot == keys.slot]
    assert len(keys.slot_values) == 3 and 0 in in_slot and len(in_slot) >= 4
    without = Traffic(keys, "t", 1, with_slot_keys=False)
    assert len(without.spread) == store_rows.SPREAD_KEYS


def synthetic_run(tmp_path: Path) -> Run:
    """Calls at 0.1 s steps for 2 s; the fault at 1.0 s; sidecar 1 reports Redis down from
    1.1 to 1.4 s, and 40 failure-mode decisions are added meanwhile."""
    (tmp_path / "store.yaml").write_text(store_rows.CONFIG)
    keys = Keys.choose(CounterNames(tmp_path, store_rows.DOMAIN), 1, seed=3)
    run = Run(Traffic(keys, "t", 1, with_slot_keys=False), Fault.__new__(Fault))
    for step in range(20):
        run.calls.add(step % 2, 1 + step % 5, step / 10, 0.001, OK)
        decided = 40.0 if step >= 15 else 0.0
        run.samples.append((step / 10, decided, {'reason="redis_down"': decided}, (True, True)))
        if 11 <= step < 15:
            decided = float((step - 10) * 10)
            run.samples[-1] = (step / 10, decided, {'reason="redis_down"': decided}, (True, False))
    run.marks["fault"] = 1.0
    return run


def test_healthy_shard_decisions_are_bounded_below_by_what_the_metrics_show(tmp_path: Path) -> None:
    run = synthetic_run(tmp_path)
    # Payload 1 is "on the failed shard": 2 of the 10 calls after the fault.
    split = split_decisions(run, failed={1})
    assert split["calls_failed_shard"] == 2 and split["calls_healthy_shards"] == 8
    assert split["healthy_calls_while_marked_down"] == 2  # sidecar 1's calls at 1.1 and 1.3 s
    assert split["failure_decisions"] == split["failure_decisions_redis_down"] == 40
    assert split["healthy_decisions_at_least"] == 40 - 2
    run.samples[-1] = (1.9, 60.0, {'reason="redis_down"': 40.0, 'reason="deadline"': 20.0}, (True, True))
    again = split_decisions(run, failed={1})
    assert again["failure_decisions"] == 60 and again["healthy_decisions_at_least"] == 40 - 2, "deadline ones aside"
    assert recovery(run) == pytest.approx(0.4)
    run.samples[12] = (1.2, 20.0, {'reason="deadline"': 20.0}, (True, True))
    assert recovery(run) == pytest.approx(0.4), "a lone sample up again is not recovery"


def test_only_masters_the_fault_did_not_touch_count_as_healthy_ones_marked_down(tmp_path: Path) -> None:
    log = tmp_path / "sidecar.log"
    log.write_text('{"event": "redis_node_unavailable", "node": "127.0.0.1:1"}\n')
    offset = log.stat().st_size
    lines = [
        {"event": "redis_node_unavailable", "node": "127.0.0.1:1"},
        {"event": "redis_node_unavailable", "node": "127.0.0.1:2"},
        {"event": "redis_unavailable", "reason": "ConnectionError"},
        {"event": "redis_recovered"},
    ]
    with log.open("a") as handle:
        handle.write("\n".join(json.dumps(line) for line in lines) + "\nnot json\n")
    kill = Fault.__new__(Fault)
    kill.name, kill.victim = "cluster_kill", 1
    assert store_events([log], [offset], kill) == {"store_marked_down": 1, "healthy_masters_marked_down": 1}
    migration = Fault.__new__(Fault)
    migration.name, migration.victim = "slot_migration", 1
    assert store_events([log], [offset], migration)["healthy_masters_marked_down"] == 2


def test_drive_connects_even_when_the_calls_deadline_is_shorter_than_a_connection() -> None:
    """The rows' calls carry Envoy's 25 ms deadline; connecting a channel on a busy machine can take
    longer. ``drive`` once waited for its channels with the calls' deadline and raised TimeoutError,
    failing a whole row; now the connection gets its own time and the calls their deadline."""
    import asyncio

    import grpc

    from loadtest.reliability_harness.support import METHOD, Calls, drive

    async def scenario() -> Calls:
        server = grpc.aio.server()
        service, name = METHOD.rsplit("/", 2)[1:]
        handler = grpc.unary_unary_rpc_method_handler(lambda request, context: b"\x08\x01")
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(service, {name: handler})])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        calls = Calls()
        try:
            await drive([f"127.0.0.1:{port}"], [b""], lambda: (0, 0), calls, seconds=0.3, lanes=1, timeout=1e-6)
        finally:
            await server.stop(None)
        return calls

    calls = asyncio.run(scenario())
    assert len(calls) > 0, "no call was sent"
    assert set(calls.errors.values()) == {"DEADLINE_EXCEEDED"}, calls.errors
