"""The ``envoy.service.rate_limit_quota.v3.RateLimitQuotaService`` servicer (RLQS).

One long-lived ``StreamRateLimitQuotas`` call per Envoy (per filter config). A reader
task hands each usage report to the :class:`~sidecar.quota.registry.QuotaRegistry`;
the call's own loop wakes when actions are queued, and at least every
:data:`TICK` seconds for TTL refreshes and idle abandonment, and sends what is queued.
Nothing a client sends ends the call with an error: undecodable messages and bad bucket
ids are counted, logged (rate-limited) and skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import structlog
from google.protobuf.message import DecodeError

from sidecar.protos.envoy.service.rate_limit_quota.v3 import rlqs_pb2
from sidecar.quota.assignments import Action, Kind
from sidecar.quota.registry import QuotaRegistry, Stream

log = structlog.get_logger(__name__)

SERVICE_NAME = "envoy.service.rate_limit_quota.v3.RateLimitQuotaService"
METHOD = "StreamRateLimitQuotas"
TICK = 1.0
"""Seconds between two maintenance passes of a stream (refreshes are due every TTL / 3)."""
MAX_ACTIONS_PER_MESSAGE = 1000
"""Actions per response message: well under the 1 MiB message cap for ids of 1 KiB."""

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


def responses(actions: list[Action], ttl: int) -> Iterator[Any]:
    """The actions in messages of at most :data:`MAX_ACTIONS_PER_MESSAGE`."""
    for start in range(0, len(actions), MAX_ACTIONS_PER_MESSAGE):
        chunk = actions[start : start + MAX_ACTIONS_PER_MESSAGE]
        yield rlqs_pb2.RateLimitQuotaResponse(bucket_action=[action_message(action, ttl) for action in chunk])


def action_label(action: Action) -> str:
    return "abandon" if action.assignment is None else action.assignment.kind.value


def usages(report: Any) -> Iterator[tuple[dict[str, str], int, int]]:
    for usage in report.bucket_quota_usages:
        yield dict(usage.bucket_id.bucket), usage.num_requests_allowed, usage.num_requests_denied


def parse_reports(data: bytes) -> Any | None:
    """Decode a report; None for bytes that are not one (the handler counts and skips it)."""
    try:
        return rlqs_pb2.RateLimitQuotaUsageReports.FromString(data)
    except DecodeError:
        return None


class QuotaService:
    """Serves ``StreamRateLimitQuotas`` from a :class:`QuotaRegistry`."""

    def __init__(self, registry: QuotaRegistry, tick: float = TICK) -> None:
        self.registry = registry
        self.tick = tick

    async def StreamRateLimitQuotas(  # noqa: N802 - name fixed by the proto
        self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[bytes]:
        registry = self.registry
        stream = registry.open(context.peer())
        wake = asyncio.Event()
        stream.notify = wake.set
        reader = asyncio.get_running_loop().create_task(self._read(requests, stream, wake))
        log.info("quota_stream_opened", stream=stream.id, peer=stream.peer)
        try:
            while not reader.done() or stream.pending:
                registry.maintain(stream)
                for message in self._take(stream):
                    yield message
                if reader.done():
                    break
                wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), self.tick)
        finally:
            reader.cancel()
            registry.close(stream)
            log.info("quota_stream_closed", stream=stream.id, peer=stream.peer)

    def _take(self, stream: Stream) -> Iterator[bytes]:
        actions, stream.pending = stream.pending, []
        sent = self.registry.stats.sent
        for action in actions:
            label = action_label(action)
            sent[label] = sent.get(label, 0) + 1
        for message in responses(actions, self.registry.settings.ttl):
            yield bytes(message.SerializeToString())

    async def _read(self, requests: AsyncIterator[Any], stream: Stream, wake: asyncio.Event) -> None:
        registry = self.registry
        try:
            async for report in requests:
                if report is None:
                    registry.stats.bump(registry.stats.malformed, "undecodable")
                    registry.logs.every("quota_report_undecodable", registry.clock(), peer=stream.peer)
                    continue
                registry.report(stream, report.domain, usages(report))
                if stream.pending:
                    wake.set()
        except (asyncio.CancelledError, grpc.aio.AioRpcError):
            raise
        except Exception:
            log.exception("quota_stream_read_failed", stream=stream.id, peer=stream.peer)
        finally:
            wake.set()


def add_to_server(service: QuotaService, server: grpc.aio.Server) -> None:
    """Register ``StreamRateLimitQuotas`` with the tolerant report parser."""
    method = grpc.stream_stream_rpc_method_handler(
        service.StreamRateLimitQuotas,
        request_deserializer=parse_reports,
        response_serializer=None,  # the handler yields serialized responses
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, {METHOD: method}),))
