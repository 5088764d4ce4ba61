"""Accuracy of ``algorithm: sliding_window`` and ``token_bucket``, from the recorded calls.

Every call of a run is known by its send time ``s`` and receive time ``r`` on the
sidecars' clock (``time.time()`` on one host); the sidecar decided it at some instant in
``[s, r]``. Figures are computed per counter (descriptor value) over the calls that got
an answer, in two forms:

* **measured**: each call is placed at the midpoint of ``[s, r]`` (latencies are a few
  ms, so only hits within that distance of an edge can be misplaced);
* **definite**: only what no placement inside the intervals can explain away, so a
  non-zero definite figure is a real violation, whatever the timing.

Sliding window (``sliding_window``: count = current window + floor(previous window x
the share of it the sliding window ``(t - unit, t]`` still covers), as HAProxy's
``http_req_rate``):

* **exact sliding count** of an admitted call at ``t``: admitted calls in ``(t - unit, t]``
  (itself included), what an exact sliding log counts. Its max and p99 over the
  admitted calls, in % of the limit, are the overshoot over any sliding window.
* **estimate** at ``t``: the formula above applied to the admitted calls (windows aligned
  to the epoch as the sidecar's); ``estimate - exact`` per admitted call is the error
  of the two-window estimate (negative: it undercounts, which is where an exact log
  would have refused).
* **estimate overshoot**: admitted calls whose estimate exceeds the limit, i.e. the
  replicas together admitted more than one exact instance of the algorithm would
  have. Definite: counting only admissions answered before the call was sent, the
  earliest-possible weight and no call straddling a boundary.
* **false rejections against the estimate**: refused while the estimate with the call
  would have been within the limit (definite: counting every admission that may have
  been decided before it, at the largest possible weight). **Against an exact
  sliding log**: refused while the exact sliding count plus the call was within the
  limit: the two-window estimate does that by design whenever the previous window's
  hits came early, so compare it with the reference.
* **reference**: one exact instance of the algorithm fed the same arrivals (each call at
  its send time, every replica's calls merged) and, for scale, an exact sliding log fed
  them too: what each admits and, for the reference, the same figures as above; and an exact
  fixed window fed them, whose exact sliding count shows the 2x a window boundary lets through.

Token bucket (``token_bucket``, GCRA: refill ``rate`` = requests_per_unit per unit, bucket
``burst``):

* **envelope**: in any interval of length ``d`` a bucket admits at most ``burst + rate x d``
  (GCRA admits ``burst + floor(rate x d)`` in a closed interval). **Excess** = admitted
  in the interval minus that, maximised over all intervals between two admitted calls.
  Definite: each pair's interval taken as long as the timestamps allow
  (from the first call's send to the latest receive of the calls in between).
* **ideal bucket**: one exact GCRA fed the same arrivals; calls refused by the sidecars
  but admitted by it, and the other way round, and both admitted totals.
* **false rejections**: refused while a bucket replaying the sidecars' own admitted calls
  still had a token (definite: those admissions placed as late as possible, the call as
  early as possible).
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from loadtest.accuracy_harness.analysis import OK, OVER_LIMIT, Calls
from loadtest.common import percentile

MICROSECONDS = 1_000_000
CLOCK_MARGIN = 0.001
"""Seconds a sidecar's window clock may differ from the load generator's (Redis's clock in redis
modes is read over loopback: well under a millisecond)."""


def window_of(moment: float, unit_seconds: int) -> int:
    """Window start as the sidecar computes it (``sidecar.limiter.windows.window_start``)."""
    whole = math.floor(moment)
    return whole - whole % unit_seconds


def certain_window(send: float, recv: float, unit_seconds: int) -> int | None:
    """The window a call decided in ``[send, recv]`` certainly fell in, give or take the clock margin."""
    start = window_of(send - CLOCK_MARGIN, unit_seconds)
    return start if window_of(recv + CLOCK_MARGIN, unit_seconds) == start else None


def weight(moment: float, unit_seconds: int) -> float:
    """``sidecar.limiter.algorithms.previous_weight``: share of the previous window still covered."""
    start = window_of(moment, unit_seconds)
    return (start + unit_seconds - moment) / unit_seconds


def interval_us(unit_seconds: int, rate: int) -> int:
    """``sidecar.limiter.algorithms.emission_interval_us``: GCRA's ``T`` in microseconds."""
    return max(1, round(unit_seconds * MICROSECONDS / rate))


@dataclass
class Counter:
    """One counter's answered calls: send, receive, midpoint, verdict (send order)."""

    send: list[float] = field(default_factory=list)
    recv: list[float] = field(default_factory=list)
    admitted: list[bool] = field(default_factory=list)

    def middle(self, index: int) -> float:
        return (self.send[index] + self.recv[index]) / 2

    def split(self) -> tuple[list[int], list[int]]:
        """Indices of the admitted and of the refused calls."""
        admitted = [i for i, verdict in enumerate(self.admitted) if verdict]
        refused = [i for i, verdict in enumerate(self.admitted) if not verdict]
        return admitted, refused


def counters(calls: Calls) -> dict[int, Counter]:
    """Answered calls (admitted or refused) per descriptor value, in send order."""
    found: dict[int, list[tuple[float, float, bool]]] = defaultdict(list)
    for i in calls.sent():
        code = calls.code[i]
        if code in (OK, OVER_LIMIT):
            found[calls.value[i]].append((calls.send[i], calls.recv[i], code == OK))
    result = {}
    for value, items in found.items():
        items.sort()
        result[value] = Counter([s for s, _, _ in items], [r for _, r, _ in items], [a for _, _, a in items])
    return result


def _distribution(values: Sequence[float]) -> dict[str, float]:
    ordered = sorted(values)
    if not ordered:
        return {}
    return {
        "min": ordered[0],
        "p1": percentile(ordered, 0.01),
        "p50": percentile(ordered, 0.50),
        "p99": percentile(ordered, 0.99),
        "max": ordered[-1],
    }


# ---------------------------------------------------------------- sliding window


def sliding_estimate(admitted: Sequence[float], moment: float, unit: int, extra: int) -> int:
    """The sidecar's count at ``moment`` from admitted times (sorted): current window up to
    ``moment`` + ``extra`` + floor(previous window x weight)."""
    start = window_of(moment, unit)
    first = bisect.bisect_left(admitted, start)
    current = bisect.bisect_right(admitted, moment) - first
    previous = first - bisect.bisect_left(admitted, start - unit)
    return current + extra + math.floor(previous * weight(moment, unit))


def exact_count(admitted: Sequence[float], moment: float, unit: int) -> int:
    """Admitted times (sorted) in ``(moment - unit, moment]``."""
    return bisect.bisect_right(admitted, moment) - bisect.bisect_right(admitted, moment - unit)


def simulate_sliding(arrivals: Iterable[float], limit: int, unit: int) -> list[float]:
    """One exact instance of the two-window estimate fed ``arrivals`` (sorted): what it admits."""
    admitted: list[float] = []
    windows: dict[int, int] = defaultdict(int)
    for moment in arrivals:
        start = window_of(moment, unit)
        count = windows[start] + 1 + math.floor(windows.get(start - unit, 0) * weight(moment, unit))
        if count <= limit:
            windows[start] += 1
            admitted.append(moment)
    return admitted


def simulate_sliding_log(arrivals: Iterable[float], limit: int, unit: int) -> list[float]:
    """An exact sliding log fed ``arrivals`` (sorted): admits while ``(t - unit, t]`` holds < limit."""
    admitted: list[float] = []
    oldest = 0
    for moment in arrivals:
        while oldest < len(admitted) and admitted[oldest] <= moment - unit:
            oldest += 1
        if len(admitted) - oldest + 1 <= limit:
            admitted.append(moment)
    return admitted


def simulate_fixed(arrivals: Iterable[float], limit: int, unit: int) -> list[float]:
    """An exact fixed window fed ``arrivals`` (sorted): what it admits (for scale)."""
    admitted: list[float] = []
    windows: dict[int, int] = defaultdict(int)
    for moment in arrivals:
        start = window_of(moment, unit)
        if windows[start] < limit:
            windows[start] += 1
            admitted.append(moment)
    return admitted


def exact_counts(admitted: Sequence[float], unit: int) -> list[int]:
    """Exact sliding count at every admitted time (sorted), itself included."""
    return [exact_count(admitted, moment, unit) for moment in admitted]


@dataclass
class SlidingTally:
    """Sliding-window figures summed over the counters of one run."""

    admitted: int = 0
    refused: int = 0
    exact: list[int] = field(default_factory=list)
    difference: list[int] = field(default_factory=list)
    estimate_over: list[int] = field(default_factory=list)
    estimate_over_definite: list[int] = field(default_factory=list)
    false_vs_estimate: int = 0
    false_vs_estimate_definite: int = 0
    false_vs_exact: int = 0
    ambiguous: int = 0
    reference_admitted: int = 0
    reference_exact: list[int] = field(default_factory=list)
    reference_false_vs_exact: int = 0
    log_admitted: int = 0
    fixed_admitted: int = 0
    fixed_exact_max: int = 0
    offered: int = 0


def _sliding_counter(counter: Counter, limit: int, unit: int, tally: SlidingTally) -> None:
    admitted_idx, refused_idx = counter.split()
    tally.admitted += len(admitted_idx)
    tally.refused += len(refused_idx)
    tally.offered += len(counter.send)
    _sliding_measured(counter, limit, unit, tally)
    _sliding_definite(counter, limit, unit, tally)
    _sliding_references(counter, limit, unit, tally)


def _sliding_measured(counter: Counter, limit: int, unit: int, tally: SlidingTally) -> None:
    """Figures with every call at its midpoint."""
    admitted_idx, refused_idx = counter.split()
    middles = sorted(counter.middle(i) for i in admitted_idx)
    for moment in middles:
        exact = exact_count(middles, moment, unit)
        estimate = sliding_estimate(middles, moment, unit, 0)
        tally.exact.append(exact)
        tally.difference.append(estimate - exact)
        tally.estimate_over.append(max(0, estimate - limit))
    for i in refused_idx:
        moment = counter.middle(i)
        if sliding_estimate(middles, moment, unit, 1) <= limit:
            tally.false_vs_estimate += 1
        if exact_count(middles, moment, unit) + 1 <= limit:
            tally.false_vs_exact += 1


def _sliding_definite(counter: Counter, limit: int, unit: int, tally: SlidingTally) -> None:
    """Figures no placement of the calls inside their intervals explains away."""
    admitted_idx, refused_idx = counter.split()
    # A call is certainly in window W when [send - margin, recv + margin] lies in it (the
    # margin covers the clock the sidecars cut windows on, Redis's in redis modes); an admission certainly
    # preceded a call if it was answered before that call was sent.
    certain: dict[int, list[float]] = defaultdict(list)
    """Window -> receive times (sorted below) of the admissions certainly decided in it."""
    for i in admitted_idx:
        start = certain_window(counter.send[i], counter.recv[i], unit)
        if start is not None:
            certain[start].append(counter.recv[i])
    for times in certain.values():
        times.sort()
    sends = sorted(counter.send[i] for i in admitted_idx)
    late_recvs = sorted(counter.recv[i] + CLOCK_MARGIN for i in admitted_idx)
    early_sends = sorted(counter.send[i] - CLOCK_MARGIN for i in admitted_idx)
    for i in admitted_idx:
        start = certain_window(counter.send[i], counter.recv[i], unit)
        if start is None:
            tally.ambiguous += 1
            continue
        before = bisect.bisect_left(certain.get(start, []), counter.send[i])
        previous = len(certain.get(start - unit, []))
        lowest = before + 1 + math.floor(previous * weight(counter.recv[i] + CLOCK_MARGIN, unit))
        tally.estimate_over_definite.append(max(0, lowest - limit))
    for i in refused_idx:
        start = certain_window(counter.send[i], counter.recv[i], unit)
        if start is None:
            tally.ambiguous += 1
            continue
        # Admissions that may have been decided in this window before the refusal, and in the previous window.
        current = bisect.bisect_left(sends, counter.recv[i]) - bisect.bisect_left(late_recvs, start)
        previous = bisect.bisect_left(early_sends, start) - bisect.bisect_left(late_recvs, start - unit)
        highest = current + 1 + math.floor(previous * weight(counter.send[i] - CLOCK_MARGIN, unit))
        if highest <= limit:
            tally.false_vs_estimate_definite += 1


def _sliding_references(counter: Counter, limit: int, unit: int, tally: SlidingTally) -> None:
    """Exact instances of the estimate, of a sliding log and of a fixed window fed the same arrivals."""
    arrivals = sorted(counter.send)
    reference = simulate_sliding(arrivals, limit, unit)
    tally.reference_admitted += len(reference)
    tally.reference_exact += exact_counts(reference, unit)
    chosen = set(reference)
    tally.reference_false_vs_exact += sum(
        1 for moment in arrivals if moment not in chosen and exact_count(reference, moment, unit) + 1 <= limit
    )
    tally.log_admitted += len(simulate_sliding_log(arrivals, limit, unit))
    fixed = simulate_fixed(arrivals, limit, unit)
    tally.fixed_admitted += len(fixed)
    tally.fixed_exact_max = max(tally.fixed_exact_max, max(exact_counts(fixed, unit), default=0))


def _pct(hits: float, limit: int) -> float:
    return round(100.0 * hits / limit, 2)


def sliding_figures(calls: Calls, limit: int, unit_seconds: int) -> dict[str, Any]:
    """Sliding-window figures of one run (see the module docstring)."""
    tally = SlidingTally()
    for counter in counters(calls).values():
        _sliding_counter(counter, limit, unit_seconds, tally)
    exact = sorted(tally.exact)
    reference = sorted(tally.reference_exact)
    difference = _distribution(tally.difference)
    return {
        "algorithm": "sliding_window",
        "limit": limit,
        "offered": tally.offered,
        "admitted": tally.admitted,
        "refused": tally.refused,
        "exact_max_hits": exact[-1] if exact else 0,
        "exact_max_pct": _pct(exact[-1] if exact else 0, limit),
        "exact_p99_pct": _pct(percentile(exact, 0.99), limit),
        "exact_over_limit_calls": sum(1 for count in exact if count > limit),
        "estimate_minus_exact": difference,
        "estimate_over_max_hits": max(tally.estimate_over, default=0),
        "estimate_over_calls": sum(1 for over in tally.estimate_over if over),
        "estimate_over_definite_max_hits": max(tally.estimate_over_definite, default=0),
        "estimate_over_definite_calls": sum(1 for over in tally.estimate_over_definite if over),
        "false_vs_estimate": tally.false_vs_estimate,
        "false_vs_estimate_definite": tally.false_vs_estimate_definite,
        "false_vs_exact_log": tally.false_vs_exact,
        "straddling": tally.ambiguous,
        "reference_admitted": tally.reference_admitted,
        "reference_exact_max_hits": reference[-1] if reference else 0,
        "reference_exact_max_pct": _pct(reference[-1] if reference else 0, limit),
        "reference_exact_p99_pct": _pct(percentile(reference, 0.99), limit),
        "reference_false_vs_exact_log": tally.reference_false_vs_exact,
        "exact_log_admitted": tally.log_admitted,
        "fixed_reference_admitted": tally.fixed_admitted,
        "fixed_reference_exact_max_pct": _pct(tally.fixed_exact_max, limit),
    }


# ---------------------------------------------------------------- token bucket


def envelope_excess(starts: Sequence[float], ends: Sequence[float], burst: float, rate: float) -> float:
    """Max over i <= j of ``(j - i + 1) - burst - rate x (ends[j] - starts[i])`` (calls in send
    order; ``ends[j]`` must be at least every end before it). With ``starts == ends`` = the times of
    the admitted calls it is the excess over the envelope; with sends and running-max receives it
    is the definite excess."""
    best = -math.inf
    lowest = math.inf
    for j in range(len(starts)):
        lowest = min(lowest, (j - 1) - rate * starts[j])
        best = max(best, (j - rate * ends[j]) - lowest - burst)
    return best if best != -math.inf else -float(burst)


def simulate_bucket(arrivals: Iterable[float], burst: int, interval: int) -> list[float]:
    """One exact GCRA fed ``arrivals`` (sorted), as ``sidecar.limiter.algorithms.bucket_after``:
    what it admits."""
    tat = 0
    admitted = []
    for moment in arrivals:
        now = math.floor(moment * MICROSECONDS)
        after = max(tat, now) + interval
        if -(-(after - now) // interval) <= burst:
            tat = after
            admitted.append(moment)
    return admitted


def bucket_tat(admitted: Sequence[float], interval: int) -> list[int]:
    """TAT after each of ``admitted`` (sorted), every one taking one token."""
    tat = 0
    result = []
    for moment in admitted:
        tat = max(tat, math.floor(moment * MICROSECONDS)) + interval
        result.append(tat)
    return result


def _token_free(tats: Sequence[int], admitted: Sequence[float], moment: float, burst: int, interval: int) -> bool:
    """Whether a bucket that admitted ``admitted`` (sorted, with their TATs) had a token at ``moment``."""
    position = bisect.bisect_right(admitted, moment)
    tat = tats[position - 1] if position else 0
    now = math.floor(moment * MICROSECONDS)
    after = max(tat, now) + interval
    return -(-(after - now) // interval) <= burst


@dataclass
class BucketTally:
    offered: int = 0
    admitted: int = 0
    refused: int = 0
    excess: float = -math.inf
    excess_definite: float = -math.inf
    excess_calls: int = 0
    ideal_admitted: int = 0
    refused_but_ideal_admits: int = 0
    admitted_but_ideal_refuses: int = 0
    false_rejections: int = 0
    false_rejections_definite: int = 0


def _bucket_counter(counter: Counter, burst: int, rate: float, interval: int, tally: BucketTally) -> None:
    indices = range(len(counter.send))
    admitted_idx = [i for i in indices if counter.admitted[i]]
    middles = sorted(counter.middle(i) for i in admitted_idx)
    tally.offered += len(counter.send)
    tally.admitted += len(admitted_idx)
    tally.refused += len(counter.send) - len(admitted_idx)
    tally.excess = max(tally.excess, envelope_excess(middles, middles, burst, rate))
    lowest = math.inf
    for j, moment in enumerate(middles):
        lowest = min(lowest, (j - 1) - rate * moment)
        if (j - rate * moment) - lowest - burst > 1e-9:
            tally.excess_calls += 1
    sends = [counter.send[i] for i in admitted_idx]
    latest = []
    running = -math.inf
    for i in admitted_idx:
        running = max(running, counter.recv[i])
        latest.append(running)
    tally.excess_definite = max(tally.excess_definite, envelope_excess(sends, latest, burst, rate))
    ideal = simulate_bucket(counter.send, burst, interval)
    tally.ideal_admitted += len(ideal)
    chosen = set(ideal)
    for i in indices:
        if counter.admitted[i] and counter.send[i] not in chosen:
            tally.admitted_but_ideal_refuses += 1
        elif not counter.admitted[i] and counter.send[i] in chosen:
            tally.refused_but_ideal_admits += 1
    tats = bucket_tat(middles, interval)
    by_send = sorted((counter.send[j], counter.recv[j]) for j in admitted_idx)
    sends_sorted = [send for send, _ in by_send]
    refused = sorted((i for i in indices if not counter.admitted[i]), key=counter.recv.__getitem__)
    possible: list[float] = []
    """Receive times of the admissions that may precede the refusal (sent before it was answered)."""
    taken = 0
    for i in refused:
        if _token_free(tats, middles, counter.middle(i), burst, interval):
            tally.false_rejections += 1
        # Definite: every admission that may precede the refusal, each as late as it may be (a TAT only
        # grows with more and with later hits), and the refusal as early as it may be (tokens only come back).
        while taken < len(by_send) and sends_sorted[taken] < counter.recv[i]:
            bisect.insort(possible, by_send[taken][1])
            taken += 1
        tat = 0
        for moment in possible:
            tat = max(tat, math.floor(moment * MICROSECONDS)) + interval
        now = math.floor(counter.send[i] * MICROSECONDS)
        if -(-(max(tat, now) + interval - now) // interval) <= burst:
            tally.false_rejections_definite += 1


def bucket_figures(calls: Calls, rate: int, burst: int, unit_seconds: int, replicas: int = 1) -> dict[str, Any]:
    """Token-bucket figures of one run (see the module docstring). ``replicas``: the local mode's
    ``--instances``, whose buckets hold ``ceil(burst / R)`` each (the envelope of their sum is
    reported as ``local_envelope_burst``)."""
    tally = BucketTally()
    interval = interval_us(unit_seconds, rate)
    per_second = MICROSECONDS / interval
    for counter in counters(calls).values():
        _bucket_counter(counter, burst, per_second, interval, tally)
    excess = max(0.0, tally.excess) if tally.excess != -math.inf else 0.0
    definite = max(0.0, tally.excess_definite) if tally.excess_definite != -math.inf else 0.0
    return {
        "algorithm": "token_bucket",
        "rate_per_s": round(per_second, 6),
        "burst": burst,
        "local_envelope_burst": replicas * math.ceil(burst / replicas),
        "offered": tally.offered,
        "admitted": tally.admitted,
        "refused": tally.refused,
        "excess_max_hits": round(excess, 3),
        "excess_calls": tally.excess_calls,
        "excess_definite_max_hits": round(definite, 3),
        "ideal_admitted": tally.ideal_admitted,
        "refused_but_ideal_admits": tally.refused_but_ideal_admits,
        "admitted_but_ideal_refuses": tally.admitted_but_ideal_refuses,
        "false_rejections": tally.false_rejections,
        "false_rejections_definite": tally.false_rejections_definite,
    }
