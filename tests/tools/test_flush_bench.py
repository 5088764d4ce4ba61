"""``python -m loadtest.flush_bench`` runs against a real redis-server and prints both ways of flushing."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.redis]

REPO = Path(__file__).resolve().parents[2]


def test_flush_bench_prints_both_ways_and_their_ratio() -> None:
    command = [sys.executable, "-m", "loadtest.flush_bench", "--counters", "5", "--flushes", "3", "--rounds", "2"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    for way in ("batch", "per-counter"):
        assert re.search(rf"{way}\s+client CPU\s+\d+\.\d+ ms per flush", done.stdout), done.stdout
    assert re.search(r"per-counter / batch client CPU: \d+\.\dx", done.stdout), done.stdout
