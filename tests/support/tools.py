"""Run a load tool of ``loadtest/`` as its users do, ``python -m loadtest.<name> ARGS``, from the checkout."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_tool(name: str, argv: Sequence[str], timeout: float) -> tuple[subprocess.CompletedProcess[str], str]:
    """The finished run (never raises on a non-zero exit) and a text of its output for
    assertion messages (stdout whole, the tail of stderr)."""
    result = subprocess.run(
        [sys.executable, "-m", f"loadtest.{name}", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    return result, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr[-3000:]}"
