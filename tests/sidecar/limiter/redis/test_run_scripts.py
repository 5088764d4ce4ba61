"""``RedisStore.run_scripts``, the one door scripts take to Redis: its resend rule on a
scripted fake, and recovery from ``SCRIPT FLUSH`` through it on a real redis-server for the
strict decide path (the batcher), flushes and quota shares."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ReadOnlyError, ResponseError

from sidecar.limiter.protocol import Check, Role
from sidecar.limiter.redis.availability import RedisUnavailable
from sidecar.limiter.redis.batcher import DecisionBatcher
from sidecar.limiter.redis.keys import counter_window
from sidecar.limiter.redis.pipeline import ScriptCall
from sidecar.limiter.redis.scripts import DECIDE, FLUSH_BATCH, Script
from sidecar.limiter.redis.store import RedisStore
from sidecar.quota.buckets import bucket_key
from sidecar.quota.redis_shares import SHARE, CallRefused, RedisShares, SharesUnavailable, share_keys
from sidecar.quota.shares import Call, Reply
from tests.support.redis_servers import RedisServer, fresh_prefix

FAR_FUTURE = int(time.time()) + 3600
A = Script("a.lua", "return 'a'", hashlib.sha1(b"return 'a'", usedforsecurity=False).hexdigest())
B = Script("b.lua", "return 'b'", hashlib.sha1(b"return 'b'", usedforsecurity=False).hexdigest())


# -- the resend rule, on a fake that answers as Redis does ----------------------------


class FakeRedis:
    """A script cache and a log of what each pipeline sent; EVALSHA of an unknown SHA is
    answered NOSCRIPT, EVAL runs the body and caches it, as Redis does (in order)."""

    def __init__(self, known: Sequence[Script] = (), *, fail: BaseException | None = None, stall: float = 0.0) -> None:
        self.known = {script.sha for script in known}
        self.sent: list[list[tuple[Any, ...]]] = []
        self.fail = fail
        self.stall = stall
        self.errors: dict[str, BaseException] = {}
        """Replies by first key: an error this call meets instead of running."""

    def pipeline(self, transaction: bool = True) -> FakePipe:
        return FakePipe(self)

    def answer(self, command: tuple[Any, ...]) -> Any:
        name = command[0]
        if name not in ("EVAL", "EVALSHA"):
            return ("ran", *command)
        body_or_sha, count = command[1], command[2]
        keys = command[3 : 3 + count]
        if name == "EVAL":
            self.known.add(hashlib.sha1(body_or_sha.encode(), usedforsecurity=False).hexdigest())
        elif body_or_sha not in self.known:
            return NoScriptError("No matching script. Please use EVAL.")
        if keys and keys[0] in self.errors:
            return self.errors[keys[0]]
        return ["ran", *keys]


class FakePipe:
    def __init__(self, server: FakeRedis) -> None:
        self.server = server
        self.commands: list[tuple[Any, ...]] = []

    def execute_command(self, *args: Any) -> None:
        self.commands.append(args)

    async def execute(self, raise_on_error: bool = True) -> list[Any]:
        assert not raise_on_error, "errors must come back as values"
        self.server.sent.append(self.commands)
        if self.server.stall:
            await asyncio.sleep(self.server.stall)
        if self.server.fail is not None:
            raise self.server.fail
        return [self.server.answer(command) for command in self.commands]


def fake_store(server: FakeRedis, cluster: bool = False) -> RedisStore:
    store = RedisStore(server)  # type: ignore[arg-type]
    store.cluster = cluster
    store.availability.mark_up()
    return store


def verbs(pipeline: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """What a pipeline sent, a script call shortened to (verb, script name, first key)."""
    names = {script.sha: script.name for script in (A, B)} | {script.source: script.name for script in (A, B)}
    return [(c[0], names[c[1]], c[3]) if c[0] in ("EVAL", "EVALSHA") else c for c in pipeline]


CALLS: list[Any] = [
    ScriptCall(A, ["k1"], [1]),
    ("GET", "plain"),
    ScriptCall(B, ["k2"], []),
    ScriptCall(A, ["k3"], [3]),
    ScriptCall(B, ["k4"], [4]),
]


async def test_calls_run_by_sha_in_one_pipeline_when_redis_knows_the_scripts() -> None:
    server = FakeRedis(known=[A, B])
    store = fake_store(server)
    replies = await store.run_scripts(CALLS, 1.0)
    assert replies == [["ran", "k1"], ("ran", "GET", "plain"), ["ran", "k2"], ["ran", "k3"], ["ran", "k4"]]
    assert [verb for verb, *_ in server.sent[0]] == ["EVALSHA", "GET", "EVALSHA", "EVALSHA", "EVALSHA"]
    assert store.round_trips_background == 1


async def test_noscript_resends_only_those_calls_the_first_of_each_script_with_its_body() -> None:
    server = FakeRedis(known=[B])
    store = fake_store(server)
    replies = await store.run_scripts(CALLS, 1.0, request_path=True)
    assert replies == [["ran", "k1"], ("ran", "GET", "plain"), ["ran", "k2"], ["ran", "k3"], ["ran", "k4"]]
    assert len(server.sent) == 2
    # B ran the first time and is not sent again; neither is the plain command.
    assert verbs(server.sent[1]) == [("EVAL", "a.lua", "k1"), ("EVALSHA", "a.lua", "k3")]
    assert store.round_trips_request_path == 2


async def test_in_cluster_every_resent_call_carries_its_body() -> None:
    server = FakeRedis()
    store = fake_store(server, cluster=True)
    await store.run_scripts(CALLS, 1.0)
    assert verbs(server.sent[1]) == [
        ("EVAL", "a.lua", "k1"), ("EVAL", "b.lua", "k2"), ("EVAL", "a.lua", "k3"), ("EVAL", "b.lua", "k4"),
    ]  # fmt: skip


async def test_a_call_refused_comes_back_as_its_error_and_the_others_as_replies() -> None:
    server = FakeRedis(known=[A, B])
    refused = ResponseError("CORRUPT k3 holds a hash")
    server.errors["k3"] = refused
    replies = await fake_store(server).run_scripts(CALLS, 1.0)
    assert replies[3] is refused
    assert replies[:3] == [["ran", "k1"], ("ran", "GET", "plain"), ["ran", "k2"]]


async def test_a_reply_for_redis_as_a_whole_raises_only_when_asked() -> None:
    """Raised, but Redis answered: it stays available (issue 31, faults.py)."""
    server = FakeRedis(known=[A, B])
    server.errors["k2"] = ReadOnlyError("You can't write against a read only replica.")
    assert isinstance((await fake_store(server).run_scripts(CALLS, 1.0))[2], ReadOnlyError)
    store = fake_store(server)
    with pytest.raises(RedisUnavailable, match="read only"):
        await store.run_scripts(CALLS, 1.0, away_raises=True)
    assert store.available
    await store.availability.close()


@pytest.mark.parametrize(
    ("server", "message"),
    [
        (FakeRedis(fail=RedisConnectionError("Connection reset by peer")), "Connection reset"),
        (FakeRedis(stall=1.0), "did not answer"),
    ],
)
async def test_a_lost_round_trip_raises_redis_unavailable_and_nothing_else(server: FakeRedis, message: str) -> None:
    store = fake_store(server)
    with pytest.raises(RedisUnavailable, match=message):
        await store.run_scripts(CALLS, 0.05)
    await store.availability.close()


async def test_nothing_is_sent_while_redis_is_known_down() -> None:
    server = FakeRedis(known=[A, B])
    store = fake_store(server)
    store.availability.available = False
    with pytest.raises(RedisUnavailable):
        await store.run_scripts(CALLS, 1.0)
    assert server.sent == []


# -- SCRIPT FLUSH between calls, on a real redis-server -------------------------------


@pytest.fixture
async def store(redis_server: RedisServer) -> AsyncIterator[RedisStore]:
    opened = RedisStore.for_url(redis_server.url, prefix=fresh_prefix(), redis_timeout=2.0)
    await opened.start()
    assert opened.available
    yield opened
    await opened.close()


def window_of(store: RedisStore, check: Check) -> str:
    return counter_window(store.prefix, check.key, check.unit_seconds, time.time())[0]


async def test_strict_decisions_recover_from_script_flush(store: RedisStore, redis_server: RedisServer) -> None:
    """The batcher's decisions (strict mode's path): a batch that meets NOSCRIPT is resent
    once, in one more request-path round trip, and every request is decided by Redis."""
    batcher = DecisionBatcher(store)
    checks = [Check((f"user{index}",), 60, 2, 1, Role.ENFORCED) for index in range(3)]

    async def decide_all() -> list[list[int]]:
        return list(
            await asyncio.gather(
                *(batcher.decide([window_of(store, c)], [c], [FAR_FUTURE], 2.0, lambda _: None) for c in checks)
            )
        )

    assert await decide_all() == [[1], [1], [1]]
    for round_number in (2, 3):
        redis_server.client().script_flush()
        before = store.round_trips_request_path
        assert await decide_all() == [[round_number]] * 3
        assert store.round_trips_request_path == before + 2, "one batch met NOSCRIPT, then one resend"
        assert redis_server.client().script_exists(DECIDE.sha) == [True]
    assert store.available


async def test_idempotent_flush_recovers_from_script_flush(store: RedisStore, redis_server: RedisServer) -> None:
    key = f"{store.prefix}:flushme"
    redis_server.client().script_flush()
    before = store.round_trips_background
    assert await store.flush({key: (5, FAR_FUTURE)}, once=("me", 1)) == {key: 5}
    assert store.round_trips_background == before + 2
    assert redis_server.client().script_exists(FLUSH_BATCH.sha) == [True]
    redis_server.client().script_flush()
    assert await store.flush({key: (5, FAR_FUTURE)}, once=("me", 1)) == {key: 5}, "the same flush adds nothing"


async def test_quota_shares_recover_from_script_flush(store: RedisStore, redis_server: RedisServer) -> None:
    """RedisShares goes through the same door: after SCRIPT FLUSH its calls still run, and a
    call its script refuses is refused on its own, not taken for Redis being away."""
    shares = RedisShares(store)
    calls = [
        (
            share_keys(store.prefix, bucket_key({"bucket": str(index)}), -1),
            Call(f"r{index}", 10, 100, 10_000, 15_000, 15_000),
        )
        for index in range(3)
    ]
    first = await shares.run(calls)
    assert all(isinstance(reply, Reply) and reply.grant > 0 for reply in first)
    redis_server.client().script_flush()
    before = store.round_trips_background
    again = await shares.run(calls)
    assert [reply.grant for reply in again if isinstance(reply, Reply)] == [reply.grant for reply in first]  # type: ignore[union-attr]
    assert store.round_trips_background == before + 2
    assert redis_server.client().script_exists(SHARE.sha) == [True]

    redis_server.client().set(calls[1][0][0], "not a hash")
    redis_server.client().script_flush()
    mixed = await shares.run(calls)
    assert isinstance(mixed[1], CallRefused) and "WRONGTYPE" in mixed[1].reason
    assert isinstance(mixed[0], Reply) and isinstance(mixed[2], Reply)
    assert store.available


async def test_quota_shares_unavailable_is_the_one_failure_when_redis_is_down(redis_server: RedisServer) -> None:
    store = RedisStore.for_url(redis_server.url, prefix=fresh_prefix(), redis_timeout=2.0)
    await store.start()
    store.availability.mark_down("test: redis is down")
    with pytest.raises(SharesUnavailable, match="test: redis is down"):
        await RedisShares(store).run(
            [(share_keys(store.prefix, bucket_key({"b": "1"}), -1), Call("r", 1, 10, 1, 1, 1))]
        )
    await store.close()
