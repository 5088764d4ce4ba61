"""One (scenario, mode) run: start R sidecars, drive them, stop them, measure.

Sidecars are restarted for every run so the round-trip counters in their shutdown
events belong to that run alone, and Redis is flushed between runs so every counter
key read afterwards belongs to it.
"""

from __future__ import annotations

import hashlib
import math
import multiprocessing.connection
import os
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest.accuracy_harness import algorithms, analysis, overload, scenarios
from loadtest.accuracy_harness.driver import RUN_GRACE, WARMUP_CALLS, ReplicaRecord, WorkerSpec, worker_main
from loadtest.accuracy_harness.processes import (
    REPO,
    ChildStartError,
    Hog,
    RedisServer,
    Sidecar,
    wait_all_serving,
)
from loadtest.accuracy_harness.redis_watch import CounterWatch, command_calls, digest_map
from loadtest.accuracy_harness.scenarios import Scenario
from loadtest.common import Worker, cpu_seconds, start_worker, stop_workers, worker_answer
from stack.processes import ProcessGroup
from stack.sidecar import cli_argv

MODES = ("local", "sync", "strict")
START_MARGIN = 0.3
"""Seconds between "go" and the first send, so every generator is waiting when it starts."""
CONVERGE_TIMEOUT = 5.0
"""Seconds redis-mode sidecars get to see each other's heartbeats before traffic starts."""
CLOSED_WARMUP = 0.5
"""Closed loop: seconds at the start that are sent but not measured."""
DEFAULT_CALL_TIMEOUT = 2.0
"""The deadline of a call when neither ``--timeout`` nor the scenario gives one."""


@dataclass(frozen=True)
class Options:
    replicas: int
    sync_interval: float | None
    client_processes: int
    throughput_processes: int
    timeout: float | None
    """``--timeout``: every call's deadline; None: the scenario's (:data:`DEFAULT_CALL_TIMEOUT`)."""
    redis_timeout: float | None
    sync_max_overshoot: float | None
    client_cpus: tuple[int, ...] | None
    seed: int
    dump_calls: Path | None
    token: str
    """Unique per harness run: salts descriptor values."""


def serve_args(mode: str, config_dir: Path, options: Options, redis: RedisServer | None) -> list[str]:
    common = ["--config", str(config_dir), "--shutdown-grace", "5", "--log-level", "info"]
    if mode == "local":
        return [*common, "--backend", "memory", "--instances", str(options.replicas)]
    assert redis is not None
    args = [*common, "--backend", "redis", "--redis-url", redis.url, "--mode", mode]
    if mode == "sync":
        if options.sync_interval is not None:
            args += ["--sync-interval", str(options.sync_interval)]
        if options.sync_max_overshoot is not None:
            args += ["--sync-max-overshoot", str(options.sync_max_overshoot)]
    if options.redis_timeout is not None:
        args += ["--redis-timeout", str(options.redis_timeout)]
    return args


def start_time(scenario: Scenario) -> float:
    """When the first call goes out: a window boundary, or now for closed loop."""
    now = time.time() + START_MARGIN
    if scenario.pattern == "closed":
        return now
    unit = scenario.unit_seconds
    if scenario.align in ("minute-fit", "fit"):
        left = unit - now % unit
        return now if left >= scenario.duration + 1.0 else math.ceil(now / unit) * unit
    return float(math.ceil(now / unit) * unit)


class Workers:
    """Load-generator processes for one run; always stopped by :meth:`close`."""

    def __init__(self) -> None:
        self.items: list[Worker] = []

    def start(self, specs: Sequence[WorkerSpec]) -> None:
        for spec in specs:
            self.items.append(start_worker(worker_main, spec))

    def expect(self, kind: str, deadline: float, while_waiting: Any = None) -> list[Any]:
        """One message of ``kind`` from every worker, by ``deadline`` (monotonic)."""
        pending = {conn: index for index, (_, conn) in enumerate(self.items)}
        answers: list[Any] = [None] * len(self.items)
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"load generator sent no {kind!r} in time")
            for conn in multiprocessing.connection.wait(list(pending), timeout=min(left, 0.5)):
                answer = worker_answer(conn.recv(), kind)  # type: ignore[union-attr,call-arg]
                answers[pending.pop(conn)] = answer  # type: ignore[call-overload]
            if while_waiting is not None:
                while_waiting()
        return answers

    def send(self, message: Any) -> None:
        for _, conn in self.items:
            conn.send(message)

    def close(self) -> None:
        stop_workers(self.items, timeout=5)
        self.items.clear()


def _split(items: Sequence[int], parts: int) -> list[list[int]]:
    parts = max(1, min(parts, len(items)))
    return [list(items[index::parts]) for index in range(parts)]


class Run:
    """One (scenario, mode) run: its children, its traffic, its figures."""

    def __init__(
        self,
        scenario: Scenario,
        mode: str,
        *,
        options: Options,
        group: ProcessGroup,
        redis: RedisServer | None,
        workdir: Path,
    ) -> None:
        self.scenario = scenario
        self.mode = mode
        self.options = options
        self.group = group
        self.redis = redis if mode != "local" else None
        self.run_dir = workdir / f"{scenario.name}-{mode}"
        self.config_dir = self.run_dir / "config"
        self.values = scenario.values(f"{mode}.{options.token}")
        self.schedules = scenario.schedules(options.replicas, options.seed) if scenario.pattern != "closed" else None
        self.client = self.redis.client() if self.redis is not None else None
        self.watch = CounterWatch(self.client) if self.client is not None else None
        self.sidecars: list[Sidecar] = []
        self.hogs: list[Hog] = []
        self.call_timeout = options.timeout or scenario.call_timeout or DEFAULT_CALL_TIMEOUT
        self.workers = Workers()
        processes = options.throughput_processes if scenario.pattern == "closed" else options.client_processes
        self.replica_groups = _split(range(options.replicas), processes)
        self.outcome: dict[str, Any] = {
            "scenario": scenario.name,
            "mode": mode,
            "replicas": options.replicas,
            "limit": scenario.limit,
            "unit": scenario.unit,
            "algorithm": scenario.algorithm,
            "sidecar_source": source_digest(),
            "call_timeout": self.call_timeout,
        }
        if scenario.hogs:
            self.outcome["pressure"] = f"{scenario.hogs} busy loop(s) on cpu {scenario.sidecar_cpus}"
        if scenario.algorithm == scenarios.TOKEN_BUCKET:
            self.outcome["burst"] = scenario.burst
        if mode == "sync":
            self.outcome["sync_max_overshoot"] = options.sync_max_overshoot

    def execute(self) -> dict[str, Any]:
        """Start, drive, stop, measure; every child is stopped whatever happens."""
        try:
            if not self._start_sidecars():
                return self.outcome
            self._measure(*self._drive())
            return self.outcome
        finally:
            self.workers.close()
            self.group.stop(self.hogs)
            self.group.stop(self.sidecars)
            if self.client is not None:
                self.client.close()

    def _start_sidecars(self) -> bool:
        self.config_dir.mkdir(parents=True, exist_ok=True)
        (self.config_dir / "accuracy.yaml").write_text(scenarios.config_yaml(self.scenario))
        if self.client is not None:
            self.client.flushall()
            self.client.config_resetstat()
            self.outcome["commands_before"] = command_calls(self.client)
        args = serve_args(self.mode, self.config_dir, self.options, self.redis)
        self.sidecars = [Sidecar(index, args, self.run_dir) for index in range(self.options.replicas)]
        for sidecar in self.sidecars:
            sidecar.cpus = self.scenario.sidecar_cpus or None
            self.group.start(sidecar)
        # The load generators start meanwhile (their imports overlap the sidecars'); they open
        # their channels and warm up once told to, while the replicas find each other.
        self.workers.start(self._worker_specs(self.replica_groups))
        try:
            wait_all_serving(self.sidecars)
        except ChildStartError as failure:
            self.group.stop(self.sidecars)
            self.outcome["status"] = "unavailable" if failure.means_unavailable else "failed"
            self.outcome["reason"] = str(failure)
            self.outcome["log_tail"] = failure.log_tail
            return False
        self.workers.send(("connect",))
        if self.redis is not None:
            self.outcome["replicas_converged_s"] = wait_replicas_converged(self.sidecars)
        started = [
            next((event for event in sidecar.events() if event.get("event") == "sidecar_started"), {})
            for sidecar in self.sidecars
        ]
        self.outcome["started_backends"] = sorted({str(event.get("backend")) for event in started})
        self.hogs = [Hog(index, self.scenario.sidecar_cpus, self.run_dir) for index in range(self.scenario.hogs)]
        for hog in self.hogs:
            self.group.start(hog)
        return True

    def _worker_specs(self, replica_groups: Sequence[Sequence[int]]) -> list[WorkerSpec]:
        scenario = self.scenario
        payloads = scenarios.payloads(scenario.descriptor_key, self.values)
        warmup = scenarios.payloads(scenario.descriptor_key, [scenarios.WARMUP_VALUE], check_only=True)[0]
        schedules = self.schedules
        return [
            WorkerSpec(
                replicas=tuple(indices),
                addresses=tuple(self.sidecars[i].address for i in indices),
                payloads=payloads,
                warmup_payload=warmup,
                schedules=(
                    None
                    if schedules is None
                    else tuple((schedules[i][0].tobytes(), schedules[i][1].tobytes()) for i in indices)
                ),
                closed_seconds=scenario.duration,
                lanes=scenario.lanes,
                timeout=self.call_timeout,
                cpus=self.options.client_cpus or other_cpus(scenario.sidecar_cpus),
            )
            for indices in replica_groups
        ]

    def _cpu(self) -> tuple[float, float | None, float, float]:
        """CPU seconds so far: sidecars, redis-server, load generators + harness, whole machine (busy)."""
        sidecars = sum(cpu_seconds(sidecar.pid) or 0.0 for sidecar in self.sidecars)
        redis = cpu_seconds(self.redis.pid) if self.redis is not None else None
        workers = sum(cpu_seconds(process.pid) or 0.0 for process, _ in self.workers.items)
        workers += sum(os.times()[:2])  # the harness itself (polling Redis, waiting)
        return sidecars, redis, workers, machine_busy_seconds()

    def _drive(self) -> tuple[float, float, list[ReplicaRecord]]:
        """Warm up, go at the start time, collect every call; returns (start, measure_from, records)."""
        scenario, options = self.scenario, self.options
        replica_groups = self.replica_groups
        self.workers.expect("ready", time.monotonic() + 60)
        start = start_time(scenario)
        self.workers.send(("go", start))
        measure_from = start + CLOSED_WARMUP if scenario.pattern == "closed" else start
        while time.time() < measure_from:
            time.sleep(min(0.05, max(0.0, measure_from - time.time())))
        cpu_before = self._cpu()
        last = max((offsets[-1] for offsets, _ in self.schedules or [] if offsets), default=scenario.duration)
        deadline = time.monotonic() + (start - time.time()) + last + RUN_GRACE + 30
        answers = self.workers.expect("result", deadline, self.watch.poll_if_due if self.watch else None)
        cpu_after = self._cpu()
        window = max(1e-9, time.time() - measure_from)  # the generators exit while the sidecars stop
        by_replica: dict[int, ReplicaRecord] = {}
        for indices, answer in zip(replica_groups, answers, strict=True):
            for index, message in zip(indices, answer, strict=True):
                by_replica[index] = ReplicaRecord.from_message(message)
        self.outcome["cpu_raw"] = {"before": cpu_before, "after": cpu_after, "seconds": window}
        return start, measure_from, [by_replica[index] for index in range(options.replicas)]

    def _measure(self, start: float, measure_from: float, records: list[ReplicaRecord]) -> None:
        scenario, outcome = self.scenario, self.outcome
        outcome["stop_requested"] = time.time()
        outcome["exit_codes"] = self.group.stop(self.sidecars, self.watch.poll_if_due if self.watch else None)
        outcome["stop_seconds"] = round(time.time() - (outcome.pop("stop_requested")), 2)
        tails = {
            sidecar.label: sidecar.log_tail(8)
            for sidecar in self.sidecars
            if sidecar.process is not None and sidecar.process.returncode
        }
        if tails:
            outcome["exit_log_tails"] = tails
        if self.watch is not None:
            self.watch.poll()
        offsets = [offsets for offsets, _ in self.schedules] if self.schedules else None
        calls = analysis.Calls.merge(records, start, offsets)
        if self.options.dump_calls is not None:
            path = self.options.dump_calls / f"{scenario.name}-{self.mode}.csv"
            analysis.write_calls(path, calls)
            outcome["calls_csv"] = str(path)
        traffic = analysis.traffic_figures(calls)
        if scenario.pattern == "closed":
            measured = analysis.traffic_figures(calls, measure_from)
            span = max(1e-9, start + scenario.duration - measure_from)
            traffic.update(
                rps=round(measured["sent"] / span, 1),
                p50_ms=measured["p50_ms"],
                p99_ms=measured["p99_ms"],
                max_ms=measured["max_ms"],
                measured_calls=measured["sent"],
                measured_seconds=round(span, 3),
            )
        outcome.update(status="ok", start=start, traffic=traffic, loadavg_1m_after=round(os.getloadavg()[0], 2))
        outcome["accuracy"] = analysis.accuracy_figures(calls, scenario.limit, scenario.unit_seconds)
        if scenario.name.startswith(overload.NAMES):
            outcome["overload"] = overload.figures(calls, scenario, start)
        if scenario.algorithm == scenarios.SLIDING_WINDOW:
            outcome["algorithm_accuracy"] = algorithms.sliding_figures(calls, scenario.limit, scenario.unit_seconds)
        elif scenario.algorithm == scenarios.TOKEN_BUCKET:
            instances = self.options.replicas if self.mode == "local" else 1
            outcome["algorithm_accuracy"] = algorithms.bucket_figures(
                calls, scenario.limit, scenario.burst, scenario.unit_seconds, instances
            )
        outcome["round_trips"] = analysis.round_trip_figures(
            [sidecar.events() for sidecar in self.sidecars] if self.redis is not None else [],
            len(calls.send) - traffic["not_sent"] + WARMUP_CALLS * self.options.replicas,
            outcome.pop("commands_before", None),
            command_calls(self.client) if self.client is not None else None,
            0,
        )
        answered = traffic.get("measured_calls", traffic["answered"])
        outcome["cpu"] = cpu_figures(outcome.pop("cpu_raw"), answered)
        if self.watch is not None and scenario.algorithm == scenarios.TOKEN_BUCKET:
            outcome["redis_check_note"] = "not applicable: a token bucket keeps a TAT in Redis, not a count of hits"
        elif self.watch is not None:
            digests = digest_map(self.config_dir, scenario.descriptor_key, self.values)
            check = analysis.cross_check(self.watch.values, digests, calls, scenario.limit, scenario.unit_seconds)
            outcome["redis_check"] = check | {"polls": self.watch.polls}
            if not self.watch.values and traffic["admitted"]:
                outcome["warning"] = "no counter in Redis although calls were admitted: the sidecar did not use Redis"


def other_cpus(taken: Sequence[int]) -> tuple[int, ...] | None:
    """The cpus of this process other than ``taken`` (None when nothing is taken or nothing is left)."""
    if not taken:
        return None
    left = tuple(sorted(set(os.sched_getaffinity(0)) - set(taken)))
    return left or None


def wait_replicas_converged(sidecars: Sequence[Sidecar], timeout: float = CONVERGE_TIMEOUT) -> float | None:
    """Until every sidecar has logged that it sees all R replicas (``replicas_changed``
    with ``live`` >= R); a replica that started before the others believes it is alone
    until its next heartbeat. Returns the seconds waited, None if they never converged
    (then the run measures start-up behaviour too; the report shows it)."""
    if len(sidecars) <= 1:
        return 0.0
    began = time.monotonic()
    while time.monotonic() - began < timeout:
        if all(
            any(event.get("event") == "replicas_changed" and event.get("live", 0) >= len(sidecars) for event in events)
            for events in (sidecar.events() for sidecar in sidecars)
        ):
            return round(time.monotonic() - began, 2)
        time.sleep(0.1)
    return None


def source_digest() -> str:
    """Digest of the sidecar's source (Python and Lua) as this run starts: other people may be
    editing it, and figures are only comparable between runs of the same code."""
    digest = hashlib.blake2b(digest_size=6)
    package = REPO / "sidecar"
    for path in sorted([*package.rglob("*.py"), *package.rglob("*.lua")]):
        digest.update(str(path.relative_to(package)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def machine_busy_seconds() -> float:
    """Non-idle CPU seconds of the whole machine since boot (``/proc/stat``)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    ticks = [int(value) for value in fields[:8]]
    idle = ticks[3] + ticks[4]
    return (sum(ticks) - idle) / os.sysconf("SC_CLK_TCK")


def cpu_figures(raw: dict[str, Any], answered: int) -> dict[str, Any]:
    """Sidecar and redis-server CPU over the measured part of a run, per answered call."""
    (sidecars_before, redis_before, workers_before, busy_before) = raw["before"]
    (sidecars_after, redis_after, workers_after, busy_after) = raw["after"]
    calls = max(1, answered)
    ours = (sidecars_after - sidecars_before) + (workers_after - workers_before)
    ours += (redis_after or 0.0) - (redis_before or 0.0)
    return {
        "other_processes_cores": round(max(0.0, (busy_after - busy_before) - ours) / raw["seconds"], 2),
        "load_generators_and_harness_cores": round((workers_after - workers_before) / raw["seconds"], 3),
        "sidecars_cores": round((sidecars_after - sidecars_before) / raw["seconds"], 3),
        "sidecars_us_per_call": round((sidecars_after - sidecars_before) / calls * 1e6, 1),
        "redis_us_per_call": (
            round((redis_after - redis_before) / calls * 1e6, 1)
            if redis_after is not None and redis_before is not None
            else None
        ),
    }


def sidecar_verdict(scenario: Scenario, mode: str, workdir: Path) -> str:
    """What ``ratelimit-sidecar check-config --mode <mode>`` says of the scenario's config: its last
    line, or that it accepted the config (then the pair is offered after all)."""
    directory = workdir / f"{scenario.name}-{mode}-check"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "accuracy.yaml").write_text(scenarios.config_yaml(scenario))
    done = subprocess.run(
        cli_argv("check-config", str(directory), "--mode", mode),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=REPO,
    )
    if done.returncode == 0:
        return "but check-config accepted it: the harness's list of unsupported pairs is stale"
    lines = [line for line in (done.stderr + done.stdout).splitlines() if "not supported" in line]
    said = lines[0].rsplit("algorithm: ", 1)[-1] if lines else done.stderr.strip()[-200:]
    return f"`check-config --mode {mode}` says: {said}"


def skipped(scenario: Scenario, mode: str, reason: str) -> dict[str, Any]:
    """The row of a (scenario, mode) pair the sidecar does not offer: reported, never run."""
    return {
        "scenario": scenario.name,
        "mode": mode,
        "algorithm": scenario.algorithm,
        "limit": scenario.limit,
        "unit": scenario.unit,
        "status": "skipped",
        "reason": reason,
    }


def run_one(
    scenario: Scenario,
    mode: str,
    *,
    options: Options,
    group: ProcessGroup,
    redis: RedisServer | None,
    workdir: Path,
) -> dict[str, Any]:
    """Run ``scenario`` against R fresh sidecars in ``mode``; returns its figures (a ``skipped`` row
    when the mode does not offer the scenario's algorithm)."""
    reason = scenario.unsupported(mode)
    if reason is not None:
        return skipped(scenario, mode, f"{reason}; {sidecar_verdict(scenario, mode, workdir)}")
    return Run(scenario, mode, options=options, group=group, redis=redis, workdir=workdir).execute()
