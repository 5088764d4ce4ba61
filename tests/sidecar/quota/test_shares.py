"""Shares of one limit across replicas: max-min fair share and leases, on a simulated clock."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.quota.shares import LEAVE, POLL, Bucket, Call, clamped, fair_shares, grants, safe_capacity, step

replica_ids = st.text(alphabet="abcdefgh", min_size=1, max_size=3)
demands_st = st.dictionaries(replica_ids, st.integers(0, 10_000), max_size=12)


@given(demands_st, st.integers(0, 20_000))
def test_fair_shares_never_exceed_the_capacity(demands: dict[str, int], capacity: int) -> None:
    shares = fair_shares(demands, capacity)
    assert set(shares) == set(demands)
    assert sum(shares.values()) <= capacity
    assert all(share >= 0 for share in shares.values())


@given(demands_st, st.integers(0, 20_000))
def test_fair_shares_are_max_min_fair(demands: dict[str, int], capacity: int) -> None:
    shares = fair_shares(demands, capacity)
    if sum(demands.values()) <= capacity:
        assert all(shares[r] >= demands[r] for r in demands)  # everybody gets what they ask
        return
    # Oversubscribed: the whole capacity is handed out, nobody gets more than asked, and a
    # replica that gets less than it asks gets at least as much as anybody else (minus 1: integers).
    assert sum(shares.values()) == capacity
    assert all(shares[r] <= demands[r] for r in demands)
    top = max(shares.values())
    for replica, wanted in demands.items():
        if shares[replica] < wanted:
            assert shares[replica] >= top - 1
    # An equal share goes to whoever asks less than it.
    equal = capacity // len(demands)
    assert all(shares[r] == demands[r] for r in demands if demands[r] <= equal)


def test_fair_share_examples() -> None:
    assert fair_shares({"a": 160, "b": 22, "c": 22}, 100) == {"b": 22, "c": 22, "a": 56}
    assert fair_shares({"a": 50, "b": 50, "c": 50}, 100) == {"a": 34, "b": 33, "c": 33}
    # Undersubscribed: demands met, slack spread, one equal share kept back for a newcomer.
    assert fair_shares({"a": 10, "b": 10}, 100) == {"a": 37, "b": 36}
    assert fair_shares({}, 100) == {}


@given(
    st.dictionaries(replica_ids, st.tuples(st.integers(0, 1000), st.integers(0, 1000)), max_size=10),
    st.integers(0, 3000),
)
def test_grants_never_hand_out_what_a_live_lease_holds(pairs: dict[str, tuple[int, int]], capacity: int) -> None:
    targets = {r: target for r, (target, _) in pairs.items()}
    reserved = {r: held for r, (_, held) in pairs.items()}
    if sum(reserved.values()) > capacity:
        reserved = dict.fromkeys(reserved, 0)
    offers = grants(targets, reserved, capacity)
    assert sum(max(reserved[r], offers[r]) for r in pairs) <= capacity
    assert all(0 <= offers[r] <= targets[r] for r in pairs)


def test_safe_capacity_is_the_local_failure_rule() -> None:
    assert safe_capacity(100, 3) == 34
    assert safe_capacity(100, 0) == 100


def call(replica: str, demand: int, limit: int = 100, **extra: int) -> Call:
    return Call(replica, demand, limit, lease_ms=10_000, stale_ms=15_000, master_ms=15_000, **extra)


def in_force(bucket: Bucket, now: int) -> int:
    return sum(entry.held for entry in bucket.entries.values() if entry.held_until > now)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["a", "b", "c", "d", "e"]),
            st.one_of(st.integers(0, 300), st.just(POLL), st.just(LEAVE)),
            st.integers(0, 4000),
        ),
        min_size=1,
        max_size=80,
    )
)
def test_no_double_allocation_on_a_simulated_clock(calls: list[tuple[str, int, int]]) -> None:
    """Any order of reports, polls, departures and silences (dead replicas): the leases in
    force never add up to more than the limit, at any instant, across every expiry."""
    bucket = Bucket()
    now = 0
    for replica, demand, wait in calls:
        now += wait
        assert in_force(bucket, now) <= 100
        step(bucket, call(replica, demand), now)
        assert in_force(bucket, now) <= 100
        # A replica's lease counts until it ends, whatever the bucket's record says since.
        assert sum(max(e.held if e.held_until > now else 0, e.grant) for e in bucket.entries.values()) <= 100


def test_a_dead_replicas_lease_is_redistributed_only_after_it_expired() -> None:
    bucket = Bucket()
    for now, replica in ((0, "a"), (1, "b"), (2, "c")):
        step(bucket, call(replica, 100), now)
    for now in range(1000, 5001, 1000):  # everybody reports; shares settle at 34/33/33
        for replica in "abc":
            step(bucket, call(replica, 100), now)
    held = {r: e.held for r, e in bucket.entries.items()}
    assert sorted(held.values()) == [33, 33, 34]
    # c dies at 5000 (its lease runs to 15000); a and b ask for everything.
    for now in range(6000, 15001, 1000):
        for replica in "ab":
            step(bucket, call(replica, 100), now)
            assert in_force(bucket, now) <= 100
        assert bucket.entries["a"].held + bucket.entries["b"].held <= 100 - held["c"]
    for now in range(16000, 26001, 1000):  # stale at 20000, then the master computes (every 5 s)
        for replica in "ab":
            step(bucket, call(replica, 100), now)
    assert bucket.entries["a"].held + bucket.entries["b"].held == 100
    assert "c" not in bucket.entries  # silent past its demand's staleness and its lease


def test_a_new_replica_gets_a_share_in_its_first_call_when_there_is_slack() -> None:
    bucket = Bucket()
    step(bucket, call("a", 10), 0)
    reply = step(bucket, call("b", 10), 100)
    assert reply.grant >= 10
    reply = step(bucket, call("c", 10), 200)  # not master, gap not due: served from the slack
    assert not reply.computed and reply.grant == 10


def test_a_demand_shift_converges_as_shrinking_replicas_pick_up() -> None:
    bucket = Bucket()
    for now in range(0, 3000, 1000):
        step(bucket, call("a", 150), now)
        step(bucket, call("b", 10), now + 10)
    assert bucket.entries["a"].held > 80
    # The demand moves from a to b; b asks first: it waits for a's lease to shrink.
    step(bucket, call("b", 150), 3010)
    assert bucket.entries["b"].held < 50
    reply = step(bucket, call("a", 10), 3500)  # a reports less: too soon to compute again (1 s gap)
    assert reply.unsettled and not reply.computed  # so a polls a second later
    reply = step(bucket, call("a", POLL), 4500)  # computes, picks up its smaller share, computes again
    assert reply.grant <= 15 and reply.computed
    reply = step(bucket, call("b", POLL), 5020)  # b (hungry: polls every second) picks up the rest
    assert reply.grant >= 80


def test_windowed_shares_are_of_what_is_left() -> None:
    bucket = Bucket()
    step(bucket, call("a", 60, window=0, used_add=0), 0)
    step(bucket, call("b", 60, window=0, used_add=0), 10)
    reply = step(bucket, call("a", 60, window=0, used_add=40), 5000)
    assert reply.capacity == 60
    reply = step(bucket, call("a", 60, window=60, used_add=0), 60_000)  # a new window: all of it again
    assert reply.capacity == 100


def test_every_number_of_a_call_is_clamped_before_any_arithmetic() -> None:
    """Issue 25, defect 5: a report of 2^64-1 must not overflow a window's counter nor ask for
    more than the whole limit; what the reference does, share.lua does (test_shares_redis)."""
    huge = 2**64 - 1
    poisoned = call("a", huge, window=0, used_add=huge)
    cut = clamped(poisoned)
    assert (cut.demand, cut.used_add, cut.limit) == (100, 100, 100)
    assert clamped(call("a", 50)) is not None and clamped(call("a", POLL)).demand == POLL
    assert clamped(call("a", -7)).demand == 0  # neither a poll nor a leave: no units
    bucket = Bucket()
    reply = step(bucket, poisoned, 0)
    assert reply.capacity == 0 and bucket.used == {0: 100}  # the window is spent, no more
    assert step(bucket, call("b", 10, window=0, used_add=huge), 10).capacity == 0


def test_a_silent_replicas_lease_stays_reserved_for_the_hold() -> None:
    """Issue 25, defect 9: a replica that stops calling may be cut off from Redis, not dead.
    Its lease stays reserved ``hold_ms`` past its end; only then is it handed on."""
    bucket = Bucket()
    hold = {"hold_ms": 20_000}
    step(bucket, call("a", 100, **hold), 0)
    step(bucket, call("b", 100, **hold), 10)
    for now in range(1_000, 4_000, 1_000):  # both settle at 50 each
        step(bucket, call("a", 100, **hold), now)
        step(bucket, call("b", 100, **hold), now + 10)
    held_by_b = bucket.entries["b"].held
    assert held_by_b == 50
    ends = bucket.entries["b"].held_until
    for now in range(4_000, ends + 20_000, 1_000):  # b is silent: a asks for everything
        reply = step(bucket, call("a", 100, **hold), now)
        assert reply.grant + held_by_b <= 100
    for now in range(ends + 20_000, ends + 28_000, 1_000):  # the master's next computation
        reply = step(bucket, call("a", 100, **hold), now)
    assert reply.grant == 100 and "b" not in bucket.entries  # handed on once the hold ended
