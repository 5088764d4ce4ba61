"""Token buckets, several limits per descriptor and bans, seen by an HTTP client through real Envoys.

Two pods (sidecar in strict mode + Envoy running ``envoy/front.yaml``) share one
redis-server, so one limit holds across both Envoys; the sidecars add the
``RateLimit-*`` headers. What we check is what a client of Envoy sees: 200s and 429s,
and ``Retry-After`` telling a refused client exactly when to come back (a bucket's next
token, a ban's end).
"""

from __future__ import annotations

import functools
import itertools
import textwrap
import time
from collections.abc import Iterator

import pytest

from stack.envoy import ENVOY_CONFIGS, EnvoyPorts, EnvoyProcess
from stack.processes import process_group
from stack.redis import RedisProcess
from stack.sidecar import SidecarProcess
from stack.upstream import UpstreamProcess
from tests.support.envoys import COUNTING_TIMEOUT, Reply, Session, fresh_window

pytestmark = [pytest.mark.envoy, pytest.mark.redis, pytest.mark.slow]
ADDRESSES = (f"198.51.100.{number}" for number in itertools.count(1))

CONFIG = textwrap.dedent(
    """\
    domain: demo
    descriptors:
      - key: remote_address
        rate_limit: {name: per_address, unit: minute, requests_per_unit: 6, algorithm: token_bucket, burst: 3}
      - key: generic_key
        value: api
        descriptors:
          - key: api_key
            rate_limits:
              - {name: key_per_second, unit: second, requests_per_unit: 2, ban_duration: 20}
              - {name: key_per_hour, unit: hour, requests_per_unit: 1000}
    """
)


@pytest.fixture(scope="module")
def envoys(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """URLs of two Envoys, each with its own strict-mode sidecar, on one redis-server."""
    directory = tmp_path_factory.mktemp("extensions")
    config = directory / "rules.yaml"
    config.write_text(CONFIG)
    with process_group() as group:
        redis = group.start_ready(functools.partial(RedisProcess, directory))
        app = group.start(UpstreamProcess("app", directory))
        flags = ["--config", str(config), "--backend", "redis", "--redis-url", redis.url, "--mode", "strict"]
        flags += ["--response-headers", "--redis-timeout", "0.5"]
        sidecars = group.start_all_ready(
            [functools.partial(SidecarProcess, f"sidecar-{index}", flags, directory) for index in (1, 2)]
        )
        app.wait_ready()
        envoys = []
        for index, sidecar in enumerate(sidecars, start=1):
            ports = EnvoyPorts.free(app=app.port, ratelimit=sidecar.port)
            envoy = group.start(
                EnvoyProcess(
                    f"envoy-{index}", ENVOY_CONFIGS / "front.yaml", ports, directory, timeout_seconds=COUNTING_TIMEOUT
                )
            )
            envoy.wait_ready()
            envoys.append(envoy)
        yield [envoy.url for envoy in envoys]
        for child in [*sidecars, *envoys]:
            assert child.alive(), child.log_tail()


def alternate(urls: list[str], requests: list[tuple[str, dict[str, str]]]) -> list[Reply]:
    """Send each ``(path, headers)`` through the Envoys in turn."""
    sessions = [Session(url) for url in urls]
    try:
        return [sessions[index % 2].send(path, headers) for index, (path, headers) in enumerate(requests)]
    finally:
        for session in sessions:
            session.close()


def test_a_token_bucket_across_two_envoys_tells_when_the_next_token_comes(envoys: list[str]) -> None:
    address = {"x-forwarded-for": next(ADDRESSES)}
    replies = alternate(envoys, [("/", address)] * 4)
    assert [reply.status for reply in replies] == [200, 200, 200, 429]
    assert [reply.header("ratelimit-remaining") for reply in replies] == ["2", "1", "0", "0"]
    assert {reply.header("ratelimit-limit") for reply in replies} == {"3"}, "a bucket's limit is its burst"
    # One token comes back every 10 s (6 a minute): the refused client waits for it.
    assert replies[3].header("retry-after") in {"9", "10"}
    # Envoy's own header shows the refill rate, from current_limit.
    assert replies[3].header("x-ratelimit-limit") == '6, 6;w=60;name="per_address"'


def test_going_over_one_limit_of_a_key_bans_it_on_both_envoys(envoys: list[str]) -> None:
    key = f"key-{time.time_ns()}"
    fresh_window(1, needed=1)

    def api() -> tuple[str, dict[str, str]]:
        return ("/api/items", {"x-api-key": key, "x-forwarded-for": next(ADDRESSES)})

    replies = alternate(envoys, [api() for _ in range(3)])
    assert [reply.status for reply in replies] == [200, 200, 429]
    refused = replies[2]
    assert refused.header("ratelimit-limit") == "2", "the status reports the per-second limit that refused"
    # Redis keeps a ban's end in whole seconds (rounded up): 20 s from now, and at most 1 s more.
    assert int(refused.header("retry-after") or 0) in range(20, 22), "the ban's end, not the second's"
    time.sleep(1.1)  # a new one-second window: only the ban refuses now, on either Envoy
    later = alternate(envoys, [api() for _ in range(2)])
    assert [reply.status for reply in later] == [429, 429]
    assert all(int(reply.header("retry-after") or 0) in range(18, 21) for reply in later)
