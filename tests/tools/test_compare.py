"""``python -m loadtest.compare``: the same recording through Envoy + sidecar and through HAProxy stick tables.

The slow test runs the tool at its smoke size (``--smoke``: quick with a 3 s recording, the
shortest that holds the burst across a boundary, and 0.5 s throughput phases) through real
Envoys, sidecars, redis-server, HAProxy and the sample app, and checks invariants, never speed:

* all four paths ran the whole recording, every request was answered, the HAProxy rules
  read the client from ``X-Forwarded-For`` like Envoy, and the table and the PNG exist;
* the memory-backend sidecar and HAProxy's fixed flavour are exact fixed windows: no
  overshoot and no false rejection against the ideal (requests placed in the second of
  their sent..answered interval; those crossing a boundary go to the side the ideal
  favours, see ``compare_harness/analysis.py``), and each client gets exactly twice the
  limit through the burst straddling a boundary;
* sync mode (two sidecars, one Redis) stays within its documented bound,
  ``(R - 1) * floor(max_overshoot * L / (R - 1))`` hits per client-window, with no false
  rejection, while Redis answers in time (the README's condition: checked through the
  sidecars' own count of failure-mode decisions);
* the sliding flavour does not admit twice the limit across the boundary: HAProxy's
  estimate (current period + previous period x the part still to come) lets through at
  most ``limit + 0.4 x limit`` in a 400 ms span that holds one period boundary; nor does
  our ``sliding_window`` (path e);
* our ``sliding_window`` and HAProxy's sliding counter agree within rounding on the same
  recording: per client and second their admitted counts differ by at most one hit (a
  request decided a few ms apart on the two paths near a step of the estimate), each
  path's verdicts are all explained by its own formula at an instant of the request's
  sent..answered interval, and HAProxy's periods started on the clock second.

A request Envoy admitted because the sidecar did not answer within its 25 ms timeout
(fail open) was never counted by a limiter: each may add one hit of overshoot, and the
checks allow exactly that many.

The fast tests check the window attribution itself on hand-made requests.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from loadtest.compare_harness.analysis import Decided, attribute, most_in_one_second
from sidecar.settings import Settings

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.haproxy, pytest.mark.redis, pytest.mark.alone]  # drives HAProxy and Envoy at full rate

PATHS = ("envoy_memory", "envoy_sync", "haproxy_fixed", "haproxy_sliding", "envoy_sliding")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
REDIS_TIMEOUT = 0.02
"""Sync sidecars wait up to 20 ms for Redis (default 5 ms), still under Envoy's 25 ms: a loaded CI
machine then rarely pushes a decision into the failure mode, where the bound does not apply."""


# ---------------------------------------------------------------- the whole tool, smoke size


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    directory = tmp_path_factory.mktemp("compare")
    outputs = {"json": directory / "compare.json", "md": directory / "compare.md", "png": directory / "compare.png"}
    argv = [sys.executable, "-m", "loadtest.compare", "--smoke", "--redis-timeout", str(REDIS_TIMEOUT)]
    for flag, path in outputs.items():
        argv += [f"--{flag}", str(path)]
    result = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=240, check=False)
    output = f"stdout:\n{result.stdout[-6000:]}\nstderr:\n{result.stderr[-3000:]}"
    assert result.returncode == 0, output
    return {
        "document": json.loads(outputs["json"].read_text()),
        "stdout": result.stdout,
        "output": output,
        **outputs,
    }


def fail_open(row: dict[str, Any]) -> int:
    """Requests Envoy admitted without the sidecar's answer during the replay."""
    return int(row["envoy"].get("failure_mode_allowed", 0))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_path_ran_and_the_outputs_exist(quick_run: dict[str, Any]) -> None:
    document, output = quick_run["document"], quick_run["output"]
    summary = document["summary"]
    requests = len(document["recording"]["requests"])
    assert list(summary) == list(PATHS), output
    assert requests > 0
    for name, row in summary.items():
        assert row["rounds"] == 1, (name, row)
        assert row["sent"] == requests and row["answered"] == requests, (name, row)
        assert row["failed"] == {}, (name, row)
        assert row["rps"] and row["rps"] > 0 and 0 < row["p50_ms"] <= row["p99_ms"], (name, row)
        assert row["admitted_pct"] and row["admitted_pct"] > 90, (name, row)
    assert {run["path"] for run in document["accuracy_runs"]} == set(PATHS)
    assert {run["path"] for run in document["throughput_runs"]} == set(PATHS)
    for command in document["haproxy"]["export_commands"]:
        assert "--fetch 'remote_address=req.hdr_ip(x-forwarded-for,-1)'" in command, command

    table = quick_run["md"].read_text()
    for row in summary.values():
        assert f"| {row['label']} |" in table, table
    assert "Reproduce: `python -m loadtest.compare --quick" in table
    assert "reproduce: python -m loadtest.compare --quick" in quick_run["stdout"]
    image = quick_run["png"].read_bytes()
    assert len(image) > 10_000 and image.startswith(PNG_SIGNATURE)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["envoy_memory", "haproxy_fixed"])
def test_exact_fixed_windows_match_the_ideal(quick_run: dict[str, Any], name: str) -> None:
    document = quick_run["document"]
    limit = document["recording"]["limit"]
    row = document["summary"][name]
    allowed = fail_open(row)
    assert row["overshoot"] <= allowed, (name, row)
    assert row["shortfall"] == 0, (name, row)
    assert row["admitted"] == row["ideal"] or allowed, (name, row)
    if not allowed:
        assert row["burst_admitted_min"] == row["burst_admitted_max"] == 2 * limit, (name, row)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sync_mode_stays_within_its_documented_bound(quick_run: dict[str, Any]) -> None:
    document = quick_run["document"]
    limit = document["recording"]["limit"]
    replicas = 2
    bound = (replicas - 1) * math.floor(Settings.sync_max_overshoot * limit / (replicas - 1))
    shutdown = document["sidecar_shutdown"]
    assert len(shutdown) == replicas, shutdown
    failure_decisions = sum(stats.get("failure_decisions", 0) for stats in shutdown.values())
    if failure_decisions:
        pytest.skip(f"Redis answered late {failure_decisions} times: the bound applies while it answers in time")
    (run,) = [run for run in document["accuracy_runs"] if run["path"] == "envoy_sync"]
    allowed = fail_open(run)
    for window in run["windows"]:
        assert window["admitted"] <= window["ideal"] + bound + allowed, window
    assert run["shortfall"] == 0, run["windows"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sliding_windows_do_not_admit_twice_the_limit_across_a_boundary(quick_run: dict[str, Any]) -> None:
    document = quick_run["document"]
    recording = document["recording"]
    limit, span = recording["limit"], recording["burst_span"]
    ceiling = math.floor(limit * (1 + 2 * span)) + 1  # one period boundary in the burst, +1 for rounding
    assert ceiling < 2 * limit
    for name in ("haproxy_sliding", "envoy_sliding"):
        row = document["summary"][name]
        assert 0 < row["burst_admitted_max"] <= ceiling + fail_open(row), (name, row)
    assert document["summary"]["haproxy_fixed"]["burst_admitted_max"] == 2 * limit


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_our_sliding_window_agrees_with_haproxys_within_rounding(quick_run: dict[str, Any]) -> None:
    document = quick_run["document"]
    figures = document["sliding_comparison"]
    assert figures is not None, "both sliding paths ran: the comparison must be there"
    (ours,) = [run for run in document["accuracy_runs"] if run["path"] == "envoy_sliding"]
    allowed = fail_open(ours)
    assert figures["max_diff_per_client_second"] <= 1 + allowed, figures
    assert figures["max_ours_vs_ideal_per_client_second"] <= 1 + allowed, figures
    assert figures["max_haproxy_vs_ideal_per_client_second"] <= 1, figures
    assert figures["max_diff_per_second"] <= document["recording"]["clients"] + allowed, figures
    for name, path in figures["paths"].items():
        unexplained = path["answered"] - path["explained_by_its_formula"]
        assert unexplained <= (allowed if name == "envoy_sliding" else 0), (name, path)
    for low, _high in figures["paths"]["haproxy_sliding"]["haproxy_phase_ms_if_haproxy"]:
        assert abs(low) <= 4, figures["paths"]["haproxy_sliding"]  # HAProxy's periods start on the clock second
    assert "| second | requests | ideal (one exact estimate, the schedule) |" in quick_run["md"].read_text()


# ---------------------------------------------------------------- window attribution (fast)

LIMIT = 3


def request(admitted: bool, low: int, high: int | None = None) -> Decided:
    """A request decided somewhere in windows ``low``..``high``."""
    return Decided(0, False, admitted, low, low if high is None else high, low, low + 0.5)


def errors(requests: list[Decided]) -> tuple[int, int]:
    windows = attribute(requests, LIMIT)
    over = short = 0
    for window, total in windows.decided.items():
        ideal = min(total, LIMIT)
        over += max(0, windows.admitted[window] - ideal)
        short += max(0, ideal - windows.admitted[window])
    return over, short


def test_an_ambiguous_request_goes_where_the_limiter_may_have_decided_it() -> None:
    # Window 0 is full (3 admitted, 1 refused); an admitted request answered just after the boundary
    # can only have been decided in window 1, whose own requests then fill it exactly.
    requests = [request(True, 0)] * 3 + [request(False, 0), request(True, 0, 1)] + [request(True, 1)] * 2
    assert errors(requests) == (0, 0)
    assert attribute(requests, LIMIT).ambiguous == 1


def test_certain_overshoot_and_shortfall_are_counted() -> None:
    assert errors([request(True, 0)] * 4 + [request(False, 0, 1)]) == (1, 0)
    assert errors([request(True, 0)] * 2 + [request(False, 0), request(False, 0, 1)]) == (0, 1)
    # Sent in window 0, answered over a second later: placed where it was sent, counted apart.
    windows = attribute([request(True, 0, 2)], LIMIT)
    assert windows.unattributable == 1 and windows.decided == {0: 1}


def test_the_recordings_first_requests_start_haproxys_periods_on_second_0() -> None:
    from loadtest.compare_harness.recording import FIRST_OFFSET, record

    recording = record(1, clients=4, limit=20, duration=4.0)
    for client in range(4):
        first = min(item.offset for item in recording.requests if item.client == client)
        assert 0.0 <= first <= FIRST_OFFSET


def test_the_sliding_path_config_changes_only_the_per_address_rule(tmp_path: Path) -> None:
    from loadtest.compare_harness.paths import sliding_config
    from sidecar.config.load import load_config

    rules = {rule.stat_key: rule for rule in load_config(sliding_config(tmp_path)).domains["demo"].rules}
    shipped = {rule.stat_key: rule for rule in load_config(REPO / "examples" / "config").domains["demo"].rules}
    assert rules.keys() == shipped.keys()
    for key, rule in rules.items():
        expected = "sliding_window" if key == "demo.remote_address" else shipped[key].algorithm.label
        assert rule.algorithm.label == expected, key
        assert rule.requests_per_unit == shipped[key].requests_per_unit


def test_most_in_one_second_uses_half_open_spans() -> None:
    assert most_in_one_second([0.0, 0.5, 0.99, 1.0, 1.5]) == 3
    assert most_in_one_second([]) == 0
