"""What the HTTP listeners cost: resident memory with and without them, and ``POST /json`` latency.

    python -m loadtest.http_listeners                      # ~1 minute
    python -m loadtest.http_listeners --seconds 10 --connections 4
    python -m loadtest.http_listeners --config-rules 14000  # GET /config's cost to the event loop
    python -m loadtest.http_listeners --json-flood          # POST /json of 21,000 empty descriptors


Starts ``ratelimit-sidecar serve`` (memory backend, examples/config) three times: with no
HTTP listener (``RLS_METRICS_ADDRESS=""``), with the admin endpoint alone (the default),
and with the admin endpoint and ``--json-address``; reads VmRSS from ``/proc/<pid>`` after
startup settles. On the last one it runs ``wrk`` (bounded by ``--seconds``) with a Lua
script that POSTs one ``RateLimitRequest`` as JSON over ``--connections`` kept-alive
connections, and prints wrk's latency percentiles, the sidecar's CPU time per request
(utime + stime from ``/proc``: less sensitive than latency to other load on the machine)
and the RSS after the load. Every child is stopped when it ends.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadtest.footprint import CONFIG, child, cpu_seconds, memory_mib, wait_serving
from stack.processes import free_port
from stack.sidecar import serve_argv

BODY = (
    '{"domain": "demo", "descriptors": [{"entries": [{"key": "remote_address", "value": "198.51.100.7"}]},'
    ' {"entries": [{"key": "generic_key", "value": "api"}, {"key": "api_key", "value": "premium-a"}]}]}'
)
LUA = f"""
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = [[{BODY}]]
"""


def start_env(grpc: str, metrics: str, json_address: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith(("RLS_", "OTEL_"))}
    env.update(
        RLS_LOG_LEVEL="warning",
        RLS_CONFIG=str(CONFIG),
        RLS_GRPC_ADDRESS=grpc,
        RLS_METRICS_ADDRESS=metrics,
        RLS_JSON_ADDRESS=json_address,
    )
    return env


def settled_rss(grpc: str, env: dict[str, str], settle: float) -> float:
    with child(serve_argv(()), env) as process:
        wait_serving(grpc, process)
        time.sleep(settle)
        return memory_mib(process.pid)[0]


def wrk_latency(port: int, seconds: float, connections: int) -> dict[str, str]:
    """wrk's requests/s and latency percentiles for ``POST /json``."""
    binary = shutil.which("wrk")
    if binary is None:
        raise SystemExit("wrk not found (scripts/bootstrap installs it)")
    with tempfile.NamedTemporaryFile("w", suffix=".lua") as script:
        script.write(LUA)
        script.flush()
        argv = [binary, "-t1", f"-c{connections}", f"-d{seconds:g}s", "--latency", "-s", script.name]
        output = subprocess.run(
            [*argv, f"http://127.0.0.1:{port}/json"], capture_output=True, text=True, timeout=seconds + 30, check=True
        ).stdout
    found = {name: value for name, value in re.findall(r"^\s+(50|75|90|99)%\s+(\S+)", output, re.MULTILINE)}
    found["rps"] = re.search(r"Requests/sec:\s+(\S+)", output).group(1)  # type: ignore[union-attr]
    found["requests"] = re.search(r"(\d+) requests in", output).group(1)  # type: ignore[union-attr]
    found["errors"] = "yes" if "Socket errors" in output else "none"
    return found


def write_rules(directory: Path, count: int) -> None:
    rules = "".join(
        f"  - key: k{index}\n    rate_limit: {{unit: minute, requests_per_unit: {index + 1}}}\n"
        for index in range(count)
    )
    (directory / "big.yaml").write_text(f"domain: big\ndescriptors:\n{rules}")


async def config_stall(rules: int, seconds: float) -> dict[str, float]:
    """In this process: one client looping ``GET /config`` of ``rules`` rules for ``seconds``,
    while a ticker measures how late the event loop runs (every 1 ms)."""
    from sidecar.admin import AdminEndpoint, config_json
    from sidecar.config import load_config

    with tempfile.TemporaryDirectory() as directory:
        write_rules(Path(directory), rules)
        config = load_config(Path(directory))
    document = {**config_json(config, 0.0), "quota": {}}
    admin: Any = AdminEndpoint
    if hasattr(admin, "config_body"):  # the snapshot API: a builder run in a thread
        endpoint = admin(None, lambda: lambda: document, lambda: True)
    else:  # the code before issue 25: the document itself, built on the loop
        endpoint = admin(None, lambda: document, lambda: True)
    await endpoint.start("127.0.0.1:0")
    loop = asyncio.get_running_loop()
    lags: list[float] = []
    gets: list[float] = []
    size = 0
    stop = loop.time() + seconds

    async def ticker() -> None:
        while loop.time() < stop:
            before = loop.time()
            await asyncio.sleep(0.001)
            lags.append(loop.time() - before - 0.001)

    async def reader() -> None:
        nonlocal size
        while loop.time() < stop:
            started = loop.time()
            stream, writer = await asyncio.open_connection("127.0.0.1", endpoint.port)
            writer.write(b"GET /config HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            size = len(await stream.read())
            writer.close()
            gets.append(loop.time() - started)

    try:
        await asyncio.gather(ticker(), reader())
    finally:
        await endpoint.close()
    lags.sort()
    gets.sort()
    return {
        "bytes": size,
        "gets": len(gets),
        "get_p50_ms": gets[len(gets) // 2] * 1000,
        "lag_p99_ms": lags[int(len(lags) * 0.99)] * 1000,
        "lag_max_ms": lags[-1] * 1000,
    }


async def json_flood(requests: int = 20) -> tuple[int, str, float]:
    """In this process: ``decide_json`` of a 63 KB body of 21,000 empty descriptors, ``requests``
    times; the status, the message and the median time of one (all of it on the event loop)."""
    import json

    from sidecar.config import load_config
    from sidecar.limiter.memory import MemoryLimiter
    from sidecar.service.json_api import decide_json
    from sidecar.service.servicer import RateLimitService

    body = json.dumps({"domain": "api", "descriptors": [{}] * 21_000}, separators=(",", ":")).encode()
    with tempfile.TemporaryDirectory() as directory:
        (Path(directory) / "api.yaml").write_text(
            "domain: api\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 1}\n"
        )
        service = RateLimitService(load_config(Path(directory)), MemoryLimiter())
    times = []
    for _ in range(requests):
        started = time.perf_counter()
        answer = await decide_json(service, body)
        times.append(time.perf_counter() - started)
    return answer.status, json.loads(answer.body)["message"], sorted(times)[requests // 2]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=15.0, help="length of the wrk run")
    parser.add_argument("--connections", type=int, default=4)
    parser.add_argument("--settle", type=float, default=3.0, help="seconds after SERVING before RSS is read")
    parser.add_argument("--config-rules", type=int, default=0, help="measure GET /config of this many rules instead")
    parser.add_argument("--json-flood", action="store_true", help="time POST /json of 21,000 descriptors instead")
    arguments = parser.parse_args(argv)
    if arguments.json_flood:
        status, message, median = asyncio.run(json_flood())
        print(f"python -m loadtest.http_listeners --json-flood\n63,032-byte body: {status} {message!r}; ", end="")
        print(f"median {median * 1000:.1f} ms per request")
        return 0
    if arguments.config_rules:
        import uvloop

        row = uvloop.run(config_stall(arguments.config_rules, arguments.seconds))
        print(
            f"python -m loadtest.http_listeners --config-rules {arguments.config_rules}"
            f" --seconds {arguments.seconds:g}\n"
            f"GET /config: {row['bytes']:,} bytes, {row['gets']:.0f} GETs, p50 {row['get_p50_ms']:.0f} ms; "
            f"event loop late by p99 {row['lag_p99_ms']:.1f} ms, max {row['lag_max_ms']:.1f} ms"
        )
        return 0
    print(
        f"python -m loadtest.http_listeners --seconds {arguments.seconds:g} --connections {arguments.connections}"
        f" --settle {arguments.settle:g}\n{os.cpu_count()} cores, Python {sys.version.split()[0]}"
    )
    grpc = f"127.0.0.1:{free_port()}"
    no_http = settled_rss(grpc, start_env(grpc, "", ""), arguments.settle)
    admin_only = settled_rss(grpc, start_env(grpc, f"127.0.0.1:{free_port()}", ""), arguments.settle)
    json_port = free_port()
    env = start_env(grpc, f"127.0.0.1:{free_port()}", f"127.0.0.1:{json_port}")
    with child(serve_argv(()), env) as process:
        wait_serving(grpc, process)
        time.sleep(arguments.settle)
        both = memory_mib(process.pid)[0]
        cpu = cpu_seconds(process.pid)
        load = wrk_latency(json_port, arguments.seconds, arguments.connections)
        cpu_per_request = (cpu_seconds(process.pid) - cpu) / max(int(load["requests"]), 1)
        after, peak = memory_mib(process.pid)
    print(f"RSS, no HTTP listener:          {no_http:6.1f} MiB")
    print(f"RSS, admin endpoint (default): {admin_only:6.1f} MiB")
    print(f"RSS, admin + /json:            {both:6.1f} MiB")
    print(f"RSS after the /json load:      {after:6.1f} MiB (peak {peak:.1f} MiB)")
    print(
        f"POST /json, {arguments.connections} connections: {load['rps']} requests/s, p50 {load['50']}, "
        f"p75 {load['75']}, p90 {load['90']}, p99 {load['99']}, socket errors: {load['errors']}; "
        f"sidecar CPU {cpu_per_request * 1e6:.0f} us/request"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
