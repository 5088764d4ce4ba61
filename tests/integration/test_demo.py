"""The README's demo command runs its scripted tour against a real sidecar and stops cleanly."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_demo_tour_shows_limits_biting_and_stops() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "demo.py"), "--once"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    # 20/second per address: 20 of 25 unless the burst happened to straddle a second boundary.
    per_address = re.search(r"25 requests -> (\d+) admitted", out)
    assert per_address is not None and 20 <= int(per_address.group(1)) <= 25, out
    assert "12 requests -> 10 admitted, 2 rejected, first 429 at request 11" in out
    assert "OVER_LIMIT limit=10/minute name=per_api_key remaining=0" in out
    assert "[0] OK unlimited" in out
    assert "Demo stopped." in out
    assert "sidecar_stopped" in result.stderr
