"""``overload: suppress``: the attempted-demand estimator on a controllable clock, ``p``,
the draw, and the memory backend applying it before the window check."""

from __future__ import annotations

import pytest

from sidecar.limiter.algorithms import Algorithm
from sidecar.limiter.memory import MemoryLimiter
from sidecar.limiter.protocol import Check
from sidecar.limiter.suppression import AVERAGE_OVER, Demand, Suppression, slot_ms, slot_of

T0 = 1_700_000_000.0  # on a second boundary
SLOT = 0.1  # a 1 s window's sub-interval


def suppressed(key: str = "k", limit: int = 100, hits: int = 1, algorithm: Algorithm = Algorithm.FIXED_WINDOW):
    return Check((key,), 1, limit, hits, algorithm=algorithm, suppress=True)


def feed(demand: Demand, start: float, seconds: float, per_second: float) -> float:
    """Attempt ``per_second`` hits for ``seconds`` from ``start``, evenly; returns the end."""
    count = round(seconds * per_second)
    for index in range(count):
        now = start + index / per_second
        demand.attempt(slot_of(now, demand.length_ms), 1)
    return start + seconds


def test_sub_intervals_are_a_tenth_of_the_window_and_aligned_to_the_epoch():
    assert slot_ms(1) == 100 and slot_ms(60) == 6000
    assert slot_of(T0 + 0.05, 100) == slot_of(T0 + 0.099, 100) != slot_of(T0 + 0.1, 100)


def test_within_the_limit_p_is_exactly_one():
    demand = Demand(100)
    end = feed(demand, T0, 2.0, 95)  # 9.5 a slot against 10 allowed
    assert demand.probability(slot_of(end - 0.001, 100), 100) == 1.0


def test_onset_counts_within_the_sub_interval_it_starts_in():
    """The in-progress rule: a spike raises the estimate before its sub-interval ends."""
    demand = Demand(100)
    end = feed(demand, T0, 1.0, 50)  # 5 a slot: p = 1
    slot = slot_of(end, 100)
    assert demand.probability(slot, 100) == 1.0
    for _ in range(30):  # 30 in the first part of one slot (300/s)
        demand.attempt(slot, 1)
    assert demand.rate(slot) == 30  # the average of complete slots is still 5
    assert demand.probability(slot, 100) == pytest.approx(10 / 30)


def test_onset_settles_within_average_over_sub_intervals():
    demand = Demand(100)
    end = feed(demand, T0, 1.0, 50)
    end = feed(demand, end, AVERAGE_OVER * SLOT, 300)
    # At the start of the next slot (nothing in progress yet) only complete slots count.
    assert demand.probability(slot_of(end + 0.001, 100), 100) == pytest.approx(10 / 30)


def test_decay_follows_the_demand_down_within_average_over_sub_intervals():
    demand = Demand(100)
    end = feed(demand, T0, 1.0, 300)
    end = feed(demand, end, SLOT, 50)
    first = demand.probability(slot_of(end + 0.001, 100), 100)
    assert 10 / 30 < first < 1.0  # half the average is still the overload
    end = feed(demand, end, (AVERAGE_OVER - 1) * SLOT, 50)
    assert demand.probability(slot_of(end + 0.001, 100), 100) == 1.0


def test_idle_slots_count_as_nothing():
    demand = Demand(100)
    end = feed(demand, T0, 1.0, 300)
    later = slot_of(end + 5.0, 100)
    assert demand.rate(later) == 0 and demand.probability(later, 100) == 1.0


def test_refused_hits_are_attempted_too():
    """Refused requests are demand: the estimate counts every check, whatever the verdict."""
    limiter = MemoryLimiter(suppression_seed=1)
    for index in range(300):
        limiter.check_now([suppressed(limit=100)], T0 + index / 300)
    demand = limiter.suppression.demands[("k",)]
    assert demand.rate(slot_of(T0 + 0.999, 100)) == pytest.approx(30, abs=1)


def test_draws_admit_the_limit_steadily_at_three_times_the_limit():
    """At 3x, admissions spread over the window instead of filling its first third."""
    limiter = MemoryLimiter(suppression_seed=7)
    per_slice = [0] * 30
    for index in range(900):  # 3 s at 300/s against 100/s
        now = T0 + index / 300
        if limiter.check_now([suppressed(limit=100)], now).admitted:
            per_slice[int((now - T0) * 10)] += 1
    seconds = [sum(per_slice[start : start + 10]) for start in (10, 20)]
    assert all(90 <= admitted <= 100 for admitted in seconds), seconds
    # No slice of a settled window takes more than a few times its share (plain: 100 in the first).
    assert max(per_slice[10:]) <= 20, per_slice


def test_the_window_stays_the_hard_cap():
    limiter = MemoryLimiter(suppression_seed=3)
    admitted = sum(limiter.check_now([suppressed(limit=10, hits=1)], T0 + i / 1000).admitted for i in range(1000))
    assert admitted <= 10


def test_a_suppressed_answer_is_an_ordinary_over_limit():
    limiter = MemoryLimiter(suppression_seed=0)
    decisions = [limiter.check_now([suppressed(limit=100)], T0 + i / 3000) for i in range(300)]
    refused = [decision for decision in decisions if not decision.admitted]
    assert refused and all(decision.over == (True,) for decision in refused)
    assert any(decision.suppressed == (True,) for decision in refused)
    assert limiter.suppression.suppressed == sum(1 for decision in refused if decision.suppressed)
    assert all(decision.remaining(0) == 0 for decision in refused)


def test_the_same_seed_draws_the_same():
    def run(seed: int) -> list[bool]:
        limiter = MemoryLimiter(suppression_seed=seed)
        return [limiter.check_now([suppressed()], T0 + i / 3000).admitted for i in range(300)]

    assert run(5) == run(5)


def test_checks_without_the_option_keep_first_come_first_served():
    limiter = MemoryLimiter(suppression_seed=0)
    plain = Check(("k",), 1, 100, 1)
    admitted = [limiter.check_now([plain], T0 + i / 300).admitted for i in range(300)]
    assert admitted[:100] == [True] * 100 and not any(admitted[100:])
    assert not limiter.suppression.demands


def test_sliding_windows_are_suppressed_too():
    limiter = MemoryLimiter(suppression_seed=2)
    check = suppressed(limit=100, algorithm=Algorithm.SLIDING_WINDOW)
    decisions = [limiter.check_now([check], T0 + i / 300) for i in range(600)]
    assert any(decision.suppressed for decision in decisions[:100])


def test_followed_counters_are_capped_least_recently_used_first():
    suppression = Suppression(max_counters=2, seed=0)
    for key in ("a", "b", "a", "c"):
        suppression.refused([suppressed(key)], [100], T0)
    assert list(suppression.demands) == [("a",), ("c",)]
    assert suppression.forgotten == 1


def test_zero_hit_checks_attempt_nothing_and_are_not_drawn():
    suppression = Suppression(seed=0)
    assert suppression.refused([suppressed(hits=0)], [0], T0) is None
    assert not suppression.demands


def test_describe_shows_the_busiest_with_p_bounded():
    suppression = Suppression(seed=0)
    for index in range(30):
        for _ in range(index + 1):
            suppression.refused([suppressed(f"k{index}", limit=10)], [10], T0)
    shown = suppression.describe(T0, limit=5)
    assert len(shown) == 5
    assert shown[0]["counter"] == ["k29"] and shown[0]["p"] == pytest.approx(1 / 30, abs=1e-3)
    assert shown[0]["attempted_per_second"] == 300.0


def test_a_draw_is_no_full_window_and_bans_nothing():
    limiter = MemoryLimiter(suppression_seed=0)
    check = Check(("k",), 1, 100, 1, ban_seconds=60, suppress=True)
    decisions = [limiter.check_now([check], T0 + i / 3000) for i in range(100)]
    assert any(decision.suppressed for decision in decisions)
    assert limiter.check_now([check], T0 + 5.0).admitted  # later, calm: no ban was set
