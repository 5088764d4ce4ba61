"""RedisStore and decide.lua against real redis-server processes (standalone, ACL, TLS, Cluster).

No mocks: every test talks to a real server started by ``tests.support.redis_servers``. Each test
uses its own key prefix, so tests sharing a server never share a counter.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
import urllib.parse
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sidecar.limiter.protocol import Check, Role, decide
from sidecar.limiter.redis.availability import SILENCE_BEFORE_DOWN, RedisUnavailable
from sidecar.limiter.redis.connect import client_url
from sidecar.limiter.redis.keys import counter_digest, counter_window, expire_at, window_key
from sidecar.limiter.redis.scripts import DECIDE
from sidecar.limiter.redis.store import RedisStore, same_slot
from sidecar.limiter.windows import window_start
from sidecar.server import build_redis_store
from sidecar.settings import Settings
from tests.support.redis_servers import (
    ACL_PASSWORD,
    ACL_USER,
    RedisCluster,
    RedisServer,
)
from tests.support.sidecars import free_port

GUARD = 30.0
"""Bounds a wait that must end far sooner (a hang fails instead of stalling); never asserted as a figure."""
GENEROUS = 2.0
"""Request budget for tests about semantics, not latency: a busy machine must not fail them."""
FAR_FUTURE = int(time.time()) + 3600
ROLES = (Role.ENFORCED, Role.SHADOW, Role.QUOTA)


def fresh_prefix() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


def store_for(url: str, *, timeout: float = GENEROUS, prefix: str | None = None, cluster: bool = False) -> RedisStore:
    settings = Settings(
        config="unused",
        backend="redis",
        redis_url=url,
        redis_timeout=timeout,
        redis_prefix=prefix or fresh_prefix(),
        redis_cluster=cluster,
    )
    return build_redis_store(settings)


@pytest.fixture
async def store(redis_server: RedisServer) -> AsyncIterator[RedisStore]:
    opened = store_for(redis_server.url)
    await opened.start()
    assert opened.available
    yield opened
    await opened.close()


def check(limit: int, hits: int = 1, role: Role = Role.ENFORCED, key: str = "k") -> Check:
    return Check((key,), 60, limit, hits, role)


def keys_of(store: RedisStore, checks: Sequence[Check], now: float | None = None) -> list[str]:
    moment = time.time() if now is None else now
    return [counter_window(store.prefix, item.key, item.unit_seconds, moment)[0] for item in checks]


async def ask(store: RedisStore, checks: Sequence[Check], admit_all: bool = False) -> tuple[bool, list[int]]:
    admitted, counts, _ = await store.decide(keys_of(store, checks), checks, [FAR_FUTURE] * len(checks), admit_all)
    return admitted, counts


# -- decide.lua -------------------------------------------------------------------------


async def test_admits_up_to_the_limit_and_counts_only_admitted_hits(
    store: RedisStore, redis_server: RedisServer
) -> None:
    checks = [check(limit=3)]
    answers = [await ask(store, checks) for _ in range(5)]
    assert answers == [(True, [1]), (True, [2]), (True, [3]), (False, [4]), (False, [4])]
    assert redis_server.client().get(keys_of(store, checks)[0]) == "3"
    assert store.round_trips_request_path == 5


async def test_all_or_nothing_across_counters(store: RedisStore, redis_server: RedisServer) -> None:
    checks = [check(limit=10, key="wide"), check(limit=1, key="narrow")]
    assert await ask(store, checks) == (True, [1, 1])
    assert await ask(store, checks) == (False, [2, 2])
    wide, narrow = keys_of(store, checks)
    assert redis_server.client().mget([wide, narrow]) == ["1", "1"]


async def test_a_repeated_counter_sees_the_earlier_checks_hits(store: RedisStore, redis_server: RedisServer) -> None:
    checks = [check(limit=3, hits=2), check(limit=3, hits=2)]
    assert await ask(store, checks) == (False, [2, 4])
    assert redis_server.client().get(keys_of(store, checks)[0]) is None
    assert await ask(store, [check(limit=4, hits=2), check(limit=4, hits=2)]) == (True, [2, 4])


async def test_pending_adds_land_first_and_their_totals_come_back(store: RedisStore, redis_server: RedisServer) -> None:
    checks = [check(limit=5, hits=1, key="a")]
    (key_a,) = keys_of(store, checks)
    (key_b,) = keys_of(store, [check(limit=5, key="b")])
    pending = {key_a: (4, FAR_FUTURE), key_b: (7, FAR_FUTURE)}
    admitted, counts, totals = await store.decide([key_a], checks, [FAR_FUTURE], False, pending)
    assert (admitted, counts, totals) == (True, [5], {key_a: 5, key_b: 7})
    admitted, counts, totals = await store.decide([key_a], checks, [FAR_FUTURE], False, {key_a: (1, FAR_FUTURE)})
    assert (admitted, counts, totals) == (False, [7], {key_a: 6})
    assert redis_server.client().ttl(key_b) > 0


async def test_script_is_reloaded_transparently_after_script_flush(
    store: RedisStore, redis_server: RedisServer
) -> None:
    client = redis_server.client()
    assert client.script_exists(DECIDE.sha) == [True]
    client.script_flush()
    before = store.round_trips_request_path
    assert await ask(store, [check(limit=2)]) == (True, [1])
    assert store.round_trips_request_path == before + 2, "EVALSHA answered NOSCRIPT, then EVAL"
    assert client.script_exists(DECIDE.sha) == [True]
    assert await ask(store, [check(limit=2)]) == (True, [2])
    assert store.round_trips_request_path == before + 3


async def test_values_with_separators_braces_newlines_and_unicode_never_collide(
    store: RedisStore,
    redis_server: RedisServer,
) -> None:
    tricky = [
        ("a_b", "c"),
        ("a", "b_c"),
        ("a:b", "c"),
        ("a", "b:c"),
        ("a{b}", "c"),
        ("a", "{b}c"),
        ("{a}",),
        ("{a", "}"),
        ("a\nb",),
        ("a", "b"),
        ("ab",),
        ("\u00e9",),
        ("e\u0301",),
        ("\U0001f600", "\x00"),
        ("",),
        ("", ""),
        ("1:a",),
        ("1", "a"),
    ]
    now = time.time()
    checks = [Check(key, 60, 1, 1) for key in tricky]
    keys = keys_of(store, checks, now)
    assert len(set(keys)) == len(tricky)
    for item, key in zip(checks, keys, strict=True):
        assert await store.decide([key], [item], [FAR_FUTURE], False) == (True, [1], {})
    stored = sorted(redis_server.client().scan_iter(f"{store.prefix}:*"))
    assert stored == sorted(keys)
    assert all(redis_server.client().get(key) == "1" for key in keys)


async def test_keys_expire_at_window_end_plus_grace(store: RedisStore, redis_server: RedisServer) -> None:
    now = time.time()
    checks = [Check(("expiring",), 60, 10, 1)]
    (key,) = keys_of(store, checks, now)
    deadline = expire_at(window_start(now, 60), 60)
    assert (await store.decide([key], checks, [deadline], False))[0]
    client = redis_server.client()
    assert client.execute_command("EXPIRETIME", key) == deadline
    assert 0 < client.ttl(key) <= 60 + 5
    # A second hit keeps the deadline: expiry is set when the key is created.
    await store.decide([key], checks, [deadline + 100], False)
    assert client.execute_command("EXPIRETIME", key) == deadline


async def test_a_window_already_over_leaves_no_key(store: RedisStore, redis_server: RedisServer) -> None:
    checks = [check(limit=5, key="gone")]
    keys = keys_of(store, checks)
    assert await store.decide(keys, checks, [int(time.time()) - 1], False) == (True, [1], {})
    assert redis_server.client().exists(keys[0]) == 0


checks_strategy = st.lists(
    st.tuples(
        st.sampled_from(["x", "y", "z"]),
        st.integers(0, 6),
        st.integers(0, 3),
        st.sampled_from(ROLES),
    ),
    min_size=1,
    max_size=5,
)


def test_script_decides_exactly_like_protocol_decide(redis_server: RedisServer) -> None:
    """Random requests against random counter states: same verdict, counts and writes."""
    client = redis_server.client()
    with asyncio.Runner() as runner:
        store = store_for(redis_server.url)
        runner.run(store.start())

        @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
        @given(
            raw=checks_strategy,
            initial=st.fixed_dictionaries({name: st.integers(0, 7) for name in "xyz"}),
            pending=st.dictionaries(st.sampled_from(["x", "y", "z"]), st.integers(0, 3), max_size=3),
            admit_all=st.booleans(),
        )
        def case(
            raw: list[tuple[str, int, int, Role]],
            initial: dict[str, int],
            pending: dict[str, int],
            admit_all: bool,
        ) -> None:
            prefix = fresh_prefix()
            name = {letter: f"{prefix}:{{{letter}}}" for letter in "xyz"}
            for letter, value in initial.items():
                if value:
                    client.set(name[letter], value)
            checks = [Check((letter,), 60, limit, hits, role) for letter, limit, hits, role in raw]
            keys = [name[letter] for letter, *_ in raw]
            adds = {name[letter]: (hits, FAR_FUTURE) for letter, hits in pending.items()}
            got = runner.run(store.decide(keys, checks, [FAR_FUTURE] * len(checks), admit_all, adds))

            before = {name[letter]: initial[letter] + pending.get(letter, 0) for letter in "xyz"}
            counts, running = [], dict(before)
            for key, item in zip(keys, checks, strict=True):
                running[key] += item.hits
                counts.append(running[key])
            admitted, _, consume = decide(checks, counts, [item.limit for item in checks], admit_all)
            after = dict(before)
            for key, item, spend in zip(keys, checks, consume, strict=True):
                after[key] += item.hits if spend else 0
            assert got == (admitted, counts, {key: after[key] for key in adds})
            assert {key: int(client.get(key) or 0) for key in after} == after

        case()
        runner.run(store.close())


async def test_a_key_holding_garbage_fails_that_call_only(store: RedisStore, redis_server: RedisServer) -> None:
    checks = [check(limit=5, key="garbage")]
    redis_server.client().set(keys_of(store, checks)[0], "not a number")
    with pytest.raises(RedisUnavailable, match="refused the call"):
        await ask(store, checks)
    assert store.available
    assert await ask(store, [check(limit=5, key="clean")]) == (True, [1])


async def test_a_request_without_checks_needs_no_round_trip(store: RedisStore) -> None:
    assert await store.decide([], [], [], False) == (True, [], {})
    assert store.round_trips_request_path == 0


# -- flush and heartbeats -------------------------------------------------------------------


async def test_flush_adds_and_reads_in_one_round_trip(store: RedisStore, redis_server: RedisServer) -> None:
    client = redis_server.client()
    known = f"{store.prefix}:{{known}}:0"
    client.set(known, 11)
    added, missing = f"{store.prefix}:{{added}}:0", f"{store.prefix}:{{missing}}:0"
    before = store.round_trips_background
    totals = await store.flush({added: (3, FAR_FUTURE)}, [known, missing, added])
    assert totals == {added: 3, known: 11, missing: 0}
    assert store.round_trips_background == before + 1
    assert client.execute_command("EXPIRETIME", added) == FAR_FUTURE
    assert await store.flush({added: (2, FAR_FUTURE)}) == {added: 5}
    assert await store.flush({}) == {}


async def test_flush_skips_a_key_that_holds_no_counter_and_adds_the_others(
    store: RedisStore, redis_server: RedisServer
) -> None:
    garbage, good = f"{store.prefix}:{{garbage}}:0", f"{store.prefix}:{{good}}:0"
    redis_server.client().set(garbage, "not a number")
    totals = await store.flush({garbage: (2, FAR_FUTURE), good: (3, FAR_FUTURE)})
    assert totals == {good: 3}
    assert store.refused_hits == 2
    assert store.available


async def test_an_idempotent_flush_is_one_script_call_that_lands_once(
    store: RedisStore, redis_server: RedisServer
) -> None:
    """flush_batch.lua: adds and reads in one call; the same sequence again only reads."""
    client = redis_server.client()
    added, other, read = (f"{store.prefix}:{{{name}}}:0" for name in ("b-added", "b-other", "b-read"))
    client.set(read, 7)
    scripts_before = script_calls(client)
    adds = {added: (3, FAR_FUTURE - 10), other: (2, FAR_FUTURE)}
    first = await store.flush(adds, [read], once=("replica-a", 1))
    assert first == {added: 3, other: 2, read: 7}
    assert script_calls(client) == scripts_before + 1, "one script call for the whole flush"
    assert await store.flush(adds, [read], once=("replica-a", 1)) == first, "a retry adds nothing"
    assert await store.flush({added: (1, FAR_FUTURE)}, once=("replica-b", 1)) == {added: 4}, "another owner"
    assert await store.flush({added: (1, FAR_FUTURE)}, once=("replica-a", 2)) == {added: 5}
    assert client.execute_command("EXPIRETIME", added) == FAR_FUTURE - 10, "set by the add that created it"
    marker = f"{store.prefix}:flushed:replica-a"
    assert client.get(marker) == "2"
    assert client.execute_command("EXPIRETIME", marker) == FAR_FUTURE, "lives as long as its batch's counters"


async def test_an_idempotent_flush_refuses_a_key_that_holds_no_counter_and_adds_the_others(
    store: RedisStore, redis_server: RedisServer
) -> None:
    client = redis_server.client()
    text, hashed, good = (f"{store.prefix}:{{{name}}}:0" for name in ("b-text", "b-hash", "b-good"))
    client.set(text, "not a number")
    client.hset(hashed, "field", 1)
    adds = {text: (2, FAR_FUTURE), hashed: (5, FAR_FUTURE), good: (3, FAR_FUTURE)}
    totals = await store.flush(adds, [text, hashed, "absent"], once=("replica-a", 1))
    assert totals == {good: 3, "absent": 0}
    assert store.refused_hits == 7
    assert client.get(text) == "not a number"
    assert client.get(good) == "3"
    assert store.available


def script_calls(client: Any) -> int:
    """EVALSHA calls Redis has run so far (INFO commandstats)."""
    return int(client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))


async def test_heartbeats_count_live_replicas_and_forget_silent_ones(store: RedisStore) -> None:
    now = time.time()
    assert await store.heartbeat("a", now, 3.0) == 1
    assert await store.heartbeat("b", now, 3.0) == 2
    assert await store.heartbeat("a", now + 2.0, 3.0) == 2
    assert await store.heartbeat("a", now + 3.5, 3.0) == 1, "b is silent for more than the ttl"
    await store.heartbeat("c", now + 3.5, 3.0)
    await store.leave("c")
    assert await store.heartbeat("a", now + 3.6, 3.0) == 1


# -- failures and recovery --------------------------------------------------------------


async def test_a_store_whose_redis_is_down_starts_and_fails_fast() -> None:
    store = store_for(f"redis://127.0.0.1:{free_port()}")
    states: list[tuple[bool, str]] = []
    store.add_listener(lambda available, reason: states.append((available, reason)))
    await store.start()
    assert not store.available
    # Counted, not timed: a call to a store known down never yields to the event loop
    # (no socket, no timer), so a task spinning on the loop does not run meanwhile.
    spins = [0]

    async def spin() -> None:
        while True:
            spins[0] += 1
            await asyncio.sleep(0)

    spinner = asyncio.ensure_future(spin())
    await asyncio.sleep(0)
    before = spins[0]
    for _ in range(20):
        with pytest.raises(RedisUnavailable):
            await ask(store, [check(limit=1)])
        with pytest.raises(RedisUnavailable):
            await store.flush({"k": (1, FAR_FUTURE)})
    assert spins[0] == before, "an unavailable store must not wait for Redis"
    spinner.cancel()
    assert len(states) == 1
    assert states[0][0] is False
    assert "Connection" in states[0][1]
    await store.close()


async def test_reconnects_with_backoff_after_redis_comes_back(own_redis: RedisServer) -> None:
    store = store_for(own_redis.url)
    states: list[bool] = []
    store.add_listener(lambda available, _: states.append(available))
    await store.start()
    assert await ask(store, [check(limit=5)]) == (True, [1])
    own_redis.kill()
    with pytest.raises(RedisUnavailable):
        await ask(store, [check(limit=5)])
    assert not store.available
    await asyncio.to_thread(own_redis.start)
    await asyncio.wait_for(store.wait_available(), 5.0)
    assert states == [False, True]
    assert await ask(store, [check(limit=5)]) == (True, [1]), "the restarted server is empty"
    assert own_redis.client().script_exists(DECIDE.sha) == [True], "the probe loads the scripts again"
    await store.close()


async def test_a_paused_redis_costs_at_most_the_budget(own_redis: RedisServer) -> None:
    """Redis stopped (SIGSTOP, until the test resumes it: no pause can run out under load).
    Every call ends by its 5 ms budget, said by its error; the guard only catches a call
    that waits for Redis. Issue 17: timeouts mark Redis down once it has been silent well
    beyond any budget (100 ms here) while this loop was responsive, not after three
    timeouts in a row; the silence is the store's own figure."""
    store = store_for(own_redis.url, timeout=0.005)
    await store.start()
    assert own_redis.process is not None
    errors: list[str] = []
    os.kill(own_redis.process.pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + GUARD
        while store.available and time.monotonic() < deadline:
            with pytest.raises(RedisUnavailable) as failed:
                await asyncio.wait_for(ask(store, [check(limit=5)]), GUARD)
            errors.append(str(failed.value))
    finally:
        os.kill(own_redis.process.pid, signal.SIGCONT)
    assert not store.available, "a silent Redis is marked unavailable"
    *late, down = errors
    assert late and all(error == "redis did not answer within 5 ms" for error in late), errors
    silent = re.fullmatch(r"redis unavailable: no answer for (\d+) ms while this process's event loop.*", down)
    if silent is None:
        # A loaded loop (its lag is not charged to Redis): the first call, abandoned on the
        # wire, reached its socket timeout (the background timeout, 1 s) first.
        assert re.fullmatch(r"redis unavailable: TimeoutError: Timeout reading from \S+", down), errors
    else:
        assert int(silent[1]) >= SILENCE_BEFORE_DOWN * 1000, errors
    await asyncio.wait_for(store.wait_available(), GUARD)
    await store.close()


async def test_one_slow_answer_does_not_mark_redis_down(own_redis: RedisServer) -> None:
    store = store_for(own_redis.url, timeout=0.02)
    await store.start()
    own_redis.pause(300)
    with pytest.raises(RedisUnavailable, match="did not answer within 20 ms"):
        await ask(store, [check(limit=5)])
    assert store.available
    # A background call (longer budget) waits the pause out on the same store.
    admitted, _, _ = await store.decide(
        keys_of(store, [check(limit=5)]), [check(limit=5)], [FAR_FUTURE], False, request_path=False
    )
    assert admitted
    assert store.available
    await store.close()


async def test_a_server_blocked_by_a_long_command_costs_at_most_the_budget(own_redis: RedisServer) -> None:
    store = store_for(own_redis.url, timeout=0.005)
    await store.start()
    sleeper = own_redis.debug_sleep(1.5)  # long enough that it is still blocked on a loaded machine
    with pytest.raises(RedisUnavailable, match="did not answer within 5 ms"):  # the budget ended it
        await asyncio.wait_for(ask(store, [check(limit=5)]), GUARD)
    await asyncio.to_thread(sleeper.join)
    await store.close()


# -- connection options ---------------------------------------------------------------------


def test_cluster_urls_are_translated_for_redis_py() -> None:
    assert client_url("redis+cluster://h:7000", False) == ("redis://h:7000", True)
    assert client_url("rediss+cluster://u:p@h:7000", False) == ("rediss://u:p@h:7000", True)
    assert client_url("redis://h:6379/2", False) == ("redis://h:6379/2", False)
    assert client_url("rediss://h:6379", True) == ("rediss://h:6379", True)


async def test_acl_user_and_password_from_the_url(acl_redis: RedisServer) -> None:
    secret = urllib.parse.quote(ACL_PASSWORD, safe="")
    store = store_for(f"redis://{ACL_USER}:{secret}@127.0.0.1:{acl_redis.port}")
    await store.start()
    assert store.available
    assert await ask(store, [check(limit=1)]) == (True, [1])
    await store.close()
    anonymous = store_for(acl_redis.url)
    await anonymous.start()
    assert not anonymous.available
    assert "Authentication" in anonymous.last_error or "NOAUTH" in anonymous.last_error
    await anonymous.close()
    wrong = store_for(f"redis://{ACL_USER}:wrong@127.0.0.1:{acl_redis.port}")
    await wrong.start()
    assert not wrong.available
    await wrong.close()


async def test_tls_with_rediss_url(tls_redis: RedisServer) -> None:
    ca = urllib.parse.quote(str(tls_redis.directory / "cert.pem"))
    store = store_for(f"rediss://127.0.0.1:{tls_redis.port}?ssl_ca_certs={ca}")
    await store.start()
    assert store.available, store.last_error
    assert await ask(store, [check(limit=1)]) == (True, [1])
    assert await ask(store, [check(limit=1)]) == (False, [2])
    await store.close()
    plain = store_for(f"redis://127.0.0.1:{tls_redis.port}")
    await plain.start()
    assert not plain.available, "a plain-text client must not get through a TLS port"
    await plain.close()


# -- Redis Cluster --------------------------------------------------------------------------


@pytest.fixture
async def cluster_store(redis_cluster: RedisCluster) -> AsyncIterator[RedisStore]:
    opened = store_for(redis_cluster.url)
    await opened.start()
    assert opened.available, opened.last_error
    assert opened.cluster
    yield opened
    await opened.close()


@pytest.mark.slow
async def test_cluster_single_slot_request_uses_the_script(
    cluster_store: RedisStore,
    redis_cluster: RedisCluster,
) -> None:
    checks = [Check(("one",), 60, 2, 1), Check(("one",), 60, 2, 1)]
    now = time.time()
    keys = keys_of(cluster_store, checks, now)
    pending_key = window_key(cluster_store.prefix, counter_digest(("one",)), window_start(now, 60) - 60)
    assert same_slot([*keys, pending_key])
    before = cluster_store.round_trips_request_path
    got = await cluster_store.decide(keys, checks, [FAR_FUTURE] * 2, False, {pending_key: (3, FAR_FUTURE)})
    assert got == (True, [1, 2], {pending_key: 3})
    assert cluster_store.round_trips_request_path == before + 1
    assert (await cluster_store.decide(keys[:1], checks[:1], [FAR_FUTURE], False))[0] is False
    assert redis_cluster.client().get(keys[0]) == "2"


@pytest.mark.slow
async def test_cluster_cross_slot_request_is_all_or_nothing(
    cluster_store: RedisStore,
    redis_cluster: RedisCluster,
) -> None:
    names = [f"cross-{index}" for index in range(40)]
    wide = Check((names[0],), 60, 10, 1)
    narrow = next(
        Check((name,), 60, 1, 1)
        for name in names[1:]
        if not same_slot(keys_of(cluster_store, [wide, Check((name,), 60, 1, 1)]))
    )
    checks = [wide, narrow]
    keys = keys_of(cluster_store, checks)
    assert await cluster_store.decide(keys, checks, [FAR_FUTURE] * 2, False) == (True, [1, 1], {})
    assert await cluster_store.decide(keys, checks, [FAR_FUTURE] * 2, False) == (False, [2, 2], {})
    await asyncio.sleep(0.2)  # the give-back runs in the background
    client = redis_cluster.client()
    assert [client.get(key) for key in keys] == ["1", "1"]
    assert client.ttl(keys[0]) > 0
    assert await cluster_store.decide(keys[:1], [wide], [FAR_FUTURE], False) == (True, [2], {})


@pytest.mark.slow
async def test_cluster_flush_heartbeat_and_script_reload(
    cluster_store: RedisStore,
    redis_cluster: RedisCluster,
) -> None:
    adds = {f"{cluster_store.prefix}:{{n{index}}}:0": (index + 1, FAR_FUTURE) for index in range(12)}
    assert await cluster_store.flush(adds, ["nobody"]) == {
        **{key: hits for key, (hits, _) in adds.items()},
        "nobody": 0,
    }
    assert await cluster_store.heartbeat("r1", time.time(), 3.0) == 1
    assert await cluster_store.heartbeat("r2", time.time(), 3.0) == 2
    for node in redis_cluster.nodes:
        node.client().script_flush()
    assert await ask(cluster_store, [check(limit=1, key="after-flush")]) == (True, [1])
