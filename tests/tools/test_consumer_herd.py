"""``python -m loadtest.consumer_herd``: one short real run against a real sidecar.

Nothing about speed is asserted: only that every caller of the herd is accounted for
(admitted, refused or an error), that no window was given more than its limit, and that
the figures the docs quote are printed.
"""

from __future__ import annotations

import re

import pytest

from loadtest.consumer_herd import main

pytestmark = pytest.mark.slow


def test_a_short_herd_reports_every_caller(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--callers", "60", "--max-wait", "0.5", "--limit", "5", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    figures = dict(re.findall(r"(\w+)=([\d.]+)", out.splitlines()[-1]))
    assert int(figures["admitted"]) + int(figures["refused"]) + int(figures["errors"]) == 60
    assert 1 <= int(figures["admitted"]) <= 5 * 2  # at most the windows a 0.5 s herd can span
    assert int(figures["errors"]) == 0
    assert {"max_wait_s", "late", "late_past_slack", "asks", "out_of_turn", "unanswered"} <= figures.keys()
