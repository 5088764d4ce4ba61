"""Attacks on the admin endpoint and on hot reload (issue 21, defects 2, 4 and 7).

Rows, each against a real sidecar process:

* **/metrics flood**: ~160 calls with 64 request-side ``limit`` overrides of 1 KB values
  (what used to mint 10,000 rows and a 64 MB ``/metrics``), plus as many ``detailed_metric``
  values (a legitimately large ``/metrics``, up to the per-rule byte cap); then
  ``/metrics`` scraped back to back while ShouldRateLimit is timed. Holds when
  ``/metrics`` stays within the byte cap and the calls' p99 within 100 ms.
* **slow readers**: 10 connections send ``GET /metrics`` on that large ``/metrics`` and
  never read; RSS is read while they hang and after ``--admin-write-timeout``. Holds
  when every one is dropped within the timeout and a connection past
  ``--admin-max-connections`` gets a 503.
* **hot reload**: ``loadtest.reload_stall``'s run of a large valid config (14,000 rules;
  quick: 3,000) reloaded under steady calls. Holds when the calls' p99 during reloads
  stays within 100 ms.

The tests' smoke size scrapes for 1 s (quick 4 s, full 20 s) and reloads once (quick twice).

    python -m loadtest.reliability_harness.hardening_admin [--full]
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import urllib.request
from pathlib import Path

import grpc

from loadtest import reload_stall
from loadtest.common import floor_percentile
from loadtest.reliability_harness.support import (
    CHANNEL_OPTIONS,
    METHOD,
    MIB,
    Context,
    Row,
    failed_row,
    main,
    ms,
    process_group,
    rss,
    start_sidecar,
)
from sidecar.protos.envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from sidecar.protos.envoy.service.ratelimit.v3 import rls_pb2

AREA = "hostile admin"
CONFIG = """\
domain: m
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 10}
  - key: team
    detailed_metric: true
    rate_limit: {unit: hour, requests_per_unit: 1000000}
"""
VALUE = 1000
CALLS = 160
P99_BOUND = 0.1
SLOW_READERS = 10
WRITE_TIMEOUT = 2.0
MAX_CONNECTIONS = 16
WAS = {3000: "was p99 60 ms", 14_000: "was p99 214 ms, max 522 ms"}
"""Issue 21's figures before the fix."""


def flood_request(call: int, override: bool) -> bytes:
    """64 descriptors of 1 KB values: request overrides of ``user``, or ``team`` (detailed)."""
    limit = ratelimit_pb2.RateLimitDescriptor.RateLimitOverride(
        requests_per_unit=1000, unit=rls_pb2.RateLimitResponse.RateLimit.HOUR
    )
    descriptors = []
    for index in range(64):
        entry = ratelimit_pb2.RateLimitDescriptor.Entry(
            key="user" if override else "team", value=f"{call:04d}-{index:02d}-" + "x" * VALUE
        )
        descriptor = ratelimit_pb2.RateLimitDescriptor(entries=[entry])
        if override:
            descriptor.limit.CopyFrom(limit)
        descriptors.append(descriptor)
    return bytes(rls_pb2.RateLimitRequest(domain="m", descriptors=descriptors).SerializeToString())


STEADY = rls_pb2.RateLimitRequest(
    domain="m",
    descriptors=[
        ratelimit_pb2.RateLimitDescriptor(entries=[ratelimit_pb2.RateLimitDescriptor.Entry(key="team", value="steady")])
    ],
).SerializeToString()


def flood(address: str) -> None:
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        call = channel.unary_unary(METHOD)
        for number in range(CALLS):
            call(flood_request(number, override=True), timeout=30)
            call(flood_request(number, override=False), timeout=30)


def scrape(url: str) -> tuple[float, int]:
    started = time.monotonic()
    with urllib.request.urlopen(url + "/metrics", timeout=60) as reply:
        size = len(reply.read())
    return time.monotonic() - started, size


def metrics_flood(context: Context) -> Row:
    scenario = f"/metrics after {CALLS} calls x 64 overrides of 1 KB values (+ as many detailed_metric values)"
    config = context.directory / "hardening-metrics.yaml"
    config.write_text(CONFIG)
    with process_group() as group:
        try:
            sidecar = start_sidecar(group, context, "metrics-flood", ["--config", str(config)])
            flood(sidecar.address)
            _, size = scrape(sidecar.metrics_url)
            seconds = {"smoke": 1.0, "quick": 4.0, "full": 20.0}[context.size]
            stop = threading.Event()
            scrapes: list[float] = []

            def scraper() -> None:
                while not stop.is_set():
                    scrapes.append(scrape(sidecar.metrics_url)[0])

            thread = threading.Thread(target=scraper, daemon=True)
            latencies: list[float] = []
            with grpc.insecure_channel(sidecar.address, options=CHANNEL_OPTIONS) as channel:
                call = channel.unary_unary(METHOD)
                thread.start()
                deadline = time.monotonic() + seconds
                while time.monotonic() < deadline:
                    started = time.monotonic()
                    call(STEADY, timeout=30)
                    latencies.append(time.monotonic() - started)
                    time.sleep(0.005)
            stop.set()
            thread.join(60)
        except Exception as error:
            return failed_row(AREA, scenario, error, group.children)
    from sidecar.metrics import MAX_RULE_SERIES_BYTES

    p99 = floor_percentile(latencies, 0.99)
    held = size <= MAX_RULE_SERIES_BYTES + 256 * 1024 and p99 <= P99_BOUND
    return Row(
        AREA,
        scenario,
        load=f"{len(scrapes)} scrapes back to back, {len(latencies):,} calls",
        ok=held,
        notes=(
            f"/metrics {size / MIB:.1f} MiB (was 64 MB), scrape median {ms(floor_percentile(scrapes, 0.5)):.0f} ms; "
            f"ShouldRateLimit during scrapes p50 {ms(floor_percentile(latencies, 0.5)):.1f} / p99 {ms(p99):.1f} / "
            f"max {ms(max(latencies)):.1f} ms (was p99 ~475 ms)"
        ),
        figures={
            "metrics_bytes": size,
            "scrape_median_ms": ms(floor_percentile(scrapes, 0.5)),
            "p50_ms": ms(floor_percentile(latencies, 0.5)),
            "p99_ms": ms(p99),
            "max_ms": ms(max(latencies)),
        },
    )


def stalled(port: int) -> socket.socket:
    raw = socket.socket()
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    raw.connect(("127.0.0.1", port))
    raw.sendall(b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n")
    return raw


def closed_by_server(raw: socket.socket) -> bool:
    raw.settimeout(5)
    try:
        while raw.recv(1 << 20):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


def slow_readers(context: Context) -> Row:
    scenario = f"{SLOW_READERS} clients GET a large /metrics and never read; {MAX_CONNECTIONS + 1} idle connections"
    config = context.directory / "hardening-slow.yaml"
    config.write_text(CONFIG)
    flags = ["--config", str(config), "--admin-write-timeout", str(WRITE_TIMEOUT)]
    with process_group() as group:
        try:
            sidecar = start_sidecar(group, context, "slow-readers", flags)
            flood(sidecar.address)
            _, size = scrape(sidecar.metrics_url)
            port = int(sidecar.metrics_url.rsplit(":", 1)[1])
            before = rss(sidecar.pid)
            sockets = [stalled(port) for _ in range(SLOW_READERS)]
            peak = before
            started = time.monotonic()
            while time.monotonic() - started < WRITE_TIMEOUT + 1.5:
                peak = max(peak, rss(sidecar.pid))
                time.sleep(0.1)
            dropped = sum(closed_by_server(raw) for raw in sockets)
            for raw in sockets:
                raw.close()
            after = rss(sidecar.pid)
            idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(MAX_CONNECTIONS)]
            time.sleep(0.3)
            with socket.create_connection(("127.0.0.1", port), timeout=5) as extra:
                extra.sendall(b"GET /healthz HTTP/1.1\r\n\r\n")
                answer = b""
                with contextlib.suppress(ConnectionResetError):
                    while chunk := extra.recv(4096):
                        answer += chunk
            for raw in idle:
                raw.close()
            refused = answer.startswith(b"HTTP/1.1 503")
        except Exception as error:
            return failed_row(AREA, scenario, error, group.children)
    return Row(
        AREA,
        scenario,
        load=f"/metrics {size / MIB:.1f} MiB",
        ok=dropped == SLOW_READERS and refused,
        notes=(
            f"{dropped}/{SLOW_READERS} dropped within the {WRITE_TIMEOUT:g} s write timeout; RSS "
            f"{before / MIB:.0f} -> {peak / MIB:.0f} MiB while they hung, {after / MIB:.0f} MiB after "
            f"(was 178 MiB -> 1.37 GiB, never closed); connection {MAX_CONNECTIONS + 1} "
            f"{'got 503' if refused else 'was NOT refused'}"
        ),
        figures={
            "metrics_bytes": size,
            "rss_before_mib": before / MIB,
            "rss_peak_mib": peak / MIB,
            "rss_after_mib": after / MIB,
            "dropped": dropped,
        },
    )


def hot_reload(context: Context) -> Row:
    rules = 3000 if context.quick else 14_000
    scenario = f"hot reload of {rules:,} rules under steady calls (SIGHUP)"
    try:
        directory = context.directory / "reload-stall"
        directory.mkdir(parents=True, exist_ok=True)
        reloads = {"smoke": 1, "quick": 2, "full": 3}[context.size]
        result = reload_stall.run_variant("after", rules, reloads, 0.002, Path(directory))
    except Exception as error:
        return failed_row(AREA, scenario, error)
    during, quiet = result["during"], result["quiet"]
    return Row(
        AREA,
        scenario,
        load=f"{during['calls']:,} calls during reloads",
        ok=during["p99_ms"] <= P99_BOUND * 1000 and result["reloads"] == len(result["reload_seconds"]),
        notes=(
            f"reloads {', '.join(f'{s:.1f}' for s in result['reload_seconds'])} s; ShouldRateLimit p50/p99/max "
            f"{during['p50_ms']}/{during['p99_ms']}/{during['max_ms']} ms during reloads "
            f"(quiet p99 {quiet['p99_ms']} ms; {WAS[rules]})"
        ),
        figures={"p50_ms": during["p50_ms"], "p99_ms": during["p99_ms"], "max_ms": during["max_ms"]},
    )


def run(context: Context) -> list[Row]:
    return [metrics_flood(context), slow_readers(context), hot_reload(context)]


if __name__ == "__main__":
    raise SystemExit(main(run))
