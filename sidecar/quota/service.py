"""The ``envoy.service.rate_limit_quota.v3.RateLimitQuotaService`` servicer (RLQS).

One long-lived ``StreamRateLimitQuotas`` call per Envoy (per filter config), at most
``--quota-max-streams`` per process (more are refused ``RESOURCE_EXHAUSTED``). A reader
task hands each usage report to the :class:`~sidecar.quota.registry.QuotaRegistry`,
a chunk of usages per loop turn; the call's own loop wakes when actions are queued,
and at least every :data:`TICK` seconds for TTL refreshes and idle abandonment, and
sends what is queued in messages cut by bytes (:data:`MAX_RESPONSE_BYTES`) and by count.

Backpressure: gRPC lets a handler write several MB to a client that does not read
before a write waits (measured on grpcio 1.85: 4-8 MB of 100-500 KB messages), so the
stream's own queue is bounded in bytes (:mod:`sidecar.quota.outbox`): past it, reports
are no longer read; and a message the client has not taken within the write timeout
ends the stream with ``RESOURCE_EXHAUSTED``. Nothing else a client sends ends the call
with an error: undecodable messages and bad bucket ids are counted, logged
(rate-limited) and skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

import grpc
import structlog

from sidecar.protos.envoy.service.rate_limit_quota.v3 import rlqs_pb2
from sidecar.quota.assignments import Action, Kind
from sidecar.quota.registry import QuotaRegistry, StreamCapError
from sidecar.quota.reports import UsageReport
from sidecar.quota.stats import QuotaStats
from sidecar.quota.stream import Stream
from sidecar.service.wire import length_delimited

log = structlog.get_logger(__name__)

SERVICE_NAME = "envoy.service.rate_limit_quota.v3.RateLimitQuotaService"
METHOD = "StreamRateLimitQuotas"
TICK = 1.0
"""Seconds between two maintenance passes of a stream (refreshes are due every TTL / 3)."""
MAX_ACTIONS_PER_MESSAGE = 256
"""Actions per response message (and built per loop turn)."""
MAX_RESPONSE_BYTES = 256 * 1024
"""Serialized bytes of one response message at most. The binding limit is our own
``grpc.max_send_message_length`` (1 MiB, ``MAX_MESSAGE_BYTES`` in server.py; a larger
message ends the stream with ``RESOURCE_EXHAUSTED``); Envoy's Google-gRPC client
refuses more than 4 MiB by default. A quarter of the smaller one leaves room for any
framing and keeps one message to a few HTTP/2 flow-control windows."""
BUCKET_ACTION_TAG = b"\x0a"
"""``RateLimitQuotaResponse.bucket_action`` is field 1, length-delimited."""

BucketAction = rlqs_pb2.RateLimitQuotaResponse.BucketAction
BLANKET = {Kind.ALLOW_ALL: 0, Kind.DENY_ALL: 1}
"""``RateLimitStrategy.BlanketRule`` values."""


def action_message(action: Action, ttl: int) -> Any:
    """One ``BucketAction``: abandon, or an assignment living ``ttl`` whole seconds."""
    message = BucketAction()
    message.bucket_id.bucket.update(action.bucket_id)
    assignment = action.assignment
    if assignment is None:
        message.abandon_action.SetInParent()
        return message
    quota = message.quota_assignment_action
    quota.assignment_time_to_live.seconds = ttl
    strategy = quota.rate_limit_strategy
    if assignment.kind is Kind.TOKEN_BUCKET:
        bucket = strategy.token_bucket
        bucket.max_tokens = assignment.max_tokens
        bucket.tokens_per_fill.value = assignment.tokens_per_fill
        bucket.fill_interval.seconds = assignment.fill_seconds
        bucket.fill_interval.nanos = action.nanos
    else:
        strategy.blanket_rule = BLANKET[assignment.kind]
    return message


def responses(actions: Sequence[Action], ttl: int, stats: QuotaStats) -> Iterator[bytes]:
    """Serialized ``RateLimitQuotaResponse`` s carrying ``actions``: each at most
    :data:`MAX_RESPONSE_BYTES` and :data:`MAX_ACTIONS_PER_MESSAGE` actions.

    A response is its ``bucket_action`` fields one after the other, so each action is
    serialized once and the message cut exactly where its bytes would pass the bound. An
    action that alone would pass it (an id near the 1 MiB report size, served without
    state) is not sent and counted: Envoy applies its ``no_assignment_behavior``."""
    parts: list[bytes] = []
    size = 0
    for action in actions:
        data = action_message(action, ttl).SerializeToString()
        field = length_delimited(BUCKET_ACTION_TAG, data)
        if len(field) > MAX_RESPONSE_BYTES:
            stats.bump(stats.malformed, "answer_too_large")
            continue
        if parts and (size + len(field) > MAX_RESPONSE_BYTES or len(parts) == MAX_ACTIONS_PER_MESSAGE):
            yield b"".join(parts)
            parts, size = [], 0
        parts.append(field)
        size += len(field)
        label = action_label(action)
        stats.sent[label] = stats.sent.get(label, 0) + 1
    if parts:
        yield b"".join(parts)


def action_label(action: Action) -> str:
    return "abandon" if action.assignment is None else action.assignment.kind.value


class QuotaService:
    """Serves ``StreamRateLimitQuotas`` from a :class:`QuotaRegistry`."""

    def __init__(
        self,
        registry: QuotaRegistry,
        tick: float = TICK,
        peer: Callable[[grpc.aio.ServicerContext[Any, Any]], str] = lambda context: context.peer(),
    ) -> None:
        self.registry = registry
        self.tick = tick
        self.peer = peer
        """Who the client is, for logs and ``/config`` (the quota worker reads what the relay saw)."""

    async def StreamRateLimitQuotas(  # noqa: N802 - name fixed by the proto
        self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]
    ) -> None:
        registry = self.registry
        try:
            stream = registry.open(self.peer(context))
        except StreamCapError as refused:
            registry.logs.every("quota_stream_refused", registry.clock(), reason=str(refused))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(refused))
        wake = asyncio.Event()
        stream.notify = wake.set
        reader = asyncio.get_running_loop().create_task(self._read(requests, stream, wake))
        registry.logs.limited("quota_stream_opened", registry.clock(), stream=stream.id, peer=stream.peer)
        try:
            await self._serve(stream, reader, wake, context)
        finally:
            reader.cancel()
            registry.close(stream)
            registry.logs.limited("quota_stream_closed", registry.clock(), stream=stream.id, peer=stream.peer)

    async def _serve(
        self,
        stream: Stream,
        reader: asyncio.Task[None],
        wake: asyncio.Event,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> None:
        """Maintain and send until the client half-closes (and all is sent) or stops reading."""
        while True:
            wake.clear()
            await self.registry.maintain_in_chunks(stream)
            if not await self._send(stream, context):
                return
            if reader.done() and not stream.pending:
                return
            if not stream.pending:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), self.tick)

    async def _send(self, stream: Stream, context: grpc.aio.ServicerContext[Any, Any]) -> bool:
        """Send what is queued, a message per turn; False when the client did not take one
        within the write timeout (the stream is then ended ``RESOURCE_EXHAUSTED``)."""
        registry = self.registry
        timeout = registry.settings.write_timeout
        while stream.pending:
            actions = stream.pending.take(MAX_ACTIONS_PER_MESSAGE)
            for message in responses(actions, registry.settings.ttl, registry.stats):
                try:
                    await asyncio.wait_for(context.write(message), timeout)
                except TimeoutError:
                    registry.stats.bump(registry.stats.streams_ended, "write_timeout")
                    registry.finishing += 1  # until gRPC has finished the call
                    context.add_done_callback(registry.call_finished)
                    registry.logs.every("quota_stream_not_reading", registry.clock(), peer=stream.peer)
                    context.set_code(grpc.StatusCode.RESOURCE_EXHAUSTED)
                    context.set_details(f"the client did not read a response for {timeout:g} s")
                    return False
        return True

    async def _read(self, requests: AsyncIterator[bytes], stream: Stream, wake: asyncio.Event) -> None:
        registry = self.registry
        try:
            async for data in requests:
                report = UsageReport(data, lambda kind: self._malformed(stream, kind))
                await registry.report_in_chunks(stream, report.domain, report.usages())
        except (asyncio.CancelledError, grpc.aio.AioRpcError):
            raise
        except Exception:
            log.exception("quota_stream_read_failed", stream=stream.id, peer=stream.peer)
        finally:
            wake.set()

    def _malformed(self, stream: Stream, kind: str) -> None:
        registry = self.registry
        registry.stats.bump(registry.stats.malformed, kind)
        registry.logs.every(f"quota_report_{kind}", registry.clock(), peer=stream.peer)


def add_to_server(service: QuotaService, server: grpc.aio.Server) -> None:
    """Register ``StreamRateLimitQuotas``; reports arrive as bytes, read lazily by the handler."""
    method = grpc.stream_stream_rpc_method_handler(
        service.StreamRateLimitQuotas,
        request_deserializer=None,  # the handler reads reports a chunk at a time (quota/reports.py)
        response_serializer=None,  # the handler writes serialized responses
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, {METHOD: method}),))
