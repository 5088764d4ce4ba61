"""The drain of a ``--backend redis`` sidecar hands its quota shares on (issue 25, defect 9
follow-up): the whole :class:`sidecar.server.Sidecar` in-process, a real redis-server, one
RLQS stream. After ``drain()`` (what SIGTERM runs) its records are gone from Redis, so the
other replicas need not wait for the hold; the stream closed first, as it does in a drain.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest

from sidecar.config import load_config
from sidecar.limiter.redis.clock import SharedClock
from sidecar.quota.buckets import bucket_key, bucket_of
from sidecar.quota.redis_shares import share_keys
from sidecar.server import Sidecar, build_limiter, build_quota_leases
from sidecar.settings import Settings
from tests.sidecar.quota.test_grpc import RULES, Client, report
from tests.support.redis_servers import RedisServer

pytestmark = [pytest.mark.slow, pytest.mark.redis]

BUCKET = bucket_of("q", [("user", "a")])


def drain_settings(directory: Path, redis_server: RedisServer, prefix: str, process: str) -> Settings:
    """A ``--backend redis`` sidecar with a short TTL and grace, quota mode ``process``."""
    (directory / "q.yaml").write_text(RULES)
    return Settings(
        config=str(directory),
        grpc_address="127.0.0.1:0",
        metrics_address="",
        watch_config=False,
        backend="redis",
        redis_url=redis_server.url,
        redis_prefix=prefix,
        quota_ttl=6,
        shutdown_grace=3.0,
        quota_process=process,
    )


@pytest.mark.parametrize("process", ["inline", "worker"])
async def test_a_drained_sidecar_gives_its_quota_leases_back(
    tmp_path: Path, redis_server: RedisServer, process: str
) -> None:
    """Inline the sidecar holds the leases; with the quota worker (the default) SIGTERM to
    the worker hands them on before it exits, within the serving process's grace."""
    prefix = f"drain{process}{time.monotonic_ns()}"
    settings = drain_settings(tmp_path, redis_server, prefix, process)
    clock = SharedClock(settings.clock_offset)
    leases = build_quota_leases(settings, clock) if process == "inline" else None  # the worker builds its own
    sidecar = Sidecar(settings, load_config(str(tmp_path)), build_limiter(settings, clock), clock, leases)
    await sidecar.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}")
    replicas = share_keys(prefix, bucket_key(BUCKET), -1)[0]
    check = redis_server.client()
    try:
        client = Client(channel)
        await client.send(report(BUCKET))
        await client.receive(timeout=30)
        for _ in range(40):  # the sync task's first call for the bucket (a tick is 0.25 s)
            if check.hlen(replicas):
                break
            await asyncio.sleep(0.1)
        assert check.hlen(replicas) == 1
        worker = sidecar.worker.running if sidecar.worker is not None else None
        await client.close()
        await sidecar.drain()
    finally:
        await channel.close()
    assert check.hlen(replicas) == 0  # handed on: no replica's record left for the bucket
    if leases is not None:
        assert leases.partition_counts().handed_on == 1
    else:
        assert worker is not None and worker.process.returncode == 0
