"""Service semantics without a gRPC server: ``RateLimitService.decide`` with a fake clock."""

from __future__ import annotations

import grpc
import pytest

from sidecar.config.match import match_descriptor
from sidecar.limiter.memory import MemoryLimiter
from sidecar.limiter.windows import Unit
from sidecar.protos.envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from sidecar.protos.envoy.service.ratelimit.v3 import rls_pb2
from sidecar.service.servicer import RateLimitService
from sidecar.service.wire import UNLIMITED_REMAINING

OK = rls_pb2.RateLimitResponse.OK
OVER = rls_pb2.RateLimitResponse.OVER_LIMIT
MINUTE = 60

RULES = """
    domain: svc
    descriptors:
      - key: user
        rate_limit: {name: per_user, unit: minute, requests_per_unit: 3}
      - key: route
        value: api
        rate_limit: {name: api_route, unit: second, requests_per_unit: 5}
        descriptors:
          - key: key
            value: "premium-*"
            rate_limit:
              name: premium
              unit: minute
              requests_per_unit: 100
              replaces: [{name: api_route}]
      - key: internal
        rate_limit: {unlimited: true, name: internal}
      - key: tight
        rate_limit: {name: tight, unit: minute, requests_per_unit: 1}
      - key: loose
        rate_limit: {unit: hour, requests_per_unit: 10}
      - key: shadow
        shadow_mode: true
        rate_limit: {name: shadowed, unit: minute, requests_per_unit: 1}
      - key: quota
        value: a
        quota_mode: true
        rate_limit: {name: quota_a, unit: minute, requests_per_unit: 1}
      - key: quota
        value: b
        quota_mode: true
        rate_limit: {name: quota_b, unit: minute, requests_per_unit: 2}
"""


@pytest.fixture
def make_service(h, clock):
    def make(limiter: MemoryLimiter | None = None) -> RateLimitService:
        return RateLimitService(h.config_of(RULES), limiter or MemoryLimiter(), clock=clock)

    return make


@pytest.fixture
def service(make_service):
    return make_service()


@pytest.fixture
def ask(h, service):
    """Send one request of descriptors (pair lists) to the service in domain ``svc``."""

    async def send(*descriptors, hits: int = 0, domain: str = "svc", to=None):
        built = [d if not isinstance(d, list) else h.descriptor(*d) for d in descriptors]
        return await (to or service).decide(h.rate_request(domain, *built, hits=hits))

    return send


def codes(response) -> tuple[int, list[int]]:
    return response.overall_code, [status.code for status in response.statuses]


def count_of(service: RateLimitService, key: str, value: str) -> int:
    """What the counter of the rule ``(key, value)`` lands on holds now."""
    domain = service.config.domains["svc"]
    match = match_descriptor(domain, [ratelimit_pb2.RateLimitDescriptor.Entry(key=key, value=value)])
    assert match is not None
    return service.limiter.count(match.key, match.rule.unit_seconds, service.clock())


async def test_unknown_domain_is_all_ok_without_limits(h, ask):
    response = await ask([("user", "u")], h.descriptor(("user", "u"), limit=(1, Unit.SECOND)), domain="elsewhere")
    assert codes(response) == (OK, [OK, OK])
    for status in response.statuses:
        assert not status.HasField("current_limit")
        assert not status.HasField("duration_until_reset")
        assert status.limit_remaining == 0


async def test_no_matching_rule_is_ok_without_limit(ask, service):
    response = await ask(
        [("nothing", "x")], [("route", "other")], [("route", "api"), ("key", "plain")], [("user", "u"), ("x", "y")]
    )
    assert codes(response) == (OK, [OK, OK, OK, OK])
    assert not any(status.HasField("current_limit") for status in response.statuses)
    assert service.limiter.live_counters == 0


async def test_unlimited_rule(ask, service):
    for _ in range(5):
        response = await ask([("internal", "anyone")], hits=1000)
        assert codes(response) == (OK, [OK])
        status = response.statuses[0]
        assert status.limit_remaining == UNLIMITED_REMAINING == 4294967295
        assert not status.HasField("current_limit")
        assert not status.HasField("duration_until_reset")
    assert service.limiter.live_counters == 0


async def test_unlimited_next_to_a_limited_rule(ask):
    response = await ask([("internal", "x")], [("tight", "t")])
    assert codes(response) == (OK, [OK, OK])
    assert response.statuses[0].limit_remaining == UNLIMITED_REMAINING
    assert response.statuses[1].current_limit.name == "tight"
    response = await ask([("internal", "x")], [("tight", "t")])
    assert codes(response) == (OVER, [OK, OVER])


async def test_replaces_drops_the_named_limit_within_the_request(ask):
    response = await ask([("route", "api")], [("route", "api"), ("key", "premium-1")])
    assert codes(response) == (OK, [OK, OK])
    assert not response.statuses[0].HasField("current_limit")
    assert response.statuses[1].current_limit.name == "premium"
    # The replaced rule spent nothing: its five hits per second are all still there.
    for expected in (4, 3, 2, 1, 0):
        response = await ask([("route", "api")])
        assert response.statuses[0].current_limit.name == "api_route"
        assert response.statuses[0].limit_remaining == expected
    assert codes(await ask([("route", "api")])) == (OVER, [OVER])
    # With api_route exhausted, premium keys still pass because it is replaced for them.
    response = await ask([("route", "api")], [("route", "api"), ("key", "premium-2")])
    assert codes(response) == (OK, [OK, OK])


async def test_request_override_wins_over_the_config(h, ask):
    override = h.descriptor(("user", "u"), limit=(2, Unit.HOUR))
    first = await ask(override)
    status = first.statuses[0]
    assert (status.current_limit.requests_per_unit, status.current_limit.unit) == (2, Unit.HOUR)
    assert status.current_limit.name == ""
    assert status.limit_remaining == 1
    assert codes(await ask(override)) == (OK, [OK])
    assert codes(await ask(override)) == (OVER, [OVER])
    # The configured per_user counter was not touched.
    assert (await ask([("user", "u")])).statuses[0].limit_remaining == 2


async def test_override_counter_is_shared_between_different_numbers(h, ask):
    def with_limit(requests: int, unit: Unit = Unit.MINUTE):
        return h.descriptor(("client", "c"), ("path", "/x"), limit=(requests, unit))

    assert codes(await ask(with_limit(2))) == (OK, [OK])
    assert codes(await ask(with_limit(2))) == (OK, [OK])
    assert codes(await ask(with_limit(2))) == (OVER, [OVER])
    response = await ask(with_limit(3))
    assert codes(response) == (OK, [OK])
    assert response.statuses[0].limit_remaining == 0
    assert codes(await ask(with_limit(3))) == (OVER, [OVER])
    # Another unit is another counter, and so are other entries.
    assert codes(await ask(with_limit(1, Unit.HOUR))) == (OK, [OK])
    assert codes(await ask(h.descriptor(("client", "c"), ("path", "/y"), limit=(1, Unit.MINUTE)))) == (OK, [OK])
    assert codes(await ask(h.descriptor(("client", "c"), limit=(1, Unit.MINUTE)))) == (OK, [OK])


async def test_override_applies_where_no_rule_matches(h, ask):
    response = await ask(h.descriptor(("nothing", "x"), limit=(0, Unit.SECOND)))
    assert codes(response) == (OVER, [OVER])
    assert response.statuses[0].current_limit.requests_per_unit == 0


@pytest.mark.parametrize(
    ("request_hits", "descriptor_hits", "spent"),
    [
        (0, None, 1),
        (1, None, 1),
        (3, None, 3),
        (3, 0, 0),
        (0, 0, 0),
        (0, 2, 2),
        (5, 1, 1),
    ],
)
async def test_hits(h, ask, request_hits, descriptor_hits, spent):
    response = await ask(h.descriptor(("loose", "l"), hits=descriptor_hits), hits=request_hits)
    assert codes(response) == (OK, [OK])
    assert response.statuses[0].limit_remaining == 10 - spent
    assert response.statuses[0].current_limit.requests_per_unit == 10


async def test_per_descriptor_hits_in_one_request(h, ask, service):
    response = await ask(
        h.descriptor(("loose", "a"), hits=4), h.descriptor(("loose", "b")), h.descriptor(("loose", "c"), hits=0), hits=2
    )
    assert [status.limit_remaining for status in response.statuses] == [6, 8, 10]
    assert service.limiter.live_counters == 2


async def test_zero_hits_checks_without_spending(h, ask):
    await ask([("tight", "t")])
    check_only = await ask(h.descriptor(("tight", "t"), hits=0))
    assert codes(check_only) == (OK, [OK])
    assert check_only.statuses[0].limit_remaining == 0
    assert codes(await ask([("tight", "t")])) == (OVER, [OVER])


async def test_current_limit_remaining_and_reset(ask, clock):
    clock.now = 1_700_000_010.25  # 30.25 s into a minute, 810.25 s into an hour
    response = await ask([("user", "u")], [("loose", "l")], [("route", "api")])
    user, loose, route = response.statuses
    assert (user.current_limit.requests_per_unit, user.current_limit.unit, user.current_limit.name) == (
        3,
        Unit.MINUTE,
        "per_user",
    )
    assert (loose.current_limit.requests_per_unit, loose.current_limit.unit, loose.current_limit.name) == (
        10,
        Unit.HOUR,
        "",
    )
    assert route.current_limit.unit == Unit.SECOND
    assert [status.limit_remaining for status in response.statuses] == [2, 9, 4]
    assert [status.duration_until_reset.seconds for status in response.statuses] == [30, 2790, 1]
    assert all(status.duration_until_reset.nanos == 0 for status in response.statuses)


async def test_limit_remaining_counts_down_to_over_limit(ask):
    seen = []
    for _ in range(5):
        response = await ask([("user", "u")])
        seen.append((response.overall_code, response.statuses[0].code, response.statuses[0].limit_remaining))
    assert seen == [(OK, OK, 2), (OK, OK, 1), (OK, OK, 0), (OVER, OVER, 0), (OVER, OVER, 0)]
    # Another user has a counter of its own.
    assert (await ask([("user", "v")])).statuses[0].limit_remaining == 2


async def test_window_resets_with_the_clock(ask, clock):
    assert codes(await ask([("tight", "t")])) == (OK, [OK])
    assert codes(await ask([("tight", "t")])) == (OVER, [OVER])
    clock.advance(29.999)
    assert codes(await ask([("tight", "t")])) == (OVER, [OVER])
    clock.advance(0.001)
    response = await ask([("tight", "t")])
    assert codes(response) == (OK, [OK])
    assert response.statuses[0].duration_until_reset.seconds == 60


async def test_overall_code_is_over_when_any_enforced_descriptor_is(ask):
    await ask([("tight", "t")])
    response = await ask([("loose", "l")], [("tight", "t")], [("nothing", "n")])
    assert codes(response) == (OVER, [OK, OVER, OK])


async def test_quota_mode_rejects_only_when_every_quota_is_over(ask):
    assert codes(await ask([("quota", "a")], [("quota", "b")])) == (OK, [OK, OK])
    response = await ask([("quota", "a")], [("quota", "b")])
    assert codes(response) == (OK, [OVER, OK])
    response = await ask([("quota", "a")], [("quota", "b")])
    assert codes(response) == (OVER, [OVER, OVER])
    # An enforced rule over the limit still rejects, whatever the quotas say.
    await ask([("tight", "t")])
    assert codes(await ask([("quota", "z")], [("tight", "t")]))[0] == OVER


async def test_shadow_rule_reports_ok_and_still_counts(ask, service):
    for expected_count in (1, 2, 3):
        response = await ask([("shadow", "s")])
        assert codes(response) == (OK, [OK])
        assert response.statuses[0].current_limit.name == "shadowed"
        assert count_of(service, "shadow", "s") == expected_count
    assert response.statuses[0].limit_remaining == 0


async def test_shadow_rule_spends_nothing_when_the_request_is_rejected(ask, service):
    await ask([("tight", "t")])
    response = await ask([("shadow", "s")], [("tight", "t")])
    assert codes(response) == (OVER, [OK, OVER])
    assert count_of(service, "shadow", "s") == 0


async def test_global_shadow_mode_keeps_codes_but_admits(ask, make_service):
    service = make_service(MemoryLimiter(admit_all=True))
    first = await ask([("tight", "t")], [("loose", "l")], to=service)
    assert codes(first) == (OK, [OK, OK])
    second = await ask([("tight", "t")], [("loose", "l")], to=service)
    assert codes(second) == (OK, [OVER, OK])
    third = await ask([("tight", "t")], [("loose", "l")], to=service)
    assert codes(third) == (OK, [OVER, OK])
    assert count_of(service, "tight", "t") == 3
    assert third.statuses[1].limit_remaining == 7


async def test_a_rejected_request_consumes_nothing(ask, service):
    assert [s.limit_remaining for s in (await ask([("loose", "l")], [("tight", "t")])).statuses] == [9, 0]
    for _ in range(3):
        response = await ask([("loose", "l")], [("user", "u")], [("tight", "t")])
        assert codes(response) == (OVER, [OK, OK, OVER])
    assert count_of(service, "loose", "l") == 1
    assert count_of(service, "user", "u") == 0
    assert (await ask([("loose", "l")])).statuses[0].limit_remaining == 8


async def test_instances_share_the_limit(ask, make_service):
    service = make_service(MemoryLimiter(instances=2))
    remaining = []
    for _ in range(3):
        response = await ask([("user", "u")], to=service)
        assert response.statuses[0].current_limit.requests_per_unit == 3
        remaining.append((response.overall_code, response.statuses[0].limit_remaining))
    assert remaining == [(OK, 1), (OK, 0), (OVER, 0)]


async def test_config_swap_takes_effect_on_the_next_request(h, ask, service):
    assert codes(await ask([("tight", "t")])) == (OK, [OK])
    service.config = h.config_of(
        "domain: svc\ndescriptors:\n  - key: other\n    rate_limit: {unit: second, requests_per_unit: 1}\n"
    )
    assert codes(await ask([("tight", "t")])) == (OK, [OK])
    assert (await ask([("other", "o")])).statuses[0].current_limit.requests_per_unit == 1


class AbortError(Exception):
    """What ``context.abort`` raises, as grpc.aio's does."""


class FakeContext:
    def __init__(self) -> None:
        self.aborted: tuple[grpc.StatusCode, str] | None = None

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.aborted = (code, details)
        raise AbortError(details)


async def test_rpc_answers_a_valid_request(h, service):
    context = FakeContext()
    response = await service.ShouldRateLimit(h.rate_request("svc", h.descriptor(("user", "u"))), context)
    assert type(response) is bytes  # wire bytes: gRPC sends them as they are
    assert codes(rls_pb2.RateLimitResponse.FromString(response)) == (OK, [OK])
    assert context.aborted is None


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda h: h.rate_request("", h.descriptor(("k", "v"))), "domain: must not be empty"),
        (lambda h: h.rate_request("svc"), "descriptors: at least one descriptor is required"),
        (lambda h: h.rate_request("svc", h.descriptor(("", "v"))), "descriptors[0].entries[0].key: must not be empty"),
    ],
)
async def test_rpc_refuses_invalid_requests(h, service, build, message):
    context = FakeContext()
    with pytest.raises(AbortError):
        await service.ShouldRateLimit(build(h), context)
    assert context.aborted == (grpc.StatusCode.INVALID_ARGUMENT, message)
    assert service.limiter.live_counters == 0


async def test_rpc_turns_a_backend_fault_into_internal(h, make_service):
    class Broken(MemoryLimiter):
        async def check(self, checks, now):
            raise RuntimeError("backend exploded")

    service = make_service(Broken())
    context = FakeContext()
    with pytest.raises(AbortError):
        await service.ShouldRateLimit(h.rate_request("svc", h.descriptor(("user", "u"))), context)
    assert context.aborted is not None
    assert context.aborted[0] is grpc.StatusCode.INTERNAL
    assert "backend exploded" not in context.aborted[1]


def test_undecodable_bytes_parse_to_none_so_the_handler_can_answer_invalid_argument():
    from sidecar.service.servicer import parse_request

    assert parse_request(b"\x0f") is None
    assert parse_request(b"\x0a\x02\xff\xfe") is None
    assert parse_request(b"\x0a\x01d").domain == "d"
