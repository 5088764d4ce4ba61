"""Quota mode over real gRPC, in-process: the sidecar's server with a client stream.

The whole :class:`sidecar.server.Sidecar` runs on this test's event loop (memory backend,
no admin listener), so the servicer, its registration, health and reflection are the
ones ``serve`` uses. Each test runs twice: with the streams served in this process
(``--quota-process inline``) and relayed to a real quota worker process (``worker``,
the default); the numbers are read from whichever holds the registry.
"""

from __future__ import annotations

import asyncio
import pickle
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from sidecar.config import load_config
from sidecar.limiter.memory import MemoryLimiter
from sidecar.protos.envoy.service.rate_limit_quota.v3 import rlqs_pb2
from sidecar.quota.buckets import bucket_of
from sidecar.quota.registry import CHUNK
from sidecar.quota.relay import STATS
from sidecar.quota.service import MAX_RESPONSE_BYTES, METHOD, SERVICE_NAME
from sidecar.quota.stats import FrozenQuota
from sidecar.server import Sidecar
from sidecar.settings import Settings

RULES = """\
domain: q
descriptors:
  - key: user
    rate_limit: {unit: second, requests_per_unit: 5}
"""
Reports = rlqs_pb2.RateLimitQuotaUsageReports
Usage = Reports.BucketQuotaUsage


def report(*buckets: dict[str, str], allowed: int = 1) -> bytes:
    """A serialized usage report of ``buckets``."""
    usages = [Usage(bucket_id=rlqs_pb2.BucketId(bucket=b), num_requests_allowed=allowed) for b in buckets]
    return bytes(Reports(domain="q", bucket_quota_usages=usages).SerializeToString())


class Client:
    """One ``StreamRateLimitQuotas`` call whose requests are raw bytes (so garbage can be sent)."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.outbox: asyncio.Queue[bytes | None] = asyncio.Queue()
        method = channel.stream_stream(
            f"/{SERVICE_NAME}/{METHOD}",
            request_serializer=lambda data: data,
            response_deserializer=rlqs_pb2.RateLimitQuotaResponse.FromString,
        )
        self.call = method(self._requests())

    async def _requests(self) -> AsyncIterator[bytes]:
        while (item := await self.outbox.get()) is not None:
            yield item

    async def send(self, data: bytes) -> None:
        await self.outbox.put(data)

    async def receive(self, timeout: float = 3.0) -> Any:
        return await asyncio.wait_for(self.call.read(), timeout)

    async def close(self) -> None:
        await self.outbox.put(None)
        self.call.cancel()


@pytest.fixture(params=["inline", "worker"])
async def running(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[SimpleNamespace]:
    (tmp_path / "q.yaml").write_text(RULES)
    settings = Settings(
        config=str(tmp_path),
        grpc_address="127.0.0.1:0",
        metrics_address="",
        watch_config=False,
        quota_ttl=6,
        quota_max_buckets=50,
        quota_max_buckets_per_stream=40,
        quota_max_streams=3,
        quota_process=request.param,
    )
    sidecar = Sidecar(settings, load_config(str(tmp_path)), MemoryLimiter())
    await sidecar.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}")
    try:
        yield SimpleNamespace(sidecar=sidecar, channel=channel, client=Client(channel), tmp=tmp_path)
    finally:
        await channel.close()
        await sidecar.server.stop(0)
        if sidecar.worker is not None:
            await sidecar.worker.close(time.monotonic() + 5)


async def numbers(running: SimpleNamespace) -> FrozenQuota:
    """The quota registry's numbers, from this process or from the worker."""
    worker = running.sidecar.worker
    if worker is None:
        frozen: FrozenQuota = running.sidecar.quota.registry.frozen_stats()
        return frozen
    return cast(FrozenQuota, pickle.loads(await worker.call(STATS)))


def inline_only(running: SimpleNamespace) -> None:
    """Tests that reach into the registry itself (its bounds, set smaller) run inline."""
    if running.sidecar.worker is not None:
        pytest.skip("reads and changes the registry's own fields: covered inline")


async def test_a_report_gets_an_assignment_with_a_ttl(running: SimpleNamespace) -> None:
    await running.client.send(report(bucket_of("q", [("user", "a")])))
    reply = await running.client.receive()
    [action] = reply.bucket_action
    assert dict(action.bucket_id.bucket) == {"domain": "q", "entry.0.user": "a"}
    quota = action.quota_assignment_action
    assert quota.assignment_time_to_live.seconds == 6
    bucket = quota.rate_limit_strategy.token_bucket
    assert (bucket.max_tokens, bucket.tokens_per_fill.value, bucket.fill_interval.seconds) == (5, 5, 1)
    assert bucket.fill_interval.nanos == 0
    # Refreshed by a server push every TTL / 3 = 2 s, without any report.
    refresh = await running.client.receive(timeout=4.0)
    assert refresh.bucket_action[0].quota_assignment_action.assignment_time_to_live.seconds == 6
    await running.client.close()


async def test_garbage_and_bad_ids_do_not_end_the_stream(running: SimpleNamespace) -> None:
    client = running.client
    await client.send(b"\xff\xff\xff not a protobuf")
    await client.send(report({"entry.0.user": "no domain"}, {"domain": "q", "entry.5.user": "gap"}))
    reply = await client.receive()
    assert [a.quota_assignment_action.rate_limit_strategy.blanket_rule for a in reply.bucket_action] == [0, 0]
    await client.send(report(bucket_of("q", [("user", "b")])))
    reply = await client.receive()
    assert reply.bucket_action[0].quota_assignment_action.rate_limit_strategy.token_bucket.max_tokens == 5
    stats = (await numbers(running)).stats
    assert stats.malformed == {"undecodable": 1}
    assert stats.unmatched == {"missing_domain": 1, "index_gap": 1}
    await client.close()


async def test_a_flood_of_buckets_is_capped_and_answered(running: SimpleNamespace) -> None:
    buckets = [bucket_of("q", [("user", f"u{index}")]) for index in range(3000)]
    await running.client.send(report(*buckets))
    actions = []
    while len(actions) < 3000:
        actions += (await running.client.receive()).bucket_action
    kinds = [a.quota_assignment_action.rate_limit_strategy.WhichOneof("strategy") for a in actions]
    assert kinds.count("token_bucket") == 40 and kinds.count("blanket_rule") == 2960
    now = await numbers(running)
    assert now.gauges.live_buckets == 40 and now.stats.overflow == {"stream": 2960}
    await running.client.close()


async def test_a_reload_pushes_the_new_assignment_to_open_streams(running: SimpleNamespace) -> None:
    await running.client.send(report(bucket_of("q", [("user", "a")])))
    await running.client.receive()
    (running.tmp / "q.yaml").write_text(RULES.replace("requests_per_unit: 5", "requests_per_unit: 9"))
    assert await running.sidecar.reloader.reload("test")
    while True:  # a TTL refresh may come first
        bucket = (await running.client.receive()).bucket_action[0].quota_assignment_action.rate_limit_strategy
        if bucket.token_bucket.max_tokens == 9:
            break
    await running.client.close()


async def test_closing_the_stream_forgets_its_buckets(running: SimpleNamespace) -> None:
    await running.client.send(report(bucket_of("q", [("user", "a")])))
    await running.client.receive()
    now = await numbers(running)
    assert (now.gauges.live_buckets, now.gauges.open_streams) == (1, 1)
    await running.client.close()
    for _ in range(100):
        now = await numbers(running)
        if not now.gauges.open_streams:
            break
        await asyncio.sleep(0.02)
    assert (now.gauges.live_buckets, now.gauges.open_streams) == (0, 0)


async def test_health_and_reflection_list_the_quota_service(running: SimpleNamespace) -> None:
    health = health_pb2_grpc.HealthStub(running.channel)
    answer = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
    assert answer.status == health_pb2.HealthCheckResponse.SERVING
    stub = reflection_pb2_grpc.ServerReflectionStub(running.channel)
    replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    async for reply in replies:
        names = [service.name for service in reply.list_services_response.service]
        assert SERVICE_NAME in names
        break


async def test_answers_of_long_ids_are_cut_by_bytes_and_the_stream_lives_on(running: SimpleNamespace) -> None:
    """1,000 buckets with ~1 KiB ids: one message of 1,060,000 bytes ended the stream
    RESOURCE_EXHAUSTED (past the 1 MiB send cap), and a reconnecting Envoy lost it again."""
    buckets = [bucket_of("q", [("user", f"{index:0990}")]) for index in range(1_000)]
    await running.client.send(report(*buckets))
    sizes: list[int] = []
    while sum(sizes) < 1_000 * 1_000:
        sizes.append((await running.client.receive()).ByteSize())
    assert max(sizes) <= MAX_RESPONSE_BYTES and len(sizes) >= 4
    await running.client.send(report(bucket_of("q", [("user", "0")])))
    await running.client.receive()  # still open
    await running.client.close()


async def test_a_client_that_never_reads_is_bounded_then_ended(running: SimpleNamespace) -> None:
    """Reports of stateless ids (bad ids) to a client that never reads: what is queued
    stays within the byte bound (reports stop being read), and once gRPC's own buffers
    are full the stream ends after the write timeout."""
    inline_only(running)
    registry = running.sidecar.quota.registry
    registry.settings = replace(registry.settings, max_queued_bytes=64 * 1024, write_timeout=1.0)
    client = Client(running.channel)
    reports = 40  # 40 x 0.9 MB of answers: more than gRPC buffers for a client that does not read
    for number in range(reports):
        await client.send(report(*({"entry.0.user": f"{number:03}{index:0990}"} for index in range(900))))
    peak = 0
    for _ in range(3_000):  # bounded: at most 60 s of 20 ms polls
        if registry.stats.streams_ended:
            break
        peak = max([peak] + [stream.pending.bytes for stream in registry.streams.values()])
        await asyncio.sleep(0.02)
    assert registry.stats.streams_ended == {"write_timeout": 1}
    assert registry.stats.reports < reports  # backpressure: not every report was read
    assert peak <= 64 * 1024 + CHUNK * 1_100  # the bound, plus one chunk of answers at most
    assert registry.finishing == 1  # still counted to the stream cap: gRPC holds its buffers
    with pytest.raises(grpc.aio.AioRpcError) as ended:
        while True:
            await client.receive()
    # The server ends it RESOURCE_EXHAUSTED; a Python client whose own send of a report
    # is still blocked (as here) reports that failed send instead (INTERNAL).
    assert ended.value.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INTERNAL)
    for _ in range(100):  # bounded: at most 2 s
        if registry.finishing == 0:
            break
        await asyncio.sleep(0.02)
    assert registry.finishing == 0  # the call is over once the client read it
    await client.close()


async def test_streams_past_the_cap_are_refused_resource_exhausted(running: SimpleNamespace) -> None:
    clients = [running.client, Client(running.channel), Client(running.channel)]
    for index, client in enumerate(clients):  # the fixture's cap is 3
        await client.send(report(bucket_of("q", [("user", str(index))])))
        await client.receive()
    # The server refuses at open, before it reads; a client message sent meanwhile
    # could lose the race to the status and end the call INTERNAL on the client side.
    refused = Client(running.channel)
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await refused.receive()
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--quota-max-streams" in (error.value.details() or "")
    assert (await numbers(running)).stats.streams_ended == {"max_streams": 1}
    for client in clients:
        await client.close()
