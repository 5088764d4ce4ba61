"""The Redis budget is the caller's (issue 17), and the failure mode knows the count.

Unit tests of the budget arithmetic and of the servicer passing the gRPC deadline on
(only to backends that wait for Redis); then strict and sync limiters against a real
redis-server: a paused Redis answers within the caller's budget through the failure
mode, counted by reason; a deadline already spent never waits; and a replica whose
last script answer showed the counter nearly full admits no whole share on top of it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Sequence
from typing import Any

import pytest

from sidecar.limiter.budget import (
    DEADLINE_MARGIN,
    DEFAULT_REDIS_TIMEOUT,
    NO_DEADLINE_LIMIT,
    FailureReasons,
    caller_budget,
    redis_wait,
)
from sidecar.limiter.failure import FailurePolicy
from sidecar.limiter.known_counts import KnownCounts, knowledge_floor, local_counts
from sidecar.limiter.protocol import Check, Decision
from sidecar.settings import Settings
from tests.sidecar.limiter.conftest import Factory
from tests.support.redis_servers import RedisServer, fresh_prefix

# -- the arithmetic ------------------------------------------------------------------------


def test_the_default_bound_leaves_envoys_deadline_in_charge() -> None:
    assert DEFAULT_REDIS_TIMEOUT == 0.1
    assert caller_budget(0.025) < DEFAULT_REDIS_TIMEOUT
    assert Settings(config="x").redis_timeout == DEFAULT_REDIS_TIMEOUT


def test_caller_budget_keeps_a_margin_for_the_answer() -> None:
    assert caller_budget(None) is None
    assert caller_budget(0.025) == pytest.approx(0.020)  # 5 ms of Envoy's 25 ms
    assert caller_budget(0.1) == pytest.approx(0.08)  # 20 %
    assert caller_budget(0.010) == pytest.approx(0.010 - DEADLINE_MARGIN)  # at least 5 ms
    assert caller_budget(0.004) == pytest.approx(-0.001)  # already too late


def test_redis_wait_is_the_callers_budget_bounded_by_redis_timeout() -> None:
    assert redis_wait(0.02, None) == (0.02, NO_DEADLINE_LIMIT, False)
    assert redis_wait(0.02, 1.8) == (0.02, 1.8, False)  # --redis-timeout bounds Redis's share
    assert redis_wait(0.02, 0.015) == (0.015, 0.015, True)  # the caller's deadline comes first
    assert redis_wait(0.02, -0.001) == (0.0, 0.0, True)


def test_failure_reasons_count_per_reason() -> None:
    reasons = FailureReasons()
    reasons.note("deadline")
    reasons.note("deadline")
    reasons.note("redis_down")
    assert reasons.copy()["deadline"] == 2 and reasons.total() == 3


def test_the_local_share_starts_from_what_is_known() -> None:
    check = Check(("k",), 60, 20, 1)
    # 3 replicas: share 7. Knowing 18 admitted (this request's hit included: 19) leaves 2.
    assert knowledge_floor(check, 19, 3) == 7 - 20 + 19
    assert local_counts([check], [1], [19], 3) == (6,)  # 6 <= 7: admitted
    assert local_counts([check], [1], [21], 3) == (8,)  # 21 > 20 known: over the share
    known = KnownCounts(max_keys=2)
    known.learn("a", 5, expire_at=10, settled=True, now=0)
    known.admitted("a", 2, expire_at=10, now=0)
    assert known.known("a") == 7
    known.learn("a", 6, expire_at=10, settled=True, now=0)  # Redis now holds them: counted once
    assert known.known("a") == 6
    known.learn("b", 1, expire_at=10, settled=True, now=0)
    known.learn("c", 1, expire_at=20, settled=True, now=11)  # at the cap: ended windows go first
    assert known.known("a") is None and known.known("c") == 1


def late_policy(mode: str, live: int, known: int) -> tuple[FailurePolicy, list[Check], list[str]]:
    """A failure policy that last heard Redis say ``known`` on a 20-per-minute window."""
    policy = FailurePolicy(mode, lambda: live)  # type: ignore[arg-type]
    checks, keys = [Check(("k",), 60, 20, 1)], ["window"]
    policy.learn(checks, keys, [10**10], [known], [True], now=0.0)
    return policy, checks, keys


def test_late_with_redis_up_the_local_share_leaves_room_for_the_other_replicas() -> None:
    """Redis up, this request's time ran out: the others still admit through Redis, so the
    share applies only while what is known leaves them their shares (issue 17)."""
    # 3 replicas, share 7: the other two's 14 must fit in 20, so 6 with this hit at most.
    policy, checks, keys = late_policy("local", 3, 5)
    assert policy.check(checks, keys, [10**10], 0.0, late=True).admitted  # 5 + 1 <= 20 - 14
    policy, checks, keys = late_policy("local", 3, 7)
    assert not policy.check(checks, keys, [10**10], 0.0, late=True).admitted
    assert policy.check(checks, keys, [10**10], 0.0).admitted, "Redis down: the share, as in an outage"
    # One replica: nobody else admits; what is known is the floor, as without Redis.
    policy, checks, keys = late_policy("local", 1, 18)
    assert policy.check(checks, keys, [10**10], 0.0, late=True).admitted
    # Nothing known (no answer yet in this window): the share.
    policy = FailurePolicy("local", lambda: 3)
    assert policy.check(checks, keys, [10**10], 0.0, late=True).admitted
    # open stays open.
    policy, checks, keys = late_policy("open", 3, 19)
    assert policy.check(checks, keys, [10**10], 0.0, late=True).admitted


# -- the servicer --------------------------------------------------------------------------


class Context:
    """The part of a grpc.aio ServicerContext the handler reads."""

    def __init__(self, remaining: float | None) -> None:
        self.remaining = remaining
        self.asked = 0

    def time_remaining(self) -> float | None:
        self.asked += 1
        return self.remaining

    def invocation_metadata(self) -> tuple[()]:
        return ()

    async def abort(self, code: Any, message: str) -> None:
        raise AssertionError(message)


class Recording:
    def __init__(self, takes_budget: bool) -> None:
        self.takes_budget = takes_budget
        self.budgets: list[float | None] = []

    async def check(self, checks: Sequence[Check], now: float, budget: float | None = None) -> Decision:
        self.budgets.append(budget)
        return Decision(True, (False,) * len(checks), (1,) * len(checks), tuple(check.limit for check in checks))


def servicer_for(limiter: Recording) -> Any:
    from sidecar.config.load import parse_text
    from sidecar.config.model import RateLimitConfig
    from sidecar.protos.envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
    from sidecar.protos.envoy.service.ratelimit.v3 import rls_pb2
    from sidecar.service.servicer import RateLimitService

    text = "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 5}\n"
    domain, issues = parse_text(text, "d.yaml")
    assert domain is not None and not issues
    config = RateLimitConfig({"d": domain}, ("d.yaml",), "x")
    entry = ratelimit_pb2.RateLimitDescriptor.Entry(key="k", value="v")
    request = rls_pb2.RateLimitRequest(domain="d", descriptors=[ratelimit_pb2.RateLimitDescriptor(entries=[entry])])
    return RateLimitService(config, limiter), request  # type: ignore[arg-type]


async def test_the_servicer_passes_the_grpc_deadline_less_the_margin() -> None:
    limiter = Recording(takes_budget=True)
    service, request = servicer_for(limiter)
    await service.ShouldRateLimit(request, Context(0.025))
    await service.ShouldRateLimit(request, Context(None))
    assert limiter.budgets[0] == pytest.approx(0.020)
    assert limiter.budgets[1] is None


async def test_a_backend_that_never_waits_costs_no_deadline_lookup() -> None:
    limiter = Recording(takes_budget=False)
    service, request = servicer_for(limiter)
    context = Context(0.025)
    await service.ShouldRateLimit(request, context)
    assert context.asked == 0 and limiter.budgets == [None]


# -- against a real redis-server -----------------------------------------------------------


DEFAULTS = {"redis_timeout": DEFAULT_REDIS_TIMEOUT, "heartbeat_interval": 5}
"""Strict limiters here run at the default budget (the shared fixture's is generous)."""
GUARD = 30.0
"""Bounds a wait that must end far sooner; no test asserts how soon."""


@pytest.mark.redis
async def test_a_paused_redis_is_answered_within_the_callers_budget(own_redis: RedisServer, limiters: Factory) -> None:
    """Only the caller's 8 ms can end the wait: ``--redis-timeout`` is an hour here, so a
    check that returns at all (within a guard far below that hour) was bounded by the
    budget. No wall time is asserted."""
    limiter = limiters(own_redis.url, **{**DEFAULTS, "redis_timeout": 3600.0}, redis_prefix=fresh_prefix())
    await limiter.start()
    assert own_redis.process is not None
    os.kill(own_redis.process.pid, signal.SIGSTOP)
    try:
        asked = limiter.check([Check(("k",), 60, 5, 1)], time.time(), budget=0.008)
        decision = await asyncio.wait_for(asked, GUARD)
    finally:
        os.kill(own_redis.process.pid, signal.SIGCONT)
    assert decision.admitted
    assert limiter.reasons.counts["deadline"] == 1
    assert limiter.store.available, "one late answer within a budget is not an outage"


@pytest.mark.redis
async def test_a_spent_deadline_is_decided_at_once_without_redis(redis_server: RedisServer, limiters: Factory) -> None:
    limiter = limiters(redis_server.url, **DEFAULTS, redis_prefix=fresh_prefix())
    await limiter.start()
    trips = limiter.store.round_trips_request_path
    decision = await limiter.check([Check(("k",), 60, 5, 1)], time.time(), budget=-0.001)
    assert decision.admitted
    assert limiter.store.round_trips_request_path == trips
    assert limiter.reasons.counts["deadline"] == 1
    await asyncio.sleep(0.2)  # the owed hit reaches Redis: the counter equals the admitted hits
    assert limiter.ledger.reconciled()


@pytest.mark.redis
async def test_strict_fallback_adds_no_whole_share_on_top_of_what_redis_admitted(
    own_redis: RedisServer, limiters: Factory
) -> None:
    prefix = fresh_prefix()
    first, second = (limiters(own_redis.url, **DEFAULTS, redis_prefix=prefix) for _ in range(2))
    for limiter in (first, second):
        await limiter.start()
    for limiter in (first, second):
        await limiter.replicas.beat()
    assert first.replicas.live == 2
    item = Check(("burst",), 3600, 8, 1)
    now = time.time()
    for _ in range(5):
        assert (await second.check([item], now)).admitted
    assert (await first.check([item], now)).admitted  # Redis answered 6: first knows it
    first.store.availability.mark_down("test: Redis away")
    admitted = sum([(await first.check([item], now)).admitted for _ in range(6)])
    # Its share is ceil(8 / 2) = 4 with 1 used: 3 more before issue 17, 2 now (6 + 2 = 8).
    assert admitted == 2
    assert first.reasons.counts["redis_down"] == 6
