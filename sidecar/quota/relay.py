"""Quota mode in a process of its own: the serving process relays RLQS streams as bytes.

One event loop answers every ``ShouldRateLimit`` of the pod. Quota mode's work grows with
what Envoy sends (a reconnect with 20,000 buckets, a 1 MiB report) and with the bucket
count (refreshes, share pipelines, a reload's re-match, an outage's retries); cut in
chunks with rests it still held the probe's p99 at 10-30 ms on a 2-core machine
(``python -m loadtest.reliability --areas loop-stalls``). With ``--quota-process worker``
(the default) that work runs in a child process, ``python -m sidecar.quota_worker``, and
the serving process only relays: each ``StreamRateLimitQuotas`` message is handed on as
bytes, unparsed, one message in hand each way, so the relay's work per message is O(1)
whatever the message holds.

The worker is started on the first stream (a sidecar that serves no quota filter never
pays for it), listens on a free 127.0.0.1 port and answers only calls carrying the token
it was given on its stdin (anything else in the pod's network namespace is refused). It
is handed the config at start and again on every reload, answers ``/metrics`` and
``/config`` numbers when asked, and exits when its stdin closes (the serving process
died) or on SIGTERM (drain: it hands its shares on first). If it dies, its streams end
``UNAVAILABLE`` and Envoy reconnects; the next stream starts it again, at once the first
time and after a growing pause if it keeps dying young.

The control calls carry pickles between the two processes of one sidecar: only the
token's holder can reach them, and the token travels on a pipe.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import os
import pickle
import secrets
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import structlog
from prometheus_client import Metric

from sidecar.config.model import RateLimitConfig
from sidecar.quota.service import METHOD, SERVICE_NAME
from sidecar.quota.stats import FrozenQuota

log = structlog.get_logger(__name__)

CONTROL_SERVICE = "ratelimit_sidecar.internal.QuotaWorker"
CONFIGURE, STATS, DESCRIBE = "Configure", "Stats", "Describe"
RLQS_PATH = f"/{SERVICE_NAME}/{METHOD}"
TOKEN_KEY = "x-ratelimit-sidecar-worker-token"
PEER_KEY = "x-ratelimit-sidecar-peer"
"""The Envoy's own address, for the worker's logs and ``/config`` (its peer is the relay)."""
READY = b"ready "
"""The worker's one line on stdout once it serves: ``ready <port>``."""
START_TIMEOUT = 30.0
"""Seconds a starting worker has to print its ready line."""
CALL_TIMEOUT = 5.0
"""Seconds a control call (numbers for a scrape, a new config) may take."""
YOUNG = 10.0
"""A worker that dies within this many seconds of its start died young: the next start waits."""
BACKOFF_FIRST, BACKOFF_MAX = 1.0, 30.0
"""The pause before starting again after a young death, doubling per young death in a row."""
MESSAGE_BYTES = 4 * 1024 * 1024
"""Largest message either way between the two processes: the serving process already
capped what Envoy sends at 1 MiB, and the worker cuts its answers at 256 KiB; control
replies (``/config``'s bucket list) are bounded by the worker's render caps."""
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MESSAGE_BYTES),
    ("grpc.max_send_message_length", MESSAGE_BYTES),
]


class WorkerUnavailableError(Exception):
    """The quota worker is not running and cannot be started now; the message says why."""


def frame(data: bytes) -> bytes:
    """What goes on the worker's stdin: the length in 8 bytes, then ``data``."""
    return len(data).to_bytes(8, "big") + data


def module_path() -> str:
    """``PYTHONPATH`` for the worker: where this ``sidecar`` package was imported from, so
    ``python -m sidecar.quota_worker`` finds the same code from any working directory."""
    root = str(Path(__file__).resolve().parents[2])
    inherited = os.environ.get("PYTHONPATH", "")
    return os.pathsep.join([root, inherited]) if inherited else root


def metadata_value(context: grpc.aio.ServicerContext[Any, Any], key: str) -> str:
    """One of a call's metadata values as text ("" when absent)."""
    given = dict(context.invocation_metadata() or ()).get(key, "")
    return given if isinstance(given, str) else given.decode("latin-1")


def token_matches(context: grpc.aio.ServicerContext[Any, Any], token: str) -> bool:
    """Whether a call carries the worker's token (compared in constant time)."""
    return hmac.compare_digest(metadata_value(context, TOKEN_KEY), token)


@dataclass
class Running:
    """One started worker: its process, where it listens, and its channel."""

    process: asyncio.subprocess.Process
    channel: grpc.aio.Channel
    port: int
    token: str
    config: RateLimitConfig
    """The config the worker holds (given at start or by the last Configure)."""
    started_at: float
    watcher: asyncio.Task[None] | None = None


@dataclass
class WorkerStats:
    """Starts and deaths, for ``/config`` and the logs."""

    starts: int = 0
    deaths: int = 0
    young_in_a_row: int = 0
    last_exit: int | None = None
    relayed: dict[str, int] = field(default_factory=dict)
    """Relayed streams by how they ended: ``ok``, a gRPC status name, ``unavailable``."""


class QuotaWorker:
    """Starts, supervises and relays to the quota worker process.

    ``start_input(config, token)`` is what the worker reads on its stdin (the serving
    process's settings, the config and the token, pickled); it runs in a thread.
    ``config()`` is the config to start with (the one being served).
    """

    def __init__(
        self,
        start_input: Callable[[RateLimitConfig, str], bytes],
        config: Callable[[], RateLimitConfig],
        *,
        write_timeout: float,
        command: tuple[str, ...] = (sys.executable, "-m", "sidecar.quota_worker"),
        start_timeout: float = START_TIMEOUT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.start_input = start_input
        self.config = config
        self.write_timeout = write_timeout
        self.command = command
        self.start_timeout = start_timeout
        self.clock = clock
        self.stats = WorkerStats()
        self.running: Running | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._starting: asyncio.Task[Running] | None = None
        self._not_before = 0.0
        self._closing = False
        self._configuring: asyncio.Task[None] | None = None

    # -- the process -------------------------------------------------------------------

    async def ensure(self) -> Running:
        """The running worker, started now if there is none (one start at a time)."""
        if self.running is not None:
            return self.running
        if self._closing:
            raise WorkerUnavailableError("the sidecar is stopping")
        wait = self._not_before - self.clock()
        if wait > 0:
            raise WorkerUnavailableError(
                f"the quota worker died young {self.stats.young_in_a_row} times; next start in {wait:.0f} s"
            )
        if self._starting is None:
            self._starting = asyncio.get_running_loop().create_task(self._start(), name="quota-worker-start")
        starting = self._starting
        try:
            return await asyncio.shield(starting)
        finally:
            if starting.done() and self._starting is starting:
                self._starting = None

    async def _start(self) -> Running:
        self.loop = asyncio.get_running_loop()
        config, token = self.config(), secrets.token_hex(16)
        process = await self._spawn(config, token)
        assert process.stdout is not None
        started_at = self.clock()
        try:
            line = await asyncio.wait_for(process.stdout.readline(), self.start_timeout)
        except TimeoutError:
            line = b""
            log.error("quota_worker_start_failed", why=f"no ready line within {self.start_timeout:g} s")
        if not (line.startswith(READY) and line[len(READY) :].strip().isdigit()):
            await self._reap(process)
            self._died(started_at, process.returncode)
            raise WorkerUnavailableError(f"the quota worker did not start (exit {process.returncode})")
        port = int(line[len(READY) :])
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS)
        running = Running(process, channel, port, token, config, started_at)
        running.watcher = asyncio.get_running_loop().create_task(self._watch(running), name="quota-worker-watch")
        self.running = running
        self.stats.starts += 1
        log.info("quota_worker_started", pid=process.pid, port=port, starts=self.stats.starts)
        if self.config() is not config:
            self.configure(self.config())  # a reload while it started
        return running

    async def _spawn(self, config: RateLimitConfig, token: str) -> asyncio.subprocess.Process:
        """The worker process, its start frame written (stdin stays open: its EOF tells the
        worker we died); what cannot even be spawned is a start that failed."""
        try:
            data = await asyncio.to_thread(self.start_input, config, token)
            process = await asyncio.create_subprocess_exec(
                *self.command,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                env={**os.environ, "PYTHONPATH": module_path()},
            )
        except (OSError, pickle.PicklingError) as error:
            log.error("quota_worker_start_failed", why=str(error))
            self._died(self.clock(), None)
            raise WorkerUnavailableError(f"the quota worker could not be started: {error}") from None
        assert process.stdin is not None
        try:
            process.stdin.write(frame(data))
            await process.stdin.drain()
        except OSError as error:  # it died before reading: its exit code says why
            log.error("quota_worker_start_failed", why=str(error))
        return process

    async def _watch(self, running: Running) -> None:
        """Wait for the worker's exit; an exit nobody asked for is logged and counted."""
        code = await running.process.wait()
        if self.running is running:
            self.running = None
        await running.channel.close()
        if not self._closing:
            self._died(running.started_at, code)
            log.error("quota_worker_exited", pid=running.process.pid, code=code, starts=self.stats.starts)

    def _died(self, started_at: float, code: int | None) -> None:
        self.stats.deaths += 1
        self.stats.last_exit = code
        young = self.clock() - started_at < YOUNG
        self.stats.young_in_a_row = self.stats.young_in_a_row + 1 if young else 0
        if young:
            pause = min(BACKOFF_MAX, BACKOFF_FIRST * 2 ** (self.stats.young_in_a_row - 1))
            self._not_before = self.clock() + pause

    @staticmethod
    async def _reap(process: asyncio.subprocess.Process) -> None:
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
        await process.wait()

    async def close(self, deadline: float) -> None:
        """Drain: SIGTERM (the worker hands its shares on), then SIGKILL at ``deadline``
        (``time.monotonic``); no later stream starts another."""
        self._closing = True
        if self._starting is not None:
            with contextlib.suppress(Exception):
                await self._starting
        running = self.running
        if running is None:
            return
        with contextlib.suppress(ProcessLookupError):
            running.process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(running.process.wait(), max(0.1, deadline - time.monotonic()))
        except TimeoutError:
            log.warning("quota_worker_killed", pid=running.process.pid, why="still running at the end of the grace")
            await self._reap(running.process)
        if running.watcher is not None:
            await running.watcher
        self.running = None

    # -- control calls -----------------------------------------------------------------

    async def call(self, method: str, data: bytes = b"") -> bytes:
        """One control call to the running worker (never starts one)."""
        running = self.running
        if running is None:
            raise WorkerUnavailableError("the quota worker is not running")
        unary = running.channel.unary_unary(f"/{CONTROL_SERVICE}/{method}")
        reply: bytes = await unary(data, timeout=CALL_TIMEOUT, metadata=((TOKEN_KEY, running.token),))
        return reply

    def call_from_thread(self, method: str) -> bytes:
        """:meth:`call` from a render thread: the loop only sends and receives bytes."""
        if self.loop is None or self.running is None:
            raise WorkerUnavailableError("the quota worker is not running")
        future = asyncio.run_coroutine_threadsafe(self.call(method), self.loop)
        return future.result(CALL_TIMEOUT + 1)

    def asked(self, method: str) -> Any:
        """What a control call returns (unpickled here, in the render thread); None when the
        worker is not running or does not answer in time."""
        try:
            return pickle.loads(self.call_from_thread(method))
        except (WorkerUnavailableError, grpc.aio.AioRpcError, TimeoutError) as error:
            log.debug("quota_worker_unanswered", method=method, why=str(error))
            return None

    def frozen_stats(self) -> FrozenQuota | None:
        """The worker's quota numbers, from a scrape thread; None when it is not running."""
        stats: FrozenQuota | None = self.asked(STATS)
        return stats

    def describe(self) -> dict[str, Any] | None:
        """The worker's ``/config`` quota section, from a render thread; None when it is not running."""
        shown: dict[str, Any] | None = self.asked(DESCRIBE)
        return shown

    def about(self) -> dict[str, Any]:
        """``/config``'s ``quota.worker``: whether it runs, and its starts and deaths."""
        running = self.running
        return {
            "running": running is not None,
            "pid": running.process.pid if running is not None else None,
            "starts": self.stats.starts,
            "deaths": self.stats.deaths,
            "last_exit": self.stats.last_exit,
            "streams_relayed": dict(self.stats.relayed),
        }

    def configure(self, config: RateLimitConfig) -> None:
        """Hand a reloaded config on (in order, the newest winning: one send at a time)."""
        if self.running is None or (self._configuring is not None and not self._configuring.done()):
            return  # a start reads self.config(); a send in flight sends the newest when done
        self._configuring = asyncio.get_running_loop().create_task(self._send_configs(), name="quota-worker-config")

    async def _send_configs(self) -> None:
        while (running := self.running) is not None and running.config is not self.config():
            config = self.config()
            data = await asyncio.to_thread(pickle.dumps, config)
            try:
                await self.call(CONFIGURE, data)
            except (WorkerUnavailableError, grpc.aio.AioRpcError) as error:
                log.error("quota_worker_config_failed", why=str(error))  # its death restarts it with the new one
                return
            running.config = config

    # -- the relay ---------------------------------------------------------------------

    async def relay(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]) -> None:
        """``StreamRateLimitQuotas``: the worker's stream, message for message, ended as it ends."""
        try:
            running = await self.ensure()
        except WorkerUnavailableError as error:
            self._ended("unavailable")
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(error))
        metadata = ((TOKEN_KEY, running.token), (PEER_KEY, context.peer()))
        call = running.channel.stream_stream(RLQS_PATH)(metadata=metadata)
        forward = asyncio.get_running_loop().create_task(self._forward(requests, call))
        try:
            async for reply in call:
                await asyncio.wait_for(context.write(reply), self.write_timeout)
            code, details = grpc.StatusCode.OK, ""
        except TimeoutError:
            code, details = (
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the client did not read a response for {self.write_timeout:g} s",
            )
        except grpc.aio.AioRpcError as error:
            code, details = error.code(), error.details() or "the quota worker ended the stream"
            if code is grpc.StatusCode.CANCELLED:  # not the client (that cancels this handler): our channel closed
                code, details = grpc.StatusCode.UNAVAILABLE, "the quota worker went away"
        except asyncio.CancelledError:
            self._ended("cancelled")  # the client went, or the server stopped
            raise
        finally:
            forward.cancel()
            call.cancel()
        self._ended(code.name.lower())
        if code is not grpc.StatusCode.OK:
            await context.abort(code, details)

    @staticmethod
    async def _forward(requests: AsyncIterator[bytes], call: Any) -> None:
        """Envoy's reports to the worker, one at a time (flow control is the bound)."""
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
            async for data in requests:
                await call.write(data)
            await call.done_writing()

    def _ended(self, how: str) -> None:
        self.stats.relayed[how] = self.stats.relayed.get(how, 0) + 1


@dataclass(frozen=True)
class RelayedQuota:
    """``ratelimit_sidecar_quota_*`` for a scrape: the worker's numbers, asked for in the
    scrape thread, or ``idle`` (zeros) while it is not running."""

    worker: QuotaWorker
    idle: FrozenQuota

    def collect(self) -> Iterator[Metric]:
        return (self.worker.frozen_stats() or self.idle).collect()


def add_relay_to_server(worker: QuotaWorker, server: grpc.aio.Server) -> None:
    """Serve ``StreamRateLimitQuotas`` by relaying to the worker; bytes both ways."""
    method = grpc.stream_stream_rpc_method_handler(worker.relay, request_deserializer=None, response_serializer=None)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, {METHOD: method}),))
