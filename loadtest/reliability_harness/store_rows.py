"""What one store-faults row sends and measures (``store_faults.py`` runs the rows): the load's
keys and payloads, the constants of the scenario, and the figures a row reports from its
calls, ``/metrics`` samples and what Redis held (issue 31)."""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import itertools
import math
import os
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
from redis.crc import key_slot

from loadtest.reliability_harness.store_topology import (
    Fault,
    Keys,
    Store,
)
from loadtest.reliability_harness.support import (
    CODE_ERROR,
    OK,
    OVER_LIMIT,
    Calls,
    Row,
    SidecarProcess,
    encode_request,
    ms,
    percentile,
    scrape,
)
from sidecar.client import health_status
from sidecar.limiter.redis.keys import window_key

AREA = "store faults"
DOMAIN = "store"
HOT_LIMIT = 100
HOT_RATE = 200.0
SPREAD_RATE = 100.0
SPREAD_KEYS = 300
DEADLINE = 0.025
"""Envoy's ``timeout`` in ``envoy/sidecar.yaml``: every call of the load carries it."""
PROBE_RATE = 40.0
PROBE_DEADLINE = 5.0
"""Long enough that only a sidecar that stopped answering misses it, even on a machine at load 8;
its calls still get `--redis-timeout` (20 ms) for Redis, so their latency is the stall."""
PROBE_KEYS = 30
REPLICAS = 2
REDIS_TIMEOUT = 0.02
SYNC_MAX_OVERSHOOT = 0.05
BLIND_CAP = math.floor(SYNC_MAX_OVERSHOOT * HOT_LIMIT / (REPLICAS - 1))
BOUNDS = {"sync": HOT_LIMIT + (REPLICAS - 1) * BLIND_CAP, "strict": HOT_LIMIT}
"""The hot key's documented bound per window (``docs/redis.md``)."""
DAY = 86_400
SAMPLE_EVERY = 0.2
SETTLED_SHARE = 0.05
"""Redis decides again once the failure mode takes at most this share of the calls."""
CONFIG = f"""\
domain: {DOMAIN}
descriptors:
  - key: hot
    rate_limit: {{unit: second, requests_per_unit: {HOT_LIMIT}}}
  - key: spread
    rate_limit: {{unit: day, requests_per_unit: 1000000}}
"""
FAULTS = {
    "cluster_kill": "Cluster: the hot key's master SIGKILLed",
    "cluster_failover": "Cluster: CLUSTER FAILOVER on the hot key's replica",
    "slot_migration": "Cluster: the hot key's slot held in migration",
    "sentinel_kill": "Sentinel: the master SIGKILLed",
}
CLUSTER_FAULTS = ("cluster_kill", "cluster_failover", "slot_migration")


@dataclass(frozen=True)
class Sizes:
    modes: tuple[str, ...]
    faults: tuple[str, ...]
    pre: float
    """Seconds of load before the fault."""
    seconds: dict[str, float]
    """Seconds of load per row, fault included."""
    hold: float
    slot_keys: int
    """Spread keys chosen in the migrated slot."""


FULL = Sizes(
    ("sync", "strict"),
    tuple(FAULTS),
    3.0,
    {"cluster_kill": 12.0, "cluster_failover": 10.0, "slot_migration": 10.0, "sentinel_kill": 14.0},
    3.0,
    8,
)
QUICK = Sizes(
    ("strict",), ("cluster_kill", "slot_migration"), 1.0, {"cluster_kill": 7.0, "slot_migration": 4.5}, 1.5, 4
)


def row_name(mode: str, fault: str) -> str:
    return f"{mode} mode: {FAULTS[fault]}"


# ---------------------------------------------------------------------------------
# Keys and traffic
# ---------------------------------------------------------------------------------


class Traffic:
    """Payloads of one row: 0 the hot key, then the spread keys, then the probe's keys."""

    def __init__(self, keys: Keys, tag: str, seed: int, *, with_slot_keys: bool) -> None:
        self.rng = random.Random(seed)
        spread = [f"{tag}-{index}" for index in range(SPREAD_KEYS)]
        spread += list(keys.slot_values) if with_slot_keys else []
        self.entries = [[("hot", keys.hot)], *([("spread", value)] for value in spread)]
        self.entries += [[("spread", f"{tag}-p{index}")] for index in range(PROBE_KEYS)]
        self.payloads = [encode_request(DOMAIN, [entries]) for entries in self.entries]
        self.digests = [keys.names.digest(entries) for entries in self.entries]
        self.slots = [int(key_slot(digest.encode())) for digest in self.digests]
        self.spread = range(1, 1 + len(spread))
        self.probe = range(1 + len(spread), len(self.entries))

    def choose(self) -> tuple[int, int]:
        hot = self.rng.random() < HOT_RATE / (HOT_RATE + SPREAD_RATE)
        return self.rng.randrange(REPLICAS), 0 if hot else self.rng.choice(self.spread)

    def choose_probe(self) -> tuple[int, int]:
        return self.rng.randrange(REPLICAS), self.rng.choice(self.probe)


# ---------------------------------------------------------------------------------
# One row: load, the fault, /metrics sampled meanwhile
# ---------------------------------------------------------------------------------


@dataclass
class Run:
    traffic: Traffic
    fault: Fault
    calls: Calls = field(default_factory=Calls)
    probe: Calls = field(default_factory=Calls)
    marks: dict[str, float] = field(default_factory=dict)
    samples: list[tuple[float, float, dict[str, float], tuple[bool, ...]]] = field(default_factory=list)
    """``(perf_counter, failure decisions of both sidecars, by reason, each one's redis_up)``."""
    wall_offset: float = 0.0
    """``time.time() - perf_counter()``: the windows are on the wall clock."""


def failure_decisions(view: dict[str, float]) -> dict[str, float]:
    prefix = "ratelimit_sidecar_failure_decisions_total{"
    found = {}
    for name, value in view.items():
        if name.startswith(prefix):
            found[name[len(prefix) :].rstrip("}")] = value
    return found


async def sample(sidecars: Sequence[SidecarProcess], run: Run, stop: asyncio.Event) -> None:
    while not stop.is_set():
        now = time.perf_counter()
        with contextlib.suppress(OSError):
            views = await asyncio.gather(*(asyncio.to_thread(scrape, s.metrics_url, 1.0) for s in sidecars))
            reasons: dict[str, float] = {}
            for view in views:
                for reason, count in failure_decisions(view).items():
                    reasons[reason] = reasons.get(reason, 0.0) + count
            up = tuple(view.get("ratelimit_sidecar_redis_up") == 1 for view in views)
            run.samples.append((now, sum(reasons.values()), reasons, up))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), SAMPLE_EVERY)


async def load(sidecars: Sequence[SidecarProcess], run: Run, seconds: float, pre: float) -> None:
    from loadtest.reliability_harness.support import drive

    addresses = [sidecar.address for sidecar in sidecars]
    payloads = run.traffic.payloads
    stop = asyncio.Event()
    start = time.perf_counter()
    run.wall_offset = time.time() - start

    async def control() -> None:
        await asyncio.sleep(pre)
        run.marks["fault"] = time.perf_counter()
        await asyncio.to_thread(run.fault.begin)
        run.marks["begun"] = time.perf_counter()
        served = await asyncio.to_thread(run.fault.wait)
        if served is not None:
            run.marks["served"] = served

    sampler = asyncio.create_task(sample(sidecars, run, stop))
    try:
        await asyncio.gather(
            drive(addresses, payloads, run.traffic.choose, run.calls, seconds=seconds, lanes=24,
                  rate=HOT_RATE + SPREAD_RATE, timeout=DEADLINE),
            drive(addresses, payloads, run.traffic.choose_probe, run.probe, seconds=seconds, lanes=4,
                  rate=PROBE_RATE, timeout=PROBE_DEADLINE),
            control(),
        )  # fmt: skip
    finally:
        stop.set()
        await sampler


def serving(sidecar: SidecarProcess, payload: bytes) -> bool:
    """Health SERVING and one call answered within the probe's deadline."""
    if not sidecar.alive():
        return False
    try:
        if health_status(sidecar.address, timeout=PROBE_DEADLINE) != "SERVING":
            return False
        with grpc.insecure_channel(sidecar.address) as channel:
            method = channel.unary_unary("/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit")
            method(payload, timeout=PROBE_DEADLINE)
    except grpc.RpcError:
        return False
    return True


# ---------------------------------------------------------------------------------
# Figures of a row
# ---------------------------------------------------------------------------------


def hot_windows(run: Run) -> tuple[dict[int, int], dict[int, int]]:
    """Hot-key calls answered OK, and calls past their deadline, per wall-clock second."""
    admitted: dict[int, int] = {}
    late: dict[int, int] = {}
    calls = run.calls
    for index in range(len(calls)):
        if calls.payload[index] != 0:
            continue
        second = int(run.wall_offset + calls.sent[index] + calls.latency[index] / 2)
        if calls.code[index] == OK:
            admitted[second] = admitted.get(second, 0) + 1
        elif calls.errors.get(index) == "DEADLINE_EXCEEDED":
            late[second] = late.get(second, 0) + 1
    return admitted, late


def spread_hits(run: Run) -> tuple[dict[int, int], dict[int, int], int]:
    """Per spread payload: hits answered OK, hits of calls past their deadline (the sidecar
    may have admitted them: their outcome is unknown); and spread calls refused."""
    sure: dict[int, int] = {}
    late: dict[int, int] = {}
    refused = 0
    for calls in (run.calls, run.probe):
        for index in range(len(calls)):
            payload = calls.payload[index]
            if payload == 0:
                continue
            if calls.code[index] == OK:
                sure[payload] = sure.get(payload, 0) + 1
            elif calls.code[index] == OVER_LIMIT:
                refused += 1
            elif calls.errors.get(index) == "DEADLINE_EXCEEDED":
                late[payload] = late.get(payload, 0) + 1
    return sure, late, refused


def held_counts(store: Store, run: Run, prefix: str) -> dict[int, int]:
    """What the store holds for each spread payload's key in today's window."""
    start = int((run.wall_offset + run.calls.sent[0]) // DAY * DAY)
    client = store.client()
    try:
        held = {}
        for payload in [*run.traffic.spread, *run.traffic.probe]:
            value = client.get(window_key(prefix, run.traffic.digests[payload], start))
            held[payload] = int(value or 0)
        return held
    finally:
        client.close()


def recovery(run: Run) -> float:
    """Seconds from the fault to the sample from which on Redis decides again: both sidecars
    say Redis is up and the failure mode decides at most :data:`SETTLED_SHARE` of the calls
    for reasons of Redis's (``deadline`` decisions, the caller's time running out on this
    loaded machine, are not counted). 0: it never stopped deciding."""
    fault = run.marks["fault"]
    after = [item for item in run.samples if item[0] >= fault]
    last_change = fault
    for previous, current in itertools.pairwise(after):
        redis_decisions = redis_decided(current[2]) - redis_decided(previous[2])
        allowed = SETTLED_SHARE * (HOT_RATE + SPREAD_RATE + PROBE_RATE) * (current[0] - previous[0])
        if redis_decisions > allowed or not all(current[3]):
            last_change = current[0]
    return last_change - fault


def redis_decided(reasons: dict[str, float]) -> float:
    """Failure-mode decisions whose reason is Redis's (all but ``deadline``)."""
    return sum(count for reason, count in reasons.items() if "deadline" not in reason)


def decisions_since(run: Run, moment: float) -> tuple[float, dict[str, float]]:
    before = [item for item in run.samples if item[0] <= moment] or run.samples[:1]
    if not before:
        return 0.0, {}
    first, last = before[-1], run.samples[-1]
    reasons = {reason: count - first[2].get(reason, 0.0) for reason, count in last[2].items()}
    return last[1] - first[1], {reason: count for reason, count in reasons.items() if count}


def on_failed_shard(run: Run, owners: dict[int, int] | None) -> set[int]:
    """Payloads whose key lives on the faulted shard: the victim's slots (Cluster kill,
    failover), the migrated slot, or every key (Sentinel: one shard)."""
    fault, traffic = run.fault, run.traffic
    if owners is None:
        return set(range(len(traffic.payloads)))
    if fault.name == "slot_migration":
        return {payload for payload, slot in enumerate(traffic.slots) if slot == fault.slot}
    return {payload for payload, slot in enumerate(traffic.slots) if owners.get(slot) == fault.victim}


@dataclass
class Outcome:
    """What the row measured beyond the calls (filled in after the load)."""

    prefix: str
    owners: dict[int, int] | None
    probe_acknowledged: int = 0
    probe_held: int = 0
    held: dict[int, int] = field(default_factory=dict)
    serving_after: bool = False
    drain_seconds: float | None = None
    events: dict[str, float] = field(default_factory=dict)
    """What the sidecars logged of the store meanwhile (:func:`store_events`)."""


def split_decisions(run: Run, failed: set[int]) -> dict[str, float]:
    """Failure-mode decisions from the fault on, and what can be said of their shards:
    ``/metrics`` counts them by reason only, so healthy shards got at least the decisions
    for Redis's reasons (``deadline`` ones are this loaded machine's) beyond the calls on
    the failed shard, and at least the calls on healthy shards sent while the sidecar
    that took them reported Redis down (it then decides every call by the failure mode)."""
    calls, probe = run.calls, run.probe
    fault = run.marks["fault"]
    decided, reasons = decisions_since(run, fault)
    moments = [item[0] for item in run.samples]
    failed_calls = healthy_calls = healthy_down = 0
    for batch in (calls, probe):
        for index in range(len(batch)):
            if batch.sent[index] < fault:
                continue
            if batch.payload[index] in failed:
                failed_calls += 1
                continue
            healthy_calls += 1
            at = bisect.bisect_right(moments, batch.sent[index]) - 1
            if at >= 0 and not run.samples[at][3][batch.target[index]]:
                healthy_down += 1
    return {
        "failure_decisions": decided,
        **{f"failure_decisions_{reason.split('=')[-1].strip(chr(34))}": count for reason, count in reasons.items()},
        "calls_failed_shard": failed_calls,
        "calls_healthy_shards": healthy_calls,
        "healthy_calls_while_marked_down": healthy_down,
        "healthy_decisions_at_least": max(redis_decided(reasons) - failed_calls, float(healthy_down), 0.0),
    }


def call_figures(run: Run) -> dict[str, float]:
    calls, probe = run.calls, run.probe
    fault = run.marks["fault"]
    errors = calls.error_counts()
    late_calls = errors.pop("DEADLINE_EXCEEDED", 0)
    before = [index for index in range(len(calls)) if calls.sent[index] < fault]
    late_before = sum(1 for index in before if calls.errors.get(index) == "DEADLINE_EXCEEDED")
    quiet = [probe.latency[index] for index in range(len(probe)) if probe.sent[index] < fault]
    latencies = sorted(probe.latency)
    return {
        "calls": len(calls) + len(probe),
        "answered": sum(1 for code in [*calls.code, *probe.code] if code != CODE_ERROR),
        "late_calls": late_calls,
        "late_share_before_fault": round(late_before / max(1, len(before)), 3),
        "load_average": round(os.getloadavg()[0], 1),
        "errors": sum(errors.values()),
        "probe_calls": len(probe),
        "probe_errors": len(probe.errors),
        "stall_ms": ms(latencies[-1] if latencies else 0.0),
        "stall_before_fault_ms": ms(max(quiet, default=0.0)),
        "probe_p99_ms": ms(percentile(latencies, 0.99)),
    }


def figures_of(mode: str, run: Run, outcome: Outcome) -> dict[str, float]:
    admitted, late_hot = hot_windows(run)
    sure, late_spread, refused = spread_hits(run)
    failed = on_failed_shard(run, outcome.owners)
    lost = {"failed": 0, "healthy": 0}
    doubled = 0
    for payload, held in outcome.held.items():
        where = "failed" if payload in failed else "healthy"
        lost[where] += max(0, sure.get(payload, 0) - held)
        doubled += max(0, held - sure.get(payload, 0) - late_spread.get(payload, 0))
    fault = run.marks["fault"]
    return {
        **call_figures(run),
        "hot_bound": BOUNDS[mode],
        "hot_max_window": max(admitted.values(), default=0),
        "hot_windows_over": sum(count > BOUNDS[mode] for count in admitted.values()),
        "hot_max_late_window": max(late_hot.values(), default=0),
        "spread_lost_failed_shard": lost["failed"],
        "spread_lost_healthy_shards": lost["healthy"],
        "spread_doubled": doubled,
        "spread_refused": refused,
        "replication_acknowledged": outcome.probe_acknowledged,
        "replication_lost": max(0, outcome.probe_acknowledged - outcome.probe_held),
        "promotion_s": round(run.marks["served"] - fault, 2) if "served" in run.marks else -1.0,
        "redis_decided_again_s": round(recovery(run), 2),
        **split_decisions(run, failed),
        **outcome.events,
        "serving_after": float(outcome.serving_after),
        "drain_seconds": round(outcome.drain_seconds, 2) if outcome.drain_seconds is not None else -1.0,
    }


def window_list(run: Run) -> str:
    """The hot key's admitted hits per second, in order (``*`` marks the fault's second)."""
    admitted, _ = hot_windows(run)
    fault = int(run.wall_offset + run.marks["fault"])
    return ",".join(f"{admitted[second]}{'*' if second == fault else ''}" for second in sorted(admitted))


def build_row(mode: str, run: Run, outcome: Outcome) -> Row:
    figures = figures_of(mode, run, outcome)
    problems = []
    if figures["errors"]:
        problems.append(f"{figures['errors']:.0f} calls failed with errors other than their deadline")
    if figures["probe_errors"]:
        problems.append(f"{figures['probe_errors']:.0f} probe calls (5 s deadline) unanswered")
    if not outcome.serving_after:
        problems.append("a sidecar did not serve after the fault")
    goals = []
    if figures["hot_windows_over"]:
        goals.append(f"hot key {figures['hot_max_window']:.0f} admitted in a window > bound {figures['hot_bound']:.0f}")
    beyond = figures["spread_lost_healthy_shards"] or (
        figures["spread_lost_failed_shard"] and not figures["replication_lost"]
    )
    if beyond:
        goals.append("hits lost beyond what replication lost")
    if figures["healthy_decisions_at_least"]:
        goals.append(f">= {figures['healthy_decisions_at_least']:.0f} failure-mode decisions for healthy shards")
    if figures["healthy_masters_marked_down"] or (outcome.owners is not None and figures["store_marked_down"]):
        goals.append("a healthy master (or the whole Cluster) marked down")
    reasons = ", ".join(f"{key.rsplit('_', 1)[-1]} {value:.0f}" for key, value in figures.items()
                        if key.startswith("failure_decisions_"))  # fmt: skip
    notes = (
        f"answered {figures['answered']:.0f} of {figures['calls']:.0f} ({figures['late_calls']:.0f} past the "
        f"25 ms deadline); max stall {figures['stall_ms']:.0f} ms; hot key max {figures['hot_max_window']:.0f}"
        f"/window (bound {figures['hot_bound']:.0f}); spread hits lost {figures['spread_lost_failed_shard']:.0f} "
        f"on the failed shard, {figures['spread_lost_healthy_shards']:.0f} elsewhere, "
        f"{figures['spread_doubled']:.0f} doubled; replication lost {figures['replication_lost']:.0f} of "
        f"{figures['replication_acknowledged']:.0f} acknowledged; promoted/served after "
        f"{figures['promotion_s']:.1f} s, Redis-decided again after {figures['redis_decided_again_s']:.1f} s; "
        f"failure-mode decisions {figures['failure_decisions']:.0f} ({reasons or 'none'}) vs "
        f"{figures['calls_failed_shard']:.0f} calls on the failed shard: >= "
        f"{figures['healthy_decisions_at_least']:.0f} for healthy shards; marked down: the store "
        f"{figures['store_marked_down']:.0f}x, healthy masters {figures['healthy_masters_marked_down']:.0f}x; "
        f"hot key per second: {window_list(run)}; "
        f"before the fault {figures['late_share_before_fault']:.0%} of calls were late, max stall "
        f"{figures['stall_before_fault_ms']:.0f} ms (load average {figures['load_average']:.1f})"
    )
    if run.fault.moved_keys:
        notes += f"; keys MIGRATEd {'+'.join(map(str, run.fault.moved_keys))}"
    if problems:
        notes = "; ".join(problems) + " | " + notes
    return Row(
        AREA,
        row_name(mode, run.fault.name),
        load=f"{HOT_RATE + SPREAD_RATE:.0f} req/s at a 25 ms deadline on {REPLICAS} sidecars",
        hits_lost=int(figures["spread_lost_failed_shard"] + figures["spread_lost_healthy_shards"]),
        ok=not problems,
        notes=notes,
        goals_missed=goals,
        figures=figures,
    )


# ---------------------------------------------------------------------------------
# Rows on one store
# ---------------------------------------------------------------------------------
