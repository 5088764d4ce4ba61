"""Issue 21, defect 2: a gRPC client must not be able to make ``/metrics`` stall the request path.

The attack: request-side ``limit`` overrides carrying long, distinct values minted one
per-rule row each, the rows were capped by count and name length but not bytes, never
went away, and ``/metrics`` was rendered on the event loop that serves gRPC. These
tests pin each part: overrides share one row per key shape, the per-rule rows are
capped in bytes, idle request-minted rows expire, and a scrape is rendered off the loop
(in process, and against a real sidecar flooded the way the attack did).
"""

from __future__ import annotations

import asyncio
import textwrap
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.core import GaugeMetricFamily

from sidecar import metrics
from sidecar.admin import AdminEndpoint
from sidecar.config import load_config
from sidecar.limiter.memory import MemoryLimiter
from sidecar.protos.envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from sidecar.protos.envoy.service.ratelimit.v3 import rls_pb2
from sidecar.service.servicer import RateLimitService
from tests.support.sidecars import SidecarFactory, clean_env, free_port, write_config

NOW = 1_700_000_000.0
CONFIG = textwrap.dedent(
    """\
    domain: m
    descriptors:
      - key: user
        rate_limit: {unit: minute, requests_per_unit: 10}
      - key: team
        detailed_metric: true
        rate_limit: {unit: hour, requests_per_unit: 1000000}
    """
)
LONG = 1000
"""Characters per hostile value: under the 1,024-character stat key bound, as in the attack."""


def override_request(domain: str, values: list[str]) -> Any:
    """One call whose descriptors each carry a request-side ``limit`` and one long value."""
    return rls_pb2.RateLimitRequest(
        domain=domain,
        descriptors=[
            ratelimit_pb2.RateLimitDescriptor(
                entries=[ratelimit_pb2.RateLimitDescriptor.Entry(key="user", value=value)],
                limit=ratelimit_pb2.RateLimitDescriptor.RateLimitOverride(
                    requests_per_unit=1000, unit=rls_pb2.RateLimitResponse.RateLimit.HOUR
                ),
            )
            for value in values
        ],
    )


def detailed_request(domain: str, values: list[str]) -> Any:
    return rls_pb2.RateLimitRequest(
        domain=domain,
        descriptors=[
            ratelimit_pb2.RateLimitDescriptor(entries=[ratelimit_pb2.RateLimitDescriptor.Entry(key="team", value=v)])
            for v in values
        ],
    )


@pytest.fixture
def service(tmp_path: Path) -> RateLimitService:
    (tmp_path / "m.yaml").write_text(CONFIG)
    return RateLimitService(load_config(str(tmp_path)), MemoryLimiter(), clock=lambda: NOW)


async def test_override_rules_share_one_row_per_key_shape(service: RateLimitService) -> None:
    for call in range(20):
        await service.decide(override_request("m", [f"{call:04d}-{index:02d}-" + "x" * LONG for index in range(8)]))
    rows = service.stats.rules.rows
    assert list(rows) == ["m.user"], f"{len(rows)} rows minted from request values"
    assert rows["m.user"][metrics.TOTAL_HITS] == 160


def test_per_rule_rows_are_capped_in_bytes() -> None:
    stats = metrics.RuleStats()
    for index in range(metrics.MAX_RULE_SERIES):
        key = f"d.team_{index:05d}_" + "v" * LONG
        stats.record(stats.row(key, "d", minted=True), 1, False, shadow=False, count=1, limit=10)
    body = metrics.render(Collect(stats.families))
    assert len(body) <= metrics.MAX_RULE_SERIES_BYTES + 64 * 1024, f"{len(body):,} bytes of per-rule series"
    assert stats.rows["d" + metrics.OVERFLOW_SUFFIX][metrics.TOTAL_HITS] > 0, "the rest share the overflow row"


def test_idle_request_minted_rows_expire_and_config_rows_stay() -> None:
    stats = metrics.RuleStats()
    config_row = stats.row("d.user", "d")
    busy = stats.row("d.team_busy", "d", minted=True)
    stats.row("d.team_idle", "d", minted=True)
    stats.expire(0.0)
    busy[metrics.TOTAL_HITS] += 1
    stats.expire(metrics.ROW_IDLE_SECONDS / 2)
    busy[metrics.TOTAL_HITS] += 1
    assert stats.expire(metrics.ROW_IDLE_SECONDS + 1) == 1
    assert set(stats.rows) == {"d.user", "d.team_busy"}
    assert stats.rows["d.user"] is config_row
    # Space is given back: a new request-minted row gets a row of its own again.
    assert stats.row("d.team_new", "d", minted=True) is stats.rows["d.team_new"]


class Collect:
    """A registry stand-in: whatever ``collect`` yields."""

    def __init__(self, collect: Any) -> None:
        self.collect = collect


class SlowCollector:
    """A collector that takes ``seconds`` of CPU-free blocking time to collect."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.threads: list[int] = []
        self.collecting = threading.Event()
        self.collected = threading.Event()

    def collect(self) -> Iterator[Any]:
        self.threads.append(threading.get_ident())
        self.collecting.set()
        time.sleep(self.seconds)
        self.collected.set()
        yield GaugeMetricFamily("slow", "a slow collector", value=1)


async def test_a_scrape_is_rendered_off_the_event_loop() -> None:
    slow = SlowCollector(0.4)
    endpoint = AdminEndpoint(registry=slow, config=lambda: dict, serving=lambda: True)
    await endpoint.start("127.0.0.1:0")
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", endpoint.port)
        writer.write(b"GET /metrics HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        turns_during_collect = 0  # loop turns seen while the collector was inside collect()
        scrape = asyncio.ensure_future(reader.read())
        while not scrape.done():
            await asyncio.sleep(0.01)
            turns_during_collect += slow.collecting.is_set() and not slow.collected.is_set()
        body = scrape.result()
        writer.close()
    finally:
        await endpoint.close()
    assert body.startswith(b"HTTP/1.1 200") and b"slow 1.0" in body
    # An ordering, not a lag figure: the loop ran while the collector was busy.
    assert turns_during_collect > 0, "the event loop was blocked for the whole collection"
    assert slow.threads and threading.get_ident() not in slow.threads, "collected on the event loop thread"


def test_a_flooded_sidecar_answers_every_call_while_scraped(start_sidecar: SidecarFactory, tmp_path: Path) -> None:
    """The attack against a real process: override and detailed_metric floods of 1 KB values,
    then ``/metrics`` scraped back to back while ShouldRateLimit is called."""
    port = free_port()
    sidecar = start_sidecar(
        config=write_config(tmp_path / "config", CONFIG, "m.yaml"),
        env=clean_env(RLS_METRICS_ADDRESS=f"127.0.0.1:{port}"),
    )
    for call in range(160):
        values = [f"{call:04d}-{index:02d}-" + "x" * LONG for index in range(64)]
        sidecar.ask(override_request("m", values), timeout=30)
        sidecar.ask(detailed_request("m", values), timeout=30)

    def scrape() -> tuple[float, int]:
        started = time.monotonic()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as reply:
            size = len(reply.read())
        return time.monotonic() - started, size

    _, size = scrape()
    assert size <= metrics.MAX_RULE_SERIES_BYTES + 256 * 1024, f"/metrics is {size:,} bytes"

    scraping = threading.Event()
    stop = threading.Event()
    scrapes: list[float] = []

    def scraper() -> None:
        while not stop.is_set():
            scraping.set()
            scrapes.append(scrape()[0])

    thread = threading.Thread(target=scraper, daemon=True)
    thread.start()
    scraping.wait(10)
    answers = []
    deadline = time.monotonic() + 4.0
    try:
        while time.monotonic() < deadline or len(scrapes) < 3:
            answers.append(sidecar.ask(detailed_request("m", ["steady"]), timeout=30).overall_code)
            time.sleep(0.005)
    finally:
        stop.set()
        thread.join(60)
    # How long the calls waited is the reliability report's figure (hardening-admin), not a test's:
    # here, every call is answered, and admitted, while /metrics is scraped back to back.
    assert len(scrapes) >= 3
    assert set(answers) == {rls_pb2.RateLimitResponse.OK}, answers
