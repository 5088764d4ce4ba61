"""Leases across replicas on a simulated clock and a simulated Redis (issue 16): a replica
that dies, Redis away, the safe capacity.

Several replicas' real :class:`QuotaLeases` share one bucket through ``shares.step`` (the
reference of ``share.lua``). The invariant checked every simulated second: what the live
Envoys are assigned, plus what a dead replica's unexpired lease still holds, never exceeds
the limit (no double allocation), including while Redis is down and the live count drops.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace

from sidecar.quota.assignments import Kind
from sidecar.quota.buckets import bucket_key, bucket_of
from sidecar.quota.leases import QuotaLeases
from sidecar.quota.redis_shares import SharesUnavailable
from sidecar.quota.registry import QuotaRegistry, QuotaSettings
from sidecar.quota.shares import Bucket, Call, Reply, step
from sidecar.quota.stream import Stream

RULES = """
domain: q
descriptors:
  - key: user
    rate_limit: {unit: second, requests_per_unit: 200}
"""
BUCKET = bucket_of("q", [("user", "shared")])
KEY = bucket_key(BUCKET)
LIMIT = 200
TTL = 6
LEASE = TTL + 10
HOLD = 4 * LEASE
"""How long past its end Redis keeps a silent replica's lease reserved (the default)."""


async def settled(result: object) -> None:
    """Await what a registry call returned, if anything (its methods may be sync or chunked)."""
    if inspect.isawaitable(result):
        await result


@dataclass
class SimRedis:
    """``share.lua``'s Python reference on the simulated clock; ``down`` refuses every call."""

    clock: object
    buckets: dict[str, Bucket] = field(default_factory=dict)
    down: bool = False
    cut: set[str] = field(default_factory=set)
    """Replicas partitioned from Redis: their calls fail, the others' go through."""

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def run(self, calls: Sequence[tuple[list[str], Call]]) -> list[Reply]:
        if self.down or any(call.replica in self.cut for _, call in calls):
            raise SharesUnavailable("simulated outage")
        now = int(self.clock() * 1000)  # type: ignore[operator]
        return [step(self.buckets.setdefault(keys[0], Bucket()), call, now) for keys, call in calls]


@dataclass
class Replica:
    name: str
    registry: QuotaRegistry
    leases: QuotaLeases
    stream: Stream
    heartbeats: SimpleNamespace
    alive: bool = True

    def tokens(self) -> int:
        assignment = self.stream.buckets[KEY].assignment
        return assignment.max_tokens if assignment.kind is Kind.TOKEN_BUCKET else 0

    def lease_in_redis(self, redis: SimRedis, now: float) -> int:
        """What Redis still reserves for this replica (its lease, until it and its hold end)."""
        (bucket,) = redis.buckets.values()
        entry = bucket.entries.get(self.name)
        if entry is None or entry.held_until + HOLD * 1000 <= now * 1000:
            return 0
        return entry.held


def replicas(h: SimpleNamespace, redis: SimRedis, clock: object, names: str) -> list[Replica]:
    made = []
    heartbeats = SimpleNamespace(live=len(names))
    for name in names:
        leases = QuotaLeases(redis, name, ttl=TTL, clock=clock, wall=clock, replicas=heartbeats)  # type: ignore[arg-type]
        registry = QuotaRegistry(h.config_of(RULES), QuotaSettings(ttl=TTL), clock=clock, leases=leases)  # type: ignore[arg-type]
        made.append(Replica(name, registry, leases, registry.open(name), heartbeats))
    return made


async def second(group: list[Replica], clock: object, offered: dict[str, int], report: bool) -> None:
    """One simulated second: the live replicas' Envoys report (every 5 s) and their sidecars sync."""
    clock.advance(1.0)  # type: ignore[attr-defined]
    for replica in group:
        if not replica.alive:
            continue
        if report:
            load = offered[replica.name]
            tokens = replica.tokens() if replica.stream.buckets else load
            usage = (BUCKET, min(load, tokens) * 5, max(0, load - tokens) * 5)
            await settled(replica.registry.report(replica.stream, "q", iter([usage])))
        await replica.leases.sync()


def in_force(group: list[Replica], redis: SimRedis, now: float) -> int:
    """Units the live Envoys enforce + what Redis still reserves for the dead (their Envoys may
    enforce it until it ends: the sidecar died, its Envoy did not)."""
    return sum(r.tokens() if r.alive else r.lease_in_redis(redis, now) for r in group)


async def settle(group: list[Replica], clock: object, offered: dict[str, int], seconds: int) -> None:
    for tick in range(seconds):
        await second(group, clock, offered, report=tick % 5 == 0)


async def test_safe_capacity_counts_a_dead_replicas_unexpired_lease(h: SimpleNamespace) -> None:
    """The big replica dies, then Redis goes away: the survivors' safe capacity must leave the
    dead replica's lease alone until it ends (``ceil(limit / live)`` alone hands it out again)."""
    clock = h.FakeClock(1000.0)
    redis = SimRedis(clock)
    group = replicas(h, redis, clock, "abc")
    offered = {"a": 240, "b": 30, "c": 30}
    await settle(group, clock, offered, 20)
    assert group[0].tokens() > 120  # a holds the big share
    group[0].alive = False  # a's sidecar dies; its Envoy enforces its lease until the TTL
    group[0].heartbeats.live = 2
    await second(group, clock, offered, report=False)
    redis.down = True
    for _ in range(LEASE + 5):
        await second(group, clock, offered, report=True)
        assert in_force(group, redis, clock()) <= LIMIT, [r.tokens() for r in group[1:]]


async def test_safe_capacity_keeps_the_live_count_of_the_last_lease_period(h: SimpleNamespace) -> None:
    """Right after a pause every heartbeat is late and the live count reads 1 for a moment. A
    bucket on safe capacity that never heard from Redis (it came during the outage) must not
    take the whole limit then: the live count is the highest seen within the last lease."""
    clock = h.FakeClock(1000.0)
    redis = SimRedis(clock, down=True)
    group = replicas(h, redis, clock, "abc")
    offered = {"a": 80, "b": 80, "c": 80}
    await second(group, clock, offered, report=True)
    assert [r.tokens() for r in group] == [67, 67, 67]  # ceil(200 / 3)
    group[0].heartbeats.live = 1  # the pause is over for the heartbeats, not yet for the shares
    for _ in range(3):
        await second(group, clock, offered, report=False)
        assert sum(r.tokens() for r in group) <= LIMIT + len(group), [r.tokens() for r in group]
    clock.advance(LEASE)  # a lease later, the count is believed
    await second(group, clock, offered, report=False)
    assert [r.tokens() for r in group] == [200, 200, 200]


async def test_a_closed_stream_does_not_give_its_lease_back(h: SimpleNamespace) -> None:
    """A replica's sidecar is killed: its stream closes first (the Envoy dies, or only the
    connection). Its Envoy may enforce the last assignment until the TTL, so the lease is left
    to run out in Redis; the survivors get it only once it has ended."""
    clock = h.FakeClock(1000.0)
    redis = SimRedis(clock)
    group = replicas(h, redis, clock, "abc")
    offered = {"a": 110, "b": 110, "c": 110}
    await settle(group, clock, offered, 20)
    dead = group[2]
    held = dead.lease_in_redis(redis, clock())
    (bucket,) = redis.buckets.values()
    ends = bucket.entries["c"].held_until / 1000
    assert held > 60
    dead.registry.close(dead.stream)  # the stream closes, then the process dies
    await settled(getattr(dead.registry, "settled", lambda: None)())
    await dead.leases.sync()
    dead.alive = False
    offered = {"a": 165, "b": 165, "c": 0}
    for tick in range(LEASE + HOLD + 15):
        await second(group, clock, offered, report=tick % 5 == 0)
        if clock() < ends + HOLD:
            assert dead.lease_in_redis(redis, clock()) == held
            assert group[0].tokens() + group[1].tokens() <= LIMIT - held
    assert group[0].tokens() + group[1].tokens() >= LIMIT - 2  # handed on once it ended


async def test_an_abandoned_bucket_gives_its_lease_back(h: SimpleNamespace) -> None:
    """Envoy erased an abandoned bucket: its lease goes back at once."""
    clock = h.FakeClock(1000.0)
    redis = SimRedis(clock)
    group = replicas(h, redis, clock, "ab")
    await settle(group, clock, {"a": 110, "b": 110}, 10)
    quiet = group[1]
    clock.advance(QuotaSettings().idle_abandon)
    await settled(quiet.registry.maintain(quiet.stream))
    await quiet.leases.sync()
    assert quiet.lease_in_redis(redis, clock()) == 0


async def test_after_an_outage_the_first_call_publishes_the_last_demand(h: SimpleNamespace) -> None:
    """Redis away longer than a demand stays fresh (15 s): the first call after it publishes
    the last known demand, not a poll, or the small replicas would count as asking nothing and
    be starved until their next report."""
    clock = h.FakeClock(1000.0)
    redis = SimRedis(clock)
    group = replicas(h, redis, clock, "abc")
    offered = {"a": 240, "b": 30, "c": 30}
    await settle(group, clock, offered, 20)
    redis.down = True
    for _ in range(18):
        await second(group, clock, offered, report=False)
    redis.down = False
    for _ in range(2):
        await second(group, clock, offered, report=False)
    tokens = [r.tokens() for r in group]
    # Without it every record is stale: all count as asking nothing and share it evenly (50 each).
    assert tokens[0] >= 120 and tokens[1] >= 33 and tokens[2] >= 33 and sum(tokens) <= LIMIT, tokens


async def test_metrics_show_each_replicas_share_and_demand_per_rule(h: SimpleNamespace) -> None:
    clock = h.FakeClock(1000.0)
    redis = SimRedis(clock)
    group = replicas(h, redis, clock, "abc")
    await settle(group, clock, {"a": 240, "b": 30, "c": 30}, 20)
    samples = {
        (family.name, sample.labels["key"]): sample.value
        for family in group[0].registry.frozen_stats().collect()
        if family.name.startswith("ratelimit_sidecar_quota_share")
        for sample in family.samples
    }
    assert samples == {
        ("ratelimit_sidecar_quota_share", "user"): group[0].tokens(),
        ("ratelimit_sidecar_quota_share_demand", "user"): 264,  # 240/s, +10%
    }
    redis.down = True
    for _ in range(LEASE):
        await second(group, clock, {"a": 240, "b": 30, "c": 30}, report=False)
    frozen = group[0].registry.frozen_stats()
    assert frozen.gauges.shares == {("q", "q.user"): (group[0].tokens(), 264)}  # the safe capacity now


async def test_one_replica_cut_from_redis_never_lifts_the_sum_above_the_limit(h: SimpleNamespace) -> None:
    """Issue 25, defect 9: c is partitioned from Redis, a and b are not. The survivors cannot
    tell c dead from cut: they keep c's last lease reserved for the hold, while c enforces
    no more than that lease, then nothing. Whatever every Envoy enforces stays within the
    limit for as long as the partition lasts (before: a and b took all 200 once c's record
    went stale, while c enforced its safe capacity of 67)."""
    clock = h.FakeClock(1000.0)
    redis = SimRedis(clock)
    group = replicas(h, redis, clock, "abc")
    offered = {"a": 150, "b": 150, "c": 150}
    await settle(group, clock, offered, 20)
    redis.cut = {"c"}
    worst = 0
    for tick in range(500):
        await second(group, clock, offered, report=tick % 5 == 0)
        worst = max(worst, sum(r.tokens() for r in group))
        assert worst <= LIMIT, (tick, [r.tokens() for r in group])
    assert group[0].tokens() + group[1].tokens() >= LIMIT - 2  # handed on once the hold ended
    assert group[2].tokens() == 0


async def test_two_replicas_cut_from_redis_never_lift_the_sum_above_the_limit(h: SimpleNamespace) -> None:
    clock = h.FakeClock(1000.0)
    redis = SimRedis(clock)
    group = replicas(h, redis, clock, "abc")
    offered = {"a": 240, "b": 30, "c": 30}
    await settle(group, clock, offered, 20)
    redis.cut = {"a", "c"}
    for tick in range(500):
        await second(group, clock, offered, report=tick % 5 == 0)
        assert sum(r.tokens() for r in group) <= LIMIT, (tick, [r.tokens() for r in group])
