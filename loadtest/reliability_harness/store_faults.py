"""Faults of the distributed store under load (issue 31): Cluster and Sentinel failovers, a slot in migration.

Two real sidecars (``--redis-failure-mode local``, ``--redis-timeout 0.02``, windows on
the local clock) share a real store on 127.0.0.1 (``store_topology.py``) and get an
Envoy-like load: every call carries a 25 ms gRPC deadline; 200 calls/s on one "hot" key
limited to 100/s and 100 calls/s spread over 300 keys far under their (daily) limits,
plus a probe of 40 calls/s with a 5 s deadline on other spread keys. Rows, each in sync
and strict mode:

1. ``cluster_kill``: a 6-node Cluster (3 masters + 1 replica each, node timeout 2 s),
   the master holding the hot key SIGKILLed (started again after the row: it rejoins
   as a replica);
2. ``cluster_failover``: ``CLUSTER FAILOVER`` on that master's replica;
3. ``slot_migration``: the hot key's slot IMPORTING/MIGRATING between two masters, one
   key MIGRATEd, held so for 3 s under load, then the rest moved and the slot given to
   the target; a few spread keys are chosen in that slot;
4. ``sentinel_kill``: a master, a replica and 3 Sentinels (quorum 2), the master
   SIGKILLed; the sidecars use ``redis+sentinel://`` with the three Sentinels.

Per row: calls answered (of sent); the probe's max latency (the longest stall); the hot
key's admitted hits per second window against the documented bound (``docs/redis.md``:
sync ``L + (R-1)·Q`` = 105, strict with ``local`` within the limit, 100); the spread keys'
hits lost or doubled, by shard, against what asynchronous replication lost (a writer
INCRs a key in the hot key's slot 100 times a second: acknowledged minus held); the
promotion time and the time until the failure mode stopped deciding (sampled
``/metrics``); and the failure-mode decisions during the fault (``/metrics`` counts them
by reason only, so the split by shard is a lower bound for healthy shards: decisions
beyond the calls that went to the failed shard's keys).

A row FAILS only on what must hold: no call ends in an error other than its 25 ms
deadline, every probe call (5 s deadline) is answered, and both sidecars serve after
the fault. The goals are printed beside it, never asserted: the hot key within the
bound, no hit lost beyond replication, no failure-mode decision for healthy shards.

    python -m loadtest.reliability --areas store-faults
    python -m loadtest.reliability_harness.store_faults [--full]

``--quick`` (the test) runs only the Cluster kill and the slot migration, in strict
mode, with shorter rows.
"""

from __future__ import annotations

import contextlib
import secrets
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvloop

from loadtest.reliability_harness.fault_phases import drained
from loadtest.reliability_harness.store_rows import (
    AREA,
    CLUSTER_FAULTS,
    CONFIG,
    DAY,
    DOMAIN,
    FULL,
    QUICK,
    REDIS_TIMEOUT,
    REPLICAS,
    SYNC_MAX_OVERSHOOT,
    Outcome,
    Run,
    Sizes,
    Traffic,
    build_row,
    held_counts,
    load,
    row_name,
    serving,
)
from loadtest.reliability_harness.store_topology import (
    ClusterStore,
    Fault,
    Keys,
    SentinelStore,
    Store,
    WriteProbe,
    store_events,
)
from loadtest.reliability_harness.support import (
    Context,
    CounterNames,
    ProcessGroup,
    Row,
    SidecarProcess,
    avoid_window_end,
    client_cpus,
    failed_row,
    main,
    process_group,
    redis_available,
    scrape,
    sidecar_build,
    skipped_row,
)


@dataclass
class Bench:
    context: Context
    group: ProcessGroup
    sizes: Sizes
    config: Path
    keys: Keys
    logs: Path


def sidecar_args(bench: Bench, store: Store, mode: str, prefix: str) -> list[str]:
    return [
        "--config", str(bench.config), "--watch-config", "false",
        "--backend", "redis", "--redis-url", store.url,
        "--mode", mode, "--redis-failure-mode", "local", "--redis-prefix", prefix,
        "--redis-timeout", str(REDIS_TIMEOUT), "--sync-max-overshoot", str(SYNC_MAX_OVERSHOOT),
        "--clock-source", "local",
    ]  # fmt: skip


def start_pair(bench: Bench, label: str, args: list[str]) -> list[SidecarProcess]:
    where = bench.logs / label
    builds = [sidecar_build(bench.context, f"sidecar-{index}", args, where) for index in range(REPLICAS)]
    sidecars = bench.group.start_all_ready(builds)  # both come up at once
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            if all(scrape(s.metrics_url).get("ratelimit_sidecar_replicas") == REPLICAS for s in sidecars):
                break
        time.sleep(0.1)
    return sidecars


def stop_pair(bench: Bench, sidecars: Sequence[SidecarProcess]) -> None:
    for sidecar in sidecars:
        sidecar.signal(signal.SIGTERM)
    for sidecar in sidecars:
        assert sidecar.process is not None
        try:
            sidecar.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            sidecar.kill()
        with contextlib.suppress(ValueError):
            bench.group.children.remove(sidecar)


def run_row(bench: Bench, store: Store, sidecars: list[SidecarProcess], mode: str, fault_name: str) -> Row:
    prefix = sidecars_prefix(sidecars)
    seconds = bench.sizes.seconds[fault_name]
    avoid_window_end(DAY, seconds + 120)
    tag = secrets.token_hex(3)
    traffic = Traffic(bench.keys, tag, bench.context.seed, with_slot_keys=fault_name == "slot_migration")
    fault = Fault(fault_name, store, bench.keys.slot, hold=bench.sizes.hold)
    owners = store.owners() if isinstance(store, ClusterStore) else None
    run = Run(traffic, fault)
    logs = [sidecar.log_path for sidecar in sidecars]
    offsets = [path.stat().st_size for path in logs]
    probe = WriteProbe(store.client, f"storeprobe:{{{traffic.digests[0]}}}:{tag}").start()
    try:
        with client_cpus(bench.context.client_cpus):
            uvloop.run(load(sidecars, run, seconds, bench.sizes.pre))
    finally:
        probe.finish()
        fault.restore()
    outcome = Outcome(prefix, owners, probe.acknowledged)
    outcome.drain_seconds = drained(sidecars)
    time.sleep(0.3)
    outcome.probe_held = probe.held()
    outcome.held = held_counts(store, run, prefix)
    outcome.events = store_events(logs, offsets, fault)
    outcome.serving_after = all(serving(sidecar, traffic.payloads[traffic.probe[0]]) for sidecar in sidecars)
    return build_row(mode, run, outcome)


def sidecars_prefix(sidecars: Sequence[SidecarProcess]) -> str:
    return sidecars[0].argv[sidecars[0].argv.index("--redis-prefix") + 1]


def run_store(bench: Bench, store: Store, faults: Sequence[str]) -> list[Row]:
    rows = []
    for mode in bench.sizes.modes:
        prefix = f"s{secrets.token_hex(3)}"
        kind = "cluster" if isinstance(store, ClusterStore) else "sentinel"
        sidecars = start_pair(bench, f"{kind}-{mode}", sidecar_args(bench, store, mode, prefix))
        try:
            for fault in faults:
                try:
                    rows.append(run_row(bench, store, sidecars, mode, fault))
                except Exception as error:
                    rows.append(failed_row(AREA, row_name(mode, fault), error, [*sidecars]))
                    with contextlib.suppress(Exception):  # the next row says it if the store stays broken
                        store.wait_healthy()
        finally:
            stop_pair(bench, sidecars)
    return rows


def run(context: Context) -> list[Row]:
    sizes = QUICK if context.quick else FULL
    if not redis_available():
        return [skipped_row(AREA, "Cluster and Sentinel faults under load", "redis-server is not installed")]
    logs = context.directory / "store-faults"
    config = logs / "config"
    config.mkdir(parents=True, exist_ok=True)
    (config / "store.yaml").write_text(CONFIG)
    keys = Keys.choose(CounterNames(config, DOMAIN), sizes.slot_keys, context.seed)
    rows: list[Row] = []
    cluster_faults = [fault for fault in sizes.faults if fault in CLUSTER_FAULTS]
    with process_group() as group:
        bench = Bench(context, group, sizes, config, keys, logs)
        if cluster_faults:
            rows += on_store(bench, lambda: ClusterStore.start(group, logs / "cluster"), cluster_faults)
        if "sentinel_kill" in sizes.faults:
            rows += on_store(bench, lambda: SentinelStore.start(group, logs / "sentinel"), ["sentinel_kill"])
    return rows


def on_store(bench: Bench, start: Any, faults: list[str]) -> list[Row]:
    """The rows of ``faults`` on a store ``start()`` brings up; its servers stopped after."""
    before = list(bench.group.children)
    try:
        store = start()
        return run_store(bench, store, faults)
    except Exception as error:
        return [failed_row(AREA, row_name(mode, fault), error, bench.group.children)
                for mode in bench.sizes.modes for fault in faults]  # fmt: skip
    finally:
        bench.group.stop([child for child in bench.group.children if child not in before])


if __name__ == "__main__":
    raise SystemExit(main(run))
