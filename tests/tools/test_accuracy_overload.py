"""The overload scenarios' figures (``loadtest/accuracy_harness/overload.py``), on recorded
calls made by the memory backend itself: fast, no process started. A plain window at 10x
admits its whole budget in one slice; ``overload: suppress`` spreads it, and neither refuses
anything during the calm phase."""

from __future__ import annotations

from loadtest.accuracy_harness import overload
from loadtest.accuracy_harness.analysis import OK, OVER_LIMIT, Calls
from loadtest.accuracy_harness.scenarios import config_yaml
from sidecar.limiter.memory import MemoryLimiter
from sidecar.limiter.protocol import Check

BASE = 1_800_000_000.0


def recorded(name: str) -> tuple[Calls, overload.Scenario]:
    """Every call of the scenario's schedule, decided by one memory backend, answered at once."""
    scenario = {item.name: item for item in overload.overload_scenarios(quick=True)}[name]
    limiter = MemoryLimiter(suppression_seed=1)
    check = Check(("k",), 1, scenario.limit, 1, suppress=bool(scenario.overload))
    calls = Calls()
    for offsets, _ in scenario.schedules(1, seed=0):
        for offset in offsets:
            moment = BASE + offset
            admitted = limiter.check_now([check], moment).admitted
            calls.replica.append(0)
            calls.value.append(0)
            calls.scheduled.append(moment)
            calls.send.append(moment)
            calls.recv.append(moment)
            calls.code.append(OK if admitted else OVER_LIMIT)
    return calls, scenario


def test_plain_windows_admit_in_one_slice_and_suppression_spreads_it() -> None:
    plain = overload.figures(*recorded("plain_10x"), BASE)
    spread = overload.figures(*recorded("suppress_10x"), BASE)
    assert plain["spread_cv"] == 3.0 and plain["admitted_max"] == 100
    assert spread["spread_cv"] < 0.5 and spread["admitted_max"] <= 100
    assert spread["admitted_mean_pct"] >= 85
    assert plain["refused_within"] == spread["refused_within"] == 0 and spread["calm_calls"] == 160
    assert spread["settle_s"] is not None and spread["settle_s"] <= 0.2
    assert plain["settle_s"] is None


def test_the_rule_under_test_carries_the_option() -> None:
    _, scenario = recorded("suppress_3x")
    assert "overload: suppress" in config_yaml(scenario)
    _, plain = recorded("plain_3x")
    assert "overload" not in config_yaml(plain)


def test_the_table_puts_both_side_by_side() -> None:
    rows = []
    for name in ("plain_3x", "suppress_3x"):
        calls, scenario = recorded(name)
        rows.append(
            {"status": "ok", "mode": "local", "replicas": 1, "overload": overload.figures(calls, scenario, BASE)}
        )
    text = overload.table(rows)
    lines = text.splitlines()
    assert len(lines) == 4 and "| refuse |" in lines[2] and "| suppress |" in lines[3]
    assert lines[2].endswith("| - |")  # a plain window has no p to settle
