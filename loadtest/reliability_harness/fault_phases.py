"""One phase of the faults scenario (``faults.py``): its traffic, the fault injectors, the load
with a fault in the middle, what the sidecars said meanwhile, and what Redis holds after.

A phase offers open-loop gRPC load (:data:`RATE` calls per second over :data:`LANES` lanes)
to the replicas, drawn by :class:`Traffic` from fresh counters (three "hot" ones far below
their limit, three "near" ones whose limits :func:`near_limits` sizes to be crossed before,
during and after the fault); :class:`Faults` starts and ends each fault on the durable
redis-server or the proxy in front of it; :func:`run_phase` runs the load while the events
happen, sampling each sidecar's ``redis_up`` and the machine's CPU; :func:`drained` and
:func:`account` compare what was admitted with what Redis holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from loadtest.reliability_harness.support import (
    OK,
    Calls,
    CounterNames,
    CpuWatch,
    ProcessGroup,
    ProxyProcess,
    RedisProcess,
    SidecarProcess,
    compare_counts,
    decision_buckets,
    drive,
    encode_request,
    pin,
    redis_counts,
    scrape,
)

DOMAIN = "faults"
UNIT_SECONDS = 86_400
HOT_LIMIT = 1_000_000
RATE = 400.0
"""Calls per second offered to the two replicas together (open loop)."""
LANES = 48
CALL_TIMEOUT = 2.0
"""A call unanswered after this is an error (its outcome unknown): none is expected."""
RECOVERY = 1.0
"""Seconds after a fault ends whose calls still count as "during the fault"."""
LATE_EVENTS = 30.0
"""Seconds a phase's load may outlast its plan when its events run late (a slow scrape or restart)."""
DRAIN_TIMEOUT = 20.0
SYNC_INTERVAL = 0.05
SYNC_MAX_OVERSHOOT = 0.05
REPLICAS = 2
SLOW_DELAY = 0.025
HOT = 3
NEAR = ("near_a", "near_b", "near_c")
WEIGHTS = {"hot": 0.60, "near": 0.25, "both": 0.15}
"""Kinds of call: one hot counter (1-3 hits), one near counter (1 hit), or both (1 hit, all or nothing)."""
BACKGROUND_TIMEOUT = 1.0
"""The sidecar's timeout of background Redis calls and its socket timeout (``max(1 s, 2 x --redis-timeout)``)."""
SMOKE_TOGETHER = 4
"""Smoke size: configurations run side by side (all four of ``faults.CONFIGURATIONS``)."""


@dataclass(frozen=True)
class Timing:
    pre: float
    fault: float
    """How long most faults last."""
    post: float
    kill_post: float
    """After a replica is killed: long enough for the survivor to see it gone (3 missed beats)."""
    pause: float = 0.8
    """``redis_pause``: shorter than the background timeout, so every late answer arrives."""
    together: int = 1
    """Configurations whose sidecar pairs meet each fault side by side (one timeline, one load each)."""
    rate: float = RATE
    """Calls per second offered to each configuration's pair."""

    @classmethod
    def of(cls, quick: bool, smoke: bool = False) -> Timing:
        """Full, quick, or smoke (the tests': each fault still long enough for calls to meet it
        and for Redis to restart; the stall still outlasts the background timeout, the pause not).
        Smoke runs the four configurations side by side, each at a quarter of :data:`RATE` (the
        machine gets the same load as one configuration at full rate): every configuration still
        meets every fault, and the near limits scale with the rate so they are crossed at the
        same moments. (The replica kill, one pair alone, keeps :data:`RATE`: ``faults.kill_setup``.)"""
        if smoke:
            return cls(0.5, 1.0, 0.6, 4.5, together=SMOKE_TOGETHER, rate=RATE / SMOKE_TOGETHER)
        return cls(0.8, 1.5, 1.0, 4.5) if quick else cls(2.0, 5.0, 3.0, 8.0)

    def duration(self, fault: str) -> float:
        if fault == "redis_pause":
            return self.pause
        if fault == "redis_stall":
            return max(self.fault, 2.0 * BACKGROUND_TIMEOUT)
        return self.fault

    def total(self, fault: str) -> float:
        return self.pre + self.duration(fault) + self.post


def near_rate(rate: float = RATE) -> float:
    """Hits per second offered to each near counter when a pair gets ``rate`` calls per second."""
    return rate * (WEIGHTS["near"] + WEIGHTS["both"]) / len(NEAR)


def near_limits(timing: Timing) -> dict[str, int]:
    # Sized on the common fault duration; shorter or longer faults move the crossings a little.
    """Limits reached before the fault, in its middle, and after it (at the offered rate)."""
    moments = (timing.pre / 2, timing.pre + timing.fault / 2, timing.pre + timing.fault + timing.post / 2)
    return {name: max(4, round(near_rate(timing.rate) * moment)) for name, moment in zip(NEAR, moments, strict=True)}


def config_text(limits: dict[str, int]) -> str:
    lines = [
        f"domain: {DOMAIN}",
        "descriptors:",
        "  - key: hot",
        f"    rate_limit: {{unit: day, requests_per_unit: {HOT_LIMIT}}}",
    ]
    for name, limit in limits.items():
        lines += [f"  - key: {name}", f"    rate_limit: {{unit: day, requests_per_unit: {limit}}}"]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------
# Traffic of one phase
# ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Payload:
    data: bytes
    spends: tuple[tuple[str, int], ...]
    """``(counter digest, hits)`` the call spends when it is admitted."""


class Traffic:
    """The calls of one phase: fresh counter values, weighted kinds, a target per call."""

    def __init__(self, names: CounterNames, tag: str, seed: int) -> None:
        self.rng = random.Random(seed)
        self.hot = [[("hot", f"{tag}-h{index}")] for index in range(HOT)]
        self.near = {name: [(name, tag)] for name in NEAR}
        self.digest_of = {tuple(entries): names.digest(entries) for entries in [*self.hot, *self.near.values()]}
        self.payloads: list[Payload] = []
        self.by_kind: dict[str, list[int]] = {kind: [] for kind in WEIGHTS}
        for entries in self.hot:
            for hits in (1, 2, 3):
                self._add("hot", [entries], hits)
        for entries in self.near.values():
            self._add("near", [entries], 1)
            for hot in self.hot:
                self._add("both", [hot, entries], 1)
        self.targets = list(range(REPLICAS))
        """Replicas the next calls may go to (the SIGKILL scenario drops the dead one)."""

    def _add(self, kind: str, descriptors: list[list[tuple[str, str]]], hits: int) -> None:
        spends = tuple((self.digest_of[tuple(entries)], hits) for entries in descriptors)
        self.by_kind[kind].append(len(self.payloads))
        self.payloads.append(Payload(encode_request(DOMAIN, descriptors, hits), spends))

    @property
    def digests(self) -> set[str]:
        return set(self.digest_of.values())

    def digest(self, name: str) -> str:
        return self.digest_of[tuple(self.near[name])]

    def choose(self) -> tuple[int, int]:
        kind = self.rng.choices(list(WEIGHTS), weights=list(WEIGHTS.values()))[0]
        return self.rng.choice(self.targets), self.rng.choice(self.by_kind[kind])

    def admitted(self, calls: Calls, target: int | None = None, until: float | None = None) -> dict[str, int]:
        """Hits per counter of the calls answered OK (by ``target``; answered by ``until``)."""
        totals = dict.fromkeys(self.digests, 0)
        for index in range(len(calls)):
            if calls.code[index] != OK or (target is not None and calls.target[index] != target):
                continue
            if until is not None and calls.sent[index] + calls.latency[index] > until:
                continue
            for digest, hits in self.payloads[calls.payload[index]].spends:
                totals[digest] += hits
        return totals

    def offered(self, calls: Calls, digest: str) -> int:
        return sum(
            hits
            for index in range(len(calls))
            for spent, hits in self.payloads[calls.payload[index]].spends
            if spent == digest
        )


# ---------------------------------------------------------------------------------
# The fault injectors
# ---------------------------------------------------------------------------------


@dataclass
class Faults:
    """What the faults act on: the (durable) redis-server and the proxy in front of it."""

    redis: RedisProcess
    proxy: ProxyProcess
    failed_restarts: list[int | None] = field(default_factory=list)

    def begin(self, name: str) -> None:
        """Start the fault; quick (no waiting), so it runs on the event loop's thread."""
        if name == "redis_kill":
            self.redis.kill()
        elif name in {"redis_pause", "redis_stall"}:
            self.redis.signal(signal.SIGSTOP)
        elif name == "redis_slow":
            self.proxy.command(f"delay {SLOW_DELAY}")
        elif name == "network_refused":
            self.proxy.command("refuse")
        else:
            raise ValueError(name)

    def end(self, name: str) -> None:
        """End the fault. A restarted redis-server is started here, on the calling thread: a
        child started from a worker thread would get SIGTERM when that thread ends (its
        ``PR_SET_PDEATHSIG`` parent is the thread); :meth:`settle` waits for it elsewhere."""
        if name == "redis_kill":
            self.restart_redis()
        elif name in {"redis_pause", "redis_stall"}:
            self.redis.signal(signal.SIGCONT)
        elif name == "redis_slow":
            self.proxy.command("delay 0")
        elif name == "network_refused":
            self.proxy.command("accept")

    def restart_redis(self, attempts: int = 3) -> None:
        """Start the killed redis-server again. Once in a CI run a restart exited at once
        without a line of output (exit code unrecorded); it is retried, and the exit
        codes of failed starts are kept in :attr:`failed_restarts` for the report."""
        for _ in range(attempts):
            self.redis.start()
            time.sleep(0.05)
            if self.redis.alive():
                return
            assert self.redis.process is not None
            self.failed_restarts.append(self.redis.process.returncode)

    def settle(self, name: str) -> None:
        """Block until the fault's end is in effect (a restarted Redis answers)."""
        if name == "redis_kill":
            self.redis.wait_ready()


def durable_redis(data: Path, logs: Path, cpus: tuple[int, ...] | None) -> RedisProcess:
    """redis-server whose acknowledged writes survive SIGKILL (AOF, fsync on every write)."""
    redis = RedisProcess(data)
    redis.argv += ["--appendonly", "yes", "--appendfsync", "always"]
    redis.log_path = logs / "redis.log"
    pin(redis, cpus)
    return redis


# ---------------------------------------------------------------------------------
# One phase: load, a fault in the middle, the sidecars' view meanwhile
# ---------------------------------------------------------------------------------


@dataclass
class Phase:
    name: str
    traffic: Traffic
    calls: Calls = field(default_factory=Calls)
    marks: dict[str, float] = field(default_factory=dict)
    down: dict[int, float] = field(default_factory=dict)
    """Seconds each replica reported ``redis_up`` 0 during the phase (sampled)."""
    drain_seconds: float | None = None
    at_drain: tuple[int, int, int] = (0, 0, 0)
    final: tuple[int, int, int] | None = None
    held: int = 0
    admitted_total: int = 0
    cpu: CpuWatch | None = None
    histograms: dict[str, dict[float, float]] = field(default_factory=dict)
    """The sidecars' decision-time histograms (summed) at the fault's start and after its recovery."""
    failed_restarts: list[int | None] = field(default_factory=list)
    """Exit codes of redis-server restarts that died at once and were retried."""

    def decisions(self) -> dict[float, float]:
        """Server-side decision times of the calls decided from the fault's start to its recovery's end."""
        before, after = self.histograms.get("fault", {}), self.histograms.get("after", {})
        return {bound: after[bound] - before.get(bound, 0.0) for bound in after}


async def watch(sidecars: Sequence[SidecarProcess], phase: Phase, stop: asyncio.Event, pids: Sequence[int]) -> None:
    """Every 0.25 s: each sidecar's ``redis_up``, and the machine's CPU."""
    phase.cpu = CpuWatch(pids)
    last = time.perf_counter()
    while not stop.is_set():
        phase.cpu.sample()
        now = time.perf_counter()
        for index, sidecar in enumerate(sidecars):
            with contextlib.suppress(OSError):
                figures = await asyncio.to_thread(scrape, sidecar.metrics_url, 1.0)
                if figures.get("ratelimit_sidecar_redis_up", 1.0) == 0:
                    phase.down[index] = phase.down.get(index, 0.0) + (now - last)
        last = now
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.25)
    phase.cpu.sample()


Event = tuple[float, str, Callable[[], None], Callable[[], None] | None]
"""``(at, mark, action, wait)``: ``at`` s into the phase run ``action`` (quick, on the loop's
thread), then ``wait`` (blocking, in a worker thread) if given; both moments are marked."""


async def run_phase(
    phase: Phase,
    sidecars: Sequence[SidecarProcess],
    seconds: float,
    events: Sequence[Event],
    pids: Sequence[int],
    *,
    rate: float = RATE,
) -> None:
    """Load for ``seconds`` while the ``events`` happen."""
    await run_phases([(phase, sidecars)], seconds, events, pids, rate=rate)


async def run_phases(
    runs: Sequence[tuple[Phase, Sequence[SidecarProcess]]],
    seconds: float,
    events: Sequence[Event],
    pids: Sequence[int],
    *,
    rate: float = RATE,
) -> None:
    """Load on each ``(phase, sidecars)`` pair for ``seconds`` (``rate`` calls per second each)
    while the ``events`` happen once for all of them."""
    stop = asyncio.Event()
    halt = asyncio.Event()
    """Set by the timeline when the load is to end."""
    start = time.perf_counter()

    async def histogram(sidecars: Sequence[SidecarProcess]) -> dict[float, float]:
        views = await asyncio.gather(*(asyncio.to_thread(scrape, sidecar.metrics_url, 2.0) for sidecar in sidecars))
        summed: dict[float, float] = {}
        for view in views:
            for bound, count in decision_buckets(view).items():
                summed[bound] = summed.get(bound, 0.0) + count
        return summed

    async def histograms(name: str) -> None:
        views = await asyncio.gather(*(histogram(sidecars) for _, sidecars in runs))
        for (phase, _), view in zip(runs, views, strict=True):
            phase.histograms[name] = view

    def mark(name: str) -> None:
        now = time.perf_counter()
        for phase, _ in runs:
            phase.marks[name] = now

    async def control() -> None:
        first, last = start, 0.0
        try:
            for number, (at, name, action, wait) in enumerate(events):
                # Later events keep their distance from the first one, however late that came.
                due = start + at if number == 0 else first + at - events[0][0]
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
                if number == 0:
                    await histograms("fault")
                    first = time.perf_counter()
                mark(name)
                action()
                if wait is not None:
                    await asyncio.to_thread(wait)
                mark(name + "_done")
                last = at
            # The load goes on for what the plan leaves after the last event, however late it was done.
            end = max(start + seconds, time.perf_counter() + seconds - last)
            await asyncio.sleep(max(0.0, min(RECOVERY, end - time.perf_counter() - 0.1)))
            with contextlib.suppress(OSError):
                await histograms("after")
            await asyncio.sleep(max(0.0, end - time.perf_counter()))
        finally:
            halt.set()

    watchers = [asyncio.create_task(watch(sidecars, phase, stop, pids)) for phase, sidecars in runs]
    try:
        await asyncio.gather(
            *(
                drive(
                    [sidecar.address for sidecar in sidecars],
                    [payload.data for payload in phase.traffic.payloads],
                    phase.traffic.choose,
                    phase.calls,
                    seconds=seconds + LATE_EVENTS,
                    lanes=LANES,
                    rate=rate,
                    timeout=CALL_TIMEOUT,
                    stop=halt,
                )
                for phase, sidecars in runs
            ),
            control(),
        )
    finally:
        stop.set()
        await asyncio.gather(*watchers)


def start_pairs(
    group: ProcessGroup, logs: Path, cpus: tuple[int, ...] | None, pairs: Sequence[tuple[str, list[str]]]
) -> list[list[SidecarProcess]]:
    """:data:`REPLICAS` sidecars per ``(label, serve args)``, all started at once (logs under
    ``logs/label``); returns once each counts its peers (or after 10 s): a sidecar that believes
    it is alone would meet the load with the wrong share."""

    def build(label: str, args: list[str], index: int) -> Callable[[], SidecarProcess]:
        return lambda: pin(SidecarProcess(f"sidecar-{index}", [*args, "--log-format", "json"], logs / label), cpus)

    started = group.start_all_ready([build(label, args, index) for label, args in pairs for index in range(REPLICAS)])
    deadline = time.monotonic() + 10

    def counts_its_peers(sidecar: SidecarProcess) -> bool:
        try:  # SERVING is the gRPC port; the metrics endpoint may answer a moment later
            return scrape(sidecar.metrics_url).get("ratelimit_sidecar_replicas") == REPLICAS
        except OSError:
            return False

    while time.monotonic() < deadline and not all(counts_its_peers(sidecar) for sidecar in started):
        time.sleep(0.1)
    return [started[number * REPLICAS : (number + 1) * REPLICAS] for number in range(len(pairs))]


def stop_pairs(group: ProcessGroup, pairs: Sequence[Sequence[SidecarProcess]]) -> list[dict[str, int | None]]:
    """SIGTERM each sidecar once (it drains and flushes), wait; returns each pair's exit codes.
    (A second SIGTERM could land after the sidecar removed its handler, at the very end of its drain.)"""
    for sidecars in pairs:
        for sidecar in sidecars:
            sidecar.signal(signal.SIGTERM)
    every: list[dict[str, int | None]] = []
    for sidecars in pairs:
        codes: dict[str, int | None] = {}
        for sidecar in sidecars:
            assert sidecar.process is not None
            try:
                codes[sidecar.label] = sidecar.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                sidecar.kill()
                codes[sidecar.label] = None
            with contextlib.suppress(ValueError):
                group.children.remove(sidecar)
        every.append(codes)
    return every


def drained(sidecars: Sequence[SidecarProcess], timeout: float = DRAIN_TIMEOUT) -> float | None:
    """Seconds until every sidecar has Redis up and no pending hit, three polls in a row (None: never)."""
    started = time.monotonic()
    quiet = 0
    while time.monotonic() - started < timeout:
        try:
            views = [scrape(sidecar.metrics_url, 2.0) for sidecar in sidecars]
        except OSError:
            views = []
        settled = bool(views) and all(
            view.get("ratelimit_sidecar_redis_up") == 1 and view.get("ratelimit_sidecar_pending_hits") == 0
            for view in views
        )
        quiet = quiet + 1 if settled else 0
        if quiet >= 3:
            return time.monotonic() - started
        time.sleep(0.1)
    return None


def account(phase: Phase, port: int, prefix: str) -> tuple[int, int, int]:
    """``(lost, extra, counters wrong)`` of the phase's counters: admitted (OK answers) vs Redis."""
    digests = phase.traffic.digests
    held = {digest: hits for digest, hits in redis_counts(port, prefix).items() if digest in digests}
    admitted = phase.traffic.admitted(phase.calls)
    phase.held = sum(held.values())
    phase.admitted_total = sum(admitted.values())
    return compare_counts(admitted, held)
