"""From recorded calls to the figures of design.md section 5.

Definitions (per descriptor value = counter key, per window):

* A call belongs to the window of its **send** time. If its receive time falls in
  another window the sidecar may have counted it in either: it is **straddling**,
  counted apart and left out of overshoot.
* **overshoot** = admitted hits beyond the limit, in % of the limit, over the calls
  sent and answered inside the window; reported as the max over (value, window) and
  the mean over the windows whose offered hits exceeded the limit (only those can
  overshoot).
* **false rejections** (receive order, as specified): responses of a (value, window)
  sorted by receive time; a rejection is false if fewer than ``limit`` admissions of
  that value and window were received before it. Admissions decided before a
  rejection can arrive after it (replicas answer at different speeds), so this count
  can flag a correct rejection. Two stricter counts go with it:
  **definite** -- fewer than ``limit`` admissions touching the window were even *sent*
  before the rejection was received (no ordering could justify it), and **in unfilled
  windows** -- rejections in a window whose admitted total (straddlers included)
  never reached the limit.
"""

from __future__ import annotations

import bisect
import csv
import math
from array import array
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtest.accuracy_harness.driver import CODE_ERROR, CODE_NOT_SENT, ReplicaRecord
from loadtest.accuracy_harness.redis_watch import OWN_COMMANDS, parse_key
from loadtest.common import percentile

OK = 1
OVER_LIMIT = 2
LATE_AFTER = 0.010
"""A call sent this much after its scheduled time counts as late (the generator fell behind)."""
DETAIL_ROWS = 20
"""(value, window) rows kept in the JSON: those with overshoot or false rejections."""
REQUEST_PATH_COMMANDS = ("evalsha", "eval", "evalsha_ro", "eval_ro", "fcall", "fcall_ro")


@dataclass
class Calls:
    """Every call of a run, flattened over replicas (index-aligned arrays)."""

    replica: array[int] = field(default_factory=lambda: array("b"))
    value: array[int] = field(default_factory=lambda: array("i"))
    scheduled: array[float] = field(default_factory=lambda: array("d"))
    send: array[float] = field(default_factory=lambda: array("d"))
    recv: array[float] = field(default_factory=lambda: array("d"))
    code: array[int] = field(default_factory=lambda: array("b"))
    errors: dict[int, str] = field(default_factory=dict)

    @classmethod
    def merge(
        cls,
        records: Sequence[ReplicaRecord],
        start: float,
        offsets: Sequence[array[float]] | None,
    ) -> Calls:
        calls = cls()
        for replica, record in enumerate(records):
            base = len(calls.code)
            count = len(record.codes)
            calls.replica.extend([replica] * count)
            calls.value.extend(record.values)
            if offsets is not None:
                calls.scheduled.extend(start + offset for offset in offsets[replica])
            else:
                calls.scheduled.extend(record.send)
            calls.send.extend(record.send)
            calls.recv.extend(record.recv)
            calls.code.extend(record.codes)
            calls.errors.update({base + index: name for index, name in record.errors.items()})
        return calls

    def sent(self) -> Iterable[int]:
        return (i for i, code in enumerate(self.code) if code != CODE_NOT_SENT)


def write_calls(path: Path, calls: Calls) -> None:
    """Every call as CSV (replica, value, scheduled, send, recv, code, error), for digging."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["replica", "value", "scheduled", "send", "recv", "code", "error"])
        for i in range(len(calls.code)):
            writer.writerow(
                [
                    calls.replica[i],
                    calls.value[i],
                    f"{calls.scheduled[i]:.6f}",
                    f"{calls.send[i]:.6f}",
                    f"{calls.recv[i]:.6f}",
                    calls.code[i],
                    calls.errors.get(i, ""),
                ]
            )


def window_of(moment: float, unit_seconds: int) -> int:
    """Window start as the sidecar computes it (``sidecar.limiter.windows.window_start``)."""
    whole = math.floor(moment)
    return whole - whole % unit_seconds


def traffic_figures(calls: Calls, measure_from: float | None = None) -> dict[str, Any]:
    """Counts, throughput, latency and pacing of the calls sent (from ``measure_from`` on)."""
    indices = [i for i in calls.sent() if measure_from is None or calls.send[i] >= measure_from]
    answered = [i for i in indices if calls.code[i] >= 0]
    latencies = sorted((calls.recv[i] - calls.send[i]) * 1e3 for i in answered)
    errors = Counter(calls.errors[i] for i in indices if calls.code[i] == CODE_ERROR)
    lateness = [calls.send[i] - calls.scheduled[i] for i in indices]
    span = (max(calls.recv[i] for i in answered) - min(calls.send[i] for i in indices)) if answered else 0.0
    return {
        "planned": len(calls.code) if measure_from is None else len(indices),
        "sent": len(indices),
        "not_sent": sum(1 for code in calls.code if code == CODE_NOT_SENT) if measure_from is None else 0,
        "answered": len(answered),
        "admitted": sum(1 for i in answered if calls.code[i] == OK),
        "rejected": sum(1 for i in answered if calls.code[i] == OVER_LIMIT),
        "other_codes": sum(1 for i in answered if calls.code[i] not in (OK, OVER_LIMIT)),
        "errors": dict(errors),
        "late_calls": sum(1 for late in lateness if late > LATE_AFTER),
        "max_late_ms": round(max(lateness, default=0.0) * 1e3, 1),
        "rps": round(len(indices) / span, 1) if span > 0 else 0.0,
        "p50_ms": round(percentile(latencies, 0.50), 3),
        "p99_ms": round(percentile(latencies, 0.99), 3),
        "max_ms": round(latencies[-1], 3) if latencies else 0.0,
    }


@dataclass
class Groups:
    """Calls of a run grouped per (value, window of the send time)."""

    by_send_window: dict[tuple[int, int], list[int]] = field(default_factory=lambda: defaultdict(list))
    """Answered calls (straddlers included)."""
    inside: dict[tuple[int, int], list[int]] = field(default_factory=lambda: defaultdict(list))
    """Answered calls whose send and receive fall in the same window."""
    admitted_sends: dict[tuple[int, int], list[float]] = field(default_factory=lambda: defaultdict(list))
    """Send times of admitted calls touching the window (straddlers in both of theirs)."""
    offered: Counter[tuple[int, int]] = field(default_factory=Counter)
    """Every call sent, answered or not."""
    straddling: Counter[str] = field(default_factory=Counter)


def group_calls(calls: Calls, unit_seconds: int) -> Groups:
    groups = Groups()
    for i in calls.sent():
        value = calls.value[i]
        send_window = window_of(calls.send[i], unit_seconds)
        group = (value, send_window)
        groups.offered[group] += 1
        code = calls.code[i]
        if code < 0:
            continue  # outcome unknown (error): neither admitted nor rejected
        groups.by_send_window[group].append(i)
        if code == OK:
            groups.admitted_sends[group].append(calls.send[i])
        recv_window = window_of(calls.recv[i], unit_seconds)
        if recv_window == send_window:
            groups.inside[group].append(i)
            continue
        groups.straddling["all"] += 1
        if code == OK:
            groups.straddling["admitted"] += 1
            groups.admitted_sends[(value, recv_window)].append(calls.send[i])
        else:
            groups.straddling["rejected"] += 1
    return groups


def false_rejections(calls: Calls, groups: Groups, group: tuple[int, int], limit: int) -> tuple[int, int, int]:
    """``(receive order, definite, in an unfilled window)`` for one (value, window)."""
    running = receive_order = 0
    for i in sorted(groups.by_send_window[group], key=calls.recv.__getitem__):
        if calls.code[i] == OK:
            running += 1
        elif calls.code[i] == OVER_LIMIT and running < limit:
            receive_order += 1
    sends = sorted(groups.admitted_sends.get(group, ()))
    rejected = [i for i in groups.inside.get(group, ()) if calls.code[i] == OVER_LIMIT]
    definite = sum(1 for i in rejected if bisect.bisect_left(sends, calls.recv[i]) < limit)
    unfilled = len(rejected) if len(sends) < limit else 0
    return receive_order, definite, unfilled


def accuracy_figures(calls: Calls, limit: int, unit_seconds: int) -> dict[str, Any]:
    """Overshoot and false rejections per (value, window); see the module docstring."""
    groups = group_calls(calls, unit_seconds)
    overshoots: list[float] = []
    saturated: list[float] = []
    over_hits: list[int] = []
    false_counts = [0, 0, 0]
    windows_with_false = admitted_total = ideal_total = 0
    detail: list[dict[str, Any]] = []
    for group, members in groups.by_send_window.items():
        admitted_inside = sum(1 for i in groups.inside.get(group, ()) if calls.code[i] == OK)
        over = max(0, admitted_inside - limit)
        over_hits.append(over)
        overshoots.append(100.0 * over / limit)
        if groups.offered[group] > limit:
            saturated.append(100.0 * over / limit)
        admitted_total += sum(1 for i in members if calls.code[i] == OK)
        ideal_total += min(groups.offered[group], limit)
        found = false_rejections(calls, groups, group, limit)
        false_counts = [total + part for total, part in zip(false_counts, found, strict=True)]
        windows_with_false += found[0] > 0
        if over or found[1] or found[2]:
            detail.append(
                {
                    "value": group[0],
                    "window": group[1],
                    "offered": groups.offered[group],
                    "admitted_inside": admitted_inside,
                    "admitted_touching": len(groups.admitted_sends.get(group, ())),
                    "rejected": sum(1 for i in members if calls.code[i] == OVER_LIMIT),
                    "false_definite": found[1],
                    "rejected_unfilled": found[2],
                }
            )
    detail.sort(key=lambda item: (-item["admitted_inside"], item["window"]))
    return {
        "windows_of_interest": detail[:DETAIL_ROWS],
        "windows": len(groups.by_send_window),
        "windows_saturated": len(saturated),
        "windows_over_limit": sum(1 for over in over_hits if over),
        "straddling": groups.straddling["all"],
        "straddling_admitted": groups.straddling["admitted"],
        "straddling_rejected": groups.straddling["rejected"],
        "overshoot_max_pct": round(max(overshoots, default=0.0), 3),
        "overshoot_max_hits": max(over_hits, default=0),
        "overshoot_mean_pct": round(sum(saturated) / len(saturated), 3) if saturated else 0.0,
        "false_rejections": false_counts[0],
        "false_rejection_windows": windows_with_false,
        "false_rejections_definite": false_counts[1],
        "rejected_in_unfilled_windows": false_counts[2],
        "admitted_vs_ideal_pct": round(100.0 * admitted_total / ideal_total, 2) if ideal_total else None,
    }


def round_trip_figures(
    events_per_sidecar: Sequence[Sequence[Mapping[str, Any]]],
    requests: int,
    commands_before: Mapping[str, int] | None,
    commands_after: Mapping[str, int] | None,
    own_commands: int,
) -> dict[str, Any]:
    """Redis round trips per request (``requests``: every call, warm-up included, as the
    sidecars count warm-up round trips too), from the sidecars' shutdown events if all logged one,
    else from ``INFO commandstats`` deltas (commands, not round trips: a pipeline of N
    commands counts N; request path = script calls)."""
    closing = []
    for events in events_per_sidecar:
        found = [event for event in events if "redis_round_trips_request_path" in event]
        if found:
            closing.append(found[-1])
    result: dict[str, Any] = {"closing_events": sorted({str(event.get("event")) for event in closing})}
    if closing and len(closing) == len(events_per_sidecar):
        request_path = sum(int(event["redis_round_trips_request_path"]) for event in closing)
        background = sum(int(event.get("redis_round_trips_background", 0)) for event in closing)
        result["source"] = "shutdown log events"
        extras: Counter[str] = Counter()
        for event in closing:
            for name, value in event.items():
                if isinstance(value, int) and not name.startswith("redis_round_trips"):
                    extras[name] += value
                elif isinstance(value, dict):  # failure_reasons: {reason: requests}
                    for part, count in value.items():
                        if isinstance(count, int):
                            extras[f"{name}.{part}"] += count
        result["backend_stats"] = dict(extras)
    elif commands_before is not None and commands_after is not None:
        delta = {
            name: commands_after.get(name, 0) - commands_before.get(name, 0)
            for name in commands_after
            if name not in OWN_COMMANDS
        }
        request_path = sum(count for name, count in delta.items() if name in REQUEST_PATH_COMMANDS)
        background = max(0, sum(delta.values()) - request_path - own_commands)
        result["source"] = (
            "INFO commandstats deltas (no shutdown event with redis_round_trips_*): "
            "request path = script calls, total = all commands, pipelined commands counted one by one"
        )
        result["command_deltas"] = {name: count for name, count in delta.items() if count}
    else:
        result["source"] = "none (no Redis)"
        return result | {"request_path": 0, "background": 0, "rt_per_request_path": 0.0, "rt_per_request_total": 0.0}
    return result | {
        "request_path": request_path,
        "background": background,
        "rt_per_request_path": round(request_path / requests, 4) if requests else None,
        "rt_per_request_total": round((request_path + background) / requests, 4) if requests else None,
    }


def cross_check(
    counters: Mapping[str, int],
    digests: Mapping[str, int],
    calls: Calls,
    limit: int,
    unit_seconds: int,
) -> dict[str, Any]:
    """Redis counters against the admissions the client saw: every admitted hit must be
    in Redis exactly once. Compared in total, per value (all windows summed: immune to
    straddling), and per (value, window) up to the straddling calls of that window."""
    client_by_value: Counter[int] = Counter()
    inside: Counter[tuple[int, int]] = Counter()
    slack: Counter[tuple[int, int]] = Counter()
    for i in calls.sent():
        if calls.code[i] != OK:
            continue
        value = calls.value[i]
        client_by_value[value] += 1
        send_window = window_of(calls.send[i], unit_seconds)
        recv_window = window_of(calls.recv[i], unit_seconds)
        if send_window == recv_window:
            inside[(value, send_window)] += 1
        else:
            slack[(value, send_window)] += 1
            slack[(value, recv_window)] += 1
    redis_by_value: Counter[int] = Counter()
    redis_by_window: Counter[tuple[int, int]] = Counter()
    unmapped = 0
    for key, count in counters.items():
        parsed = parse_key(key)
        index = digests.get(parsed[0]) if parsed else None
        if parsed is None or index is None:
            unmapped += 1
            continue
        redis_by_value[index] += count
        redis_by_window[(index, parsed[1])] += count
    redis_total = sum(counters.values())
    client_total = sum(client_by_value.values())
    unknown = sum(1 for i in calls.sent() if calls.code[i] == CODE_ERROR)
    result: dict[str, Any] = {
        "redis_total": redis_total,
        "client_admitted": client_total,
        "difference": redis_total - client_total,
        "counter_keys": len(counters),
        "unmapped_keys": unmapped,
        "calls_with_unknown_outcome": unknown,
        "redis_overshoot_max_pct": round(100.0 * max(0, max(counters.values(), default=0) - limit) / limit, 3),
    }
    if digests and not unmapped:
        values = set(client_by_value) | set(redis_by_value)
        result["values_mismatched"] = sum(1 for v in values if client_by_value[v] != redis_by_value[v])
        groups = set(inside) | set(redis_by_window) | set(slack)
        result["windows_unexplained"] = sum(1 for g in groups if abs(redis_by_window[g] - inside[g]) > slack[g])
        result["granularity"] = "total, per value, per (value, window)"
    else:
        result["granularity"] = "total only (counter keys could not be mapped to descriptor values)"
    result["match"] = result["difference"] == 0 and not result.get("values_mismatched")
    return result
