"""strict and sync limiters through one Redis Cluster master's death (issue 31), against a
real Cluster with one replica per master (node timeout 2 s).

* A flush whose keys span every master lands on the healthy ones (``PartialFlush``): their
  keys are settled (strict) or read back (sync) at once, while the dead master's keys are
  still owed; before, the flush counted as failed whole and every key waited for the failover.
* A request on the dead master's counter is decided by the failure mode at once, as
  ``redis_down`` (a Redis outage, for its keys), even in strict mode with hits owed to that
  counter; before, strict waited its whole budget for a flush that could not land
  (``redis_timeout``) and a request refused at once counted as ``redis_refused``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
from redis.crc import key_slot

from sidecar.limiter.algorithms import Algorithm
from sidecar.limiter.protocol import Check
from sidecar.limiter.redis.keys import counter_window
from sidecar.limiter.strict import StrictLimiter
from sidecar.limiter.sync import SyncLimiter
from sidecar.server import build_redis_limiter, build_strict_limiter
from tests.sidecar.limiter.conftest import strict_settings, sync_settings
from tests.support import outages
from tests.support.redis_servers import RedisCluster, fresh_prefix, replicated_cluster
from tests.support.windows import ensure_left_async

__all__ = ["replicated_cluster"]  # a fixture, used by name

pytestmark = [pytest.mark.slow, pytest.mark.serial]

LIMIT = 1_000_000
"""Never reached: what is tested is who decided and what landed."""
WAIT = 40.0
"""Bounds every wait (a failover on a loaded machine); never a measured time."""
EXPIRE = int(time.time()) + 3600
UNIT = 86_400
"""Every counter's window: a day. A key is named by its window, so the test must run inside
one; with one-minute windows a run crossing a minute's end read the next window's empty key."""


def masters_by_port(cluster: RedisCluster) -> dict[int, set[int]]:
    masters: dict[int, set[int]] = {}
    for start, end, master, *_ in cluster.alive()[0].client().execute_command("CLUSTER", "SLOTS"):
        masters.setdefault(int(master[1]), set()).update(range(int(start), int(end) + 1))
    return masters


def key_of(prefix: str, check: Check) -> str:
    return counter_window(prefix, check.key, check.unit_seconds, time.time())[0]


def check_on(prefix: str, slots: set[int], name: str, algorithm: Algorithm = Algorithm.FIXED_WINDOW) -> Check:
    """A counter (window :data:`UNIT`) whose key lives in ``slots``."""
    for index in range(10_000):
        check = Check((f"{name}-{index}",), UNIT, LIMIT, 1, algorithm=algorithm)
        if key_slot(key_of(prefix, check).encode()) in slots:
            return check
    raise AssertionError(f"no counter found in {len(slots)} slots")


async def until(condition: Callable[[], object], what: str) -> None:
    await outages.until(condition, what, WAIT)


def redis_total(cluster: RedisCluster, key: str) -> int:
    return int(cluster.client().get(key) or 0)


async def test_healthy_masters_keys_land_during_a_failover_and_the_dead_masters_fail_at_once(
    replicated_cluster: RedisCluster,
) -> None:
    cluster = replicated_cluster
    await ensure_left_async(UNIT, needed=4 * WAIT)  # a day's last minutes: the next day's window
    strict = build_strict_limiter(strict_settings(cluster.url, redis_prefix=fresh_prefix("s"), redis_timeout=1.0))
    built = build_redis_limiter(sync_settings(cluster.url, redis_prefix=fresh_prefix("y"), redis_timeout=1.0))
    assert isinstance(built, SyncLimiter)
    sync = built
    await strict.start()
    await sync.start()
    try:
        masters = masters_by_port(cluster)
        victim_port = int(strict.store.client.get_default_node().port)
        victim = next(node for node in cluster.nodes if node.port == victim_port)
        owed = {port: check_on(strict.prefix, slots, f"owed-{port}") for port, slots in masters.items()}
        pending = {port: check_on(sync.prefix, slots, f"pending-{port}") for port, slots in masters.items()}
        replica = cluster.kill_master(victim)
        for check in pending.values():  # admitted locally: pending hits, for the next flush
            assert (await sync.check([check], time.time())).admitted
        # Both find the master down: strict by a request on it (its call breaks on the
        # connection; the failure mode admits it, owing the hit), sync by its next flush.
        deadline = time.monotonic() + WAIT
        while not down(strict):
            assert time.monotonic() < deadline, "strict never found the master down"
            await strict.check([owed[victim_port]], time.time())
        await until(lambda: down(sync), "sync's flush found the master down")
        assert strict.store.available and sync.store.available  # the Cluster as a whole is up
        # strict: hits owed to a counter on every master, then a flush over all of them.
        for check in owed.values():
            strict.ledger.owe(key_of(strict.prefix, check), 2, EXPIRE)
        victim_key = key_of(strict.prefix, owed[victim_port])
        healthy_keys = [key_of(strict.prefix, check) for port, check in owed.items() if port != victim_port]
        await until(lambda: strict.ledger.settled(healthy_keys), "the healthy masters' owed hits settled")
        assert not strict.ledger.settled([victim_key]), "settled only with the dead master's key: after the failover"
        assert [redis_total(cluster, key) for key in healthy_keys] == [2] * len(healthy_keys)
        # A request on the dead master's counter, hits owed to it: the failure mode at once.
        before = dict(strict.reasons.counts)
        started = time.monotonic()
        await strict.check([owed[victim_port]], time.time())
        waited = time.monotonic() - started
        assert strict.reasons.counts["redis_down"] == before["redis_down"] + 1, strict.reasons.counts
        # sync: the healthy masters' counters flushed and read back, the dead one's still in flight.
        counters = {port: sync.table.counter(check, time.time()) for port, check in pending.items()}
        for counter in counters.values():
            counter.busy -= 1
        healthy = [counter for port, counter in counters.items() if port != victim_port]
        await until(lambda: not any(counter.unflushed for counter in healthy), "sync's healthy counters flushed")
        assert counters[victim_port].unflushed == 1, "its flush resent until the failover"
        assert all(counter.known == 1 for counter in healthy)
        # New hits go on landing on the healthy masters (newer flushes than the one resent).
        for check in pending.values():
            assert (await sync.check([check], time.time())).admitted
        await until(lambda: not any(counter.unflushed for counter in healthy), "sync's next hits flushed")
        assert counters[victim_port].unflushed == 2 and all(counter.known == 2 for counter in healthy)
        for check in owed.values():
            strict.ledger.owe(key_of(strict.prefix, check), 1, EXPIRE)
        await until(lambda: strict.ledger.settled(healthy_keys), "strict's next owed hits settled")
        assert [redis_total(cluster, key) for key in healthy_keys] == [3] * len(healthy_keys)
        assert not strict.ledger.settled([victim_key])
        # A sync escalation on the dead master (a sliding window: escalates until its
        # previous window is known) is decided by the failure mode as an outage of its keys.
        sliding = check_on(sync.prefix, masters[victim_port], "sliding", Algorithm.SLIDING_WINDOW)
        await sync.check([sliding], time.time())
        assert sync.reasons.counts["redis_down"] >= 1 and not sync.reasons.counts["redis_refused"], sync.reasons.counts
        print(f"strict request on the dead master's owed counter decided in {waited * 1000:.0f} ms (budget 1000)")
        # After the failover everything lands, nothing twice.
        await asyncio.to_thread(cluster.wait_promoted, replica)
        await until(lambda: strict.ledger.settled([victim_key]), "the dead master's owed hits landed")
        await until(lambda: not sync.table.has_unflushed(), "sync's pending hits landed")
        assert redis_total(cluster, victim_key) >= 3  # 3 owed, plus what the failure mode admitted there
        assert [redis_total(cluster, key) for key in healthy_keys] == [3] * len(healthy_keys)
        for check in pending.values():
            assert redis_total(cluster, key_of(sync.prefix, check)) == 2
        assert set(strict.reasons.counts) and not strict.reasons.counts["redis_timeout"], strict.reasons.counts
    finally:
        await strict.close()
        await sync.close()


def down(limiter: StrictLimiter | SyncLimiter) -> bool:
    """Whether the limiter knows a Cluster master down."""
    nodes = limiter.store.nodes
    assert nodes is not None
    return bool(nodes.down())
