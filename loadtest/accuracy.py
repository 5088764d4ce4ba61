"""Accuracy harness: R real sidecars against one Redis, driven with known traffic.

For every scenario (balanced, skewed, burst at the window start, many keys, a low
limit, a per-minute window, and a closed-loop throughput run) and every mode
(``local`` = memory backend with ``--instances R``, ``sync``, ``strict``) it starts
one redis-server and R sidecar processes on free loopback ports, drives them over
gRPC (one channel per replica, open-loop pacing, bounded in-flight calls), stops
them with SIGTERM and reports, per scenario x mode:

* overshoot (admitted hits beyond the limit, % of the limit, per value and window:
  max and mean), calls straddling a window boundary (left out of overshoot);
* false rejections (receive order; definite; in windows that never filled);
* Redis round trips per request on the request path and in total (from the
  sidecars' shutdown log events, else from ``INFO commandstats`` -- marked ``*``);
* throughput and p50 / p99 latency;
* for redis modes, whether the Redis counters sum to the admitted hits the client saw.

Three scenarios test the other algorithms (``accuracy_harness/algorithms.py`` defines
the figures): ``sliding_steady`` and ``sliding_boundary`` (``algorithm: sliding_window``,
3x the limit steady; a burst straddling a window boundary then 2x to the end of the
window) report the exact sliding count (admitted calls in the unit before each admitted
call) against one exact instance of the estimate fed the same arrivals, and how far the
replicas let the estimate itself go past the limit; ``token_bucket`` reports the most
admitted calls in any interval beyond ``burst + rate x its length``. A mode that does not
offer an algorithm (sync mode refuses token buckets) is reported as skipped, with what
``check-config`` says, not run.

Examples::

    python -m loadtest.accuracy --quick                         # everything, short (CI)
    python -m loadtest.accuracy --quick --scenario balanced_5x,low_limit --modes local,sync,strict
    python -m loadtest.accuracy --quick --scenario sliding_steady,sliding_boundary,token_bucket
    python -m loadtest.accuracy                                 # full run, for docs/accuracy.md
    python -m loadtest.accuracy --quick --readme docs/accuracy.md   # and rewrite its accuracy block
    python -m loadtest.accuracy --smoke --scenario low_limit    # the tests' size: same checks, no figures to quote

It prints a Markdown table (and one per algorithm), the goals of design.md section 5
with verdicts, the command that reproduces the figures and the machine's core count,
and writes the same figures as JSON (``--json``, default ``loadtest/results/accuracy.json``),
the docs block included (``readme_block``; ``--readme FILE`` writes it into FILE, docs/accuracy.md).
Every child process is stopped at the end, also on Ctrl-C or error.
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from loadtest.accuracy_harness import overload, processes, report, runner
from loadtest.accuracy_harness.processes import REDIS_SERVER, RedisServer
from loadtest.accuracy_harness.scenarios import Scenario, catalogue
from loadtest.common import bounded_float, machine_facts, parse_cpus, positive_int, reproduce_command, run_cli
from stack.processes import process_group

HERE = Path(__file__).resolve().parent

REPO = HERE.parent
DEFAULT_JSON = REPO / "loadtest" / "results" / "accuracy.json"


POSITIVE_SECONDS = bounded_float(0, 60, include_low=False)
SMOKE_WINDOWS = 2
"""1 s windows per steady scenario in ``--smoke`` runs (quick: 3): the second window is the first with a
full one before it, where the sliding estimate and the sync bound meet a window boundary under load."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.accuracy",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    names = ", ".join(catalogue(quick=True))
    parser.add_argument(
        "--scenario",
        default="all",
        help=f"comma-separated scenarios, 'all' ({names}) or 'overload' (plain and suppressed windows, 1.5x to 10x)",
    )
    parser.add_argument("--modes", default=",".join(runner.MODES), help="comma-separated: local, sync, strict")
    parser.add_argument("--quick", action="store_true", help="short scenarios and reduced rates (CI)")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help=f"the tests' size: --quick with {SMOKE_WINDOWS} windows per steady scenario unless --windows is given",
    )
    parser.add_argument("--replicas", type=positive_int, default=4, help="sidecar processes (default 4)")
    parser.add_argument("--limit", type=positive_int, help="per-second limit of balanced/skewed/burst")
    parser.add_argument("--windows", type=positive_int, help="1 s windows per per-second scenario")
    parser.add_argument("--sync-interval", type=POSITIVE_SECONDS, help="passed to sync-mode sidecars (default: theirs)")
    parser.add_argument(
        "--sync-max-overshoot",
        type=float,
        help="passed to sync-mode sidecars (their bound on overshoot, fraction of the limit; default: theirs)",
    )
    parser.add_argument("--client-processes", type=positive_int, default=1, help="load-generator processes (open loop)")
    parser.add_argument(
        "--throughput-processes", type=positive_int, default=2, help="load-generator processes (closed loop)"
    )
    parser.add_argument(
        "--throughput-replicas", type=positive_int, help="sidecars in the throughput scenario (default --replicas)"
    )
    parser.add_argument(
        "--throughput-rounds",
        type=positive_int,
        help="throughput runs per mode, alternating the order; the median is reported (default 1 quick, 3 full)",
    )
    parser.add_argument(
        "--timeout",
        type=POSITIVE_SECONDS,
        help="deadline of each call, seconds (default: the scenario's, 25 ms for burst_hour as Envoy sends; else 2 s)",
    )
    parser.add_argument(
        "--redis-timeout", type=POSITIVE_SECONDS, help="passed to redis-mode sidecars (default: theirs)"
    )
    parser.add_argument("--server-cpus", help="pin redis-server and the sidecars to these cpus, e.g. 0 or 0-1")
    parser.add_argument("--client-cpus", help="pin the load generators to these cpus, e.g. 1")
    parser.add_argument("--seed", type=int, default=1, help="seed of the traffic schedules")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write the figures")
    parser.add_argument("--keep-logs", action="store_true", help="keep the sidecar logs and configs")
    parser.add_argument("--dump-calls", type=Path, metavar="DIR", help="write every call of every run as CSV here")
    parser.add_argument(
        "--readme",
        type=Path,
        metavar="FILE",
        help="rewrite the block between <!-- accuracy:start --> and <!-- accuracy:end --> of FILE (docs/accuracy.md)",
    )
    return parser


def command_line(arguments: argparse.Namespace) -> str:
    """The command that reproduces the figures, every option spelled out."""
    return reproduce_command(["python", "-m", "loadtest.accuracy"], arguments, skip={"json", "keep_logs", "dump_calls"})


def environment() -> dict[str, Any]:
    redis_version = subprocess.run(
        [REDIS_SERVER, "--version"], capture_output=True, text=True, check=False, timeout=10
    ).stdout.strip()
    commit = subprocess.run(
        ["git", "-C", str(REPO), "describe", "--always", "--dirty"],
        capture_output=True,
        text=True,
        check=False,
        timeout=10,
    ).stdout.strip()
    return {
        **machine_facts(),
        "usable_cores": len(os.sched_getaffinity(0)),
        "loadavg_at_start": round(os.getloadavg()[0], 2),
        "redis_server": redis_version,
        "git": commit,
    }


def select(text: str, known: Sequence[str], what: str) -> list[str]:
    if text == "all":
        return list(known)
    chosen = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [name for name in chosen if name not in known]
    if unknown:
        raise SystemExit(f"accuracy.py: unknown {what}: {', '.join(unknown)} (known: {', '.join(known)})")
    return chosen


def print_header(command: str, env: dict[str, Any], arguments: argparse.Namespace, modes: Sequence[str]) -> None:
    print(f"command: {command}")
    print(
        f"machine: {env['cores']} cores ({env['usable_cores']} usable, {env['cpu_model']}), load average "
        f"{env['loadavg_at_start']}; Python {env['python']}, grpcio {env['grpcio']}; {env['redis_server']}"
    )
    print(
        f"replicas {arguments.replicas} (throughput: {arguments.throughput_replicas}, "
        f"{arguments.throughput_rounds} round(s)), modes {', '.join(modes)}, "
        f"{'quick' if arguments.quick else 'full'} run; pinning: servers {arguments.server_cpus or 'none'}, "
        f"load generators {arguments.client_cpus or 'none'}"
    )


def print_parameters(parameters: dict[str, dict[str, Any]]) -> None:
    print("scenarios:")
    for name, facts in parameters.items():
        print(
            f"  {name}: {facts['description']}; limit {facts['limit']}/{facts['unit']} per value, "
            f"{facts['keys']} value(s), {facts['rate_total_per_s'] or 'max'} req/s offered "
            f"({facts['shares']}), {facts['duration']:g} s, {facts['planned_calls'] or 'closed-loop'} calls, "
            f"<= {facts['lanes']} in flight per replica"
        )


class Campaign:
    """Every (scenario, mode) run of one invocation, against one redis-server."""

    def __init__(self, arguments: argparse.Namespace, modes: Sequence[str], workdir: Path) -> None:
        self.arguments = arguments
        self.modes = list(modes)
        self.workdir = workdir
        self.options = runner.Options(
            replicas=arguments.replicas,
            sync_interval=arguments.sync_interval,
            client_processes=arguments.client_processes,
            throughput_processes=arguments.throughput_processes,
            timeout=arguments.timeout,
            redis_timeout=arguments.redis_timeout,
            sync_max_overshoot=arguments.sync_max_overshoot,
            client_cpus=parse_cpus(arguments.client_cpus),
            seed=arguments.seed,
            dump_calls=arguments.dump_calls,
            token=f"{os.getpid()}-{int(time.time())}",
        )
        self.rows: list[dict[str, Any]] = []
        self.unavailable: dict[str, str] = {}

    def run(self, scenarios: Sequence[Scenario]) -> None:
        with process_group() as group:
            redis = None
            if any(mode != "local" for mode in self.modes):
                redis = RedisServer(self.workdir / "redis")
                group.start(redis)
                redis.wait_ready()
                print(f"redis-server pid {redis.pid} at {redis.url}", flush=True)
            for scenario in scenarios:
                self._scenario(scenario, group, redis)

    def _scenario(self, scenario: Scenario, group: Any, redis: RedisServer | None) -> None:
        closed = scenario.pattern == "closed"
        rounds = self.arguments.throughput_rounds if closed else 1
        options = replace(self.options, replicas=self.arguments.throughput_replicas) if closed else self.options
        if scenario.replicas:
            options = replace(options, replicas=scenario.replicas)
        runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in self.modes}
        for round_index in range(rounds):
            for mode in self.modes if round_index % 2 == 0 else self.modes[::-1]:
                if mode in self.unavailable:
                    continue
                began = time.monotonic()
                row = runner.run_one(scenario, mode, options=options, group=group, redis=redis, workdir=self.workdir)
                runs[mode].append(row)
                suffix = f"  round {round_index + 1}/{rounds}" if rounds > 1 else ""
                print(progress(row, time.monotonic() - began) + suffix, flush=True)
                if row["status"] == "unavailable":
                    self.unavailable[mode] = row["reason"]
        for mode in self.modes:
            if runs[mode]:
                self.rows.append(median_run(runs[mode]))
            else:
                reason = self.unavailable[mode]
                self.rows.append({"scenario": scenario.name, "mode": mode, "status": "unavailable", "reason": reason})


def fill_defaults(arguments: argparse.Namespace) -> None:
    """The defaults that depend on other options: ``--smoke`` is ``--quick`` with fewer windows."""
    if arguments.smoke:
        arguments.quick = True
        arguments.windows = arguments.windows or SMOKE_WINDOWS
    if arguments.throughput_replicas is None:
        arguments.throughput_replicas = arguments.replicas
    if arguments.throughput_rounds is None:
        arguments.throughput_rounds = 1 if arguments.quick else 3


def run(arguments: argparse.Namespace) -> int:
    fill_defaults(arguments)
    scenarios = catalogue(arguments.quick, arguments.limit, arguments.windows)
    extra = overload.overload_scenarios(arguments.quick, arguments.limit, arguments.windows)
    if arguments.scenario == overload.GROUP:
        arguments.scenario = ",".join(scenario.name for scenario in extra)
    everything = {**scenarios, **{scenario.name: scenario for scenario in extra}}
    chosen = select(arguments.scenario, list(everything if arguments.scenario != "all" else scenarios), "scenario")
    scenarios = everything  # 'all' leaves the overload ones out: --scenario overload runs them
    modes = select(arguments.modes, list(runner.MODES), "mode")
    env = environment()
    command = command_line(arguments)
    print_header(command, env, arguments, modes)
    parameters = {name: scenarios[name].describe(scenarios[name].replicas or arguments.replicas) for name in chosen}
    print_parameters(parameters)
    processes.SERVER_CPUS = parse_cpus(arguments.server_cpus)
    started = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="accuracy-"))
    campaign = Campaign(arguments, modes, workdir)
    campaign.run([scenarios[name] for name in chosen])
    rows = campaign.rows
    elapsed = time.monotonic() - started
    print()
    print(report.table(rows))
    print()
    tables = report.algorithm_tables(rows)
    if tables:
        print(tables)
        print()
    print_overload(rows)
    goal_items = report.goals(rows, arguments.replicas)
    print(report.goals_table(goal_items))
    print()
    print(notes(rows, arguments.replicas))
    print(f"reproduce: {command}")
    print(f"cores: {env['cores']}; total run time {elapsed:.0f} s")
    document = {
        "command": command,
        "environment": env,
        "quick": arguments.quick,
        "replicas": arguments.replicas,
        "modes": modes,
        "scenarios": parameters,
        "results": rows,
        "goals": goal_items,
        "unavailable_modes": campaign.unavailable,
        "elapsed_s": round(elapsed, 1),
    }
    document["readme_block"] = report.readme_block(document, vars(arguments))
    report.write_json(arguments.json, document)
    print(f"wrote {arguments.json}")
    if arguments.readme is not None:
        report.write_readme_block(arguments.readme, document["readme_block"])
        print(f"rewrote the accuracy block of {arguments.readme}")
    if arguments.keep_logs:
        print(f"logs and configs kept in {workdir}")
    else:
        _remove(workdir)
    return 1 if any(row.get("status") == "failed" for row in rows) else 0


def print_overload(rows: Sequence[dict[str, Any]]) -> None:
    """The table of the overload scenarios, when any ran (loadtest/accuracy_harness/overload.py)."""
    suppressed = overload.table(rows)
    if suppressed:
        print("overload: suppress against plain fixed windows (figures: loadtest/accuracy_harness/overload.py):")
        print(suppressed)
        print()


def median_run(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median throughput (lower median), with every round's figure attached."""
    if len(runs) == 1:
        return runs[0]
    failed = [run for run in runs if run.get("status") != "ok"]
    if failed:
        return failed[0]
    ordered = sorted(runs, key=lambda run: run["traffic"]["rps"])
    chosen = dict(ordered[(len(ordered) - 1) // 2])
    chosen["rounds_rps"] = [run["traffic"]["rps"] for run in runs]
    chosen["rounds_failure_decisions"] = [report.failure_decisions(run) for run in runs]
    return chosen


def progress(row: dict[str, Any], seconds: float) -> str:
    head = f"  {row['scenario']:<14} {row['mode']:<7}"
    if row["status"] != "ok":
        return f"{head} {row['status']}: {row.get('reason')} ({seconds:.1f} s)"
    traffic, acc = row["traffic"], row["accuracy"]
    text = f"{head} {traffic['sent']:>7} sent {traffic['rps']:>7.0f}/s p99 {traffic['p99_ms']:.2f} ms; "
    figures = row.get("algorithm_accuracy")
    if figures and figures["algorithm"] == "sliding_window":
        text += (
            f"exact sliding max {figures['exact_max_pct']:.1f} % (reference {figures['reference_exact_max_pct']:.1f}"
            f" %); estimate over by {figures['estimate_over_definite_max_hits']} definite; false rej. vs estimate "
            f"{figures['false_vs_estimate_definite']} definite"
        )
    elif figures:
        text += (
            f"bucket excess {figures['excess_max_hits']:.2f} ({figures['excess_definite_max_hits']:.2f} definite); "
            f"admitted {figures['admitted']} vs ideal {figures['ideal_admitted']}; false rej. "
            f"{figures['false_rejections_definite']} definite"
        )
    else:
        text += (
            f"overshoot max {acc['overshoot_max_pct']:.2f} %; false rej. {acc['false_rejections']}/"
            f"{acc['false_rejections_definite']}/{acc['rejected_in_unfilled_windows']}"
        )
    if row["mode"] != "local":
        rt = row["round_trips"]
        text += f"; RT/req {rt.get('rt_per_request_path')} path, {rt.get('rt_per_request_total')} total"
    if "redis_check" in row:
        check = row["redis_check"]
        text += f"; Redis {check['redis_total']} vs admitted {check['client_admitted']}"
    if row.get("warning"):
        text += f"; WARNING {row['warning']}"
    return text + f" ({seconds:.1f} s)"


def notes(rows: Sequence[dict[str, Any]], replicas: int) -> str:
    """Footnotes: how to read the table, and what the run itself may have distorted."""
    lines = [
        "Notes: overshoot per (value, window) over calls sent and answered inside the window; "
        "'sat.' = windows whose offered hits exceeded the limit (overshoot mean is over those); "
        "false rejections: receive-order / definite / in windows never filled (see analysis.py); "
        "* = round trips estimated from INFO commandstats (no shutdown event)."
    ]
    for row in rows:
        if row.get("status") != "ok":
            continue
        traffic = row["traffic"]
        label = f"{row['scenario']}/{row['mode']}"
        if traffic["late_calls"]:
            lines.append(
                f"- {label}: {traffic['late_calls']} calls went out > 10 ms late "
                f"(max {traffic['max_late_ms']} ms): the load generator or the machine fell behind"
            )
        if row["mode"] != "local" and row.get("replicas_converged_s") is None and row["replicas"] > 1:
            lines.append(f"- {label}: the sidecars did not all log seeing {row['replicas']} live replicas in time")
        other = row.get("cpu", {}).get("other_processes_cores", 0.0)
        if other > 0.3:
            lines.append(f"- {label}: other processes used {other} cores during the run: figures are disturbed")
        if traffic["errors"]:
            lines.append(f"- {label}: errors {traffic['errors']}")
        if row.get("warning"):
            lines.append(f"- {label}: {row['warning']}")
        stats = row.get("round_trips", {}).get("backend_stats")
        if stats:
            lines.append(f"- {label}: backend counters {stats}")
        check = row.get("redis_check")
        if check and not check["match"]:
            cause = (
                "; the sidecars decided calls without Redis (failure mode) -- a script that timed out on the "
                "sidecar may still have run in Redis"
                if report.failure_decisions(row)
                else ""
            )
            lines.append(
                f"- {label}: Redis counters {check['redis_total']} != admitted {check['client_admitted']} "
                f"(difference {check['difference']:+d}, values mismatched {check.get('values_mismatched')}, "
                f"calls with unknown outcome {check['calls_with_unknown_outcome']}){cause}"
            )
    loads = [load for row in rows if (load := row.get("loadavg_1m_after")) is not None]
    if loads:
        lines.append(
            f"- load average (1 min) after each run: min {min(loads)}, max {max(loads)} on {os.cpu_count()} cores"
            " (other work on the machine distorts latency and pushes Redis calls past their timeout)"
        )
    return "\n".join(lines)


def _remove(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    arguments = build_parser().parse_args(argv)
    return run_cli("loadtest.accuracy", functools.partial(run, arguments), (signal.SIGTERM,))


if __name__ == "__main__":
    sys.exit(main())
