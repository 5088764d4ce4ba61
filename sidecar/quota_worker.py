"""The quota worker process: quota mode's registry, shares and RLQS streams, off the serving loop.

Started by the serving process (:mod:`sidecar.quota.relay`) as ``python -m
sidecar.quota_worker``, never by hand. It reads on stdin one frame (8-byte length, then a
pickle of the serving process's :class:`~sidecar.settings.Settings`, the config and a
token), serves ``StreamRateLimitQuotas`` and the control calls on a free 127.0.0.1 port
to callers with the token, prints ``ready <port>`` and runs until SIGTERM (drain: streams
end, every share is handed on within ``--shutdown-grace``) or until stdin closes (the
serving process is gone, SIGKILL included: nothing is left behind). SIGINT and SIGHUP, which
a terminal sends the whole process group, are the serving process's to act on.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import signal
import sys
import time
from typing import Any

import grpc
import structlog
import uvloop

from sidecar import heap
from sidecar.config.model import RateLimitConfig
from sidecar.config.reload import settle_after_load
from sidecar.limiter.redis.clock import SharedClock
from sidecar.logs import configure_logging
from sidecar.quota import service as quota
from sidecar.quota.registry import QuotaRegistry
from sidecar.quota.relay import (
    CHANNEL_OPTIONS,
    CONFIGURE,
    CONTROL_SERVICE,
    DESCRIBE,
    PEER_KEY,
    READY,
    STATS,
    metadata_value,
    token_matches,
)
from sidecar.quota.stats import QuotaStats
from sidecar.server import SERVER_OPTIONS, build_quota_leases, quota_settings
from sidecar.settings import Settings
from sidecar.turns import SWITCH_INTERVAL

log = structlog.get_logger(__name__)

NICE = 10
"""The worker's CPU priority below the serving process's: on a busy machine the kernel gives
the core to the loop that answers ``ShouldRateLimit`` first. Raising one's own niceness needs
no privilege (a container's dropped capabilities included)."""

OPTIONS = [*(option for option in SERVER_OPTIONS if option[0] != "grpc.max_send_message_length"), CHANNEL_OPTIONS[1]]
"""The serving process's server options, but control replies up to the relay's own bound."""
Handler = Any
"""A gRPC aio handler: ``(request or request iterator, context) -> awaitable``."""


def read_start() -> tuple[Settings, RateLimitConfig, str]:
    """The frame on stdin: settings, config, token."""
    stdin = sys.stdin.buffer
    size = int.from_bytes(stdin.read(8), "big")
    settings, config, token = pickle.loads(stdin.read(size))
    return settings, config, token


class Worker:
    """One registry (and its shares through Redis), served to the token's holder."""

    def __init__(self, settings: Settings, config: RateLimitConfig, token: str) -> None:
        self.settings = settings
        self.token = token
        self.leases = (
            build_quota_leases(settings, SharedClock(settings.clock_offset)) if settings.backend == "redis" else None
        )
        registry = QuotaRegistry(
            config,
            quota_settings(settings, shared=self.leases is not None),
            QuotaStats(),
            leases=self.leases,
            settle=heap.settle,
        )
        self.quota = quota.QuotaService(registry, peer=self.peer)

    @staticmethod
    def peer(context: grpc.aio.ServicerContext[Any, Any]) -> str:
        """The Envoy's address as the relay saw it."""
        return metadata_value(context, PEER_KEY)

    def guarded(self, handler: Handler) -> Handler:
        """``handler`` for callers with the token; anything else is refused."""

        async def checked(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            if not token_matches(context, self.token):
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, "not the serving process")
            return await handler(request, context)

        return checked

    async def configure(self, data: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        """A reloaded config: every bucket's assignment under it is pushed (in chunks)."""
        config: RateLimitConfig = pickle.loads(data)
        self.quota.registry.reassign(config)
        return b""

    async def stats(self, data: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        return pickle.dumps(self.quota.registry.frozen_stats())

    async def describe(self, data: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        shown = self.quota.registry.describe()
        if self.leases is not None:
            shown["shares"] = self.leases.describe()
        return pickle.dumps(shown)

    def add_handlers(self, server: grpc.aio.Server) -> None:
        stream = grpc.stream_stream_rpc_method_handler(self.guarded(self.quota.StreamRateLimitQuotas))
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(quota.SERVICE_NAME, {quota.METHOD: stream}),)
        )
        control = {
            name: grpc.unary_unary_rpc_method_handler(self.guarded(handler))
            for name, handler in ((CONFIGURE, self.configure), (STATS, self.stats), (DESCRIBE, self.describe))
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(CONTROL_SERVICE, control),))

    async def run(self) -> None:
        server = grpc.aio.server(options=OPTIONS)
        self.add_handlers(server)
        port = server.add_insecure_port("127.0.0.1:0")
        if self.leases is not None:
            await self.leases.start()
        await server.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)  # the serving process's drain, once its own is done
        # Ctrl-C reaches the whole process group: the serving process drains and then stops
        # the worker; SIGHUP too: the serving process reloads and hands the config on.
        for sig in (signal.SIGINT, signal.SIGHUP):
            loop.add_signal_handler(sig, lambda: None)
        await loop.connect_read_pipe(lambda: ParentGone(stop), sys.stdin)
        sys.stdout.write(f"{READY.decode()}{port}\n")
        sys.stdout.flush()
        await stop.wait()
        deadline = time.monotonic() + self.settings.shutdown_grace
        await server.stop(0)
        await self.quota.registry.settled()
        if self.leases is not None:
            await self.leases.close(deadline)  # a clean stop hands its shares on at once


class ParentGone(asyncio.Protocol):
    """stdin's end: the serving process closed it or died."""

    def __init__(self, stop: asyncio.Event) -> None:
        self.stop = stop

    def eof_received(self) -> bool:
        self.stop.set()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.stop.set()


def main() -> int:
    settings, config, token = read_start()
    os.nice(NICE)
    configure_logging(settings.log_level, settings.log_format)
    structlog.contextvars.bind_contextvars(process="quota-worker")
    settle_after_load()  # full collections skip the config and the imports
    sys.setswitchinterval(SWITCH_INTERVAL)
    uvloop.run(Worker(settings, config, token).run())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
