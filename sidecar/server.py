"""Process lifecycle: grpc.aio on uvloop, health, reflection, signals, graceful drain."""

from __future__ import annotations

import asyncio
import dataclasses
import pickle
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import structlog
import uvloop
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, ProcessCollector

from sidecar import heap
from sidecar.addresses import (
    StartupError,
    ensure_bindable,
    is_loopback,
    unix_socket_created_private,
)
from sidecar.admin import AdminEndpoint, config_json
from sidecar.config import ConfigError, LoadOptions, RateLimitConfig
from sidecar.config.reload import ConfigReloader, load_quietly, rule_count, settle_after_load
from sidecar.config.watch import ConfigWatcher
from sidecar.config.xds_source import XdsConfigSource, XdsOptions, convert, empty_config, header_pairs, json_object
from sidecar.limiter.memory import MemoryLimiter
from sidecar.limiter.protocol import Limiter
from sidecar.limiter.redis.clock import SharedClock
from sidecar.limiter.windows import Clock, system_clock
from sidecar.metrics import EXPIRE_EVERY_SECONDS, Collectable, RuleStats, Scrape, ServiceStats, SidecarCollector
from sidecar.quota import service as quota
from sidecar.quota.registry import QuotaRegistry, QuotaSettings
from sidecar.quota.relay import QuotaWorker, RelayedQuota, add_relay_to_server
from sidecar.quota.stats import QuotaStats
from sidecar.service.headers import HeaderNames
from sidecar.service.json_api import JsonEndpoint
from sidecar.service.servicer import SERVICE_NAME, RateLimitService, add_to_server
from sidecar.settings import Settings
from sidecar.tls_files import TLS_RELOADS, RotatingServerCredentials, ServerTlsFiles, SettledReload, TlsFileError
from sidecar.tracing import start_tracing
from sidecar.turns import SWITCH_INTERVAL

if TYPE_CHECKING:
    from sidecar.limiter.redis.store import RedisStore
    from sidecar.limiter.strict import StrictLimiter
    from sidecar.quota.leases import QuotaLeases

log = structlog.get_logger(__name__)

MAX_MESSAGE_BYTES = 1024 * 1024
"""Largest request accepted: generous for 64 descriptors, and a bound on allocation."""

HEALTH_NAMES = ("", SERVICE_NAME, quota.SERVICE_NAME, "ratelimit")
"""Names the gRPC health service answers for: overall, the two services', and envoyproxy/ratelimit's."""

SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # gRPC enables SO_REUSEPORT by default, which would let a second sidecar bind the
    # same port silently and split Envoy's traffic between two unrelated counters.
    ("grpc.so_reuseport", 0),
    # Envoy multiplexes every call of a worker on one HTTP/2 connection; 1,000 streams
    # is far above what it keeps in flight and bounds what one misbehaving client holds.
    ("grpc.max_concurrent_streams", 1000),
    # Keepalive enforcement: answer pings (Envoy's, or a client's) no more often than
    # every 10 s, and close a connection that pings harder (two strikes).
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_ping_strikes", 2),
    ("grpc.keepalive_permit_without_calls", 1),
    # And ping idle clients every minute, so a vanished peer's connection is closed.
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
]


DRAIN_QUIET = 0.1
"""On SIGTERM, serving stops once no call has arrived for this long (the callers have stopped)."""


def build_limiter(settings: Settings, clock: SharedClock | None = None) -> Limiter:
    """The backend named by the settings."""
    if settings.backend == "redis":
        return build_redis_limiter(settings, clock)
    return MemoryLimiter(
        instances=settings.instances,
        max_counters=settings.max_counters,
        admit_all=settings.shadow_mode,
    )


def build_redis_limiter(settings: Settings, clock: SharedClock | None = None) -> Limiter:
    """The ``strict`` or ``sync`` backend.

    Imported here, only when chosen: redis-py takes 0.1-0.2 s to import, which the
    memory backend should not pay, and ``sync`` is loaded only when asked for.
    """
    clock = clock or SharedClock(settings.clock_offset)
    # The heartbeats sample Redis TIME only when given the SharedClock itself.
    beat_clock: Clock = clock if settings.clock_source == "redis" else clock.local
    if settings.mode == "strict":
        return build_strict_limiter(settings, beat_clock)
    try:
        from sidecar.limiter.sync import SyncLimiter  # noqa: PLC0415 - lazy, see docstring
    except ImportError as error:
        raise StartupError(f"--mode sync is not available in this build ({error}); use --mode strict") from None
    from sidecar.limiter.redis.replicas import Replicas  # noqa: PLC0415 - lazy, see docstring

    store = build_redis_store(settings)
    return SyncLimiter(
        store,
        Replicas(store, settings.heartbeat_interval, clock=beat_clock),
        prefix=settings.redis_prefix,
        sync_interval=settings.sync_interval,
        redis_timeout=settings.redis_timeout,
        failure_mode=settings.redis_failure_mode,
        admit_all=settings.shadow_mode,
        max_overshoot=settings.sync_max_overshoot,
        max_counters=settings.max_counters,
        clock=clock,
    )


def build_redis_store(settings: Settings) -> RedisStore:
    """A store for ``settings.redis_url``; connects lazily (call ``start``)."""
    from redis.exceptions import RedisClusterException, RedisError  # noqa: PLC0415 - lazy, see build_redis_limiter

    from sidecar.limiter.redis.connect import ENCODE_HINT, secrets_of  # noqa: PLC0415
    from sidecar.limiter.redis.store import RedisStore  # noqa: PLC0415

    try:
        return RedisStore.for_url(
            settings.redis_url,
            cluster=settings.redis_cluster,
            prefix=settings.redis_prefix,
            redis_timeout=settings.redis_timeout,
        )
    except (ValueError, TypeError, RedisError, RedisClusterException) as error:
        # Settings checked the URL; what redis-py still refuses is told in one line, and its
        # own words only if they hold no credential.
        text = str(error)
        if not text or any(secret in text for secret in secrets_of(settings.redis_url)):
            text = f"{type(error).__name__} (check the query options; {ENCODE_HINT})"
        raise StartupError(f"--redis-url / RLS_REDIS_URL: redis-py cannot use it: {text}") from None


def build_strict_limiter(settings: Settings, clock: Clock = system_clock) -> StrictLimiter:
    """Store, heartbeats and failure policy as the settings say; ``clock`` times the
    heartbeats (a :class:`~sidecar.limiter.redis.clock.SharedClock` also samples Redis TIME)."""
    from sidecar.limiter.failure import FailurePolicy  # noqa: PLC0415 - lazy, see build_redis_limiter
    from sidecar.limiter.redis.replicas import Replicas  # noqa: PLC0415
    from sidecar.limiter.strict import StrictLimiter  # noqa: PLC0415

    store = build_redis_store(settings)
    replicas = Replicas(store, settings.heartbeat_interval, clock=clock)
    policy = FailurePolicy(
        settings.redis_failure_mode,
        lambda: replicas.live,
        admit_all=settings.shadow_mode,
        max_counters=settings.max_counters,
    )
    return StrictLimiter(store, replicas, policy, prefix=settings.redis_prefix, admit_all=settings.shadow_mode)


def server_credentials(settings: Settings) -> RotatingServerCredentials | None:
    """TLS (and mutual TLS with ``--tls-client-ca``) for the gRPC server, or None for
    plaintext; the certificate set follows its files (sidecar/tls_files.py)."""
    if not settings.tls_cert:
        return None
    try:
        return RotatingServerCredentials(
            ServerTlsFiles(settings.tls_cert, settings.tls_key, settings.tls_client_ca or None)
        )
    except TlsFileError as error:
        raise StartupError(str(error)) from None


def load_options(settings: Settings) -> LoadOptions:
    """How the config files are read, from the settings."""
    return LoadOptions(merge_domains=settings.merge_domain_config, calendar_months=settings.calendar_months)


def xds_source(settings: Settings, reloader: ConfigReloader) -> XdsConfigSource:
    """The control-plane client of ``--config-source xds``; pushes are validated as files are."""
    options = XdsOptions(
        settings.xds_server,
        settings.xds_node_id,
        json_object(settings.xds_node_metadata),
        header_pairs(settings.xds_headers),
        settings.xds_backoff_initial,
        settings.xds_backoff_max,
        settings.xds_backoff_jitter,
        settings.xds_max_message_bytes,
        settings.xds_tls,
        settings.xds_tls_ca,
        settings.xds_tls_cert,
        settings.xds_tls_key,
        settings.xds_tls_server_name,
    )
    mode, options_ = enforcing_mode(settings), load_options(settings)
    return XdsConfigSource(options, reloader, lambda found: convert(found, mode, settings.max_config_bytes, options_))


def has_startup_config(settings: Settings) -> bool:
    """Whether ``--config`` is loaded at startup. Always with files; with xDS it is a fallback
    served until the first push, and a path that does not exist (the image's default
    ``/etc/ratelimit/config`` with nothing mounted) means none, with a warning."""
    if settings.config_source == "file":
        return True
    if settings.config and not Path(settings.config).exists():
        log.warning("xds_fallback_missing", config=settings.config, serving="no limits until the first push")
        return False
    return bool(settings.config)


class Sidecar:
    """A running gRPC server with its service, health, limiter and admin endpoint."""

    def __init__(
        self,
        settings: Settings,
        config: RateLimitConfig,
        limiter: Limiter,
        clock: Clock = system_clock,
        leases: QuotaLeases | None = None,
    ) -> None:
        self.settings = settings
        self.leases = leases
        """Quota shares across replicas through Redis (``--backend redis``)."""
        self.stats = ServiceStats(rules=RuleStats(near_ratio=settings.near_limit_ratio))
        self.stats.config_loaded(config.digest)
        debug = settings.log_level == "debug"
        self.service = RateLimitService(
            config,
            limiter,
            clock=clock,
            stats=self.stats,
            log_every=settings.request_log_sample if debug else 0,
            response_headers=settings.response_headers,
            header_names=HeaderNames(
                limit=settings.limit_header,
                remaining=settings.remaining_header,
                reset=settings.reset_header,
                warning=settings.warn_header,
                style=settings.response_header_style,
            ),
            dynamic_metadata=settings.response_dynamic_metadata,
        )
        self.quota = quota.QuotaService(
            QuotaRegistry(
                config,
                quota_settings(settings, shared=leases is not None),
                QuotaStats(),
                leases=leases,
                settle=heap.settle,  # buckets adopted in bursts leave the heap full collections walk
            )
        )
        self.worker = (
            QuotaWorker(
                lambda config, token: pickle.dumps((settings, config, token)),
                lambda: self.service.config,
                write_timeout=self.quota.registry.settings.write_timeout,
            )
            if settings.quota_process == "worker"
            else None
        )
        """``--quota-process worker``: quota mode runs in a child process; ``self.quota`` stays idle."""
        self.health = health.aio.HealthServicer()
        self.server = grpc.aio.server(options=SERVER_OPTIONS)
        self.port = 0
        self.serving = False
        self.collector = SidecarCollector(self.stats, self.service.limiter.snapshot, self._quota_numbers)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)
        process = ProcessCollector(registry=self.registry)
        self.admin = AdminEndpoint(
            # Called on the event loop: copies the numbers; the text is made in a thread.
            lambda: Scrape(
                self.collector.frozen(),
                process,
                heap.PAUSES.frozen(),
                TLS_RELOADS.frozen(),
                *([self.xds.state.frozen()] if self.xds is not None else []),
            ),
            self._config_json,
            lambda: self.serving,
            write_timeout=settings.admin_write_timeout,
            max_connections=settings.admin_max_connections,
            config_version=lambda: self.service.config,
        )
        self._expire_task: asyncio.Task[None] | None = None
        self.json = JsonEndpoint(self.service, serving=lambda: self.serving, remote=settings.json_remote)
        """``POST /json`` (``--json-address``): the same request path as gRPC, as JSON over HTTP."""
        self.watcher: ConfigWatcher | None = None
        self._watch_task: asyncio.Task[None] | None = None
        self.tls: RotatingServerCredentials | None = None
        """The gRPC server's certificate set, reloaded when its files change."""
        self._tls_tasks: list[asyncio.Task[None]] = []
        self.reloader = ConfigReloader(
            settings.config,
            lambda: self.service.config,
            self._install,
            self.stats.config_refused,
            enforcing_mode(settings),
            max_bytes=settings.max_config_bytes,
            options=load_options(settings),
        )
        self.xds: XdsConfigSource | None = (
            xds_source(settings, self.reloader) if settings.config_source == "xds" else None
        )
        """``--config-source xds``: the control plane's pushes replace the config (no file reloads)."""
        self._xds_task: asyncio.Task[None] | None = None

    def _quota_numbers(self) -> Collectable:
        """Quota mode's numbers for a scrape: copied here, on the loop, or asked of the worker
        from the scrape thread (its idle stand-in's zeros while it is not running)."""
        idle = self.quota.registry.frozen_stats()
        return idle if self.worker is None else RelayedQuota(self.worker, idle)

    def _config_json(self) -> Callable[[], dict[str, Any]]:
        """``/config``, called on the event loop: the quota buckets' assignments (mutable, so
        described here, bounded) and the config (immutable, swapped whole on reload), and what
        turns them into the document, in a worker thread: the rules and each live bucket."""
        config, loaded_at = self.service.config, self.stats.config_loaded_at
        quota_state = self.quota.registry.describe()
        if self.leases is not None:
            quota_state["shares"] = self.leases.describe()
        worker = self.worker
        about = worker.about() if worker is not None else None
        suppression = getattr(self.service.limiter, "suppression", None)
        busy = suppression.describe(self.service.clock()) if suppression is not None else []
        xds = dataclasses.asdict(self.xds.state) if self.xds is not None else None

        def document() -> dict[str, Any]:
            shown = config_json(config, loaded_at)
            shown["quota"] = quota_state if worker is None else {**(worker.describe() or quota_state), "worker": about}
            shown["suppression"] = busy  # overload: suppress, the busiest counters and their p
            if xds is not None:
                shown["xds"] = xds  # --config-source xds: the version served, pushes applied and refused
            return shown

        return document

    def _install(self, config: RateLimitConfig) -> None:
        """Swap the config the request path reads (one assignment: no request sees half of it),
        and push every quota bucket's assignment under it to every open stream."""
        self.service.config = config
        self.stats.config_loaded(config.digest)
        if self.worker is None:
            self.quota.registry.reassign(config)
        else:
            self.worker.configure(config)  # the idle registry here holds no bucket to re-match

    def _add_services(self) -> None:
        """ShouldRateLimit, RLQS (served here, or relayed to the quota worker), health, reflection."""
        add_to_server(self.service, self.server)
        if self.worker is None:
            quota.add_to_server(self.quota, self.server)
        else:
            add_relay_to_server(self.worker, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = (SERVICE_NAME, quota.SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, self.server)

    async def start(self) -> None:
        """Bind, start serving, and only then report SERVING."""
        heap.PAUSES.install()  # ratelimit_sidecar_gc_pause_max_seconds
        self._add_services()
        address = self.settings.grpc_address
        self.tls = server_credentials(self.settings)
        if self.tls is None and not is_loopback(address):
            log.warning(
                "grpc_exposed_without_tls",
                address=address,
                hint="anything that reaches this address can spend every limit; use --tls-cert/--tls-key",
            )
        try:
            with unix_socket_created_private(address):
                if self.tls is None:
                    self.port = self.server.add_insecure_port(address)
                else:
                    self.port = self.server.add_secure_port(address, self.tls.credentials())
        except RuntimeError as error:
            raise StartupError(f"cannot listen on {address}: {error} (port in use?)") from None
        if self.port == 0:
            raise StartupError(f"cannot listen on {address} (port in use?)")
        if self.settings.metrics_address:
            try:
                await self.admin.start(self.settings.metrics_address)
            except OSError as error:
                raise StartupError(f"cannot listen on {self.settings.metrics_address}: {error.strerror}") from None
        if self.settings.json_address:
            await self._start_json(self.settings.json_address)
        await self.service.limiter.start()
        if self.leases is not None:
            await self.leases.start()
        await self.server.start()
        for name in HEALTH_NAMES:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self.serving = True
        self._expire_task = asyncio.get_running_loop().create_task(self._expire_rows(), name="expire-rows")
        if self.tls is not None:
            await self._watch_tls(self.tls)
        await self._follow_config()

    async def _follow_config(self) -> None:
        """Take config changes from now on: the control plane's pushes, or the files' changes."""
        if self.xds is not None:
            self._xds_task = asyncio.get_running_loop().create_task(self.xds.run(), name="xds-config")
        elif self.settings.watch_config:
            await self._watch_config()

    async def _watch_tls(self, tls: RotatingServerCredentials) -> None:
        """Reload the certificate set whenever one of its files may have changed (always:
        a rotation must not wait for ``--watch-config``). The watchers' logic is the config's:
        renames over a file and the kubelet's ``..data`` swap both count."""
        settled = SettledReload(tls.reload)
        loop = asyncio.get_running_loop()
        self._tls_tasks.append(loop.create_task(settled.run(), name="tls-reload"))
        for path in tls.files.paths():
            watcher = ConfigWatcher(path, settled.kick)
            self._tls_tasks.append(loop.create_task(watcher.run(), name=f"tls-watch {path}"))
            await watcher.ready.wait()
        # A change between the startup load and the watches being armed has no event: look once.
        await settled.kick()

    async def _expire_rows(self) -> None:
        """Drop idle per-rule rows minted from request values, every minute."""
        rules = self.stats.rules
        while True:
            await asyncio.sleep(EXPIRE_EVERY_SECONDS)
            dropped = rules.expire(time.monotonic())
            if dropped:
                log.info("metric_rows_expired", rows=dropped, left=len(rules.rows))

    async def _start_json(self, address: str) -> None:
        if self.settings.json_remote and not is_loopback(address):
            log.warning(
                "json_exposed",
                address=address,
                hint="plain HTTP without TLS: anything that reaches this address can spend every limit",
            )
        try:
            await self.json.start(address)
        except OSError as error:
            raise StartupError(f"cannot listen on {address}: {error.strerror}") from None

    async def _watch_config(self) -> None:
        """Reload on every change under the config path, from now on."""
        self.watcher = ConfigWatcher(self.settings.config, self._reload_on_change)
        self._watch_task = asyncio.get_running_loop().create_task(self.watcher.run(), name="config-watch")
        await self.watcher.ready.wait()
        # A change between the startup load and the watch being armed has no event: look once.
        await self.reloader.reload("watch")

    async def _reload_on_change(self) -> None:
        await self.reloader.reload("watch")

    async def drain(self) -> None:
        """NOT_SERVING, keep answering until calls stop coming, then stop and flush.

        ``grpc.aio``'s ``server.stop(grace)`` cancels every call gRPC has received but
        not yet handed to a handler, and an open health Watch stream would hold it for
        the whole grace. So the server keeps answering (health says NOT_SERVING) until
        no call has arrived for :data:`DRAIN_QUIET` and none is in flight, bounded by
        ``--shutdown-grace``; only then does it stop, cutting what is left (streams).
        """
        self.serving = False
        if self._expire_task is not None:
            self._expire_task.cancel()
        await self.health.enter_graceful_shutdown()
        if self.watcher is not None and self._watch_task is not None:
            self.watcher.stop()
            await self._watch_task
        if self._xds_task is not None:
            self._xds_task.cancel()
            await asyncio.gather(self._xds_task, return_exceptions=True)
        for task in self._tls_tasks:
            task.cancel()
        await asyncio.gather(*self._tls_tasks, return_exceptions=True)
        deadline = time.monotonic() + self.settings.shutdown_grace
        await self._wait_until_quiet(deadline)
        await self.server.stop(0)
        await self.json.close()
        if self.worker is not None:
            await self.worker.close(deadline)  # it hands its shares on, as below
        if self.leases is not None:
            await self.leases.close(deadline)  # a clean stop hands its shares on at once
        await self.service.limiter.close(deadline)  # the flush may use what the grace left
        await self.admin.close()

    async def _wait_until_quiet(self, deadline: float) -> None:
        stats = self.service.stats
        while time.monotonic() < deadline:
            seen = stats.requests + sum(stats.errors.values())
            await asyncio.sleep(min(DRAIN_QUIET, max(0.0, deadline - time.monotonic())))
            arrived = stats.requests + sum(stats.errors.values()) != seen
            if not arrived and self.service.in_flight == 0:
                return


def _install_signal_handlers(stop: asyncio.Event, reload: Callable[[], None]) -> Callable[[], None]:
    """SIGTERM/SIGINT stop, SIGHUP reloads the config."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, reload)

    def remove() -> None:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(sig)

    return remove


async def run(settings: Settings, config: RateLimitConfig) -> None:
    """Serve until SIGTERM or SIGINT, then drain."""
    stop = asyncio.Event()
    clock = SharedClock(settings.clock_offset)
    inline_shares = settings.backend == "redis" and settings.quota_process == "inline"
    leases = build_quota_leases(settings, clock) if inline_shares else None
    sidecar = Sidecar(settings, config, build_limiter(settings, clock), clock, leases)
    # OpenTelemetry: only the OTEL_* variables turn it on (sidecar/tracing.py); off, nothing is imported.
    tracing = start_tracing(enforcing_mode(settings) or "memory")
    if tracing is not None:
        sidecar.service.tracing = tracing
        tracing.hook(sidecar.service.limiter)
    reloads: set[asyncio.Task[bool]] = set()

    def reload_on_sighup() -> None:
        if sidecar.xds is not None:
            log.info("config_reload_ignored", trigger="SIGHUP", why="--config-source xds: the control plane pushes")
            return
        task = asyncio.get_running_loop().create_task(sidecar.reloader.reload("SIGHUP"))
        reloads.add(task)  # keep a reference until it is done
        task.add_done_callback(reloads.discard)

    remove_handlers = _install_signal_handlers(stop, reload_on_sighup)
    await sidecar.start()
    log.info(
        "sidecar_started",
        address=settings.grpc_address,
        port=sidecar.port,
        metrics_address=settings.metrics_address or None,
        json_address=settings.json_address or None,
        backend=settings.backend,
        mode=settings.mode if settings.backend == "redis" else None,
        instances=settings.instances,
        shadow_mode=settings.shadow_mode,
        response_headers=settings.response_headers,
        domains=sorted(config.domains),
        rules=rule_count(config),
        config_digest=config.digest[:12],
    )
    try:
        await stop.wait()
        log.info("sidecar_draining", grace_seconds=settings.shutdown_grace)
        await sidecar.drain()
        if tracing is not None:
            await asyncio.to_thread(tracing.close)  # the last spans, the final flush's included
    finally:
        remove_handlers()
    log.info("sidecar_stopped")


def quota_settings(settings: Settings, shared: bool = False) -> QuotaSettings:
    """The quota service's share of the settings (``--instances`` and ``--shadow-mode`` too).

    With shares through Redis (``shared``) assignments start from the whole limit: the
    leases divide it, and ``--instances`` is only a floor on the live count."""
    return QuotaSettings(
        ttl=settings.quota_ttl,
        idle_abandon=settings.quota_idle_abandon,
        max_buckets=settings.quota_max_buckets,
        max_buckets_per_stream=settings.quota_max_buckets_per_stream,
        max_streams=settings.quota_max_streams,
        instances=1 if shared else settings.instances,
        admit_all=settings.shadow_mode,
    )


def build_quota_leases(settings: Settings, clock: SharedClock) -> QuotaLeases:
    """Quota shares across replicas: its own store (connections) and its own heartbeat set,
    ``<prefix>:quota:replicas``, so the limiter's live count is not doubled."""
    from sidecar.limiter.redis.keys import replicas_key  # noqa: PLC0415 - lazy, see build_redis_limiter
    from sidecar.limiter.redis.replicas import Replicas  # noqa: PLC0415
    from sidecar.quota.leases import QuotaLeases  # noqa: PLC0415
    from sidecar.quota.redis_shares import RedisShares  # noqa: PLC0415

    store = build_redis_store(settings)
    store.replicas_key = replicas_key(settings.redis_prefix + ":quota")
    beat_clock: Clock = clock if settings.clock_source == "redis" else clock.local
    replicas = Replicas(store, settings.heartbeat_interval, clock=beat_clock)
    return QuotaLeases(
        RedisShares(store, replicas),
        replicas.replica_id,
        settings.quota_ttl,
        wall=clock,
        replicas=replicas,
        instances=settings.instances,
        prefix=settings.redis_prefix,
        hold=settings.quota_partition_hold or None,  # 0: four leases, following --quota-ttl
        after_hold=settings.quota_after_hold,
    )


def enforcing_mode(settings: Settings) -> str | None:
    """The Redis mode that will enforce the config, or None for the memory backend."""
    return settings.mode if settings.backend == "redis" else None


def serve(settings: Settings) -> None:
    """Load the config and serve on uvloop; raises :class:`StartupError` on failure."""
    ensure_bindable(settings.grpc_address)
    if settings.metrics_address:
        ensure_bindable(settings.metrics_address)
    if settings.backend == "redis":
        build_redis_store(settings)  # a client redis-py refuses ends startup here, before any log line
    if settings.json_address:
        ensure_bindable(settings.json_address)
    try:
        config = (
            load_quietly(settings.config, enforcing_mode(settings), settings.max_config_bytes, load_options(settings))
            if has_startup_config(settings)
            else empty_config()  # --config-source xds without a fallback: no limits until the first push
        )
    except ConfigError as error:
        mode = enforcing_mode(settings)
        flag = f"--mode {mode} " if mode else ""
        flag += "--merge-domain-config " if settings.merge_domain_config else ""
        flag += "--calendar-months " if settings.calendar_months else ""
        hint = f"run 'ratelimit-sidecar check-config {flag}{settings.config}' to list every issue"
        raise StartupError(f"{error}; {hint}") from None
    log.info("config_loaded", files=len(config.files), domains=sorted(config.domains), rules=rule_count(config))
    settle_after_load()  # full collections skip the config and everything loaded so far
    sys.setswitchinterval(SWITCH_INTERVAL)  # gRPC's poller thread waits less for the GIL (turns.py)
    uvloop.run(run(settings, config))
