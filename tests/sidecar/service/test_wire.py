"""The hand-written response encoding gives exactly protobuf's bytes."""

from __future__ import annotations

from google.protobuf.duration_pb2 import Duration
from hypothesis import given
from hypothesis import strategies as st

from sidecar.config.model import RateLimitRule
from sidecar.limiter.windows import Unit
from sidecar.protos.envoy.service.ratelimit.v3 import rls_pb2
from sidecar.service.metadata import dynamic_metadata_field
from sidecar.service.wire import (
    CODE_OK,
    CODE_OVER_LIMIT,
    OK,
    OVER_LIMIT,
    PLAIN_OK_STATUS,
    SMALL_VARINTS,
    UNLIMITED_REMAINING,
    UNLIMITED_STATUS,
    StatusParts,
    encode_varint,
    headers_fields,
    limited_status,
    overall,
    varint,
)

Response = rls_pb2.RateLimitResponse
UINT32 = st.integers(min_value=0, max_value=2**32 - 1)
HEADER_TEXT = st.text(max_size=40)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
METADATA = st.none() | st.dictionaries(st.text(max_size=8), JSON_VALUES, max_size=4)


def rule(name: str | None = "per_user", requests_per_unit: int = 20, unit: Unit = Unit.SECOND) -> RateLimitRule:
    return RateLimitRule(
        domain="svc",
        requests_per_unit=requests_per_unit,
        unit=unit,
        unlimited=False,
        name=name,
        replaces=frozenset(),
        shadow_mode=False,
        quota_mode=False,
        detailed_metric=False,
        stat_key="svc.user",
        counter_id=f"svc\0user\0{name}\0{requests_per_unit}\0{unit.seconds}",  # as real ids, the window in it
        source="test.yaml:1",
    )


@given(st.integers(min_value=-(2**63), max_value=2**64 - 1))
def test_varints_decode_to_their_value(value):
    """The table and the loop agree, and a varint reads back as its value (as an int64 field)."""
    assert varint(value) == encode_varint(value)
    assert Duration.FromString(b"\x08" + varint(value)).seconds == (value if value < 2**63 else value - 2**64)


def test_the_varint_table_ends_where_the_loop_takes_over():
    assert varint(SMALL_VARINTS - 1) == b"\xff\x7f"
    assert varint(SMALL_VARINTS) == b"\x80\x80\x01"


@given(
    admitted=st.booleans(),
    statuses=st.lists(
        st.one_of(
            st.just("plain"),
            st.just("unlimited"),
            st.tuples(
                st.booleans(),
                st.one_of(st.none(), st.text(max_size=30)),
                UINT32,
                st.sampled_from(list(Unit)),
                UINT32,
                st.integers(min_value=-(10**9), max_value=10**9),
            ),
        ),
        max_size=6,
    ),
    headers=st.lists(st.tuples(HEADER_TEXT, HEADER_TEXT), max_size=4),
    metadata=METADATA,
)
def test_responses_are_byte_for_byte_what_protobuf_writes(admitted, statuses, headers, metadata):
    parts = StatusParts()
    expected = Response(overall_code=OK if admitted else OVER_LIMIT)
    written = [overall(admitted)]
    for status in statuses:
        if status == "plain":
            expected.statuses.add(code=OK)
            written.append(PLAIN_OK_STATUS)
        elif status == "unlimited":
            expected.statuses.add(code=OK, limit_remaining=UNLIMITED_REMAINING)
            written.append(UNLIMITED_STATUS)
        else:
            over, name, per_unit, unit, remaining, reset = status
            limited = rule(name, per_unit, unit)
            expected.statuses.add(
                code=OVER_LIMIT if over else OK,
                current_limit=Response.RateLimit(name=name or "", requests_per_unit=per_unit, unit=unit),
                limit_remaining=remaining,
                duration_until_reset=Duration(seconds=reset),
            )
            code = CODE_OVER_LIMIT if over else CODE_OK
            written.append(limited_status(code, parts.limit(limited), remaining, reset))
    for name, value in headers:
        expected.response_headers_to_add.add(key=name, value=value)
    written.append(headers_fields(headers))
    if metadata is not None:  # dynamic_metadata (--response-dynamic-metadata): a Struct, map keys sorted
        expected.dynamic_metadata.update(metadata)
        written.append(dynamic_metadata_field(metadata))
    assert b"".join(written) == expected.SerializeToString(deterministic=True)
    assert Response.FromString(b"".join(written)) == expected


def test_a_zero_reset_is_an_empty_duration_that_is_still_present():
    response = Response.FromString(overall(True) + limited_status(CODE_OK, StatusParts().limit(rule()), 0, 0))
    status = response.statuses[0]
    assert status.HasField("duration_until_reset")
    assert status.duration_until_reset.seconds == 0
    assert status.limit_remaining == 0


def test_limit_fields_are_cached_and_the_cache_is_bounded():
    parts = StatusParts()
    first = parts.limit(rule())
    assert parts.limit(rule()) is first
    for n in range(StatusParts.MAX_ENTRIES + 5):
        parts.limit(rule(requests_per_unit=n + 1))
    assert len(parts._limits) <= StatusParts.MAX_ENTRIES
