"""What the cyclic collector must walk per live quota bucket (issue 25: full collections).

A full collection walks every GC-tracked object of the process while holding the GIL, so
each tracked object a live bucket keeps costs every full collection. Counted, not timed:
the tracked objects a few thousand adopted buckets add once their answers are sent; and
the registry's calls to settle the heap (``sidecar.heap``) as buckets are adopted.
"""

from __future__ import annotations

import gc
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

from sidecar import heap
from sidecar.config import load_config
from sidecar.heap import SETTLE_EVERY
from sidecar.limiter.memory import MemoryLimiter
from sidecar.quota.buckets import bucket_of
from sidecar.quota.leases import QuotaLeases
from sidecar.quota.registry import CHUNK, QuotaRegistry, QuotaSettings
from sidecar.quota.stream import Stream
from sidecar.server import Sidecar
from sidecar.settings import Settings
from tests.sidecar.quota.test_leases_outage import CountingRedis

RULES = """
domain: q
descriptors:
  - key: user
    rate_limit: {unit: second, requests_per_unit: 200}
  - key: team
    rate_limit: {unit: minute, requests_per_unit: 50}
"""
BUCKETS = 2000


def tracked_types() -> Counter[str]:
    gc.collect()  # also untracks tuples and dicts that hold only atomic values
    return Counter(type(item).__name__ for item in gc.get_objects())


def adopt(registry: QuotaRegistry, stream: Stream) -> None:
    usages = ((bucket_of("q", [("user" if i % 2 else "team", f"u{i}")]), 1, 0) for i in range(BUCKETS))
    registry.report(stream, "q", usages)
    stream.pending.clear()  # sent: what stays is the live state


def per_bucket(h: SimpleNamespace, leases: QuotaLeases | None) -> dict[str, float]:
    clock = h.FakeClock(1000.0)
    registry = QuotaRegistry(h.config_of(RULES), QuotaSettings(max_buckets_per_stream=BUCKETS), clock=clock)
    registry.leases = leases
    stream = registry.open("envoy")
    before = tracked_types()
    adopt(registry, stream)
    grown = tracked_types() - before
    assert registry.live == BUCKETS
    return {name: count / BUCKETS for name, count in grown.items()}


def test_a_live_bucket_is_one_tracked_object(h: SimpleNamespace) -> None:
    grown = per_bucket(h, None)
    assert grown.get("LiveBucket") == 1
    assert grown.get("Assignment", 0) < 0.01  # one per rule, shared by its buckets
    assert sum(grown.values()) < 1.05, grown


def test_a_shared_bucket_keeps_at_most_four_tracked_objects(h: SimpleNamespace) -> None:
    clock = h.FakeClock(1000.0)
    warm = QuotaLeases(CountingRedis(clock), "w", ttl=6, clock=clock, wall=clock)  # type: ignore[arg-type]
    per_bucket(h, warm)  # first-use costs (caches filled once per process) are no bucket's: run alone they were
    leases = QuotaLeases(CountingRedis(clock), "a", ttl=6, clock=clock, wall=clock)  # type: ignore[arg-type]
    grown = per_bucket(h, leases)
    assert grown.get("Shape", 0) < 0.01
    assert grown.get("Assignment", 0) < 0.01
    assert sum(grown.values()) < 4.05, grown


async def test_adoptions_settle_the_heap_every_few_thousand_buckets_between_chunks(h: SimpleNamespace) -> None:
    settles: list[int] = []
    registry = QuotaRegistry(
        h.config_of(RULES),
        QuotaSettings(max_buckets_per_stream=100_000),
        clock=h.FakeClock(1000.0),
        settle=lambda: settles.append(registry.live),
    )
    stream = registry.open("envoy")
    count = 2 * SETTLE_EVERY + 100
    usages = ((bucket_of("q", [("user", f"u{i}")]), 1, 0) for i in range(count))
    await registry.report_in_chunks(stream, "q", usages)
    assert len(settles) == 2
    assert all(live % CHUNK == 0 and SETTLE_EVERY <= live < SETTLE_EVERY + CHUNK for live in settles[:1])
    assert settles[1] - settles[0] >= SETTLE_EVERY
    usages = ((bucket_of("q", [("user", f"u{i}")]), 1, 0) for i in range(count))  # known: none adopted
    await registry.report_in_chunks(stream, "q", usages)
    assert len(settles) == 2


async def test_the_server_settles_after_adoptions_and_shows_the_worst_pause(tmp_path: Path) -> None:
    (tmp_path / "q.yaml").write_text(RULES)
    settings = Settings(config=str(tmp_path), grpc_address="127.0.0.1:0", metrics_address="", watch_config=False)
    sidecar = Sidecar(settings, load_config(str(tmp_path)), MemoryLimiter())
    assert sidecar.quota.registry.settle is heap.settle
    scraped = {family.name for family in sidecar.admin.registry().collect()}
    assert "ratelimit_sidecar_gc_pause_max_seconds" in scraped
