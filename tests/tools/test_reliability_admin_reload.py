"""The ``hardening-admin`` reliability area (issue 21, defects 2, 4 and 7) in its smoke size.

Latency figures are the report's business on a noisy 2-core machine; this checks the
bounds that do not depend on timing: ``/metrics`` within the byte cap after the flood,
every non-reading client dropped, the connection past the cap refused, the reloads done.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest.reliability_harness import Context, hardening_admin
from sidecar.metrics import MAX_RULE_SERIES_BYTES


@pytest.mark.slow
def test_the_admin_and_reload_attacks_are_bounded(tmp_path: Path) -> None:
    flood, slow, reload = hardening_admin.run(Context(tmp_path, quick=True, smoke=True))
    assert flood.figures, flood.notes
    assert flood.figures["metrics_bytes"] <= MAX_RULE_SERIES_BYTES + 256 * 1024
    assert slow.figures.get("dropped") == hardening_admin.SLOW_READERS, slow.notes
    assert "got 503" in slow.notes
    assert reload.figures and reload.load, reload.notes
