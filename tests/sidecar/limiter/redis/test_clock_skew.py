"""Clock skew between replicas, with real sidecar processes on one redis-server.

One replica's clock is pushed 30 s ahead (``--clock-offset 30``). With ``--clock-source
local`` the two disagree on where each minute window starts (their
``duration_until_reset`` differ by 30 s, and their hits go to different window keys);
with the default ``--clock-source redis`` both cut windows on Redis's clock and agree.
"""

from __future__ import annotations

from pathlib import Path

from tests.support.redis_servers import RedisServer, fresh_prefix
from tests.support.sidecars import OK, OVER_LIMIT, Sidecar, SidecarFactory, request, wait_for_replicas

SKEW = 30.0


def resets(sidecars: list[Sidecar], value: str) -> list[int]:
    """``duration_until_reset`` (s) of a minute rule, as each replica reports it."""
    return [
        sidecar.ask(request("it", [("per_minute", value)])).statuses[0].duration_until_reset.seconds
        for sidecar in sidecars
    ]


def pair(start_sidecar: SidecarFactory, config_dir: Path, redis_server: RedisServer, source: str) -> list[Sidecar]:
    flags = ["--backend", "redis", "--redis-url", redis_server.url, "--redis-prefix", fresh_prefix("clk")]
    flags += ["--clock-source", source, "--heartbeat-interval", "0.2"]
    # What is tested is where windows start, not Redis latency: with the 5 ms default a
    # slow escalation on a loaded machine falls back to the ``local`` failure mode, which
    # lets each of the two replicas admit ceil(5 / 2) = 3 and the exact count is lost.
    flags += ["--redis-timeout", "0.5"]
    sidecars = [
        start_sidecar(*flags, config=config_dir, metrics=True),
        start_sidecar(*flags, "--clock-offset", str(SKEW), config=config_dir, metrics=True),
    ]
    # Until a replica has seen the other's heartbeat it counts itself alone, and may admit
    # locally what the pair may admit together: wait until both count two. (On skewed
    # local clocks each takes the other's heartbeats for stale: only Redis's clock agrees.)
    if source == "redis":
        for sidecar in sidecars:
            wait_for_replicas(sidecar.metrics_port, 2)
    return sidecars


def gap(first: int, second: int) -> int:
    """How far apart two reset countdowns are, on a 60 s circle."""
    difference = abs(first - second) % 60
    return min(difference, 60 - difference)


def test_local_clocks_with_skew_disagree_on_windows(
    start_sidecar: SidecarFactory, config_dir: Path, redis_server: RedisServer
) -> None:
    sidecars = pair(start_sidecar, config_dir, redis_server, "local")
    assert gap(*resets(sidecars, "skew-local")) in range(29, 32)


def test_redis_clock_makes_skewed_replicas_agree(
    start_sidecar: SidecarFactory, config_dir: Path, redis_server: RedisServer
) -> None:
    sidecars = pair(start_sidecar, config_dir, redis_server, "redis")
    assert gap(*resets(sidecars, "skew-redis")) <= 1
    # One window, one counter: 5 per minute across both replicas.
    codes = [sidecars[index % 2].ask(request("it", [("per_minute", "shared")])).overall_code for index in range(6)]
    assert codes == [OK] * 5 + [OVER_LIMIT], codes
