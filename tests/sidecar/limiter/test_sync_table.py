"""CounterTable (sync mode's counters) on its own, and sync's failure decision as the plain
function it is: what SyncLimiter composes, checked without a limiter around it."""

from __future__ import annotations

import pytest

from sidecar.limiter.failure import sync_failure_limits
from sidecar.limiter.protocol import Check, Role
from sidecar.limiter.shares import share_of_limit
from sidecar.limiter.sync_table import CounterTable

NOW = 1_000.5


def check(value: str, limit: int = 10, hits: int = 1) -> Check:
    return Check(("rule", value), 60, limit, hits)


def use(table: CounterTable, value: str, *, pending: int = 0) -> None:
    """What a request does: take the counter, admit ``pending`` hits on it, release it."""
    counter = table.counter(check(value), NOW)
    counter.pending += pending
    counter.busy -= 1


def test_the_same_check_gets_the_same_counter_and_a_new_window_a_new_one() -> None:
    table = CounterTable(max_counters=10)
    first = table.counter(check("a"), NOW)
    assert table.counter(check("a"), NOW + 1) is first
    assert first.busy == 2, "each request holds the counter until it has decided"
    assert table.counter(check("a"), NOW + 60) is not first
    assert table.live_counters == 2


def test_at_the_cap_counters_redis_holds_make_room_and_unflushed_ones_never_do() -> None:
    table = CounterTable(max_counters=10)
    for index in range(5):
        use(table, f"flushed-{index}")
    for index in range(5):
        use(table, f"pending-{index}", pending=1)
    use(table, "new")
    assert table.live_counters <= 10
    assert table.evictions >= 1
    assert table.unflushed_hits() == 5, "no admitted hit Redis lacks was forgotten"
    assert table.expired_hits == 0


def test_a_full_table_of_unflushed_counters_does_not_remember_a_new_one_nor_scan_for_each() -> None:
    table = CounterTable(max_counters=10)
    for index in range(10):
        use(table, f"pending-{index}", pending=1)
    stranger = table.counter(check("stranger"), NOW)
    assert not stranger.remembered
    assert table.live_counters == 10
    # The scan read every counter and freed none: the next new counters are refused without
    # one, even once counters became forgettable, until a flush lands.
    for counter in table.all_counters():
        counter.pending = 0
    assert not table.counter(check("next"), NOW).remembered
    assert table.evictions == 0
    table.flush_landed()
    assert table.remembered(check("stranger"), stranger, NOW).remembered
    assert table.evictions > 0
    assert table.has_unflushed() is False


def test_ended_windows_are_forgotten_once_redis_holds_their_hits() -> None:
    table = CounterTable(max_counters=10)
    use(table, "done")
    use(table, "owed", pending=2)
    table.expire(NOW + 120)
    assert [counter.pending for counter in table.all_counters()] == [2]


CHECKS = [check("a", limit=10, hits=1)]


@pytest.mark.parametrize("mode", ["open", "closed"])
def test_open_and_closed_count_what_is_known(mode: str) -> None:
    counts, limits = sync_failure_limits(
        mode, CHECKS, own=[1], known=[7], doubt=[0], remembered=[True], live=2, late=False
    )
    assert counts == (7,)
    assert limits == ((10,) if mode == "open" else (-1,))


def test_local_holds_to_the_share_raised_by_what_is_known_and_in_doubt() -> None:
    share = share_of_limit(10, 2)
    counts, limits = sync_failure_limits(
        "local", CHECKS, own=[1], known=[7], doubt=[3], remembered=[True], live=2, late=False
    )
    assert limits == (share,)
    assert counts == (share - 10 + 7 + 3,), "known + in doubt leaves less than the share"


def test_local_late_near_the_limit_refuses_as_closed_and_far_from_it_shares() -> None:
    near = sync_failure_limits("local", CHECKS, own=[1], known=[7], doubt=[0], remembered=[True], live=2, late=True)
    far = sync_failure_limits("local", CHECKS, own=[1], known=[2], doubt=[0], remembered=[True], live=2, late=True)
    assert near[1] == (-1,)
    assert far[1] == (share_of_limit(10, 2),)


def test_local_refuses_a_counter_that_could_not_be_remembered_only() -> None:
    checks = [check("a"), check("b")._replace(role=Role.ENFORCED)]
    _, limits = sync_failure_limits(
        "local", checks, own=[1, 1], known=[1, 1], doubt=[0, 0], remembered=[True, False], live=1, late=False
    )
    assert limits == (10, -1)
