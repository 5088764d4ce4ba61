"""The partition rule as an operator's choice, and a clean stop handing its shares on (issue 25,
defect 9 follow-up), on a simulated clock and ``share.lua``'s Python reference.

* ``--quota-after-hold deny``: what every Envoy enforces stays within the limit whoever is
  cut, for as long as it lasts; a full outage denies once the hold ended.
* ``--quota-after-hold share``: a cut replica enforces ``ceil(limit / R)`` after the hold,
  so the sum stays within the limit + ``ceil(limit / R)`` per cut replica, and a full
  outage stays available.
* A clean stop gives its leases back: the others need not wait for the hold.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from sidecar.quota.buckets import bucket_key, bucket_of
from sidecar.quota.leases import CHUNK, QuotaLeases
from sidecar.quota.partition import AfterHold
from sidecar.quota.registry import QuotaRegistry, QuotaSettings
from tests.sidecar.quota.test_leases_sim import (
    LEASE,
    LIMIT,
    RULES,
    TTL,
    Replica,
    SimRedis,
    second,
    settle,
    settled,
)

SAFE = math.ceil(LIMIT / 3)
"""What a cut replica enforces past its hold with ``share`` (3 replicas): 67."""
HOLD = 2 * LEASE
"""A shorter hold than the default (4 leases): ``--quota-partition-hold``."""


def group_of(
    h: SimpleNamespace, redis: SimRedis, clock: object, after_hold: AfterHold, hold: float | None = HOLD
) -> list[Replica]:
    made = []
    heartbeats = SimpleNamespace(live=3)
    for name in "abc":
        leases = QuotaLeases(
            redis,  # type: ignore[arg-type]
            name,
            ttl=TTL,
            clock=clock,  # type: ignore[arg-type]
            wall=clock,  # type: ignore[arg-type]
            replicas=heartbeats,  # type: ignore[arg-type]
            hold=hold,
            after_hold=after_hold,
        )
        registry = QuotaRegistry(h.config_of(RULES), QuotaSettings(ttl=TTL), clock=clock, leases=leases)  # type: ignore[arg-type]
        made.append(Replica(name, registry, leases, registry.open(name), heartbeats))
    return made


async def cut_for(group: list[Replica], clock: object, offered: dict[str, int], seconds: int) -> list[int]:
    """``seconds`` simulated seconds; each second, what the Envoys enforce over the bound of
    ``share``: the limit + the safe capacity per replica past its hold (<= 0: within it)."""
    over = []
    for tick in range(seconds):
        await second(group, clock, offered, report=tick % 5 == 0)
        past = sum(r.leases.partition_counts().past_hold_buckets for r in group)
        over.append(sum(r.tokens() for r in group) - LIMIT - SAFE * past)
    return over


def sums_of(group: list[Replica]) -> int:
    return sum(r.tokens() for r in group)


async def test_deny_keeps_the_sum_within_the_limit_with_a_shorter_hold(h: SimpleNamespace) -> None:
    clock = h.FakeClock(1000.0)
    redis = SimRedis(clock)
    group = group_of(h, redis, clock, "deny")
    offered = {"a": 150, "b": 150, "c": 150}
    await settle(group, clock, offered, 20)
    redis.cut = {"c"}
    sums = []
    for tick in range(LEASE + HOLD + 60):
        await second(group, clock, offered, report=tick % 5 == 0)
        sums.append(sums_of(group))
    assert max(sums) <= LIMIT, sums
    assert group[2].tokens() == 0  # past its hold: nothing
    assert group[0].tokens() + group[1].tokens() >= LIMIT - 2  # handed on after the (shorter) hold


async def test_share_bounds_the_sum_by_the_limit_plus_the_safe_capacity_per_cut_replica(h: SimpleNamespace) -> None:
    clock = h.FakeClock(1000.0)
    redis = SimRedis(clock)
    group = group_of(h, redis, clock, "share")
    offered = {"a": 150, "b": 150, "c": 150}
    await settle(group, clock, offered, 20)
    redis.cut = {"c"}
    over = await cut_for(group, clock, offered, LEASE + HOLD + 60)
    assert max(over) <= 0, over
    assert group[2].tokens() == SAFE  # past its hold: ceil(limit / 3), not nothing
    assert group[0].tokens() + group[1].tokens() >= LIMIT - 2
    assert sums_of(group) == LIMIT + SAFE  # the bound is reached: 267 of 200
    # Two cut, a big one among them: at most one safe capacity over per cut replica.
    skewed = {"a": 240, "b": 30, "c": 30}
    redis.cut = set()
    await settle(group, clock, skewed, 20)
    redis.cut = {"a", "c"}
    over = await cut_for(group, clock, skewed, LEASE + HOLD + 60)
    assert max(over) <= 0, over


async def test_a_full_outage_stays_available_with_share_and_denies_with_deny(h: SimpleNamespace) -> None:
    """Redis down for everyone, skewed demand: with ``share`` each replica ends at the safe
    capacity (R x ceil(limit / R) = 201 of 200), and while some still keep a bigger grant
    within their hold the sum stays within the limit + one safe capacity per replica past
    it; with ``deny`` everything is denied once the holds ended."""
    offered = {"a": 240, "b": 30, "c": 30}
    ends: dict[str, list[int]] = {}
    for policy in ("share", "deny"):
        clock = h.FakeClock(1000.0)
        redis = SimRedis(clock)
        group = group_of(h, redis, clock, policy)  # type: ignore[arg-type]
        await settle(group, clock, offered, 20)
        redis.down = True
        over = await cut_for(group, clock, offered, LEASE + HOLD + 60)
        assert max(over) <= 0, over
        ends[policy] = [r.tokens() for r in group]
    assert ends == {"share": [SAFE, SAFE, SAFE], "deny": [0, 0, 0]}


async def test_a_bucket_past_its_hold_is_not_looked_at_again_every_tick(h: SimpleNamespace) -> None:
    """Once its hold ended during an outage, nothing changes for a bucket until Redis answers:
    it leaves the timers (a past time put it back in every tick's recheck)."""
    clock = h.FakeClock(1000.0)
    redis = SimRedis(clock)
    group = group_of(h, redis, clock, "deny")
    await settle(group, clock, {"a": 150, "b": 150, "c": 150}, 20)
    redis.down = True
    await cut_for(group, clock, {"a": 150, "b": 150, "c": 150}, LEASE + HOLD + 10)
    assert [len(r.leases.timers) for r in group] == [0, 0, 0]
    assert not any(r.leases.recheck for r in group)


async def test_holds_and_ended_holds_are_counted_and_exposed(h: SimpleNamespace) -> None:
    clock = h.FakeClock(1000.0)
    redis = SimRedis(clock)
    group = group_of(h, redis, clock, "share")
    offered = {"a": 150, "b": 150, "c": 150}
    await settle(group, clock, offered, 20)
    redis.cut = {"c"}
    await cut_for(group, clock, offered, 30)  # c's record is stale: held for it
    survivor = group[0].leases.partition_counts()
    assert (survivor.held_buckets, survivor.holds_started) == (1, 1)
    await cut_for(group, clock, offered, LEASE + HOLD)
    survivor, cut = group[0].leases.partition_counts(), group[2].leases.partition_counts()
    assert survivor.held_buckets == 0  # the hold ended: handed on
    assert (cut.policy, cut.past_hold_buckets, cut.holds_ended) == ("share", 1, 1)
    samples = {
        (sample.name, sample.labels.get("policy", "")): sample.value
        for family in group[2].registry.frozen_stats().collect()
        for sample in family.samples
    }
    assert samples[("ratelimit_sidecar_quota_past_hold_buckets", "share")] == 1
    assert samples[("ratelimit_sidecar_quota_holds_ended_total", "share")] == 1
    assert samples[("ratelimit_sidecar_quota_held_buckets", "")] == 0
    redis.cut = set()
    await cut_for(group, clock, offered, 5)
    assert group[2].leases.partition_counts().past_hold_buckets == 0  # Redis answers again


async def test_a_clean_stop_hands_its_shares_on_at_once(h: SimpleNamespace) -> None:
    """c stops cleanly: its stream closes (its bucket kept in Redis), then its leases close
    and give every lease back; a and b get the whole limit on their next computation."""
    clock = h.FakeClock(1000.0)
    redis = SimRedis(clock)
    group = group_of(h, redis, clock, "deny")
    offered = {"a": 150, "b": 150, "c": 150}
    await settle(group, clock, offered, 20)
    stopped = group[2]
    stopped.registry.close(stopped.stream)
    await settled(stopped.registry.settled())
    assert len(stopped.leases.kept) == 1 and not stopped.leases.buckets
    await stopped.leases.close()
    stopped.alive = False
    assert stopped.leases.partition_counts().handed_on == 1
    (bucket,) = redis.buckets.values()
    assert "c" not in bucket.entries
    await cut_for(group[:2], clock, offered, 3)
    assert group[0].tokens() + group[1].tokens() >= LIMIT - 2  # not after the hold


async def test_the_hand_on_is_chunked_and_stops_at_its_deadline(h: SimpleNamespace) -> None:
    clock = h.FakeClock(1000.0)
    redis = SimRedis(clock)
    sizes: list[int] = []
    run = redis.run

    async def counted(calls):  # type: ignore[no-untyped-def]
        sizes.append(len(calls))
        clock.advance(1.0)  # each pipeline takes a second of the drain
        return await run(calls)

    redis.run = counted  # type: ignore[method-assign]
    leases = QuotaLeases(redis, "a", ttl=TTL, clock=clock, wall=clock)  # type: ignore[arg-type]
    leases.kept.update((bucket_key(bucket_of("q", [("user", str(i))])), 1e9) for i in range(3 * CHUNK))
    given = await leases.hand_on(deadline=clock() + 1.5)
    assert sizes == [CHUNK, CHUNK]  # a chunk per pipeline; the third would start past the deadline
    assert given == 2 * CHUNK


TRACES = [
    # (policy, cut, offered a/b/c): tokens before the cut, then (second after the cut, tokens) at each change
    ("deny", "c", (150, 150, 150), [67, 67, 66], [(75, [67, 67, 0]), (81, [100, 100, 0])]),
    ("share", "c", (150, 150, 150), [67, 67, 66], [(75, [67, 67, 67]), (81, [100, 100, 67])]),
    (
        "deny",
        "ac",
        (240, 30, 30),
        [134, 33, 33],
        [(71, [134, 33, 0]), (75, [0, 33, 0]), (76, [0, 44, 0]), (81, [0, 116, 0])],
    ),
    (
        "share",
        "ac",
        (240, 30, 30),
        [134, 33, 33],
        [(71, [134, 33, 67]), (75, [67, 33, 67]), (76, [67, 44, 67]), (81, [67, 116, 67])],
    ),
    ("deny", "abc", (240, 30, 30), [134, 33, 33], [(71, [134, 0, 0]), (75, [0, 0, 0])]),
    ("share", "abc", (240, 30, 30), [134, 33, 33], [(71, [134, 67, 67]), (75, [67, 67, 67])]),
]


@pytest.mark.parametrize("case", TRACES, ids=lambda case: f"{case[0]}-{case[1]}")
async def test_the_traces_docs_quota_md_shows(
    h: SimpleNamespace, case: tuple[AfterHold, str, tuple[int, int, int], list[int], list[tuple[int, list[int]]]]
) -> None:
    """docs/quota.md's table of what each replica enforces after a cut, with the default hold
    (4 leases: 64 s at --quota-ttl 6), for both policies (``pytest -s`` prints each trace)."""
    policy, cut, offered, before, changes = case
    clock = h.FakeClock(1000.0)
    redis = SimRedis(clock)
    group = group_of(h, redis, clock, policy, hold=None)
    load = dict(zip("abc", offered, strict=True))
    await settle(group, clock, load, 20)
    assert [r.tokens() for r in group] == before
    redis.cut = set(cut)
    seen, last = [], before
    for tick in range(1, 301):
        await second(group, clock, load, report=(tick - 1) % 5 == 0)
        now = [r.tokens() for r in group]
        if now != last:
            seen.append((tick, now))
            last = now
    print(policy, cut, before, seen)
    assert seen == changes
