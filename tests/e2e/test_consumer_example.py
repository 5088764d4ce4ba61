"""examples/consumer runs: replicas of a service share a provider's budget through two sync-mode sidecars.

``run.py`` starts redis-server, two sidecars, the provider and the consumer service (4
processes x 10 callers for 5 s, ``max_wait`` 1 s) with the stack's launchers and checks,
from what the provider and Redis saw: no second past the limit plus sync mode's bound, no
caller waiting past ``max_wait``, Redis's count equal to the hits admitted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sidecar.consumer import ANSWER_SLACK

pytestmark = [pytest.mark.slow, pytest.mark.redis, pytest.mark.alone]  # 40 callers, per-second counts, 0.1 s of slack

REPO = Path(__file__).resolve().parents[2]


def test_the_provider_never_sees_more_than_the_shared_budget() -> None:
    # As the README runs it: a module from the repository root, no sys.path edits.
    done = subprocess.run(
        [sys.executable, "-m", "examples.consumer.run"],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        cwd=REPO,
    )
    assert done.stdout, done.stderr[-3000:]
    result = json.loads(done.stdout)
    print(json.dumps(result))  # the figures the README and docs/consumer.md quote (pytest -s)
    assert result["problems"] == [], result
    assert done.returncode == 0
    limit, bound = result["limit"], result["bound"]
    assert max(result["provider_per_grant_second"]) <= limit + bound
    assert sum(result["provider_per_grant_second"]) == sum(result["provider_per_second"])  # every call stamped
    # The whole budget is used: Redis's full windows hold the limit (the provider sees less in
    # a second when a slot was admitted after its caller had left: `orphaned`).
    windows = result["redis_per_window"][1:-1]
    assert len(windows) >= 3 and all(limit <= hits <= limit + bound for hits in windows), windows
    consumer = result["consumer"]
    assert consumer["longest_wait"] <= result["max_wait"] + ANSWER_SLACK + 0.1  # 0.1: timers on a loaded machine
    assert consumer["failures"] > 0, "40 callers were meant to want more than 20 a second"
    assert consumer["granted"] == sum(result["provider_per_second"]) + consumer["orphaned"]
    # Exact unless an ask was cut by its gRPC deadline: then Redis may hold it or not.
    assert consumer["granted"] <= result["redis_hits"] <= consumer["granted"] + consumer["unanswered"]
