"""The command line: ``run``, ``compare`` and ``inproc``; ``run`` drives a server already running."""

from __future__ import annotations

import argparse
import functools
import os
import signal
from collections.abc import Sequence
from dataclasses import asdict

from loadtest import grpc_bench
from loadtest.common import parse_cpus, positive_int, run_cli, tool_parser, write_json
from loadtest.grpc_bench.compare import cmd_compare
from loadtest.grpc_bench.drive import load_options, run_load
from loadtest.grpc_bench.inproc import cmd_inproc
from loadtest.grpc_bench.mix import DEFAULT_CONFIG, PATTERNS, REPO
from loadtest.grpc_bench.report import (
    command_line,
    describe_errors,
    environment,
    print_header,
    saturation_note,
    table,
)


def cmd_run(arguments: argparse.Namespace) -> int:
    client_cpus = parse_cpus(arguments.client_cpus)
    env = environment(client_cpus=client_cpus, server_cpus=None)
    print_header(arguments, env)
    result = run_load(
        "target",
        arguments.target,
        load_options(arguments),
        run_seed=arguments.seed,
        client_cpus=client_cpus,
        server_pid=arguments.server_pid,
    )
    print(table([asdict(result)]))
    print(f"requests {result.requests} in {result.elapsed:.2f} s; {describe_errors(result)}")
    note = saturation_note(result, len(client_cpus or os.sched_getaffinity(0)))
    if note:
        print(note)
    if arguments.json:
        write_json(
            arguments.json,
            {"command": command_line(arguments), "environment": env, "result": asdict(result)},
        )
    return 0 if not result.errors else 1


# ---------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------


def _duration(text: str) -> float:
    value = float(text)
    if not 0 < value <= 3600:
        raise argparse.ArgumentTypeError("must be in (0, 3600] seconds")
    return value


def _add_load_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--concurrency", type=positive_int, default=32, help="calls in flight")
    parser.add_argument(
        "--rate",
        type=float,
        default=0.0,
        help="offered load in calls/s over all lanes, for latency at a fixed load (default 0: as fast as possible)",
    )
    parser.add_argument("--duration", type=_duration, default=5.0, help="measured seconds per run (default 5)")
    parser.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds before each run (default 1)")
    parser.add_argument(
        "--max-requests",
        type=positive_int,
        default=5_000_000,
        help="stop a run after this many measured calls (default 5000000)",
    )
    parser.add_argument(
        "--processes",
        type=positive_int,
        default=1,
        help="load-generator processes; concurrency is split between them (default 1)",
    )
    parser.add_argument(
        "--channels",
        type=positive_int,
        default=1,
        help="gRPC channels (TCP connections) per process (default 1)",
    )
    parser.add_argument("--pattern", choices=PATTERNS, default="mixed", help="request mix")
    parser.add_argument(
        "--pool-size",
        type=positive_int,
        default=20_000,
        help="distinct prebuilt requests per process, cycled (default 20000)",
    )
    parser.add_argument("--timeout", type=float, default=1.0, help="deadline of each call in seconds (default 1)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the request mix")
    parser.add_argument("--client-cpus", help="pin the load generator to these cpus, e.g. 1 or 0-1")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")


def build_parser() -> argparse.ArgumentParser:
    parser = tool_parser("loadtest.grpc_bench", grpc_bench.__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="drive a running server")
    run.add_argument("--target", required=True, help="HOST:PORT of the server (loopback)")
    run.add_argument("--server-pid", type=int, help="pid of the server, to report its CPU")
    _add_load_arguments(run)
    run.set_defaults(handler=cmd_run)

    compare = commands.add_parser("compare", help="bare servicer vs sidecar, alternating rounds")
    compare.add_argument("--rounds", type=positive_int, default=3, help="rounds (default 3)")
    compare.add_argument("--config", default=str(DEFAULT_CONFIG.relative_to(REPO)), help="sidecar config")
    compare.add_argument("--server-cpus", help="pin both servers to these cpus (default: the first usable cpu)")
    compare.add_argument("--no-pin", action="store_true", help="do not pin anything")
    compare.add_argument(
        "--calibrate-us",
        metavar="US[,US...]",
        help="also run bare servicers that burn this many us of CPU per call, e.g. 25,50",
    )
    compare.add_argument(
        "--quiet-wait",
        type=float,
        default=20.0,
        help="before each run, wait up to this many seconds for a quiet machine (0: don't; default 20)",
    )
    compare.add_argument(
        "--quiet-threshold",
        type=float,
        default=0.2,
        help="cores busy (idle servers included) below which the machine counts as quiet (default 0.2)",
    )
    compare.add_argument(
        "--redo-disturbed",
        type=int,
        default=2,
        help="redo a run up to this many times when other load exceeded --quiet-threshold (default 2)",
    )
    compare.add_argument(
        "--partial",
        metavar="WORK[,WORK...]",
        help="also run bare servicers doing part of the sidecar's work: validate, decide, handler, floor",
    )
    _add_load_arguments(compare)
    compare.set_defaults(handler=cmd_compare)

    inproc = commands.add_parser("inproc", help="cost per call of answer(), without gRPC")
    inproc.add_argument("--pattern", choices=PATTERNS, default="mixed", help="request mix")
    inproc.add_argument("--calls", type=positive_int, default=100_000, help="calls per pass")
    inproc.add_argument("--repeat", type=positive_int, default=3, help="timed passes (median)")
    inproc.add_argument("--pool-size", type=positive_int, default=20_000, help="distinct requests")
    inproc.add_argument("--seed", type=int, default=1, help="seed of the request mix")
    inproc.add_argument("--config", default=str(DEFAULT_CONFIG.relative_to(REPO)), help="sidecar config")
    inproc.add_argument("--profile", type=int, metavar="N", help="also print the N costliest functions (cProfile)")
    inproc.add_argument(
        "--response-headers", action="store_true", help="the service with --response-headers (RateLimit-* headers)"
    )
    inproc.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    inproc.set_defaults(handler=cmd_inproc)
    return parser


def _validate_target(target: str) -> None:
    host = target.rpartition(":")[0].strip("[]")
    if host not in {"127.0.0.1", "localhost", "::1"}:
        raise SystemExit(f"grpc_bench: --target must be on loopback (127.0.0.1), not {host!r}")


def main(argv: Sequence[str] | None = None) -> int:
    arguments = build_parser().parse_args(argv)
    if arguments.command == "run":
        _validate_target(arguments.target)
    # Explicit handlers, so that even a copy started with SIGINT ignored (a background
    # job of a non-interactive shell) stops its children on SIGINT, SIGTERM or SIGHUP.
    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    return run_cli("grpc_bench", functools.partial(arguments.handler, arguments), signals)
