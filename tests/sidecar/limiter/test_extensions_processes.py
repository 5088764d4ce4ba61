"""Several limits per descriptor and windows of N units, in real sidecar processes of every mode.

Two replicas share one redis-server in sync and strict mode (one process alone for the
memory backend); requests alternate between them. What must hold everywhere: a
descriptor is refused by whichever of its limits is exhausted, no limit spends hits on
a refused request, the status reports the limit closest to exhaustion, and a window of
N units resets on its epoch-aligned boundary.
"""

from __future__ import annotations

import math
import textwrap
import time
from pathlib import Path

import pytest

from sidecar.limiter.windows import Unit
from tests.support.redis_servers import RedisServer, fresh_prefix
from tests.support.sidecars import (
    OK,
    OVER_LIMIT,
    Sidecar,
    SidecarFactory,
    request,
    wait_for_replicas,
    write_config,
)
from tests.support.windows import ensure_left

pytestmark = pytest.mark.slow

CONFIG = textwrap.dedent(
    """\
    domain: ext
    descriptors:
      - key: user
        rate_limits:
          - {name: user_per_second, unit: second, requests_per_unit: 3}
          - {name: user_per_minute, unit: minute, requests_per_unit: 5}
      - key: seven
        rate_limit: {name: seven_seconds, unit: second, unit_multiplier: 7, requests_per_unit: 4}
    """
)
MODES = ["memory", "sync", "strict"]


@pytest.fixture(params=MODES)
def replicas(request: pytest.FixtureRequest, start_sidecar: SidecarFactory, tmp_path: Path) -> list[Sidecar]:
    config = write_config(tmp_path / "config", CONFIG)
    mode = request.param
    if mode == "memory":
        return [start_sidecar(config=config)]
    redis: RedisServer = request.getfixturevalue("redis_server")
    flags = ["--backend", "redis", "--redis-url", redis.url, "--redis-prefix", fresh_prefix("ext"), "--mode", mode]
    flags += ["--redis-timeout", "0.5", "--heartbeat-interval", "0.2"]
    sidecars = [start_sidecar(*flags, config=config, metrics=True) for _ in range(2)]
    # Until a replica has seen the other's heartbeat it counts itself alone (and may decide
    # locally with the whole limit, so its limit_remaining would not count the other's hits).
    for sidecar in sidecars:
        wait_for_replicas(sidecar.metrics_port, 2)
    return sidecars


def next_window(unit: float, offset: float = 0.05) -> None:
    """Sleep to ``offset`` seconds into the next ``unit`` window."""
    time.sleep(unit - time.time() % unit + offset)


def test_the_exhausted_limit_refuses_and_the_others_spend_nothing(replicas: list[Sidecar]) -> None:
    user = f"u{time.time_ns()}"
    ensure_left(60, needed=3)  # both seconds below inside one minute
    next_window(1)
    first = [replicas[index % len(replicas)].ask(request("ext", [("user", user)])) for index in range(4)]
    assert [reply.overall_code for reply in first] == [OK, OK, OK, OVER_LIMIT]
    refused = first[3].statuses[0]
    assert refused.current_limit.name == "user_per_second", "the per-second limit is the one exhausted"
    assert first[2].statuses[0].limit_remaining == 0, "3/second left none; the minute still has 2"
    next_window(1)
    second = [replicas[index % len(replicas)].ask(request("ext", [("user", user)])) for index in range(3)]
    # The refused request spent nothing on the minute: exactly 5 - 3 = 2 more fit.
    assert [reply.overall_code for reply in second] == [OK, OK, OVER_LIMIT]
    status = second[2].statuses[0]
    assert (status.current_limit.name, status.current_limit.unit) == ("user_per_minute", Unit.MINUTE)
    assert status.duration_until_reset.seconds > 1, "a refused client waits for the minute"


def test_a_window_of_seven_seconds_resets_on_its_epoch_boundary(replicas: list[Sidecar]) -> None:
    value = f"s{time.time_ns()}"
    ensure_left(7, needed=3)
    before = 7 - time.time() % 7
    replies = [replicas[index % len(replicas)].ask(request("ext", [("seven", value)])) for index in range(5)]
    assert [reply.overall_code for reply in replies] == [OK] * 4 + [OVER_LIMIT]
    status = replies[0].statuses[0]
    # Exact from the 7 s boundary: the seconds left, rounded up, when the first request was decided.
    assert status.duration_until_reset.seconds in {math.ceil(before), math.ceil(before) - 1}
    assert status.current_limit.unit == Unit.SECOND, "7 seconds is no larger unit: reported per second"
    next_window(7, 0.1)
    assert replicas[-1].ask(request("ext", [("seven", value)])).overall_code == OK, "a new 7 s window"
