"""Sync mode under hostile input (issue 21, defects 1 and 3), against real redis-server.

* **Repeated descriptors** (defect 1): one request naming the same counter many times
  must not carry more hits past the blind cap than the cap allows. The local decision
  counts the hits earlier checks of the same request put on the counter, so across two
  replicas the admitted total stays within ``limit + (R - 1) * Q``. Checked on limiter
  objects and on two real sidecar processes (memory-exact strict mode alongside).
* **A unique-key flood during a Redis outage** (defect 3): ``--max-counters`` is a hard
  cap whatever the counters hold, a call does not get slower as the flood goes on, and
  in the ``local`` failure mode every hit admitted during the outage reaches Redis when
  it comes back (a counter that cannot be remembered is refused, not admitted and lost);
  in ``open`` mode such hits are admitted and counted as dropped.
"""

from __future__ import annotations

import asyncio
import re
import signal
import textwrap
import time
from pathlib import Path

import pytest

from sidecar.limiter.protocol import Check, Role
from sidecar.limiter.redis.keys import counter_window, replicas_key
from tests.sidecar.limiter.conftest import Fleet, steady_now
from tests.support.redis_servers import RedisServer, fresh_prefix
from tests.support.sidecars import OK, SidecarFactory, request, write_config

UNIT = 3600
LIMIT = 100
OVERSHOOT = 0.05
BOUND = LIMIT + int(OVERSHOOT * LIMIT)
"""``limit + (R - 1) * Q`` for two replicas: 105."""


def counter(server: RedisServer, prefix: str, check: Check, now: float) -> int:
    return int(server.client().get(counter_window(prefix, check.key, check.unit_seconds, now)[0]) or 0)


# -- defect 1: repeated descriptors ----------------------------------------------------------------


@pytest.mark.parametrize(("repeats", "hits"), [(64, 1), (19, 5)])
async def test_repeating_a_descriptor_does_not_bypass_the_blind_cap(
    redis_server: RedisServer, fleet: Fleet, repeats: int, hits: int
) -> None:
    prefix = fresh_prefix("r")
    pair = [fleet.build(redis_server.url, redis_prefix=prefix, sync_max_overshoot=OVERSHOOT) for _ in range(2)]
    for limiter in pair:
        await limiter.start()
    for limiter in pair:
        await limiter.replicas.beat()
    assert {limiter.replicas.live for limiter in pair} == {2}
    assert pair[0].blind_cap(LIMIT, 2) == 5

    now = await steady_now()
    check = Check(("dup", f"v{repeats}"), UNIT, LIMIT, hits, Role.ENFORCED)
    admitted = 0
    for limiter in pair:
        decision = await limiter.check([check] * repeats, now)
        admitted += repeats * hits if decision.admitted else 0
    for limiter in pair:
        await limiter.close()
    in_redis = counter(redis_server, prefix, check, now)
    assert admitted <= BOUND, f"{admitted} hits admitted against a limit of {LIMIT} (bound {BOUND})"
    assert in_redis == admitted
    assert sum(limiter.failure_decisions for limiter in pair) == 0


async def test_a_repeated_descriptor_within_the_blind_cap_is_still_decided_locally(
    redis_server: RedisServer, fleet: Fleet
) -> None:
    """The fix must not send every request with repeats to Redis: 2 x 2 hits fit a cap of 5."""
    prefix = fresh_prefix("r")
    pair = [fleet.build(redis_server.url, redis_prefix=prefix) for _ in range(2)]
    for limiter in pair:
        await limiter.start()
    for limiter in pair:
        await limiter.replicas.beat()
    now = await steady_now()
    check = Check(("dup", "small"), UNIT, LIMIT, 2, Role.ENFORCED)
    decision = await pair[0].check([check, check], now)
    assert decision.admitted
    assert (pair[0].local_decisions, pair[0].escalations) == (1, 0)
    decision = await pair[0].check([check, check], now)  # 4 held + 4 more > 5: Redis decides
    assert decision.admitted
    assert pair[0].escalations == 1


DUP_CONFIG = textwrap.dedent(
    f"""\
    domain: dup
    descriptors:
      - key: client
        rate_limit:
          unit: hour
          requests_per_unit: {LIMIT}
    """
)


def sum_counters(server: RedisServer, prefix: str) -> int:
    """Every window counter under ``prefix`` (markers and the replica set left out)."""
    client = server.client()
    window = re.compile(re.escape(prefix) + r":\{[0-9a-f]+\}:\d+")
    return sum(int(client.get(key) or 0) for key in client.scan_iter(f"{prefix}:*") if window.fullmatch(key))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "strict"])
@pytest.mark.parametrize("attack", [(64, 1), (19, 5)], ids=["64x1", "19x5"])
async def test_two_sidecars_hold_the_bound_against_repeated_descriptors(
    redis_server: RedisServer, start_sidecar: SidecarFactory, tmp_path: Path, mode: str, attack: tuple[int, int]
) -> None:
    """The attack of issue 21 against real processes: each replica gets one request that
    names the same descriptor ``repeats`` times with ``hits_addend`` ``hits`` (sync mode
    admitted 128 and 190 hits of 100; strict mode was exact and must stay so)."""
    repeats, hits = attack
    config = write_config(tmp_path / "conf", DUP_CONFIG, name="dup.yaml")
    prefix = fresh_prefix("p")
    flags = ["--backend", "redis", "--redis-url", redis_server.url, "--mode", mode, "--redis-prefix", prefix]
    flags += ["--heartbeat-interval", "0.2", "--redis-timeout", "0.5", "--shutdown-grace", "5"]
    sidecars = [start_sidecar(*flags, config=config) for _ in range(2)]
    client = redis_server.client()
    deadline = time.monotonic() + 10
    while client.zcard(replicas_key(prefix)) < 2:
        assert time.monotonic() < deadline, "the replicas never both beat"
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.6)  # a few beats: each replica counts the other

    admitted = 0
    for sidecar in sidecars:
        answer = await asyncio.to_thread(sidecar.ask, request("dup", *[[("client", "alice")]] * repeats, hits=hits))
        admitted += repeats * hits if answer.overall_code == OK else 0
    for sidecar in sidecars:
        sidecar.send_signal(signal.SIGTERM)
    for sidecar in sidecars:
        assert await asyncio.to_thread(sidecar.wait, 15) == 0, sidecar.stderr()
    assert admitted <= BOUND, f"{mode}: {admitted} hits admitted against a limit of {LIMIT} (bound {BOUND})"
    assert sum_counters(redis_server, prefix) == admitted
