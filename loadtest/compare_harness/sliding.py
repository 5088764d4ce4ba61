"""Our ``sliding_window`` against HAProxy 2.6's sliding rate counter, on the same recording.

**Same quantity.** The comparison's HAProxy sliding flavour counts with ``sc-inc-gpc`` *after*
its deny rules, so its ``gpc_rate`` counts admitted requests only, as the sidecar's counters
do (``http_req_rate`` would count refused requests too, and a client over its limit would
stay locked out). Both then apply one formula: HAProxy's ``read_freq_ctr_period``
(``freq_ctr_total``: ``past * remain + curr * period``, divided by the period) is
``current + floor(previous x remain / period)``, and a request is denied when that is
``>= limit`` (``sc_gpc_rate(0,0) ge 20``); the sidecar admits while
``current + 1 + floor(previous x share still covered) <= limit`` (``sidecar.limiter.algorithms``).

**Same periods.** The sidecar's windows start on epoch seconds; HAProxy's start at a counter's
first increment (``update_freq_ctr_period``: ``curr_tick = now_ms``, stored with its low bit
cleared) and keep that phase until the counter misses two periods, when the next increment
restarts them. The recording sends each client's first request 0.2 ms after a clock second
(``recording.FIRST_OFFSET``), so HAProxy's periods start on that second (give or take the
milliseconds it takes to read the request) and the two grids coincide. The phase each
client actually got is inferred from its first admitted request and reported.

**What remains.** HAProxy reads the time in whole milliseconds, once per event-loop pass
(``now_ms``), and rounds the period start to an even millisecond; both paths decide a
request a little after it was sent, by their own latency (Envoy + sidecar ~1-3 ms, HAProxy
well under 1 ms). The estimate steps by one every ``period / previous`` (50 ms at 20/s),
so a request decided within a few milliseconds of a step can get a different verdict on
the two paths; after that their states differ by one hit and converge again within the
window. Per client and second the admitted counts can therefore differ by a hit, rarely two.

**The models.** :class:`OursModel` and :class:`HAProxyModel` decide requests exactly as the two
implementations do (HAProxy's in integer milliseconds, with its period start and rotation rules).
Fed the schedule, ours gives the ideal. Fed a path's own verdicts (:func:`place`: client by client,
each request at the first instant of its sent..answered interval at which the formula gives the
path's verdict, the path's admissions as the history) they tell how many verdicts the formula
explains, and where each admission falls: the per-second counts use those instants.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from loadtest.common import md_table
from loadtest.compare_harness.analysis import DEFAULT_MARGIN
from loadtest.compare_harness.client import Replay
from loadtest.compare_harness.recording import Recording

ADMITTED, REJECTED = 200, 429
OURS, HAPROXY = "envoy_sliding", "haproxy_sliding"
PERIOD_MS = 1000


@dataclass
class HAProxyCounter:
    """``struct freq_ctr`` of one stick-table entry's ``gpc_rate``, ticks in milliseconds."""

    tick: int | None = None
    """Start of the current period; None before the first increment."""
    current: int = 0
    previous: int = 0

    def read(self, now_ms: int) -> int:
        """``read_freq_ctr_period`` at ``now_ms`` (``freq_ctr_total`` divided by the period)."""
        if self.tick is None:
            return 0
        current, past = self.current, self.previous
        remain = self.tick + PERIOD_MS - now_ms
        if remain < 0:
            remain += PERIOD_MS
            past = current if remain >= 0 else 0
            current = 0
        if not current and past <= 1:
            return past  # the flapping correction at very low rates
        return (past * remain + current * PERIOD_MS) // PERIOD_MS

    def increment(self, now_ms: int) -> None:
        """``update_freq_ctr_period`` by one: rotate when the period is over, restart after two."""
        if self.tick is None or now_ms - self.tick >= PERIOD_MS:
            if self.tick is None:
                self.tick, self.previous, self.current = now_ms & ~1, 0, 1
                return
            self.previous, self.current = self.current, 1
            self.tick += PERIOD_MS
            if now_ms - self.tick >= PERIOD_MS:
                self.previous = 0
                self.tick = now_ms & ~1
            return
        self.current += 1


class HAProxyModel:
    """HAProxy's decision on one counter: deny when the rate is ``>= limit``, count admitted requests."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.counter = HAProxyCounter()

    def admits(self, moment: float) -> bool:
        return self.counter.read(math.floor(moment * 1000)) < self.limit

    def add(self, moment: float) -> None:
        self.counter.increment(math.floor(moment * 1000))


class OursModel:
    """The sidecar's ``sliding_window`` on one counter: 1 s windows on the epoch."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.windows: Counter[int] = Counter()

    def admits(self, moment: float) -> bool:
        start = math.floor(moment)
        share = (start + 1 - moment) / 1
        return self.windows[start] + 1 + math.floor(self.windows[start - 1] * share) <= self.limit

    def add(self, moment: float) -> None:
        self.windows[math.floor(moment)] += 1


def decide(model: type[OursModel | HAProxyModel], times: Sequence[float], limit: int) -> list[bool]:
    """The model's verdicts for requests at ``times`` (sorted), each admission counted."""
    state = model(limit)
    verdicts = []
    for moment in times:
        admitted = state.admits(moment)
        verdicts.append(admitted)
        if admitted:
            state.add(moment)
    return verdicts


def ours(times: Sequence[float], limit: int) -> list[bool]:
    """The sidecar's verdicts for requests at ``times`` (sorted)."""
    return decide(OursModel, times, limit)


def haproxy(times: Sequence[float], limit: int) -> list[bool]:
    """HAProxy's verdicts for requests at absolute ``times`` (sorted; whole milliseconds)."""
    return decide(HAProxyModel, times, limit)


MODELS: dict[str, type[OursModel | HAProxyModel]] = {OURS: OursModel, HAPROXY: HAProxyModel}


@dataclass(frozen=True)
class Answered:
    """One answered request of a replay: relative times, verdict."""

    index: int
    client: int
    sent: float
    done: float
    admitted: bool

    @property
    def middle(self) -> float:
        return (self.sent + self.done) / 2


def answered(recording: Recording, replay: Replay) -> list[Answered]:
    found = []
    for outcome in replay.outcomes:
        if outcome.status not in (ADMITTED, REJECTED):
            continue
        client = recording.requests[outcome.index].client
        found.append(
            Answered(
                outcome.index,
                client,
                outcome.sent - replay.start,
                outcome.done - replay.start,
                outcome.status == ADMITTED,
            )
        )
    return found


def scheduled_ideal(recording: Recording) -> dict[int, dict[int, bool]]:
    """Per client, request index -> the verdict of one exact estimate fed the schedule (both models agree
    on it when the periods start on second 0; checked by the caller)."""
    ideal: dict[int, dict[int, bool]] = {}
    for client in range(recording.clients):
        items = [(item.offset, index) for index, item in enumerate(recording.requests) if item.client == client]
        items.sort()
        verdicts = ours([offset for offset, _ in items], recording.limit)
        ideal[client] = {index: verdict for (_, index), verdict in zip(items, verdicts, strict=True)}
    return ideal


def candidates(request: Answered, start: int, margin: float) -> list[float]:
    """Absolute instants at which the path may have decided ``request``: its send, both sides of a second
    boundary its interval crosses, its answer (within a window the estimate only falls as time passes, so
    these are the extremes of what the path could have seen); then the same widened by ``margin``, for a
    proxy that read the clock earlier in its event-loop pass (HAProxy)."""
    instants = []
    for widen in (0.0, margin):
        sent, done = start + request.sent - widen, start + request.done + widen
        instants.append(sent)
        for boundary in range(math.floor(sent) + 1, math.floor(done) + 1):
            instants += [boundary - 1e-6, float(boundary)]
        instants.append(done)
    return instants


def place(
    path: str, requests: Sequence[Answered], start: int, limit: int, margin: float = DEFAULT_MARGIN
) -> tuple[dict[int, float], int]:
    """Replay the path's verdicts through its formula, client by client in send order, each admission
    counted as the path counted it: every request is put at the first instant of its sent..answered
    interval at which the formula gives the path's verdict. Returns (request index -> that instant,
    relative to second 0; the midpoint when no instant explains it) and how many were explained."""
    placed: dict[int, float] = {}
    explained = 0
    by_client: dict[int, list[Answered]] = defaultdict(list)
    for request in requests:
        by_client[request.client].append(request)
    for items in by_client.values():
        state = MODELS[path](limit)
        for request in sorted(items, key=lambda item: item.sent):
            moment = next(
                (when for when in candidates(request, start, margin) if state.admits(when) == request.admitted), None
            )
            if moment is None:
                moment = start + request.middle
            else:
                explained += 1
            if request.admitted:
                state.add(moment)
            placed[request.index] = moment - start
    return placed, explained


def phases_ms(requests: Sequence[Answered], start: int) -> list[tuple[int, int]]:
    """Per client, the range of HAProxy period starts (ms from the clock second nearest its first admitted
    request) that request allows: HAProxy read the clock between sending and answering, and cleared the low
    bit."""
    first: dict[int, Answered] = {}
    for request in sorted(requests, key=lambda item: item.sent):
        if request.admitted and request.client not in first:
            first[request.client] = request
    ranges = []
    for client in sorted(first):
        request = first[client]
        low = math.floor((start + request.sent) * 1000) & ~1
        high = math.floor((start + request.done) * 1000) & ~1
        base = (start + round(request.sent)) * 1000
        ranges.append((low - base, high - base))
    return ranges


def compare(
    recording: Recording, runs: dict[str, tuple[Replay, dict[str, Any]]], margin: float = DEFAULT_MARGIN
) -> dict[str, Any]:
    """Per-second admitted counts of our sliding window and HAProxy's next to the ideal, their largest
    difference, how many verdicts differ, and how many of each path's verdicts its formula explains.

    ``runs``: path -> (its replay, its summary) for :data:`OURS` and :data:`HAPROXY` (one round)."""
    limit = recording.limit
    ideal = scheduled_ideal(recording)
    models_differ = 0
    for client in range(recording.clients):
        items = sorted((item.offset, index) for index, item in enumerate(recording.requests) if item.client == client)
        offsets = [offset for offset, _ in items]
        models_differ += sum(1 for a, b in zip(haproxy(offsets, limit), ours(offsets, limit), strict=True) if a != b)
    per_second: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    per_client: dict[tuple[int, int], dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for index, item in enumerate(recording.requests):
        second = math.floor(item.offset)
        per_second[second]["requests"] += 1
        admitted = ideal[item.client][index]
        per_second[second]["ideal"] += admitted
        per_client[(item.client, second)]["ideal"] += admitted
    verdicts: dict[str, dict[int, bool]] = {}
    figures: dict[str, Any] = {"paths": {}}
    for path, (replay, _summary) in runs.items():
        requests = answered(recording, replay)
        verdicts[path] = {request.index: request.admitted for request in requests}
        placed, agree = place(path, requests, replay.start, limit, margin)
        for request in requests:
            if request.admitted:
                second = math.floor(placed[request.index])
                per_second[second][path] += 1
                per_client[(request.client, second)][path] += 1
        total = len(requests)
        figures["paths"][path] = {
            "answered": total,
            "admitted": sum(1 for request in requests if request.admitted),
            "explained_by_its_formula": agree,
            "explained_pct": round(100.0 * agree / total, 2) if total else None,
            "haproxy_phase_ms_if_haproxy": phases_ms(requests, replay.start) if path == HAPROXY else None,
        }
    both = [index for index in verdicts.get(OURS, {}) if index in verdicts.get(HAPROXY, {})]
    differing = [index for index in both if verdicts[OURS][index] != verdicts[HAPROXY][index]]
    ideal_all = {index: verdict for client in ideal.values() for index, verdict in client.items()}

    def spread(first: str, second: str, table: dict[Any, dict[str, int]]) -> int:
        return max((abs(row.get(first, 0) - row.get(second, 0)) for row in table.values()), default=0)

    figures.update(
        ideal_admitted=sum(ideal_all.values()),
        models_differ_on_schedule=models_differ,
        scheduled_requests=len(recording.requests),
        both_answered=len(both),
        verdicts_differ=len(differing),
        verdicts_differ_pct=round(100.0 * len(differing) / len(both), 2) if both else None,
        ours_vs_ideal_differ=sum(1 for index in verdicts.get(OURS, {}) if verdicts[OURS][index] != ideal_all[index]),
        haproxy_vs_ideal_differ=sum(
            1 for index in verdicts.get(HAPROXY, {}) if verdicts[HAPROXY][index] != ideal_all[index]
        ),
        max_diff_per_second=spread(OURS, HAPROXY, per_second),
        max_diff_per_client_second=spread(OURS, HAPROXY, per_client),
        max_ours_vs_ideal_per_client_second=spread(OURS, "ideal", per_client),
        max_haproxy_vs_ideal_per_client_second=spread(HAPROXY, "ideal", per_client),
        per_second={
            str(second): {key: row.get(key, 0) for key in ("requests", "ideal", OURS, HAPROXY)}
            for second, row in sorted(per_second.items())
        },
    )
    return figures


def table(figures: dict[str, Any], labels: dict[str, str]) -> str:
    """Admitted per second, all clients together: the ideal, ours, HAProxy's, and the difference."""
    header = ["second", "requests", "ideal (one exact estimate, the schedule)", labels[OURS], labels[HAPROXY]]
    cells = [
        [second, row["requests"], row["ideal"], row[OURS], row[HAPROXY], f"{row[OURS] - row[HAPROXY]:+d}"]
        for second, row in figures["per_second"].items()
    ]
    return md_table([*header, "difference"], cells)


def summary_lines(figures: dict[str, Any]) -> list[str]:
    """How close the two sliding estimates came, and what explains the rest."""
    paths = figures["paths"]
    ours_path, haproxy_path = paths.get(OURS, {}), paths.get(HAPROXY, {})
    phases = haproxy_path.get("haproxy_phase_ms_if_haproxy") or []
    shown = ", ".join(f"{low}" if low == high else f"{low}..{high}" for low, high in phases) or "-"
    return [
        f"Sliding windows, ours vs HAProxy's (round 1): admitted {ours_path.get('admitted')} vs "
        f"{haproxy_path.get('admitted')} (ideal {figures['ideal_admitted']}); largest difference "
        f"{figures['max_diff_per_second']} per second (all clients), {figures['max_diff_per_client_second']} per "
        f"client and second; {figures['verdicts_differ']} of {figures['both_answered']} requests "
        f"({figures['verdicts_differ_pct']} %) got different verdicts. Against the ideal, per client and second: "
        f"ours within {figures['max_ours_vs_ideal_per_client_second']}, HAProxy within "
        f"{figures['max_haproxy_vs_ideal_per_client_second']}.",
        f"- Both count admitted requests only (HAProxy: gpc_rate incremented after the deny rules, not "
        f"http_req_rate, which counts denials too). HAProxy's periods started {shown} ms after the clock second "
        "(per client, from its first admitted request; it was scheduled 0.2 ms after the second), ours on it. Verdicts "
        "each path's formula explains at an instant of the request's sent..answered interval (+- the margin), "
        "replayed on the "
        f"path's own admissions: ours {ours_path.get('explained_pct')} %, HAProxy {haproxy_path.get('explained_pct')} "
        f"%. Fed the schedule, the two formulas differ on {figures['models_differ_on_schedule']} of "
        f"{figures['scheduled_requests']} requests (HAProxy reads whole milliseconds: just after a step of the "
        "estimate it still sees the count before it, and the next request evens it out).",
        "- What differs: each path decides a request when it reads it (Envoy + sidecar a few ms after it was sent, "
        "HAProxy well under one, in whole ms read once per event-loop pass), and the estimate steps by one hit "
        "every period / previous count (50 ms at 20/s): a request within a few ms of a step can get another "
        "verdict, and the two states then differ by one hit until the window rolls over.",
    ]
