"""Quota shares' pipelines packed by hand (``run_scripts(packed=True)``,
``sidecar/limiter/redis/packed.py``) against a real redis-server: the same replies, errors
and failures as redis-py's ``Pipeline``, and a connection cut off mid-read never answers
the next pipeline with the old replies."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.limiter.redis.availability import RedisUnavailable
from sidecar.limiter.redis.packed import pack, packable
from sidecar.limiter.redis.pipeline import ScriptCall
from sidecar.limiter.redis.scripts import Script
from sidecar.limiter.redis.store import RedisStore
from sidecar.quota.buckets import bucket_key
from sidecar.quota.redis_shares import RedisShares, share_keys
from sidecar.quota.shares import MAX_MS, MAX_UNITS, POLL, Call, Reply, clamped
from tests.support.redis_servers import RedisServer, fresh_prefix

pytestmark = [pytest.mark.slow, pytest.mark.redis]


def script(name: str, source: str) -> Script:
    return Script(name, source, hashlib.sha1(source.encode(), usedforsecurity=False).hexdigest())


ECHO = script(
    "echo.lua",
    "if ARGV[1] == 'refuse' then return redis.error_reply('NOPE refused') end\n"
    "if ARGV[1] == 'crash' then return redis.call('INCR', KEYS[1]) end\n"
    "return {KEYS[1], ARGV[1], tonumber(ARGV[2]) or -1}",
)
SLOW = script(
    "slow.lua",
    "local t0 = redis.call('TIME')\n"
    "repeat local t = redis.call('TIME')\n"
    "until (t[1] - t0[1]) * 1000000 + (t[2] - t0[2]) > tonumber(ARGV[1])\n"
    "return ARGV[2]",
)


@pytest.fixture
async def store(redis_server: RedisServer) -> AsyncIterator[RedisStore]:
    opened = RedisStore.for_url(redis_server.url, prefix=fresh_prefix(), redis_timeout=2.0)
    await opened.start()
    assert opened.available and packable(opened.client)
    yield opened
    await opened.close()


def shown(replies: Sequence[Any]) -> list[Any]:
    """Replies comparable across runs: an error as its type and message."""
    return [(type(reply), str(reply)) if isinstance(reply, BaseException) else reply for reply in replies]


def echo_calls(prefix: str) -> list[ScriptCall]:
    return [
        ScriptCall(ECHO, [f"{prefix}:a"], ["plain", 2**48]),
        ScriptCall(ECHO, [f"{prefix}:b"], ["refuse", 0]),
        ScriptCall(ECHO, [f"{prefix}:hash"], ["crash", 0]),  # WRONGTYPE from inside the script
        ScriptCall(ECHO, [f"{prefix}:é"], ["ünïcode ☃", -5]),
        ScriptCall(ECHO, [f"{prefix}:c"], ["", 0]),
    ]


async def test_packed_replies_errors_and_noscript_resend_match_the_pipeline(
    store: RedisStore, redis_server: RedisServer
) -> None:
    client = redis_server.client()
    client.hset(f"{store.prefix}:hash", "f", "v")
    seen: dict[bool, list[Any]] = {}
    for packed in (False, True):
        client.script_flush()  # the first pipeline meets NOSCRIPT: the resend carries the body
        before = store.round_trips_background
        first = await store.run_scripts(echo_calls(store.prefix), 2.0, packed=packed)
        assert store.round_trips_background == before + 2, "NOSCRIPT, then one resend"
        again = await store.run_scripts(echo_calls(store.prefix), 2.0, packed=packed)
        assert store.round_trips_background == before + 3, "the script cached: one round trip"
        assert shown(first) == shown(again)
        seen[packed] = shown(first)
    assert seen[True] == seen[False]
    assert seen[True][0] == [f"{store.prefix}:a".encode(), b"plain", 2**48]
    assert seen[True][3] == [f"{store.prefix}:é".encode(), "ünïcode ☃".encode(), -5]
    assert "NOPE refused" in seen[True][1][1] and "WRONGTYPE" in seen[True][2][1]
    assert store.available


async def test_packed_share_calls_answer_as_the_pipeline_does(store: RedisStore) -> None:
    """The same share calls on two copies of the same buckets: the same replies either way."""
    calls = {
        packed: [
            (
                share_keys(f"{store.prefix}:{packed}", bucket_key({"b": str(index)}), -1),
                Call("r", 5 + index, 50, 9, 9, 9),
            )
            for index in range(40)
        ]
        for packed in (False, True)
    }
    shares = RedisShares(store)
    store_run = store.run_scripts
    for packed in (False, True):
        store.run_scripts = lambda *args, packed=packed, **kwargs: store_run(*args, **{**kwargs, "packed": packed})  # type: ignore[method-assign]
        replies = await shares.run(calls[packed])
        assert all(isinstance(reply, Reply) for reply in replies)
        calls[packed] = replies  # type: ignore[assignment]
    assert calls[True] == calls[False]


async def test_a_packed_pipeline_cut_off_mid_read_leaves_no_reply_behind(own_redis: RedisServer) -> None:
    """A pipeline given up on while Redis still runs it: its connection is closed, so the
    next pipeline reads its own replies, not the old ones (a desync would answer every later
    call with the replies of the one before)."""
    store = RedisStore.for_url(own_redis.url, prefix=fresh_prefix(), redis_timeout=2.0)
    await store.start()
    try:
        slow = [ScriptCall(SLOW, ["k"], [300_000, "old"]) for _ in range(2)]
        with pytest.raises(RedisUnavailable):
            await store.run_scripts(slow, 0.1, packed=True)
        await asyncio.sleep(0.7)  # the old replies have been written by now
        if not store.available:
            await store.probe()
        replies = await store.run_scripts([ScriptCall(ECHO, ["k"], ["new", 1])], 2.0, packed=True)
        assert replies == [[b"k", b"new", 1]]
    finally:
        await store.close()


async def test_redis_gone_fails_a_packed_pipeline_as_it_fails_the_pipeline(own_redis: RedisServer) -> None:
    """Redis killed: the same one failure type, and Redis marked down either way."""
    stores = {packed: RedisStore.for_url(own_redis.url, prefix=fresh_prefix(), redis_timeout=2.0) for packed in (0, 1)}
    for opened in stores.values():
        await opened.start()
        assert await opened.run_scripts([ScriptCall(ECHO, ["k"], ["up", 1])], 2.0) == [[b"k", b"up", 1]]
    own_redis.kill()
    causes: list[type[BaseException]] = []
    try:
        for packed, opened in stores.items():
            with pytest.raises(RedisUnavailable) as caught:
                await opened.run_scripts([ScriptCall(ECHO, ["k"], ["x", 1])], 2.0, packed=bool(packed))
            assert not opened.available, f"packed={bool(packed)}: a lost connection marks Redis down"
            assert caught.value.__cause__ is not None
            causes.append(type(caught.value.__cause__))
        assert causes[0] is causes[1], causes
    finally:
        for opened in stores.values():
            await opened.close()


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.integers(min_value=-(2**62), max_value=2**62),
            st.text(max_size=40),
            st.binary(max_size=20),
        ),
        min_size=1,
        max_size=20,
    )
)
def test_pack_writes_what_redis_py_writes(arguments: list[Any]) -> None:
    """The packed bytes are redis-py's own packing of the same command."""
    from redis.asyncio.connection import Connection

    command = ("EVALSHA", *arguments)
    assert pack([command, command]) == b"".join(Connection().pack_commands([command, command]))


@settings(max_examples=300, deadline=None)
@given(
    st.integers(min_value=-3, max_value=MAX_UNITS + 2),
    st.integers(min_value=-3, max_value=MAX_UNITS + 2),
    st.integers(min_value=-3, max_value=MAX_MS + 2),
    st.integers(min_value=-2, max_value=MAX_MS + 2),
    st.integers(min_value=-1, max_value=1001),
)
def test_clamped_cuts_exactly_what_is_out_of_bounds(demand: int, limit: int, ms: int, window: int, pct: int) -> None:
    """The usual case returns the call itself; anything out of bounds is cut, field by field."""
    call = Call("r", demand, limit, ms, ms, ms, pct, ms, ms, window, demand, ms)
    cut = clamped(call)
    bounded = min(max(0, limit), MAX_UNITS)
    assert cut.limit == bounded
    assert cut.demand == (demand if demand in (POLL, -2) else min(max(0, demand), bounded))
    assert cut.used_add == min(max(0, demand), bounded)
    assert cut.lease_ms == cut.hold_ms == min(max(0, ms), MAX_MS)
    assert cut.threshold_pct == min(max(0, pct), 1000) and cut.window == min(max(-1, window), MAX_MS)
    assert (cut is call) == (cut == call)


def test_the_share_cost_loadtest_runs_end_to_end(capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m loadtest.quota_share_cost`` at its smallest: a real redis-server, both passes printed."""
    from loadtest.quota_share_cost import main

    assert main(["--buckets", "300", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.startswith(("report", "renew"))}
    assert set(rows) == {"report", "renew"}
    assert all(float(value) >= 0 for values in rows.values() for value in values)


def test_only_plain_redis_connections_are_packed() -> None:
    """Sentinel's connections turn a demoted master's READONLY into a lost connection in their
    own ``read_response``: they keep redis-py's ``Pipeline``, as does RESP3."""
    from redis.asyncio import Redis
    from redis.asyncio.sentinel import Sentinel

    from sidecar.limiter.redis.connect import connect

    assert packable(connect("redis://127.0.0.1:1", False, 0.05))
    assert packable(connect("rediss://127.0.0.1:1", False, 0.05))
    assert not packable(Sentinel([("127.0.0.1", 1)]).master_for("mymaster"))
    assert not packable(Redis(host="127.0.0.1", port=1, protocol=3))
    assert not packable(connect("redis://127.0.0.1:1", True, 0.05))  # Cluster


def test_a_redis_py_without_the_parser_read_here_keeps_the_pipeline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Packing reads redis-py's private parser: where its layout is not the one known
    (``PARSER_KNOWN``), every client keeps redis-py's ``Pipeline`` instead of failing."""
    from sidecar.limiter.redis import packed
    from sidecar.limiter.redis.connect import connect

    monkeypatch.setattr(packed, "PARSER_KNOWN", False)
    assert not packable(connect("redis://127.0.0.1:1", False, 0.05))
