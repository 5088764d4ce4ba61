"""Floods of unique values: memory stays bounded by ``--max-counters`` (design.md section 6).

A key-only rule counts each value separately, so a client sending a new value with
every request makes the sidecar create a counter per request. This scenario sends
``N`` distinct values (1,000,000; quick: 100,000; the tests' smoke size: 25,000) to a
real sidecar process and measures what that costs:

* **memory backend, cap below the flood** (``--max-counters`` 200,000; quick 20,000):
  live counters must stop at the cap, the rest evicted (``ratelimit_sidecar_evictions_total``),
  and RSS must stay within the cap's budget (:data:`BUDGET_BYTES_PER_COUNTER` per counter);
* **memory backend, cap above the flood**: nothing evicted, every value live; RSS growth
  divided by the live counters is the price of one counter;
* **sync mode with Redis** (quick size in full runs too): the cap evicts only counters whose
  hits Redis already holds, so the flood loses no admitted hit (Redis holds exactly
  ``N`` hits afterwards).

Sending a million gRPC calls from Python would take minutes on 2 cores, so every
request carries 64 descriptors (the validation bound), each with its own value: a
million keys take ~15,600 calls. Live counters come from the sidecar's ``/metrics``
(``ratelimit_sidecar_counters``), memory from ``VmRSS`` / ``VmHWM`` in ``/proc``.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import uvloop

from loadtest.reliability_harness.support import (
    CHANNEL_OPTIONS,
    METHOD,
    MIB,
    OK,
    Child,
    Context,
    CounterNames,
    RedisProcess,
    Row,
    SidecarProcess,
    avoid_window_end,
    check_encoding,
    client_cpus,
    compare_counts,
    encode_request,
    failed_row,
    main,
    overall_code,
    pin,
    proc_status,
    process_group,
    redis_available,
    redis_counts,
    rss,
    scrape,
    skipped_row,
    start_sidecar,
    wait_for,
)

AREA = "load"
DOMAIN = "flood"
KEY = "flood_key"
UNIT = "day"
UNIT_SECONDS = 86_400
LIMIT = 1000
"""Per value and day: every flood value is hit once, so every request is admitted."""
PER_REQUEST = 64
"""Descriptors per request: the validation bound (``sidecar.config.model.MAX_DESCRIPTORS``)."""
IN_FLIGHT = 8
CALL_TIMEOUT = 30.0
SERVING_WAIT = 10.0
"""Seconds after the flood the sidecar gets to answer a health check SERVING."""
BUDGET_BYTES_PER_COUNTER = 1024
"""What one live counter may cost in RSS, fragmentation included. README sizes the
default cap of 2,000,000 counters at "about 1 GB" (~500 bytes each); this budget is
twice that, so the check fails on a leak or on eviction not freeing memory, not on
allocator noise."""
BASELINE_SLACK = 32 * MIB
"""RSS a process may gain for reasons other than counters (allocator arenas, gRPC buffers)."""

CONFIG = f"""\
domain: {DOMAIN}
descriptors:
  - key: {KEY}
    rate_limit: {{unit: {UNIT}, requests_per_unit: {LIMIT}}}
"""


@dataclass(frozen=True)
class Flood:
    name: str
    backend: str
    """``memory`` or ``sync``."""
    values: int
    cap: int
    sync_interval: float | None = None
    """``--sync-interval`` (sync mode), None for the default (50 ms)."""

    @property
    def flushes_during_flood(self) -> bool:
        """With a flush interval longer than the flood nothing is flushed, so nothing can be evicted."""
        return self.sync_interval is None


@dataclass
class Sent:
    calls: int = 0
    ok: int = 0
    other: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    peak_counters: float = 0.0
    peak_rss: int = 0


def plan(size_name: str) -> list[Flood]:
    """The floods of a ``full``, ``quick`` or ``smoke`` run (the tests': a quarter of quick, which
    still passes each cap many times over; the exact counts the rows check hold at any size)."""
    size = {"full": 1_000_000, "quick": 100_000, "smoke": 25_000}[size_name]
    sync_size = 25_000 if size_name == "smoke" else 100_000
    return [
        Flood("memory, cap below the flood", "memory", size, size // 5),
        Flood("memory, cap above the flood", "memory", size, 2 * size),
        Flood("sync mode (Redis), cap below the flood", "sync", sync_size, sync_size // 5),
        # Every counter of the flood is unflushed when the cap is passed: eviction must then
        # keep them all (and the counters of the request being decided) or hits are lost.
        Flood("sync mode, cap passed before any flush", "sync", 4_096, 1_000, sync_interval=2.0),
    ]


def flood_values(tag: str, count: int) -> Iterator[str]:
    return (f"{tag}{index:08d}" for index in range(count))


def batches(tag: str, values: int) -> Iterator[bytes]:
    """Requests of up to 64 descriptors, each value ``<tag><index>`` used once."""
    for first in range(0, values, PER_REQUEST):
        last = min(values, first + PER_REQUEST)
        yield encode_request(DOMAIN, ([(KEY, f"{tag}{index:08d}")] for index in range(first, last)))


async def send_all(address: str, requests: Iterator[bytes], sent: Sent, watch: SidecarProcess) -> None:
    """``IN_FLIGHT`` lanes take the next request until none is left; a sampler records peaks."""
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        call = channel.unary_unary(METHOD)
        done = asyncio.Event()

        async def lane() -> None:
            for payload in requests:
                sent.calls += 1
                try:
                    answer = await call(payload, timeout=CALL_TIMEOUT)
                except grpc.aio.AioRpcError as error:
                    name = error.code().name
                    sent.errors[name] = sent.errors.get(name, 0) + 1
                    continue
                if overall_code(answer) == OK:
                    sent.ok += 1
                else:
                    sent.other += 1

        async def sampler() -> None:
            while not done.is_set():
                with contextlib.suppress(OSError):
                    figures = await asyncio.to_thread(scrape, watch.metrics_url)
                    sent.peak_counters = max(sent.peak_counters, figures.get("ratelimit_sidecar_counters", 0.0))
                sent.peak_rss = max(sent.peak_rss, rss(watch.pid))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(done.wait(), 0.5)

        sampling = asyncio.create_task(sampler())
        try:
            await asyncio.gather(*(lane() for _ in range(IN_FLIGHT)))
        finally:
            done.set()
            await sampling


WARM_VALUES = 4 * PER_REQUEST
WARM_REPEATS = 4


def run_flood(context: Context, flood: Flood, config: Path, index: int) -> Row:
    where = context.directory / f"flood-{index}"
    where.mkdir(parents=True, exist_ok=True)
    args = ["--config", str(config), "--max-counters", str(flood.cap), "--watch-config", "false"]
    prefix = f"flood{secrets.token_hex(3)}"
    tag = f"{index}{secrets.token_hex(2)}-"
    children: list[Child] = []
    with process_group() as group:
        try:
            redis = None
            if flood.backend == "sync":
                redis = group.start_ready(lambda: pin(RedisProcess(where), context.server_cpus))
                children.append(redis)
                args += ["--backend", "redis", "--redis-url", redis.url, "--mode", "sync", "--redis-prefix", prefix]
                if flood.sync_interval is not None:
                    args += ["--sync-interval", str(flood.sync_interval)]
            sidecar = start_sidecar(group, context, "sidecar", args, where)
            children.append(sidecar)
            # Warm up: the first calls import and allocate what every later call reuses.
            sent = Sent()
            with client_cpus(context.client_cpus):
                warm = list(batches("w" + tag, WARM_VALUES)) * WARM_REPEATS
                uvloop.run(send_all(sidecar.address, iter(warm), sent, sidecar))
            time.sleep(0.5)
            before = scrape(sidecar.metrics_url)
            rss_before = rss(sidecar.pid)
            sent = Sent()
            started = time.monotonic()
            with client_cpus(context.client_cpus):
                uvloop.run(send_all(sidecar.address, batches(tag, flood.values), sent, sidecar))
            elapsed = time.monotonic() - started
            accounting = None
            if redis is not None:
                drained = wait_for(
                    lambda: scrape(sidecar.metrics_url).get("ratelimit_sidecar_pending_hits", 1) == 0, 15
                )
                accounting = account(config, redis.port, prefix, tag=tag, values=flood.values, drained=drained)
            time.sleep(0.5)
            after = scrape(sidecar.metrics_url)
            rss_after = rss(sidecar.pid)
            hwm = proc_status(sidecar.pid, "VmHWM") or 0
            # Serving still: one health call (0.5 s) can miss on a loaded machine right after the
            # flood; a sidecar that stopped serving does not start again within SERVING_WAIT.
            alive = sidecar.alive() and wait_for(sidecar.ready, SERVING_WAIT)
        except Exception as error:
            return failed_row(AREA, f"flood of unique values: {flood.name}", error, children)
    return judge(
        flood,
        sent,
        elapsed=elapsed,
        before=before,
        after=after,
        memory=(rss_before, rss_after, hwm),
        alive=alive,
        accounting=accounting,
    )


@dataclass(frozen=True)
class Accounting:
    admitted: int
    held: int
    lost: int
    extra: int
    wrong: int
    drained: bool


def account(config: Path, port: int, prefix: str, *, tag: str, values: int, drained: bool) -> Accounting:
    """Per counter, the hits the sidecar admitted (every call was OK) against what Redis holds."""
    names = CounterNames(config, DOMAIN)
    expected = {names.digest([(KEY, f"w{tag}{index:08d}")]): WARM_REPEATS for index in range(WARM_VALUES)}
    expected.update((names.digest([(KEY, value)]), 1) for value in flood_values(tag, values))
    held = redis_counts(port, prefix)
    lost, extra, wrong = compare_counts(expected, held)
    return Accounting(sum(expected.values()), sum(held.values()), lost, extra, wrong, drained)


EVICTIONS = "ratelimit_sidecar_evictions_total"


def cap_problems(flood: Flood, sent: Sent, counters_before: float, live: float, evictions: float) -> list[str]:
    """How live counters and evictions differ from what the cap promises."""
    problems = []
    if flood.backend == "memory":
        expected_live = min(flood.values + counters_before, flood.cap)
        if live != expected_live:
            problems.append(f"{live:.0f} live counters, expected {expected_live:.0f}")
        expected_evictions = max(0.0, flood.values + counters_before - flood.cap)
        if evictions != expected_evictions:
            problems.append(f"{evictions:.0f} evictions, expected {expected_evictions:.0f}")
        if sent.peak_counters > flood.cap:
            problems.append(f"live counters peaked at {sent.peak_counters:.0f} > cap {flood.cap}")
        return problems
    # Sync mode evicts only flushed counters, down to 90 % of the cap: live may pass the
    # cap by what one flush interval admits, never by the flood.
    if not flood.flushes_during_flood:
        return problems
    if live > flood.cap:
        problems.append(f"{live:.0f} live counters after the flood > cap {flood.cap}")
    if sent.peak_counters > 1.5 * flood.cap:
        problems.append(f"live counters peaked at {sent.peak_counters:.0f} > 1.5 x cap {flood.cap}")
    if evictions < flood.values - flood.cap:
        problems.append(f"only {evictions:.0f} evictions for {flood.values} values and a cap of {flood.cap}")
    return problems


def judge(
    flood: Flood,
    sent: Sent,
    *,
    elapsed: float,
    before: dict[str, float],
    after: dict[str, float],
    memory: tuple[int, int, int],
    alive: bool,
    accounting: Accounting | None,
) -> Row:
    rss_before, rss_after, hwm = memory
    counters_before = before.get("ratelimit_sidecar_counters", 0.0)
    live = after.get("ratelimit_sidecar_counters", 0.0)
    added = max(1.0, live - counters_before)
    evictions = after.get(EVICTIONS, 0.0) - before.get(EVICTIONS, 0.0)
    growth = rss_after - rss_before
    budget = flood.cap * BUDGET_BYTES_PER_COUNTER + BASELINE_SLACK
    problems = []
    if not alive:
        problems.append("the sidecar died or stopped serving")
    if sent.errors or sent.ok != sent.calls:
        problems.append(f"{sent.calls - sent.ok} of {sent.calls} calls not OK ({sent.errors or 'OVER_LIMIT'})")
    problems += cap_problems(flood, sent, counters_before, live, evictions)
    if growth > budget or hwm - rss_before > budget:
        problems.append(f"RSS grew {growth / MIB:.0f} MiB (peak {(hwm - rss_before) / MIB:.0f}) > {budget / MIB:.0f}")
    if accounting is not None:
        if not accounting.drained:
            problems.append("pending hits did not drain within 15 s")
        if accounting.lost or accounting.extra:
            problems.append(
                f"Redis lacks {accounting.lost} admitted hits and holds {accounting.extra} extra "
                f"({accounting.wrong} counters wrong)"
            )
    per_counter = growth / added
    figures: dict[str, float] = {
        "values": flood.values,
        "max_counters": flood.cap,
        "calls": sent.calls,
        "seconds": round(elapsed, 1),
        "keys_per_second": round(flood.values / elapsed),
        "live_counters": live,
        "peak_live_counters": sent.peak_counters,
        "evictions": evictions,
        "rss_before_mib": round(rss_before / MIB, 1),
        "rss_after_mib": round(rss_after / MIB, 1),
        "rss_peak_mib": round(hwm / MIB, 1),
        "bytes_per_live_counter": round(per_counter),
        "budget_mib": round(budget / MIB, 1),
    }
    notes = (
        f"{flood.values:,} distinct values in {sent.calls:,} calls of {PER_REQUEST} descriptors "
        f"({flood.values / elapsed:,.0f} keys/s); live {live:,.0f} (peak sampled {sent.peak_counters:,.0f}), "
        f"evicted {evictions:,.0f}; RSS {rss_before / MIB:.0f} -> {rss_after / MIB:.0f} MiB "
        f"(peak {hwm / MIB:.0f}), {per_counter:.0f} B per live counter, budget {budget / MIB:.0f} MiB"
    )
    hits_lost = None
    if accounting is not None:
        hits_lost = accounting.lost
        figures.update(
            admitted_hits=accounting.admitted,
            redis_hits=accounting.held,
            hits_extra=accounting.extra,
            counters_wrong=accounting.wrong,
        )
        notes += f"; Redis holds {accounting.held:,} hits for {accounting.admitted:,} admitted"
    if problems:
        notes = "; ".join(problems) + " | " + notes
    return Row(
        AREA,
        f"flood of unique values: {flood.name}",
        load=f"{flood.values:,} keys, --max-counters {flood.cap:,}",
        hits_lost=hits_lost,
        ok=not problems,
        notes=notes,
        figures=figures,
    )


def run(context: Context) -> list[Row]:
    check_encoding()
    floods = plan(context.size)
    config_dir = context.directory / "flood-config"
    config_dir.mkdir(parents=True, exist_ok=True)
    (config_dir / "flood.yaml").write_text(CONFIG)
    # Every counter must live in one window (a day, on the Unix clock): if the flood could
    # cross midnight UTC, start after it.
    avoid_window_end(UNIT_SECONDS, 90 if context.quick else 300)
    rows = []
    for index, flood in enumerate(floods):
        if flood.backend == "sync" and not redis_available():
            rows.append(skipped_row(AREA, f"flood of unique values: {flood.name}", "redis-server is not installed"))
            continue
        rows.append(run_flood(context, flood, config_dir, index))
    return rows


if __name__ == "__main__":
    raise SystemExit(main(run))
