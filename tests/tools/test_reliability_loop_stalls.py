"""The ``loop-stalls`` reliability area (issue 25) in its smoke size, and its pieces.

Latency, stall and memory figures are the report's business (printed as each row's
verdict); this checks what does not depend on timing: every row is there and measured,
the probe got an answer for every call, the figures parse, the sidecar still serves
after each input, and the inputs are what the rows say.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from loadtest.reliability import AREAS, table
from loadtest.reliability_harness import Context, Row, loop_stalls
from loadtest.reliability_harness.quota_streams import MESSAGE_BYTES, bucket_reports, tiny_ids_reports
from loadtest.reliability_harness.stall_measure import goals_missed, problems, verdict
from loadtest.reliability_harness.support import main
from sidecar.protos.envoy.service.rate_limit_quota.v3 import rlqs_pb2

MEASURED = (
    "quiet_p50_ms",
    "quiet_p99_ms",
    "quiet_max_ms",
    "p50_ms",
    "p99_ms",
    "max_ms",
    "quiet_stall_ms",
    "stall_ms",
    "rss_before_mib",
    "rss_peak_mib",
    "rss_after_mib",
)


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.timeout(400)
def test_every_row_is_measured_and_the_sidecar_serves_after_each_input(tmp_path: Path) -> None:
    rows = loop_stalls.run(Context(tmp_path, quick=True, smoke=True))
    # the tests run the default --quota-process only; quota rows are named with it
    assert [row.scenario.removesuffix(" [worker]") for row in rows] == list(loop_stalls.ROWS)
    for row in rows:
        figures = row.figures
        assert figures, f"{row.scenario}: {row.notes}"
        assert figures["quiet_calls"] > 0 and figures["calls"] > 0, row.notes
        assert figures["quiet_errors"] == 0 and figures["errors"] == 0, row.notes
        for name in MEASURED:
            assert math.isfinite(figures[name]) and figures[name] >= 0, (name, row.notes)
        assert figures["rss_before_mib"] > 0 and figures["rss_peak_mib"] >= figures["rss_before_mib"]
        assert figures["serving_after"] == 1, row.notes
        assert row.ok is True, row.notes
    by_name = {row.scenario.split(":")[0]: row for row in rows}
    assert by_name["JSON body"].figures["posts"] > 0
    assert by_name["/config reader"].figures["config_reads"] > 0
    smoke = loop_stalls.SMOKE
    for name in ("outage", "reload"):
        assert by_name[name].figures["live_buckets"] == smoke.buckets, by_name[name].notes
    assert by_name["/config reader"].figures["live_buckets"] == smoke.config_buckets
    assert "| loop stalls | big report" in table(rows)


def test_the_area_is_in_the_report() -> None:
    assert AREAS["loop-stalls"] == loop_stalls.__name__


def test_the_big_report_holds_every_id_in_messages_under_the_cap() -> None:
    reports = tiny_ids_reports("q", 100_000)
    assert all(len(report) < MESSAGE_BYTES for report in reports)
    ids = [
        tuple(usage.bucket_id.bucket.items())
        for report in reports
        for usage in rlqs_pb2.RateLimitQuotaUsageReports.FromString(report).bucket_quota_usages
    ]
    assert len(ids) == len(set(ids)) == 100_000


def test_live_buckets_are_valid_ids_of_the_limited_rule_with_values_of_the_size_asked() -> None:
    reports = bucket_reports("q", "user", 1_500, value_bytes=1000)
    assert len(reports) > 1 and all(len(report) < MESSAGE_BYTES for report in reports)
    usages = [u for r in reports for u in rlqs_pb2.RateLimitQuotaUsageReports.FromString(r).bucket_quota_usages]
    assert len(usages) == 1_500
    first = dict(usages[0].bucket_id.bucket)
    assert first.keys() == {"domain", "entry.0.user"} and first["domain"] == "q"
    assert len(first["entry.0.user"]) == 1000


FIGURES_OF_A_ROW = {
    **dict.fromkeys(MEASURED, 1.0),
    **dict.fromkeys(("quiet_calls", "scheduled", "quiet_scheduled", "input_seconds"), 1.0),
    "other_cores_quiet": 0.0,
    "other_cores_input": 0.0,
}


def test_the_verdict_names_each_goal_missed() -> None:
    calm = {
        "errors": 0.0,
        "quiet_errors": 0.0,
        "calls": 400.0,
        "quiet_p99_ms": 2.0,
        "p99_ms": 3.9,
        "stall_ms": 20.0,
        "rss_before_mib": 60.0,
        "rss_after_mib": 65.9,
        "serving_after": 1.0,
    }
    assert goals_missed(calm) == problems(calm) == []
    stormy = {**calm, "errors": 2.0, "p99_ms": 4.1, "stall_ms": math.nan, "rss_after_mib": 66.1, "serving_after": 0.0}
    assert [text.split()[0] for text in goals_missed(stormy)] == ["p99", "stall", "RSS"]
    assert [text.split()[0] for text in problems(stormy)] == ["2", "not"], "what must hold fails the row"
    row = verdict("loop stalls", "x", {**FIGURES_OF_A_ROW, **stormy}, "input")
    assert row.ok is False and len(row.goals_missed) == 3


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_floor_variant_probes_a_sidecar_the_input_never_reaches(tmp_path: Path) -> None:
    """``--floor``: the reload goes to one sidecar, the probe calls another, which never reloads."""
    sizes = loop_stalls.SMOKE
    context = Context(tmp_path, quick=True, smoke=True)
    row = loop_stalls.run_row(context, sizes, "reload [floor]", loop_stalls.reload, floor=True)
    assert row.ok is True and row.figures["live_buckets"] == sizes.buckets, row.notes
    assert "config_reloaded" in (tmp_path / "stalls-reload.log").read_text()
    assert "config_reloaded" not in (tmp_path / "stalls-probed.log").read_text()


def test_an_areas_own_flags_reach_its_context(tmp_path: Path) -> None:
    seen: list[Context] = []

    def run(context: Context) -> list[Row]:
        seen.append(context)
        return []

    flags = {loop_stalls.FLOOR: "help"}
    assert main(run, ["--smoke", "--directory", str(tmp_path), "--floor"], flags=flags) == 0
    assert main(run, ["--smoke", "--directory", str(tmp_path)], flags=flags) == 0
    assert [context.flags for context in seen] == [frozenset({"floor"}), frozenset()]
