"""loadtest.http_stacks and loadtest.http_listeners' /config and --json-flood modes, run small."""

from __future__ import annotations

import re

import pytest

from loadtest import http_listeners, http_stacks


def test_http_stacks_prints_cpu_and_import_cost_per_stack(capsys: pytest.CaptureFixture[str]) -> None:
    assert http_stacks.main(["--requests", "50", "--rounds", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "python -m loadtest.http_stacks --requests 50 --rounds 1"
    h11_row = next(line for line in lines if line.startswith("h11"))
    assert re.search(r"CPU\s+\d+ us/request .* import: \+\d+\.\d MiB", h11_row), h11_row


def test_config_mode_reads_a_capped_config_while_timing_the_loop(capsys: pytest.CaptureFixture[str]) -> None:
    assert http_listeners.main(["--config-rules", "200", "--seconds", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "python -m loadtest.http_listeners --config-rules 200 --seconds 0.5" in out
    assert re.search(r"GET /config: [\d,]+ bytes, \d+ GETs, p50 \d+ ms; event loop late by p99", out), out


def test_json_flood_mode_times_the_refusal_of_21000_descriptors(capsys: pytest.CaptureFixture[str]) -> None:
    assert http_listeners.main(["--json-flood"]) == 0
    out = capsys.readouterr().out
    assert "63,032-byte body: 400 'descriptors: more than 64 descriptors'; median" in out
