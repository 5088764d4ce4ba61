"""Real HTTP through real Envoy, real sidecar processes and a real redis-server.

The stack is the demo's (``envoy/front.yaml``, which trusts one X-Forwarded-For hop,
so each test acts as its own client address and never shares a counter with another).
The descriptor-shape tests put a recording RateLimitService behind the per-pod config
(``envoy/sidecar.yaml``) to see exactly what Envoy's filter sends.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sidecar.settings import Settings
from stack.envoy import ENVOY_CONFIGS, EnvoyPorts, EnvoyProcess
from stack.processes import ProcessGroup, process_group
from stack.sidecar import SidecarProcess
from stack.topology import EXAMPLE_CONFIG, Stack, StackOptions, running_stack
from stack.upstream import UpstreamProcess
from tests.support.envoys import (
    COUNTING_TIMEOUT,
    RecordingRateLimitService,
    Reply,
    Session,
    descriptors,
    fresh_window,
    send,
    wait_for,
)

pytestmark = [pytest.mark.envoy, pytest.mark.redis, pytest.mark.slow]
ADDRESSES = (f"198.51.100.{number}" for number in itertools.count(1))
"""A new client address per test: counters never carry over between tests."""


def client(headers: dict[str, str] | None = None) -> dict[str, str]:
    return {"x-forwarded-for": next(ADDRESSES), **(headers or {})}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Two pods (app + sidecar + Envoy each), sidecars in sync mode on one redis-server."""
    with running_stack(tmp_path_factory.mktemp("stack"), StackOptions(replicas=2)) as running:
        yield running
        for replica in running.replicas:
            assert replica.sidecar.alive(), replica.sidecar.log_tail()
            assert replica.envoy.alive(), replica.envoy.log_tail()


def burst(session: Session, count: int, path: str, headers: dict[str, str], method: str = "GET") -> list[Reply]:
    return [session.send(path, headers, method) for _ in range(count)]


def statuses(replies: list[Reply]) -> list[int]:
    return [reply.status for reply in replies]


def test_per_address_limit_gives_exactly_the_limit_then_429_with_headers(stack: Stack) -> None:
    session = Session(stack.envoy_urls[0])
    headers = client()
    fresh_window(1)
    replies = burst(session, 25, "/", headers)
    session.close()
    assert statuses(replies) == [200] * 20 + [429] * 5
    for sent, reply in enumerate(replies[:20], start=1):
        assert reply.header("x-ratelimit-limit") == "20, 20;w=1"
        assert reply.header("x-ratelimit-remaining") == str(20 - sent)
        assert reply.header("x-ratelimit-reset") == "1"
        assert reply.header("x-envoy-ratelimited") is None
        assert reply.body.startswith(b"hello from app-1")
    for reply in replies[20:]:
        assert reply.header("x-envoy-ratelimited") == "true"
        assert (reply.header("x-ratelimit-remaining"), reply.header("x-ratelimit-reset")) == ("0", "1")


def test_api_key_limit_per_minute_and_the_headers_of_the_tightest_limit(stack: Stack) -> None:
    session = Session(stack.envoy_urls[0])
    headers = client({"x-api-key": f"key-{time.time_ns()}"})
    left = fresh_window(60, needed=5)
    replies = burst(session, 12, "/api/items", headers)
    session.close()
    assert statuses(replies) == [200] * 10 + [429] * 2
    expected_limit = '10, 20;w=1, 50;w=1;name="api_route", 10;w=60;name="per_api_key"'
    for sent, reply in enumerate(replies[:10], start=1):
        assert reply.header("x-ratelimit-limit") == expected_limit
        assert reply.header("x-ratelimit-remaining") == str(10 - sent)
        assert abs(int(reply.header("x-ratelimit-reset") or -1) - math.ceil(left)) <= 2
    assert replies[-1].header("x-envoy-ratelimited") == "true"


def test_premium_key_replaces_the_route_cap_and_monitoring_is_unlimited(stack: Stack) -> None:
    session = Session(stack.envoy_urls[0])
    fresh_window(60, needed=5)
    premium = burst(session, 12, "/api/items", client({"x-api-key": "premium-e2e"}))
    monitoring = burst(session, 15, "/api/items", client({"x-api-key": "internal-monitoring"}))
    session.close()
    assert statuses(premium) == [200] * 12
    assert premium[0].header("x-ratelimit-limit") == '20, 20;w=1, 100;w=60;name="premium_key"'
    assert statuses(monitoring) == [200] * 15
    assert "per_api_key" not in (monitoring[0].header("x-ratelimit-limit") or "")


def test_without_the_api_key_header_only_the_route_and_address_limits_apply(stack: Stack) -> None:
    session = Session(stack.envoy_urls[0])
    fresh_window(1)
    replies = burst(session, 12, "/api/items", client())
    session.close()
    assert statuses(replies) == [200] * 12
    assert replies[0].header("x-ratelimit-limit") == '20, 20;w=1, 50;w=1;name="api_route"'


def test_two_envoys_and_two_sidecars_on_one_redis_hold_one_limit(stack: Stack) -> None:
    session = Session(*stack.envoy_urls)  # alternates: odd requests via envoy-1, even via envoy-2
    headers = client()
    fresh_window(1)
    replies = burst(session, 40, "/", headers)
    session.close()
    admitted = statuses(replies).count(200)
    bound = math.floor(Settings.sync_max_overshoot * 20)  # (R - 1) * Q with R = 2
    assert 20 <= admitted <= 20 + bound, statuses(replies)
    served_by = {reply.body.split()[-1] for reply in replies if reply.status == 200}
    assert served_by == {b"app-1", b"app-2"}


def test_writes_are_limited_across_addresses_and_a_refused_write_costs_nothing(stack: Stack) -> None:
    session = Session(stack.envoy_urls[0])
    fresh_window(1)
    replies = [session.send("/orders", client(), "POST") for _ in range(8)]
    session.close()
    assert statuses(replies) == [200] * 5 + [429] * 3
    assert replies[-1].header("x-ratelimit-limit") == "5, 20;w=1, 5;w=1"


def test_shadow_mode_login_limit_never_refuses(stack: Stack) -> None:
    session = Session(stack.envoy_urls[0])
    headers = client()
    fresh_window(60, needed=5)
    replies = [session.send("/login", headers, "GET") for _ in range(6)]
    session.close()
    assert statuses(replies) == [200] * 6


# -- what the real filter sends ------------------------------------------------------------------


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RecordingRateLimitService, str]]:
    """The per-pod config (envoy/sidecar.yaml) in front of the app, calling a recording service."""
    directory = tmp_path_factory.mktemp("recorded")
    with RecordingRateLimitService() as service, process_group() as group:
        app = group.start(UpstreamProcess("app", directory))
        app.wait_ready()
        ports = EnvoyPorts.free(app=app.port, ratelimit=service.port)
        envoy = group.start(
            EnvoyProcess("envoy", ENVOY_CONFIGS / "sidecar.yaml", ports, directory, timeout_seconds=COUNTING_TIMEOUT)
        )
        envoy.wait_ready()
        yield service, f"http://127.0.0.1:{ports.listen}"


@pytest.mark.parametrize(
    ("method", "path", "headers", "expected"),
    [
        ("GET", "/", {}, [[("remote_address", "127.0.0.1")]]),
        (
            "GET",
            "/api/items",
            {"x-api-key": "alice"},
            [
                [("remote_address", "127.0.0.1")],
                [("generic_key", "api")],
                [("generic_key", "api"), ("api_key", "alice")],
            ],
        ),
        # No header: Envoy drops the whole (generic_key, api_key) descriptor, not just the entry.
        ("GET", "/api/items", {}, [[("remote_address", "127.0.0.1")], [("generic_key", "api")]]),
        ("DELETE", "/", {}, [[("remote_address", "127.0.0.1")], [("header_match", "write")]]),
        (
            "POST",
            "/login",
            {},
            [
                [("remote_address", "127.0.0.1")],
                [("generic_key", "login"), ("remote_address", "127.0.0.1")],
                [("header_match", "write")],
            ],
        ),
        # The pod config trusts no X-Forwarded-For hop: a client cannot pick its own address.
        ("GET", "/", {"x-forwarded-for": "203.0.113.1"}, [[("remote_address", "127.0.0.1")]]),
    ],
)
def test_descriptors_the_real_filter_sends(
    recorded: tuple[RecordingRateLimitService, str],
    method: str,
    path: str,
    headers: dict[str, str],
    expected: list[list[tuple[str, str]]],
) -> None:
    service, url = recorded
    service.take()
    assert send(url, path, headers, method).status == 200
    calls = service.take()
    assert len(calls) == 1, "all rate_limits entries of a route go in one ShouldRateLimit call"
    assert calls[0].domain == "demo"
    assert descriptors(calls[0]) == expected
    assert calls[0].hits_addend == 0, "Envoy leaves hits_addend unset: one hit"


# -- when the sidecar is down ----------------------------------------------------------------------


def start_envoy(
    group: ProcessGroup, directory: Path, deny: bool, sidecar: SidecarProcess, app_port: int
) -> EnvoyProcess:
    ports = EnvoyPorts.free(app=app_port, ratelimit=sidecar.port)
    name = "envoy-deny" if deny else "envoy-open"
    envoy = EnvoyProcess(name, ENVOY_CONFIGS / "front.yaml", ports, directory, failure_mode_deny=deny)
    group.start(envoy)
    envoy.wait_ready()
    return envoy


def test_sidecar_down_fails_open_or_closed_and_recovers(tmp_path: Path) -> None:
    with process_group() as group:
        app = group.start_ready(lambda: UpstreamProcess("app", tmp_path))
        sidecar = group.start_ready(lambda: SidecarProcess("sidecar", ["--config", str(EXAMPLE_CONFIG)], tmp_path))
        fail_open = start_envoy(group, tmp_path, False, sidecar, app.port)
        fail_closed = start_envoy(group, tmp_path, True, sidecar, app.port)
        open_url, deny_url = fail_open.url, fail_closed.url
        headers = client()
        assert send(open_url, "/", headers).status == 200
        assert send(deny_url, "/", headers).status == 200

        sidecar.stop()
        assert [send(open_url, "/", headers).status for _ in range(30)] == [200] * 30, "fail open: no limit"
        down = send(deny_url, "/", headers)
        assert down.status == 500, "failure_mode_deny: refused while the limiter is unknown"
        assert fail_open.counters().get("failure_mode_allowed", 0) >= 30
        assert fail_closed.counters().get("error", 0) >= 1

        sidecar.start()
        sidecar.wait_ready()
        wait_for(lambda: send(deny_url, "/", client()).status == 200, 15, "Envoy to reach the sidecar again")
        fresh_window(1)
        again = client()
        assert [send(open_url, "/", again).status for _ in range(22)] == [200] * 20 + [429] * 2
