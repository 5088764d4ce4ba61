"""Side-by-side comparison: the same recorded traffic through Envoy + sidecar and through HAProxy stick tables.

Five paths, all on 127.0.0.1, in front of one sample app (``stack/upstream.py``):

(a) ``envoy_memory``     Envoy (``envoy/front.yaml``) + one sidecar, memory backend;
(b) ``envoy_sync``       two Envoys + two sidecars in ``sync`` mode sharing one redis-server; each
                         client's requests alternate between the Envoys, so the shared limit is measured;
(c) ``haproxy_fixed``    HAProxy 2.6, the exporter's fixed-window flavour (clock-aligned windows);
(d) ``haproxy_sliding``  HAProxy 2.6, the sliding flavour (``gpc_rate`` over the last second);
(e) ``envoy_sliding``    Envoy + one sidecar, memory backend, the per-address rule with
                         ``algorithm: sliding_window`` (HAProxy's estimate, enforced by the sidecar).

HAProxy sees the same client identities as Envoy: both generated parts of ``haproxy/haproxy.cfg``
are exported again with ``--fetch remote_address=req.hdr_ip(x-forwarded-for,-1)`` (the last
``X-Forwarded-For`` address, which Envoy uses with one trusted hop), spliced into a copy of the
shipped file and checked with ``haproxy -c -dW`` before use.

**The recording** (``compare_harness/recording.py``): a deterministic schedule of (send time,
client, path, headers) from ``--seed``: ``--clients`` addresses against the per-address limit
(20/s), 2x the limit steady, a quiet stretch, then 1.5x the limit in the last 200 ms of a second
and 1.5x in the first 200 ms of the next, then steady again, over ``--duration`` seconds. It is
saved into the JSON and replayed open loop (each request at its time on pre-opened keep-alive
connections, whatever the earlier ones did) on every path, with the recording's second 0 on a
wall-clock second boundary.

**Accuracy** (``compare_harness/analysis.py``): per client and clock second the ideal is an exact
fixed window, min(requests decided in it, limit); overshoot = admitted beyond the ideal, false
rejections = ideal minus admitted when short, both summed over client-windows. Each request is
placed in the second holding [sent - margin, answered + margin] (the limiter decided inside that
interval, on the same clock); those crossing a boundary are ambiguous and go to the side closest
to the ideal. Also: what each client got through the burst (an exact fixed window admits 2x the
limit there) and the most admitted per client in any 1 s span.

**Sliding windows** (``compare_harness/sliding.py``): when (d) and (e) both run, their admissions
per clock second are set next to one exact two-window estimate fed the schedule, with the largest
difference per second and per client-second, how many verdicts differ, and how many of each path's
verdicts its own formula explains. Both count admitted requests only (HAProxy's ``gpc_rate`` is
incremented after the deny rules); HAProxy starts a counter's periods at its first hit, and each
client's first request goes out 0.2 ms after second 0, so both use the same one-second grid.

**Throughput** is measured separately per path: closed loop, ``--concurrency`` keep-alive
connections with one request in flight each, every request from another address (65,536
addresses, so nearly all are admitted: the cost of asking, not of refusing), ``--throughput-duration``
seconds after a short warm-up; responses per second, their p50/p99 latency, and the CPU time of
the path's server processes per request. The load generator is one Python process: HAProxy's
figure is bounded by it, not by HAProxy.

The paths alternate in ``--rounds`` rounds (the order rotates), so noise hits all of them.
Prints a Markdown table, admitted per second, notes and the command that reproduces the figures;
writes the table (``--md``), a PNG plot (``--png``; ``--docs`` also copies it to docs/compare.png)
and every request's outcome as JSON (``--json``). Every child process is stopped at the end, also
on Ctrl-C, SIGTERM or error.

Examples::

    python -m loadtest.compare                           # ~10 s recording, 3 rounds (about 3 minutes)
    python -m loadtest.compare --quick                   # ~4 s recording, 1 round, 1 s throughput phases
    python -m loadtest.compare --smoke                   # the tests': 3 s recording, 0.5 s throughput phases
    python -m loadtest.compare --server-cpus 0 --client-cpus 1 --docs
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import uvloop

from loadtest.common import (
    bounded_float,
    cpu_seconds_of,
    machine_facts,
    percentile,
    positive_int,
    print_header,
    program_version,
    reproduce_command,
    run_cli,
    split_cpus,
    tool_parser,
)
from loadtest.compare_harness import analysis, client, paths, plot, report, sliding
from loadtest.compare_harness.recording import MIN_DURATION, Recording, record

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

RESULTS = REPO / "loadtest" / "results"
DOCS_PNG = REPO / "docs" / "compare.png"
RULE = "demo.remote_address"
"""The per-address rule of examples/config the recording runs against."""
SETTLE = 3.0
"""Seconds between two replays on one path: HAProxy's sliding entries (1 s periods) forget the last one."""
LEAD = 0.5
"""The least time between deciding a replay's start second and that second."""
WARMUP = 0.3
QUICK = {"duration": 4.0, "rounds": 1, "throughput_duration": 1.0}
SMOKE = {"duration": MIN_DURATION, "rounds": 1, "throughput_duration": 0.5}
"""The tests' size: the shortest recording that still holds the burst across a boundary."""
FULL = {"duration": 10.0, "rounds": 3, "throughput_duration": 3.0}


def address_limit() -> int:
    """The per-address limit of ``examples/config`` (requests per second)."""
    from sidecar.config.load import load_config

    for rule in load_config(REPO / "examples" / "config").domains["demo"].rules:
        if rule.stat_key == RULE:
            if rule.unit_seconds != 1:
                raise RuntimeError(f"{RULE} is not a per-second limit any more")
            return rule.requests_per_unit
    raise RuntimeError(f"examples/config has no rule {RULE}")


def versions() -> dict[str, str]:
    found = {name: program_version(name) for name in ("envoy", "haproxy")}
    describe = ["git", "-C", str(REPO), "describe", "--always", "--dirty"]
    found["git"] = subprocess.run(describe, capture_output=True, text=True, check=False, timeout=10).stdout.strip()
    return found


class Campaign:
    """The rounds of one invocation against one set of processes."""

    def __init__(self, arguments: argparse.Namespace, recording: Recording, bench: paths.Bench) -> None:
        self.arguments = arguments
        self.recording = recording
        self.bench = bench
        self.accuracy: list[dict[str, Any]] = []
        self.throughput: list[dict[str, Any]] = []
        self.last_end: dict[str, float] = {}
        self.addresses_used = 0

    def run(self, names: Sequence[str]) -> None:
        rounds = self.arguments.rounds
        for number in range(1, rounds + 1):
            shift = (number - 1) % len(names)
            order = list(names[shift:]) + list(names[:shift])
            for name in order:
                self.accuracy.append(self.replay(name, number))
            for name in order:
                self.throughput.append(self.closed_loop(name, number))

    def _targets(self, path: paths.Contender) -> list[int]:
        """Per request, which entry of the path it goes to: each client's requests alternate."""
        seen: Counter[int] = Counter()
        targets = []
        for item in self.recording.requests:
            targets.append(seen[item.client] % len(path.ports))
            seen[item.client] += 1
        return targets

    def replay(self, name: str, number: int) -> dict[str, Any]:
        path = self.bench.paths[name]
        arguments = self.arguments
        earliest = max(time.time() + LEAD, self.last_end.get(name, 0.0) + SETTLE)
        start = math.ceil(earliest)
        before = path.envoy_counters()
        targets = self._targets(path)
        began = time.monotonic()
        outcome = uvloop.run(
            client.replay(
                self.recording.requests,
                path.ports,
                lambda index, _item: targets[index],
                start=start,
                connections=arguments.connections,
                max_connections=4 * arguments.connections,
                timeout=arguments.timeout,
            )
        )
        self.last_end[name] = time.time()
        after = path.envoy_counters()
        summary = analysis.summarize(self.recording, outcome, arguments.margin)
        summary.update(path=name, round=number)
        summary["envoy"] = {key: after[key] - before.get(key, 0) for key in after if after[key] != before.get(key, 0)}
        summary["outcome_fields"] = analysis.OUTCOME_FIELDS
        summary["outcomes"] = analysis.outcome_rows(outcome)
        print(progress_accuracy(summary, time.monotonic() - began, self.arguments.rounds), flush=True)
        return summary

    def closed_loop(self, name: str, number: int) -> dict[str, Any]:
        path = self.bench.paths[name]
        arguments = self.arguments
        before_cpu = cpu_seconds_of(path.pids)
        before = path.envoy_counters()
        result = uvloop.run(
            client.closed_loop(
                path.ports,
                concurrency=arguments.concurrency,
                warmup=WARMUP,
                duration=arguments.throughput_duration,
                timeout=arguments.timeout,
                first_address=self.addresses_used,
            )
        )
        after_cpu = cpu_seconds_of(path.pids)
        after = path.envoy_counters()
        self.addresses_used += result.total
        latencies = sorted(result.latencies)
        admitted = result.statuses.get(200, 0)
        figures: dict[str, Any] = {
            "path": name,
            "round": number,
            "seconds": result.seconds,
            "completed": result.completed,
            "total": result.total,
            "rps": round(result.completed / result.seconds, 1),
            "p50_ms": round(percentile(latencies, 0.50) * 1000, 3),
            "p99_ms": round(percentile(latencies, 0.99) * 1000, 3),
            "statuses": {str(status): count for status, count in sorted(result.statuses.items())},
            "admitted_pct": round(100.0 * admitted / result.completed, 2) if result.completed else None,
            "errors": result.errors,
            "cpu_us_per_request": None,
            "envoy": {key: after[key] - before.get(key, 0) for key in after if after[key] != before.get(key, 0)},
        }
        if before_cpu is not None and after_cpu is not None and result.total:
            figures["cpu_us_per_request"] = round((after_cpu - before_cpu) / result.total * 1e6, 1)
        print(progress_throughput(figures, self.arguments.rounds), flush=True)
        return figures


def progress_accuracy(summary: dict[str, Any], seconds: float, rounds: int) -> str:
    failed = sum(summary["failed"].values())
    fail_open = summary["envoy"].get("failure_mode_allowed", 0)
    return (
        f"  round {summary['round']}/{rounds} replay     {paths.SHORT[summary['path']]:<26} "
        f"{summary['sent']} sent, {summary['admitted']} admitted (ideal {summary['ideal']}): "
        f"overshoot {summary['overshoot']}, false rejections {summary['shortfall']}, "
        f"burst per client {summary['burst_admitted_per_client']}, ambiguous {summary['ambiguous']}"
        f"{f', failed {failed}' if failed else ''}{f', Envoy failed open {fail_open}' if fail_open else ''}; "
        f"p99 {summary['latency_p99_ms']:.2f} ms, latest send {summary['late_max_ms']:.1f} ms ({seconds:.1f} s)"
    )


def progress_throughput(figures: dict[str, Any], rounds: int) -> str:
    cpu = figures["cpu_us_per_request"]
    errors = f", errors {figures['errors']}" if figures["errors"] else ""
    return (
        f"  round {figures['round']}/{rounds} throughput {paths.SHORT[figures['path']]:<26} "
        f"{figures['rps']:,.0f} req/s ({figures['admitted_pct']} % admitted), p50 {figures['p50_ms']:.2f} ms, "
        f"p99 {figures['p99_ms']:.2f} ms, server CPU {'-' if cpu is None else f'{cpu:.0f}'} µs/req"
        f"{errors}"
    )


def command_line(arguments: argparse.Namespace) -> str:
    return reproduce_command(
        ["python", "-m", "loadtest.compare"], arguments, skip={"json", "md", "png", "docs", "keep_logs"}
    )


def markdown(
    *,
    arguments: argparse.Namespace,
    recording: Recording,
    summary: dict[str, dict[str, Any]],
    first_round: Sequence[dict[str, Any]],
    notes: Sequence[str],
    command: str,
    facts: dict[str, Any],
    sliding_figures: dict[str, Any] | None = None,
) -> str:
    throughput = f"closed loop ({arguments.concurrency} conns, {arguments.throughput_duration:g} s)"
    parts = [
        "## Side by side: Envoy + sidecar and HAProxy stick tables",
        "",
        f"Recording: {recording.describe()}.",
        "",
        report.main_table(summary, recording, arguments.rounds, throughput),
        "",
        "Admitted per clock second, all clients together (round 1; a cell shows the path's own ideal when its "
        "decision seconds make it differ from the schedule's):",
        "",
        report.per_second_table(first_round, recording),
        "",
    ]
    if sliding_figures is not None:
        parts += [
            "Sliding windows: our `sliding_window` (Envoy + sidecar) and HAProxy's sliding rate counter, admitted per "
            "clock second, all clients together (round 1; each admission at the first instant of its sent..answered "
            "interval at which the path's formula admits it; ideal: one exact two-window estimate fed the schedule):",
            "",
            sliding.table(sliding_figures, paths.LABELS),
            "",
            *sliding.summary_lines(sliding_figures),
            "",
        ]
    parts += [
        *notes,
        "",
        f"Machine: {facts['cores']} cores ({facts['cpu_model']}), load average {facts['loadavg']:.2f} at start; "
        f"{facts['envoy']}; {facts['haproxy']}; git {facts['git']}.",
        "",
        f"Reproduce: `{command}`",
        "",
    ]
    return "\n".join(parts)


def measure(
    arguments: argparse.Namespace, recording: Recording, names: Sequence[str], workdir: Path
) -> tuple[paths.Bench, Campaign]:
    """Start the paths (servers on ``--server-cpus``), run every round, stop everything."""
    server_cpus, client_cpus = split_cpus(arguments.server_cpus, arguments.client_cpus)
    began = time.monotonic()
    original = os.sched_getaffinity(0)
    if server_cpus is not None:
        os.sched_setaffinity(0, server_cpus)  # the servers inherit it
    bench = paths.start(workdir, names, redis_timeout=arguments.redis_timeout)
    try:
        os.sched_setaffinity(0, client_cpus or original)
        print(f"paths up in {time.monotonic() - began:.1f} s; logs in {workdir}", flush=True)
        if bench.haproxy_config is not None:
            for line in bench.haproxy_config.commands:
                print(f"haproxy rules: {line}", flush=True)
        campaign = Campaign(arguments, recording, bench)
        campaign.run(names)
    finally:
        bench.group.close()
    return bench, campaign


def run(arguments: argparse.Namespace) -> int:
    names = select_paths(arguments.paths)
    recording = record(arguments.seed, clients=arguments.clients, limit=address_limit(), duration=arguments.duration)
    server_cpus, client_cpus = split_cpus(arguments.server_cpus, arguments.client_cpus)
    command = command_line(arguments)
    facts = {**machine_facts(), **versions(), "loadavg": os.getloadavg()[0]}
    pins = f"pinning: servers {server_cpus or 'no'}, load generator {client_cpus or 'no'}"
    print_header(command, facts, facts["loadavg"], f"{facts['envoy']}; {facts['haproxy']}; {pins}")
    print(f"recording: {recording.describe()}", flush=True)
    started = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="compare-"))
    try:
        bench, campaign = measure(arguments, recording, names, workdir)
    except BaseException:
        print(f"compare.py: logs of the processes kept in {workdir}", file=sys.stderr)
        raise
    shutdown = paths.sidecar_shutdown_stats(bench)
    summary = report.aggregate(names, campaign.accuracy, campaign.throughput)
    first_round = [item for item in campaign.accuracy if item["round"] == 1]
    first_round.sort(key=lambda item: names.index(item["path"]))
    sliding_figures = compare_sliding(recording, first_round, arguments.margin)
    text = markdown(
        arguments=arguments,
        recording=recording,
        summary=summary,
        first_round=first_round,
        notes=report.notes(summary, shutdown, arguments.margin),
        command=command,
        facts=facts,
        sliding_figures=sliding_figures,
    )
    print()
    print(text)
    written = write_outputs(arguments, recording, text, first_round)
    document = {
        "command": command,
        "machine": {**facts, "server_cpus": server_cpus, "client_cpus": client_cpus},
        "options": {key: str(value) if isinstance(value, Path) else value for key, value in vars(arguments).items()},
        "paths": {name: paths.LABELS[name] for name in names},
        "haproxy": {
            "export_commands": bench.haproxy_config.commands if bench.haproxy_config else [],
            "exporter_notes": bench.haproxy_config.notes if bench.haproxy_config else [],
        },
        "recording": recording.to_json(),
        "summary": summary,
        "accuracy_runs": campaign.accuracy,
        "throughput_runs": campaign.throughput,
        "sidecar_shutdown": shutdown,
        "sliding_comparison": sliding_figures,
        "elapsed_s": round(time.monotonic() - started, 1),
    }
    arguments.json.parent.mkdir(parents=True, exist_ok=True)
    arguments.json.write_text(json.dumps(document) + "\n")
    written.append(arguments.json)
    print(f"wrote {', '.join(str(path) for path in written)}")
    print(f"reproduce: {command}")
    if arguments.keep_logs:
        print(f"logs and configs kept in {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


def compare_sliding(
    recording: Recording, first_round: Sequence[dict[str, Any]], margin: float
) -> dict[str, Any] | None:
    """Our sliding window against HAProxy's on round 1, when both paths ran (None otherwise)."""
    runs = {}
    for item in first_round:
        if item["path"] in (sliding.OURS, sliding.HAPROXY):
            outcomes = analysis.outcomes_from_rows(item["outcomes"], item["start"])
            runs[item["path"]] = (client.Replay(item["start"], outcomes), item)
    if len(runs) < 2:
        return None
    return sliding.compare(recording, runs, margin)


def write_outputs(
    arguments: argparse.Namespace, recording: Recording, text: str, first_round: Sequence[dict[str, Any]]
) -> list[Path]:
    """The Markdown report and the plot (and its copy under docs/ with ``--docs``)."""
    arguments.md.parent.mkdir(parents=True, exist_ok=True)
    arguments.md.write_text(text)
    title = (
        f"The same recording through each path (round 1 of {arguments.rounds}; "
        f"{recording.clients} clients, limit {recording.limit}/s each)"
    )
    plot.draw(first_round, recording, arguments.png, title)
    written = [arguments.md, arguments.png]
    if arguments.docs:
        DOCS_PNG.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(arguments.png, DOCS_PNG)
        written.append(DOCS_PNG)
    return written


def select_paths(text: str) -> list[str]:
    known = list(paths.LABELS)
    if text == "all":
        return known
    chosen = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [name for name in chosen if name not in known]
    if unknown or not chosen:
        raise SystemExit(f"compare.py: unknown paths {', '.join(unknown)} (known: {', '.join(known)})")
    return [name for name in known if name in chosen]


def build_parser() -> argparse.ArgumentParser:
    parser = tool_parser("loadtest.compare", __doc__)
    parser.add_argument("--quick", action="store_true", help="4 s recording, 1 round, 1 s throughput phases")
    parser.add_argument(
        "--smoke", action="store_true", help="the tests' size (implies --quick): 3 s recording, 0.5 s throughput phases"
    )
    parser.add_argument(
        "--duration", type=bounded_float(MIN_DURATION, 120), help="seconds of recorded traffic (default 10; quick 4)"
    )
    parser.add_argument("--rounds", type=positive_int, help="rounds over all paths (default 3; quick 1)")
    parser.add_argument(
        "--throughput-duration",
        type=bounded_float(0.2, 60),
        help="measured seconds of each closed-loop phase (default 3; quick 1)",
    )
    parser.add_argument("--paths", default="all", help=f"comma-separated, or all ({', '.join(paths.LABELS)})")
    parser.add_argument("--clients", type=positive_int, default=4, help="client addresses in the recording (default 4)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the recording (default 1)")
    parser.add_argument(
        "--concurrency", type=positive_int, default=16, help="connections of the closed-loop phase (default 16)"
    )
    parser.add_argument(
        "--connections", type=positive_int, default=8, help="keep-alive connections opened per entry before a replay"
    )
    parser.add_argument("--timeout", type=bounded_float(0.1, 60), default=2.0, help="per request, seconds")
    parser.add_argument(
        "--margin",
        type=bounded_float(0, 0.1),
        default=analysis.DEFAULT_MARGIN,
        help="seconds added on both sides of a request's sent..answered interval before placing it in a second",
    )
    parser.add_argument(
        "--redis-timeout",
        type=bounded_float(0.001, 1),
        help="passed to the sync-mode sidecars (default: theirs, 5 ms); keep it under Envoy's 25 ms timeout",
    )
    parser.add_argument("--server-cpus", help="pin every server to these cpus, e.g. 0")
    parser.add_argument("--client-cpus", help="pin the load generator (this process) to these cpus, e.g. 1")
    parser.add_argument("--json", type=Path, default=RESULTS / "compare.json", help="every figure and request")
    parser.add_argument("--md", type=Path, default=RESULTS / "compare.md", help="the Markdown report")
    parser.add_argument("--png", type=Path, default=RESULTS / "compare.png", help="the plot")
    parser.add_argument("--docs", action="store_true", help=f"also copy the plot to {DOCS_PNG.relative_to(REPO)}")
    parser.add_argument("--keep-logs", action="store_true", help="keep the processes' logs and configs")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    arguments = build_parser().parse_args(argv)
    arguments.quick = arguments.quick or arguments.smoke
    defaults = SMOKE if arguments.smoke else QUICK if arguments.quick else FULL
    for key, value in defaults.items():
        if getattr(arguments, key) is None:
            setattr(arguments, key, value)
    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    return run_cli("loadtest.compare", functools.partial(run, arguments), signals)


if __name__ == "__main__":
    sys.exit(main())
