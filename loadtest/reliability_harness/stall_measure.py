"""How one hostile input weighs on a sidecar's event loop: a quiet run, then the input, same process.

:func:`measure` holds a steady probe of ``ShouldRateLimit`` calls (:class:`Probe`,
:data:`PROBE_RATE` a second over gRPC on loopback) against a running sidecar through a
quiet run and then through the input, and reads, for each of the two windows, the probe's
p50/p99/max and the sidecar's own loop-lag detector
(``ratelimit_sidecar_event_loop_lag_max_seconds``, the worst tick lateness since the
previous scrape: scraped only at the edges of the windows, so each reading covers one
window exactly). It samples the sidecar's RSS through the input (:class:`RssWatch`) and
waits, bounded, for it to come back. :func:`verdict` holds the figures to the goals of
issue 25; they are printed, not asserted.

The probe runs on its own event loop in a thread of this process; the inputs are built
before the quiet run and their replies parsed after the input, so this process does as
little as it can while it measures.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from loadtest.reliability_harness.support import (
    CHANNEL_OPTIONS,
    CODE_ERROR,
    METHOD,
    MIB,
    OK,
    Calls,
    CpuWatch,
    Row,
    SidecarProcess,
    drive,
    latency_figures,
    ms,
    overall_code,
    scrape,
    tree_rss,
)
from sidecar.client import health_status

PROBE_RATE = 200.0
"""Probe calls a second: steady and bounded, one every 5 ms across its lanes."""
PROBE_LANES = 4
PROBE_TIMEOUT = 30.0
"""Deadline of a probe call: far past any stall, so a stalled call is measured, not cut."""
PROBE_BOUND = 600.0
"""Seconds after which a probe stops by itself, whatever happens to the row."""
LAG_MAX = "ratelimit_sidecar_event_loop_lag_max_seconds"
P99_FACTOR = 2.0
"""Goal: the probe's p99 during the input within this factor of the quiet run's."""
STALL_GOAL = 0.020
"""Goal: no loop stall over 20 ms (Envoy's filter timeout is 20-25 ms: it fails open)."""
RSS_BACK = 0.10
"""Goal: RSS back within 10 % of the quiet run's after the input."""

Figures = dict[str, float]
Hostile = Callable[[], Figures]
"""Runs one input to its end (bounded) in this thread; returns figures of the input itself."""


class Probe:
    """``ShouldRateLimit`` at :data:`PROBE_RATE` on one channel, in its own thread and loop."""

    def __init__(self, address: str, request: bytes) -> None:
        self.address = address
        self.request = request
        self.calls = Calls()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._running = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._drive()), name="probe", daemon=True)

    async def _drive(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._running.set()
        await drive(
            [self.address],
            [self.request],
            lambda: (0, 0),
            self.calls,
            seconds=PROBE_BOUND,
            lanes=PROBE_LANES,
            rate=PROBE_RATE,
            timeout=PROBE_TIMEOUT,
            stop=self._stop,
        )

    def start(self) -> None:
        self._thread.start()
        if not self._running.wait(10):
            raise RuntimeError("the probe's event loop did not start")

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    def window(self, start: float, end: float) -> tuple[list[float], int]:
        """``(latencies, errors)`` of the calls sent in ``[start, end)``; a failed call's
        latency is how long it waited for its failure.

        A lane waits for its call, so while the sidecar stalls fewer calls are sent than
        scheduled (their slots are skipped): compare ``len(latencies)`` with
        :func:`scheduled`, which the row prints."""
        calls = self.calls
        chosen = [index for index, sent in enumerate(calls.sent) if start <= sent < end]
        errors = sum(1 for index in chosen if calls.code[index] == CODE_ERROR)
        return [calls.latency[index] for index in chosen], errors


def scheduled(start: float, end: float) -> int:
    """Probe calls due in ``[start, end)`` at :data:`PROBE_RATE`."""
    return round((end - start) * PROBE_RATE)


class RssWatch:
    """The largest RSS of ``pid`` and its children (the quota worker) while it runs, sampled every
    20 ms in a thread, from ``before`` on."""

    def __init__(self, pid: int, before: int) -> None:
        self.pid = pid
        self.peak = before
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="rss-watch", daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, tree_rss(self.pid))

    def __enter__(self) -> RssWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self.peak = max(self.peak, tree_rss(self.pid))


def worst_stall(sidecar: SidecarProcess) -> float:
    """The loop-lag detector's largest lateness since the previous call (NaN when not exposed)."""
    return scrape(sidecar.metrics_url, timeout=60).get(LAG_MAX, math.nan)


def rss_after(pid: int, before: int, limit: float) -> tuple[int, float]:
    """``(RSS, seconds waited)``: polled until within :data:`RSS_BACK` of ``before`` or ``limit`` s."""
    started = time.monotonic()
    while True:
        now = tree_rss(pid)
        waited = time.monotonic() - started
        if now <= before * (1 + RSS_BACK) or waited >= limit:
            return now, waited
        time.sleep(0.2)


def still_serving(sidecar: SidecarProcess, request: bytes) -> bool:
    """Health SERVING and one more ``ShouldRateLimit`` answered OK."""
    try:
        if health_status(sidecar.address, timeout=5) != "SERVING":
            return False
        with grpc.insecure_channel(sidecar.address, options=CHANNEL_OPTIONS) as channel:
            return overall_code(channel.unary_unary(METHOD)(request, timeout=5)) == OK
    except grpc.RpcError:
        return False


@dataclass(frozen=True)
class Timing:
    quiet: float
    """Seconds of the quiet run."""
    settle: float
    """At most this long for RSS to come back after the input."""


def measure(sidecar: SidecarProcess, probe_request: bytes, hostile: Hostile, timing: Timing) -> Figures:
    """The quiet run, then ``hostile``, under the probe; every figure of the row."""
    cpu = CpuWatch([sidecar.pid])
    probe = Probe(sidecar.address, probe_request)
    probe.start()
    try:
        time.sleep(0.5)  # the probe's channel connected and warm
        worst_stall(sidecar)  # starts the detector's max over
        cpu.sample()
        quiet_start = time.perf_counter()
        time.sleep(timing.quiet)
        quiet_end = time.perf_counter()
        quiet_stall = worst_stall(sidecar)
        before = tree_rss(sidecar.pid)
        cpu.sample()
        input_start = time.perf_counter()
        with RssWatch(sidecar.pid, before) as watch:
            figures = dict(hostile())
            input_end = time.perf_counter()
            stall = worst_stall(sidecar)
        cpu.sample()
    finally:
        probe.stop()
    after, waited = rss_after(sidecar.pid, before, timing.settle)
    quiet_latencies, quiet_errors = probe.window(quiet_start, quiet_end)
    latencies, errors = probe.window(input_start, input_end)
    figures.update(latency_figures(quiet_latencies, "quiet_"))
    figures.update(latency_figures(latencies))
    figures.update(
        {
            "quiet_calls": len(quiet_latencies),
            "quiet_scheduled": scheduled(quiet_start, quiet_end),
            "quiet_errors": quiet_errors,
            "calls": len(latencies),
            "scheduled": scheduled(input_start, input_end),
            "errors": errors,
            "input_seconds": round(input_end - input_start, 2),
            "quiet_stall_ms": ms(quiet_stall),
            "stall_ms": ms(stall),
            "rss_before_mib": round(before / MIB, 1),
            "rss_peak_mib": round(watch.peak / MIB, 1),
            "rss_after_mib": round(after / MIB, 1),
            "rss_settle_seconds": round(waited, 1),
            "other_cores_quiet": round(cpu.other_cores(quiet_start, quiet_end), 2),
            "other_cores_input": round(cpu.other_cores(input_start, input_end), 2),
            "serving_after": float(still_serving(sidecar, probe_request)),
        }
    )
    return figures


def problems(figures: Figures) -> list[str]:
    """What must hold whatever the machine: every probe call answered, the sidecar serving after."""
    found = []
    if figures["errors"] or figures["quiet_errors"]:
        found.append(f"{figures['errors'] + figures['quiet_errors']:.0f} probe calls failed")
    if not figures["calls"]:
        found.append("no probe call during the input")
    if not figures["serving_after"]:
        found.append("not serving after the input")
    return found


def goals_missed(figures: Figures) -> list[str]:
    """The measured goals of issue 25 this row missed, each with its figures (reported, not a failure)."""
    missed = []
    if figures["p99_ms"] > P99_FACTOR * figures["quiet_p99_ms"]:
        missed.append(f"p99 {figures['p99_ms']:g} ms over {P99_FACTOR:g}x the quiet {figures['quiet_p99_ms']:g} ms")
    if not figures["stall_ms"] <= ms(STALL_GOAL):  # NaN (no detector) misses it too
        missed.append(f"stall {figures['stall_ms']:g} ms over {ms(STALL_GOAL):g} ms")
    if figures["rss_after_mib"] > figures["rss_before_mib"] * (1 + RSS_BACK):
        missed.append(
            f"RSS {figures['rss_after_mib']:g} MiB not back within {RSS_BACK:.0%} of {figures['rss_before_mib']:g}"
        )
    return missed


def verdict(area: str, scenario: str, figures: Figures, about_input: str) -> Row:
    """The row: the probe quiet -> during, the worst stall, RSS before/peak/after, the goals."""
    f = figures
    load = (
        f"probe {PROBE_RATE:.0f}/s: p50/p99/max {f['quiet_p50_ms']:g}/{f['quiet_p99_ms']:g}/{f['quiet_max_ms']:g}"
        f" → {f['p50_ms']:g}/{f['p99_ms']:g}/{f['max_ms']:g} ms"
    )
    failed = problems(figures)
    busy = max(f["other_cores_quiet"], f["other_cores_input"])
    notes = (
        f"worst loop stall {f['quiet_stall_ms']:g} → {f['stall_ms']:g} ms; "
        f"RSS {f['rss_before_mib']:g} → {f['rss_peak_mib']:g} → {f['rss_after_mib']:g} MiB; "
        f"{f['calls']:,.0f} of {f['scheduled']:,.0f} scheduled probe calls sent in {f['input_seconds']:g} s "
        f"(quiet: {f['quiet_calls']:,.0f} of {f['quiet_scheduled']:,.0f}), {f['errors']:.0f} failed; {about_input}"
        + (f"; other processes used {busy:.1f} cores" if busy >= 0.3 else "")
    )
    if failed:
        notes = "; ".join(failed) + " | " + notes
    return Row(area, scenario, load=load, ok=not failed, notes=notes, figures=figures, goals_missed=goals_missed(f))
