"""``python -m loadtest.reliability``: the report runs areas as real processes and prints one table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_report_runs_an_area_and_prints_the_table(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "loadtest.reliability",
            "--quick",
            "--areas",
            "security",
            "--json",
            str(tmp_path / "r.json"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "| area | scenario | load held | bad inputs | hits lost | result | notes |" in result.stdout
    assert "| security | mutual TLS on gRPC: who gets in |" in result.stdout
    assert "reproduce: python -m loadtest.reliability --quick --areas security" in result.stdout
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert {row["area"] for row in rows} == {"security"} and all(row["ok"] for row in rows)


def test_unknown_areas_are_refused_with_one_line() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "loadtest.reliability", "--areas", "nope"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert "unknown area(s): nope" in result.stderr


def test_the_sizes_reach_every_area_smoke_implying_quick(tmp_path: Path) -> None:
    from loadtest.reliability import build_context, parse_arguments
    from loadtest.reliability_harness import Context, Row
    from loadtest.reliability_harness.support import main

    sizes = {
        flags: build_context(parse_arguments(list(flags)), tmp_path).size for flags in [(), ("--quick",), ("--smoke",)]
    }
    assert sizes == {(): "full", ("--quick",): "quick", ("--smoke",): "smoke"}
    assert build_context(parse_arguments(["--smoke"]), tmp_path).quick is True

    seen: list[Context] = []

    def area(context: Context) -> list[Row]:
        seen.append(context)
        return []

    for flags in ([], ["--full"], ["--smoke"]):
        assert main(area, [*flags, "--directory", str(tmp_path)]) == 0
    assert [context.size for context in seen] == ["quick", "full", "smoke"]
    assert all(context.quick for context in seen if context.size != "full")
