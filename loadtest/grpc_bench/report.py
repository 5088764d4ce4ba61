"""Reporting: the header every report starts with, the results table, notes, JSON."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import subprocess
from collections.abc import Sequence
from typing import Any

from loadtest.common import machine_facts, reproduce_command
from loadtest.common import print_header as loadtest_header
from loadtest.grpc_bench.drive import RunResult
from loadtest.grpc_bench.mix import REPO

SATURATED_CPU = 0.9
"""A load-generator core busier than this may be the bottleneck: the report says so."""

# ---------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------


def code_version() -> str:
    """Commit of the checkout, and whether sidecar/ has uncommitted changes: what was measured."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=5, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "sidecar"],
            check=False,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{commit} + uncommitted changes in sidecar/" if dirty else commit


def environment(client_cpus: Any = None, server_cpus: Any = None) -> dict[str, Any]:
    """What the figures depend on: cores, CPU model, versions, pinning, load average."""
    import google.protobuf
    from google.protobuf.internal import api_implementation

    return {
        **machine_facts(),
        "usable_cores": sorted(os.sched_getaffinity(0)),
        "loadavg_at_start": os.getloadavg()[0],
        "protobuf": f"{google.protobuf.__version__} ({api_implementation.Type()})",
        "uvloop": importlib.metadata.version("uvloop"),
        "server_cpus": server_cpus,
        "client_cpus": client_cpus,
        "code": code_version(),
    }


def command_line(arguments: argparse.Namespace) -> str:
    """The command that reproduces the figures, every option spelled out."""
    words = ["python", "-m", "loadtest.grpc_bench", arguments.command]
    return reproduce_command(words, arguments, skip={"command", "handler", "json"})


def print_header(arguments: argparse.Namespace, env: dict[str, Any]) -> None:
    versions = f"Python {env['python']}, grpcio {env['grpcio']}, protobuf {env['protobuf']}, uvloop {env['uvloop']}"
    loadtest_header(command_line(arguments), env, env["loadavg_at_start"], versions)
    print(f"pinning: server cpus {env['server_cpus']}, load generator cpus {env['client_cpus']}; code {env['code']}")


COLUMNS = (
    ("target", 8, "label"),
    ("req/s", 8, "rps"),
    ("p50 ms", 7, "p50_ms"),
    ("p90 ms", 7, "p90_ms"),
    ("p99 ms", 7, "p99_ms"),
    ("max ms", 7, "max_ms"),
    ("OK", 8, "ok"),
    ("OVER", 7, "over_limit"),
    ("errors", 6, "errors"),
    ("srv cpu", 7, "server_cpu"),
    ("srv us/call", 11, "server_us_per_call"),
    ("gen cpu", 7, "client_cpu"),
    ("other cpu", 9, "other_cpu"),
)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, dict):
        return str(sum(value.values()))
    if isinstance(value, float):
        return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.3g}"
    return str(value)


def table(rows: Sequence[dict[str, Any]]) -> str:
    """Fixed-width table of result dicts, one line each."""
    header = " ".join(name.rjust(width) for name, width, _ in COLUMNS)
    lines = [header]
    for row in rows:
        lines.append(" ".join(_cell(row.get(key)).rjust(width) for _, width, key in COLUMNS))
    return "\n".join(lines)


def describe_errors(result: RunResult) -> str:
    parts = [f"{name}={count}" for name, count in sorted(result.errors.items())]
    parts += [f"code {name}={count}" for name, count in sorted(result.other_codes.items())]
    return ", ".join(parts)


def saturation_note(result: RunResult, client_cores: int) -> str | None:
    """Warn when the load generator, not the server, was probably the limit."""
    if result.client_cpu >= SATURATED_CPU * client_cores:
        server = "" if result.server_cpu is None else f" (server at {result.server_cpu:.2f} cores)"
        return (
            f"warning: load generator used {result.client_cpu:.2f} of its {client_cores} core(s)"
            f"{server}: it may be the bottleneck; add --processes or cores"
        )
    return None
