"""The three counting algorithms: their arithmetic, the memory backend, and the service.

``sidecar.limiter.algorithms`` is also the spec of the Lua script, so its formulas
are pinned here with exact numbers. Times are chosen to be exact in binary floating
point (quarters of a second) so no test depends on how ``1.7e9 + 0.1`` rounds.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.config.match import match_descriptor
from sidecar.limiter.algorithms import (
    MICROSECONDS,
    Algorithm,
    bucket_after,
    emission_interval_us,
    now_us,
    previous_weight,
    reset_seconds,
    sliding_part,
    tokens_in_use,
)
from sidecar.limiter.memory import MemoryLimiter
from sidecar.limiter.protocol import Check, Role
from sidecar.limiter.windows import Unit
from sidecar.protos.envoy.service.ratelimit.v3 import rls_pb2
from sidecar.service.servicer import RateLimitService

OK = rls_pb2.RateLimitResponse.OK
OVER = rls_pb2.RateLimitResponse.OVER_LIMIT
MINUTE_START = 1_700_000_040
"""The first second of a minute (and so of a second)."""
T = 100_000
"""Microseconds per token of 10 per second."""


def bucket(limit: int = 5, hits: int = 1, interval: int = T, key: str = "b", role: Role = Role.ENFORCED) -> Check:
    return Check((key,), 1, limit, hits, role, Algorithm.TOKEN_BUCKET, interval)


def sliding(limit: int = 10, hits: int = 1, unit: int = 1, key: str = "s") -> Check:
    return Check((key,), unit, limit, hits, Role.ENFORCED, Algorithm.SLIDING_WINDOW)


# -- the arithmetic ------------------------------------------------------------------------------


def test_algorithm_numbers_and_labels_are_what_the_config_and_the_script_use():
    assert [(algorithm.label, int(algorithm)) for algorithm in Algorithm] == [
        ("fixed_window", 0),
        ("sliding_window", 1),
        ("token_bucket", 2),
    ]


@pytest.mark.parametrize(
    ("offset", "unit", "weight"),
    [
        (0.0, 1, 1.0),  # at the window start the previous window still counts whole
        (0.25, 1, 0.75),
        (0.5, 1, 0.5),
        (0.75, 1, 0.25),
        (0.0, 60, 1.0),
        (15.0, 60, 0.75),
        (30.0, 60, 0.5),
        (59.5, 60, 0.5 / 60),
    ],
)
def test_previous_weight_is_the_share_of_the_previous_window_still_covered(offset, unit, weight):
    assert previous_weight(MINUTE_START + offset, unit) == pytest.approx(weight, abs=1e-12)


def test_previous_weight_just_before_the_window_end_is_small_but_positive():
    just_before = math.nextafter(float(MINUTE_START + 1), 0.0)
    weight = previous_weight(just_before, 1)
    assert 0 < weight < 1e-6
    assert previous_weight(float(MINUTE_START + 1), 1) == 1.0, "the next window starts afresh"


@pytest.mark.parametrize(
    ("previous", "weight", "part"),
    [
        (10, 1.0, 10),
        (10, 0.5, 5),
        (7, 0.5, 3),  # 3.5 rounds down, as HAProxy's integer arithmetic does
        (3, 0.999, 2),
        (1, 0.999, 0),
        (0, 1.0, 0),
        (10, 0.0, 0),
        (4_294_967_295, 0.25, 1_073_741_823),
    ],
)
def test_sliding_part_rounds_down(previous, weight, part):
    assert sliding_part(previous, weight) == part


@settings(max_examples=300, deadline=None)
@given(
    previous=st.integers(0, 2**32),
    current=st.integers(0, 2**32),
    offset=st.floats(0, 60, exclude_max=True, allow_nan=False),
    unit=st.sampled_from([1, 7, 60, 3600]),
)
def test_sliding_estimate_lies_between_the_current_window_and_both_windows(previous, current, offset, unit):
    now = MINUTE_START + min(offset, unit - 1e-3)
    weight = previous_weight(now, unit)
    assert 0 < weight <= 1
    estimate = current + sliding_part(previous, weight)
    assert current <= estimate <= current + previous


@pytest.mark.parametrize(
    ("seconds", "rate", "interval"),
    [
        (1, 10, 100_000),
        (60, 10, 6_000_000),
        (60, 7, 8_571_429),  # rounded to the nearest microsecond
        (1, 3, 333_333),
        (1, 1_000_000, 1),
        (1, 3_000_000, 1),  # never 0: faster rates than a token per microsecond are capped
    ],
)
def test_emission_interval(seconds, rate, interval):
    assert emission_interval_us(seconds, rate) == interval


def test_now_us_floors_to_whole_microseconds():
    assert now_us(MINUTE_START + 0.25) == MINUTE_START * MICROSECONDS + 250_000
    assert now_us(1.0000004) == 1_000_000
    assert now_us(-0.5) == -500_000


@pytest.mark.parametrize(
    ("ahead", "tokens"),
    [(-5 * T, 0), (0, 0), (1, 1), (T - 1, 1), (T, 1), (T + 1, 2), (5 * T, 5), (5 * T + 1, 6)],
)
def test_tokens_in_use_rounds_up(ahead, tokens):
    now = MINUTE_START * MICROSECONDS
    assert tokens_in_use(now + ahead, now, T) == tokens


def test_bucket_after_from_a_full_bucket_and_from_a_tat_in_the_past():
    now = MINUTE_START * MICROSECONDS
    assert bucket_after(0, now, T, 1) == (now + T, 1)
    assert bucket_after(now - 10 * T, now, T, 3) == (now + 3 * T, 3), "a TAT in the past is a full bucket"


def test_bucket_after_with_zero_hits_only_looks():
    now = MINUTE_START * MICROSECONDS
    assert bucket_after(now - 1, now, T, 0) == (now, 0)
    assert bucket_after(now + 2 * T + 5, now, T, 0) == (now + 2 * T + 5, 3)


def test_bucket_after_adds_to_a_tat_in_the_future():
    now = MINUTE_START * MICROSECONDS
    assert bucket_after(now + T // 2, now, T, 2) == (now + T // 2 + 2 * T, 3)


def test_bucket_after_with_many_hits():
    now = MINUTE_START * MICROSECONDS
    hits = 2**32 - 1
    tat, tokens = bucket_after(now, now, T, hits)
    assert (tat - now, tokens) == (hits * T, hits)


def test_reset_of_windows_is_the_end_of_the_window():
    now = MINUTE_START + 15.25
    for algorithm in (Algorithm.FIXED_WINDOW, Algorithm.SLIDING_WINDOW):
        window = Check(("k",), 60, 10, 1, Role.ENFORCED, algorithm)
        assert reset_seconds(window, 3, 10, False, now) == 45  # 44.75 s, rounded up
        assert reset_seconds(window, 11, 10, True, now) == 45
    seven = Check(("k",), 7, 10, 1)
    start = MINUTE_START - MINUTE_START % 7
    assert reset_seconds(seven, 1, 10, False, start + 2.0) == 5


@pytest.mark.parametrize(
    ("count", "over", "seconds"),
    [
        (0, False, 0),  # already full
        (1, False, 1),  # 0.1 s until full, rounded up
        (10, False, 1),
        (11, False, 2),
        (20, False, 2),
        (21, True, 1),  # refused: one token missing, back in 0.1 s
        (30, True, 1),
        (31, True, 2),
    ],
)
def test_reset_of_a_token_bucket(count, over, seconds):
    check = bucket(limit=20)
    assert reset_seconds(check, count, 20, over, MINUTE_START + 0.5) == seconds


@pytest.mark.parametrize(
    ("count", "over", "seconds"),
    [
        (1, False, 1),  # 0.2 s per token of this replica's half of the bucket
        (5, False, 1),
        (6, False, 2),
        (10, False, 2),
        (11, True, 1),  # refused: the next token is 0.2 s away, not "0 s"
        (16, True, 2),
    ],
)
def test_reset_of_a_shared_token_bucket_counts_the_shares_tokens(count, over, seconds):
    check = bucket(limit=20)
    assert reset_seconds(check, count, 10, over, MINUTE_START) == seconds


# -- properties of GCRA --------------------------------------------------------------------------

REQUESTS = st.lists(st.tuples(st.integers(0, 3 * T), st.integers(0, 8)), min_size=1, max_size=60)


@settings(max_examples=300, deadline=None)
@given(requests=REQUESTS, burst=st.integers(1, 10), interval=st.sampled_from([1, 7, T, 333_333]))
def test_a_token_bucket_never_admits_more_than_burst_plus_refill(requests, burst, interval):
    """In any interval [t1, t2]: admitted hits <= burst + (t2 - t1) / T (exact, in microseconds)."""
    now = MINUTE_START * MICROSECONDS
    tat = 0
    admitted: list[tuple[int, int]] = []
    for gap, hits in requests:
        now += gap
        new_tat, count = bucket_after(tat, now, interval, hits)
        assert count == tokens_in_use(new_tat, now, interval)
        assert count >= hits
        if count <= burst:
            tat = new_tat
            if hits:
                admitted.append((now, hits))
    for first in range(len(admitted)):
        total = 0
        for last in range(first, len(admitted)):
            total += admitted[last][1]
            elapsed = admitted[last][0] - admitted[first][0]
            assert total <= burst + elapsed / interval


@settings(max_examples=300, deadline=None)
@given(requests=REQUESTS, burst=st.integers(1, 10), rate=st.integers(1, 50))
def test_in_rate_terms_the_bound_holds_within_one_token(requests, burst, rate):
    """The same bound with the configured rate: ``T`` is rounded to the microsecond."""
    interval = emission_interval_us(1, rate)
    now = MINUTE_START * MICROSECONDS
    tat = 0
    admitted: list[tuple[int, int]] = []
    for gap, hits in requests:
        now += gap * 37
        new_tat, count = bucket_after(tat, now, interval, hits)
        if count <= burst:
            tat = new_tat
            admitted.append((now, hits))
    for first in range(len(admitted)):
        total = 0
        for last in range(first, len(admitted)):
            total += admitted[last][1]
            elapsed = (admitted[last][0] - admitted[first][0]) / MICROSECONDS
            assert total <= burst + rate * elapsed + 1


@settings(max_examples=200, deadline=None)
@given(requests=REQUESTS, burst=st.integers(1, 10), hits=st.integers(1, 10))
def test_a_bucket_left_alone_long_enough_is_full_again(requests, burst, hits):
    now = MINUTE_START * MICROSECONDS
    tat = 0
    for gap, wanted in requests:
        now += gap
        new_tat, count = bucket_after(tat, now, T, wanted)
        if count <= burst:
            tat = new_tat
    assert tokens_in_use(tat, now, T) <= burst
    later = max(tat, now)
    assert tokens_in_use(tat, later, T) == 0
    assert bucket_after(tat, later, T, hits)[1] == hits, "a full bucket admits up to burst at once"


@settings(max_examples=100, deadline=None)
@given(
    requests=st.lists(st.tuples(st.integers(0, 400), st.integers(0, 4)), min_size=1, max_size=60),
    burst=st.integers(1, 6),
    instances=st.sampled_from([1, 2, 3]),
)
def test_the_memory_backend_keeps_the_bucket_bound(requests, burst, instances):
    """The same bound through :class:`MemoryLimiter`, with times in milliseconds as floats."""
    limiter = MemoryLimiter(instances=instances)
    check = bucket(limit=burst)
    share, interval = math.ceil(burst / instances), T * instances
    now = float(MINUTE_START)
    admitted: list[tuple[float, int]] = []
    for gap, hits in requests:
        now += gap / 1000
        if limiter.check_now([check._replace(hits=hits)], now).admitted and hits:
            admitted.append((now, hits))
    for first in range(len(admitted)):
        total = 0
        for last in range(first, len(admitted)):
            total += admitted[last][1]
            elapsed_us = now_us(admitted[last][0]) - now_us(admitted[first][0])
            assert total <= share + elapsed_us / interval


# -- the memory backend --------------------------------------------------------------------------


def test_memory_token_bucket_burst_then_refill():
    limiter = MemoryLimiter()
    now = float(MINUTE_START)
    decisions = [limiter.check_now([bucket(limit=5)], now) for _ in range(6)]
    assert [decision.admitted for decision in decisions] == [True] * 5 + [False]
    assert [decision.counts[0] for decision in decisions] == [1, 2, 3, 4, 5, 6]
    assert [decision.remaining(0) for decision in decisions] == [4, 3, 2, 1, 0, 0]
    assert limiter.live_counters == 1
    # A token comes back every 0.1 s.
    assert limiter.check_now([bucket(limit=5, hits=0)], now + 0.25).counts == (3,)
    assert limiter.check_now([bucket(limit=5, hits=2)], now + 0.25).admitted
    assert not limiter.check_now([bucket(limit=5)], now + 0.25).admitted
    assert limiter.check_now([bucket(limit=5)], now + 0.3).admitted


def test_memory_token_bucket_rejected_hits_take_nothing():
    limiter = MemoryLimiter()
    now = float(MINUTE_START)
    assert not limiter.check_now([bucket(limit=5, hits=6)], now).admitted
    assert limiter.live_counters == 0
    assert limiter.check_now([bucket(limit=5, hits=5)], now).admitted


def test_memory_token_bucket_shadow_role_spends_even_when_over():
    limiter = MemoryLimiter()
    now = float(MINUTE_START)
    for _ in range(3):
        decision = limiter.check_now([bucket(limit=2, role=Role.SHADOW)], now)
        assert decision.admitted
    assert decision.over == (True,)
    assert limiter.check_now([bucket(limit=2, hits=0)], now).counts == (3,)


def test_memory_token_bucket_named_twice_sees_its_own_hits():
    limiter = MemoryLimiter()
    now = float(MINUTE_START)
    decision = limiter.check_now([bucket(limit=3), bucket(limit=3)], now)
    assert (decision.admitted, decision.counts) == (True, (1, 2))
    decision = limiter.check_now([bucket(limit=3), bucket(limit=3)], now)
    assert (decision.admitted, decision.counts, decision.over) == (False, (3, 4), (False, True))
    assert limiter.check_now([bucket(limit=3)], now).counts == (3,), "the refused request took nothing"


def test_memory_full_buckets_are_swept_and_the_cap_holds():
    limiter = MemoryLimiter(max_counters=10)
    now = float(MINUTE_START)
    for index in range(30):
        limiter.check_now([bucket(key=str(index))], now)
        assert limiter.live_counters <= 10
    assert limiter.evictions == 20
    # Once they are full again they are forgotten rather than evicted.
    later = now + 1.0
    for index in range(30, 40):
        limiter.check_now([bucket(key=str(index))], later)
    assert limiter.live_counters <= 10
    assert limiter.evictions == 20


def test_memory_a_flood_of_new_buckets_at_the_cap_sweeps_rarely(monkeypatch):
    limiter = MemoryLimiter(max_counters=1_000)
    sweeps = 0
    sweep = limiter._sweep_buckets

    def counted(now: float) -> None:
        nonlocal sweeps
        sweeps += 1
        sweep(now)

    monkeypatch.setattr(limiter, "_sweep_buckets", counted)
    now = float(MINUTE_START)
    for index in range(20_000):
        limiter.check_now([bucket(key=str(index))], now)
    assert limiter.live_counters == 1_000
    assert limiter.evictions == 19_000
    assert sweeps <= 20_000 // 1_000 + 1, "a sweep reads every bucket: not one per new bucket at the cap"


def test_memory_a_flood_evicts_the_bucket_spent_least_recently():
    limiter = MemoryLimiter(max_counters=100)
    now = float(MINUTE_START)
    steady = bucket(limit=1_000, key="steady", interval=10**9)
    limiter.check_now([steady], now)
    for index in range(1_000):
        limiter.check_now([bucket(key=str(index))], now)
        if index % 50 == 0:
            limiter.check_now([steady], now)
    decision = limiter.check_now([steady._replace(hits=0)], now)
    assert decision.counts == (21,), "the client spending all along kept its bucket"


def test_memory_sliding_window_counts_the_previous_window_weighted():
    limiter = MemoryLimiter()
    start = float(MINUTE_START)
    assert [limiter.check_now([sliding()], start).admitted for _ in range(11)] == [True] * 10 + [False]
    decision = limiter.check_now([sliding(hits=0)], start + 1.25)
    assert decision.counts == (7,), "10 * 0.75 of the previous window"
    assert limiter.count(("s",), 1, start + 1.25) == 0, "only the current window is stored"


def test_memory_sliding_window_keeps_a_window_one_window_longer():
    limiter = MemoryLimiter()
    start = float(MINUTE_START)
    limiter.check_now([sliding(limit=100, unit=60)], start)
    limiter.check_now([Check(("fixed",), 60, 100, 1)], start)
    assert limiter.live_counters == 2
    assert limiter.check_now([sliding(limit=100, unit=60, hits=0)], start + 60).counts == (1,)
    assert limiter.check_now([sliding(limit=100, unit=60, hits=0)], start + 90).counts == (0,)  # floor(0.5)
    assert limiter.live_counters == 2, "the window is still read by the next one"
    limiter.check_now([sliding(limit=100, unit=60, hits=0)], start + 120)
    assert limiter.live_counters == 0


def test_memory_record_adds_without_deciding():
    limiter = MemoryLimiter()
    now = float(MINUTE_START)
    limiter.record(bucket(limit=2, hits=5), now)
    assert limiter.check_now([bucket(limit=2, hits=0)], now).counts == (5,)
    limiter.record(sliding(limit=2, hits=4), now)
    assert limiter.check_now([sliding(limit=2, hits=0)], now + 1.5).counts == (2,)


def test_memory_instances_share_a_bucket_size_and_its_refill():
    limiter = MemoryLimiter(instances=2)
    now = float(MINUTE_START)
    decisions = [limiter.check_now([bucket(limit=5)], now) for _ in range(4)]
    assert [decision.admitted for decision in decisions] == [True, True, True, False]
    assert decisions[0].limits == (3,), "5 / 2 rounded up"
    assert not limiter.check_now([bucket(limit=5)], now + 0.1).admitted, "a token takes 0.2 s"
    assert limiter.check_now([bucket(limit=5)], now + 0.2).admitted


# -- through the service -------------------------------------------------------------------------

RULES = """
    domain: alg
    descriptors:
      - key: sliding
        rate_limit: {unit: second, requests_per_unit: 10, algorithm: sliding_window}
      - key: sliding_minute
        rate_limit: {unit: minute, requests_per_unit: 10, algorithm: sliding_window}
      - key: bucket
        rate_limit: {name: bucket, unit: second, requests_per_unit: 10, algorithm: token_bucket, burst: 20}
      - key: small_bucket
        rate_limit: {unit: second, requests_per_unit: 2, algorithm: token_bucket}
      - key: fixed
        rate_limit: {unit: second, requests_per_unit: 100}
"""


@pytest.fixture
def clock(h):
    """At the start of a minute (the shared fixture stands in the middle of one)."""
    return h.FakeClock(float(MINUTE_START))


@pytest.fixture
def make(h, clock):
    def build(instances: int = 1, response_headers: bool = False) -> RateLimitService:
        return h.memory_service(RULES, clock, instances=instances, response_headers=response_headers)

    return build


@pytest.fixture
def service(make) -> RateLimitService:
    return make()


@pytest.fixture
def ask(h, service):
    return h.asker("alg", service)


def status_numbers(response: Any, index: int = 0) -> tuple[bool, int, int]:
    status = response.statuses[index]
    return status.code == OVER, status.limit_remaining, status.duration_until_reset.seconds


def count_of(h, service: RateLimitService, key: str, value: str) -> int:
    """What the window counter of the rule ``(key, value)`` lands on holds now."""
    match = match_descriptor(service.config.domains["alg"], [h.Entry(key, value)])
    assert match is not None
    return service.limiter.count(match.key, match.rule.unit_seconds, service.clock())


async def admitted_in_a_row(ask, descriptor, limit: int = 100) -> int:
    for admitted in range(limit):
        if (await ask(descriptor)).overall_code != OK:
            return admitted
    return limit


async def test_sliding_window_admits_exactly_per_the_estimate_across_a_boundary(h, ask, clock, service):
    assert await admitted_in_a_row(ask, ("sliding", "a")) == 10
    clock.now = MINUTE_START + 1.25  # previous 10 weighs 0.75: 7
    assert await admitted_in_a_row(ask, ("sliding", "a")) == 3
    clock.now = MINUTE_START + 1.5  # 10 * 0.5 + 3
    assert await admitted_in_a_row(ask, ("sliding", "a")) == 2
    clock.now = MINUTE_START + 1.75  # floor(2.5) + 5
    assert await admitted_in_a_row(ask, ("sliding", "a")) == 3
    assert count_of(h, service, "sliding", "a") == 8
    clock.now = MINUTE_START + 2.0  # the previous window is now the 8, whole
    assert await admitted_in_a_row(ask, ("sliding", "a")) == 2
    clock.now = MINUTE_START + 3.5  # 2 * 0.5 = 1
    assert await admitted_in_a_row(ask, ("sliding", "a")) == 9
    clock.now = MINUTE_START + 5.0  # two windows of silence: nothing left
    assert await admitted_in_a_row(ask, ("sliding", "a")) == 10


async def test_sliding_window_status_reports_the_estimate_and_the_window_end(ask, clock):
    clock.now = MINUTE_START + 30.0
    for _ in range(6):
        await ask(("sliding_minute", "a"))
    clock.now = MINUTE_START + 75.0  # 45 s left: previous 6 weighs 0.75, floor(4.5) = 4
    response = await ask(("sliding_minute", "a"))
    assert response.overall_code == OK
    assert status_numbers(response) == (False, 10 - 5, 45)
    status = response.statuses[0]
    assert (status.current_limit.requests_per_unit, status.current_limit.unit) == (10, Unit.MINUTE)


async def test_token_bucket_burst_then_refill(ask, clock):
    seen = [status_numbers(await ask(("bucket", "a"))) for _ in range(21)]
    # remaining counts down from the burst; reset is until the bucket is full again
    assert seen[:20] == [(False, 20 - n, math.ceil(n / 10)) for n in range(1, 21)]
    assert seen[20] == (True, 0, 1), "refused: one token comes back in 0.1 s"
    clock.now = MINUTE_START + 0.25  # two tokens back
    assert [status_numbers(await ask(("bucket", "a")))[0] for _ in range(3)] == [False, False, True]
    clock.now = MINUTE_START + 10.0
    response = await ask(("bucket", "a"))
    assert status_numbers(response) == (False, 19, 1), "full again after 2 s"


async def test_token_bucket_current_limit_is_the_rate(ask):
    response = await ask(("bucket", "a"))
    limit = response.statuses[0].current_limit
    assert (limit.name, limit.requests_per_unit, limit.unit) == ("bucket", 10, Unit.SECOND)


async def test_token_bucket_default_burst_is_the_rate(ask):
    assert await admitted_in_a_row(ask, ("small_bucket", "a")) == 2


async def test_token_bucket_with_hits_addend(h, ask, clock):
    seen = [status_numbers(await ask(("bucket", "a"), hits=5)) for _ in range(5)]
    assert seen == [(False, 15, 1), (False, 10, 1), (False, 5, 2), (False, 0, 2), (True, 0, 1)]
    clock.now = MINUTE_START + 0.5
    assert (await ask(("bucket", "a"), hits=5)).overall_code == OK
    assert (await ask(("bucket", "a"), hits=21)).overall_code == OVER, "more than the burst never fits"
    clock.now = MINUTE_START + 100.0
    assert (await ask(h.descriptor(("bucket", "b"), hits=21))).overall_code == OVER
    assert (await ask(h.descriptor(("bucket", "b"), hits=20))).overall_code == OK


async def test_a_request_naming_the_same_bucket_twice(ask):
    both = await ask(("small_bucket", "a"), ("small_bucket", "a"))
    assert both.overall_code == OK
    assert [status.limit_remaining for status in both.statuses] == [1, 0]
    refused = await ask(("small_bucket", "a"), ("small_bucket", "a"))
    assert [status.code for status in refused.statuses] == [OVER, OVER]


async def test_a_request_naming_the_same_bucket_twice_is_all_or_nothing(ask, clock):
    await ask(("small_bucket", "a"))
    refused = await ask(("small_bucket", "a"), ("small_bucket", "a"))
    assert (refused.overall_code, [status.code for status in refused.statuses]) == (OVER, [OK, OVER])
    assert (await ask(("small_bucket", "a"))).overall_code == OK, "the refused request took no token"


async def test_a_bucket_refusing_the_request_leaves_a_window_untouched(h, ask, service):
    for _ in range(2):
        await ask(("small_bucket", "a"))
    refused = await ask(("small_bucket", "a"), ("fixed", "x"))
    assert refused.overall_code == OVER
    assert count_of(h, service, "fixed", "x") == 0


async def test_instances_share_a_bucket(make, ask, clock):
    shared = make(instances=2)
    seen = [status_numbers(await ask(("bucket", "a"), to=shared)) for _ in range(11)]
    # This replica's bucket is 10 tokens, refilling at 5 per second: 0.2 s per token.
    assert seen[0] == (False, 9, 1)
    assert seen[9] == (False, 0, 2), "10 tokens take 2 s to come back"
    assert seen[10] == (True, 0, 1), "refused: the next token is back in 0.2 s"
    clock.now = MINUTE_START + 0.1
    assert (await ask(("bucket", "a"), to=shared)).overall_code == OVER
    clock.now = MINUTE_START + 0.2
    assert (await ask(("bucket", "a"), to=shared)).overall_code == OK


async def test_instances_share_a_sliding_window(make, ask, clock):
    shared = make(instances=2)
    assert await admitted_in_a_row(lambda d: ask(d, to=shared), ("sliding", "a")) == 5
    clock.now = MINUTE_START + 1.5  # this replica's previous 5 weighs 0.5: 2
    assert await admitted_in_a_row(lambda d: ask(d, to=shared), ("sliding", "a")) == 3


async def test_headers_of_a_token_bucket(make, ask):
    with_headers = make(response_headers=True)
    for _ in range(20):
        response = await ask(("bucket", "a"), to=with_headers)
    assert [(header.key, header.value) for header in response.response_headers_to_add] == [
        ("RateLimit-Limit", "20"),
        ("RateLimit-Remaining", "0"),
        ("RateLimit-Reset", "2"),
    ]
    refused = await ask(("bucket", "a"), to=with_headers)
    assert [(header.key, header.value) for header in refused.response_headers_to_add][-1] == ("Retry-After", "1")
