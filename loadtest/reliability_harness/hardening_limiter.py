"""Attacks on the limiter from issue 21 (defects 1, 3, 5 and 6), as rows of the reliability report.

Each scenario runs real processes (sidecars, redis-server) on 127.0.0.1 and measures
the figure the issue reported, so the report shows the bound that holds now:

* **repeated descriptor, sync mode** (defect 1): two replicas, a limit of 100/hour and
  the default ``--sync-max-overshoot 0.05`` (bound 105); each replica gets one request
  naming the same descriptor 64 times (1 hit each), then 19 times with ``hits_addend``
  5. Before the fix 128 and 190 hits were admitted; the row holds when at most 105 are
  and Redis holds exactly what was admitted.
* **unique-key flood during an outage** (defects 3 and 5): Redis stopped, 64 new
  values per call. Sync mode with ``--max-counters 1000`` (before: 28,864 live
  counters, a call from 1 to 87 ms) must keep its counters at the cap; strict mode at
  a ledger cap of 40,000 (before: 1 to 99 ms per call) must not slow down. The row
  holds when the last calls cost at most a few times the first ones. (The tests' smoke size:
  10,000 values in sync mode, a ledger cap of 5,000 in strict mode.)
* **SIGTERM during a short outage** (defect 6): 50 hits admitted by the failure mode,
  SIGTERM, Redis back 1.5 s later, ``--shutdown-grace 10``. Before the fix Redis held
  0 of 50 (sync gave up after 0.8 s, strict after 1.3 s); the row holds when it holds
  50 and the process exits 0 within the grace.

    python -m loadtest.reliability_harness.hardening_limiter [--full]
"""

from __future__ import annotations

import json
import secrets
import signal
import statistics
import subprocess
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path

import grpc

from loadtest.reliability_harness.support import (
    CHANNEL_OPTIONS,
    METHOD,
    OK,
    Child,
    Context,
    ProcessGroup,
    RedisProcess,
    Row,
    SidecarProcess,
    encode_request,
    failed_row,
    main,
    overall_code,
    pin,
    process_group,
    redis_available,
    redis_client,
    redis_counts,
    scrape,
    skipped_row,
    start_sidecar,
    wait_for,
)

AREA = "hostile limiter"
LIMIT = 100
BOUND = LIMIT + int(0.05 * LIMIT)
PER_CALL = 64
SYNC_CAP = 1_000
STRICT_CAP = 40_000
OUTAGE_HITS = 50
GRACE = 10.0
REDIS_BACK_AFTER = 1.5

CONFIG = textwrap.dedent(
    f"""\
    domain: hardening
    descriptors:
      - key: client
        rate_limit:
          unit: hour
          requests_per_unit: {LIMIT}
      - key: flood
        rate_limit:
          unit: hour
          requests_per_unit: 10
    """
)


def config_dir(context: Context) -> Path:
    directory = context.directory / "hardening-config"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "hardening.yaml").write_text(CONFIG)
    return directory


def ask(channel: grpc.Channel, payload: bytes) -> int:
    """One ShouldRateLimit call: its overall code."""
    return overall_code(channel.unary_unary(METHOD)(payload, timeout=10))


def redis_args(redis: RedisProcess, mode: str, prefix: str) -> list[str]:
    return ["--backend", "redis", "--redis-url", redis.url, "--mode", mode, "--redis-prefix", prefix]


def start_redis(group: ProcessGroup, context: Context, where: Path, port: int = 0) -> RedisProcess:
    return group.start_ready(lambda: pin(RedisProcess(where, port=port), context.server_cpus))


def redis_and_sidecars(
    group: ProcessGroup,
    context: Context,
    where: Path,
    children: list[Child],
    args: Sequence[str],
    *,
    mode: str,
    prefix: str,
    count: int = 1,
) -> tuple[RedisProcess, list[SidecarProcess]]:
    """A redis-server and ``count`` sidecars on it in ``mode`` with ``args``, all put in
    ``children`` (their logs go into a failed row)."""
    redis = start_redis(group, context, where)
    children.append(redis)
    serve = [*args, *redis_args(redis, mode, prefix)]
    names = ["sidecar"] if count == 1 else [f"sidecar-{index}" for index in range(count)]
    sidecars = [start_sidecar(group, context, name, serve, where) for name in names]
    children += sidecars
    return redis, sidecars


def held(redis: RedisProcess, prefix: str) -> int:
    return sum(redis_counts(redis.port, prefix).values())


# -- defect 1 ----------------------------------------------------------------------------------------


def repeated_descriptor_row(context: Context, config: Path) -> Row:
    scenario = "sync: one descriptor repeated in a request, 2 replicas, limit 100/h (bound 105)"
    where = context.directory / "hardening-repeats"
    prefix = f"rep{secrets.token_hex(3)}"
    children: list[Child] = []
    with process_group() as group:
        try:
            args = ["--config", str(config), "--heartbeat-interval", "0.2"]
            redis, sidecars = redis_and_sidecars(
                group, context, where, children, args, mode="sync", prefix=prefix, count=2
            )
            client = redis_client(redis.port)
            if not wait_for(lambda: client.zcard(f"{prefix}:replicas") >= 2, 10, 0.02):
                raise RuntimeError("the two replicas never both beat")
            time.sleep(0.6)  # a few beats: each counts the other
            admitted: dict[str, int] = {}
            for repeats, hits in ((64, 1), (19, 5)):
                value = f"{repeats}x{hits}"
                payload = encode_request("hardening", [[("client", value)]] * repeats, hits)
                admitted[value] = 0
                for sidecar in sidecars:
                    with grpc.insecure_channel(sidecar.address, options=CHANNEL_OPTIONS) as channel:
                        if ask(channel, payload) == OK:
                            admitted[value] += repeats * hits
            codes = group.stop(sidecars, timeout=15)
            in_redis = held(redis, prefix)
        except Exception as error:  # the report shows a broken scenario as a failed row
            return failed_row(AREA, scenario, error, children)
    worst = max(admitted.values())
    ok = worst <= BOUND and in_redis == sum(admitted.values()) and set(codes.values()) == {0}
    notes = (
        f"admitted {admitted['64x1']} (64 x 1 hit) and {admitted['19x5']} (19 x 5 hits) of {LIMIT}; "
        f"Redis holds {in_redis} for {sum(admitted.values())} admitted; before the fix 128 and 190"
    )
    figures: dict[str, float] = {
        "admitted_64x1": admitted["64x1"],
        "admitted_19x5": admitted["19x5"],
        "redis": in_redis,
    }
    return Row(AREA, scenario, load="64 x 1 hit, 19 x 5 hits per replica", ok=ok, notes=notes, figures=figures)


# -- defects 3 and 5 -----------------------------------------------------------------------------------


def flood_row(context: Context, config: Path, mode: str) -> Row:
    cap = SYNC_CAP if mode == "sync" else {"smoke": 5_000, "quick": 20_000, "full": STRICT_CAP}[context.size]
    sync_values = 10_000 if context.smoke else 28_864  # the smoke size: still 10x the cap
    calls = (sync_values // PER_CALL) if mode == "sync" else cap // PER_CALL + 100
    scenario = f"{mode}: {calls * PER_CALL:,} unique values during a Redis outage, --max-counters {cap:,}"
    where = context.directory / f"hardening-flood-{mode}"
    prefix = f"fl{secrets.token_hex(3)}"
    children: list[Child] = []
    with process_group() as group:
        try:
            args = ["--config", str(config), "--max-counters", str(cap), "--shutdown-grace", "1"]
            redis, (sidecar,) = redis_and_sidecars(group, context, where, children, args, mode=mode, prefix=prefix)
            redis.kill()
            seconds: list[float] = []
            admitted = 0
            with grpc.insecure_channel(sidecar.address, options=CHANNEL_OPTIONS) as channel:
                ask(channel, encode_request("hardening", [[("flood", "warm")]]))
                time.sleep(0.5)  # a heartbeat or a script has failed: Redis is known to be away
                for call in range(calls):
                    payload = encode_request("hardening", [[("flood", f"{call}-{index}")] for index in range(PER_CALL)])
                    began = time.perf_counter()
                    code = ask(channel, payload)
                    seconds.append(time.perf_counter() - began)
                    admitted += PER_CALL if code == OK else 0
            metrics = scrape(sidecar.metrics_url)
        except Exception as error:
            return failed_row(AREA, scenario, error, children)
    first, last = statistics.median(seconds[:20]), statistics.median(seconds[-20:])
    counters = int(metrics.get("ratelimit_sidecar_counters", -1))
    flat = last <= max(3 * first, first + 0.005)
    figures = {"first_ms": round(first * 1000, 2), "last_ms": round(last * 1000, 2), "counters": counters}
    if mode == "sync":
        ok = flat and 0 <= counters <= cap
        before = "before the fix 28,864 live counters and 1 → 87 ms per call"
        notes = f"live counters {counters:,} (cap {cap:,}); {admitted:,} hits admitted (local failure mode)"
    else:
        ok = flat
        before = "before the fix 1 → 99 ms per call at a cap of 40,000"
        notes = f"{admitted:,} hits admitted, what the ledger could not hold dropped and counted"
    load = f"{calls:,} calls of {PER_CALL} new values, one at a time"
    notes += f"; per call {first * 1000:.2f} ms (first 20) → {last * 1000:.2f} ms (last 20); {before}"
    return Row(AREA, scenario, load=load, ok=ok, notes=notes, figures=figures)


# -- defect 6 --------------------------------------------------------------------------------------------


def log_events(child: Child) -> list[dict[str, object]]:
    events = []
    for line in child.log_text().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict):
            events.append(event)
    return events


def shutdown_row(context: Context, config: Path, mode: str) -> Row:
    scenario = f"{mode}: SIGTERM during a Redis outage, Redis back {REDIS_BACK_AFTER:g} s later, grace {GRACE:g} s"
    where = context.directory / f"hardening-shutdown-{mode}"
    prefix = f"sd{secrets.token_hex(3)}"
    children: list[Child] = []
    with process_group() as group:
        try:
            args = ["--config", str(config), "--shutdown-grace", str(GRACE)]
            redis, (sidecar,) = redis_and_sidecars(group, context, where, children, args, mode=mode, prefix=prefix)
            redis.kill()
            time.sleep(0.3)
            payload = encode_request("hardening", [[("client", "outage")]])
            with grpc.insecure_channel(sidecar.address, options=CHANNEL_OPTIONS) as channel:
                admitted = sum(1 for _ in range(OUTAGE_HITS) if ask(channel, payload) == OK)
            assert sidecar.process is not None
            signalled = time.monotonic()
            sidecar.signal(signal.SIGTERM)
            while time.monotonic() - signalled < REDIS_BACK_AFTER and sidecar.alive():
                time.sleep(0.01)  # an exit before Redis is back is timed here (the bug's 0.8 s)
            back = start_redis(group, context, where, port=redis.port)
            children.append(back)
            try:
                code: int | None = sidecar.process.wait(timeout=GRACE + 10)
            except subprocess.TimeoutExpired:
                code = None
            took = time.monotonic() - signalled
            in_redis = held(back, prefix)
            lost_lines = [event for event in log_events(sidecar) if event.get("event") == "admitted_hits_lost"]
        except Exception as error:
            return failed_row(AREA, scenario, error, children)
    lost = admitted - in_redis
    ok = admitted == OUTAGE_HITS and lost == 0 and code == 0 and took < GRACE + 2 and not lost_lines
    notes = (
        f"Redis holds {in_redis} of {admitted} admitted; exit {code} after {took:.1f} s; "
        f"before the fix 0 of 50 (sync gave up after 0.8 s, strict after 1.3 s)"
    )
    figures = {"admitted": admitted, "redis": in_redis, "exit_seconds": round(took, 2)}
    return Row(AREA, scenario, load=f"{OUTAGE_HITS} hits", hits_lost=lost, ok=ok, notes=notes, figures=figures)


def run(context: Context) -> list[Row]:
    scenarios: Sequence[str] = (
        "sync: one descriptor repeated in a request",
        "sync: unique values during a Redis outage",
        "strict: unique values during a Redis outage",
        "sync: SIGTERM during a Redis outage",
        "strict: SIGTERM during a Redis outage",
    )
    if not redis_available():
        return [skipped_row(AREA, scenario, "redis-server is not installed") for scenario in scenarios]
    config = config_dir(context)
    return [
        repeated_descriptor_row(context, config),
        flood_row(context, config, "sync"),
        flood_row(context, config, "strict"),
        shutdown_row(context, config, "sync"),
        shutdown_row(context, config, "strict"),
    ]


if __name__ == "__main__":
    raise SystemExit(main(run))
