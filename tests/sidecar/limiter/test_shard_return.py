"""Returning from one Redis Cluster master's outage (issue 31): the hits the failure mode
admitted on that master's keys are settled before a replica decides them from Redis alone,
as after a whole outage (docs/redis.md, "Returning from an outage"), against a real
Cluster with one replica per master (node timeout 2 s).

Two replicas share a hot key limited to 40 (a share of 20 each). Each has Redis admit 10,
then the hot key's master is SIGKILLed; each admits its share's 10 more by the failure
mode. The Cluster promotes the replica; replica A finds the slots served again while B's
probe of the dead master is held down. Before, A decided from Redis, which lacked B's 10
outage hits, and admitted 10 more: 50 of 40 in strict mode (sync: about as many, against
its bound of 42). Now A is held to its share until B has marked itself settled. The
replicas' heartbeats live on the dead master too, so after the failover A's first beat
finds B's last beat stale: A still counts two replicas until the return is settled.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
from redis.crc import key_slot

from sidecar.limiter.protocol import Check
from sidecar.limiter.redis.keys import counter_window, replicas_key
from sidecar.limiter.sync import SyncLimiter
from tests.sidecar.limiter.conftest import HOUR
from tests.support import outages
from tests.support.redis_servers import RedisCluster, fresh_prefix, replicated_cluster

__all__ = ["replicated_cluster"]  # a fixture, used by name

pytestmark = [pytest.mark.slow, pytest.mark.serial]

LIMIT = 40
BEFORE = 10
"""Hits each replica has Redis admit before the master dies."""
BOUNDS = {"strict": LIMIT, "sync": LIMIT + 2}
"""Two shares of 20 (strict); sync's bound ``L + (R - 1) * Q``, Q = floor(0.05 * 40)."""
HEARTBEAT = 1.0
"""Three intervals (3 s) outlast B's held probe: A waits for B's mark, not for the time."""
HELD = 1.2
"""Seconds B's probe of the dead master is kept failing after A found the slots back."""
WAIT = 40.0
"""Bounds each wait (a failover on a loaded machine); never a measured time."""

Limiter = outages.Limiter


def build(mode: str, url: str, prefix: str) -> Limiter:
    options: dict[str, object] = {"redis_prefix": prefix, "heartbeat_interval": HEARTBEAT, "redis_timeout": 0.5}
    return outages.build_limiter(mode, url, **options)


async def until(condition: Callable[[], object], what: str) -> None:
    await outages.until(condition, what, WAIT)


def hot_check() -> Check:
    return Check(("hot",), HOUR, LIMIT, 1)


def key_of(prefix: str, check: Check) -> str:
    return counter_window(prefix, check.key, check.unit_seconds, time.time())[0]


def owner_port(cluster: RedisCluster, key: str) -> int:
    slot = key_slot(key.encode())
    for start, end, master, *_ in cluster.alive()[0].client().execute_command("CLUSTER", "SLOTS"):
        if int(start) <= slot <= int(end):
            return int(master[1])
    raise AssertionError(f"slot {slot} not served")


async def admit(limiter: Limiter, check: Check, count: int) -> int:
    admitted = 0
    for _ in range(count):
        admitted += (await limiter.check([check], time.time())).admitted
        await asyncio.sleep(0.005)
    return admitted


async def settled(limiter: Limiter) -> bool:
    if isinstance(limiter, SyncLimiter):
        await limiter.sync_once()
        return not limiter.table.has_unflushed()
    await limiter.reconcile()
    return bool(limiter.ledger.reconciled())


async def until_settled(limiter: Limiter, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not await settled(limiter):
        assert time.monotonic() < deadline, f"never settled: {what}"
        await asyncio.sleep(0.02)


def hold_node_probe(limiter: Limiter, name: str) -> list[bool]:
    """Keep ``limiter``'s probe of master ``name`` failing while the returned flag holds True."""
    nodes = limiter.store.nodes
    assert nodes is not None
    return outages.hold_availability(nodes.node(name))


@pytest.mark.parametrize("mode", ["strict", "sync"])
async def test_a_replica_back_first_from_a_masters_outage_keeps_its_share_until_the_peer_settled(
    replicated_cluster: RedisCluster, mode: str
) -> None:
    cluster = replicated_cluster
    check = hot_check()
    prefix = fresh_prefix("h")
    port = owner_port(cluster, key_of(prefix, check))
    while owner_port(cluster, replicas_key(prefix)) != port:  # the heartbeats die with it too
        prefix = fresh_prefix("h")
    first, second = build(mode, cluster.url, prefix), build(mode, cluster.url, prefix)
    try:
        for limiter in (first, second):
            await limiter.start()
        await until(lambda: first.replicas.live == 2 and second.replicas.live == 2, "two live replicas")
        admitted = {"before": 0, "outage": 0, "returned": 0, "after": 0}
        for limiter in (first, second):
            admitted["before"] += await admit(limiter, check, BEFORE)
            await until_settled(limiter, "before the kill")
        key = key_of(prefix, check)
        victim = next(node for node in cluster.nodes if node.port == port)
        victim.client().execute_command("WAIT", 1, 5000)  # its replica holds the window's 20
        name = f"127.0.0.1:{port}"
        held = hold_node_probe(second, name)
        replica = cluster.kill_master(victim)
        for limiter in (first, second):  # each finds the master down, then admits by its share
            admitted["outage"] += await admit(limiter, check, 15)
            nodes = limiter.store.nodes
            assert nodes is not None
            await until(lambda nodes=nodes: name in nodes.down(), "the dead master found down")
        await asyncio.to_thread(cluster.wait_promoted, replica)
        first_nodes = first.store.nodes
        assert first_nodes is not None
        await until(lambda: name not in first_nodes.down(), "the first replica finds the slots served again")
        await until_settled(first, "the first replica's outage hits")
        started = time.monotonic()
        while time.monotonic() - started < HELD:  # the second still away
            admitted["returned"] += await admit(first, check, 1)
            await asyncio.sleep(0.05)
        held[0] = False
        second_nodes = second.store.nodes
        assert second_nodes is not None
        await until(lambda: name not in second_nodes.down(), "the second replica back")
        await until_settled(second, "the second replica's outage hits")
        await until(lambda: not first.replicas.holds([key]) and not second.replicas.holds([key]), "holds released")
        assert first.replicas.live == second.replicas.live == 2
        for limiter in (first, second):
            admitted["after"] += await admit(limiter, check, 10)
        await until_settled(first, "the last hits")
        total = sum(admitted.values())
        in_redis = int(cluster.client().get(key) or 0)
        print(f"{mode}: admitted {admitted}, total {total} (bound {BOUNDS[mode]}), Redis holds {in_redis}")
        assert admitted["before"] == 2 * BEFORE
        assert total <= BOUNDS[mode], admitted
        assert in_redis == total, "Redis holds exactly the admitted hits"
    finally:
        await first.close()
        await second.close()
