""":class:`ClusterNodes` on a scripted fake Cluster: calls grouped per master, a lost master
failing its own calls only, redirections resent alone, and the whole Cluster down only
when every master is. The real-Cluster behaviour is in ``test_cluster_faults.py``."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
from redis.exceptions import ClusterError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError

from sidecar.limiter.redis.availability import Availability, RedisUnavailable
from sidecar.limiter.redis.cluster_health import ClusterNodes, ShardUnavailable
from sidecar.limiter.redis.pipeline import Command, ScriptCall
from sidecar.limiter.redis.scripts import DECIDE


class FakeNode:
    def __init__(self, name: str) -> None:
        self.name = name


class FakeNodes:
    """redis-py's NodesManager, as far as ClusterNodes uses it: slot ``ord(key[0])``."""

    def __init__(self, masters: dict[str, FakeNode]) -> None:
        self.masters = masters
        self.moved_last: list[str] = []
        self.slots_cache = {ord("a"): [masters["a"]], ord("b"): [masters["b"]], ord("c"): [masters["b"]]}

    def get_node_from_slot(self, slot: int) -> FakeNode:
        return self.masters["a" if slot == ord("a") else "b"]

    def move_node_to_end_of_cached_nodes(self, name: str) -> None:
        self.moved_last.append(name)

    async def initialize(self) -> None:
        raise RedisConnectionError("the fake Cluster gives no slot map to probes")


class FakeCluster:
    """Keys starting with ``a`` live on master ``A:1``, the others on ``B:2``."""

    def __init__(self) -> None:
        self.masters = {"a": FakeNode("A:1"), "b": FakeNode("B:2")}
        self.nodes_manager = FakeNodes(self.masters)
        self.resent: list[tuple[Any, ...]] = []
        self.resend_reply: Any = "resent"

    async def initialize(self) -> FakeCluster:
        return self

    def keyslot(self, key: str) -> int:
        return ord(key[0])

    def get_primaries(self) -> list[FakeNode]:
        return list(self.masters.values())

    async def execute_command(self, *args: Any) -> Any:
        self.resent.append(args)
        if isinstance(self.resend_reply, BaseException):
            raise self.resend_reply
        return self.resend_reply


class Heard(list[tuple[bool, str]]):
    def __call__(self, available: bool, reason: str) -> None:
        self.append((available, reason))


async def never() -> None:
    raise RedisConnectionError("no probe of the whole here")


@pytest.fixture
async def cluster() -> AsyncIterator[tuple[ClusterNodes, FakeCluster, Heard]]:
    fake = FakeCluster()
    whole = Availability(never, 0.05)
    whole.mark_up()
    heard = Heard()
    whole.add_listener(heard)
    nodes = ClusterNodes(fake, whole, 0.05, 1.0)  # type: ignore[arg-type]
    yield nodes, fake, heard
    await nodes.close()
    await whole.close()


CALLS: list[ScriptCall | Command] = [
    ScriptCall(DECIDE, ["a1"], []),
    ("GET", "b1"),
    ScriptCall(DECIDE, ["a2"], []),
    ScriptCall(DECIDE, ["b2"], []),
]


def answering(failing: dict[str, BaseException | list[Any]]) -> Any:
    """A ``send`` whose pipeline to the master of a key's first letter raises, or answers
    the replies given, or echoes each call's first key."""
    sent: list[list[str]] = []

    async def send(calls: Sequence[ScriptCall | Command]) -> list[Any]:
        keys = [call.keys[0] if isinstance(call, ScriptCall) else str(call[1]) for call in calls]
        sent.append(keys)
        scripted = failing.get(keys[0][0])
        if isinstance(scripted, BaseException):
            raise scripted
        return list(scripted) if scripted is not None else keys

    send.sent = sent  # type: ignore[attr-defined]
    return send


async def test_calls_go_per_master_and_come_back_in_order(cluster: tuple[ClusterNodes, FakeCluster, Heard]) -> None:
    nodes, _, _ = cluster
    send = answering({})
    assert await nodes.run(CALLS, send, 1.0, budget=False) == ["a1", "b1", "a2", "b2"]
    assert sorted(send.sent) == [["a1", "a2"], ["b1", "b2"]]


async def test_a_lost_master_fails_its_own_calls_then_is_not_sent_to(
    cluster: tuple[ClusterNodes, FakeCluster, Heard],
) -> None:
    nodes, fake, heard = cluster
    replies = await nodes.run(CALLS, answering({"a": RedisConnectionError("Connection refused")}), 1.0, budget=False)
    assert replies[1::2] == ["b1", "b2"]
    assert all(isinstance(reply, RedisUnavailable) for reply in replies[0::2])
    assert nodes.states() == {"A:1": False, "B:2": True}
    assert fake.nodes_manager.moved_last == ["A:1"]  # never redis-py's default node while down
    assert nodes.whole.available
    assert heard == []
    send = answering({})
    replies = await nodes.run(CALLS, send, 1.0, budget=False)
    assert isinstance(replies[0], ShardUnavailable)
    assert send.sent == [["b1", "b2"]]  # nothing went to the master known down


async def test_shard_listeners_hear_a_masters_outage_and_return_with_its_slots(
    cluster: tuple[ClusterNodes, FakeCluster, Heard],
) -> None:
    """What a limiter needs to hold a returning master's keys (docs/redis.md, "Returning
    from an outage"): its slots when it goes down, the same slots when they are back; the
    whole Cluster's listeners hear nothing."""
    nodes, _, heard = cluster
    shards: list[tuple[bool, frozenset[int]]] = []
    nodes.add_shard_listener(lambda up, slots: shards.append((up, slots)))
    await nodes.run(CALLS, answering({"b": RedisConnectionError("Connection refused")}), 1.0, budget=False)
    assert shards == [(False, frozenset({ord("b"), ord("c")}))]
    nodes.node("B:2").mark_up()  # its probe answered
    assert shards[1:] == [(True, frozenset({ord("b"), ord("c")}))]
    assert heard == []


async def test_a_connection_lost_while_replies_are_read_marks_that_master_down(
    cluster: tuple[ClusterNodes, FakeCluster, Heard],
) -> None:
    nodes, _, _ = cluster
    broken = RedisConnectionError("Connection closed by server.")
    replies = await nodes.run(CALLS, answering({"b": ["b1", broken]}), 1.0, budget=False)
    assert replies[1] == "b1"
    assert isinstance(replies[3], RedisUnavailable)
    assert nodes.states() == {"A:1": True, "B:2": False}


async def test_every_master_down_is_the_whole_cluster_down(cluster: tuple[ClusterNodes, FakeCluster, Heard]) -> None:
    nodes, _, heard = cluster
    lost = RedisConnectionError("Connection refused")
    await nodes.run(CALLS, answering({"a": lost, "b": lost}), 1.0, budget=False)
    assert not nodes.whole.available
    assert len(heard) == 1
    assert heard[0][0] is False
    assert "every Cluster master is down" in heard[0][1]


async def test_a_redirected_call_is_resent_alone_with_its_body(
    cluster: tuple[ClusterNodes, FakeCluster, Heard],
) -> None:
    nodes, fake, _ = cluster
    again = TryAgainError("Multiple keys request during rehashing of slot")
    replies = await nodes.run(CALLS, answering({"a": [again, "a2"]}), 1.0, budget=False)
    assert replies == ["resent", "b1", "a2", "b2"]
    assert fake.resent == [("EVAL", DECIDE.source, 1, "a1")]
    fake.resend_reply = ClusterError("TTL exhausted.")
    replies = await nodes.run(CALLS, answering({"a": [again, "a2"]}), 1.0, budget=False)
    assert isinstance(replies[0], RedisUnavailable)
    assert "TTL exhausted" in str(replies[0])
    assert nodes.states() == {"A:1": True, "B:2": True}  # the master answered: it stays up
