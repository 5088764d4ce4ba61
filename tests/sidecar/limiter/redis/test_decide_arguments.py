"""What strict mode sends to Redis per algorithm: key names, ``decide.lua``'s KEYS and ARGV
layout, and what the failure policy owes (``INCRBY`` amounts) for each kind of counter.

The script itself runs against a real Redis in ``tests/sidecar/limiter/test_strict_algorithms.py``.
"""

from __future__ import annotations

import re

from sidecar.limiter.algorithms import Algorithm, emission_interval_us
from sidecar.limiter.failure import FailurePolicy
from sidecar.limiter.protocol import Check, Role
from sidecar.limiter.redis.keys import (
    EXPIRY_GRACE_SECONDS,
    ban_key,
    bucket_key,
    check_window,
    counter_digest,
    counter_window,
    per_hit,
    previous_window,
    window_key,
)
from sidecar.limiter.redis.scripts import DECIDE, decide_arguments

NOW = 1_700_000_045.25
MINUTE = 1_700_000_040
"""Start of the minute holding :data:`NOW`."""
INTERVAL = emission_interval_us(60, 30)
"""30 per minute: one token every two seconds."""

FIXED = Check(("fixed",), 60, 10, 1)
SLIDING = Check(("sliding",), 60, 20, 2, Role.SHADOW, Algorithm.SLIDING_WINDOW)
BUCKET = Check(("bucket",), 60, 5, 3, Role.QUOTA, Algorithm.TOKEN_BUCKET, INTERVAL, 30)


def tag(key: str) -> str:
    """The Cluster hash tag of a key (what decides its slot)."""
    found = re.search(r"\{([^}]*)\}", key)
    assert found is not None, key
    return found[1]


def test_each_algorithm_names_its_key_and_expiry() -> None:
    fixed, fixed_expiry = check_window("rls", FIXED, NOW)
    assert (fixed, fixed_expiry) == counter_window("rls", FIXED.key, 60, NOW)
    assert fixed == window_key("rls", counter_digest(FIXED.key), MINUTE)
    assert fixed_expiry == MINUTE + 60 + EXPIRY_GRACE_SECONDS

    sliding, sliding_expiry = check_window("rls", SLIDING, NOW)
    assert sliding == window_key("rls", counter_digest(SLIDING.key), MINUTE)
    assert sliding_expiry == MINUTE + 2 * 60 + EXPIRY_GRACE_SECONDS, "the next window reads it"

    bucket, bucket_expiry = check_window("rls", BUCKET, NOW)
    digest = counter_digest(BUCKET.key)
    assert bucket == bucket_key("rls", digest) == f"rls:{{{digest}}}:tat"
    # An empty bucket refills in burst * interval (5 * 2 s): an upper bound of the TAT's lead.
    assert bucket_expiry == 1_700_000_056 + EXPIRY_GRACE_SECONDS, "ceil(NOW + 10 s) + grace"


def test_keys_of_one_counter_share_its_hash_tag() -> None:
    digest = counter_digest(SLIDING.key)
    current = window_key("rls:x", digest, MINUTE)
    previous, start = previous_window(current, 60)
    assert (previous, start) == (window_key("rls:x", digest, MINUTE - 60), MINUTE)
    names = [current, previous, ban_key("rls:x", digest), bucket_key("rls:x", digest)]
    assert {tag(name) for name in names} == {digest}


def test_per_hit_is_one_for_windows_and_the_interval_for_buckets() -> None:
    assert [per_hit(FIXED), per_hit(SLIDING), per_hit(BUCKET)] == [1, 1, 2_000_000]


def test_script_arguments_per_algorithm() -> None:
    checks = [FIXED, SLIDING, BUCKET]
    windows = [check_window("rls", check, NOW) for check in checks]
    keys = [key for key, _ in windows]
    expiries = [expires for _, expires in windows]
    pending = {"rls:{p}:1": (4, 99)}
    names, args = decide_arguments(keys, checks, expiries, True, pending, now_us=1_700_000_045_250_000)

    digest = counter_digest(BUCKET.key)
    assert names == [
        keys[0], keys[0], keys[0],  # fixed, no ban: its own key stands in for both extras
        keys[1], previous_window(keys[1], 60)[0], keys[1],  # sliding: the window before
        keys[2], keys[2], ban_key("rls", digest),  # bucket with a ban
        "rls:{p}:1",
    ]  # fmt: skip
    assert args == [
        1, 3, 1_700_000_045_250_000, EXPIRY_GRACE_SECONDS,
        10, 1, 0, expiries[0], 0, 60, 0, 0, 0,
        20, 2, 1, expiries[1], 1, 60, MINUTE, 0, 0,
        5, 3, 2, expiries[2], 2, 60, 0, INTERVAL, 30,
        4, 99,
    ]  # fmt: skip


def test_the_redis_clock_is_the_default() -> None:
    _, args = decide_arguments(["rls:{d}:0"], [FIXED], [10], False, {})
    assert args[:4] == [0, 1, 0, EXPIRY_GRACE_SECONDS]


def script_constant(name: str) -> int:
    found = re.search(rf"local {name} = (\d+)", DECIDE.source)
    assert found is not None, name
    return int(found[1])


def test_the_script_reads_the_layout_the_arguments_follow() -> None:
    """``decide.lua`` indexes ARGV with constants: they must match :func:`decide_arguments`."""
    header, stride = script_constant("HEADER"), script_constant("STRIDE")
    names, args = decide_arguments(["a", "b"], [FIXED, FIXED], [1, 2], False, {"c": (1, 2)})
    assert len(args) == header + 2 * stride + 2
    assert len(names) == 3 * 2 + 1
    assert "3 * n" in DECIDE.source, "three keys per check"


def test_owed_bucket_hits_are_tat_microseconds_but_reported_as_hits() -> None:
    policy = FailurePolicy("open")
    windows = [check_window("rls", check, NOW) for check in (FIXED, BUCKET)]
    decision = policy.check([FIXED, BUCKET], [key for key, _ in windows], [exp for _, exp in windows], NOW)
    assert decision.admitted
    assert policy.ledger.owed_hits == 1 + 3
    drained = policy.ledger.drain_admitted()
    assert drained == {
        windows[0][0]: (1, windows[0][1]),
        windows[1][0]: (3 * INTERVAL, windows[1][1]),  # INCRBY of the TAT: charging the bucket
    }
    policy.ledger.restore(drained)
    assert policy.ledger.owed_hits == 4, "a failed flush keeps the amounts and what a hit is worth"
    assert policy.ledger.owe(windows[1][0], -1, windows[1][1], INTERVAL)  # a late answer: give one back
    assert policy.ledger.owed_hits == 3
    drained = policy.ledger.drain_admitted()
    assert drained[windows[1][0]] == (2 * INTERVAL, windows[1][1])
    assert policy.ledger.hits_in(drained) == 3
    policy.ledger.settle(drained)
    assert policy.ledger.reconciled()
