"""The admission rule (``decide``) and the embedded memory backend."""

from __future__ import annotations

from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.limiter.memory import MemoryLimiter
from sidecar.limiter.protocol import Check, Decision, Role, decide
from sidecar.limiter.shares import share_of_limit
from sidecar.limiter.windows import window_start

E, S, Q = Role.ENFORCED, Role.SHADOW, Role.QUOTA
T0 = 1_700_000_010.0  # 30 s into a minute
MINUTE = 60


def check(key: str = "k", limit: int = 3, hits: int = 1, role: Role = E, unit: int = MINUTE):
    return Check((key,), unit, limit, hits, role)


# decide() ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("roles", "over", "admitted", "consume"),
    [
        ((), (), True, ()),
        ((E,), (False,), True, (True,)),
        ((E,), (True,), False, (False,)),
        ((E, E), (False, True), False, (False, False)),
        ((E, E), (False, False), True, (True, True)),
        # Shadow never rejects and counts whenever the request is admitted.
        ((S,), (True,), True, (True,)),
        ((S, E), (True, False), True, (True, True)),
        ((S, E), (False, True), False, (False, False)),
        # Quota rejects only when every quota check is over; over quotas do not consume.
        ((Q,), (True,), False, (False,)),
        ((Q,), (False,), True, (True,)),
        ((Q, Q), (True, False), True, (False, True)),
        ((Q, Q), (True, True), False, (False, False)),
        ((Q, E), (False, True), False, (False, False)),
        ((Q, E), (True, False), False, (False, False)),
        ((Q, Q, E), (True, False, False), True, (False, True, True)),
        ((Q, S), (True, True), False, (False, False)),
        ((Q, S), (False, True), True, (True, True)),
    ],
)
def test_decide(roles, over, admitted, consume):
    checks = [check(str(index), limit=1, role=role) for index, role in enumerate(roles)]
    counts = [2 if is_over else 1 for is_over in over]
    limits = [1] * len(checks)
    assert decide(checks, counts, limits, admit_all=False) == (admitted, over, consume)


@pytest.mark.parametrize(
    ("roles", "over"),
    [((E,), (True,)), ((Q, Q), (True, True)), ((E, S, Q), (True, True, False))],
)
def test_decide_admit_all_admits_and_consumes_everything(roles, over):
    checks = [check(str(index), limit=1, role=role) for index, role in enumerate(roles)]
    counts = [2 if is_over else 1 for is_over in over]
    assert decide(checks, counts, [1] * len(checks), admit_all=True) == (
        True,
        over,
        (True,) * len(checks),
    )


def test_decide_over_means_strictly_above_the_limit():
    checks = [check("a"), check("b"), check("c")]
    assert decide(checks, [2, 3, 4], [3, 3, 3], admit_all=False)[1] == (False, False, True)


def test_decision_remaining():
    decision = Decision(True, (False, True), (2, 9), (5, 4))
    assert (decision.remaining(0), decision.remaining(1)) == (3, 0)


# MemoryLimiter ---------------------------------------------------------------------


def test_counts_to_the_limit_then_rejects():
    limiter = MemoryLimiter()
    results = [limiter.check_now([check(limit=3)], T0) for _ in range(5)]
    assert [result.admitted for result in results] == [True, True, True, False, False]
    assert [result.over for result in results] == [(False,)] * 3 + [(True,)] * 2
    assert [result.counts for result in results] == [(1,), (2,), (3,), (4,), (4,)]
    assert [result.remaining(0) for result in results] == [2, 1, 0, 0, 0]
    assert limiter.count(("k",), MINUTE, T0) == 3


def test_over_limit_when_the_hits_would_exceed():
    limiter = MemoryLimiter()
    assert limiter.check_now([check(limit=10, hits=8)], T0).admitted
    assert not limiter.check_now([check(limit=10, hits=3)], T0).admitted
    assert limiter.check_now([check(limit=10, hits=2)], T0).admitted
    assert limiter.count(("k",), MINUTE, T0) == 10
    assert not limiter.check_now([check(limit=10, hits=1)], T0).admitted


def test_hits_larger_than_the_limit_on_an_empty_counter():
    limiter = MemoryLimiter()
    assert not limiter.check_now([check(limit=3, hits=4)], T0).admitted
    assert limiter.count(("k",), MINUTE, T0) == 0
    assert limiter.live_counters == 0


def test_limit_zero_rejects_every_hit():
    limiter = MemoryLimiter()
    assert not limiter.check_now([check(limit=0)], T0).admitted
    assert limiter.check_now([check(limit=0, hits=0)], T0).admitted


def test_zero_hits_only_checks():
    limiter = MemoryLimiter()
    decision = limiter.check_now([check(limit=2, hits=0)], T0)
    assert (decision.admitted, decision.counts, decision.remaining(0)) == (True, (0,), 2)
    assert limiter.live_counters == 0
    limiter.check_now([check(limit=2, hits=2)], T0)
    decision = limiter.check_now([check(limit=2, hits=0)], T0)
    assert (decision.admitted, decision.over, decision.counts) == (True, (False,), (2,))
    assert limiter.count(("k",), MINUTE, T0) == 2


def test_rejected_hits_are_never_added():
    limiter = MemoryLimiter()
    admitted = 0
    for hits in [1, 5, 2, 9, 1, 1, 3]:
        if limiter.check_now([check(limit=5, hits=hits)], T0).admitted:
            admitted += hits
        assert limiter.count(("k",), MINUTE, T0) == admitted
    assert admitted == 5


def test_all_or_nothing_across_checks():
    limiter = MemoryLimiter()
    limiter.check_now([check("tight", limit=1)], T0)
    decision = limiter.check_now([check("loose", limit=100), check("tight", limit=1)], T0)
    assert (decision.admitted, decision.over) == (False, (False, True))
    assert limiter.count(("loose",), MINUTE, T0) == 0
    assert limiter.count(("tight",), MINUTE, T0) == 1


def test_quota_rejects_only_when_every_quota_check_is_over():
    limiter = MemoryLimiter()
    both = [check("q1", limit=1, role=Q), check("q2", limit=2, role=Q)]
    first = limiter.check_now(both, T0)
    assert (first.admitted, first.over) == (True, (False, False))
    second = limiter.check_now(both, T0)
    assert (second.admitted, second.over) == (True, (True, False))
    # The over quota did not consume; the other did.
    assert limiter.count(("q1",), MINUTE, T0) == 1
    assert limiter.count(("q2",), MINUTE, T0) == 2
    third = limiter.check_now(both, T0)
    assert (third.admitted, third.over) == (False, (True, True))
    assert limiter.count(("q1",), MINUTE, T0) == 1
    assert limiter.count(("q2",), MINUTE, T0) == 2


def test_shadow_never_rejects_and_counts_when_admitted():
    limiter = MemoryLimiter()
    for _ in range(4):
        assert limiter.check_now([check("s", limit=2, role=S)], T0).admitted
    assert limiter.count(("s",), MINUTE, T0) == 4
    decision = limiter.check_now([check("s", limit=2, role=S), check("e", limit=0)], T0)
    assert (decision.admitted, decision.over) == (False, (True, True))
    assert limiter.count(("s",), MINUTE, T0) == 4


def test_admit_all_admits_and_counts_everything():
    limiter = MemoryLimiter(admit_all=True)
    decisions = [limiter.check_now([check(limit=2), check("q", limit=1, role=Q)], T0) for _ in "abc"]
    assert [decision.admitted for decision in decisions] == [True, True, True]
    assert [decision.over for decision in decisions] == [
        (False, False),
        (False, True),
        (True, True),
    ]
    assert limiter.count(("k",), MINUTE, T0) == 3
    assert limiter.count(("q",), MINUTE, T0) == 3


def test_the_same_counter_twice_in_one_request_sees_the_first_hits():
    limiter = MemoryLimiter()
    decision = limiter.check_now([check(limit=3, hits=2), check(limit=3, hits=1)], T0)
    assert (decision.admitted, decision.counts) == (True, (2, 3))
    assert limiter.count(("k",), MINUTE, T0) == 3
    limiter = MemoryLimiter()
    decision = limiter.check_now([check(limit=3, hits=2), check(limit=3, hits=2)], T0)
    assert (decision.admitted, decision.over, decision.counts) == (False, (False, True), (2, 4))
    assert limiter.count(("k",), MINUTE, T0) == 0


def test_same_key_in_different_units_are_different_counters():
    limiter = MemoryLimiter()
    limiter.check_now([check(limit=1, unit=1), check(limit=1, unit=MINUTE)], T0)
    assert limiter.count(("k",), 1, T0) == 1
    assert limiter.count(("k",), MINUTE, T0) == 1
    assert limiter.live_counters == 2


def test_reset_at_the_window_boundary():
    limiter = MemoryLimiter()
    start = window_start(T0, MINUTE)
    end = start + MINUTE
    for now in (start, start + 30, end - 0.001):
        assert limiter.check_now([check(limit=3)], now).admitted
    assert not limiter.check_now([check(limit=3)], end - 0.001).admitted
    decision = limiter.check_now([check(limit=3)], end)
    assert (decision.admitted, decision.counts) == (True, (1,))
    assert limiter.count(("k",), MINUTE, end) == 1
    assert limiter.count(("k",), MINUTE, end - 1) == 0  # the old window was dropped


def test_expiry_drops_ended_windows():
    limiter = MemoryLimiter()
    start = window_start(T0, MINUTE)
    limiter.check_now([check(f"m{n}") for n in range(3)], start)
    limiter.check_now([check(f"s{n}", unit=1) for n in range(2)], start)
    assert limiter.live_counters == 5
    limiter.check_now([], start + 0.5)
    assert limiter.live_counters == 5
    limiter.check_now([], start + 1)  # the one-second window ended
    assert limiter.live_counters == 3
    limiter.check_now([check("later", unit=1)], start + 30)
    assert limiter.live_counters == 4
    limiter.check_now([], start + MINUTE)
    assert limiter.live_counters == 0
    assert limiter.count(("m0",), MINUTE, start) == 0


def test_max_counters_evicts_the_window_that_ends_first():
    """A flood of short-window keys must not reset long-window (daily) quotas."""
    evicted: list[int] = []
    limiter = MemoryLimiter(max_counters=3, on_evict=evicted.append)
    now = window_start(T0, MINUTE) + 30.0
    limiter.check_now([check("m1"), check("m2")], now)  # minute window: ends in 30 s
    limiter.check_now([check("s1", unit=1)], now)  # second window: ends in 1 s
    assert (limiter.live_counters, limiter.evictions) == (3, 0)
    limiter.check_now([check("s2", unit=1)], now)
    assert (limiter.live_counters, limiter.evictions, evicted) == (3, 1, [1])
    # The window ending first loses its oldest counter, although m1 was inserted earlier.
    assert limiter.count(("s1",), 1, now) == 0
    assert limiter.count(("s2",), 1, now) == 1
    assert limiter.count(("m1",), MINUTE, now) == 1
    limiter.check_now([check("s3", unit=1)], now)
    limiter.check_now([check("s4", unit=1)], now)
    assert (limiter.live_counters, limiter.evictions, evicted) == (3, 3, [1, 2, 3])
    assert [limiter.count((key,), MINUTE, now) for key in ("m1", "m2")] == [1, 1]
    assert [limiter.count((key,), 1, now) for key in ("s2", "s3", "s4")] == [0, 0, 1]


def test_flood_of_unique_keys_stays_under_the_cap():
    limiter = MemoryLimiter(max_counters=50)
    for n in range(1_000):
        assert limiter.check_now([check(f"user-{n}")], T0).admitted
        assert limiter.live_counters <= 50
    assert limiter.evictions == 950


def test_existing_counters_do_not_count_against_the_cap():
    limiter = MemoryLimiter(max_counters=1)
    for _ in range(3):
        limiter.check_now([check(limit=10)], T0)
    assert (limiter.live_counters, limiter.evictions) == (1, 0)
    assert limiter.count(("k",), MINUTE, T0) == 3


@pytest.mark.parametrize(
    ("limit", "instances", "share"),
    [(5, 4, 2), (0, 4, 0), (10, 1, 10), (1, 3, 1), (7, 7, 1), (8, 3, 3), (9, 3, 3), (100, 8, 13)],
)
def test_share_of_limit(limit, instances, share):
    assert share_of_limit(limit, instances) == share


def test_instances_enforce_the_share_of_the_limit():
    limiter = MemoryLimiter(instances=4)
    decisions = [limiter.check_now([check(limit=5)], T0) for _ in range(3)]
    assert [decision.admitted for decision in decisions] == [True, True, False]
    assert decisions[0].limits == (2,)
    assert decisions[0].remaining(0) == 1
    assert not MemoryLimiter(instances=4).check_now([check(limit=0)], T0).admitted


@pytest.mark.parametrize(
    ("arguments", "message"),
    [({"instances": 0}, "instances"), ({"max_counters": 0}, "max_counters")],
)
def test_bad_construction(arguments, message):
    with pytest.raises(ValueError, match=message):
        MemoryLimiter(**arguments)


async def test_async_check_is_check_now():
    limiter = MemoryLimiter()
    decision = await limiter.check([check(limit=1)], T0)
    assert decision.admitted
    assert not (await limiter.check([check(limit=1)], T0)).admitted
    await limiter.close()


# Property: the counter equals admitted hits and enforced counters never pass their limit.

STEP = st.tuples(
    st.floats(min_value=0, max_value=0.75),  # time to advance
    st.lists(
        st.tuples(
            st.sampled_from(["a", "b", "c"]),
            st.integers(min_value=0, max_value=4),  # hits
            st.integers(min_value=0, max_value=6),  # limit
            st.sampled_from([E, E, Q, S]),
        ),
        min_size=1,
        max_size=4,
    ),
)
UNITS = {"a": 1, "b": 2, "c": 60}


@settings(max_examples=200, deadline=None)
@given(steps=st.lists(STEP, max_size=40), instances=st.sampled_from([1, 1, 3]))
def test_counters_equal_admitted_hits(steps, instances):
    limiter = MemoryLimiter(instances=instances)
    expected: dict[tuple[str, int], int] = defaultdict(int)
    now = T0
    for advance, wanted in steps:
        now += advance
        checks = [Check((key,), UNITS[key], limit, hits, role) for key, hits, limit, role in wanted]
        decision = limiter.check_now(checks, now)
        # Reference: the would-be count of each check, seen in request order.
        running = dict(expected)
        would = []
        for item in checks:
            slot = (item.key[0], window_start(now, item.unit_seconds))
            running[slot] = running.get(slot, 0) + item.hits
            would.append(running[slot])
        assert decision.counts == tuple(would)
        limits = [share_of_limit(item.limit, instances) for item in checks]
        assert decision.limits == tuple(limits)
        over = [count > limit for count, limit in zip(would, limits, strict=True)]
        assert decision.over == tuple(over)
        quota = [is_over for item, is_over in zip(checks, over, strict=True) if item.role is Q]
        blocked = any(is_over and item.role is E for item, is_over in zip(checks, over, strict=True))
        assert decision.admitted == (not blocked and not (quota and all(quota)))
        if decision.admitted:
            for item, is_over in zip(checks, over, strict=True):
                if not is_over or item.role is S:
                    expected[(item.key[0], window_start(now, item.unit_seconds))] += item.hits
        for key, unit in UNITS.items():
            stored = limiter.count((key,), unit, now)
            assert stored == expected.get((key, window_start(now, unit)), 0)


LIMITS = {"a": 3, "b": 1, "c": 7}


@settings(max_examples=200, deadline=None)
@given(
    steps=st.lists(
        st.tuples(
            st.floats(min_value=0, max_value=0.75),
            st.lists(
                st.tuples(st.sampled_from(list(LIMITS)), st.integers(min_value=0, max_value=4)),
                min_size=1,
                max_size=4,
            ),
        ),
        max_size=40,
    )
)
def test_enforced_counters_never_pass_their_limit(steps):
    limiter = MemoryLimiter()
    now = T0
    for advance, wanted in steps:
        now += advance
        checks = [Check((key,), UNITS[key], LIMITS[key], hits) for key, hits in wanted]
        before = {key: limiter.count((key,), UNITS[key], now) for key in LIMITS}
        decision = limiter.check_now(checks, now)
        spent: dict[str, int] = defaultdict(int)
        for key, hits in wanted:
            spent[key] += hits
        fits = all(before[key] + spent[key] <= LIMITS[key] for key in spent)
        assert decision.admitted == fits
        for key, limit in LIMITS.items():
            stored = limiter.count((key,), UNITS[key], now)
            assert stored <= limit
            assert stored == before[key] + (spent[key] if fits else 0)


def test_eviction_bursts_are_logged_at_most_once_per_interval() -> None:
    from structlog.testing import capture_logs

    from sidecar.limiter.bounds import EvictionLog

    eviction_log = EvictionLog(max_counters=10, interval=3600)
    with capture_logs() as logs:
        eviction_log.note(5, 5)
        eviction_log.note(7, 12)
        eviction_log.note(0, 12)
    assert [(entry["event"], entry["evicted"], entry["total_evictions"]) for entry in logs] == [
        ("counters_evicted", 5, 5)
    ]
    eviction_log.interval = 0
    with capture_logs() as logs:
        eviction_log.note(1, 13)
    assert [(entry["evicted"], entry["total_evictions"]) for entry in logs] == [(8, 13)], "held-back ones are reported"
