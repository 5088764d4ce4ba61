"""SIGTERM during a Redis outage (issue 21, defect 6): the drain uses what is left of the grace.

A real sidecar (sync and strict modes) against a real redis-server: Redis is stopped,
the failure mode admits 50 hits, the sidecar gets SIGTERM. Before the fix, sync gave up
after 0.8 s and strict after 1.3 s, though ``--shutdown-grace 10`` had time left: when
Redis came back 1.5 s after the signal it held none of the 50 hits, the process exited
0, and sync logged the loss at info level.

* Redis back within the grace: the last flush keeps probing and lands every hit.
* Redis away for the whole grace: the process still leaves within it (exit status 0,
  see docs/operations.md), and the loss is one error line with the count of hits.
"""

from __future__ import annotations

import asyncio
import re
import signal
import textwrap
import time
from pathlib import Path

import pytest

from tests.support.redis_servers import RedisServer, fresh_prefix
from tests.support.sidecars import OK, Sidecar, SidecarFactory, log_events, request, write_config

pytestmark = pytest.mark.slow

HITS = 50
CONFIG = textwrap.dedent(
    """\
    domain: outage
    descriptors:
      - key: client
        rate_limit:
          unit: hour
          requests_per_unit: 1000
    """
)


def window_total(server: RedisServer, prefix: str) -> int:
    client = server.client()
    window = re.compile(re.escape(prefix) + r":\{[0-9a-f]+\}:\d+")
    return sum(int(client.get(key) or 0) for key in client.scan_iter(f"{prefix}:*") if window.fullmatch(key))


async def admit_during_outage(server: RedisServer, sidecar: Sidecar) -> None:
    """Stop Redis, then spend ``HITS`` hits one call at a time (all admitted: far below the limit)."""
    server.kill()
    await asyncio.sleep(0.3)  # the sidecar notices (a flush or a script fails)
    for _ in range(HITS):
        answer = await asyncio.to_thread(sidecar.ask, request("outage", [("client", "alice")]))
        assert answer.overall_code == OK


def start(start_sidecar: SidecarFactory, tmp_path: Path, server: RedisServer, mode: str, grace: float) -> Sidecar:
    config = write_config(tmp_path / "conf", CONFIG, name="outage.yaml")
    prefix = fresh_prefix("o")
    flags = ["--backend", "redis", "--redis-url", server.url, "--mode", mode, "--redis-prefix", prefix]
    sidecar = start_sidecar(*flags, "--shutdown-grace", str(grace), config=config)
    sidecar.prefix = prefix  # type: ignore[attr-defined]
    return sidecar


@pytest.mark.parametrize("mode", ["sync", "strict"])
async def test_hits_admitted_in_an_outage_reach_redis_if_it_returns_within_the_grace(
    own_redis: RedisServer, start_sidecar: SidecarFactory, tmp_path: Path, mode: str
) -> None:
    grace = 10.0
    sidecar = start(start_sidecar, tmp_path, own_redis, mode, grace)
    await admit_during_outage(own_redis, sidecar)

    signalled = time.monotonic()
    sidecar.send_signal(signal.SIGTERM)
    await asyncio.sleep(1.5)
    await asyncio.to_thread(own_redis.start)
    code = await asyncio.to_thread(sidecar.wait, grace + 10)
    took = time.monotonic() - signalled

    stderr = sidecar.stderr()
    assert code == 0, stderr
    assert took < grace + 2, f"the drain took {took:.1f} s, past the {grace:g} s grace"
    assert window_total(own_redis, sidecar.prefix) == HITS, stderr  # type: ignore[attr-defined]
    events = log_events(stderr)
    assert not [event for event in events if event["event"] == "admitted_hits_lost"], stderr


@pytest.mark.parametrize("mode", ["sync", "strict"])
async def test_hits_lost_when_redis_stays_away_are_one_error_with_the_count(
    own_redis: RedisServer, start_sidecar: SidecarFactory, tmp_path: Path, mode: str
) -> None:
    grace = 2.0
    sidecar = start(start_sidecar, tmp_path, own_redis, mode, grace)
    await admit_during_outage(own_redis, sidecar)

    signalled = time.monotonic()
    sidecar.send_signal(signal.SIGTERM)
    code = await asyncio.to_thread(sidecar.wait, grace + 10)
    took = time.monotonic() - signalled

    stderr = sidecar.stderr()
    assert code == 0, stderr
    assert took >= grace - 0.5, f"gave up after {took:.1f} s of a {grace:g} s grace"
    assert took < grace + 2, f"the drain took {took:.1f} s, past the {grace:g} s grace"
    lost = [event for event in log_events(stderr) if event["event"] == "admitted_hits_lost"]
    assert len(lost) == 1, stderr
    assert lost[0]["level"] == "error"
    assert lost[0]["hits"] == HITS
    assert lost[0]["mode"] == mode
