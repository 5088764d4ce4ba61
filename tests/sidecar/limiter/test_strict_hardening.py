"""Strict mode: a unique-key flood once the owed-hits ledger is full (issue 21, defect 5).

While Redis is away, hits the failure mode admits are owed per key, at most
``--max-counters`` keys. At that cap every new key used to scan the whole ledger for
entries of ended windows (a call of 64 new keys at a cap of 40,000: from 0.2 to 89 ms).
Making room is now amortised O(1): entries are kept in order of expiry, so only
entries that did expire are looked at. What the cap drops is still counted.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

from sidecar.limiter.ledger import OwedHits
from sidecar.limiter.protocol import Check, Role
from sidecar.limiter.strict import StrictLimiter
from sidecar.server import build_redis_limiter
from tests.support.redis_servers import RedisServer, fresh_prefix, redis_settings

NOW = 1_700_000_000.0
LATER = int(NOW) + 3600


def full_ledger(cap: int, expired: int = 0) -> OwedHits:
    """A ledger at its cap: ``expired`` entries of windows that ended before ``NOW``, the rest live."""
    ledger = OwedHits(cap)
    for index in range(cap):
        assert ledger.owe_amount(f"k{index}", 1, int(NOW) - 10 if index < expired else LATER, NOW)
    return ledger


class ScannedDict(dict):  # type: ignore[type-arg]
    """The ledger's entries, counting every entry a full pass (iteration, keys, values, items) reads."""

    read = 0

    def _scan(self) -> None:
        ScannedDict.read += len(self)

    def __iter__(self) -> Iterator[Any]:
        self._scan()
        return super().__iter__()

    def keys(self) -> Any:
        self._scan()
        return super().keys()

    def values(self) -> Any:
        self._scan()
        return super().values()

    def items(self) -> Any:
        self._scan()
        return super().items()


class ScannedList(list):  # type: ignore[type-arg]
    """The expiry order, counting every item a Python-level pass reads (``heapq`` reads by index)."""

    def __iter__(self) -> Iterator[Any]:
        ScannedDict.read += len(self)
        return super().__iter__()


def watch_scans(ledger: OwedHits) -> None:
    """Count from here on every entry a pass over the ledger or its expiry order reads."""
    ledger._owed = ScannedDict(ledger._owed)
    ledger._expiry = ScannedList(ledger._expiry)
    ScannedDict.read = 0


def test_new_keys_at_a_full_ledger_cost_no_scan_each() -> None:
    """Counted, not timed (the figure is loadtest's): a new key at a full ledger of live
    entries reads no entry. Before: every new key read all 40,000 (80 million reads, seconds)."""
    ledger = full_ledger(40_000)
    watch_scans(ledger)
    for index in range(2_000):
        assert not ledger.owe_amount(f"new{index}", 1, LATER, NOW)
    assert ScannedDict.read == 0, f"2,000 new keys at a full ledger read {ScannedDict.read:,} entries"
    assert ledger.dropped_hits == 2_000
    assert ledger.owed_hits == 40_000


def test_entries_of_ended_windows_make_room_and_live_ones_stay() -> None:
    ledger = full_ledger(1_000, expired=300)
    for index in range(400):
        ledger.owe_amount(f"new{index}", 2, LATER, NOW)
    assert ledger.dropped_hits == 200, "300 entries had expired: room for 300 of the 400 new keys"
    assert ledger.owed_hits == 700 + 300 * 2
    assert ledger.settled([f"k{index}" for index in range(300)]), "expired entries are forgotten"
    assert not ledger.settled(["k300"]), "live entries are never forgotten to make room"


def test_a_key_owed_again_after_a_drain_is_forgotten_only_once_expired() -> None:
    """Entries leave the ledger by drains and corrections too: stale order entries must not
    forget a key owed again later with a live window."""
    ledger = OwedHits(2)
    ledger.owe_amount("a", 1, int(NOW) - 10, NOW)
    ledger.owe_amount("b", 1, LATER, NOW)
    drained = ledger.drain_admitted()
    ledger.settle(drained)
    ledger.owe_amount("a", 1, LATER, NOW)
    ledger.owe_amount("b", 1, LATER, NOW)
    assert not ledger.owe_amount("c", 1, LATER, NOW)  # full of live entries: dropped
    assert ledger.owed_hits == 2
    assert ledger.dropped_hits == 1


def test_a_long_flood_keeps_the_order_bounded() -> None:
    """Keys that come and go (drained, restored, cancelled) must not grow the expiry order for ever."""
    ledger = OwedHits(100)
    for round_ in range(200):
        for index in range(100):
            ledger.owe_amount(f"r{round_}-{index}", 1, LATER, NOW)
        ledger.settle(ledger.drain_admitted())
    assert len(ledger._expiry) <= 2 * 100 + 64


async def test_a_strict_flood_during_an_outage_stays_fast_at_the_ledger_cap(own_redis: RedisServer) -> None:
    cap = 20_000
    settings = redis_settings(own_redis.url, "strict", 0.005, max_counters=cap, redis_prefix=fresh_prefix("s"))
    limiter = build_redis_limiter(settings)
    assert isinstance(limiter, StrictLimiter)
    await limiter.start()
    try:
        own_redis.kill()
        deadline = time.monotonic() + 5
        while limiter.store.available:
            assert time.monotonic() < deadline, "the limiter never noticed the outage"
            await limiter.replicas.beat()
            await asyncio.sleep(0.01)
        now = time.time()
        calls = cap // 64 + 60
        watch_scans(limiter.ledger)
        for call in range(calls):
            checks = [Check(("flood", f"{call}-{index}"), 3600, 10, 1, Role.ENFORCED) for index in range(64)]
            decision = await limiter.check(checks, now)
            assert decision.admitted
        assert limiter.ledger.dropped_hits == calls * 64 - cap
        # Counted, not timed: the 60 calls past the cap read no entry of the full ledger.
        assert ScannedDict.read == 0, f"the flood read {ScannedDict.read:,} ledger entries"
    finally:
        await limiter.close()
