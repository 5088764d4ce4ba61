"""What a client can make large in quota mode is capped in bytes (issue 25): the answer
messages, the numbers it reports, what ``/config`` and the log show of it, and how many
streams it opens."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import structlog

from sidecar.protos.envoy.service.rate_limit_quota.v3 import rlqs_pb2
from sidecar.quota.assignments import Action, Assignment, Kind, default
from sidecar.quota.buckets import bucket_of
from sidecar.quota.registry import QuotaRegistry, QuotaSettings, StreamCapError
from sidecar.quota.reports import MAX_REPORTED_REQUESTS, UsageReport
from sidecar.quota.service import (
    MAX_ACTIONS_PER_MESSAGE,
    MAX_RESPONSE_BYTES,
    action_message,
    responses,
)
from sidecar.quota.shown import SHOWN_ID_CHARS, RateLimitedLog
from sidecar.quota.stats import QuotaStats

RULES = """
domain: q
descriptors:
  - key: user
    rate_limit: {unit: second, requests_per_unit: 5}
"""
Response = rlqs_pb2.RateLimitQuotaResponse
Usage = rlqs_pb2.RateLimitQuotaUsageReports.BucketQuotaUsage
TOKENS = Assignment(Kind.TOKEN_BUCKET, "fixed_window", None, 5, 5, 1)


def test_answers_are_cut_by_serialized_bytes() -> None:
    """1,000 buckets with ~1 KiB ids made one 1,060,000-byte message, past gRPC's 1 MiB."""
    actions = [Action(bucket_of("q", [("user", f"{index:01000}")]), default("overflow")) for index in range(1_000)]
    stats = QuotaStats()
    messages = list(responses(actions, 60, stats))
    assert all(len(message) <= MAX_RESPONSE_BYTES for message in messages)
    assert len(messages) >= 1_000 * 1_000 // MAX_RESPONSE_BYTES
    decoded = [action for message in messages for action in Response.FromString(message).bucket_action]
    assert [dict(action.bucket_id.bucket) for action in decoded] == [dict(action.bucket_id) for action in actions]
    assert stats.sent == {"allow_all": 1_000}


def test_answers_are_cut_by_count_too_and_are_what_protobuf_writes() -> None:
    actions = [Action(bucket_of("q", [("user", str(index))]), TOKENS, index % 2) for index in range(600)]
    messages = list(responses(actions, 60, QuotaStats()))
    assert [len(Response.FromString(m).bucket_action) for m in messages] == [MAX_ACTIONS_PER_MESSAGE] * 2 + [88]
    first = Response(bucket_action=[action_message(action, 60) for action in actions[:MAX_ACTIONS_PER_MESSAGE]])
    assert Response.FromString(messages[0]) == first  # map entries may come in another order
    assert len(messages[0]) == first.ByteSize()


def test_an_answer_too_large_for_any_message_is_not_sent_and_counted() -> None:
    huge = Action({"entry.0.user": "x" * MAX_RESPONSE_BYTES}, default("bad_id:missing_domain"))
    small = Action(bucket_of("q", [("user", "a")]), TOKENS)
    stats = QuotaStats()
    [message] = list(responses([huge, small], 60, stats))
    assert [dict(a.bucket_id.bucket) for a in Response.FromString(message).bucket_action] == [small.bucket_id]
    assert stats.malformed == {"answer_too_large": 1}


def test_reported_counts_are_clamped_at_the_entry() -> None:
    report = rlqs_pb2.RateLimitQuotaUsageReports(
        domain="q",
        bucket_quota_usages=[
            Usage(bucket_id=rlqs_pb2.BucketId(bucket=bucket_of("q", [("user", "a")])), num_requests_allowed=2**64 - 1),
            Usage(bucket_id=rlqs_pb2.BucketId(bucket=bucket_of("q", [("user", "b")])), num_requests_denied=7),
        ],
    )
    malformed: list[str] = []
    read = UsageReport(report.SerializeToString(), malformed.append)
    assert read.domain == "q"
    assert [(allowed, denied) for _, allowed, denied in read.usages()] == [(MAX_REPORTED_REQUESTS, 0), (0, 7)]
    assert malformed == ["count_clamped"]


def test_a_report_is_read_an_entry_at_a_time_and_as_protobuf_reads_it() -> None:
    buckets = [bucket_of("q", [("user", str(index))]) for index in range(1_000)]
    usages = [Usage(bucket_id=rlqs_pb2.BucketId(bucket=b), num_requests_allowed=i) for i, b in enumerate(buckets)]
    data = rlqs_pb2.RateLimitQuotaUsageReports(domain="q", bucket_quota_usages=usages).SerializeToString()
    read = UsageReport(data, [].append)
    entries = read.usages()
    assert next(entries) == (buckets[0], 0, 0)
    assert list(entries) == [(bucket, index, 0) for index, bucket in enumerate(buckets)][1:]


def test_a_broken_report_ends_where_it_breaks() -> None:
    good = Usage(bucket_id=rlqs_pb2.BucketId(bucket=bucket_of("q", [("user", "a")])), num_requests_allowed=1)
    data = rlqs_pb2.RateLimitQuotaUsageReports(domain="q", bucket_quota_usages=[good]).SerializeToString()
    malformed: list[str] = []
    read = UsageReport(data + b"\x12\x7f\x00", malformed.append)  # a usage cut short
    assert [bucket for bucket, _, _ in read.usages()] == [good.bucket_id.bucket]
    assert malformed == ["undecodable"]
    garbage: list[str] = []
    assert list(UsageReport(b"\xff\xff\xff not a protobuf", garbage.append).usages()) == []
    assert garbage == ["undecodable"]


def test_config_shows_a_bounded_part_of_each_id_and_of_all(h: SimpleNamespace) -> None:
    registry = QuotaRegistry(h.config_of(RULES), QuotaSettings(), clock=h.FakeClock(1000.0))
    stream = registry.open("envoy")
    long_ids = [bucket_of("q", [("user", f"{index:04000}")]) for index in range(1_000)]
    registry.report(stream, "q", iter([(bucket, 1, 0) for bucket in long_ids]))
    shown = registry.describe()
    for bucket in shown["buckets"]:  # type: ignore[attr-defined]
        assert sum(len(name) + len(value) for name, value in bucket["bucket_id"].items()) <= SHOWN_ID_CHARS + 16
    assert len(json.dumps(shown)) < 300_000  # the ids alone are 4 MB
    assert shown["buckets_not_shown"] == 1_000 - len(shown["buckets"])  # type: ignore[arg-type]


def test_streams_past_the_cap_are_refused_naming_it(h: SimpleNamespace) -> None:
    registry = QuotaRegistry(h.config_of(RULES), QuotaSettings(max_streams=2), clock=h.FakeClock(1000.0))
    first = registry.open("a")
    registry.open("b")
    with pytest.raises(StreamCapError, match="--quota-max-streams"):
        registry.open("c")
    assert registry.stats.streams_ended == {"max_streams": 1}
    registry.close(first)
    registry.finishing += 1  # ended for not reading, its gRPC call not over yet
    with pytest.raises(StreamCapError):
        registry.open("c")
    registry.call_finished()
    registry.open("c")


def test_per_stream_log_lines_are_limited() -> None:
    logs = RateLimitedLog(interval=60.0, burst=5)
    with structlog.testing.capture_logs() as lines:
        logged = [logs.limited("quota_stream_opened", 1000.0 + index * 0.01, stream=index) for index in range(1_000)]
        logs.limited("quota_stream_opened", 1060.0, stream=1_000)
    assert sum(logged) == 5 and len(lines) == 6
    assert lines[-1]["suppressed_before"] == 995
