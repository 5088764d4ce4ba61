"""RLQS streams as an Envoy holds them, for the loop-stalls area: reports as bytes, replies kept raw.

A :class:`QuotaStream` is one ``StreamRateLimitQuotas`` call over a blocking gRPC channel:
reports go out as prebuilt bytes, and a reader thread keeps every reply as bytes with its
arrival time. Nothing is parsed while a measurement runs (parsing a reply of 20,000
actions would stall this process, and the probe beside it, not the sidecar); the replies
are counted afterwards by :meth:`QuotaStream.actions`.

The report builders make the area's inputs, cut into messages under the 1 MiB cap:
:func:`tiny_ids_reports` (bucket ids of 13 bytes, each read and refused one by one) and
:func:`bucket_reports` (valid ids of one limited rule: what an Envoy reports after a
reconnect).
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import string
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from sidecar.protos.envoy.service.rate_limit_quota.v3 import rlqs_pb2

PATH = "/envoy.service.rate_limit_quota.v3.RateLimitQuotaService/StreamRateLimitQuotas"
MESSAGE_BYTES = 1024 * 1024
"""The sidecar's gRPC message cap (``sidecar.server.MAX_MESSAGE_BYTES``): a report must fit."""
REPORT_BUDGET = 900 * 1024
"""Bytes of one report message built here: under the cap with room for the framing."""
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * MESSAGE_BYTES),
    ("grpc.max_send_message_length", 2 * MESSAGE_BYTES),
]
Reports = rlqs_pb2.RateLimitQuotaUsageReports
Usage = Reports.BucketQuotaUsage
ALPHABET = string.ascii_letters + string.digits


def _identity(data: bytes) -> bytes:
    return data


def short_values(count: int) -> Iterator[str]:
    """``count`` distinct strings, the shortest first (1, 2, then 3 characters of 62)."""
    produced = 0
    for length in itertools.count(1):
        for letters in itertools.product(ALPHABET, repeat=length):
            if produced == count:
                return
            yield "".join(letters)
            produced += 1


def tiny_ids_reports(domain: str, count: int) -> list[bytes]:
    """Reports of ``count`` distinct bucket ids ``{"": <1-3 letters>}`` (13 bytes each: 100,000
    take 1.3 MB, so two messages sent back to back). None is a valid id (no ``domain``, an
    unknown field): the sidecar reads each, refuses it with a reason and answers it with
    the default action."""
    usages = (Usage(bucket_id=rlqs_pb2.BucketId(bucket={"": value})) for value in short_values(count))
    return cut_into_reports(domain, usages)


def bucket_id(domain: str, key: str, value: str) -> dict[str, str]:
    """The bucket id convention of ``docs/quota.md``: one descriptor entry."""
    return {"domain": domain, f"entry.0.{key}": value}


def bucket_reports(
    domain: str, key: str, count: int, *, value_bytes: int = 0, prefix: str = "u", budget: int = REPORT_BUDGET
) -> list[bytes]:
    """Reports of ``count`` valid bucket ids ``(key, <prefix><n>[padding])``, one request
    allowed each, of at most ``budget`` bytes; ``value_bytes`` pads each value to about
    that length (ids of ~1 KiB)."""
    usages = (
        Usage(
            bucket_id=rlqs_pb2.BucketId(bucket=bucket_id(domain, key, f"{prefix}{number:06d}".ljust(value_bytes, "x"))),
            num_requests_allowed=1,
        )
        for number in range(count)
    )
    return cut_into_reports(domain, usages, budget)


def cut_into_reports(domain: str, usages: Iterable[Any], budget: int = REPORT_BUDGET) -> list[bytes]:
    """Serialized reports holding ``usages`` in order, each at most ``budget`` bytes."""
    messages: list[bytes] = []
    batch: list[Any] = []
    size = 0
    for usage in usages:
        usage_bytes = usage.ByteSize() + 4  # the field's tag and length
        if batch and size + usage_bytes > budget:
            messages.append(bytes(Reports(domain=domain, bucket_quota_usages=batch).SerializeToString()))
            batch, size = [], 0
        batch.append(usage)
        size += usage_bytes
    if batch:
        messages.append(bytes(Reports(domain=domain, bucket_quota_usages=batch).SerializeToString()))
    return messages


@dataclass
class Replies:
    """What a stream got back: raw replies with their ``perf_counter`` arrival, and how it ended."""

    arrivals: list[tuple[float, bytes]] = field(default_factory=list)
    ended: str = ""
    """Empty while open; ``"closed"`` or the gRPC status name when the call ended."""


class QuotaStream:
    """One ``StreamRateLimitQuotas`` call: send prebuilt reports, keep replies raw."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        method = self.channel.stream_stream(PATH, request_serializer=_identity, response_deserializer=_identity)
        self._outbox: queue.Queue[bytes | None] = queue.Queue()
        self.replies = Replies()
        self._lock = threading.Lock()
        self._call = method(iter(self._outbox.get, None))
        self._reader = threading.Thread(target=self._read, name="quota-stream-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            for reply in self._call:
                with self._lock:
                    self.replies.arrivals.append((time.perf_counter(), reply))
            ended = "closed"
        except grpc.RpcError as error:
            ended = error.code().name if isinstance(error, grpc.Call) else type(error).__name__
        with self._lock:
            self.replies.ended = ended

    def send(self, data: bytes) -> None:
        self._outbox.put(data)

    def reply_count(self) -> int:
        with self._lock:
            return len(self.replies.arrivals)

    def last_arrival(self) -> float | None:
        with self._lock:
            return self.replies.arrivals[-1][0] if self.replies.arrivals else None

    def ended(self) -> str:
        with self._lock:
            return self.replies.ended

    def wait_quiet(self, since: float, quiet: float, limit: float) -> float:
        """Block until the replies stop: ``quiet`` seconds without one after a first reply
        that came after ``since`` (``perf_counter``), the call ended, or ``limit`` seconds
        passed. Returns when the answer was complete (the last reply, or the moment given up)."""
        deadline = time.perf_counter() + limit
        while True:
            now = time.perf_counter()
            last = self.last_arrival()
            if self.ended():
                return last if last is not None and last > since else now
            if last is not None and last > since and now - last >= quiet:
                return last
            if now >= deadline:
                return now
            time.sleep(0.02)

    def actions(self, since: float = 0.0) -> int:
        """Bucket actions in the replies that arrived after ``since`` (parsed now, not while measuring)."""
        with self._lock:
            replies = [data for at, data in self.replies.arrivals if at > since]
        return sum(len(rlqs_pb2.RateLimitQuotaResponse.FromString(data).bucket_action) for data in replies)

    def close(self) -> None:
        self._outbox.put(None)
        with contextlib.suppress(Exception):
            self._call.cancel()
        self._reader.join(5)
        self.channel.close()
