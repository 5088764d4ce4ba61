"""The ``hardening-input`` reliability area (issue 21, defects 8 to 11) in its smoke size.

The smoke size starts ``serve`` for two of the bad Redis URLs and one float setting: every URL
and every float setting get a real ``serve`` process in tests/sidecar (test_startup_errors.py,
test_settings_finite.py); the quick and full sizes try them all here too.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest import reliability
from loadtest.reliability_harness import Context, hardening_input


def test_the_area_is_registered() -> None:
    assert reliability.AREAS["hardening-input"] == hardening_input.__name__


@pytest.mark.slow
@pytest.mark.redis
def test_every_input_attack_holds(tmp_path: Path) -> None:
    corrupt, urls, huge, numbers = hardening_input.run(Context(tmp_path, quick=True, smoke=True))
    for row in (corrupt, urls, huge, numbers):
        assert row.ok, f"{row.scenario}: {row.notes}"
    assert max(value for name, value in corrupt.figures.items() if name.startswith("admitted_")) <= 10
    assert urls.figures == {"refused": len(hardening_input.SMOKE_URLS), "leaks": 0}
    assert huge.figures["reload_added_mib"] < 40
    assert numbers.figures["refused"] == numbers.inputs > 0
