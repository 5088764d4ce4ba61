"""Reading an RLQS usage report a chunk at a time, straight from its wire bytes.

A report is up to gRPC's 1 MiB receive cap: 20,000 legitimate usages, or ~69,000 short
hostile ids. Decoding it whole with protobuf (``FromString``, one C call that holds the
GIL) takes 60 ms for 20,000 usages and ~200 ms for 69,000 on the event loop, so the
handler is given the raw bytes and :class:`UsageReport` walks the message's top-level
fields itself: each ``bucket_quota_usages`` entry is decoded (``BucketQuotaUsage``, a
few microseconds) only when the registry takes it, a chunk per loop turn.

``num_requests_allowed``/``denied`` are uint64 from the client; each is clamped here to
:data:`MAX_REPORTED_REQUESTS` before it reaches the stats, the leases or Redis.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from google.protobuf.message import DecodeError

from sidecar.protos.envoy.service.rate_limit_quota.v3 import rlqs_pb2

MAX_REPORTED_REQUESTS = 2**32 - 1
"""A usage's counts are clamped to this: about a million requests a second on one bucket
for over an hour, more than one Envoy serves between two reports (5 s by default), and
small enough that sums over years of reports stay exact in 64-bit arithmetic."""
DOMAIN_FIELD = 1
USAGES_FIELD = 2
VARINT, FIXED64, LENGTH, FIXED32 = 0, 1, 2, 5

Usage = rlqs_pb2.RateLimitQuotaUsageReports.BucketQuotaUsage


class ReportDecodeError(ValueError):
    """The bytes are not a ``RateLimitQuotaUsageReports`` (from this point on)."""


def read_varint(data: bytes, at: int) -> tuple[int, int]:
    """``(value, next offset)`` of the varint at ``at``."""
    value = shift = 0
    while at < len(data) and shift < 64:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7
    raise ReportDecodeError("truncated or overlong varint")


def fields(data: bytes) -> Iterator[tuple[int, int, int, int]]:
    """``(field number, wire type, start, end)`` of each top-level field, in order; the
    value of a length-delimited field is ``data[start:end]``."""
    at = 0
    while at < len(data):
        tag, at = read_varint(data, at)
        number, wire = tag >> 3, tag & 7
        if number == 0:
            raise ReportDecodeError("field number 0")
        if wire == VARINT:
            _, end = read_varint(data, at)
            start = at
        elif wire == LENGTH:
            length, start = read_varint(data, at)
            end = start + length
        elif wire in (FIXED64, FIXED32):
            start, end = at, at + (8 if wire == FIXED64 else 4)
        else:
            raise ReportDecodeError(f"wire type {wire}")
        if end > len(data):
            raise ReportDecodeError("truncated field")
        yield number, wire, start, end
        at = end


def first_domain(data: bytes) -> str:
    """The ``domain`` when it leads the message (every protobuf serializer writes fields
    in number order), else "": it only labels the stream in ``/config``."""
    try:
        for number, wire, start, end in fields(data):
            if number == DOMAIN_FIELD and wire == LENGTH:
                return data[start:end].decode("utf-8", "replace")
            return ""
    except ReportDecodeError:
        return ""
    return ""


class UsageReport:
    """One report's raw bytes, read lazily: :meth:`usages` decodes entries as taken."""

    def __init__(self, data: bytes, malformed: Callable[[str], None]) -> None:
        self.data = data
        self.malformed = malformed
        """Called with a kind (``undecodable``, ``undecodable_usage``, ``count_clamped``) to count."""
        self.domain = first_domain(data)

    def usages(self) -> Iterator[tuple[dict[str, str], int, int]]:
        """``(bucket id, allowed, denied)`` per entry, counts clamped. Entries that do not
        decode are counted and skipped; a broken message ends the report where it breaks
        (the entries before were applied, as a stream of small reports would have been)."""
        data = self.data
        try:
            for number, wire, start, end in fields(data):
                if number != USAGES_FIELD or wire != LENGTH:
                    continue
                try:
                    usage = Usage.FromString(data[start:end])
                except DecodeError:
                    self.malformed("undecodable_usage")
                    continue
                yield dict(usage.bucket_id.bucket), *self._clamped(usage)
        except ReportDecodeError:
            self.malformed("undecodable")

    def _clamped(self, usage: Any) -> tuple[int, int]:
        allowed, denied = usage.num_requests_allowed, usage.num_requests_denied
        if allowed > MAX_REPORTED_REQUESTS or denied > MAX_REPORTED_REQUESTS:
            self.malformed("count_clamped")
            return min(allowed, MAX_REPORTED_REQUESTS), min(denied, MAX_REPORTED_REQUESTS)
        return allowed, denied
