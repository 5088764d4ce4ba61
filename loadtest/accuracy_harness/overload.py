"""``overload: suppress`` against plain windows: the scenarios, their figures and their table.

Each scenario sends 0.8x the limit for :data:`CALM` seconds (within the limit: nothing may
be refused), then ``demand`` x the limit until the end (the onset is on a window boundary).
The same traffic runs against the rule with and without ``overload: suppress``
(``suppress_3x`` / ``plain_3x``), so the table shows both side by side. Per run:

* admitted per window: calls admitted in each whole one-second window of the overload after
  the first (the estimate settles in the first), as % of the limit: mean and min;
* spread: per such window, the coefficient of variation (std / mean) of its admissions over
  its ten 100 ms slices, averaged (a plain window at 10x admits everything in one slice: 3.0);
* refused while within: calls refused during the calm phase, where the attempted rate is
  0.8x the limit;
* p settles: seconds from the onset until ``p`` stays within 20 % of ``1 / demand`` to the end
  of the onset's window, ``p`` as the estimator (:mod:`sidecar.limiter.suppression`) works it
  out from every replica's calls, replayed by send time (the count the replicas share); the
  sidecars do not report each draw's ``p``, so this is the model's figure on the real arrivals.

A call whose send and answer fall in different one-second windows is left out of the
admitted and refused counts (it was decided in one of them, which one is not known).

Calls are placed in windows and slices by their send time.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from loadtest.accuracy_harness.analysis import OK, OVER_LIMIT, Calls
from loadtest.accuracy_harness.scenarios import Phase, Scenario
from loadtest.common import dash, md_table
from sidecar.limiter.suppression import Demand, slot_ms, slot_of

CALM = 2.0
"""Seconds at 0.8x the limit before the onset."""
CALM_DEMAND = 0.8
SLICES = 10
"""Slices of a one-second window (100 ms each)."""
DEMANDS = (1.5, 3.0, 10.0)
GROUP = "overload"
"""``--scenario overload`` runs every scenario of this module (``all`` leaves them out)."""
NAMES = ("plain_", "suppress_")
"""How this module's scenarios are named: ``plain_3x``, ``suppress_3x``."""


def overload_scenarios(quick: bool, limit: int | None = None, windows: int | None = None) -> list[Scenario]:
    """Plain and suppressed, at each of :data:`DEMANDS` (limit 100/s; ``windows`` of overload,
    3 quick, 8 full)."""
    main_limit = limit or 100
    overload = float(windows or (3 if quick else 8))
    length = CALM + overload
    phases = (Phase(0.0, CALM, CALM_DEMAND), Phase(CALM, length, 0.0))
    made = []
    for demand in DEMANDS:
        shaped = (phases[0], Phase(CALM, length, demand))
        for option in ("", "suppress"):
            name = f"{option or 'plain'}_{demand:g}x"
            rule = "overload: suppress" if option else "plain fixed window"
            made.append(
                Scenario(
                    name,
                    f"{rule}: 0.8x the limit for {CALM:g} s, then {demand:g}x for {overload:g} s, evenly spread",
                    "phases",
                    "second",
                    main_limit,
                    1,
                    demand,
                    "balanced",
                    length,
                    phases=shaped,
                    cycle=length,
                    overload=option,
                )
            )
    return made


def _slices(calls: Calls, start: float, limit_windows: int) -> tuple[list[int], list[int], list[int]]:
    """Per 100 ms slice from ``start``: calls sent, admitted, refused over the limit."""
    count = limit_windows * SLICES
    sent, admitted, refused = [0] * count, [0] * count, [0] * count
    for index in calls.sent():
        slot = math.floor((calls.send[index] - start) * SLICES)
        if not 0 <= slot < count:
            continue
        sent[slot] += 1
        if math.floor(calls.send[index]) != math.floor(calls.recv[index]):
            continue  # decided in this window or the next: counted in neither
        admitted[slot] += calls.code[index] == OK
        refused[slot] += calls.code[index] == OVER_LIMIT
    return sent, admitted, refused


def figures(calls: Calls, scenario: Scenario, start: float) -> dict[str, Any]:
    """The figures of one run (see the module docstring); ``start``: the run's start (a window boundary)."""
    limit = scenario.limit
    windows = math.floor(scenario.duration)
    sent, admitted, refused = _slices(calls, start, windows)
    calm = int(CALM * SLICES)
    settled_windows = range(int(CALM) + 1, windows)
    per_window = [sum(admitted[w * SLICES : (w + 1) * SLICES]) for w in settled_windows]
    spreads = []
    for w in settled_windows:
        part = admitted[w * SLICES : (w + 1) * SLICES]
        mean = statistics.fmean(part)
        spreads.append(statistics.pstdev(part) / mean if mean else 0.0)
    return {
        "demand": scenario.demand,
        "overload": scenario.overload or "refuse",
        "admitted_mean_pct": round(100 * statistics.fmean(per_window) / limit, 1) if per_window else None,
        "admitted_min_pct": round(100 * min(per_window) / limit, 1) if per_window else None,
        "admitted_max": max(per_window) if per_window else None,
        "spread_cv": round(statistics.fmean(spreads), 2) if spreads else None,
        "refused_within": sum(refused[:calm]),
        "calm_calls": sum(sent[:calm]),
        "settle_s": settle_seconds(calls, scenario, start) if scenario.overload else None,
        "slices_sent": sent,
        "slices_admitted": admitted,
    }


def settle_seconds(calls: Calls, scenario: Scenario, start: float) -> float | None:
    """Seconds from the onset until ``p`` stays within 20 % of ``1 / demand`` to the end of the
    onset's window, ``p`` being what :mod:`sidecar.limiter.suppression` works out from the
    calls' send times replayed into it (every replica's: the shared count); None when it never does."""
    demand = Demand(slot_ms(scenario.unit_seconds))
    onset, end, target = start + CALM, start + CALM + scenario.unit_seconds, 1 / scenario.demand
    settled: float | None = None
    for moment in sorted(calls.send[index] for index in calls.sent()):
        if moment >= end:
            break
        slot = slot_of(moment, demand.length_ms)
        demand.attempt(slot, 1)
        p = demand.probability(slot, scenario.limit)
        if moment < onset:
            continue
        within = abs(p - target) <= 0.2 * target
        settled = (settled or moment) if within else None  # the latest moment it came back within
    return None if settled is None else round(settled - onset, 2)


def _admitted(figures_of: Mapping[str, Any]) -> str:
    if figures_of["admitted_mean_pct"] is None:
        return "-"
    return f"{figures_of['admitted_mean_pct']:.1f} ({figures_of['admitted_min_pct']:.1f})"


def _refused(figures_of: Mapping[str, Any]) -> str:
    return f"{figures_of['refused_within']} of {figures_of['calm_calls']}"


def _settle(row: Mapping[str, Any]) -> str:
    if row["overload"]["overload"] == "refuse":
        return "-"  # no p: the window refuses once full
    value = row["overload"]["settle_s"]
    return "never" if value is None else f"{value:.1f}"


COLUMNS = (
    ("demand", lambda row: f"{row['overload']['demand']:g}x"),
    ("replicas", lambda row: str(row.get("replicas", ""))),
    ("mode", lambda row: row["mode"]),
    ("overload", lambda row: row["overload"]["overload"]),
    ("admitted / window: mean % (min %)", lambda row: _admitted(row["overload"])),
    ("most in a window", lambda row: dash(row["overload"]["admitted_max"])),
    ("CV over 100 ms slices", lambda row: dash(row["overload"]["spread_cv"], ".2f")),
    ("refused while attempted <= limit", lambda row: _refused(row["overload"])),
    ("p settles (s)", _settle),
)


def _order(row: Mapping[str, Any]) -> tuple[float, int, str, str]:
    figures_of = row["overload"]
    return figures_of["demand"], row.get("replicas", 0), row["mode"], figures_of["overload"]


def table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The overload rows, plain and suppressed side by side ('' when none ran)."""
    shown = [row for row in rows if row.get("status") == "ok" and "overload" in row]
    if not shown:
        return ""
    shown.sort(
        key=lambda row: (row["overload"]["demand"], row.get("replicas", 0), row["mode"], row["overload"]["overload"])
    )
    return md_table([name for name, _ in COLUMNS], ([cell(row) for _, cell in COLUMNS] for row in shown))
