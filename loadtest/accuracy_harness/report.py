"""The Markdown table, the goals of design.md section 5 checked against the figures, and JSON."""

from __future__ import annotations

import json
import math
import textwrap
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


FIXED_WINDOW = "fixed_window"


def algorithm(row: Mapping[str, Any]) -> str:
    """The algorithm of a row's rule (rows written before algorithms existed are fixed windows)."""
    return str(row.get("algorithm") or FIXED_WINDOW)


def fixed_rows(rows: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The fixed-window rows, not those of the overload scenarios (their own table: overload.py)."""
    return [row for row in rows if algorithm(row) == FIXED_WINDOW and "overload" not in row]


def _render(rows: Sequence[Mapping[str, Any]], columns: Sequence[tuple[str, Any]]) -> str:
    lines = [
        "| " + " | ".join(name for name, _ in columns) + " |",
        "|" + "|".join("---" for _ in columns) + "|",
    ]
    for row in rows:
        if row.get("status") != "ok":
            cells = [row["scenario"], row["mode"], f"{row.get('status')}: {row.get('reason', '')}"]
            cells += [""] * (len(columns) - len(cells))
        else:
            cells = [render(row) for _, render in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The fixed-window scenarios (the sliding-window and token-bucket ones have their own tables)."""
    return _render(fixed_rows(rows), COLUMNS)


def _alg(row: Mapping[str, Any]) -> Mapping[str, Any]:
    return row["algorithm_accuracy"]  # type: ignore[no-any-return]


def _rt_pair(row: Mapping[str, Any]) -> str:
    return f"{_rt(row, 'rt_per_request_path')} / {_rt(row, 'rt_per_request_total')}"


def _difference(row: Mapping[str, Any]) -> str:
    found = _alg(row)["estimate_minus_exact"]
    if not found:
        return "-"
    return f"{found['p1']:+d} / {found['p50']:+d} / {found['p99']:+d} (min {found['min']:+d})"


ALGORITHM_LEAD_COLUMNS = (
    ("scenario", lambda r: r["scenario"]),
    ("mode", lambda r: r["mode"]),
    ("req/s", lambda r: f"{r['traffic']['rps']:.0f}"),
    ("p99 ms", lambda r: f"{r['traffic']['p99_ms']:.2f}"),
    ("sent", lambda r: str(r["traffic"]["sent"])),
)
"""The first columns of the sliding-window and token-bucket tables."""
SLIDING_COLUMNS = (
    *ALGORITHM_LEAD_COLUMNS,
    (
        "admitted (reference / exact log)",
        lambda r: f"{_alg(r)['admitted']} ({_alg(r)['reference_admitted']} / {_alg(r)['exact_log_admitted']})",
    ),
    (
        "exact sliding count: max % (hits) / p99 %",
        lambda r: f"{_alg(r)['exact_max_pct']:.1f} ({_alg(r)['exact_max_hits']}) / {_alg(r)['exact_p99_pct']:.1f}",
    ),
    (
        "reference: max % / p99 % (fixed window: max %)",
        lambda r: (
            f"{_alg(r)['reference_exact_max_pct']:.1f} / {_alg(r)['reference_exact_p99_pct']:.1f}"
            f" ({_alg(r)['fixed_reference_exact_max_pct']:.0f})"
        ),
    ),
    (
        "estimate over the limit: max hits (definite)",
        lambda r: f"{_alg(r)['estimate_over_max_hits']} ({_alg(r)['estimate_over_definite_max_hits']})",
    ),
    ("estimate - exact: p1 / p50 / p99", _difference),
    (
        "false rej. vs estimate (definite)",
        lambda r: f"{_alg(r)['false_vs_estimate']} ({_alg(r)['false_vs_estimate_definite']})",
    ),
    (
        "refused, exact log would admit (reference)",
        lambda r: f"{_alg(r)['false_vs_exact_log']} ({_alg(r)['reference_false_vs_exact_log']})",
    ),
    ("failure-mode decisions", _failure_decisions),
    ("RT/req path / total", _rt_pair),
    ("Redis = admitted", _check),
)

BUCKET_COLUMNS = (
    *ALGORITHM_LEAD_COLUMNS,
    ("admitted (ideal bucket)", lambda r: f"{_alg(r)['admitted']} ({_alg(r)['ideal_admitted']})"),
    (
        "excess over burst + rate x d: max hits (definite)",
        lambda r: f"{_alg(r)['excess_max_hits']:.2f} ({_alg(r)['excess_definite_max_hits']:.2f})",
    ),
    (
        "refused but the ideal admits / admitted but the ideal refuses",
        lambda r: f"{_alg(r)['refused_but_ideal_admits']} / {_alg(r)['admitted_but_ideal_refuses']}",
    ),
    (
        "false rej.: a token was free (definite)",
        lambda r: f"{_alg(r)['false_rejections']} ({_alg(r)['false_rejections_definite']})",
    ),
    ("failure-mode decisions", _failure_decisions),
    ("RT/req path / total", _rt_pair),
)


def algorithm_tables(rows: Sequence[Mapping[str, Any]]) -> str:
    """The sliding-window and token-bucket tables with how to read them ('' when neither ran)."""
    parts = []
    sliding = [row for row in rows if algorithm(row) == "sliding_window"]
    if sliding:
        limit = sliding[0].get("limit")
        parts += [
            f"sliding_window (limit {limit}/s, HAProxy's two-window estimate):",
            "",
            _render(sliding, SLIDING_COLUMNS),
            "",
            SLIDING_NOTES,
        ]
    bucket = [row for row in rows if algorithm(row) == "token_bucket"]
    if bucket:
        first = bucket[0]
        parts += [
            "",
            f"token_bucket (GCRA, refill {first.get('limit')}/s, burst {first.get('burst')}):",
            "",
            _render(bucket, BUCKET_COLUMNS),
            "",
            BUCKET_NOTES,
        ]
    return "\n".join(parts).strip("\n")


SLIDING_NOTES = (
    "How to read it (per counter, every call at the midpoint of its sent..answered interval; 'definite' = "
    "what no placement inside the intervals explains away; loadtest/accuracy_harness/algorithms.py): exact "
    "sliding count = admitted calls in (t - 1 s, t] at each admitted call, itself included (an exact sliding "
    "log keeps it <= limit); reference = one exact instance of the two-window estimate fed the same arrivals "
    "at their send times (what the algorithm itself allows: its overshoot is HAProxy's too), fixed window = "
    "an exact fixed window fed them, exact log = an exact sliding log fed them; estimate = current window + "
    "floor(previous window x the share of it still covered), recomputed from the admitted calls: over the "
    "limit means the replicas together admitted more than one exact instance would; false rejections vs "
    "estimate = refused while the estimate with the call was within the limit; 'refused, exact log would "
    "admit' = refused while the exact sliding count plus the call was within the limit (the estimate does "
    "this by design when the previous window's hits came early: compare with the reference)."
)
BUCKET_NOTES = (
    "How to read it (per counter; loadtest/accuracy_harness/algorithms.py): excess = the most admitted calls "
    "in any interval beyond burst + rate x its length (GCRA's envelope), over pairs of admitted calls at "
    "their midpoints; definite = with each interval as long as the calls' timestamps allow, so > 0 is a "
    "certain violation. Local mode (--instances R) gives each replica a bucket of ceil(burst / R) refilled "
    "at rate / R, whose sum has the same envelope when R divides the burst. Ideal bucket = one exact GCRA "
    "fed the same arrivals at their send times. False rejection = refused while a bucket replaying the "
    "admitted calls still had a token."
)


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
    strict_rows = [row for row in fixed_rows(rows) if row["mode"] == "strict" and row.get("status") == "ok"]
    if strict_rows:
        worst_over = max(row["accuracy"]["overshoot_max_pct"] for row in strict_rows)
        definite = sum(row["accuracy"]["false_rejections_definite"] for row in strict_rows)
        unfilled = sum(row["accuracy"]["rejected_in_unfilled_windows"] for row in strict_rows)
        receive = sum(row["accuracy"]["false_rejections"] for row in strict_rows)
        add(
            "strict: zero overshoot and zero false rejections (every fixed-window scenario)",
            f"overshoot max {worst_over:.2f} %; false rejections definite {definite}, in unfilled windows "
            f"{unfilled}, receive-order {receive}",
            worst_over == 0 and definite == 0 and unfilled == 0,
        )
    else:
        add("strict: zero overshoot and zero false rejections (every fixed-window scenario)", "-", None)
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
    results += algorithm_goals(rows, replicas)
    return results


def algorithm_goals(rows: Sequence[Mapping[str, Any]], replicas: int) -> list[dict[str, Any]]:
    """What each mode promises for sliding windows and token buckets, checked on the definite figures."""
    results: list[dict[str, Any]] = []

    def add(goal: str, measured: str, met: bool) -> None:
        results.append({"goal": goal, "measured": measured, "verdict": "met" if met else "MISSED"})

    for row in rows:
        if row.get("status") != "ok" or "algorithm_accuracy" not in row:
            continue
        figures, mode, name = row["algorithm_accuracy"], row["mode"], row["scenario"]
        failures = failure_decisions(row) if mode != "local" else None
        decided = f"; {failures} decided in failure mode (Redis over its timeout)" if failures else ""
        if figures["algorithm"] == "sliding_window":
            over = figures["estimate_over_definite_max_hits"]
            false = figures["false_vs_estimate_definite"]
            allowed = sliding_estimate_bound(mode, row["limit"], replicas, row.get("sync_max_overshoot"))
            add(
                f"{name}/{mode}: the replicas' admissions keep the two-window estimate within limit + {allowed} "
                "(definite), no definite false rejection against it",
                f"estimate over the limit by {over} hit(s) definite ({figures['estimate_over_max_hits']} measured); "
                f"false rejections {false} definite; exact sliding count max {figures['exact_max_pct']:.1f} % "
                f"(reference {figures['reference_exact_max_pct']:.1f} %){decided}",
                over <= allowed and (false == 0 or mode == "local"),
            )
        elif figures["algorithm"] == "token_bucket":
            allowed = figures["local_envelope_burst"] - figures["burst"] if mode == "local" else 0
            add(
                f"{name}/{mode}: admitted within burst + rate x d in every interval (definite excess <= {allowed})",
                f"definite excess {figures['excess_definite_max_hits']:.2f} hits, measured "
                f"{figures['excess_max_hits']:.2f}; false rejections {figures['false_rejections_definite']} definite"
                + decided,
                figures["excess_definite_max_hits"] <= allowed,
            )
    return results


def sliding_estimate_bound(mode: str, limit: int, replicas: int, max_overshoot: float | None = None) -> int:
    """Hits by which a mode may take the two-window estimate past the limit: strict 0; sync ``(R - 1) * Q``
    for the other replicas' blind hits in the current window (the documented bound of a window) and as many
    again for their blind hits of the previous window, which a replica reads back only with its first flush
    after the boundary; local ``R * ceil(L / R) - L`` from the shares plus ``R - 1`` from rounding each
    replica's previous-window part down separately."""
    if mode == "strict" or replicas <= 1:
        return 0
    if mode == "sync":
        return 2 * sync_bound_hits(limit, replicas, max_overshoot)
    return replicas * math.ceil(limit / replicas) - limit + replicas - 1


def goals_table(items: Sequence[Mapping[str, Any]]) -> str:
    lines = ["| goal | measured | verdict |", "|---|---|---|"]
    lines += [f"| {item['goal']} | {item['measured']} | {item['verdict']} |" for item in items]
    return "\n".join(lines)


def write_json(path: Path, document: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2, sort_keys=True, default=str) + "\n")


# ---------------------------------------------------------------- the README block

README_START, README_END = "<!-- accuracy:start -->", "<!-- accuracy:end -->"


def _yes(row: Mapping[str, Any]) -> str:
    check = row.get("redis_check")
    if check is None:
        return "-"
    return "yes" if check["match"] else f"NO ({check['redis_total']} vs {check['client_admitted']})"


def _false_pair(row: Mapping[str, Any]) -> str:
    acc = row["accuracy"]
    return f"{acc['false_rejections_definite']} / {acc['rejected_in_unfilled_windows']}"


LEAD_COLUMNS = (
    ("scenario ({replicas} replicas)", lambda r: r["scenario"]),
    ("mode", lambda r: r["mode"]),
    ("req/s", lambda r: f"{r['traffic']['rps']:.0f}"),
    ("p99 ms", lambda r: f"{r['traffic']['p99_ms']:.2f}"),
)
"""The first columns of every README table: what ran and how fast."""
README_COLUMNS = (
    *LEAD_COLUMNS,
    (
        "overshoot max % (hits)",
        lambda r: f"{r['accuracy']['overshoot_max_pct']:.2f} ({r['accuracy']['overshoot_max_hits']})",
    ),
    ("false rejections (definite / unfilled)", _false_pair),
    ("failure-mode decisions", _failure_decisions),
    ("Redis round trips per request: path / total", _rt_pair),
    ("Redis = admitted", _yes),
)
README_SLIDING_COLUMNS = (
    *LEAD_COLUMNS,
    (
        "exact sliding count: max % (p99 %)",
        lambda r: f"{_alg(r)['exact_max_pct']:.0f} ({_alg(r)['exact_p99_pct']:.0f})",
    ),
    (
        "same arrivals, one exact instance (fixed window): max %",
        lambda r: f"{_alg(r)['reference_exact_max_pct']:.0f} ({_alg(r)['fixed_reference_exact_max_pct']:.0f})",
    ),
    (
        "estimate over the limit, hits: measured (definite)",
        lambda r: f"{_alg(r)['estimate_over_max_hits']} ({_alg(r)['estimate_over_definite_max_hits']})",
    ),
    (
        "false rejections vs the estimate: measured (definite)",
        lambda r: f"{_alg(r)['false_vs_estimate']} ({_alg(r)['false_vs_estimate_definite']})",
    ),
    ("failure-mode decisions", _failure_decisions),
    ("Redis round trips per request: path / total", _rt_pair),
    ("Redis = admitted", _yes),
)
README_BUCKET_COLUMNS = (
    *LEAD_COLUMNS,
    ("admitted (one exact bucket, same arrivals)", lambda r: f"{_alg(r)['admitted']} ({_alg(r)['ideal_admitted']})"),
    (
        "excess over burst + rate x d, hits: measured (definite)",
        lambda r: f"{_alg(r)['excess_max_hits']:.2f} ({_alg(r)['excess_definite_max_hits']:.2f})",
    ),
    (
        "refused with a token free: measured (definite)",
        lambda r: f"{_alg(r)['false_rejections']} ({_alg(r)['false_rejections_definite']})",
    ),
    ("failure-mode decisions", _failure_decisions),
    ("Redis round trips per request: path / total", _rt_pair),
)


def _readme_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[tuple[str, Any]], replicas: int) -> str:
    named = [(name.format(replicas=replicas), render) for name, render in columns]
    return _render(rows, named)


def _setting(value: float | None, name: str, scale: float, suffix: str) -> str:
    if value is None:
        try:
            from sidecar.settings import Settings

            value = float(getattr(Settings, name))
        except (ImportError, AttributeError):
            return "the sidecar's default"
    return f"{value * scale:g}{suffix}"


def readme_block(document: Mapping[str, Any], options: Mapping[str, Any]) -> str:
    """The README's accuracy block (markers included) from the harness's JSON document: the fixed-window
    table in the README's columns, then the sliding-window and token-bucket tables, and the command."""
    rows = document["results"]
    replicas = document["replicas"]
    scenarios = document["scenarios"]
    main = next((facts["limit"] for name, facts in scenarios.items() if name == "balanced_5x"), None)
    if main is None and scenarios:
        main = next(iter(scenarios.values()))["limit"]
    others = [
        f"{name}: {facts['limit']}/{facts['unit']}"
        for name, facts in scenarios.items()
        if facts["limit"] != main and facts["pattern"] != "closed"
    ]
    settings = (
        f"`--redis-timeout` {_setting(options.get('redis_timeout'), 'redis_timeout', 1000, ' ms')}, "
        f"`--sync-interval` {_setting(options.get('sync_interval'), 'sync_interval', 1000, ' ms')}, "
        f"`--sync-max-overshoot` {_setting(options.get('sync_max_overshoot'), 'sync_max_overshoot', 1, '')}"
    )
    cores = document["environment"].get("cores")
    defaults = all(options.get(name) is None for name in ("redis_timeout", "sync_interval", "sync_max_overshoot"))
    intro = (
        f"{'Quick' if document['quick'] else 'Full'} run at commit {document['environment'].get('git')}, "
        f"{'default settings' if defaults else 'settings'} ({settings}), limit {main}/s unless the scenario says "
        "otherwise" + (f" ({'; '.join(others)})" if others else "") + f", all on this {cores}-core machine:"
    )
    lines = [README_START, *textwrap.wrap(intro, 100, break_on_hyphens=False), ""]
    fixed = fixed_rows(rows)
    if fixed:
        lines += [_readme_table(fixed, README_COLUMNS, replicas), ""]
    sliding = [row for row in rows if algorithm(row) == "sliding_window"]
    if sliding:
        lines += [
            "`algorithm: sliding_window` (exact sliding count: admitted calls in the second before each admitted "
            "call, which an exact sliding log keeps at 100 %; estimate: HAProxy's two-window count the sidecars "
            "enforce, recomputed from what they admitted):",
            "",
            _readme_table(sliding, README_SLIDING_COLUMNS, replicas),
            "",
        ]
    bucket = [row for row in rows if algorithm(row) == "token_bucket"]
    if bucket:
        first = bucket[0]
        lines += [
            f"`algorithm: token_bucket` (GCRA, refill {first.get('limit')}/s, burst {first.get('burst')}; excess: "
            "admitted calls in any interval beyond burst + rate x its length):",
            "",
            _readme_table(bucket, README_BUCKET_COLUMNS, replicas),
            "",
        ]
    lines += [f"Reproduce: `{document['command']}`", README_END]
    return "\n".join(lines)


def write_readme_block(path: Path, block: str) -> None:
    """Replace the accuracy block of ``path`` (between the markers) with ``block``."""
    text = path.read_text()
    start, end = text.find(README_START), text.find(README_END)
    if start < 0 or end < start:
        raise RuntimeError(f"{path}: no {README_START} ... {README_END} block")
    path.write_text(text[:start] + block + text[end + len(README_END) :])
