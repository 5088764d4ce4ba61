"""The ``cluster_failover`` scenario's store for ``loadtest/quota_accuracy.py``: a Redis Cluster
whose master holding a bucket's shares is SIGKILLed mid-run.

Why a module of its own: the scenario needs what the single redis-server of the other
scenarios does not (six Cluster nodes, which master serves a bucket's share keys, a kill
and a wait for the promotion); the Cluster itself and the kill are the store-faults
area's (:class:`~loadtest.reliability_harness.store_topology.ClusterStore`,
:class:`~loadtest.reliability_harness.store_topology.Fault`), reused as they are.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from redis.crc import key_slot

from loadtest.reliability_harness.store_topology import ClusterStore, Fault
from sidecar.quota.buckets import bucket_key
from sidecar.quota.redis_shares import share_keys
from stack import redis as stack_redis
from stack.processes import ProcessGroup
from stack.sidecar import SidecarProcess

PREFIX = "rls"
"""The sidecars' ``--redis-prefix`` (its default): the share keys begin with it."""
CLUSTER_SCENARIOS = ("cluster_failover",)
BAND = 0.05
"""Back within the limit: a second's total within 5 % of it, either way."""


def share_key_names(client: str, tier: str = "shared", prefix: str = PREFIX) -> list[str]:
    """The ``share.lua`` keys a sidecar uses for the bucket Envoy builds from ``x-tier: tier``
    and ``x-client: client`` (``stack/quota_envoy.py``'s bucket id: domain, entry.0, entry.1)."""
    bucket = {"domain": "quota", "entry.0.tier": tier, "entry.1.client": client}
    return share_keys(prefix, bucket_key(bucket), -1)


def share_slot(client: str, tier: str = "shared", prefix: str = PREFIX) -> int:
    """The Cluster slot of that bucket's share keys (one slot: they carry one hash tag)."""
    slots = {key_slot(key.encode()) for key in share_key_names(client, tier, prefix)}
    if len(slots) != 1:
        raise AssertionError(f"the share keys of {client!r} span slots {sorted(slots)}")
    return int(slots.pop())


def start_cluster(group: ProcessGroup, directory: Path) -> ClusterStore:
    """Six nodes, three masters with a replica each, node timeout 2 s (the store-faults
    area's Cluster), then ``cluster-require-full-coverage no`` on every node: the masters
    still up go on answering while the dead one's slots wait for its replica."""
    store = ClusterStore.start(group, directory / "cluster")
    for port in store.ports:
        with stack_redis.admin(port) as client:
            client.config_set("cluster-require-full-coverage", "no")
    return store


@dataclass
class Failover:
    """What the kill did: the master and its heir, when it was killed and promoted, and
    whether the bucket's share keys were on the killed master (the point of the scenario)."""

    victim: int
    heir: int
    keys_on_victim: bool
    promoted_after: float | None

    def note(self) -> str:
        promoted = "not within 20 s" if self.promoted_after is None else f"{self.promoted_after:.1f} s"
        keys = "held" if self.keys_on_victim else "NOT held"
        return f"killed master :{self.victim} ({keys} the share keys), replica :{self.heir} promoted after {promoted}"


async def kill_share_master(store: ClusterStore, client: str) -> Failover:
    """SIGKILL the master serving ``client``'s share keys and wait (in a thread: the load
    goes on) until its replica is master."""
    fault = Fault("cluster_kill", store, share_slot(client))
    with stack_redis.admin(fault.victim) as node:
        held = bool(node.exists(share_key_names(client)[0]))
    killed = time.perf_counter()
    fault.begin()
    promoted = await asyncio.to_thread(fault.wait)
    return Failover(fault.victim, fault.heir, held, None if promoted is None else promoted - killed)


@dataclass(frozen=True)
class Recovery:
    """The seconds from the kill on: when the total was back within :data:`BAND` of the limit
    for good (``0 s``: it never left; ``no``: not by the end), its lowest and highest second."""

    back: str
    lowest: int
    highest: int


def outage_seen(sidecars: Sequence[SidecarProcess], victim: int) -> str:
    """What each sidecar logged of the fault: share batches that found Redis away
    (``quota_shares_unavailable``), the killed master marked down, and any other master
    marked down (``redis_node_unavailable``: none should be). Without the first two the run
    would show nothing: a fault that never reached the leases."""
    away, down, others = [], [], []
    for sidecar in sidecars:
        nodes = []
        for line in sidecar.log_text().splitlines():
            if "redis_node_unavailable" in line:
                with contextlib.suppress(ValueError):
                    nodes.append(str(json.loads(line).get("node", "")))
        away.append(str(sidecar.log_text().count("quota_shares_unavailable")))
        down.append(str(sum(node.endswith(f":{victim}") for node in nodes)))
        others.append(str(sum(not node.endswith(f":{victim}") for node in nodes)))
    return (
        f"sidecars logged shares unavailable {'/'.join(away)}, the killed master down {'/'.join(down)},"
        f" another master down {'/'.join(others)} times"
    )


def recovery(totals: Mapping[int, int], limit: int, killed_at: int) -> Recovery:
    """:class:`Recovery` of the per-second ``totals`` (the last, partial second left out by the caller)."""
    after = {second: total for second, total in totals.items() if second >= killed_at}
    outside = [second for second, total in after.items() if abs(total - limit) > BAND * limit]
    lowest, highest = min(after.values(), default=0), max(after.values(), default=0)
    if not outside:
        return Recovery("0 s (never left)", lowest, highest)
    if max(outside) == max(after):
        return Recovery("no", lowest, highest)
    return Recovery(f"{max(outside) + 1 - killed_at} s", lowest, highest)
