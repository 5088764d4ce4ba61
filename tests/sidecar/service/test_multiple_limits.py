"""Several limits on one descriptor (``rate_limits``), through ``RateLimitService.decide``.

The limits of a descriptor are all-or-nothing like the descriptors of a request: no
limit spends hits when another refuses. The descriptor's status, the ``RateLimit-*``
headers and the rule metrics report the limit closest to exhaustion.
"""

from __future__ import annotations

from typing import Any

import pytest

from sidecar.config.match import Match, match_descriptor
from sidecar.limiter.memory import MemoryLimiter
from sidecar.limiter.windows import Unit
from sidecar.metrics import OVER_LIMIT, TOTAL_HITS, WARNED, WITHIN_LIMIT
from sidecar.protos.envoy.service.ratelimit.v3 import rls_pb2
from sidecar.service.servicer import RateLimitService, check_of

OK = rls_pb2.RateLimitResponse.OK
OVER = rls_pb2.RateLimitResponse.OVER_LIMIT
MINUTE_START = 1_700_000_040
T0 = MINUTE_START + 30.0
"""Half a minute in: a second's window resets in 1 s, the minute's in 30 s, the hour's in 2,730 s."""

RULES = """
    domain: multi
    descriptors:
      - key: user
        rate_limits:
          - {name: per_second, unit: second, requests_per_unit: 10}
          - {name: per_minute, unit: minute, requests_per_unit: 15}
      - key: warned
        rate_limits:
          - {name: warn_second, unit: second, requests_per_unit: 10, warn_at: 0.5}
          - {name: warn_minute, unit: minute, requests_per_unit: 15, warn_at: 0.8}
      - key: vip
        rate_limit: {name: vip, unit: hour, requests_per_unit: 1000, replaces: [{name: per_minute}]}
      - key: staff
        rate_limit:
          {name: staff, unit: hour, requests_per_unit: 1000, replaces: [{name: per_second}, {name: per_minute}]}
      - key: mixed
        rate_limit: {name: mixed_bucket, unit: second, requests_per_unit: 2, algorithm: token_bucket, burst: 4}
        rate_limits:
          - {name: mixed_hour, unit: hour, requests_per_unit: 6}
      - key: sliding
        rate_limits:
          - {name: sliding_second, unit: second, requests_per_unit: 4, algorithm: sliding_window}
          - {name: fixed_second, unit: second, requests_per_unit: 6}
      - key: shadow
        shadow_mode: true
        rate_limits:
          - {name: shadow_second, unit: second, requests_per_unit: 1}
          - {name: shadow_minute, unit: minute, requests_per_unit: 2}
      - key: other
        rate_limit: {name: other, unit: hour, requests_per_unit: 100}
"""


@pytest.fixture
def clock(h):
    return h.FakeClock(T0)


@pytest.fixture
def make(h, clock):
    def build(response_headers: bool = False, instances: int = 1) -> RateLimitService:
        return h.memory_service(RULES, clock, instances=instances, response_headers=response_headers)

    return build


@pytest.fixture
def service(make) -> RateLimitService:
    return make()


@pytest.fixture
def ask(h, service):
    return h.asker("multi", service)


def reported(response: Any, index: int = 0) -> tuple[int, str, int, int]:
    """A status as ``(code, name of the limit reported, remaining, reset)``."""
    status = response.statuses[index]
    return status.code, status.current_limit.name, status.limit_remaining, status.duration_until_reset.seconds


def headers(response: Any) -> list[tuple[str, str]]:
    return [(header.key, header.value) for header in response.response_headers_to_add]


def limits_of(h, service: RateLimitService, key: str, value: str) -> tuple[Match, ...]:
    match = match_descriptor(service.config.domains["multi"], [h.Entry(key, value)])
    assert match is not None
    return match.limits()


def counts(h, service: RateLimitService, key: str, value: str) -> list[int]:
    """What every limit of the descriptor holds now, without spending anything."""
    limiter = service.limiter
    assert isinstance(limiter, MemoryLimiter)
    checks = [check_of(limit, 0) for limit in limits_of(h, service, key, value)]
    return list(limiter.check_now(checks, service.clock()).counts)


async def test_the_second_limit_refuses_without_the_minute_limit_spending(h, ask, service):
    for sent in range(10):
        assert reported(await ask(("user", "u")))[0] == OK, sent
    refused = await ask(("user", "u"))
    assert refused.overall_code == OVER
    assert reported(refused) == (OVER, "per_second", 0, 1)
    assert counts(h, service, "user", "u") == [10, 10]


async def test_the_minute_limit_refuses_without_the_second_limit_spending(h, ask, service, clock):
    for _ in range(10):
        await ask(("user", "u"))
    clock.now = T0 + 1.0
    for _ in range(5):
        assert (await ask(("user", "u"))).overall_code == OK
    refused = await ask(("user", "u"))
    assert reported(refused) == (OVER, "per_minute", 0, 29)
    assert counts(h, service, "user", "u") == [5, 15]


async def test_the_status_reports_the_limit_with_the_fewest_hits_left(ask, clock):
    assert reported(await ask(("user", "u"))) == (OK, "per_second", 9, 1)
    for _ in range(7):
        response = await ask(("user", "u"))
    assert reported(response) == (OK, "per_second", 2, 1)
    clock.now = T0 + 1.0
    for _ in range(4):
        response = await ask(("user", "u"))
    assert reported(response) == (OK, "per_minute", 3, 29), "12 of 15 this minute, 4 of 10 this second"
    limit = response.statuses[0].current_limit
    assert (limit.requests_per_unit, limit.unit) == (15, Unit.MINUTE)


async def test_equal_hits_left_report_the_later_reset(ask, clock):
    for _ in range(5):
        await ask(("user", "u"))
    clock.now = T0 + 1.0
    for _ in range(5):
        response = await ask(("user", "u"))
    assert reported(response) == (OK, "per_minute", 5, 29)


async def test_of_several_over_limits_the_last_to_reset_is_reported(ask):
    refused = await ask(("user", "u"), hits=20)
    assert reported(refused) == (OVER, "per_minute", 0, 30)


async def test_only_the_over_limit_is_reported_even_with_fewer_left_elsewhere(ask, clock):
    for _ in range(10):
        await ask(("user", "u"))
    clock.now = T0 + 1.0
    for _ in range(4):
        await ask(("user", "u"))
    refused = await ask(("user", "u"), hits=2)  # 16 of 15 this minute; 6 of 10 this second
    assert reported(refused) == (OVER, "per_minute", 0, 29)


async def test_a_descriptor_refused_by_another_consumes_nothing_on_any_limit(h, ask, service):
    for _ in range(100):
        await ask(("other", "o"))
    refused = await ask(("user", "u"), ("other", "o"))
    assert [status.code for status in refused.statuses] == [OK, OVER]
    assert counts(h, service, "user", "u") == [0, 0]


async def test_a_request_naming_a_multi_limit_descriptor_twice(h, ask, service):
    response = await ask(("user", "u"), ("user", "u"))
    assert [reported(response, index)[:3] for index in (0, 1)] == [(OK, "per_second", 9), (OK, "per_second", 8)]
    assert counts(h, service, "user", "u") == [2, 2]
    refused = await ask(("user", "u"), hits=5), await ask(("user", "u"), ("user", "u"), hits=3)
    assert refused[0].overall_code == OK
    assert refused[1].overall_code == OVER, "7 + 3 + 3 > 10"
    assert counts(h, service, "user", "u") == [7, 7]


async def test_rate_limit_headers_report_the_limit_closest_to_exhaustion(make, ask, clock):
    with_headers = make(response_headers=True)
    response = await ask(("user", "u"), to=with_headers)
    assert headers(response) == [("RateLimit-Limit", "10"), ("RateLimit-Remaining", "9"), ("RateLimit-Reset", "1")]
    for _ in range(9):
        await ask(("user", "u"), to=with_headers)
    refused = await ask(("user", "u"), to=with_headers)
    assert headers(refused) == [
        ("RateLimit-Limit", "10"),
        ("RateLimit-Remaining", "0"),
        ("RateLimit-Reset", "1"),
        ("Retry-After", "1"),
    ]
    clock.now = T0 + 1.0
    for _ in range(5):
        await ask(("user", "u"), to=with_headers)
    refused = await ask(("user", "u"), to=with_headers)
    assert headers(refused) == [
        ("RateLimit-Limit", "15"),
        ("RateLimit-Remaining", "0"),
        ("RateLimit-Reset", "29"),
        ("Retry-After", "29"),
    ]


async def test_rate_limit_headers_across_descriptors_and_their_limits(make, ask):
    with_headers = make(response_headers=True)
    for _ in range(98):
        await ask(("other", "o"), to=with_headers)
    response = await ask(("user", "u"), ("other", "o"), to=with_headers)
    assert headers(response) == [("RateLimit-Limit", "100"), ("RateLimit-Remaining", "1"), ("RateLimit-Reset", "2730")]
    response = await ask(("other", "o2"), ("user", "u"), to=with_headers)
    assert headers(response) == [("RateLimit-Limit", "10"), ("RateLimit-Remaining", "8"), ("RateLimit-Reset", "1")]


async def test_warn_at_per_limit(ask, service, clock):
    texts = []
    for _ in range(6):
        response = await ask(("warned", "w"))
        texts.append([value for key, value in headers(response)])
    assert texts[:4] == [[]] * 4
    assert texts[4:] == [["warn_second: 50% of 10/second used"], ["warn_second: 60% of 10/second used"]]
    clock.now = T0 + 1.0
    for _ in range(6):
        response = await ask(("warned", "w"))
    assert [value for _, value in headers(response)] == [
        "warn_second: 60% of 10/second used",
        "warn_minute: 80% of 15/minute used",
    ]
    rows = service.stats.rules.rows["multi.warned"]
    assert rows[TOTAL_HITS] == 12
    # 5th and 6th of each second; the last is past both warn_at: its hit counts once
    assert rows[WARNED] == 4


async def test_replaces_naming_one_limit_drops_only_that_limit(h, ask, service, clock):
    for _ in range(10):
        response = await ask(("user", "u"), ("vip", "v"))
        assert response.overall_code == OK
    assert reported(response)[:3] == (OK, "per_second", 0)
    assert (await ask(("user", "u"), ("vip", "v"))).overall_code == OVER, "the second limit still applies"
    for second in range(1, 4):
        clock.now = T0 + second
        for _ in range(10):
            assert (await ask(("user", "u"), ("vip", "v"))).overall_code == OK
    assert counts(h, service, "user", "u") == [10, 0], "the minute limit was replaced: it counted nothing"
    assert (await ask(("user", "u"))).overall_code == OVER, "without vip, the second limit is full again"


async def test_replacing_every_limit_of_a_descriptor_leaves_it_unlimited(h, ask, service):
    for _ in range(30):
        response = await ask(("user", "u"), ("staff", "s"))
        assert response.overall_code == OK
    status = response.statuses[0]
    assert (status.code, status.HasField("current_limit"), status.limit_remaining) == (OK, False, 0)
    assert counts(h, service, "user", "u") == [0, 0]


async def test_a_token_bucket_beside_a_window(h, ask, service, clock):
    seen = [reported(await ask(("mixed", "m"))) for _ in range(5)]
    assert seen[0] == (OK, "mixed_bucket", 3, 1), "3 tokens left, full again in 0.5 s"
    assert seen[3] == (OK, "mixed_bucket", 0, 2), "no token left, full again in 2 s; 2 left this hour"
    assert seen[4] == (OVER, "mixed_bucket", 0, 1), "refused: the next token is 0.5 s away"
    assert counts(h, service, "mixed", "m") == [4, 4], "4 tokens in use; 4 of 6 this hour"
    clock.now = T0 + 1.0  # two tokens back
    assert reported(await ask(("mixed", "m"))) == (OK, "mixed_hour", 1, 2729), "1 left of each: the later reset"
    assert reported(await ask(("mixed", "m"))) == (OK, "mixed_hour", 0, 2729)
    clock.now = T0 + 10.0  # the bucket is full: only the hour refuses
    refused = await ask(("mixed", "m"))
    assert reported(refused) == (OVER, "mixed_hour", 0, 2720)
    assert counts(h, service, "mixed", "m") == [0, 6], "the refused request took no token"
    limit = refused.statuses[0].current_limit
    assert (limit.requests_per_unit, limit.unit) == (6, Unit.HOUR)


async def test_a_sliding_window_beside_a_fixed_one(ask, clock):
    assert [(await ask(("sliding", "s"))).overall_code for _ in range(5)] == [OK] * 4 + [OVER]
    clock.now = T0 + 1.5  # 4 * 0.5 = 2 from the previous window
    seen = [reported(await ask(("sliding", "s"))) for _ in range(3)]
    assert seen == [(OK, "sliding_second", 1, 1), (OK, "sliding_second", 0, 1), (OVER, "sliding_second", 0, 1)]


async def test_shadow_mode_covers_every_limit(ask, service):
    for _ in range(3):
        response = await ask(("shadow", "x"))
        assert response.overall_code == OK
    assert reported(response) == (OK, "shadow_minute", 0, 30)
    rows = service.stats.rules.rows["multi.shadow"]
    assert (rows[TOTAL_HITS], rows[WITHIN_LIMIT], rows[OVER_LIMIT]) == (3, 1, 2)


async def test_metrics_count_each_request_once(ask, service):
    for _ in range(11):
        await ask(("user", "u"))
    rows = service.stats.rules.rows["multi.user"]
    assert (rows[TOTAL_HITS], rows[WITHIN_LIMIT], rows[OVER_LIMIT]) == (11, 10, 1)


async def test_instances_share_every_limit(make, ask, clock):
    shared = make(instances=2)
    assert [(await ask(("user", "u"), to=shared)).overall_code for _ in range(6)] == [OK] * 5 + [OVER]
    clock.now = T0 + 1.0
    seen = [reported(await ask(("user", "u"), to=shared)) for _ in range(4)]
    # This replica enforces 5 per second and 8 per minute.
    assert seen == [
        (OK, "per_minute", 2, 29),
        (OK, "per_minute", 1, 29),
        (OK, "per_minute", 0, 29),
        (OVER, "per_minute", 0, 29),
    ]
