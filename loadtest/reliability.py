"""The reliability report: bad input, floods, load, faults, clock skew and security, in one table.

Every scenario runs against real processes (sidecars, redis-server) on 127.0.0.1, bounded
in time and count, and stops what it started; each prints one row: the load it held
(requests/s and p99), the bad inputs it tried, the admitted hits Redis lost (0, except
the measured bound of a replica killed with SIGKILL), and whether the invariant held.

    python -m loadtest.reliability --quick        # CI-sized, a few minutes
    python -m loadtest.reliability --smoke        # the tests' size: same checks, no figures to quote
    python -m loadtest.reliability                # longer soak and floods, ~15 minutes
    python -m loadtest.reliability --areas faults,clock

Exit status 0 when every row held, 1 otherwise (a row that cannot run on this machine
says so and does not fail the report).
"""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from loadtest.common import machine_facts, md_table, parse_cpus, reproduce_command, run_cli, tool_parser
from loadtest.reliability_harness import Context, Row

AREAS = {
    "bad-input": "loadtest.reliability_harness.bad_input",
    "flood": "loadtest.reliability_harness.flood",
    "soak": "loadtest.reliability_harness.soak",
    "faults": "loadtest.reliability_harness.faults",
    "clock": "loadtest.reliability_harness.clock_skew",
    "security": "loadtest.reliability_harness.security",
    "hardening-input": "loadtest.reliability_harness.hardening_input",
    "hardening-admin": "loadtest.reliability_harness.hardening_admin",
    "hardening-limiter": "loadtest.reliability_harness.hardening_limiter",
    "json-input": "loadtest.reliability_harness.json_input",
    "deadline-budget": "loadtest.reliability_harness.deadline_budget",
    "loop-stalls": "loadtest.reliability_harness.loop_stalls",
    "store-faults": "loadtest.reliability_harness.store_faults",
}
"""Report order: what each ``--areas`` name runs (a module with ``run(Context) -> list[Row]``)."""


def load_area(name: str) -> Callable[[Context], list[Row]]:
    module = importlib.import_module(AREAS[name])
    run: Callable[[Context], list[Row]] = module.run
    return run


def run_area(name: str, context: Context) -> tuple[list[Row], float]:
    """The rows of one area and how long it took; an area that raises becomes a failed row."""
    started = time.monotonic()
    try:
        rows = load_area(name)(context)
    except Exception as error:  # the report must show every area, even a broken one
        rows = [Row(name, "the whole area", ok=False, notes=f"{type(error).__name__}: {error}")]
    return rows, time.monotonic() - started


def verdict(row: Row) -> str:
    held = {True: "held", False: "FAILED", None: "not run"}[row.ok]
    return f"{held}; goal missed" if row.goals_missed else held


def table(rows: Sequence[Row]) -> str:
    """The report: one Markdown row per scenario."""
    header = ["area", "scenario", "load held", "bad inputs", "hits lost", "result", "notes"]
    cells = []
    for row in rows:
        lost = "" if row.hits_lost is None else f"{row.hits_lost:,}"
        inputs = f"{row.inputs:,}" if row.inputs else ""
        notes = "; ".join([*row.goals_missed, row.notes]).replace("|", "/").replace("\n", " ")
        cells.append([row.area, row.scenario, row.load, inputs, lost, verdict(row), notes])
    return md_table(header, cells)


def summary(rows: Sequence[Row]) -> str:
    tried = sum(row.inputs for row in rows)
    lost = sum(row.hits_lost or 0 for row in rows if "SIGKILL" not in row.scenario)
    failed = [row for row in rows if row.ok is False]
    missed = sum(1 for row in rows if row.goals_missed)
    return (
        f"{len(rows)} scenarios: {len(rows) - len(failed)} held or not run, {len(failed)} failed, "
        f"{missed} missed a latency goal; "
        f"{tried:,} bad inputs tried; {lost} admitted hits lost outside the SIGKILL bound"
    )


def parse_arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = tool_parser("loadtest.reliability", __doc__)
    parser.add_argument("--quick", action="store_true", help="CI-sized: seconds per scenario")
    parser.add_argument(
        "--smoke", action="store_true", help="the tests' size (implies --quick): smaller runs, the same checks"
    )
    parser.add_argument("--areas", default=",".join(AREAS), help=f"comma-separated, of: {', '.join(AREAS)}")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--server-cpus", help="pin servers to these cpus, e.g. 0")
    parser.add_argument("--client-cpus", help="pin load generators to these cpus, e.g. 1")
    parser.add_argument("--json", help="also write the rows and figures to this file")
    parser.add_argument("--keep", action="store_true", help="keep the run directory (logs of every process)")
    arguments = parser.parse_args(argv)
    unknown = set(arguments.areas.split(",")) - set(AREAS)
    if unknown:
        parser.error(f"unknown area(s): {', '.join(sorted(unknown))}")
    return arguments


def build_context(arguments: argparse.Namespace, directory: Path) -> Context:
    """What every area gets from the command line (``--smoke`` implies ``--quick``)."""
    return Context(
        directory,
        quick=arguments.quick or arguments.smoke,
        smoke=arguments.smoke,
        seed=arguments.seed,
        server_cpus=parse_cpus(arguments.server_cpus),
        client_cpus=parse_cpus(arguments.client_cpus),
    )


def report(arguments: argparse.Namespace) -> int:
    names = arguments.areas.split(",")
    directory = Path(tempfile.mkdtemp(prefix="reliability-"))
    context = build_context(arguments, directory)
    rows: list[Row] = []
    timings: dict[str, float] = {}
    for name in names:
        print(f"running {name} ...", file=sys.stderr, flush=True)
        area_rows, timings[name] = run_area(name, context)
        rows += area_rows
    print(table(rows))
    print()
    print(summary(rows))
    print("seconds per area: " + ", ".join(f"{name} {seconds:.0f}" for name, seconds in timings.items()))
    command = reproduce_command(["python", "-m", "loadtest.reliability"], arguments, skip={"json", "keep"})
    print(f"reproduce: {command}")
    if arguments.json:
        document: dict[str, Any] = {
            "command": command,
            "machine": machine_facts(),
            "seconds": timings,
            "rows": [asdict(row) for row in rows],
        }
        Path(arguments.json).write_text(json.dumps(document, indent=2, default=str) + "\n")
    if arguments.keep:
        print(f"logs: {directory}", file=sys.stderr)
    else:
        shutil.rmtree(directory, ignore_errors=True)
    return 1 if any(row.ok is False for row in rows) else 0


def main(argv: Sequence[str] | None = None) -> int:
    arguments = parse_arguments(argv)
    return run_cli("loadtest.reliability", lambda: report(arguments), (signal.SIGTERM, signal.SIGHUP))


if __name__ == "__main__":
    sys.exit(main())
