"""Throughput of the four ways Envoy can rate-limit, in one run on one Envoy binary, with a C load generator.

Why: the per-request path (Envoy's ``ratelimit`` filter asking the sidecar) costs one gRPC
call into Python per request; quota mode (Envoy's ``rate_limit_quota`` filter, the sidecar
assigning over one stream) should cost about what Envoy's in-process ``local_ratelimit``
costs. Goal (issue 15): quota >= 0.9x ``local_ratelimit`` req/s, sidecar under 1% of a core.

Variants, all with the routes of ``envoy/front.yaml`` in front of the sample app
(``stack/upstream.py``), one Envoy worker (``--concurrency 1``) pinned to ``--envoy-cpu``:

(a) ``envoy``   Envoy alone (the ``ratelimit`` filter removed);
(b) ``local``   Envoy + ``local_ratelimit`` (one token bucket far above the load);
(b') ``local-per-client``  Envoy + ``local_ratelimit`` with quota mode's limit: a descriptor built
    from the client address per request and a token bucket per client address (a wildcard
    descriptor, ``loadtest/local_limits.py``): (c)'s work done in Envoy alone, the like-for-like
    baseline; (b) builds no descriptor at all;
(c) ``quota``   Envoy + the ``rate_limit_quota`` filter(s) of ``export-envoy-quota`` + a sidecar,
    one Envoy per ``--quota-shapes`` entry (``loadtest/quota_shapes.py``: the same buckets,
    matched differently; ``--extra-routes N`` puts N routes before front.yaml's in every variant);
(d) ``ratelimit`` Envoy + ``ratelimit`` filter + a sidecar (memory backend).

The sidecars run as real processes (``python -m sidecar serve``) on a config whose only rule
is 10^9 requests/s per client address, so everything is admitted: what is measured is the
cost of asking, not of refusing. ``wrk`` (Debian) sends ``GET /bench`` (the catch-all route:
one descriptor, the client address) on keep-alive connections, pinned to ``--client-cpu``;
the app and the sidecars are not pinned (the scheduler places them).
Rounds alternate a, b, b', c, d; the report gives per variant the median req/s over rounds and
its ratios to (b) and to (b'), and for (c) the sidecar's CPU (``/proc/<pid>/stat`` utime + stime from 1 s
into each run to 0.5 s before its end) and whether the sidecar answered the RLQS stream: a
quota result counts only if it did (else Envoy ran on ``no_assignment_behavior`` alone).

    python -m loadtest.quota_paths                         # 3 rounds x 5 s per variant, Envoy on cpu 0, wrk on 1
    python -m loadtest.quota_paths --rounds 5 --plot docs/quota-paths.png
    python -m loadtest.quota_paths --rounds 7 --quota-shapes route,list,tree,cel,list-all,route-all

Each round runs every variant once, starting one variant later than the round before (so no
variant always runs first or right after another); the report gives per variant the median
over rounds, its ratio to (b) (of medians) and the spread of the per-round ratio to (b) (each
round's run divided by the same round's (b) run: median, min-max), and the same against (b').

Only 127.0.0.1; every child is stopped at the end, also on Ctrl-C, SIGTERM or error.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtest.common import (
    cpu_seconds,
    dash,
    machine_facts,
    md_table,
    positive_int,
    print_header,
    reproduce_command,
    run_cli,
    scrape_metrics,
    tool_parser,
)
from loadtest.local_limits import LIMIT, local_per_client, local_ratelimit
from loadtest.quota_shapes import (
    DEFAULT_SHAPE,
    QUOTA_SHAPES,
    TEMPLATE,
    add_routes,
    extra_count,
    quota_config,
    shape_list,
)
from stack.envoy import ConfiguredEnvoy, EnvoyPorts, admin_get, envoy_binary, render
from stack.processes import ProcessGroup
from stack.sidecar import SidecarProcess
from stack.upstream import UpstreamProcess

PATH = "/bench"
VARIANTS = {
    "envoy": "(a) Envoy alone",
    "local": "(b) Envoy + local_ratelimit",
    "local-per-client": "(b') Envoy + local_ratelimit, a bucket per client",
    "quota": "(c) Envoy + rate_limit_quota + sidecar",
    "ratelimit": "(d) Envoy + ratelimit filter + sidecar",
}
REFERENCE = "local"
PER_CLIENT = "local-per-client"
"""The second reference: (b'), the same per-client limit as (c), in Envoy alone."""
SIDECARLESS = ("envoy", "local", PER_CLIENT)
CPU_SKIP_START = 1.0
CPU_SKIP_END = 0.5
BENCH_CONFIG = f"""\
# quota_paths: one rule, far above any load, so every request is admitted
domain: demo
descriptors:
  - key: remote_address
    rate_limit:
      unit: second
      requests_per_unit: {LIMIT}
"""


# ---------------------------------------------------------------------------------
# Envoy configs
# ---------------------------------------------------------------------------------


def variant_config(
    variant: str, ports: EnvoyPorts, rules: Path, shapes: Sequence[str], extra_routes: int = 0
) -> dict[str, Any]:
    """The Envoy config of one variant on ``ports`` (``ports.ratelimit``: that variant's sidecar),
    with ``extra_routes`` routes before front.yaml's (:func:`add_routes`)."""
    config = add_routes(render(TEMPLATE, ports, ratelimit=variant not in SIDECARLESS), extra_routes)
    if variant == "envoy":
        return config
    if variant == "local":
        return local_ratelimit(config, TEMPLATE)
    if variant == PER_CLIENT:
        return local_per_client(config, TEMPLATE)
    if variant == "ratelimit":
        return config
    return quota_config(config, rules, shape_of(variant, shapes))


def quota_variants(shapes: Sequence[str]) -> dict[str, str]:
    """Every variant, (c) once per shape: ``quota`` for the first, ``quota:<shape>`` for the others."""
    found = {key: label for key, label in VARIANTS.items() if key in SIDECARLESS}
    for number, shape in enumerate(shapes):
        suffix = f" [{shape}]" if len(shapes) > 1 else ""
        found["quota" if number == 0 else f"quota:{shape}"] = VARIANTS["quota"] + suffix
    found["ratelimit"] = VARIANTS["ratelimit"]
    return found


def shape_of(variant: str, shapes: Sequence[str]) -> str:
    return variant.partition(":")[2] or shapes[0]


class PinnedEnvoy(ConfiguredEnvoy):
    """Envoy with one worker, pinned to one cpu by ``taskset`` (all its threads)."""

    def __init__(self, variant: str, config: dict[str, Any], ports: EnvoyPorts, directory: Path, cpu: int) -> None:
        self.ports = ports
        super().__init__(f"envoy-{variant}", config, directory, listen=ports.listen, admin=ports.admin, cpu=cpu)

    def stats(self, pattern: str) -> dict[str, int]:
        """Counters and gauges whose names match ``pattern`` (an Envoy stats filter regex)."""
        values = {}
        for line in admin_get(self.admin, f"/stats?filter={pattern}").splitlines():
            name, _, value = line.partition(": ")
            if value.strip().isdigit():
                values[name] = int(value)
        return values


@dataclass
class Servers:
    group: ProcessGroup
    envoys: dict[str, PinnedEnvoy] = field(default_factory=dict)
    quota_sidecar: SidecarProcess | None = None


def start_servers(directory: Path, arguments: argparse.Namespace) -> Servers:
    """The app, two sidecars (one for (c), one for (d)) and an Envoy per variant, each waited for."""
    rules = directory / "bench.yaml"
    rules.write_text(BENCH_CONFIG)
    group = ProcessGroup()
    servers = Servers(group)
    try:
        # Through the launchers that build a child again on fresh ports when another process
        # took one between choosing and binding it.
        app = group.start_ready(lambda: UpstreamProcess("app", directory))
        serve = ["--config", str(rules), "--backend", "memory", "--log-level", "warning"]
        builds = [functools.partial(SidecarProcess, f"sidecar-{n}", serve, directory) for n in ("quota", "ratelimit")]
        quota, per_request = group.start_all_ready(builds)
        servers.quota_sidecar = quota
        sidecars = {"quota": quota.port, "ratelimit": per_request.port}

        def envoy(variant: str) -> Callable[[], PinnedEnvoy]:
            def build() -> PinnedEnvoy:
                ports = EnvoyPorts.free(app.port, sidecars.get(variant, quota.port))
                config = variant_config(variant, ports, rules, shapes_of(arguments), arguments.extra_routes)
                return PinnedEnvoy(variant, config, ports, directory, arguments.envoy_cpu)

            return build

        variants = quota_variants(shapes_of(arguments))
        servers.envoys.update(zip(variants, group.start_all_ready([envoy(v) for v in variants]), strict=True))
    except BaseException:
        group.close()
        raise
    return servers


# ---------------------------------------------------------------------------------
# wrk
# ---------------------------------------------------------------------------------


@dataclass
class RunResult:
    variant: str
    round: int
    requests_per_second: float
    requests: int
    non_2xx: int
    socket_errors: int
    p50_ms: float
    p99_ms: float
    sidecar_cpu_percent: float | None = None
    sidecar_cpu_seconds: float = 0.0
    sidecar_window_seconds: float = 0.0
    envoy_cpu_seconds: float | None = None
    """Envoy's user + system CPU over the whole run: its work per request, which other processes
    on the machine slow down far less than they slow down its requests per second."""


_UNITS_MS = {"us": 0.001, "ms": 1.0, "s": 1000.0, "m": 60000.0}


def parse_wrk(text: str) -> dict[str, Any]:
    """Requests/s, request count, non-2xx, socket errors and p50/p99 (ms) from ``wrk --latency``."""

    def number(pattern: str) -> float:
        found = re.search(pattern, text)
        return float(found.group(1)) if found else 0.0

    def latency(percent: str) -> float:
        found = re.search(rf"^\s*{percent}%\s+([\d.]+)(us|ms|s|m)\s*$", text, re.MULTILINE)
        return float(found.group(1)) * _UNITS_MS[found.group(2)] if found else 0.0

    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
    return {
        "requests_per_second": number(r"Requests/sec:\s+([\d.]+)"),
        "requests": int(number(r"(\d+) requests in")),
        "non_2xx": int(number(r"Non-2xx or 3xx responses: (\d+)")),
        "socket_errors": sum(int(value) for value in errors.groups()) if errors else 0,
        "p50_ms": latency("50"),
        "p99_ms": latency("99"),
    }


def wrk_argv(port: int, duration: int, arguments: argparse.Namespace) -> list[str]:
    return [
        "taskset", "-c", str(arguments.client_cpu), wrk_binary(),
        "-t1", f"-c{arguments.connections}", f"-d{duration}s", "--latency", "--timeout", "2s",
        f"http://127.0.0.1:{port}{PATH}",
    ]  # fmt: skip


def wrk_binary() -> str:
    found = shutil.which("wrk")
    if found is None:
        raise RuntimeError("no wrk: apt-get install wrk (scripts/bootstrap does)")
    return found


def run_wrk(
    port: int, duration: int, arguments: argparse.Namespace, pid: int | None = None
) -> tuple[str, tuple[float, float] | None]:
    """One wrk run; with ``pid``, that process's CPU seconds over the steady part of the run and
    that part's length (clock ticks are 10 ms: summed over rounds, the figure gets finer)."""
    process = subprocess.Popen(
        wrk_argv(port, duration, arguments), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    cpu = None
    try:
        if pid is not None and duration > CPU_SKIP_START + CPU_SKIP_END:
            time.sleep(CPU_SKIP_START)
            before, start = cpu_seconds(pid), time.monotonic()
            time.sleep(duration - CPU_SKIP_START - CPU_SKIP_END)
            after, end = cpu_seconds(pid), time.monotonic()
            if before is not None and after is not None:
                cpu = (after - before, end - start)
        output, _ = process.communicate(timeout=duration + 30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    if process.returncode != 0:
        raise RuntimeError(f"wrk failed ({process.returncode}): {output.strip()[-500:]}")
    return output, cpu


def measure(servers: Servers, variant: str, number: int, arguments: argparse.Namespace) -> RunResult:
    envoy = servers.envoys[variant]
    sidecar = servers.quota_sidecar if variant.startswith("quota") else None
    before = cpu_seconds(envoy.pid)
    output, cpu = run_wrk(envoy.ports.listen, arguments.duration, arguments, sidecar.pid if sidecar else None)
    after = cpu_seconds(envoy.pid)
    result = RunResult(variant, number, **parse_wrk(output))
    if before is not None and after is not None:
        result.envoy_cpu_seconds = after - before
    if cpu is not None:
        result.sidecar_cpu_seconds, result.sidecar_window_seconds = cpu
        result.sidecar_cpu_percent = cpu[0] / cpu[1] * 100
    return result


# ---------------------------------------------------------------------------------
# Did the sidecar answer the quota stream?
# ---------------------------------------------------------------------------------


def stream_evidence(servers: Servers) -> tuple[bool, list[str]]:
    """Whether the sidecar served the RLQS streams of (c), and the figures that say so: each (c)
    Envoy's ``rlqs`` cluster (a stream closed with a gRPC error means the service was not there)
    and the sidecar's ``ratelimit_sidecar_quota_*`` metrics (an assignment sent: ``actions_sent``)."""
    lines, closed_with_error = [], 0
    for variant, envoy in servers.envoys.items():
        if variant.startswith("quota"):
            found = envoy.stats(r"^cluster\.rlqs\.")
            lines += [
                f"{variant} envoy {name}: {value}"
                for name, value in sorted(found.items())
                if value and _interesting(name)
            ]
            closed_with_error += sum(
                value for name, value in found.items() if re.search(r"streams_closed_(?!0$)\d+$", name)
            )
    assigned = 0.0
    sidecar = servers.quota_sidecar
    if sidecar is not None:
        for name, value in quota_metrics(sidecar.metrics_url):
            lines.append(f"sidecar {name}: {value:g}")
            if ("actions_sent" in name or "assign" in name) and "abandon" not in name and value > 0:
                assigned += value
    return assigned > 0 and closed_with_error == 0, lines


def _interesting(name: str) -> bool:
    return any(word in name for word in ("grpc", "upstream_rq_total", "upstream_cx_total", "rx_bytes_total"))


def quota_metrics(url: str) -> list[tuple[str, float]]:
    """The sidecar's ``ratelimit_sidecar_quota_*`` samples (none when it has no quota service)."""
    try:
        samples = scrape_metrics(url, timeout=2)
    except OSError:
        return []
    return [(name, value) for name, value in samples.items() if name.startswith("ratelimit_sidecar_quota_")]


# ---------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------


def summarize(results: Sequence[RunResult], variants: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Per variant: median req/s over rounds and its spread, Envoy CPU per request, totals of
    non-2xx and errors, and its ratios to (b) and to (b') (:func:`add_ratios`)."""
    rows: dict[str, dict[str, Any]] = {}
    for variant, label in variants.items():
        runs = [result for result in results if result.variant == variant]
        if not runs:
            continue
        window = sum(run.sidecar_window_seconds for run in runs)
        counted = [run for run in runs if run.envoy_cpu_seconds is not None and run.requests]
        spent = sum(run.envoy_cpu_seconds or 0.0 for run in counted)
        rows[variant] = {
            "label": label,
            "cpu_us": spent / sum(run.requests for run in counted) * 1e6 if counted else None,
            "rps": statistics.median(run.requests_per_second for run in runs),
            "rps_min": min(run.requests_per_second for run in runs),
            "rps_max": max(run.requests_per_second for run in runs),
            "p50_ms": statistics.median(run.p50_ms for run in runs),
            "p99_ms": statistics.median(run.p99_ms for run in runs),
            "non_2xx": sum(run.non_2xx for run in runs),
            "errors": sum(run.socket_errors for run in runs),
            # all rounds' steady parts together: one figure at 10 ms / total-window resolution
            "sidecar_cpu_percent": sum(run.sidecar_cpu_seconds for run in runs) / window * 100 if window else None,
        }
    add_ratios(rows, results, REFERENCE, "")
    add_ratios(rows, results, PER_CLIENT, "_per_client")
    return rows


def add_ratios(rows: dict[str, dict[str, Any]], results: Sequence[RunResult], reference: str, suffix: str) -> None:
    """Each row's ratio to ``reference``'s, under keys ending in ``suffix``: ``ratio`` (of the
    medians), ``round_ratios`` (each run over the same round's ``reference`` run), ``cpu_ratio``
    (``reference``'s Envoy CPU per request over the row's, all rounds together) and
    ``cpu_ratios`` (the same per round). None / empty when ``reference`` was not measured."""
    by_round = {run.round: run for run in results if run.variant == reference}
    mine = rows.get(reference, {})
    for variant, row in rows.items():
        runs = [run for run in results if run.variant == variant]
        row["round_ratios" + suffix] = [
            run.requests_per_second / other.requests_per_second
            for run in runs
            if (other := by_round.get(run.round)) and other.requests_per_second
        ]
        row["cpu_ratios" + suffix] = [
            theirs / ours
            for run in runs
            if (ours := _cpu_per_request(run)) and (theirs := _cpu_per_request_of(by_round.get(run.round)))
        ]
        row["ratio" + suffix] = row["rps"] / mine["rps"] if mine.get("rps") else None
        row["cpu_ratio" + suffix] = mine["cpu_us"] / row["cpu_us"] if mine.get("cpu_us") and row["cpu_us"] else None


def _cpu_per_request_of(run: RunResult | None) -> float | None:
    return None if run is None else _cpu_per_request(run)


def _cpu_per_request(run: RunResult) -> float | None:
    """Envoy CPU seconds per request of one run (None: not measured)."""
    return run.envoy_cpu_seconds / run.requests if run.envoy_cpu_seconds and run.requests else None


def _spread(values: Sequence[float]) -> str:
    """``median [min-max]`` of per-round ratios."""
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]" if values else "-"


def table(rows: dict[str, dict[str, Any]], arguments: argparse.Namespace) -> str:
    """One row per variant: its figures, and its ratios to (b) (one bucket) and to (b') (a
    bucket per client, like (c)), each by req/s and by Envoy CPU per request."""
    header = [f"variant (median of {arguments.rounds} x {arguments.duration:g} s)", "req/s", "x (b)"]
    header += ["x (b) per round: median [min-max]", "req/s min-max", "Envoy CPU us/request", "x (b) by Envoy CPU"]
    header += ["x (b) by CPU per round", "x (b')", "x (b') per round", "x (b') by Envoy CPU"]
    header += ["x (b') by CPU per round", "p50 ms", "p99 ms", "non-2xx", "socket errors"]
    header += ["sidecar CPU % of a core (all rounds)"]
    cells = []
    for row in rows.values():
        speed = [f"{row['rps']:,.0f}", dash(row["ratio"], ".2f"), _spread(row["round_ratios"])]
        speed += [f"{row['rps_min']:,.0f}-{row['rps_max']:,.0f}", dash(row["cpu_us"], ".1f")]
        speed += [dash(row["cpu_ratio"], ".2f"), _spread(row["cpu_ratios"])]
        speed += [dash(row["ratio_per_client"], ".2f"), _spread(row["round_ratios_per_client"])]
        speed += [dash(row["cpu_ratio_per_client"], ".2f"), _spread(row["cpu_ratios_per_client"])]
        speed += [f"{row['p50_ms']:.2f}", f"{row['p99_ms']:.2f}"]
        failed = [f"{row['non_2xx']:,}", f"{row['errors']:,}"]
        cells.append([row["label"], *speed, *failed, dash(row["sidecar_cpu_percent"], ".2f")])
    return md_table(header, cells)


def quota_ratios(rows: dict[str, dict[str, Any]]) -> list[str]:
    """One line per (c) run: its ratio to both baselines, by req/s and by Envoy CPU per request."""
    lines = []
    for variant, row in rows.items():
        if variant.startswith("quota"):
            lines.append(
                f"{row['label']}: x (b) one bucket {dash(row['ratio'], '.2f')} by req/s, "
                f"{dash(row['cpu_ratio'], '.2f')} by Envoy CPU; x (b') a bucket per client "
                f"{dash(row['ratio_per_client'], '.2f')} by req/s, "
                f"{dash(row['cpu_ratio_per_client'], '.2f')} by Envoy CPU"
            )
    return lines


def plot(rows: dict[str, dict[str, Any]], path: Path, answered: bool) -> None:
    """A bar of median req/s per variant, each labelled with its ratios to (b) and (b')."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [row["label"].replace(" + ", "\n+ ").replace(" [", "\n[").replace(", ", ",\n") for row in rows.values()]
    values = [row["rps"] for row in rows.values()]
    figure, axes = plt.subplots(figsize=(max(8, 1.6 * len(values)), 4.5))
    greens = ["#55a868", "#2e8b57", "#8fbc8f", "#6b8e23", "#3cb371", "#9acd32"]
    fixed = {"envoy": "#888888", "local": "#4c72b0", PER_CLIENT: "#8fa8d8", "ratelimit": "#c44e52"}
    colors = [fixed[key] if key in fixed else greens.pop(0) for key in rows]
    bars = axes.bar(labels, values, color=colors)
    for bar, row in zip(bars, rows.values(), strict=True):
        text = f"{row['rps']:,.0f}" + ("" if row["ratio"] is None else f"\n{row['ratio']:.2f}x (b)")
        text += "" if row["ratio_per_client"] is None else f"\n{row['ratio_per_client']:.2f}x (b')"
        axes.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)
    note = "" if answered else " (quota: sidecar did NOT answer the stream)"
    axes.set_title(f"Envoy 1 worker, wrk on another core: req/s, everything admitted{note}", fontsize=9)
    axes.set_ylabel("requests/s (median over rounds)")
    axes.set_ylim(0, max(values) * 1.3 if values else 1)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)


def command_line(arguments: argparse.Namespace) -> str:
    return reproduce_command(["python", "-m", "loadtest.quota_paths"], arguments, skip=())


def run(arguments: argparse.Namespace) -> int:
    wrk_binary()
    details = f"Envoy {envoy_binary()} --concurrency 1 on cpu {arguments.envoy_cpu}, wrk on cpu {arguments.client_cpu}"
    print_header(command_line(arguments), machine_facts(), os.getloadavg()[0], details)
    results: list[RunResult] = []
    variants = quota_variants(shapes_of(arguments))
    print(
        f"quota shapes: {arguments.quota_shapes} (the first is (c); export-envoy-quota --full writes {DEFAULT_SHAPE})"
    )
    with tempfile.TemporaryDirectory(prefix="quota-paths-") as directory:
        servers = start_servers(Path(directory), arguments)
        try:
            for variant in variants if arguments.warmup else ():  # warm every path (connections, first buckets)
                run_wrk(servers.envoys[variant].ports.listen, arguments.warmup, arguments)
            for number in range(1, arguments.rounds + 1):
                for variant in rotated(list(variants), number - 1):
                    result = measure(servers, variant, number, arguments)
                    results.append(result)
                    cpu = (
                        "" if result.sidecar_cpu_percent is None else f", sidecar {result.sidecar_cpu_percent:.2f}% cpu"
                    )
                    print(
                        f"round {number}/{arguments.rounds} {variant:<15} {result.requests_per_second:>10,.0f} req/s, "
                        f"p99 {result.p99_ms:.2f} ms, non-2xx {result.non_2xx}, errors {result.socket_errors}{cpu}",
                        flush=True,
                    )
            answered, evidence = stream_evidence(servers)
        finally:
            servers.group.close()
    rows = summarize(results, variants)
    print()
    print(table(rows, arguments))
    print()
    for line in quota_ratios(rows):
        print(line)
    print(
        "quota stream: "
        + (
            "ANSWERED by the sidecar"
            if answered
            else "NOT answered: (c) ran on no_assignment_behavior only, not a quota-mode result"
        )
    )
    for line in evidence:
        print(f"  {line}")
    if arguments.plot:
        plot(rows, Path(arguments.plot), answered)
        print(f"wrote {arguments.plot}")
    print(f"Reproduce: `{command_line(arguments)}`")
    bad = sum(row["non_2xx"] + row["errors"] for row in rows.values())
    return 0 if bad == 0 else 2


def rotated(items: list[str], by: int) -> list[str]:
    """``items`` starting at ``by`` (mod length): round ``n`` starts one variant later than ``n - 1``."""
    start = by % len(items)
    return items[start:] + items[:start]


def shapes_of(arguments: argparse.Namespace) -> list[str]:
    return str(arguments.quota_shapes).split(",")


def whole_seconds(text: str) -> int:
    """argparse type: a whole number >= 0 (a test's ``--warmup 0`` skips the unmeasured runs)."""
    if int(text) < 0:
        raise argparse.ArgumentTypeError("must be at least 0")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    parser = tool_parser("loadtest.quota_paths", __doc__)
    parser.add_argument("--rounds", type=positive_int, default=3, help="rounds of every variant (default 3)")
    parser.add_argument("--duration", type=positive_int, default=5, help="seconds per run, whole (default 5)")
    parser.add_argument("--warmup", type=whole_seconds, default=1, help="unmeasured seconds per variant (default 1)")
    parser.add_argument("--connections", type=positive_int, default=32, help="wrk keep-alive connections (default 32)")
    parser.add_argument(
        "--extra-routes",
        type=extra_count,
        default=0,
        metavar="N",
        help="N more routes before front.yaml's, in every variant: what a matcher walk per route costs (default 0)",
    )
    parser.add_argument("--envoy-cpu", type=int, default=0, help="cpu of the Envoys (default 0)")
    parser.add_argument("--client-cpu", type=int, default=1, help="cpu of wrk (default 1)")
    parser.add_argument("--plot", metavar="PNG", help="write a bar chart of the medians")
    parser.add_argument(
        "--quota-shapes",
        type=shape_list,
        default=DEFAULT_SHAPE,
        metavar="SHAPES",
        help=f"(c) once per shape, comma-separated: {', '.join(QUOTA_SHAPES)} (default {DEFAULT_SHAPE})",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    arguments = build_parser().parse_args(argv)
    return run_cli("quota_paths", functools.partial(run, arguments), (signal.SIGINT, signal.SIGTERM, signal.SIGHUP))


if __name__ == "__main__":
    sys.exit(main())
