"""Per-path figures over all rounds, and the Markdown the tool prints and writes."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from loadtest.common import dash, md_table, median_or_none
from loadtest.compare_harness.paths import LABELS
from loadtest.compare_harness.recording import Recording

SUMMED = (
    "sent",
    "answered",
    "admitted",
    "ideal",
    "overshoot",
    "shortfall",
    "ambiguous",
    "unattributable",
    "send_second_overshoot",
    "send_second_shortfall",
)


def aggregate(
    names: Sequence[str], accuracy: Sequence[dict[str, Any]], throughput: Sequence[dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """Per path: accuracy summed over rounds, throughput as the median over rounds."""
    summary: dict[str, dict[str, Any]] = {}
    for name in names:
        runs = [run for run in accuracy if run["path"] == name]
        row: dict[str, Any] = {"label": LABELS[name], "rounds": len(runs)}
        for key in SUMMED:
            row[key] = sum(run[key] for run in runs)
        ideal = row["ideal"]
        row["overshoot_pct"] = round(100.0 * row["overshoot"] / ideal, 2) if ideal else 0.0
        row["shortfall_pct"] = round(100.0 * row["shortfall"] / ideal, 2) if ideal else 0.0
        row["worst_window_overshoot"] = max((run["worst_window_overshoot"] for run in runs), default=0)
        failed: Counter[str] = Counter()
        envoy: Counter[str] = Counter()
        for run in runs:
            failed.update(run["failed"])
            envoy.update(run.get("envoy", {}))
        row["failed"] = dict(failed)
        row["envoy"] = dict(envoy)
        bursts = [value for run in runs for value in run["burst_admitted_per_client"]]
        most = [value for run in runs for value in run["most_admitted_in_1s_per_client"]]
        row["burst_admitted_min"], row["burst_admitted_max"] = min(bursts, default=0), max(bursts, default=0)
        row["most_in_1s_min"], row["most_in_1s_max"] = min(most, default=0), max(most, default=0)
        row["replay_latency_p99_ms"] = max((run["latency_p99_ms"] for run in runs), default=0.0)
        row["late_max_ms"] = max((run["late_max_ms"] for run in runs), default=0.0)
        speed = [run for run in throughput if run["path"] == name]
        for key in ("rps", "p50_ms", "p99_ms", "cpu_us_per_request", "admitted_pct"):
            row[key] = median_or_none(run.get(key) for run in speed)
        row["throughput_rounds_rps"] = [run["rps"] for run in speed]
        row["throughput_errors"] = sum(run["errors"] for run in speed)
        row["throughput_fail_open"] = sum(run.get("envoy", {}).get("failure_mode_allowed", 0) for run in speed)
        summary[name] = row
    return summary


def _span(low: int, high: int) -> str:
    return f"{low}" if low == high else f"{low}-{high}"


def main_table(summary: dict[str, dict[str, Any]], recording: Recording, rounds: int, throughput: str) -> str:
    header = [f"path ({rounds} round(s) of the same recording)", "requests", "admitted", "ideal", "overshoot"]
    header += ["false rejections", f"burst: admitted per client (exact window: {2 * recording.limit})"]
    header += ["most admitted per client in any 1 s", f"{throughput} req/s", "p50 ms", "p99 ms", "server CPU µs/req"]
    cells = []
    for row in summary.values():
        counts = [f"{row[key]:,}" for key in ("sent", "admitted", "ideal")]
        errors = [
            f"{row['overshoot']} ({row['overshoot_pct']:.1f} %)",
            f"{row['shortfall']} ({row['shortfall_pct']:.1f} %)",
        ]
        spans = [_span(row["burst_admitted_min"], row["burst_admitted_max"])]
        spans.append(_span(row["most_in_1s_min"], row["most_in_1s_max"]))
        speed = [dash(row["rps"], ",.0f"), dash(row["p50_ms"], ",.2f"), dash(row["p99_ms"], ",.2f")]
        cells.append([row["label"], *counts, *errors, *spans, *speed, dash(row["cpu_us_per_request"], ",.0f")])
    return md_table(header, cells)


def schedule_ideal(recording: Recording) -> dict[int, int]:
    """Per second, summed over clients: min(scheduled requests, limit), from the schedule alone."""
    counts: Counter[tuple[int, int]] = Counter((item.client, int(item.offset // 1)) for item in recording.requests)
    ideal: Counter[int] = Counter()
    for (_, second), count in counts.items():
        ideal[second] += min(count, recording.limit)
    return dict(ideal)


def per_second_table(runs: Sequence[dict[str, Any]], recording: Recording) -> str:
    """Admitted per clock second, all clients together, one run per path."""
    planned = schedule_ideal(recording)
    seconds = sorted({int(second) for run in runs for second in run["per_second"]} | set(planned))
    cells = []
    for second in seconds:
        row: list[object] = [second, planned.get(second, 0)]
        for run in runs:
            figures = run["per_second"].get(str(second))
            if figures is None:
                row.append("0")
            elif figures["ideal"] != planned.get(second, 0):
                row.append(f"{figures['admitted']} (ideal {figures['ideal']})")
            else:
                row.append(figures["admitted"])
        cells.append(row)
    return md_table(["second", "scheduled ideal", *(LABELS[run["path"]] for run in runs)], cells)


def notes(summary: dict[str, dict[str, Any]], shutdown: dict[str, dict[str, Any]], margin: float) -> list[str]:
    """How to read the table, and what may have distorted this run."""
    lines = [
        "Ideal: an exact fixed window per client and clock second, min(requests decided in it, limit). "
        "Overshoot and false rejections are summed over client-windows (% of the ideal). A request is placed "
        f"in the second that holds [sent - {margin * 1000:g} ms, answered + {margin * 1000:g} ms]; one whose "
        "interval crosses a boundary is ambiguous and goes to the side closest to the ideal.",
    ]
    lines.append(
        "Throughput: a separate closed-loop phase per path (the connections each keep one request in flight, every "
        "request from another of 65,536 addresses, so nearly all are admitted: the cost of asking); responses per "
        "second and their latency, median over rounds. The load generator is one Python process, so HAProxy's "
        "figure is the generator's ceiling, not HAProxy's. Server CPU: CPU time of the path's proxies and limiters "
        "(Envoy, sidecars, redis-server; HAProxy) per request, the app excluded. Burst: what each client got "
        "through in the 400 ms around the boundary. Most in any 1 s: the largest count of one client's admissions "
        "inside any one-second span (at the midpoint of sent..answered)."
    )
    for row in summary.values():
        label = row["label"]
        extra = []
        if row["ambiguous"]:
            extra.append(
                f"{row['ambiguous']} ambiguous at a boundary (placing every request in the second it was sent "
                f"instead: overshoot {row['send_second_overshoot']}, false rejections {row['send_second_shortfall']})"
            )
        if row["unattributable"]:
            extra.append(f"{row['unattributable']} answered more than a second later")
        if row["failed"]:
            extra.append(f"failed {row['failed']}")
        fail_open = row["envoy"].get("failure_mode_allowed", 0)
        if fail_open:
            extra.append(f"Envoy admitted {fail_open} without the sidecar's answer (timeout: fail open)")
        if row["throughput_fail_open"]:
            extra.append(f"closed loop: {row['throughput_fail_open']} failed open")
        if row["throughput_errors"]:
            extra.append(f"closed loop: {row['throughput_errors']} errors")
        extra.append(
            f"replay latency p99 {row['replay_latency_p99_ms']:.2f} ms, latest send {row['late_max_ms']:.1f} ms"
        )
        lines.append(f"- {label}: " + "; ".join(extra))
    for sidecar, stats in shutdown.items():
        keys = ("escalations", "local_decisions", "failure_decisions", "late_answers", "unflushed_hits")
        shown = ", ".join(f"{key} {stats[key]}" for key in keys if key in stats)
        lines.append(f"- {sidecar} at shutdown: {shown}")
    return lines
