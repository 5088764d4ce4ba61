"""The models the accuracy and comparison harnesses judge ``sliding_window`` and ``token_bucket`` by.

Fast: no process is started. Each harness model must decide exactly as the sidecar's own
memory backend on the same arrivals (the spec, ``sidecar/limiter/algorithms.py``), and the
figures computed from recorded calls must flag a violation and only a violation:

* ``loadtest/accuracy_harness/algorithms.py``: the exact two-window estimate and the GCRA
  bucket fed arrivals, the envelope excess, the estimate's overshoot and false rejections;
* ``loadtest/compare_harness/sliding.py``: the sidecar's sliding window and HAProxy 2.6's
  ``freq_ctr`` arithmetic (whole milliseconds, periods started by the first hit).
"""

from __future__ import annotations

import random
from array import array

import pytest

from loadtest.accuracy_harness import algorithms
from loadtest.accuracy_harness.analysis import OK, OVER_LIMIT, Calls
from loadtest.compare_harness import sliding
from sidecar.limiter.algorithms import Algorithm, emission_interval_us
from sidecar.limiter.memory import MemoryLimiter
from sidecar.limiter.protocol import Check

BASE = 1_800_000_000.0
"""An epoch second: every test's arrivals start on it."""


def arrivals(seed: int, count: int, seconds: float) -> list[float]:
    rng = random.Random(seed)
    return sorted(BASE + rng.random() * seconds for _ in range(count))


def memory_verdicts(check: Check, times: list[float]) -> list[bool]:
    limiter = MemoryLimiter()
    return [limiter.check_now([check], moment).admitted for moment in times]


def calls_from(times: list[float], verdicts: list[bool], latency: float = 0.0002) -> Calls:
    """One counter's calls, each answered ``latency`` after it was sent."""
    count = len(times)
    return Calls(
        replica=array("b", [0] * count),
        value=array("i", [0] * count),
        scheduled=array("d", times),
        send=array("d", times),
        recv=array("d", [moment + latency for moment in times]),
        code=array("b", [OK if verdict else OVER_LIMIT for verdict in verdicts]),
    )


# ---------------------------------------------------------------- the models decide as the sidecar does


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_sliding_reference_decides_as_the_memory_backend(seed: int) -> None:
    times = arrivals(seed, 400, 4.0)
    check = Check(("sliding", str(seed)), 1, 25, 1, algorithm=Algorithm.SLIDING_WINDOW)
    expected = memory_verdicts(check, times)
    admitted = set(algorithms.simulate_sliding(times, 25, 1))
    assert [moment in admitted for moment in times] == expected
    assert sliding.ours(times, 25) == expected


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_bucket_reference_decides_as_the_memory_backend(seed: int) -> None:
    times = arrivals(seed, 400, 4.0)
    interval = emission_interval_us(1, 50)
    check = Check(("bucket", str(seed)), 1, 10, 1, algorithm=Algorithm.TOKEN_BUCKET, interval_us=interval)
    expected = memory_verdicts(check, times)
    admitted = set(algorithms.simulate_bucket(times, 10, interval))
    assert [moment in admitted for moment in times] == expected


def test_haproxy_counts_in_whole_milliseconds_and_starts_periods_at_the_first_hit() -> None:
    counter = sliding.HAProxyCounter()
    counter.increment(10_001)  # the first hit starts the period, low bit cleared
    assert (counter.tick, counter.current, counter.previous) == (10_000, 1, 0)
    for _ in range(19):
        counter.increment(10_500)
    assert counter.read(10_999) == 20
    assert counter.read(11_000) == 20  # 20 x 1000 / 1000 of the previous period
    assert counter.read(11_500) == 10  # half of it
    counter.increment(11_500)  # rotation: the previous period holds 20
    assert (counter.tick, counter.current, counter.previous) == (11_000, 1, 20)
    assert counter.read(11_750) == 1 + 5
    counter.increment(14_003)  # two periods missed: the next hit starts again
    assert (counter.tick, counter.current, counter.previous) == (14_002, 1, 0)


def test_haproxys_formula_is_ours_but_for_its_millisecond_clock() -> None:
    times = arrivals(7, 600, 4.0)
    ours, theirs = sliding.ours(times, 20), sliding.haproxy(times, 20)
    # Only a request just after a step of the estimate (HAProxy still reads the millisecond before it)
    # and the request that evens it out differ; the grids coincide since the first hit is on second 0.
    differ = [index for index, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b]
    assert len(differ) <= len(times) // 10
    assert abs(sum(ours) - sum(theirs)) <= 1
    aligned = [BASE + 0.0001, *times]
    assert sliding.ours(aligned, 20)[0] and sliding.haproxy(aligned, 20)[0]


# ---------------------------------------------------------------- figures flag violations, and only those


def test_an_exact_sliding_limiter_has_no_overshoot_of_its_estimate() -> None:
    times = arrivals(11, 300, 3.0)
    verdicts = sliding.ours(times, 20)
    figures = algorithms.sliding_figures(calls_from(times, verdicts), 20, 1)
    assert figures["estimate_over_definite_max_hits"] == 0
    assert figures["estimate_over_max_hits"] == 0
    assert figures["false_vs_estimate_definite"] == 0
    assert figures["admitted"] == figures["reference_admitted"] == sum(verdicts)
    assert figures["exact_log_admitted"] >= figures["admitted"] * 0.9
    assert figures["fixed_reference_exact_max_pct"] >= figures["reference_exact_max_pct"]


def test_one_admission_too_many_is_a_definite_overshoot_of_the_estimate() -> None:
    times = arrivals(11, 300, 3.0)
    verdicts = sliding.ours(times, 20)
    refused = [index for index, verdict in enumerate(verdicts) if not verdict and times[index] - BASE > 1.2]
    verdicts[refused[0]] = True
    figures = algorithms.sliding_figures(calls_from(times, verdicts), 20, 1)
    assert figures["estimate_over_definite_max_hits"] >= 1


def test_a_refusal_with_room_left_is_a_definite_false_rejection() -> None:
    times = [BASE + 0.1 * step for step in range(10)]
    verdicts = [True] * 10
    verdicts[5] = False
    figures = algorithms.sliding_figures(calls_from(times, verdicts), 20, 1)
    assert figures["false_vs_estimate_definite"] == 1
    assert figures["false_vs_exact_log"] == 1


def test_the_bucket_envelope() -> None:
    # burst 3 at 10/s: 3 at once, then one every 100 ms fits exactly; one more does not.
    fitting = [0.0, 0.0, 0.0, 0.1, 0.2, 0.3]
    assert algorithms.envelope_excess(fitting, fitting, 3, 10.0) == pytest.approx(0.0)
    extra = sorted([*fitting, 0.3])
    assert algorithms.envelope_excess(extra, extra, 3, 10.0) == pytest.approx(1.0)


def test_an_exact_bucket_has_no_excess_and_an_extra_admission_has() -> None:
    times = arrivals(5, 400, 3.0)
    interval = emission_interval_us(1, 50)
    admitted = set(algorithms.simulate_bucket(times, 10, interval))
    verdicts = [moment in admitted for moment in times]
    figures = algorithms.bucket_figures(calls_from(times, verdicts), 50, 10, 1)
    assert figures["excess_definite_max_hits"] <= 0
    assert figures["false_rejections_definite"] == 0
    assert figures["admitted"] == figures["ideal_admitted"]
    verdicts[verdicts.index(False)] = True
    assert algorithms.bucket_figures(calls_from(times, verdicts), 50, 10, 1)["excess_definite_max_hits"] > 0
