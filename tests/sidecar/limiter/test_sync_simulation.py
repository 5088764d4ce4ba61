"""The sync algorithm on a simulated Redis: deterministic interleavings of replicas.

Each replica is a real SyncLimiter; the store is an in-memory stand-in that applies
the same admission rule as the Lua script. The tests interleave requests and syncs
of several replicas in random orders and check the accuracy model of design.md
section 5: the overshoot bound, zero false rejections, and counters equal to
admitted hits.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Iterable, Mapping, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.limiter.protocol import Check, Role, decide
from sidecar.limiter.redis.availability import RedisUnavailable
from sidecar.limiter.redis.corrupt import CorruptKeys
from sidecar.limiter.sync import SyncLimiter

NOW = 1_000_000.25
KEY = ("rule", "value")


class SimulatedStore:
    """Counts in a dict; ``decide`` and ``flush`` behave like the Redis scripts."""

    replicas_key = "rls:replicas"
    background_timeout = 1.0
    """As the real store's least: how long a request at ``--max-counters`` waits for flushes to make room."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.markers: dict[tuple[str, str], int] = {}
        self.lose_next_flush_reply = False
        self.available = True
        self.round_trips_request_path = 0
        self.round_trips_background = 0
        self.corrupt = CorruptKeys()
        """Keys holding no counter: never any here (the real store's registry, empty)."""

    async def decide(
        self,
        keys: Sequence[str],
        checks: Sequence[Check],
        expire_ats: Sequence[int],
        admit_all: bool,
        pending: Mapping[str, tuple[int, int]] | None = None,
        *,
        request_path: bool = True,
    ) -> tuple[bool, list[int], dict[str, int]]:
        self._round_trip(request_path)
        admitted, counts = self._script(keys, checks, admit_all)
        return admitted, counts, {}

    async def decide_batch(
        self, requests: Sequence[tuple[Sequence[str], Sequence[Check], Sequence[int]]], admit_all: bool
    ) -> list[list[int]]:
        self._round_trip(True)
        return [self._script(keys, checks, admit_all)[1] for keys, checks, _ in requests]

    def _script(self, keys: Sequence[str], checks: Sequence[Check], admit_all: bool) -> tuple[bool, list[int]]:
        """What decide.lua does: would-be counts, the shared rule, then record."""
        seen: dict[str, int] = {}
        counts = []
        for key, check in zip(keys, checks, strict=True):
            before = seen.get(key, self.counts.get(key, 0))
            seen[key] = before + check.hits
            counts.append(before + check.hits)
        admitted, _, consume = decide(checks, counts, [check.limit for check in checks], admit_all)
        if admitted:
            for key, check, spend in zip(keys, checks, consume, strict=True):
                if spend:
                    self.counts[key] = self.counts.get(key, 0) + check.hits
        return admitted, counts

    async def flush(
        self,
        adds: Mapping[str, tuple[int, int]],
        reads: Sequence[str],
        *,
        once: tuple[str, int] | None = None,
        live_since: float | None = None,
        bans: Mapping[str, int] | None = None,
    ) -> dict[str, int]:
        """INCRBY each add once per (owner, sequence), as flush_once.lua does; bans are
        ``SET NX`` (the first ban's end stays).

        Membership is fixed (:class:`FixedReplicas`), so ``live_since`` reads nothing."""
        self._round_trip(False)
        for key, until in (bans or {}).items():
            self.counts.setdefault(key, until)
        for key, (hits, _) in adds.items():
            marker = (key, once[0] if once else "")
            if once is None or self.markers.get(marker, 0) < once[1]:
                self.counts[key] = self.counts.get(key, 0) + hits
                if once is not None:
                    self.markers[marker] = once[1]
        if self.lose_next_flush_reply:
            self.lose_next_flush_reply = False
            raise RedisUnavailable("reply lost after the flush landed")
        return {key: self.counts.get(key, 0) for key in [*adds, *reads]}

    def _round_trip(self, request_path: bool) -> None:
        if not self.available:
            raise RedisUnavailable("simulated outage")
        if request_path:
            self.round_trips_request_path += 1
        else:
            self.round_trips_background += 1

    async def start(self) -> None:
        """Nothing to connect."""

    async def close(self) -> None:
        """Nothing to release."""


class FixedReplicas:
    """Replica membership with a fixed live count."""

    alive_since = 0.0
    returning = False
    """A simulated Redis never goes away."""

    def __init__(self, live: int) -> None:
        self.live = live
        self.replica_id = f"replica-{id(self)}"

    def observe(self, live: int) -> None:
        """The count is fixed; a simulated store never reports another."""

    def follow_outages(self, settled: Callable[[], bool], *, shards: bool = False) -> None:
        """A simulated Redis never goes away."""

    def holds(self, keys: Iterable[str]) -> bool:
        """No Cluster master returns in a simulation."""
        return False

    async def start(self) -> None:
        """No heartbeats in a simulation."""

    async def close(self) -> None:
        """No heartbeats in a simulation."""


def cluster(replicas: int, store: SimulatedStore, **options: object) -> list[SyncLimiter]:
    return [
        SyncLimiter(store, FixedReplicas(replicas), clock=lambda: NOW, **options)  # type: ignore[arg-type]
        for _ in range(replicas)
    ]


def check(limit: int, hits: int = 1, role: Role = Role.ENFORCED) -> Check:
    return Check(KEY, 1, limit, hits, role)


async def drive(
    limiters: list[SyncLimiter], schedule: list[tuple[int, str]], limit: int, prompt_flush: bool = False
) -> dict[str, int]:
    """Run a schedule of (replica, "hit"|"sync"); return admitted, false rejections.

    ``prompt_flush`` flushes as soon as a replica wakes its flusher (a fast Redis);
    otherwise flushes happen only where the schedule says (a slow one).
    """
    admitted = false_rejections = 0
    for replica, action in schedule:
        limiter = limiters[replica]
        if action == "sync":
            await limiter.sync_once()
            continue
        decision = await limiter.check([check(limit)], NOW)
        if decision.admitted:
            admitted += 1
        elif admitted + 1 <= limit:
            false_rejections += 1
        if prompt_flush and limiter._wake.is_set():
            limiter._wake.clear()
            await limiter.sync_once()
    for limiter in limiters:
        await limiter.sync_once()
    return {"admitted": admitted, "false_rejections": false_rejections}


def only_counter(store: SimulatedStore) -> int:
    return sum(store.counts.values())


schedules = st.lists(
    st.tuples(st.integers(0, 3), st.sampled_from(["hit", "hit", "hit", "sync"])), min_size=1, max_size=400
)


@settings(max_examples=200, deadline=None)
@given(
    schedule=schedules,
    limit=st.integers(1, 300),
    replicas=st.integers(1, 4),
    max_overshoot=st.sampled_from([0.0, 0.01, 0.05, 0.2]),
    prompt_flush=st.booleans(),
)
def test_overshoot_stays_within_the_proven_bound(
    schedule: list[tuple[int, str]], limit: int, replicas: int, max_overshoot: float, prompt_flush: bool
) -> None:
    store = SimulatedStore()
    limiters = cluster(replicas, store, max_overshoot=max_overshoot)
    schedule = [(replica % replicas, action) for replica, action in schedule]
    result = asyncio.run(drive(limiters, schedule, limit, prompt_flush))
    bound = (replicas - 1) * limiters[0].blind_cap(limit, replicas)
    assert bound <= max_overshoot * limit
    assert result["admitted"] <= limit + bound
    assert result["false_rejections"] == 0
    assert only_counter(store) == result["admitted"], "the Redis counter equals admitted hits"


@settings(max_examples=60, deadline=None)
@given(schedule=schedules, limit=st.integers(1, 200))
def test_one_replica_is_exact(schedule: list[tuple[int, str]], limit: int) -> None:
    store = SimulatedStore()
    limiters = cluster(1, store)
    schedule = [(0, action) for _, action in schedule]
    result = asyncio.run(drive(limiters, schedule, limit))
    hits = sum(1 for _, action in schedule if action == "hit")
    assert result["admitted"] == min(hits, limit)


def test_balanced_load_far_below_the_limit_never_touches_redis_on_the_request_path() -> None:
    store = SimulatedStore()
    limiters = cluster(4, store)
    schedule = [(index % 4, "hit") if index % 10 else (index % 4, "sync") for index in range(400)]
    result = asyncio.run(drive(limiters, schedule, 1_000, prompt_flush=True))
    assert result["admitted"] == sum(1 for _, action in schedule if action == "hit")
    assert store.round_trips_request_path == 0


def test_near_the_limit_decisions_escalate_and_are_exact() -> None:
    store = SimulatedStore()
    limiters = cluster(4, store)
    schedule = [(index % 4, "hit") for index in range(300)]
    result = asyncio.run(drive(limiters, schedule, 100))
    assert store.round_trips_request_path > 0
    assert result["false_rejections"] == 0
    assert result["admitted"] <= 100 + 3 * limiters[0].blind_cap(100, 4)


def test_known_over_limit_counters_are_rejected_without_redis() -> None:
    store = SimulatedStore()
    (limiter,) = cluster(1, store)

    async def scenario() -> None:
        for _ in range(5):
            await limiter.check([check(5)], NOW)
        await limiter.sync_once()
        before = store.round_trips_request_path
        for _ in range(50):
            assert not (await limiter.check([check(5)], NOW)).admitted
        assert store.round_trips_request_path == before

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("mode", "expected"),
    [("open", 10), ("closed", 0), ("local", math.ceil(100 / 4))],
)
def test_failure_modes_while_redis_is_down(mode: str, expected: int) -> None:
    store = SimulatedStore()
    limiters = cluster(4, store, failure_mode=mode)
    store.available = False

    async def scenario() -> int:
        admitted = 0
        for _ in range(10 if mode == "open" else 40):
            decision = await limiters[0].check([check(100, hits=1)], NOW)
            admitted += decision.admitted
        return admitted

    # Force the decision off the local path: a tiny blind cap makes every hit escalate.
    for limiter in limiters:
        limiter.max_overshoot = 0.0
    admitted = asyncio.run(scenario())
    assert admitted == expected


def test_hits_admitted_during_an_outage_are_reconciled_when_redis_returns() -> None:
    store = SimulatedStore()
    (limiter,) = cluster(1, store)

    async def scenario() -> None:
        for _ in range(7):
            assert (await limiter.check([check(100)], NOW)).admitted
        store.available = False
        await limiter.sync_once()
        assert only_counter(store) == 0
        store.available = True
        await limiter.sync_once()

    asyncio.run(scenario())
    assert only_counter(store) == 7


def test_rejected_requests_consume_nothing_all_or_nothing() -> None:
    store = SimulatedStore()
    (limiter,) = cluster(1, store)
    other = ("rule", "other")

    async def scenario() -> None:
        await limiter.check([check(1)], NOW)
        decision = await limiter.check([Check(other, 1, 10, 1), check(1)], NOW)
        assert not decision.admitted
        await limiter.sync_once()

    asyncio.run(scenario())
    assert only_counter(store) == 1


class SlowStore(SimulatedStore):
    """Answers escalations only after ``release`` is set: every escalation times out."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()

    async def decide_batch(
        self, requests: Sequence[tuple[Sequence[str], Sequence[Check], Sequence[int]]], admit_all: bool
    ) -> list[list[int]]:
        await self.release.wait()
        return await super().decide_batch(requests, admit_all)


@pytest.mark.parametrize("mode", ["open", "closed", "local"])
def test_late_escalation_answers_leave_every_admitted_hit_counted_exactly_once(mode: str) -> None:
    store = SlowStore()
    (limiter,) = cluster(1, store, failure_mode=mode, max_overshoot=0.0, redis_timeout=0.001)
    limiter.replicas.live = 2  # type: ignore[attr-defined]  # a peer exists: every hit escalates (Q = 0)

    async def scenario() -> int:
        admitted = 0
        for _ in range(6):
            admitted += (await limiter.check([check(100)], NOW)).admitted
        store.release.set()
        for _ in range(3):
            await asyncio.sleep(0)
        await limiter.sync_once()
        return admitted

    admitted = asyncio.run(scenario())
    assert limiter.batcher.late_answers == 6
    assert only_counter(store) == admitted


def test_a_flush_whose_reply_was_lost_is_retried_without_counting_twice() -> None:
    store = SimulatedStore()
    (limiter,) = cluster(1, store)

    async def scenario() -> None:
        for _ in range(4):
            await limiter.check([check(100)], NOW)
        store.lose_next_flush_reply = True
        await limiter.sync_once()  # landed in Redis, but the replica never heard
        assert only_counter(store) == 4
        await limiter.check([check(100)], NOW)
        await limiter.sync_once()  # the same batch again: a no-op in Redis
        await limiter.sync_once()  # then the hit admitted since
        assert only_counter(store) == 5

    asyncio.run(scenario())


def test_a_flood_of_unique_keys_stays_under_the_cap_and_loses_no_hit() -> None:
    store = SimulatedStore()
    (limiter,) = cluster(1, store, max_counters=50)

    async def scenario() -> None:
        for index in range(500):
            assert (await limiter.check([Check(("rule", f"user-{index}"), 1, 10, 1)], NOW)).admitted
            if index % 20 == 19:
                await limiter.sync_once()
            assert limiter.live_counters <= 50 + 20  # counters with unflushed hits are never evicted
        await limiter.sync_once()

    asyncio.run(scenario())
    assert limiter.evictions > 0
    assert only_counter(store) == 500


def test_a_request_of_many_new_keys_past_the_cap_loses_none_of_its_hits() -> None:
    """Eviction runs while a request creates its counters: it must not take the counters
    that request is about to spend on (or they would never be flushed)."""
    store = SimulatedStore()
    (limiter,) = cluster(1, store, max_counters=50)

    async def scenario() -> None:
        for batch in range(2):
            checks = [Check(("rule", f"batch-{batch}-{index}"), 1, 10, 1) for index in range(64)]
            assert (await limiter.check(checks, NOW)).admitted
        await limiter.sync_once()

    asyncio.run(scenario())
    assert only_counter(store) == 128
    assert all(counter.busy == 0 for counter in limiter.table.all_counters())


@pytest.mark.parametrize("skew", [-1.0, -0.1, 0.1, 1.0])
@pytest.mark.parametrize("shared_clock", [False, True])
def test_clock_skew_between_two_replicas(skew: float, shared_clock: bool) -> None:
    """Two replicas at twice a 20/s limit for 4 s, the second one's clock off by ``skew``.

    Each replica cuts windows on the time it is given: its own skewed clock, or the
    shared (Redis) clock that ``--clock-source redis`` corrects it to. Counted per true
    second: skew lets some true second admit beyond the limit; a shared clock never does.
    """
    store = SimulatedStore()
    first, second = cluster(2, store, max_overshoot=0.0)
    limit, rate, start = 20, 40, 1_000_000.0
    per_true_second: dict[int, int] = {}

    async def scenario() -> None:
        for index in range(4 * rate):
            true_now = start + index / rate
            replica = (first, second)[index % 2]
            seen_now = true_now + (skew if replica is second and not shared_clock else 0.0)
            if (await replica.check([Check(KEY, 1, limit, 1)], seen_now)).admitted:
                per_true_second[int(true_now)] = per_true_second.get(int(true_now), 0) + 1
            if index % 4 == 3:  # flushes every 100 ms of traffic
                await first.sync_once()
                await second.sync_once()

    asyncio.run(scenario())
    beyond = sum(max(0, count - limit) for count in per_true_second.values())
    if shared_clock:
        assert beyond == 0 and all(count == limit for count in per_true_second.values()), per_true_second
    elif abs(skew) >= 1.0:
        assert max(per_true_second.values()) > limit, "a whole second of skew doubles some true second"
    else:
        assert beyond > 0, f"100 ms of skew shows at the boundaries: {per_true_second}"
