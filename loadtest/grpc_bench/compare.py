"""``compare``: the bare servicer and the sidecar (and calibration servicers), alternating rounds."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from loadtest.common import median_or_none, parse_cpus, write_json
from loadtest.grpc_bench.drive import RunResult, core_busy_seconds, load_options, run_load
from loadtest.grpc_bench.report import (
    command_line,
    describe_errors,
    environment,
    print_header,
    saturation_note,
    table,
)
from loadtest.grpc_bench.servers import ServerProcess, config_path
from stack import sidecar

LOADTEST = Path(__file__).resolve().parents[1]
GOAL_RATIO = 0.85


def medians(results: Sequence[RunResult]) -> dict[str, Any]:
    """Median of every numeric figure across rounds; counts summed."""
    keys = ("rps", "p50_ms", "p90_ms", "p99_ms", "max_ms", "client_cpu", "other_cpu")
    row: dict[str, Any] = {key: statistics.median(getattr(r, key) for r in results) for key in keys}
    for key in ("server_cpu", "server_us_per_call", "server_cores_busy"):
        row[key] = median_or_none(getattr(r, key) for r in results)
    row["ok"] = sum(r.ok for r in results)
    row["over_limit"] = sum(r.over_limit for r in results)
    errors: dict[str, int] = {}
    for result in results:
        for name, count in result.errors.items():
            errors[name] = errors.get(name, 0) + count
    row["errors"] = errors
    return row


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return round(numerator / denominator, 3)


def default_pinning(arguments: argparse.Namespace) -> tuple[Any, Any]:
    """Server on the first usable core, load generator on the others (2+ cores only)."""
    if arguments.no_pin:
        return None, None
    usable = sorted(os.sched_getaffinity(0))
    server = parse_cpus(arguments.server_cpus) or (tuple(usable[:1]) if len(usable) > 1 else None)
    client = parse_cpus(arguments.client_cpus) or (
        tuple(cpu for cpu in usable if cpu not in (server or ())) if server else None
    )
    return server, client or None


def compare_servers(arguments: argparse.Namespace, server_cpus: tuple[int, ...] | None) -> list[ServerProcess]:
    """The bare servicer, the sidecar, and any calibration servicers (``--calibrate-us``)."""
    bare_argv = [sys.executable, str(LOADTEST / "bare_servicer.py"), "--max-seconds", "3600"]
    servers = [ServerProcess("bare", bare_argv, server_cpus)]
    # Only the flags the sidecar has always had; log level, format and drain time go
    # through RLS_* variables, which a sidecar without those settings ignores.
    servers.append(
        ServerProcess(
            "sidecar",
            sidecar.serve_argv(["--config", config_path(arguments.config)]),
            server_cpus,
            env={
                "RLS_LOG_LEVEL": "warning",
                "RLS_LOG_FORMAT": "json",
                "RLS_SHUTDOWN_GRACE": "1",
                "RLS_METRICS_ADDRESS": "",  # its port may be taken; metrics are still recorded
            },
        )
    )
    for spin in parse_numbers(arguments.calibrate_us):
        servers.append(ServerProcess(f"spin{spin:g}", [*bare_argv, "--spin-us", f"{spin:g}"], server_cpus))
    for work in arguments.partial.split(",") if arguments.partial else []:
        argv = [*bare_argv, "--work", work, "--config", config_path(arguments.config)]
        servers.append(ServerProcess(f"b-{work}", argv, server_cpus))
    return servers


def machine_busy(seconds: float) -> float:
    """Cores busy over the next ``seconds`` (all processes, softirq and steal included)."""
    before = core_busy_seconds()
    time.sleep(seconds)
    after = core_busy_seconds()
    return sum(after.get(cpu, 0.0) - busy for cpu, busy in before.items()) / seconds


def wait_for_quiet(threshold: float, patience: float) -> float:
    """Wait (at most ``patience`` s) for a second in which the machine uses < ``threshold`` cores.

    Other sessions on a shared machine come and go; starting runs in a quiet second
    removes much of the noise. Returns the last busy figure measured.
    """
    deadline = time.monotonic() + patience
    busy = machine_busy(1.0)
    while busy >= threshold and time.monotonic() < deadline:
        busy = machine_busy(1.0)
    return busy


def parse_numbers(text: str | None) -> list[float]:
    return [float(part) for part in text.split(",") if part.strip()] if text else []


def measured_run(
    arguments: argparse.Namespace,
    server: ServerProcess,
    run_index: int,
    pinning: tuple[tuple[int, ...] | None, tuple[int, ...] | None],
) -> RunResult:
    """One run, redone (up to ``--redo-disturbed`` times) if other load disturbed it.

    Keeps the least disturbed attempt. A run counts as disturbed when everything
    else on the machine used more than ``--quiet-threshold`` cores during it.
    """
    server_cpus, client_cpus = pinning
    best: RunResult | None = None
    for attempt in range(1 + arguments.redo_disturbed):
        if arguments.quiet_wait > 0:
            busy = wait_for_quiet(arguments.quiet_threshold, arguments.quiet_wait)
            if busy >= arguments.quiet_threshold:
                print(f"         machine not quiet ({busy:.2f} cores busy before the run); running anyway")
        result = run_load(
            server.label,
            server.address,
            load_options(arguments),
            run_seed=arguments.seed + run_index * 100 + attempt,
            client_cpus=client_cpus,
            server_pid=server.pid,
            server_cpus=server_cpus,
        )
        if best is None or result.other_cpu < best.other_cpu:
            best = result
        if result.other_cpu <= arguments.quiet_threshold:
            break
        if attempt < arguments.redo_disturbed:
            print(f"         {server.label}: other load used {result.other_cpu:.2f} cores during the run; redoing it")
    assert best is not None
    return best


def run_rounds(
    arguments: argparse.Namespace,
    servers: Sequence[ServerProcess],
    pinning: tuple[tuple[int, ...] | None, tuple[int, ...] | None],
) -> dict[str, list[RunResult]]:
    """Every server once per round, the order alternating so that drift hits all alike."""
    results: dict[str, list[RunResult]] = {server.label: [] for server in servers}
    run_index = 0
    for round_index in range(arguments.rounds):
        for server in servers if round_index % 2 == 0 else servers[::-1]:
            run_index += 1
            result = measured_run(arguments, server, run_index, pinning)
            results[server.label].append(result)
            print(table([asdict(result)]).splitlines()[1] + f"   round {round_index + 1}")
            if result.errors or result.other_codes:
                print(f"         {describe_errors(result)}")
    return results


def cmd_compare(arguments: argparse.Namespace) -> int:
    server_cpus, client_cpus = default_pinning(arguments)
    env = environment(client_cpus=client_cpus, server_cpus=server_cpus)
    print_header(arguments, env)
    if client_cpus is not None:
        os.sched_setaffinity(0, client_cpus)  # this process mostly waits; keep it off the server
    servers = compare_servers(arguments, server_cpus)
    failed = True
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready()
        for server in servers:
            print(f"server {server.label}: pid {server.pid} on {server.address}")
        print(f"sidecar config: {arguments.config}")
        print(table([]))
        results = run_rounds(arguments, servers, (server_cpus, client_cpus))
        failed = False
    except KeyboardInterrupt:
        failed = False  # nothing to debug: drop the logs
        raise
    finally:
        for server in servers:
            server.stop()
            if failed:
                print(f"{server.label} log kept: {server.log.name}", file=sys.stderr)
            else:
                server.discard_log()
    return report_compare(arguments, env, results, len(client_cpus or os.sched_getaffinity(0)))


def ratios_to_bare(runs: Sequence[RunResult], bare_runs: Sequence[RunResult]) -> dict[str, float | None]:
    """Ratios of medians, and the median of the per-round (paired) throughput ratios."""
    row, bare = medians(runs), medians(bare_runs)
    paired = [r.rps / b.rps for r, b in zip(runs, bare_runs, strict=True) if b.rps]
    return {
        "throughput": _ratio(row["rps"], bare["rps"]),
        "throughput_paired_median": round(statistics.median(paired), 3) if paired else None,
        "p50": _ratio(row["p50_ms"], bare["p50_ms"]),
        "p99": _ratio(row["p99_ms"], bare["p99_ms"]),
        "server_us_per_call": _ratio(row["server_us_per_call"], bare["server_us_per_call"]),
        # When the server's core is the bottleneck, throughput is 1 / (CPU per call):
        # this estimate holds up even when other load steals some of that core.
        "throughput_from_cpu": _ratio(bare["server_us_per_call"], row["server_us_per_call"]),
        "server_us_per_call_added": (
            round(row["server_us_per_call"] - bare["server_us_per_call"], 1)
            if row["server_us_per_call"] and bare["server_us_per_call"]
            else None
        ),
    }


def machine_notes(results: dict[str, list[RunResult]], client_cores: int, threshold: float) -> list[str]:
    """Warnings that make figures suspect: a saturated generator, other load during runs."""
    notes = []
    for runs in results.values():
        for result in runs:
            note = saturation_note(result, client_cores)
            if note:
                notes.append(f"{result.label}: {note}")
                break
    every = [run for runs in results.values() for run in runs]
    disturbed = [run for run in every if run.other_cpu > threshold]
    if disturbed:
        worst = max(disturbed, key=lambda run: run.other_cpu)
        notes.append(
            f"warning: {len(disturbed)} of {len(every)} runs were disturbed by other load (> {threshold:g} cores; "
            f"worst {worst.other_cpu:.2f}): their figures (throughput most) are less reliable; "
            "server CPU per call is the steadier figure. Rerun when the machine is quiet."
        )
    return notes


def describe_ratio(label: str, ratio: dict[str, Any], arguments: argparse.Namespace, *, unreliable: bool) -> str:
    """One line of ratios to the bare servicer, with the verdict on the goal for the sidecar."""
    verdict = ""
    if label == "sidecar" and arguments.rate:
        verdict = f" (offered {arguments.rate:g}/s to both: compare latencies, not throughput)"
    elif label == "sidecar" and unreliable:
        verdict = " (UNRELIABLE: most runs disturbed by other load; see the CPU-based estimate)"
    elif label == "sidecar":
        ok = ratio["throughput"] is not None and ratio["throughput"] >= GOAL_RATIO
        verdict = f" ({'meets' if ok else 'BELOW'} goal >= {GOAL_RATIO})"
    line = (
        f"{label}/bare: throughput {ratio['throughput']}{verdict}; per-round paired median "
        f"{ratio['throughput_paired_median']}; p50 {ratio['p50']}, p99 {ratio['p99']}"
    )
    if ratio["server_us_per_call_added"] is not None:
        line += (
            f"; server CPU per call {ratio['server_us_per_call']} ({ratio['server_us_per_call_added']:+} us), "
            f"so a server-bound throughput ratio of {ratio['throughput_from_cpu']}"
        )
    return line


def report_compare(
    arguments: argparse.Namespace,
    env: dict[str, Any],
    results: dict[str, list[RunResult]],
    client_cores: int,
) -> int:
    rows = {label: medians(runs) | {"label": label} for label, runs in results.items()}
    ratios = {label: ratios_to_bare(runs, results["bare"]) for label, runs in results.items() if label != "bare"}
    print()
    print(
        f"medians over {arguments.rounds} rounds ({arguments.duration:g} s each, "
        f"concurrency {arguments.concurrency}, pattern {arguments.pattern}; OK/OVER summed):"
    )
    print(table(list(rows.values())))
    every = [run for runs in results.values() for run in runs]
    disturbed = sum(1 for run in every if run.other_cpu > arguments.quiet_threshold)
    for label, ratio in ratios.items():
        print(describe_ratio(label, ratio, arguments, unreliable=disturbed * 2 > len(every)))
    for note in machine_notes(results, client_cores, arguments.quiet_threshold):
        print(note)
    print(f"reproduce: {command_line(arguments)}")
    if arguments.json:
        write_json(
            arguments.json,
            {
                "command": command_line(arguments),
                "environment": env,
                "runs": {label: [asdict(r) for r in runs] for label, runs in results.items()},
                "medians": rows,
                "ratios_to_bare": ratios,
            },
        )
    return 0
