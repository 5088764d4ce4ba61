"""Faults under load: Redis killed, paused, stalled, slow or unreachable, and a replica killed.

Two real sidecar processes share one real redis-server through a small TCP proxy
(``tcp_proxy.py``, its own process) and get continuous open-loop gRPC load from the
harness: three "hot" counters far below their limit and three "near" counters whose
limits are sized so one is over before the fault, one crosses its limit during it and
one after it (escalations and certain rejections all happen around the fault). Every
configuration (sync mode with ``--redis-failure-mode`` ``local``, ``open``, ``closed``,
and strict mode with ``local``) gets every fault mid-load, one phase each, with fresh
counters per phase (quick and full runs: one configuration after the other; the tests'
smoke size: all four pairs side by side on one fault timeline, each at a quarter of the rate;
the replica kill below always runs one pair at the full rate):

``redis_kill``
    redis-server SIGKILLed, restarted on the same port. It runs with ``appendonly yes``
    and ``appendfsync always`` (its files on tmpfs when there is one), so what it
    acknowledged survives: without persistence a killed Redis loses every counter,
    and "Redis equals admitted" could not hold whatever the sidecars do.
``redis_pause``
    redis-server SIGSTOPped for 0.8 s, then SIGCONTed: connections stay open, nothing
    answers, and what was sent meanwhile runs late but within the sidecars' 1 s
    background timeout (the late-answer corrections are exercised).
``redis_stall``
    The same for 2 s or more: past the background timeout, so the sidecars give up
    and drop connections whose scripts Redis still runs when it wakes up.
``redis_slow``
    The proxy delays every chunk by 25 ms each way: past ``--redis-timeout`` (20 ms).
``network_refused``
    The proxy stops listening and resets every connection (connection refused), then
    listens again.

Per phase the row checks that every call was answered (no gRPC error) and reports how
long calls took from the fault's start to a second after its end against two latency
goals, shown as "goal missed" but never failing the row (a loaded 2-core machine misses
them by itself): the client's p99 under 50 ms (not judged while other processes use more
than half the machine), and the sidecars' own decision time
(``ratelimit_sidecar_decision_seconds``) at p99 within the 25 ms bucket: the request
path must not wait on Redis beyond ``--redis-timeout``. Then, once the sidecars say
nothing is pending (``ratelimit_sidecar_pending_hits`` 0 with Redis up) and again
after both were stopped with SIGTERM (final flush), Redis must hold exactly the hits
the harness saw admitted, per counter (keys computed as the sidecar does):
``hits_lost`` is what Redis lacks (always 0), ``hits_extra`` what it holds beyond.
Faults that cut connections while scripts are on the wire (kill, stall, refused) may
leave ``hits_extra`` above 0: README ("When Redis misbehaves") documents that a
script whose connection broke may still have run; the row reports it.

Last, a replica is SIGKILLed mid-load (sync mode): its unflushed hits are the only
loss. The loss is measured (hits the dead replica answered OK minus what Redis got
from it) and bounded by what it admitted in the last two ``--sync-interval`` (50 ms)
before dying (one interval of pending hits plus one flush on the wire); the survivor
must keep answering and keep the near counters within their limit plus sync mode's
bound plus that loss.
"""

from __future__ import annotations

import functools
import math
import secrets
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import uvloop

from loadtest.reliability_harness.fault_phases import (
    BACKGROUND_TIMEOUT,
    DOMAIN,
    DRAIN_TIMEOUT,
    RATE,
    RECOVERY,
    REPLICAS,
    SLOW_DELAY,
    SYNC_INTERVAL,
    SYNC_MAX_OVERSHOOT,
    UNIT_SECONDS,
    Event,
    Faults,
    Phase,
    Timing,
    Traffic,
    account,
    config_text,
    drained,
    durable_redis,
    near_limits,
    run_phase,
    run_phases,
    start_pairs,
    stop_pairs,
)
from loadtest.reliability_harness.support import (
    CODE_ERROR,
    OK,
    Child,
    Context,
    CounterNames,
    ProcessGroup,
    ProxyProcess,
    Row,
    SidecarProcess,
    avoid_window_end,
    bucket_quantile,
    client_cpus,
    failed_row,
    latency_figures,
    main,
    ms,
    percentile,
    pin,
    process_group,
    redis_available,
    redis_counts,
    skipped_row,
)

AREA = "faults"
REDIS_TIMEOUT = 0.02
"""``--redis-timeout`` here: the budget Envoy's 25 ms deadline leaves (less the 5 ms margin).
This area's calls carry 2 s deadlines (an unanswered call would be an unknown outcome),
so without it they would wait the default bound, 100 ms; ``deadline-budget`` runs the
defaults with Envoy's deadline on every call."""
P99_BUDGET = 0.050
"""p99 of calls during a fault: :data:`REDIS_TIMEOUT` plus this noisy 2-core box's scheduling."""
SLOW_CALL = 0.025
"""Envoy's ``timeout`` in ``envoy/sidecar.yaml``: calls slower than this would fail open."""
SERVER_P99_BUDGET = 0.025
"""p99 of the sidecars' own decision time (``ratelimit_sidecar_decision_seconds``, histogram bucket)
during a fault: the 20 ms budget (:data:`REDIS_TIMEOUT`; the default was 5 ms in the 10 ms bucket
before issue 17) fits in the 25 ms bucket; unlike the client's figure it barely depends on other
processes' CPU use."""
DISTURBED_CPU = 0.5
"""Other processes using more cores than this during a fault make its latency verdict moot."""
KILL_AFTER = 1.5
"""Seconds of load before a replica is killed (at least)."""
CONFIGURATIONS = (("sync", "local"), ("sync", "open"), ("sync", "closed"), ("strict", "local"))
FAULTS = {
    "redis_kill": "redis-server SIGKILLed, restarted on its port (AOF, fsync always)",
    "redis_pause": f"redis-server SIGSTOPped, SIGCONTed within the {BACKGROUND_TIMEOUT:g} s background timeout",
    "redis_stall": f"redis-server SIGSTOPped past the {BACKGROUND_TIMEOUT:g} s background timeout, then SIGCONTed",
    "redis_slow": f"{SLOW_DELAY * 1000:.0f} ms added each way by a proxy",
    "network_refused": "connections to Redis refused and reset",
}
BREAKS_CONNECTIONS = frozenset({"redis_kill", "redis_stall", "network_refused"})
"""Faults that cut connections with scripts on the wire. README ("When Redis misbehaves"): such a
script may still have run while the sidecar answered from its failure mode and owes the hits, so
they can be counted once more than admitted (errs toward rejecting). Hits lost must still be 0."""


# ---------------------------------------------------------------------------------
# A configuration: two sidecars, every fault in turn
# ---------------------------------------------------------------------------------


@dataclass
class Setup:
    context: Context
    group: ProcessGroup
    faults: Faults
    config: Path
    names: CounterNames
    timing: Timing
    logs: Path


def sidecar_args(setup: Setup, mode: str, failure: str, prefix: str) -> list[str]:
    return [
        "--config", str(setup.config),
        "--watch-config", "false",
        "--backend", "redis",
        "--redis-url", f"redis://127.0.0.1:{setup.faults.proxy.port}",
        "--mode", mode,
        "--redis-failure-mode", failure,
        "--redis-prefix", prefix,
        "--sync-interval", str(SYNC_INTERVAL),
        "--sync-max-overshoot", str(SYNC_MAX_OVERSHOOT),
        "--redis-timeout", str(REDIS_TIMEOUT),
    ]  # fmt: skip


@dataclass
class Configuration:
    """One configuration's pair of sidecars, its counters' prefix and its phases so far."""

    mode: str
    failure: str
    seed: int
    prefix: str = field(default_factory=lambda: f"f{secrets.token_hex(3)}")
    sidecars: list[SidecarProcess] = field(default_factory=list)
    phases: list[Phase] = field(default_factory=list)
    broken: dict[str, Row] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.mode}-{self.failure}"


def run_configurations(setup: Setup, configurations: Sequence[Configuration]) -> list[Row]:
    """Every fault in turn; the configurations' pairs meet each one side by side."""
    args = [sidecar_args(setup, item.mode, item.failure, item.prefix) for item in configurations]
    labels = [item.label for item in configurations]
    pairs = start_pairs(setup.group, setup.logs, setup.context.server_cpus, list(zip(labels, args, strict=True)))
    for item, sidecars in zip(configurations, pairs, strict=True):
        item.sidecars = sidecars
    pids = [sidecar.pid for sidecars in pairs for sidecar in sidecars]
    pids += [setup.faults.redis.pid, setup.faults.proxy.pid]
    for number, fault in enumerate(FAULTS):
        run_fault(setup, configurations, number, fault, pids)
    every_codes = stop_pairs(setup.group, pairs)
    rows = []
    for item, codes in zip(configurations, every_codes, strict=True):
        for phase in item.phases:
            if phase.name in item.broken:
                rows.append(item.broken[phase.name])
                continue
            phase.final = account(phase, setup.faults.redis.port, item.prefix)
            rows.append(fault_row(item.mode, item.failure, phase, codes, setup.timing.rate))
    return rows


def run_fault(setup: Setup, configurations: Sequence[Configuration], number: int, fault: str, pids: list[int]) -> None:
    """One fault mid-load on every configuration's pair, then each pair's drain and accounting."""
    timing = setup.timing
    avoid_window_end(UNIT_SECONDS, timing.total(fault) + DRAIN_TIMEOUT + 30)
    phases = [
        Phase(fault, Traffic(setup.names, f"{item.prefix}{number}", item.seed * 100 + number))
        for item in configurations
    ]
    events: list[Event] = [
        (timing.pre, "fault", functools.partial(setup.faults.begin, fault), None),
        (
            timing.pre + timing.duration(fault),
            "recovery",
            functools.partial(setup.faults.end, fault),
            functools.partial(setup.faults.settle, fault),
        ),
    ]
    runs = [(phase, item.sidecars) for phase, item in zip(phases, configurations, strict=True)]
    try:
        try:
            with client_cpus(setup.context.client_cpus):
                uvloop.run(run_phases(runs, timing.total(fault), events, pids, rate=timing.rate))
        finally:
            if "recovery_done" not in phases[0].marks:
                setup.faults.end(fault)  # never leave Redis stopped or the proxy refusing
                setup.faults.settle(fault)
            for phase in phases:
                phase.failed_restarts = list(setup.faults.failed_restarts)
            setup.faults.failed_restarts = []
        together = drained([sidecar for item in configurations for sidecar in item.sidecars])
    except Exception as error:
        for item, phase in zip(configurations, phases, strict=True):
            item.broken[fault] = failed_row(AREA, row_name(item.mode, item.failure, fault), error, item.sidecars)
            item.phases.append(phase)
        return
    time.sleep(0.3)  # strict mode: give-backs are not counted as pending
    for item, phase in zip(configurations, phases, strict=True):
        try:  # a pair that did not drain with the others is asked on its own (its row says so)
            phase.drain_seconds = together if together is not None else drained(item.sidecars, timeout=1.0)
            phase.at_drain = account(phase, setup.faults.redis.port, item.prefix)
        except Exception as error:
            item.broken[fault] = failed_row(AREA, row_name(item.mode, item.failure, fault), error, item.sidecars)
        item.phases.append(phase)


def row_name(mode: str, failure: str, fault: str) -> str:
    return f"{mode} mode, --redis-failure-mode {failure}: {fault}"


def bound_ms(bound: float) -> float:
    """A histogram bound in ms; -1 for "beyond the last bound" (250 ms)."""
    return bound * 1000 if math.isfinite(bound) else -1.0


def fault_row(mode: str, failure: str, phase: Phase, codes: dict[str, int | None], rate: float) -> Row:
    calls = phase.calls
    start, end = phase.marks["fault"], phase.marks.get("recovery_done", phase.marks["fault"]) + RECOVERY
    during = [index for index in range(len(calls)) if start <= calls.sent[index] <= end]
    before = [index for index in range(len(calls)) if calls.sent[index] < start]
    latencies = sorted(calls.latency[index] for index in during)
    errors = calls.error_counts()
    decisions = phase.decisions()
    decided = decisions.get(math.inf, 0.0)
    lost, extra, wrong = phase.final or (0, 0, 0)
    drain_lost, drain_extra, _ = phase.at_drain
    figures = {
        "fault_seconds": round(phase.marks.get("recovery", start) - start, 2),
        "calls": len(calls),
        "calls_during_fault": len(during),
        "errors": sum(errors.values()),
        **latency_figures(latencies),
        "over_25ms": sum(latency > SLOW_CALL for latency in latencies),
        "baseline_p99_ms": ms(percentile(sorted(calls.latency[index] for index in before), 0.99)),
        "other_cpu_during_fault": round(phase.cpu.other_cores(start, end) if phase.cpu else 0.0, 2),
        "server_decisions": decided,
        "server_p99_bucket_ms": bound_ms(bucket_quantile(decisions, 0.99)),
        "server_max_bucket_ms": bound_ms(bucket_quantile(decisions, 1.0)),
        "server_over_10ms": decided - decisions.get(0.01, 0.0),
        "server_over_25ms": decided - decisions.get(0.025, 0.0),
        "admitted_share_during_fault": round(sum(calls.code[index] == OK for index in during) / max(1, len(during)), 3),
        "redis_down_seconds": round(max(phase.down.values(), default=0.0), 2),
        "drain_seconds": round(phase.drain_seconds, 2) if phase.drain_seconds is not None else -1.0,
        "hits_admitted": phase.admitted_total,
        "redis_hits": phase.held,
        "hits_lost_at_drain": drain_lost,
        "hits_extra_at_drain": drain_extra,
        "hits_extra": extra,
    }
    ambiguous = phase.name in BREAKS_CONNECTIONS
    problems = [f"calls failed: {errors}"] if errors else []
    if figures["server_p99_bucket_ms"] < 0:
        problems.append("the sidecars reported no decision times")
    if phase.drain_seconds is None:
        problems.append(f"pending hits did not drain within {DRAIN_TIMEOUT:.0f} s")
    if drain_lost or (drain_extra and not ambiguous):
        problems.append(f"once drained Redis lacked {drain_lost} admitted hits and held {drain_extra} extra")
    if lost or (extra and not ambiguous):
        problems.append(f"after SIGTERM Redis lacks {lost} admitted hits and holds {extra} extra ({wrong} counters)")
    if any(code != 0 for code in codes.values()):
        problems.append(f"exit codes {codes}")
    notes = (
        f"{FAULTS[phase.name]}, for {figures['fault_seconds']:.1f} s: {len(during)} calls during it and the "
        f"second after, p99 {figures['p99_ms']:.1f} ms, max {figures['max_ms']:.1f} ms, {figures['over_25ms']} "
        f"over 25 ms (the sidecars' own decision times: p99 <= {figures['server_p99_bucket_ms']:g} ms, "
        f"{figures['server_over_10ms']:.0f} of {decided:.0f} over 10 ms, max <= "
        f"{figures['server_max_bucket_ms']:g} ms); {figures['admitted_share_during_fault']:.0%} admitted; "
        f"Redis marked down {figures['redis_down_seconds']:.1f} s; drained in {figures['drain_seconds']:.1f} s; "
        f"Redis {phase.held:,} hits, admitted {phase.admitted_total:,}"
    )
    if extra and ambiguous:
        notes += (
            f"; {extra} hits counted twice: scripts on a connection the fault cut ran anyway while their "
            "requests were answered by the failure mode (documented ambiguity, errs toward rejecting)"
        )
    if phase.failed_restarts:
        notes += f"; redis-server restart retried (failed starts exited with {phase.failed_restarts})"
    if figures["p99_ms"] > P99_BUDGET * 1000 and figures["other_cpu_during_fault"] > DISTURBED_CPU:
        notes += f"; other processes used {figures['other_cpu_during_fault']:.2f} cores meanwhile"
    if problems:
        notes = "; ".join(problems) + " | " + notes
    return Row(
        AREA,
        row_name(mode, failure, phase.name),
        load=f"{rate:.0f} req/s on {REPLICAS} replicas, p99 {figures['p99_ms']:.1f} ms during the fault",
        hits_lost=lost,
        ok=not problems,
        notes=notes,
        goals_missed=latency_goals_missed(figures),
        figures=figures,
    )


def latency_goals_missed(figures: dict[str, float]) -> list[str]:
    """The client's p99 (unless other processes hogged the CPU) and the sidecars' own p99:
    goals the report shows, not invariants (a loaded machine misses them by itself)."""
    missed = []
    if figures["p99_ms"] > P99_BUDGET * 1000 and figures["other_cpu_during_fault"] <= DISTURBED_CPU:
        missed.append(f"p99 during the fault {figures['p99_ms']:.1f} ms > {P99_BUDGET * 1000:.0f} ms")
    if figures["server_p99_bucket_ms"] > SERVER_P99_BUDGET * 1000:
        missed.append(f"the sidecars' own p99 decision time was over {SERVER_P99_BUDGET * 1000:.0f} ms")
    return missed


# ---------------------------------------------------------------------------------
# A replica SIGKILLed mid-load
# ---------------------------------------------------------------------------------


def kill_setup(setup: Setup) -> Setup:
    """The replica kill runs one pair alone: at the full :data:`RATE` at every size (its loss bound,
    two sync intervals of the victim's admissions, needs hits to count), near limits sized for it."""
    timing = replace(setup.timing, together=1, rate=RATE)
    if timing == setup.timing:
        return setup
    config = setup.logs / "config-kill"
    config.mkdir(parents=True, exist_ok=True)
    (config / "faults.yaml").write_text(config_text(near_limits(timing)))
    return replace(setup, config=config, names=CounterNames(config, DOMAIN), timing=timing)


def run_replica_kill(setup: Setup, seed: int) -> Row:
    prefix = f"k{secrets.token_hex(3)}"
    args = sidecar_args(setup, "sync", "local", prefix)
    (sidecars,) = start_pairs(setup.group, setup.logs, setup.context.server_cpus, [("replica-kill", args)])
    survivor, victim = sidecars
    pids = [survivor.pid, victim.pid, setup.faults.redis.pid, setup.faults.proxy.pid]
    timing = setup.timing
    kill_at = max(timing.pre, KILL_AFTER)
    avoid_window_end(UNIT_SECONDS, kill_at + timing.kill_post + DRAIN_TIMEOUT + 30)
    phase = Phase("replica_kill", Traffic(setup.names, prefix, seed))

    def kill() -> None:
        phase.traffic.targets = [0]  # no new call to the dead replica; calls on the wire fail
        victim.kill()

    with client_cpus(setup.context.client_cpus):
        seconds = kill_at + timing.kill_post
        uvloop.run(run_phase(phase, sidecars, seconds, [(kill_at, "kill", kill, None)], pids, rate=timing.rate))
    phase.drain_seconds = drained([survivor])
    (codes,) = stop_pairs(setup.group, [[survivor]])
    return replica_kill_row(setup, phase, prefix, codes)


@dataclass(frozen=True)
class NearCounter:
    """A counter near its limit when the replica was killed: what the survivor did with it."""

    name: str
    limit: int
    admitted: int
    """Hits of the calls answered OK, by either replica."""
    offered: int
    lost: int
    """Admitted hits Redis does not hold (the victim's unflushed ones)."""

    def problems(self, cut_hits: int) -> list[str]:
        """At most the limit plus sync mode's bound plus what was lost; and when more was offered, at
        least the limit less ``cut_hits``: the hits of this counter in calls the kill cut, which the
        victim may have counted (and flushed) though their answers never arrived."""
        bound = (REPLICAS - 1) * math.floor(SYNC_MAX_OVERSHOOT * self.limit / (REPLICAS - 1))
        found = []
        if self.admitted > self.limit + bound + self.lost:
            found.append(f"{self.name}: {self.admitted} admitted > limit {self.limit} + bound {bound} + lost")
        if self.offered >= self.limit + 10 and self.admitted + cut_hits < self.limit:
            found.append(
                f"{self.name}: only {self.admitted} admitted of a limit of {self.limit} "
                f"(offered more; {cut_hits} hits in calls the kill cut)"
            )
        return found


def replica_kill_row(setup: Setup, phase: Phase, prefix: str, codes: dict[str, int | None]) -> Row:
    traffic, calls = phase.traffic, phase.calls
    killed = phase.marks["kill"]
    held = {
        digest: hits
        for digest, hits in redis_counts(setup.faults.redis.port, prefix).items()
        if digest in traffic.digests
    }
    by_survivor = traffic.admitted(calls, target=0)
    by_victim = traffic.admitted(calls, target=1)
    admitted = {digest: by_survivor[digest] + by_victim[digest] for digest in traffic.digests}
    lost = sum(admitted.values()) - sum(held.values())
    per_counter_lost = {digest: max(0, admitted[digest] - held.get(digest, 0)) for digest in traffic.digests}
    extra = sum(max(0, held.get(digest, 0) - admitted[digest]) for digest in traffic.digests)
    # The bound: what the victim answered OK within two sync intervals before it died.
    recent = traffic.admitted(calls, target=1, until=killed)
    earlier = traffic.admitted(calls, target=1, until=killed - 2 * SYNC_INTERVAL)
    bound = sum(recent.values()) - sum(earlier.values())
    last_second = sum(recent.values()) - sum(traffic.admitted(calls, target=1, until=killed - 1.0).values())
    one_interval = last_second * SYNC_INTERVAL
    cut = [index for index in range(len(calls)) if calls.code[index] == CODE_ERROR and calls.target[index] == 1]
    cut_spends = [spend for index in cut for spend in traffic.payloads[calls.payload[index]].spends]
    cut_hits = sum(hits for _, hits in cut_spends)
    survivor_after = [index for index in range(len(calls)) if calls.target[index] == 0 and calls.sent[index] >= killed]
    survivor_errors = calls.error_counts(index for index in range(len(calls)) if calls.target[index] == 0)
    latencies = sorted(calls.latency[index] for index in survivor_after)
    p99 = percentile(latencies, 0.99)
    other = phase.cpu.other_cores(killed, killed + setup.timing.kill_post) if phase.cpu else 0.0
    limits = near_limits(setup.timing)
    problems = []
    if lost < 0 or lost > bound:
        problems.append(f"lost {lost} hits, bound {bound} (two sync intervals of the victim's admissions)")
    if extra > cut_hits:
        problems.append(f"Redis holds {extra} hits nobody saw admitted (calls cut by the kill: {cut_hits} hits)")
    if survivor_errors:
        problems.append(f"the survivor's calls failed: {survivor_errors}")
    if phase.drain_seconds is None:
        problems.append("the survivor's pending hits did not drain")
    if any(code != 0 for code in codes.values()):
        problems.append(f"exit codes {codes}")
    verdicts = []
    for name, limit in limits.items():
        digest = traffic.digest(name)
        total = admitted[digest]
        verdicts.append(f"{name} {total}/{limit}")
        counter = NearCounter(name, limit, total, traffic.offered(calls, digest), per_counter_lost[digest])
        problems += counter.problems(sum(hits for spent, hits in cut_spends if spent == digest))
    figures = {
        "hits_lost": lost,
        "loss_bound": bound,
        "one_sync_interval_hits": round(one_interval, 1),
        "victim_hits_admitted": sum(by_victim.values()),
        "survivor_hits_admitted": sum(by_survivor.values()),
        "redis_hits": sum(held.values()),
        "hits_extra": extra,
        "calls_cut_by_kill": len(cut),
        "survivor_calls_after_kill": len(survivor_after),
        **latency_figures(latencies, "survivor_"),
        "other_cpu_after_kill": round(other, 2),
    }
    notes = (
        f"replica 2 of 2 SIGKILLed after {killed - phase.calls.sent[0]:.1f} s at {setup.timing.rate:.0f} req/s: it "
        "had answered "
        f"{sum(by_victim.values()):,} hits OK, Redis got all but {lost} (bound {bound}: its admissions in the "
        f"last {2 * SYNC_INTERVAL * 1000:.0f} ms; one {SYNC_INTERVAL * 1000:.0f} ms interval at its rate is "
        f"{one_interval:.1f}); {len(cut)} calls on the wire failed; the survivor answered every call after it "
        f"(p99 {p99 * 1000:.1f} ms); near counters admitted/limit: {', '.join(verdicts)}"
    )
    if problems:
        notes = "; ".join(problems) + " | " + notes
    return Row(
        AREA,
        "sync mode: a replica SIGKILLed mid-load",
        load=f"{setup.timing.rate:.0f} req/s on {REPLICAS} replicas, then 1",
        hits_lost=lost,
        ok=not problems,
        notes=notes,
        goals_missed=(
            [f"the survivor's p99 after the kill {p99 * 1000:.1f} ms > {P99_BUDGET * 1000:.0f} ms"]
            if p99 > P99_BUDGET and other <= DISTURBED_CPU
            else []
        ),
        figures=figures,
    )


# ---------------------------------------------------------------------------------
# The module's entry
# ---------------------------------------------------------------------------------


def data_directory() -> Path:
    """Redis's AOF on tmpfs when there is one: ``appendfsync always`` on a disk would slow every
    write past the 5 ms request budget and turn the baseline into a fault of its own."""
    shm = Path("/dev/shm")
    parent = shm if shm.is_dir() and shutil.disk_usage(shm).free > 256 * 1024 * 1024 else None
    return Path(tempfile.mkdtemp(prefix="rls-faults-", dir=parent))


def run(context: Context) -> list[Row]:
    if not redis_available():
        return [skipped_row(AREA, "Redis and replica faults under load", "redis-server is not installed")]
    timing = Timing.of(context.quick, context.smoke)
    logs = context.directory / "faults"
    config = logs / "config"
    config.mkdir(parents=True, exist_ok=True)
    (config / "faults.yaml").write_text(config_text(near_limits(timing)))
    data = data_directory()
    rows: list[Row] = []
    children: list[Child] = []
    try:
        with process_group() as group:
            try:
                redis = group.start_ready(lambda: durable_redis(data, logs, context.server_cpus))
                proxy = group.start_ready(lambda: pin(ProxyProcess(logs, redis.port), context.server_cpus))
                children += [redis, proxy]
                setup = Setup(context, group, Faults(redis, proxy), config, CounterNames(config, DOMAIN), timing, logs)
            except Exception as error:
                return [failed_row(AREA, "Redis and replica faults under load", error, children)]
            every = [
                Configuration(mode, failure, context.seed * 1000 + number)
                for number, (mode, failure) in enumerate(CONFIGURATIONS)
            ]
            for first in range(0, len(every), timing.together):
                batch = every[first : first + timing.together]
                try:
                    rows += run_configurations(setup, batch)
                except Exception as error:
                    for item in batch:
                        scenario = f"{item.mode} mode, --redis-failure-mode {item.failure}"
                        rows.append(failed_row(AREA, scenario, error, group.children))
                    stop_pairs(group, [[child for child in group.children if isinstance(child, SidecarProcess)]])
            try:
                rows.append(run_replica_kill(kill_setup(setup), context.seed * 1000 + 99))
            except Exception as error:
                rows.append(failed_row(AREA, "sync mode: a replica SIGKILLed mid-load", error, group.children))
    finally:
        shutil.rmtree(data, ignore_errors=True)
    return rows


if __name__ == "__main__":
    raise SystemExit(main(run))
