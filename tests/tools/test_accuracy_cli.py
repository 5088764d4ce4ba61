"""``python -m loadtest.accuracy``'s sizes: ``--smoke`` (the tests') is ``--quick`` with fewer windows."""

from __future__ import annotations

import argparse

from loadtest.accuracy import SMOKE_WINDOWS, build_parser, fill_defaults
from loadtest.accuracy_harness.scenarios import catalogue


def parsed(*flags: str) -> argparse.Namespace:
    arguments = build_parser().parse_args(list(flags))
    fill_defaults(arguments)
    return arguments


def test_smoke_is_quick_with_fewer_windows_unless_they_are_given() -> None:
    smoke = parsed("--smoke")
    assert smoke.quick is True and smoke.windows == SMOKE_WINDOWS and smoke.throughput_rounds == 1
    assert parsed("--smoke", "--windows", "4").windows == 4
    quick, full = parsed("--quick"), parsed()
    assert quick.windows is None and quick.throughput_rounds == 1
    assert full.quick is False and full.windows is None and full.throughput_rounds == 3


def test_the_smoke_windows_shorten_the_steady_scenarios_only() -> None:
    quick, smoke = catalogue(True), catalogue(True, windows=SMOKE_WINDOWS)
    for name in ("balanced_5x", "low_limit", "sliding_steady"):
        assert smoke[name].duration == SMOKE_WINDOWS < quick[name].duration, name
    for name in ("sliding_boundary", "token_bucket", "long_window"):
        assert smoke[name].duration == quick[name].duration, name
