"""``RateLimitResponse`` written straight to protobuf wire bytes.

Building a response as protobuf messages (one ``DescriptorStatus`` per descriptor, a
copied ``RateLimit`` and ``Duration`` in each) and serializing it costs about four
times as much as joining a few cached byte strings; on a loaded sidecar that is the
largest single piece of our own request-path work. The fields written here are all
the sidecar ever sets, encoded exactly as protobuf does (fields in number order,
proto3 defaults left out), so ``SerializeToString`` of the equivalent message gives
the same bytes: the tests hold the two to that.

Field numbers (``envoy/service/ratelimit/v3/rls.proto``): ``RateLimitResponse``
``overall_code = 1``, ``statuses = 2``, ``response_headers_to_add = 3``;
``DescriptorStatus`` ``code = 1``, ``current_limit = 2``, ``limit_remaining = 3``,
``duration_until_reset = 4``; ``HeaderValue`` ``key = 1``, ``value = 2``;
``google.protobuf.Duration`` ``seconds = 1``.
"""

from __future__ import annotations

from collections.abc import Iterable

from sidecar.config.model import RateLimitRule
from sidecar.protos.envoy.service.ratelimit.v3 import rls_pb2

OK = rls_pb2.RateLimitResponse.OK
OVER_LIMIT = rls_pb2.RateLimitResponse.OVER_LIMIT

SMALL_VARINTS = 1 << 14
"""Varints below this are looked up, not computed: counts, remainders and resets nearly always are."""


def encode_varint(value: int) -> bytes:
    """An integer as a protobuf base-128 varint (a negative one as its 64-bit two's complement, as int64)."""
    value &= 0xFFFF_FFFF_FFFF_FFFF
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_VARINTS = [encode_varint(value) for value in range(SMALL_VARINTS)]


def varint(value: int) -> bytes:
    """:func:`encode_varint`, from a table for small values."""
    return _VARINTS[value] if 0 <= value < SMALL_VARINTS else encode_varint(value)


def length_delimited(tag: bytes, payload: bytes) -> bytes:
    """A message or string field: tag, length, payload."""
    return tag + varint(len(payload)) + payload


OVERALL_OK = b"\x08" + varint(OK)
OVERALL_OVER_LIMIT = b"\x08" + varint(OVER_LIMIT)
STATUS_TAG = b"\x12"
CODE_OK = b"\x08" + varint(OK)
CODE_OVER_LIMIT = b"\x08" + varint(OVER_LIMIT)
REMAINING_TAG = b"\x18"
RESET_TAG = b"\x22"
HEADER_TAG = b"\x1a"
PLAIN_OK_STATUS = length_delimited(STATUS_TAG, CODE_OK)
"""The status of a descriptor no rule matched: ``code: OK`` and nothing else."""


def overall(admitted: bool) -> bytes:
    """The response's ``overall_code`` field."""
    return OVERALL_OK if admitted else OVERALL_OVER_LIMIT


def limited_status(code: bytes, limit_field: bytes, remaining: int, reset: int) -> bytes:
    """A limited descriptor's status; ``limit_field`` from :meth:`StatusParts.limit`."""
    body = code + limit_field
    if remaining:
        body += REMAINING_TAG + varint(remaining)
    # The Duration is always present (envoyproxy/ratelimit sets it), empty when it is 0 s.
    body += RESET_TAG + (b"\x02\x08" + _VARINTS[reset] if 0 < reset < 128 else _reset_payload(reset))
    return STATUS_TAG + varint(len(body)) + body


def _reset_payload(seconds: int) -> bytes:
    """Length and body of a ``Duration`` of whole ``seconds`` (``b"\\x00"`` for zero)."""
    return length_delimited(b"", b"\x08" + varint(seconds) if seconds else b"")


UNLIMITED_REMAINING = 2**32 - 1
"""What envoyproxy/ratelimit reports as ``limit_remaining`` for unlimited rules."""
UNLIMITED_STATUS = length_delimited(STATUS_TAG, CODE_OK + REMAINING_TAG + varint(UNLIMITED_REMAINING))
"""An unlimited rule's status: OK, with ``limit_remaining`` at its maximum."""


def headers_fields(headers: Iterable[tuple[str, str]]) -> bytes:
    """``response_headers_to_add`` fields for ``(name, value)`` pairs."""
    return b"".join(
        length_delimited(
            HEADER_TAG,
            (length_delimited(b"\x0a", name.encode()) if name else b"")
            + (length_delimited(b"\x12", value.encode()) if value else b""),
        )
        for name, value in headers
    )


class StatusParts:
    """The ``current_limit`` field of each rule, encoded once and reused.

    Keyed by what the field shows (the rule's identity, limit and name), so a reload
    that keeps a rule keeps its entry; bounded, since request overrides bring their
    own limits.
    """

    MAX_ENTRIES = 10_000

    def __init__(self) -> None:
        self._limits: dict[tuple[str, int, str | None], bytes] = {}

    def limit(self, rule: RateLimitRule) -> bytes:
        """The ``current_limit`` field of a status reporting ``rule``."""
        key = (rule.counter_id, rule.requests_per_unit, rule.name)
        field = self._limits.get(key)
        if field is None:
            if len(self._limits) >= self.MAX_ENTRIES:
                self._limits.clear()
            message = rls_pb2.RateLimitResponse.RateLimit(
                name=rule.name or "", requests_per_unit=rule.requests_per_unit, unit=rule.reported_unit
            )
            field = self._limits[key] = length_delimited(b"\x12", message.SerializeToString())
        return field
