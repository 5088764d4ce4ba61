"""What a failed call says about Redis (:mod:`sidecar.limiter.redis.faults`): error replies
as redis-py's own parser turns them into exceptions, redis-py's Cluster errors, lost
connections and timeouts; and what :class:`Availability` does with each."""

from __future__ import annotations

import asyncio

import pytest
from redis._parsers.base import BaseParser
from redis.exceptions import (
    AuthenticationError,
    ClusterError,
    MaxConnectionsError,
    RedisClusterException,
    SlotNotCoveredError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from sidecar.limiter.redis.availability import Availability, RedisUnavailable
from sidecar.limiter.redis.faults import Fault, classify
from sidecar.metrics import LimiterSnapshot, limiter_families

REPLIES = [
    "TRYAGAIN Multiple keys request during rehashing of slot",
    "ASK 3999 127.0.0.1:6381",
    "MOVED 3999 127.0.0.1:6381",
    "LOADING Redis is loading the dataset in memory",
    "READONLY You can't write against a read only replica.",
    "CLUSTERDOWN The cluster is down",
    "CLUSTERDOWN Hash slot not served",
    "MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.",
    "BUSY Redis is busy running a script.",
    "NOSCRIPT No matching script. Please use EVAL.",
    "OOM command not allowed when used memory > 'maxmemory'.",
    "WRONGTYPE Operation against a key holding the wrong kind of value",
    "CORRUPT rls:{x}:1 holds a hash",
]
"""Error replies a node may send: each refuses one call, the node is there."""


@pytest.mark.parametrize("reply", REPLIES)
def test_an_error_reply_fails_its_call_only(reply: str) -> None:
    assert classify(BaseParser.parse_error(reply)) is Fault.CALL


@pytest.mark.parametrize(
    "error",
    [
        ClusterError("TTL exhausted."),
        SlotNotCoveredError('Slot "12" is not covered by the cluster.'),
        RedisClusterException("No targets were found"),
        MaxConnectionsError("Too many connections"),
        RedisUnavailable("redis node 127.0.0.1:7000 unavailable: refused"),
    ],
)
def test_cluster_give_ups_and_our_own_limits_fail_their_call_only(error: BaseException) -> None:
    assert classify(error) is Fault.CALL


@pytest.mark.parametrize(
    "error",
    [
        RedisConnectionError("Error 111 connecting to 127.0.0.1:7000. Connection refused."),
        AuthenticationError("invalid password"),
        ConnectionResetError(104, "Connection reset by peer"),
        OSError("Network is unreachable"),
    ],
)
def test_a_lost_connection_marks_the_node_down(error: BaseException) -> None:
    assert classify(error) is Fault.LOST


@pytest.mark.parametrize("error", [TimeoutError(), RedisTimeoutError("Timeout reading from socket")])
def test_a_timeout_is_silence(error: BaseException) -> None:
    assert classify(error) is Fault.SILENCE


async def never() -> None:
    raise RedisConnectionError("no server in these tests")


@pytest.mark.parametrize("reply", ["TRYAGAIN Multiple keys request during rehashing of slot", "LOADING loading"])
async def test_availability_stays_up_on_a_refused_call(reply: str) -> None:
    availability = Availability(never, 0.05)
    availability.mark_up()
    failure = availability.failed(BaseParser.parse_error(reply), request_path=True)
    assert availability.available
    assert "refused the call" in str(failure)
    failure = availability.failed(ClusterError("TTL exhausted."), request_path=True)
    assert availability.available
    assert "TTL exhausted" in str(failure)


async def test_availability_goes_down_on_a_lost_connection_and_on_long_silence_only() -> None:
    now = [0.0]
    availability = Availability(never, 0.05, clock=lambda: now[0], max_backoff=0.01)
    availability.mark_up()
    availability.sent()
    now[0] = 0.1  # under the silence rule's 0.25 s
    availability.failed(RedisTimeoutError("Timeout reading from socket"), request_path=True)
    assert availability.available
    now[0] = 0.3
    assert availability.silent_too_long()
    availability.failed(TimeoutError(), request_path=True)
    assert not availability.available
    await availability.close()
    again = Availability(never, 0.05, what="redis node 127.0.0.1:7000")
    again.mark_up()
    failure = again.failed(RedisConnectionError("Connection refused"), request_path=True)
    assert not again.available
    assert str(failure).startswith("redis node 127.0.0.1:7000 unavailable")
    await asyncio.sleep(0)
    await again.close()


def test_the_per_node_gauge_names_each_cluster_master() -> None:
    snapshot = LimiterSnapshot(
        counters=0, evictions=0, redis_up=True, redis_nodes_up={"127.0.0.1:7001": False, "127.0.0.1:7000": True}
    )
    families = {family.name: family for family in limiter_families(snapshot)}
    samples = [(sample.labels, sample.value) for sample in families["ratelimit_sidecar_redis_node_up"].samples]
    assert samples == [({"node": "127.0.0.1:7000"}, 1), ({"node": "127.0.0.1:7001"}, 0)]
    single = LimiterSnapshot(counters=0, evictions=0, redis_up=True)
    assert "ratelimit_sidecar_redis_node_up" not in {family.name for family in limiter_families(single)}
