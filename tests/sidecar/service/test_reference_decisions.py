"""Decisions and per-rule stats as envoyproxy/ratelimit answers them (issue 26, causes 1-4, 6).

Written from the reference's documented behaviour (its README on
STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT, per-descriptor ``hits_addend``, the near-limit
ratio and the stats it names, ``share_threshold`` with ``detailed_metric``, descriptors
without entries); read from its limiter for behaviour only, nothing copied. Every case
runs on the memory backend and, against a real redis-server, on ``sync`` and ``strict``:

1/6. A refused request adds no hits (all-or-nothing, i.e. STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT
     always on): a descriptor that passed reports ``limit - stored count``, what is really left.
2.   The stats of a multi-hit request are split per hit: past the limit ``over_limit``,
     between ``floor(limit * 0.8)`` and the limit ``near_limit``, and, for passing
     descriptors, all of them ``within_limit`` (near_limit is a part of those); a passing
     descriptor of a refused request counts its hits as the last ones of its stored count.
3.   A descriptor without entries is answered OK with no limit, and the request counts.
4.   Under a ``share_threshold`` wildcard, a ``detailed_metric`` child's stat key keeps the
     parent's pattern.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from sidecar.limiter.memory import MemoryLimiter
from sidecar.limiter.protocol import Limiter
from sidecar.metrics import NEAR_LIMIT, OVER_LIMIT, RULE_STATS, TOTAL_HITS, WITHIN_LIMIT, RuleStats
from sidecar.protos.envoy.service.ratelimit.v3 import rls_pb2
from sidecar.server import build_redis_limiter, build_strict_limiter
from sidecar.service.servicer import RateLimitService
from tests.sidecar.limiter.conftest import steady_now, strict_settings, sync_settings
from tests.support.redis_servers import RedisServer, fresh_prefix
from tests.support.sidecars import Sidecar, clean_env, free_port, request

OK = rls_pb2.RateLimitResponse.OK
OVER = rls_pb2.RateLimitResponse.OVER_LIMIT

RULES = """
    domain: ref
    descriptors:
      - {key: key2, rate_limit: {unit: hour, requests_per_unit: 20}}
      - {key: key3, rate_limit: {unit: hour, requests_per_unit: 10}}
      - {key: fifteen, rate_limit: {unit: hour, requests_per_unit: 15}}
      - {key: fourteen, rate_limit: {unit: hour, requests_per_unit: 14}}
      - {key: eight, rate_limit: {unit: hour, requests_per_unit: 8}}
      - {key: twenty, rate_limit: {unit: hour, requests_per_unit: 20}}
      - key: service
        value: svc/*
        share_threshold: true
        descriptors:
          - key: endpoint
            detailed_metric: true
            rate_limit: {unit: hour, requests_per_unit: 80}
      - key: path
        value: path/*
        descriptors:
          - key: endpoint
            detailed_metric: true
            rate_limit: {unit: hour, requests_per_unit: 80}
"""

Ask = Callable[..., Any]


@pytest.fixture(
    params=["memory", pytest.param("sync", marks=pytest.mark.redis), pytest.param("strict", marks=pytest.mark.redis)]
)
async def service(request: pytest.FixtureRequest, h: Any) -> AsyncIterator[RateLimitService]:
    """The service on each backend; Redis ones on a fresh prefix, with one ``now`` for the test
    (hour windows that outlive it), so counts are exact."""
    mode = request.param
    if mode == "memory":
        limiter: Limiter = MemoryLimiter()
        now = 1_700_000_000.0
    else:
        server: RedisServer = request.getfixturevalue("redis_server")
        settings = (sync_settings if mode == "sync" else strict_settings)(server.url, redis_prefix=fresh_prefix())
        limiter = build_redis_limiter(settings) if mode == "sync" else build_strict_limiter(settings)
        await limiter.start()
        now = await steady_now()
    yield RateLimitService(h.config_of(RULES), limiter, clock=lambda: now)
    await limiter.close()


@pytest.fixture
def ask(h: Any, service: RateLimitService) -> Ask:
    """``await ask((key, value, hits), ...)``: one request; ``hits`` None is the request default (1)."""

    async def send(*descriptors: tuple[str, str, int | None]) -> Any:
        built = [h.descriptor((key, value), hits=hits) for key, value, hits in descriptors]
        return await service.decide(h.rate_request("ref", *built))

    return send


def statuses(response: Any) -> list[tuple[int, int]]:
    return [(status.code, status.limit_remaining) for status in response.statuses]


def row(service: RateLimitService, stat_key: str) -> dict[str, int]:
    return dict(zip(RULE_STATS, service.stats.rules.rows[stat_key], strict=True))


async def test_cause_1_a_passing_descriptor_of_a_refused_request_reports_the_stored_count(ask: Ask) -> None:
    answers = [statuses(await ask(("key2", "R", None), ("key3", "R", None))) for _ in range(13)]
    assert answers[:10] == [[(OK, 19 - n), (OK, 9 - n)] for n in range(10)]
    # key3 is over; key2's hits were not added, so 10 are left of its 20, every time.
    assert answers[10:] == [[(OK, 10), (OVER, 0)]] * 3


async def test_cause_1_per_descriptor_hits_counters_at_13_limits_15_and_14(ask: Ask) -> None:
    assert statuses(await ask(("fifteen", "x", 13), ("fourteen", "x", 13))) == [(OK, 2), (OK, 1)]
    refused = await ask(("fifteen", "x", 2), ("fourteen", "x", 2))
    assert refused.overall_code == OVER
    assert statuses(refused) == [(OK, 2), (OVER, 0)], "what is left is what the counter kept"
    assert statuses(await ask(("fifteen", "x", 2))) == [(OK, 0)], "the 2 really fit"


async def test_cause_1_a_counter_named_twice_in_a_refused_request(ask: Ask) -> None:
    await ask(("key2", "twice", 5))
    answer = await ask(("key2", "twice", 3), ("key2", "twice", 3), ("key3", "twice", 11))
    assert statuses(answer) == [(OK, 15), (OK, 15), (OVER, 0)]


def split(service: RateLimitService, stat_key: str, before: dict[str, int]) -> dict[str, int]:
    after = row(service, stat_key)
    return {
        name: after[name] - before.get(name, 0) for name in ("total_hits", "over_limit", "near_limit", "within_limit")
    }


@pytest.mark.parametrize(
    "case",
    [
        ("eight", 5, 2, {"total_hits": 2, "over_limit": 0, "near_limit": 1, "within_limit": 2}),
        ("twenty", 19, 3, {"total_hits": 3, "over_limit": 2, "near_limit": 1, "within_limit": 0}),
        ("twenty", 15, 7, {"total_hits": 7, "over_limit": 2, "near_limit": 4, "within_limit": 0}),
        ("twenty", 20, 2, {"total_hits": 2, "over_limit": 2, "near_limit": 0, "within_limit": 0}),
        ("twenty", 10, 6, {"total_hits": 6, "over_limit": 0, "near_limit": 0, "within_limit": 6}),
    ],
)
async def test_cause_2_multi_hit_stats_are_split_per_hit(
    ask: Ask, service: RateLimitService, case: tuple[str, int, int, dict[str, int]]
) -> None:
    key, stored, hits, expected = case  # limit of `key`, its count, then `hits` more
    if stored:
        await ask((key, "v", stored))
    before = row(service, f"ref.{key}")
    await ask((key, "v", hits))
    assert split(service, f"ref.{key}", before) == expected


async def test_cause_2_refused_request_stats(ask: Ask, service: RateLimitService) -> None:
    await ask(("fifteen", "s", 13), ("fourteen", "s", 13))
    fifteen, fourteen = row(service, "ref.fifteen"), row(service, "ref.fourteen")
    await ask(("fifteen", "s", 2), ("fourteen", "s", 2))
    # Passing, not added: its 2 hits count as the last two of the 13 kept (12 is the threshold).
    assert split(service, "ref.fifteen", fifteen) == {
        "total_hits": 2,
        "over_limit": 0,
        "near_limit": 1,
        "within_limit": 2,
    }
    # Over: 13 + 2 against 14: one hit past the limit, one between 11 and 14.
    assert split(service, "ref.fourteen", fourteen) == {
        "total_hits": 2,
        "over_limit": 1,
        "near_limit": 1,
        "within_limit": 0,
    }


async def test_cause_3_a_descriptor_without_entries_is_ok_with_no_limit(h: Any, service: RateLimitService) -> None:
    for domain in ("ref", "not_configured"):
        wire = await service.handle(h.rate_request(domain, h.descriptor(), h.descriptor(("key2", "e"))))
        assert isinstance(wire, bytes), wire
        answer = rls_pb2.RateLimitResponse.FromString(wire)
        assert answer.overall_code == OK
        assert [status.code for status in answer.statuses] == [OK, OK]
        assert not answer.statuses[0].HasField("current_limit")
        assert answer.statuses[1].HasField("current_limit") is (domain == "ref")
    assert service.stats.requests == 2, "counted as answered requests, not errors"
    assert not service.stats.errors


async def test_cause_4_share_threshold_keeps_the_pattern_under_detailed_metric(
    h: Any, service: RateLimitService
) -> None:
    for parent in (("service", "svc/user"), ("path", "path/foo")):
        await service.decide(h.rate_request("ref", h.descriptor(parent, ("endpoint", "get"))))
    rows = service.stats.rules.rows
    assert rows["ref.service_svc/*.endpoint_get"][TOTAL_HITS] == 1
    assert "ref.service_svc/user.endpoint_get" not in rows
    assert rows["ref.path_path/foo.endpoint_get"][TOTAL_HITS] == 1, "no share_threshold: the request's value"


def test_near_threshold_is_single_precision_like_the_reference() -> None:
    stats = RuleStats(near_ratio=0.7)
    counts = [0] * len(RULE_STATS)
    stats.record(counts, 1, False, shadow=False, count=7, limit=10)
    assert counts[NEAR_LIMIT] == 0, "floor(float32(10) * float32(0.7)) is 7: the 7th hit is not past it"
    stats.record(counts, 1, False, shadow=False, count=8, limit=10)
    assert (counts[NEAR_LIMIT], counts[WITHIN_LIMIT], counts[OVER_LIMIT]) == (1, 2, 0)


@pytest.mark.slow
def test_cause_6_stop_cache_key_increment_when_overlimit_set_explicitly(tmp_path: Path) -> None:
    """The reference's environment with STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT=true: the same
    remaining counts, from a process started with its variables only."""
    config = tmp_path / "runtime" / "ratelimit" / "config"
    config.mkdir(parents=True)
    (config / "ref.yaml").write_text(RULES.replace("\n    ", "\n").strip() + "\n")
    port = free_port()
    env = clean_env(
        RUNTIME_ROOT=str(tmp_path / "runtime"),
        RUNTIME_SUBDIRECTORY="ratelimit",
        GRPC_HOST="127.0.0.1",
        GRPC_PORT=str(port),
        PORT=str(free_port()),  # RUNTIME_* alone opens the reference's 0.0.0.0:8080, one per machine
        HOST="127.0.0.1",
        STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT="true",
    )
    sidecar = Sidecar(tmp_path, [], env).start(port=port, pass_address=False)
    try:
        sidecar.ask(with_hits(request("ref", [("fifteen", "p")], [("fourteen", "p")]), 13, 13))
        refused = sidecar.ask(with_hits(request("ref", [("fifteen", "p")], [("fourteen", "p")]), 2, 2))
        assert refused.overall_code == OVER
        assert statuses(refused) == [(OK, 2), (OVER, 0)]
    finally:
        sidecar.kill()


def with_hits(message: rls_pb2.RateLimitRequest, *hits: int) -> rls_pb2.RateLimitRequest:
    for descriptor, value in zip(message.descriptors, hits, strict=True):
        descriptor.hits_addend.value = value
    return message
