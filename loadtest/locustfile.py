"""Locust load test of the demo's limits, through a real Envoy (``envoy/front.yaml``) and its sidecar.

Run it headless against a running stack (``scripts/demo`` starts one with Envoy on 127.0.0.1:10000)::

    locust -f loadtest/locustfile.py --headless -u 20 -r 20 -t 10s --host http://127.0.0.1:10000

(``.venv/bin/locust`` after ``pip install -e .[dev]``.) The same scenarios as
``loadtest/k6/envoy_ratelimit.js``, one user class each, every user paced with
``constant_throughput``; with ``-u 20`` the weights give the offered rates below (more
users, proportionally more load):

=============  =====  ================================================  =======  ==================
scenario       users  requests                                          offered  limit (demo.yaml)
=============  =====  ================================================  =======  ==================
per_address    4      GET /catalog, all from X-Forwarded-For 192.0.2.1  40/s     20/s per address
api_key        2      GET /api/items, 2 API keys unique to this run     10/s     10/minute per key
route_cap      6      GET /api/status, key ``internal-monitoring``      60/s     50/s for /api
writes         3      POST /orders                                      15/s     5/s for all writes
under_limit    5      GET /catalog, each request from another address   20/s     none reached
=============  =====  ================================================  =======  ==================

Envoy trusts one X-Forwarded-For hop, so a request acts as the client address it names.
All scenarios but per_address spread their requests over 508 documentation addresses
(198.51.100.0/24, 203.0.113.0/24), far below 20/s each. ``internal-monitoring`` is
unlimited per key but still counts against the /api cap, which api_key shares.

429 is an expected answer, so it counts as a success in locust's own statistics; any
other status or a connection error is a failure. A 200 without ``x-ratelimit-limit`` got no
verdict: the sidecar missed the filter's timeout and Envoy failed open; such answers are
counted ("failed open") and left out of the limit checks. At the end (``quitting`` event) it
prints, per scenario, the requests sent and the 200 / 429 / other answers, and per limit
the offered and admitted requests per second (over the whole seconds after all users had
spawned) next to the configured limit, the most requests admitted in one window, and a
check against the bound: the limit plus sync mode's proven overshoot (``--max-overshoot``,
default 0.05 of the limit, rounded down). A request whose send and answer fall in
different windows may have been decided in either: it is left out of the per-window
check, as in the accuracy harness. under_limit must see no 429 at all.

Exit status: 0 when every check holds; 1 when a request failed (locust's
``--exit-code-on-error``); 3 when a limit check failed (whether or not a request failed).
``--ratelimit-json PATH`` also writes the figures as JSON. Limits are read from
``--limits-config`` (default ``examples/config/demo.yaml``). Run it in one process: with
``--processes`` or ``--master``/``--worker`` each worker only sees its own requests.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml
from locust import FastHttpUser, constant_throughput, events, task

REPO = Path(__file__).resolve().parent.parent
DEFAULT_LIMITS = REPO / "examples" / "config" / "demo.yaml"
HOT_ADDRESS = "192.0.2.1"
API_KEYS = 2
RUN = format(int(time.time() * 1000), "x")
"""Makes this run's API keys unique, so that an earlier run in the same minute does not count."""
UNIT_SECONDS = {"second": 1, "minute": 60, "hour": 3600, "day": 86400}
SCENARIOS = ("per_address", "api_key", "route_cap", "writes", "under_limit")

# ---------------------------------------------------------------------------------
# Limits, read from the descriptor config the sidecar uses
# ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Limit:
    """One configured limit and the scenarios whose requests count against it."""

    name: str
    requests: int
    unit_seconds: int
    text: str
    scenarios: tuple[str, ...]


def _rule(descriptors: list[dict[str, Any]], path: list[tuple[str, str | None]], source: Path) -> dict[str, Any]:
    """The ``rate_limit`` of the node reached by ``path`` (key, value or None for key-only)."""
    node: dict[str, Any] = {"descriptors": descriptors}
    for key, value in path:
        matches = [child for child in node.get("descriptors", []) if (child["key"], child.get("value")) == (key, value)]
        if not matches:
            raise ValueError(f"{source}: no descriptor {key}={value or '*'} on the path {path}")
        node = matches[0]
    rule: dict[str, Any] = node["rate_limit"]
    return rule


def load_limits(source: Path) -> dict[str, Limit]:
    """The four limits the scenarios exceed, from ``source`` (an envoyproxy/ratelimit YAML file)."""
    descriptors = yaml.safe_load(source.read_text())["descriptors"]
    shapes: dict[str, tuple[list[tuple[str, str | None]], str, tuple[str, ...]]] = {
        "address": ([("remote_address", None)], "per client address", ("per_address",)),
        "api_key": ([("generic_key", "api"), ("api_key", None)], "per API key", ("api_key",)),
        "route": ([("generic_key", "api")], "for /api", ("api_key", "route_cap")),
        "write": ([("header_match", "write")], "for all writes", ("writes",)),
    }
    limits = {}
    for name, (path, what, scenarios) in shapes.items():
        rule = _rule(descriptors, path, source)
        unit = str(rule["unit"]).lower()
        text = f"{rule['requests_per_unit']}/{unit} {what}"
        limits[name] = Limit(name, int(rule["requests_per_unit"]), UNIT_SECONDS[unit], text, scenarios)
    return limits


# ---------------------------------------------------------------------------------
# What each answer counts against, tallied per window
# ---------------------------------------------------------------------------------


@dataclass
class Tally:
    """Answers of this run: per scenario, and per limit counter and window."""

    statuses: dict[str, Counter[int]] = field(default_factory=lambda: defaultdict(Counter))
    sent: Counter[tuple[str, str, int]] = field(default_factory=Counter)
    """(limit, counter, window start) -> requests sent in that window."""
    admitted: Counter[tuple[str, str, int]] = field(default_factory=Counter)
    """(limit, counter, window start) -> 200s with a verdict sent in that window (for the rates)."""
    within: Counter[tuple[str, str, int]] = field(default_factory=Counter)
    """(limit, counter, window start) -> of those, sent and answered within the window (for the check)."""
    straddling: Counter[str] = field(default_factory=Counter)
    """limit -> 200s sent in one window and answered in the next: left out of the check."""
    failed_open: Counter[str] = field(default_factory=Counter)
    """scenario -> 200s without a rate-limit verdict: Envoy let them through because the sidecar did not
    answer within the filter's timeout (``failure_mode_deny: false``). Left out of the check."""
    started: float = 0.0
    spawned: float = 0.0
    stopped: float = 0.0

    def reset(self, started: float) -> None:
        """Forget everything: a new test starts at ``started``."""
        fresh = Tally(started=started)
        for item in fields(self):
            setattr(self, item.name, getattr(fresh, item.name))


TALLY = Tally()
_addresses = itertools.count()
_keys = itertools.count()


def spread_address(offset: int) -> str:
    """One of 508 documentation addresses, in turn: each far below 20 requests/s."""
    index = (next(_addresses) + offset) % 508
    return f"198.51.100.{index + 1}" if index < 254 else f"203.0.113.{index - 253}"


@events.init_command_line_parser.add_listener
def _arguments(parser: Any) -> None:
    parser.add_argument("--ratelimit-json", default="", help="also write the limit figures as JSON to this path")
    parser.add_argument("--limits-config", default=str(DEFAULT_LIMITS), help="descriptor config with the limits")
    parser.add_argument(
        "--max-overshoot",
        type=float,
        default=0.05,
        help="admitted beyond a limit per window that still passes, as a fraction of it (sync mode's bound)",
    )


@events.test_start.add_listener
def _test_start(environment: Any, **kwargs: Any) -> None:
    TALLY.reset(time.time())


@events.spawning_complete.add_listener
def _spawned(user_count: int, **kwargs: Any) -> None:
    TALLY.spawned = time.time()


@events.test_stop.add_listener
def _test_stop(environment: Any, **kwargs: Any) -> None:
    TALLY.stopped = time.time()


@events.request.add_listener
def _request(context: dict[str, Any], response: Any, start_time: float, response_time: float, **kwargs: Any) -> None:
    scenario = context.get("scenario")
    if scenario is None:
        return
    status = int(getattr(response, "status_code", 0) or 0)
    TALLY.statuses[scenario][status] += 1
    headers = getattr(response, "headers", None)
    # Every request here matches a limit, so a decided answer carries x-ratelimit-limit (Envoy's
    # enable_x_ratelimit_headers); a 200 without it went through without a verdict.
    failed_open = status == 200 and (headers is None or headers.get("x-ratelimit-limit") is None)
    if failed_open:
        TALLY.failed_open[scenario] += 1
    answered = start_time + response_time / 1000
    for limit_name, counter, unit in context["counts"]:
        window = int(start_time // unit * unit)
        TALLY.sent[limit_name, counter, window] += 1
        if status != 200 or failed_open:
            continue
        TALLY.admitted[limit_name, counter, window] += 1
        if int(answered // unit * unit) == window:
            TALLY.within[limit_name, counter, window] += 1
        else:
            TALLY.straddling[limit_name] += 1


# ---------------------------------------------------------------------------------
# Users: one class per scenario
# ---------------------------------------------------------------------------------


class _Scenario(FastHttpUser):
    abstract = True
    network_timeout = 5.0
    connection_timeout = 5.0
    scenario = ""

    def send(self, method: str, path: str, headers: dict[str, str], counts: list[tuple[str, str, int]]) -> None:
        context = {"scenario": self.scenario, "counts": counts}
        body = '{"item": 1}' if method == "POST" else None
        with self.client.request(
            method, path, headers=headers, data=body, name=self.scenario, context=context, catch_response=True
        ) as response:
            if response.status_code in (200, 429):
                response.success()
            else:
                response.failure(f"status {response.status_code}")


class PerAddress(_Scenario):
    """Many requests from one client address: 20/s per address."""

    weight = 4
    wait_time = constant_throughput(10)
    scenario = "per_address"

    @task
    def catalog(self) -> None:
        self.send("GET", "/catalog", {"X-Forwarded-For": HOT_ADDRESS}, [("address", HOT_ADDRESS, 1)])


class ApiKey(_Scenario):
    """A few API keys, each over 10/minute; they also count against the /api cap."""

    weight = 2
    wait_time = constant_throughput(5)
    scenario = "api_key"

    @task
    def items(self) -> None:
        key = f"locust-{RUN}-{next(_keys) % API_KEYS}"
        headers = {"X-Forwarded-For": spread_address(0), "x-api-key": key}
        self.send("GET", "/api/items", headers, [("api_key", key, 60), ("route", "api", 1)])


class RouteCap(_Scenario):
    """/api from many addresses with the key that has no per-key limit: the 50/s route cap decides."""

    weight = 6
    wait_time = constant_throughput(10)
    scenario = "route_cap"

    @task
    def status(self) -> None:
        headers = {"X-Forwarded-For": spread_address(100), "x-api-key": "internal-monitoring"}
        self.send("GET", "/api/status", headers, [("route", "api", 1)])


class Writes(_Scenario):
    """POSTs from many addresses: 5 writes/s in all."""

    weight = 3
    wait_time = constant_throughput(5)
    scenario = "writes"

    @task
    def order(self) -> None:
        headers = {"X-Forwarded-For": spread_address(200), "Content-Type": "application/json"}
        self.send("POST", "/orders", headers, [("write", "all", 1)])


class UnderLimit(_Scenario):
    """Reads from many addresses, each far below every limit: nothing may be refused."""

    weight = 5
    wait_time = constant_throughput(4)
    scenario = "under_limit"

    @task
    def catalog(self) -> None:
        self.send("GET", "/catalog", {"X-Forwarded-For": spread_address(300)}, [])


# ---------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------


def limit_figures(limit: Limit, tally: Tally, max_overshoot: float) -> dict[str, Any]:
    """Offered and admitted rates, the fullest window and the check, for one limit."""
    unit = limit.unit_seconds
    bound = limit.requests + math.floor(max_overshoot * limit.requests + 1e-9)
    windows = [key for key in tally.sent if key[0] == limit.name]
    most = max((tally.within[key] for key in windows), default=0)
    figures: dict[str, Any] = {
        "limit": limit.text,
        "requests_per_unit": limit.requests,
        "unit_seconds": unit,
        "scenarios": list(limit.scenarios),
        "counters": len({key[1] for key in windows}),
        "max_admitted_in_a_window": most,
        "bound": bound,
        "straddling_admitted": tally.straddling[limit.name],
        "ok": most <= bound,
    }
    if unit == 1:
        # Rates over the whole seconds after every user had spawned and before the stop.
        first, last = math.ceil(tally.spawned or tally.started), math.floor(tally.stopped)
        full = [key for key in windows if first <= key[2] and key[2] + 1 <= last]
        seconds = max(1, len({key[2] for key in full}))
        counters = max(1, len({key[1] for key in full}))
        figures["full_seconds"] = len({key[2] for key in full})
        figures["offered_per_s"] = sum(tally.sent[key] for key in full) / seconds / counters
        figures["admitted_per_s"] = sum(tally.admitted[key] for key in full) / seconds / counters
    else:
        # Longer windows (the per-key minute): per counter and window touched by the run.
        touched = max(1, len(windows))
        figures["windows"] = len({key[2] for key in windows})
        figures["offered_per_window"] = sum(tally.sent[key] for key in windows) / touched
        figures["admitted_per_window"] = sum(tally.admitted[key] for key in windows) / touched
    return figures


def report(tally: Tally, limits: dict[str, Limit], max_overshoot: float) -> dict[str, Any]:
    scenarios = {}
    for name in SCENARIOS:
        statuses = tally.statuses.get(name, Counter())
        other = sum(count for status, count in statuses.items() if status not in (200, 429))
        scenarios[name] = {
            "sent": sum(statuses.values()),
            "200": statuses[200],
            "429": statuses[429],
            "other": other,
            "failed_open": tally.failed_open[name],
        }
    figures = {name: limit_figures(limit, tally, max_overshoot) for name, limit in limits.items()}
    false_rejections = scenarios["under_limit"]["429"]
    return {
        "duration_s": round(tally.stopped - tally.started, 3),
        "all_spawned_after_s": round(tally.spawned - tally.started, 3) if tally.spawned else None,
        "max_overshoot": max_overshoot,
        "scenarios": scenarios,
        "limits": figures,
        "under_limit_rejections": false_rejections,
        "ok": all(item["ok"] for item in figures.values()) and false_rejections == 0,
    }


def print_report(document: dict[str, Any]) -> None:
    lines = [
        "",
        f"Rate limits through Envoy: {document['duration_s']:.1f} s, all users spawned after "
        f"{document['all_spawned_after_s']} s",
        f"{'scenario':<12} {'sent':>7} {'200':>7} {'429':>7} {'other':>6} {'failed open':>11}",
    ]
    for name, row in document["scenarios"].items():
        lines.append(
            f"{name:<12} {row['sent']:>7} {row['200']:>7} {row['429']:>7} {row['other']:>6} {row['failed_open']:>11}"
        )
    failed_open = sum(row["failed_open"] for row in document["scenarios"].values())
    if failed_open:
        lines.append(
            f"failed open: {failed_open} answers of 200 carried no rate-limit verdict: the sidecar did not answer "
            "within the filter's timeout and Envoy let them through (failure_mode_deny: false); "
            "they are left out of the checks below"
        )
    lines.append("")
    lines.append(
        f"{'limit':<28} {'offered/s':>9} {'admitted/s':>10} {'max in a window':>15} {'bound':>5} "
        f"{'straddling':>10}  check"
    )
    for item in document["limits"].values():
        if "admitted_per_s" in item:
            offered, admitted = f"{item['offered_per_s']:.1f}", f"{item['admitted_per_s']:.1f}"
        else:
            unit = {60: "/min", 3600: "/h"}.get(item["unit_seconds"], f"/{item['unit_seconds']}s")
            offered = f"{item['offered_per_window']:.1f}{unit}"
            admitted = f"{item['admitted_per_window']:.1f}{unit}"
        lines.append(
            f"{item['limit']:<28} {offered:>9} {admitted:>10} {item['max_admitted_in_a_window']:>15} "
            f"{item['bound']:>5} {item['straddling_admitted']:>10}  {'ok' if item['ok'] else 'FAILED'}"
        )
    lines.append(
        "(per counter: per second over the whole seconds after all users spawned; per API key and minute "
        "window touched; straddling: admitted in a request sent in one window and answered in the next)"
    )
    rejections = document["under_limit_rejections"]
    lines.append(f"under_limit: {rejections} rejected ({'ok' if rejections == 0 else 'FAILED: false rejections'})")
    lines.append("all limit checks passed" if document["ok"] else "a limit check failed: exit status 3")
    print("\n".join(lines), flush=True)


@events.quitting.add_listener
def _quitting(environment: Any, **kwargs: Any) -> None:
    options = environment.parsed_options
    if options is None or not any(TALLY.statuses.values()):
        print("rate-limit report: no requests recorded in this process", flush=True)
        return
    if not TALLY.stopped:
        TALLY.stopped = time.time()
    document = report(TALLY, load_limits(Path(options.limits_config)), options.max_overshoot)
    document["host"] = environment.host
    print_report(document)
    if options.ratelimit_json:
        path = Path(options.ratelimit_json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n")
        print(f"wrote {path}", flush=True)
    if not document["ok"] and environment.process_exit_code is None:
        environment.process_exit_code = 3
