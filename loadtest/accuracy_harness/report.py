"""The Markdown table, the goals of design.md section 5 checked against the figures, and JSON."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

MAX_OVERSHOOT = 0.01


def sync_blind_cap(limit: int, replicas: int, max_overshoot: float | None = None) -> int:
    """``Q`` of sync mode: from ``SyncLimiter.blind_cap`` when importable (with the sidecar's
    default ``max_overshoot`` unless one was passed), else ``max(1, floor(0.01 * limit / (R - 1)))``."""
    try:
        from sidecar.limiter import sync

        probe = sync.SyncLimiter.__new__(sync.SyncLimiter)
        default = getattr(sync, "DEFAULT_MAX_OVERSHOOT", MAX_OVERSHOOT)
        probe.max_overshoot = default if max_overshoot is None else max_overshoot
        return int(probe.blind_cap(limit, replicas))
    except Exception:
        if replicas <= 1:
            return max(1, limit)
        fraction = MAX_OVERSHOOT if max_overshoot is None else max_overshoot
        return max(1, math.floor(fraction * limit / (replicas - 1)))


def sync_bound_hits(limit: int, replicas: int, max_overshoot: float | None = None) -> int:
    """Overshoot sync mode documents per counter and window: ``(R - 1) * Q`` hits."""
    return 0 if replicas <= 1 else (replicas - 1) * sync_blind_cap(limit, replicas, max_overshoot)


def _rt(row: Mapping[str, Any], name: str) -> str:
    if row["mode"] == "local":
        return "-"
    value = row["round_trips"].get(name)
    if value is None:
        return "?"
    fallback = "" if row["round_trips"]["source"] == "shutdown log events" else "*"
    return f"{value:.4f}{fallback}"


def failure_decisions(row: Mapping[str, Any]) -> int | None:
    """Requests a redis-mode sidecar decided without Redis (timeout or outage), if it says."""
    stats = row.get("round_trips", {}).get("backend_stats") or {}
    value = stats.get("failure_decisions")
    return int(value) if value is not None else None


def _failure_decisions(row: Mapping[str, Any]) -> str:
    if row["mode"] == "local":
        return "-"
    value = failure_decisions(row)
    return "?" if value is None else str(value)


def _check(row: Mapping[str, Any]) -> str:
    check = row.get("redis_check")
    if check is None:
        return "-"
    if check["match"]:
        return f"yes ({check['redis_total']})"
    return f"NO: redis {check['redis_total']} vs {check['client_admitted']}"


COLUMNS = (
    ("scenario", lambda r: r["scenario"]),
    ("mode", lambda r: r["mode"]),
    ("req/s", lambda r: f"{r['traffic']['rps']:.0f}"),
    ("p50 ms", lambda r: f"{r['traffic']['p50_ms']:.2f}"),
    ("p99 ms", lambda r: f"{r['traffic']['p99_ms']:.2f}"),
    ("sent", lambda r: str(r["traffic"]["sent"])),
    ("admitted", lambda r: str(r["traffic"]["admitted"])),
    ("err", lambda r: str(sum(r["traffic"]["errors"].values()))),
    ("windows (sat.)", lambda r: f"{r['accuracy']['windows']} ({r['accuracy']['windows_saturated']})"),
    ("straddling", lambda r: str(r["accuracy"]["straddling"])),
    (
        "overshoot max % (hits)",
        lambda r: f"{r['accuracy']['overshoot_max_pct']:.2f} ({r['accuracy']['overshoot_max_hits']})",
    ),
    ("overshoot mean %", lambda r: f"{r['accuracy']['overshoot_mean_pct']:.2f}"),
    (
        "false rej. recv-order / definite / unfilled",
        lambda r: (
            f"{r['accuracy']['false_rejections']} / {r['accuracy']['false_rejections_definite']}"
            f" / {r['accuracy']['rejected_in_unfilled_windows']}"
        ),
    ),
    ("failure-mode decisions", _failure_decisions),
    ("RT/req path", lambda r: _rt(r, "rt_per_request_path")),
    ("RT/req total", lambda r: _rt(r, "rt_per_request_total")),
    ("Redis = admitted", _check),
)


def table(rows: Sequence[Mapping[str, Any]]) -> str:
    lines = [
        "| " + " | ".join(name for name, _ in COLUMNS) + " |",
        "|" + "|".join("---" for _ in COLUMNS) + "|",
    ]
    for row in rows:
        if row.get("status") != "ok":
            cells = [row["scenario"], row["mode"], f"{row.get('status')}: {row.get('reason', '')}"]
            cells += [""] * (len(COLUMNS) - len(cells))
        else:
            cells = [render(row) for _, render in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _find(rows: Sequence[Mapping[str, Any]], scenario: str, mode: str) -> Mapping[str, Any] | None:
    for row in rows:
        if row["scenario"] == scenario and row["mode"] == mode and row.get("status") == "ok":
            return row
    return None


def goals(rows: Sequence[Mapping[str, Any]], replicas: int) -> list[dict[str, Any]]:
    """Each goal of design.md section 5 with the figure measured and a verdict."""
    results: list[dict[str, Any]] = []

    def add(goal: str, measured: str, met: bool | None) -> None:
        verdict = "not measured" if met is None else ("met" if met else "MISSED")
        results.append({"goal": goal, "measured": measured, "verdict": verdict})

    for scenario, bound in (("balanced_5x", 1.0), ("skewed_5x", 1.0), ("burst", 5.0)):
        row = _find(rows, scenario, "sync")
        if row is None:
            add(f"sync overshoot <= {bound:g} % ({scenario})", "-", None)
            continue
        acc = row["accuracy"]
        limit = row["limit"]
        documented = sync_bound_hits(limit, replicas, row.get("sync_max_overshoot"))
        add(
            f"sync overshoot <= {bound:g} % ({scenario}, limit {limit}/s, {replicas} replicas)",
            f"max {acc['overshoot_max_pct']:.2f} % ({acc['overshoot_max_hits']} hits), mean "
            f"{acc['overshoot_mean_pct']:.2f} %; Redis-side max {row['redis_check']['redis_overshoot_max_pct']:.2f} %;"
            f" documented bound (R-1)*Q = {documented} hits = {100 * documented / limit:.2f} %",
            acc["overshoot_max_pct"] <= bound,
        )
    for mode in ("sync", "strict"):
        row = _find(rows, "balanced_0.5x", mode)
        if row is None:
            add(f"{mode}: zero false rejections while demand < limit", "-", None)
            continue
        acc = row["accuracy"]
        add(
            f"{mode}: zero false rejections while demand < limit (balanced_0.5x)",
            f"{acc['false_rejections']} (rejected in total: {row['traffic']['rejected']})",
            row["traffic"]["rejected"] == 0,
        )
    for scenario in ("balanced_5x", "skewed_5x"):
        row = _find(rows, scenario, "sync")
        if row is None:
            add(f"sync <= 0.05 request-path round trips per request ({scenario})", "-", None)
            continue
        value = row["round_trips"].get("rt_per_request_path")
        add(
            f"sync <= 0.05 request-path round trips per request ({scenario})",
            f"{value} ({row['round_trips']['source']})",
            value is not None and value <= 0.05,
        )
    strict_rows = [row for row in rows if row["mode"] == "strict" and row.get("status") == "ok"]
    if strict_rows:
        worst_over = max(row["accuracy"]["overshoot_max_pct"] for row in strict_rows)
        definite = sum(row["accuracy"]["false_rejections_definite"] for row in strict_rows)
        unfilled = sum(row["accuracy"]["rejected_in_unfilled_windows"] for row in strict_rows)
        receive = sum(row["accuracy"]["false_rejections"] for row in strict_rows)
        add(
            "strict: zero overshoot and zero false rejections (every scenario)",
            f"overshoot max {worst_over:.2f} %; false rejections definite {definite}, in unfilled windows "
            f"{unfilled}, receive-order {receive}",
            worst_over == 0 and definite == 0 and unfilled == 0,
        )
    else:
        add("strict: zero overshoot and zero false rejections (every scenario)", "-", None)
    sync_row, strict_row = _find(rows, "throughput", "sync"), _find(rows, "throughput", "strict")
    if sync_row and strict_row:
        ratio = sync_row["traffic"]["rps"] / max(1e-9, strict_row["traffic"]["rps"])
        cpu_sync = sync_row["cpu"]["sidecars_us_per_call"] + (sync_row["cpu"]["redis_us_per_call"] or 0)
        cpu_strict = strict_row["cpu"]["sidecars_us_per_call"] + (strict_row["cpu"]["redis_us_per_call"] or 0)
        strict_failures = failure_decisions(strict_row) or 0
        share = 100.0 * strict_failures / max(1, strict_row["traffic"]["sent"])
        rounds = ""
        if "rounds_rps" in sync_row:
            rounds = f" (median of {len(sync_row['rounds_rps'])} alternating rounds: sync {sync_row['rounds_rps']}, "
            rounds += f"strict {strict_row.get('rounds_rps')})"
        add(
            f"sync throughput >= 1.8x strict (closed loop, {sync_row['replicas']} replica(s), back to back){rounds}",
            f"{sync_row['traffic']['rps']:.0f} vs {strict_row['traffic']['rps']:.0f} req/s = {ratio:.2f}x; "
            f"server CPU per call (sidecars + redis) {cpu_sync:.0f} vs {cpu_strict:.0f} us "
            f"= {cpu_strict / max(1e-9, cpu_sync):.2f}x"
            + (
                f"; strict decided {share:.0f} % of calls in failure mode (Redis over its timeout), "
                "which flatters its throughput"
                if strict_failures
                else ""
            ),
            ratio >= 1.8,
        )
    else:
        add("sync throughput >= 1.8x strict", "-", None)
    return results


def goals_table(items: Sequence[Mapping[str, Any]]) -> str:
    lines = ["| goal | measured | verdict |", "|---|---|---|"]
    lines += [f"| {item['goal']} | {item['measured']} | {item['verdict']} |" for item in items]
    return "\n".join(lines)


def write_json(path: Path, document: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2, sort_keys=True, default=str) + "\n")
