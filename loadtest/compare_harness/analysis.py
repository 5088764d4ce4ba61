"""What a path admitted, against the ideal: an exact fixed window per client and clock second.

**The ideal.** For each client and clock second ``w``: ``min(n_w, limit)`` admitted, where ``n_w``
counts the client's requests decided in ``w``. **Overshoot** is, per client-window,
``max(0, admitted - ideal)``; **false rejections** (shortfall) ``max(0, ideal - admitted)``;
both are summed over client-windows. (Since admitted <= sent, overshoot is admitted beyond
the limit.)

**Attribution.** A limiter decides a request at some instant between the moment the client
wrote it (``sent``) and the moment the response was read (``done``), on the same wall clock.
When ``[sent - margin, done + margin]`` lies in one clock second, that second is certain; the
margin covers clocks a proxy caches (HAProxy reads the time once per event-loop pass). A
request whose interval crosses a boundary (sent at x.999, answered at y.000) is
*ambiguous*: it may have been decided in either second. Ambiguous requests are given the
side that makes the path's result closest to the ideal (least overshoot + shortfall over
the whole run; a Viterbi pass over the client's boundaries), so a path is never charged for
what the timestamps cannot tell apart, and an exact fixed window scores 0 whenever the
measured intervals allow it. Their number is reported; a request whose interval spans more
than one boundary (a latency over a second) is put in the second it was sent and counted as
``unattributable``. Requests without an answer (timeouts, broken connections) or with a
status other than 200/429 are left out and counted as ``failed``.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from loadtest.common import percentile
from loadtest.compare_harness.client import Outcome, Replay
from loadtest.compare_harness.recording import BURST, Planned, Recording

ADMITTED, REJECTED = 200, 429
DEFAULT_MARGIN = 0.002
TRAILING_STEP = 0.01
BIN_WIDTH = 0.1


@dataclass(frozen=True, slots=True)
class Decided:
    """One answered request, placed in time relative to the replay's second 0."""

    client: int
    burst: bool
    admitted: bool
    low: int
    """Earliest window (clock second, relative) it may have been decided in."""
    high: int
    """Latest such window."""
    sent_window: int
    """The window it was sent in."""
    middle: float
    """Midpoint of its sent..done interval, relative seconds."""


def decided(requests: Sequence[Planned], replay: Replay, margin: float) -> tuple[list[Decided], Counter[str]]:
    """The answered requests of ``replay``, and the failed ones counted by cause."""
    placed: list[Decided] = []
    failed: Counter[str] = Counter()
    for outcome in replay.outcomes:
        if outcome.status not in (ADMITTED, REJECTED):
            failed[outcome.error or f"status {outcome.status}"] += 1
            continue
        planned = requests[outcome.index]
        low = math.floor(outcome.sent - margin) - replay.start
        high = math.floor(outcome.done + margin) - replay.start
        middle = (outcome.sent + outcome.done) / 2 - replay.start
        sent_window = math.floor(outcome.sent) - replay.start
        burst = planned.phase == BURST
        placed.append(Decided(planned.client, burst, outcome.status == ADMITTED, low, high, sent_window, middle))
    return placed, failed


@dataclass
class Windows:
    """One client's requests per window after attribution."""

    decided: dict[int, int] = field(default_factory=dict)
    admitted: dict[int, int] = field(default_factory=dict)
    ambiguous: int = 0
    unattributable: int = 0


def _cost(limit: int, admitted: int, total: int) -> tuple[int, int]:
    ideal = min(total, limit)
    return max(0, admitted - ideal), max(0, ideal - admitted)


def attribute(requests: Iterable[Decided], limit: int) -> Windows:
    """Place one client's requests in windows: certain ones where they are, ambiguous ones on the side
    that minimizes overshoot + shortfall over all windows (exact dynamic programming)."""
    certain_n: Counter[int] = Counter()
    certain_a: Counter[int] = Counter()
    crossing: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    """Boundary b (between windows b-1 and b) -> [admitted, rejected] that may sit on either side."""
    result = Windows()
    for request in requests:
        if request.high == request.low + 1:
            crossing[request.high][0 if request.admitted else 1] += 1
            result.ambiguous += 1
            continue
        window = request.low
        if request.high > request.low + 1:
            result.unattributable += 1
            window = request.sent_window
        certain_n[window] += 1
        certain_a[window] += request.admitted
    windows = sorted(set(certain_n) | set(crossing) | {b - 1 for b in crossing})
    if not windows:
        return result
    first, last = windows[0], windows[-1]

    def choices(boundary: int) -> list[tuple[int, int]]:
        admitted, rejected = crossing.get(boundary, (0, 0))
        return [(x, y) for x in range(admitted + 1) for y in range(rejected + 1)]

    # best[c] = (cost so far, overshoot so far, choice history) for choice c at the left boundary of window w;
    # c = (admitted, rejected) ambiguous requests of that boundary put in window w (the rest go left).
    best: dict[tuple[int, int], tuple[int, int, list[tuple[int, int]]]] = {(0, 0): (0, 0, [])}
    for window in range(first, last + 1):
        right = crossing.get(window + 1, (0, 0))
        following: dict[tuple[int, int], tuple[int, int, list[tuple[int, int]]]] = {}
        for nxt in choices(window + 1):
            for here, (cost, over_so_far, history) in best.items():
                admitted = certain_a[window] + here[0] + right[0] - nxt[0]
                total = certain_n[window] + here[0] + here[1] + right[0] - nxt[0] + right[1] - nxt[1]
                over, short = _cost(limit, admitted, total)
                candidate = (cost + over + short, over_so_far + over, [*history, here])
                if nxt not in following or candidate[:2] < following[nxt][:2]:
                    following[nxt] = candidate
        best = following
    _, _, history = best[(0, 0)]
    for offset, window in enumerate(range(first, last + 1)):
        here = history[offset]
        right = crossing.get(window + 1, (0, 0))
        nxt = history[offset + 1] if offset + 1 < len(history) else (0, 0)
        admitted = certain_a[window] + here[0] + right[0] - nxt[0]
        total = certain_n[window] + here[0] + here[1] + right[0] - nxt[0] + right[1] - nxt[1]
        if total:
            result.decided[window] = total
            result.admitted[window] = admitted
    return result


def by_send_second(requests: Iterable[Decided], limit: int) -> tuple[int, int]:
    """(overshoot, shortfall) with every request in the second it was sent: the naive attribution,
    which charges an exact limiter for requests sent just before a boundary and decided after it."""
    decided: Counter[int] = Counter()
    admitted: Counter[int] = Counter()
    for request in requests:
        decided[request.sent_window] += 1
        admitted[request.sent_window] += request.admitted
    over = short = 0
    for window, total in decided.items():
        window_over, window_short = _cost(limit, admitted[window], total)
        over, short = over + window_over, short + window_short
    return over, short


def most_in_one_second(times: Sequence[float]) -> int:
    """Most of ``times`` (sorted) inside any half-open span of one second."""
    most, begin = 0, 0
    for end, moment in enumerate(times):
        while moment - times[begin] >= 1.0:
            begin += 1
        most = max(most, end - begin + 1)
    return most


def trailing_counts(times: Sequence[float], until: float, step: float = TRAILING_STEP) -> list[int]:
    """At every ``step`` from 0 to ``until``: how many of ``times`` (sorted) fall in the second before."""
    return [
        bisect.bisect_right(times, index * step) - bisect.bisect_right(times, index * step - 1.0)
        for index in range(int(until / step) + 1)
    ]


def binned(times: Sequence[float], until: float, width: float = BIN_WIDTH) -> list[int]:
    """Counts of ``times`` in consecutive bins of ``width`` seconds from 0 to ``until``."""
    counts = [0] * (int(until / width) + 1)
    for moment in times:
        slot = math.floor(moment / width)
        if 0 <= slot < len(counts):
            counts[slot] += 1
    return counts


def summarize(recording: Recording, replay: Replay, margin: float = DEFAULT_MARGIN) -> dict[str, Any]:
    """Accuracy, attribution and generator figures of one replay."""
    limit = recording.limit
    placed, failed = decided(recording.requests, replay, margin)
    by_client: dict[int, list[Decided]] = defaultdict(list)
    for request in placed:
        by_client[request.client].append(request)
    per_second: dict[int, dict[str, int]] = defaultdict(lambda: {"decided": 0, "admitted": 0, "ideal": 0})
    windows_out: list[dict[str, int]] = []
    totals = Counter[str]()
    worst_over = 0
    burst_admitted, most_per_second, admitted_times = [], [], []
    for client in range(recording.clients):
        requests = by_client.get(client, [])
        windows = attribute(requests, limit)
        naive_over, naive_short = by_send_second(requests, limit)
        totals["send_second_overshoot"] += naive_over
        totals["send_second_shortfall"] += naive_short
        totals["ambiguous"] += windows.ambiguous
        totals["unattributable"] += windows.unattributable
        for window, total in sorted(windows.decided.items()):
            admitted = windows.admitted[window]
            over, short = _cost(limit, admitted, total)
            ideal = min(total, limit)
            totals["ideal"] += ideal
            totals["overshoot"] += over
            totals["shortfall"] += short
            worst_over = max(worst_over, over)
            row = per_second[window]
            row["decided"] += total
            row["admitted"] += admitted
            row["ideal"] += ideal
            windows_out.append(
                {"client": client, "window": window, "decided": total, "admitted": admitted, "ideal": ideal}
            )
        times = sorted(request.middle for request in requests if request.admitted)
        admitted_times.append(times)
        burst_admitted.append(sum(1 for request in requests if request.burst and request.admitted))
        most_per_second.append(most_in_one_second(times))
    everyone = sorted(moment for times in admitted_times for moment in times)
    answered = [outcome for outcome in replay.outcomes if outcome.status in (ADMITTED, REJECTED)]
    latencies = sorted(outcome.done - outcome.sent for outcome in answered)
    late = sorted(replay.late)
    ideal_total = totals["ideal"]
    return {
        "start": replay.start,
        "sent": len(replay.outcomes),
        "answered": len(answered),
        "admitted": sum(1 for request in placed if request.admitted),
        "ideal": ideal_total,
        "overshoot": totals["overshoot"],
        "overshoot_pct": round(100.0 * totals["overshoot"] / ideal_total, 2) if ideal_total else 0.0,
        "shortfall": totals["shortfall"],
        "shortfall_pct": round(100.0 * totals["shortfall"] / ideal_total, 2) if ideal_total else 0.0,
        "worst_window_overshoot": worst_over,
        "ambiguous": totals["ambiguous"],
        "send_second_overshoot": totals["send_second_overshoot"],
        "send_second_shortfall": totals["send_second_shortfall"],
        "unattributable": totals["unattributable"],
        "failed": dict(failed),
        "burst_admitted_per_client": burst_admitted,
        "most_admitted_in_1s_per_client": most_per_second,
        "per_second": {str(window): per_second[window] for window in sorted(per_second)},
        "windows": windows_out,
        "admitted_trailing_1s": trailing_counts(everyone, recording.duration + 1.0),
        "admitted_per_bin": binned(everyone, recording.duration + 1.0),
        "latency_p50_ms": round(percentile(latencies, 0.50) * 1000, 3),
        "latency_p99_ms": round(percentile(latencies, 0.99) * 1000, 3),
        "late_p99_ms": round(percentile(late, 0.99) * 1000, 3),
        "late_max_ms": round((late[-1] if late else 0.0) * 1000, 3),
        "connections": replay.connections,
    }


OUTCOME_FIELDS = [
    "index into recording.requests (its offset is the scheduled time)",
    "target (entry of the path: which Envoy)",
    "sent, s after second 0",
    "answered, s after second 0",
    "status (or the error)",
]


def outcome_rows(replay: Replay) -> list[list[Any]]:
    """Every outcome as ``[index, target, sent, done, status]`` (times relative to second 0, in seconds)."""

    def relative(moment: float) -> float | None:
        return round(moment - replay.start, 6) if moment else None

    rows = []
    for outcome in replay.outcomes:
        row: list[Any] = [outcome.index, outcome.target, relative(outcome.sent), relative(outcome.done)]
        row.append(outcome.status if outcome.status else outcome.error or "error")
        rows.append(row)
    return rows


def outcomes_from_rows(rows: Sequence[Sequence[Any]], start: int) -> list[Outcome]:
    """The inverse of :func:`outcome_rows` (re-analysis of a saved run)."""
    outcomes = []
    for index, target, sent, done, status in rows:
        failed = not isinstance(status, int)
        outcomes.append(
            Outcome(
                index=index,
                target=target,
                sent=start + sent if sent is not None else 0.0,
                done=start + done if done is not None else 0.0,
                status=0 if failed else status,
                error=str(status) if failed else "",
            )
        )
    return outcomes
