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
* p settles: seconds from the onset until ``p`` stays within 25 % of ``1 / demand`` for half
  a second, ``p`` as the estimator (:mod:`sidecar.limiter.suppression`) works it
  out from every replica's calls, replayed by send time (the count the replicas share); the
  sidecars do not report each draw's ``p``, so this is the model's figure on the real arrivals.

Calls are placed in windows and slices by when their answer came: a call is decided after
it is sent, and on a loaded machine mostly waits before its decision (a call sent just before
a boundary is often decided after it), while the answer leaves as soon as it is decided.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
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
HOLD = 0.5
"""Seconds ``p`` must stay near its steady value to count as settled."""
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
        slot = math.floor((calls.recv[index] - start) * SLICES)
        if not 0 <= slot < count:
            continue
        sent[slot] += 1
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
    """Seconds from the onset until ``p`` stays within 25 % of ``1 / demand`` for
    :data:`HOLD` seconds, ``p`` being what :mod:`sidecar.limiter.suppression` works out from
    the calls' send times replayed into it (every replica's: the shared count); None when it
    does not within two windows."""
    demand = Demand(slot_ms(scenario.unit_seconds))
    onset, target = start + CALM, 1 / scenario.demand
    end = onset + 2 * scenario.unit_seconds
    moments: list[tuple[float, bool]] = []
    for moment in sorted(calls.send[index] for index in calls.sent()):
        if moment >= end:
            break
        slot = slot_of(moment, demand.length_ms)
        demand.attempt(slot, 1)
        p = demand.probability(slot, scenario.limit)
        if moment >= onset:
            moments.append((moment, abs(p - target) <= 0.25 * target))
    for first, (moment, within) in enumerate(moments):
        if within and moment + HOLD < end:
            held = [ok for later, ok in moments[first:] if later <= moment + HOLD]
            if all(held):
                return round(moment - onset, 2)
    return None


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


def plot(results: Sequence[Mapping[str, Any]], path: Path, *, mode: str, replicas: int) -> None:
    """Admitted per 100 ms slice, plain against suppressed, one panel per demand (a PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    picked = [
        row for row in results if row.get("mode") == mode and row.get("replicas") == replicas and "overload" in row
    ]
    demands = sorted({row["overload"]["demand"] for row in picked})
    figure, axes = plt.subplots(len(demands), 1, figsize=(9, 2.4 * len(demands)), sharex=True, squeeze=False)
    for axis, demand in zip(axes[:, 0], demands, strict=True):
        for row in picked:
            figures_of = row["overload"]
            if figures_of["demand"] != demand:
                continue
            admitted = figures_of["slices_admitted"]
            times = [index / SLICES for index in range(len(admitted))]
            suppress = figures_of["overload"] == "suppress"
            axis.step(times, admitted, where="post", label="overload: suppress" if suppress else "plain window")
        limit = picked[0]["limit"] if picked else 0
        axis.axhline(limit / SLICES, color="grey", linewidth=0.8, linestyle=":", label="limit / 10")
        axis.axvline(CALM, color="grey", linewidth=0.8)
        axis.set_ylabel(f"{demand:g}x: admitted")
        axis.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel(
        f"seconds ({CALM:g} s at {CALM_DEMAND:g}x, then the overload); {mode}, {replicas} replica(s)"
    )
    figure.suptitle("Admitted per 100 ms slice (limit per second)", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m loadtest.accuracy_harness.overload --plot docs/overload.png RESULTS.json``."""
    parser = argparse.ArgumentParser(description=plot.__doc__)
    parser.add_argument("results", type=Path, nargs="+", help="JSON written by loadtest.accuracy --scenario overload")
    parser.add_argument("--plot", type=Path, required=True, help="PNG to write")
    parser.add_argument("--mode", default="sync")
    parser.add_argument("--replicas", type=int, default=3)
    arguments = parser.parse_args(argv)
    rows = [row for path in arguments.results for row in json.loads(path.read_text())["results"]]
    plot(rows, arguments.plot, mode=arguments.mode, replicas=arguments.replicas)
    print(f"wrote {arguments.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
