"""Faults of one part of a real Redis Cluster (issue 31): a slot in migration, a dead
master, a slow master. Each fails the requests it touches, and only those: the others
keep deciding from Redis, and the Cluster as a whole is never marked down."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from redis.crc import key_slot

from sidecar.limiter.protocol import Check
from sidecar.limiter.redis.availability import RedisUnavailable
from sidecar.limiter.redis.batcher import DecisionBatcher
from sidecar.limiter.redis.cluster_health import ShardUnavailable
from sidecar.limiter.redis.flush_calls import PartialFlush
from sidecar.limiter.redis.keys import counter_digest, counter_window, window_key
from sidecar.limiter.redis.store import RedisStore
from sidecar.limiter.windows import window_start
from tests.sidecar.limiter.conftest import Factory
from tests.support.redis_servers import RedisCluster, RedisServer, fresh_prefix, own_cluster, replicated_cluster

__all__ = ["own_cluster", "replicated_cluster"]  # fixtures, used by name

FAR_FUTURE = int(time.time()) + 3600
GUARD = 40.0
"""Bounds a wait that must end far sooner; never asserted as a figure."""
LIMIT = 1_000_000
"""High enough that every call here is admitted: what is tested is who decided it."""


class Heard(list[tuple[bool, str]]):
    """What the store's listeners were told (limiters reconcile on these)."""

    def __call__(self, available: bool, reason: str) -> None:
        self.append((available, reason))


@pytest.fixture
async def heard() -> Heard:
    return Heard()


async def open_store(cluster: RedisCluster, heard: Heard, redis_timeout: float) -> RedisStore:
    store = RedisStore.for_url(cluster.url, prefix=fresh_prefix(), redis_timeout=redis_timeout)
    store.add_listener(heard)
    await store.start()
    assert store.available, store.last_error
    return store


def masters_by_port(cluster: RedisCluster) -> dict[int, set[int]]:
    """``{port: slots}`` of each live master, as the Cluster says now."""
    masters: dict[int, set[int]] = {}
    for start, end, master, *_ in cluster.alive()[0].client().execute_command("CLUSTER", "SLOTS"):
        masters.setdefault(int(master[1]), set()).update(range(int(start), int(end) + 1))
    return masters


def counter_on(store: RedisStore, slots: set[int], name: str, avoid: int | None = None) -> Check:
    """A counter whose key lives in ``slots`` (and not in slot ``avoid``)."""
    for index in range(10_000):
        check = Check((f"{name}-{index}",), 60, LIMIT, 1)
        slot = key_slot(key_of(store, check).encode())
        if slot in slots and slot != avoid:
            return check
    raise AssertionError(f"no counter found in {len(slots)} slots")


def key_of(store: RedisStore, check: Check) -> str:
    return counter_window(store.prefix, check.key, check.unit_seconds, time.time())[0]


async def decide_one(store: RedisStore, check: Check, pending: dict[str, tuple[int, int]] | None = None) -> bool:
    """True when Redis decided ``check`` (admitted: the limit is never reached here)."""
    admitted, _, _ = await store.decide([key_of(store, check)], [check], [FAR_FUTURE], False, pending)
    assert admitted
    return True


async def outcome(call: asyncio.Future[bool] | asyncio.Task[bool]) -> str:
    """``redis`` if Redis decided, else the failure's kind (the failure mode decides)."""
    try:
        await call
    except ShardUnavailable:
        return "shard_down"
    except RedisUnavailable:
        return "refused"
    return "redis"


# -- (a) a slot in migration -----------------------------------------------------------


@pytest.mark.slow
@pytest.mark.serial
async def test_a_slot_in_migration_fails_its_own_calls_only(own_cluster: RedisCluster, heard: Heard) -> None:
    """Multi-key calls on a migrating slot are answered TRYAGAIN (redis-py then gives up:
    ``TTL exhausted``): those calls fail alone; every other slot keeps deciding from
    Redis, and the store is never marked down (before issue 31 it was, at the first one)."""
    store = await open_store(own_cluster, heard, redis_timeout=1.0)
    now = time.time()
    digest = counter_digest(("migrating",))
    here = window_key(store.prefix, digest, window_start(now, 60))
    moved = window_key(store.prefix, digest, window_start(now, 60) - 60)
    slot = key_slot(here.encode())
    writer = own_cluster.client()
    writer.set(here, 1, ex=3600)
    writer.set(moved, 1, ex=3600)
    others = [
        counter_on(store, slots, f"other-{port}", avoid=slot) for port, slots in masters_by_port(own_cluster).items()
    ]
    migrating = Check(("migrating",), 60, LIMIT, 1)
    source, target = own_cluster.start_migration(slot, [moved])
    tally: dict[str, int] = {}
    try:
        for _ in range(4):
            # The migrating slot's call (its keys split between two nodes) alongside the others.
            calls = [asyncio.ensure_future(decide_one(store, check)) for check in others]
            split = asyncio.ensure_future(decide_one(store, migrating, {moved: (1, FAR_FUTURE)}))
            assert [await outcome(call) for call in calls] == ["redis"] * len(others)
            result = await outcome(split)
            assert result in ("refused", "redis")  # failed alone, or decided after a resend
            tally[result] = tally.get(result, 0) + 1
            assert store.available
            # An idempotent flush on the migrating slot (flush_once.lua: two keys) fails alone too.
            with pytest.raises(RedisUnavailable, match=r"refused the call|resend"):
                await store.flush({here: (1, FAR_FUTURE)}, once=("owner", 1))
            assert store.available
            assert await store.flush({key_of(store, others[0]): (1, FAR_FUTURE)}, once=("owner", 2))
        # The batcher (strict mode's path): the other slots' requests decided from Redis.
        batcher = DecisionBatcher(store)
        answers = await asyncio.gather(
            *(batcher.decide([key_of(store, check)], [check], [FAR_FUTURE], 5.0, lambda _: None) for check in others),
            batcher.decide([here, moved], [migrating, migrating], [FAR_FUTURE] * 2, 5.0, lambda _: None),
            return_exceptions=True,
        )
        assert all(isinstance(answer, list) for answer in answers[:-1]), answers
        assert store.available
    finally:
        own_cluster.finish_migration(slot, source, target)
        await store.close()
    print(f"migrating slot: {tally}; other slots: {4 * len(others)} calls, all decided by Redis")
    assert tally.get("refused", 0) >= 1, tally  # the migration was real: some call met TRYAGAIN
    assert heard == []
    assert store.nodes is not None
    assert all(store.nodes.states().values())


# -- (b) a dead master, then its replica promoted --------------------------------------


@pytest.mark.slow
@pytest.mark.serial
async def test_a_dead_master_fails_its_own_slots_until_its_replica_takes_over(
    replicated_cluster: RedisCluster, heard: Heard
) -> None:
    """SIGKILL one master: keys on the other masters keep deciding from Redis every round;
    keys on the dead one get the failure mode (at once, not sent) until the Cluster
    promotes its replica (node timeout 2 s) and the store's probe finds the new slot map,
    then Redis again. The store as a whole stays available and listeners hear nothing."""
    cluster = replicated_cluster
    store = await open_store(cluster, heard, redis_timeout=1.0)
    masters = masters_by_port(cluster)
    checks = {port: counter_on(store, slots, f"on-{port}") for port, slots in masters.items()}
    victim_port = int(store.client.get_default_node().port)  # the node redis-py re-reads the Cluster from
    victim = next(node for node in cluster.nodes if node.port == victim_port)
    assert [await outcome(asyncio.ensure_future(decide_one(store, check))) for check in checks.values()] == [
        "redis"
    ] * len(checks)
    replica = cluster.kill_master(victim)
    # redis-py drops its connections and re-reads the Cluster before the next call (as it
    # does itself after CLUSTERDOWN or a run of MOVED), through its default node: the dead one.
    await store.client.aclose()
    rounds: list[dict[int, str]] = []
    loop = asyncio.get_running_loop()
    killed = loop.time()
    deadline = killed + GUARD
    back_after = 0.0
    partial: list[tuple[PartialFlush, dict[int, str]]] = []
    try:
        while loop.time() < deadline:
            calls = {port: asyncio.ensure_future(decide_one(store, check)) for port, check in checks.items()}
            rounds.append({port: await outcome(call) for port, call in calls.items()})
            assert store.available, store.last_error
            if rounds[-1][victim_port] != "redis":
                back_after = loop.time() - killed  # a figure for the report, never asserted
            if rounds[-1][victim_port] == "shard_down":  # the per-node gauge says which master
                assert store.nodes is not None
                assert store.nodes.states().get(f"127.0.0.1:{victim_port}") is not True  # down, or forgotten
                healthy_keys = [key_of(store, check) for port, check in checks.items() if port != victim_port]
                assert store.unavailable_for(healthy_keys) is None
                if f"127.0.0.1:{victim_port}" in store.nodes.states():  # not yet replaced
                    assert "unavailable" in str(store.unavailable_for([key_of(store, checks[victim_port])]))
                if not partial:  # a flush over every master lands on the healthy ones, names the rest
                    partial.append(await flush_over(store, checks))
            recovered = [row[victim_port] for row in rounds[-10:]]
            if len(rounds) > 10 and any(row[victim_port] != "redis" for row in rounds) and set(recovered) == {"redis"}:
                break
            await asyncio.sleep(0.05)
        healthy = [row[port] for row in rounds for port in checks if port != victim_port]
        victim_rows = [row[victim_port] for row in rounds]
        summary = {kind: victim_rows.count(kind) for kind in set(victim_rows)}
        print(f"rounds={len(rounds)} healthy={len(healthy)}; dead master's keys: {summary}, back {back_after:.1f} s")
        assert set(healthy) == {"redis"}, rounds
        assert "shard_down" in victim_rows, summary  # failed at once while known down
        first_back = victim_rows.index("redis", victim_rows.index("shard_down"))
        assert set(victim_rows[first_back:]) == {"redis"}, victim_rows  # back for good once promoted
        assert replica.client().info("replication")["role"] == "master"
        assert partial, "no flush was tried while the master was known down"
        flushed, keys = partial[0]
        assert flushed.failed == [keys[victim_port]]
        assert sorted(flushed.totals) == sorted(keys[port] for port in checks if port != victim_port)
        assert heard == []
        assert store.nodes is not None
        assert f"127.0.0.1:{victim_port}" not in store.nodes.states()  # left the slot map: forgotten
    finally:
        await store.close()


async def flush_over(store: RedisStore, checks: dict[int, Check]) -> tuple[PartialFlush, dict[int, str]]:
    """An idempotent flush of one hit on every master's counter, one of them down; and its keys."""
    keys = {port: key_of(store, check) for port, check in checks.items()}
    with pytest.raises(PartialFlush) as raised:
        await store.flush({key: (1, FAR_FUTURE) for key in keys.values()}, once=("flusher", 1))
    return raised.value, keys


# -- (c) a slow master does not hold the others' answers -------------------------------


@pytest.mark.slow
@pytest.mark.serial
async def test_a_strict_batch_answers_each_request_when_its_own_call_returns(
    own_cluster: RedisCluster, heard: Heard
) -> None:
    """One batch, three requests on three masters; one master blocked (DEBUG SLEEP): the
    other two requests are answered while the blocked one's call is still out (before
    issue 31 the batch answered all three when the last returned)."""
    store = await open_store(own_cluster, heard, redis_timeout=2.0)
    masters = masters_by_port(own_cluster)
    checks = {port: counter_on(store, slots, f"batch-{port}") for port, slots in masters.items()}
    slow_port = sorted(masters)[0]
    slow = next(node for node in own_cluster.nodes if node.port == slow_port)
    batcher = DecisionBatcher(store)
    order: list[int] = []
    slow_done_when_answered: dict[int, bool] = {}
    try:
        sleeper = await asyncio.to_thread(slow_sleep, slow)
        calls: dict[int, asyncio.Task[list[int]]] = {}
        for port, check in checks.items():  # one loop iteration: one batch
            calls[port] = asyncio.ensure_future(
                batcher.decide([key_of(store, check)], [check], [FAR_FUTURE], GUARD, lambda _: None)
            )

        def answered(port: int) -> None:
            order.append(port)
            slow_done_when_answered[port] = calls[slow_port].done()

        for port, call in calls.items():
            call.add_done_callback(lambda _, port=port: answered(port))
        answers = await asyncio.wait_for(asyncio.gather(*calls.values()), GUARD)
        await asyncio.to_thread(sleeper.join, GUARD)
    finally:
        await store.close()
    assert all(answer == [1] for answer in answers), answers  # every request decided by Redis
    assert order[-1] == slow_port, order
    fast = [port for port in checks if port != slow_port]
    assert not any(slow_done_when_answered[port] for port in fast), slow_done_when_answered
    assert heard == []


def slow_sleep(node: RedisServer) -> threading.Thread:
    """DEBUG SLEEP 1 s on ``node`` in a thread (blocks that master), started before returning."""
    return node.debug_sleep(1.0)


# -- (b) end to end: strict mode through a master's death -------------------------------


@pytest.mark.slow
@pytest.mark.serial
async def test_strict_mode_decides_from_redis_on_healthy_masters_while_one_is_dead(
    replicated_cluster: RedisCluster, limiters: Factory
) -> None:
    """A strict limiter, one master SIGKILLed: requests on the healthy masters are decided by
    Redis every round; the dead master's get the failure mode at once (reason ``redis_down``,
    an outage of their keys, though the limiter hears of no outage of the Cluster) until its
    replica takes over; the hits admitted meanwhile are owed, and land once it has."""
    cluster = replicated_cluster
    limiter = limiters(cluster.url, redis_timeout=1.0)
    await limiter.start()
    await limiter.replicas.beat()
    store = limiter.store
    masters = masters_by_port(cluster)
    checks = {port: counter_on(store, slots, f"strict-{port}") for port, slots in masters.items()}
    victim_port = int(store.client.get_default_node().port)
    victim = next(node for node in cluster.nodes if node.port == victim_port)
    cluster.kill_master(victim)
    rounds: list[dict[int, bool]] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + GUARD
    while loop.time() < deadline:
        row: dict[int, bool] = {}
        for port, check in checks.items():
            before = limiter.redis_decisions
            assert (await limiter.check([check], time.time())).admitted
            row[port] = limiter.redis_decisions > before  # True: Redis decided it
        rounds.append(row)
        assert not limiter.policy.degraded  # the limiter heard of no outage
        back = [row[victim_port] for row in rounds[-10:]]
        if len(rounds) > 10 and not all(row[victim_port] for row in rounds) and all(back):
            break
        await asyncio.sleep(0.05)
    healthy = [row[port] for row in rounds for port in checks if port != victim_port]
    dead = [row[victim_port] for row in rounds]
    print(
        f"strict: healthy masters {sum(healthy)} of {len(healthy)} by Redis;",
        f"dead master {dead.count(False)} by the failure mode, reasons {dict(limiter.reasons.counts)}",
    )
    assert all(healthy), rounds
    assert not all(dead)
    assert all(dead[dead.index(False) + dead[dead.index(False) :].index(True) :]), dead
    reasons = {reason: count for reason, count in limiter.reasons.counts.items() if count}
    # Each at once, a counter with hits owed too (before, it waited its budget for a flush
    # that could not land yet: redis_timeout; and the others counted as redis_refused).
    assert set(reasons) == {"redis_down"}, reasons
    while limiter.ledger.owed_hits and loop.time() < deadline:
        await limiter.reconcile()
        await asyncio.sleep(0.05)
    assert limiter.ledger.owed_hits == 0
