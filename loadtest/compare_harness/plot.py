"""The PNG: what each path admitted over time, next to the ideal and the limit (matplotlib, Agg backend)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadtest.compare_harness.analysis import BIN_WIDTH, TRAILING_STEP
from loadtest.compare_harness.paths import LABELS
from loadtest.compare_harness.recording import Recording
from loadtest.compare_harness.report import schedule_ideal

COLOURS = {
    "envoy_memory": "#1f77b4",
    "envoy_sync": "#2ca02c",
    "haproxy_fixed": "#ff7f0e",
    "haproxy_sliding": "#9467bd",
    "envoy_sliding": "#e377c2",
}
STYLES = {"envoy_memory": "-", "envoy_sync": "--", "haproxy_fixed": "-.", "haproxy_sliding": "-", "envoy_sliding": "--"}


def draw(runs: Sequence[dict[str, Any]], recording: Recording, path: Path, title: str) -> None:
    """Two panels over the recording, all clients together: admitted in the preceding second at every
    instant (at each whole second that is the clock second just ended, where the ideal is marked), with
    ``limit x clients``; and admitted per 100 ms, which shows where inside each second admissions fall."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    limit, clients = recording.limit, recording.clients
    seconds = recording.seconds
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(11, 8), sharex=True, constrained_layout=True)
    burst = (recording.boundary - recording.burst_span, recording.boundary + recording.burst_span)
    for axes in (top, bottom):
        axes.axvspan(*burst, color="#dddddd", zorder=0, label="burst straddling a second boundary")
        axes.grid(True, alpha=0.3)
        for second in range(seconds + 1):
            axes.axvline(second, color="#bbbbbb", linewidth=0.5, zorder=0)

    for index, run in enumerate(runs):
        name = run["path"]
        width = 1.0 + 1.0 * (len(runs) - 1 - index)  # widest first, so equal lines stay visible
        style = {"color": COLOURS[name], "linestyle": STYLES[name], "linewidth": width, "label": LABELS[name]}
        points = run["admitted_trailing_1s"]
        top.plot([step * TRAILING_STEP for step in range(len(points))], points, **style)
        bins = run["admitted_per_bin"]
        edges = [step * BIN_WIDTH for step in range(len(bins) + 1)]
        bottom.step(edges, [*bins, bins[-1] if bins else 0], where="post", **style)
    ideal = schedule_ideal(recording)
    ends = [second + 1 for second in range(seconds)]
    marker = {"color": "black", "markersize": 6, "fillstyle": "none"}
    label = "ideal: exact fixed window, per clock second"
    top.plot(ends, [ideal.get(second, 0) for second in range(seconds)], "o", label=label, **marker)
    top.axhline(
        limit * clients, color="red", linestyle=":", linewidth=1.5, label=f"limit x clients ({limit * clients})"
    )
    top.axhline(2 * limit * clients, color="red", linestyle=":", linewidth=0.8, alpha=0.5, label="2 x that")
    top.set_ylabel("admitted in the preceding 1 s\n(all clients)")
    top.set_ylim(0, 2 * limit * clients * 1.3)
    top.legend(loc="upper left", fontsize=8, ncol=2)
    top.set_title(title, fontsize=11)

    even = limit * clients * BIN_WIDTH
    label = f"limit x clients, spread evenly ({even:g} per {BIN_WIDTH * 1000:.0f} ms)"
    bottom.axhline(even, color="red", linestyle=":", linewidth=1.5, label=label)
    bottom.set_ylabel(f"admitted per {BIN_WIDTH * 1000:.0f} ms\n(all clients)")
    bottom.set_xlabel("seconds since the recording's start (a wall-clock second boundary)")
    bottom.set_xlim(0, seconds + 0.5)
    bottom.legend(loc="upper right", fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
