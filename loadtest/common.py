"""Pieces shared by the load-test tools: ``grpc_bench`` and the accuracy harness (``accuracy``).

The tools run as modules of the ``loadtest`` package (``python -m loadtest.grpc_bench``,
``python -m loadtest.accuracy``, from the checkout), and import this one as
``loadtest.common``, in the tools and in the load-generator processes they spawn alike.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing
import multiprocessing.connection
import os
import platform
import re
import shlex
import signal
import statistics
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Collection, Coroutine, Iterable, Sequence
from pathlib import Path
from typing import IO, Any

import grpc

REPO = Path(__file__).resolve().parent.parent
METHOD = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"

# ---------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def bounded_float(low: float, high: float, *, include_low: bool = True) -> Callable[[str], float]:
    """argparse type: a number in ``[low, high]`` (``(low, high]`` with ``include_low=False``)."""

    def parse(text: str) -> float:
        value = float(text)
        if not (low <= value if include_low else low < value) or value > high:
            bracket = "[" if include_low else "("
            raise argparse.ArgumentTypeError(f"must be in {bracket}{low:g}, {high:g}]")
        return value

    return parse


def parse_cpus(text: str | None) -> tuple[int, ...] | None:
    """``"0"``, ``"0,1"`` or ``"0-1"`` into a tuple of cpu numbers; None for none/empty."""
    if not text or text == "none":
        return None
    cpus: list[int] = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        cpus.extend(range(int(low), int(high or low) + 1))
    return tuple(cpus)


def reproduce_command(words: Sequence[str], arguments: argparse.Namespace, skip: Collection[str]) -> str:
    """``words`` followed by every option of ``arguments`` spelled out (but those in ``skip``
    and unset ones): the command that reproduces the figures."""
    words = list(words)
    for name, value in vars(arguments).items():
        if name in skip or value is None:
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            if value:
                words.append(flag)
        else:
            words += [flag, str(value)]
    return shlex.join(words)


def tool_parser(module: str, doc: str | None) -> argparse.ArgumentParser:
    """The parser of ``python -m <module>``: the docstring's first paragraph as its description."""
    description = (doc or "").split("\n\n")[0]
    return argparse.ArgumentParser(
        prog=f"python -m {module}", description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def write_json(path: str | Path, document: dict[str, Any]) -> None:
    """The figures as JSON (keys sorted, so two runs diff cleanly), then "wrote PATH"."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(document, indent=2, sort_keys=True) + "\n")
    print(f"wrote {path}")


def run_cli(prog: str, run: Callable[[], int], signals: Sequence[signal.Signals]) -> int:
    """Run a tool's main work, turning ``signals`` into KeyboardInterrupt so that the
    ``finally`` blocks stop every child; exit code 130 when interrupted, 1 on RuntimeError."""

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    for signum in signals:
        signal.signal(signum, interrupt)
    try:
        return int(run())
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; child processes stopped", file=sys.stderr)
        return 130
    except RuntimeError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 1


# ---------------------------------------------------------------------------------
# Reports
# ---------------------------------------------------------------------------------


def md_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A Markdown table: ``header``, the ``|---|`` line, then one line per row (cells as ``str``)."""
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
    return "\n".join(lines)


def dash(value: float | None, spec: str = "") -> str:
    """``value`` formatted with ``spec``, or "-" for a figure that was not measured."""
    return "-" if value is None else format(value, spec)


# ---------------------------------------------------------------------------------
# Machine and measurements
# ---------------------------------------------------------------------------------


def cpu_model() -> str:
    """The CPU model name from ``/proc/cpuinfo`` ("" when unknown)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return ""


def machine_facts() -> dict[str, Any]:
    """What every report states about the machine: cores, CPU model, Python and grpcio versions."""
    return {
        "cores": os.cpu_count(),
        "cpu_model": cpu_model(),
        "python": platform.python_version(),
        "grpcio": grpc.__version__,
    }


def split_cpus(
    server_text: str | None, client_text: str | None
) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
    """(server cpus, client cpus) from ``--server-cpus``/``--client-cpus``; one given pins
    the other to the remaining usable cpus, so the two never share a core by accident."""
    server, client = parse_cpus(server_text), parse_cpus(client_text)
    usable = sorted(os.sched_getaffinity(0))
    if server and not client:
        client = tuple(cpu for cpu in usable if cpu not in server) or None
    elif client and not server:
        server = tuple(cpu for cpu in usable if cpu not in client) or None
    return server, client


_VERSIONS = {
    "envoy": ("Envoy", "--version", r"version: \w+/([\w.-]+)/"),
    "haproxy": ("HAProxy", "-v", r"HAProxy version (\S+)"),
}


def program_version(name: str) -> str:
    """``"Envoy 1.40.0"`` or ``"HAProxy 2.6.12"`` (``name``: envoy or haproxy), as the binary
    the stack launchers run says it; the number is "unknown" when it does not say."""
    from stack.envoy import envoy_binary
    from stack.haproxy import haproxy_binary

    label, flag, pattern = _VERSIONS[name]
    binary = envoy_binary() if name == "envoy" else haproxy_binary()
    try:
        text = subprocess.run([binary, flag], capture_output=True, text=True, check=False, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        text = ""
    found = re.search(pattern, text)
    return f"{label} {found.group(1) if found else 'unknown'}"


def print_header(command: str, facts: dict[str, Any], loadavg: float, details: str) -> None:
    """The first two lines of every benchmark's output: the command that reproduces it, and
    the machine (cores, CPU model, load average) followed by the tool's own ``details``."""
    print(f"command: {command}", flush=True)
    print(f"machine: {facts['cores']} cores ({facts['cpu_model']}), load average {loadavg:.2f}; {details}", flush=True)


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a process (all its threads), or None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds_of(pids: Sequence[int]) -> float | None:
    """User + system CPU seconds of the processes (None when one is gone)."""
    seconds = [cpu_seconds(pid) for pid in pids]
    return None if any(value is None for value in seconds) else sum(value or 0.0 for value in seconds)


def proc_status(pid: int, field: str) -> int | None:
    """A ``kB`` field of ``/proc/<pid>/status`` in bytes (``VmRSS``, ``VmHWM``), None if gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def percentile(ordered: Sequence[float], fraction: float) -> float:
    """Nearest-rank percentile of an ascending sequence (0 when empty)."""
    if not ordered:
        return 0.0
    rank = min(len(ordered), max(1, math.ceil(fraction * len(ordered))))
    return ordered[rank - 1]


def median_or_none(values: Iterable[float | None]) -> float | None:
    """Median of the figures that were measured (None ones left out); None when none was."""
    present = [value for value in values if value is not None]
    return statistics.median(present) if present else None


def floor_percentile(values: Iterable[float], fraction: float) -> float:
    """The sample at index ``floor(fraction * n)`` of the sorted ``values`` (0 when empty).

    Not :func:`percentile`: the tools that print p50/p99 of raw samples this way keep
    doing so, so their figures stay comparable with the ones they printed before.
    """
    ordered = sorted(values)
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def scrape_metrics(url: str, timeout: float = 5.0) -> dict[str, float]:
    """``url``/metrics (Prometheus text) as ``{"name{labels}": value}``; comments and lines
    without a number skipped. OSError when the endpoint does not answer."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=timeout) as reply:
        text = reply.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        with contextlib.suppress(ValueError):
            values[name] = float(value)
    return values


# ---------------------------------------------------------------------------------
# Server children (sidecars, redis-server, bare servicers)
# ---------------------------------------------------------------------------------


def start_child(
    argv: Sequence[str], log: IO[bytes], *, env: dict[str, str], cpus: tuple[int, ...] | None
) -> subprocess.Popen[bytes]:
    """Start a server child in the repository, its output to ``log``, pinned to ``cpus``.

    It runs in its own session, so Ctrl-C reaches the tool only and the tool stops
    its children itself.
    """
    from stack.processes import spawn

    return spawn(argv, stdout=log, env=env, cpus=cpus)


def health_serving(address: str, timeout: float = 0.5) -> bool:
    """One gRPC health probe of ``address``: True when it answers SERVING."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError:
            return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


# ---------------------------------------------------------------------------------
# Load-generator processes (started with the "spawn" method, one pipe each)
# ---------------------------------------------------------------------------------

Worker = tuple[Any, multiprocessing.connection.Connection]
"""A load-generator process and the parent's end of its pipe."""


def overall_code(response: bytes) -> int:
    """``overall_code`` of a serialized ``RateLimitResponse`` without parsing it all.

    Field 1 (varint, tag byte 0x08) is written first; absent means 0 (UNKNOWN).
    """
    return response[1] if response[:1] == b"\x08" else 0


def run_worker(
    drive: Callable[[Any, multiprocessing.connection.Connection], Coroutine[Any, Any, None]],
    spec: Any,
    conn: multiprocessing.connection.Connection,
) -> None:
    """Body of a load-generator process: pin it to ``spec.cpus``, run ``drive(spec, conn)``
    on uvloop, report a failure as an ``("error", text)`` message, always close the pipe."""
    import uvloop

    if spec.cpus is not None:
        os.sched_setaffinity(0, spec.cpus)  # before gRPC starts any thread
    try:
        uvloop.run(drive(spec, conn))
    except KeyboardInterrupt:
        pass
    except Exception as error:
        with contextlib.suppress(OSError):
            conn.send(("error", f"{type(error).__name__}: {error}"))
    finally:
        conn.close()


def start_worker(target: Callable[[Any, multiprocessing.connection.Connection], None], spec: Any) -> Worker:
    """Start ``target(spec, pipe)`` in a new ("spawn") daemon process."""
    context = multiprocessing.get_context("spawn")
    parent_end, child_end = context.Pipe()
    process = context.Process(target=target, args=(spec, child_end), daemon=True)
    process.start()
    child_end.close()
    return process, parent_end


def worker_answer(message: Any, kind: str) -> Any:
    """The payload of a worker's ``(kind, payload)`` message; RuntimeError for an error or another kind."""
    if message[0] == "error":
        raise RuntimeError(f"load generator failed: {message[1]}")
    if message[0] != kind:
        raise RuntimeError(f"load generator sent {message[0]!r}, expected {kind!r}")
    return message[1]


def stop_workers(workers: Sequence[Worker], timeout: float) -> None:
    """Close every pipe and reap every process: joined, killed after ``timeout`` s if still alive."""
    for process, conn in workers:
        with contextlib.suppress(OSError):
            conn.close()
        process.join(timeout=timeout)
        if process.is_alive():
            process.kill()
            process.join(timeout=timeout)
