"""The whole local stack: one redis-server and, per replica, an upstream app, a sidecar and an Envoy.

Replica ``i`` is a pod as in production: Envoy ``i`` sends its rate-limit calls to
sidecar ``i`` and its traffic to app ``i``. With ``quota`` one more pod runs the same
limits in quota mode: ``envoy/quota.yaml`` (Envoy enforces in-process) with its own
sidecar, on the embedded backend (one Envoy: its full limit). With Redis the sidecars share every limit
(``sync`` mode unless told otherwise); without it each runs the embedded backend with
``--instances R`` (limit / R each), and :attr:`Stack.backend_note` says so. With ``xds`` the
sidecars take their limits from a control plane (``stack.xds_server``) serving a copy of
the config directory: edit a file there and every sidecar takes it.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from stack.envoy import ENVOY_CONFIGS, EnvoyPorts, EnvoyProcess
from stack.haproxy import HAProxyPorts, HAProxyProcess, haproxy_binary
from stack.processes import REPO, ProcessGroup, StartError, free_port, port_free
from stack.quota_envoy import ShippedQuotaEnvoy
from stack.redis import RedisProcess
from stack.redis import available as redis_available
from stack.sidecar import SidecarProcess
from stack.upstream import UpstreamProcess
from stack.xds_server import XdsServerProcess

EXAMPLE_CONFIG = REPO / "examples" / "config"


def preferred_port(port: int | None) -> int:
    """``port`` when it is given and free on loopback, else any free port."""
    return port if port and port_free(port) else free_port()


@dataclass(frozen=True)
class StackOptions:
    """What to start. Ports left at None are picked free; preferred ones fall back to free ones."""

    replicas: int = 2
    use_redis: bool = True
    mode: str = "sync"
    config: Path = EXAMPLE_CONFIG
    envoy_template: Path = ENVOY_CONFIGS / "front.yaml"
    sidecar_args: Sequence[str] = ()
    failure_mode_deny: bool | None = None
    envoy_ports: Sequence[int] = ()
    """Preferred listen ports of the Envoys (the demo asks for 10000, 10001, ...)."""
    haproxy: bool = False
    """Also run ``haproxy/haproxy.cfg`` (both flavours) in front of the first app."""
    haproxy_ports: tuple[int, int] = (10080, 10081)
    """Preferred ports of HAProxy's fixed and sliding frontends."""
    quota: bool = False
    """Also run a quota-mode pod: ``envoy/quota.yaml`` -> its own sidecar -> its own app."""
    quota_port: int | None = None
    """Preferred listen port of the quota-mode Envoy."""
    xds: bool = False
    """The sidecars' limits from a control plane (``--config-source xds``) serving a copy of
    ``config``, instead of the files themselves (the quota pod keeps the files)."""


@dataclass
class Replica:
    """One pod's worth of processes."""

    app: UpstreamProcess
    sidecar: SidecarProcess
    envoy: EnvoyProcess


@dataclass
class QuotaPod:
    """The quota-mode pod: Envoy enforces the assignments its sidecar sends (RLQS)."""

    app: UpstreamProcess
    sidecar: SidecarProcess
    envoy: ShippedQuotaEnvoy


@dataclass
class Stack:
    """The running processes, and why the backend is what it is."""

    group: ProcessGroup
    redis: RedisProcess | None
    mode: str
    """``sync`` or ``strict`` with Redis; ``local`` on the embedded backend."""
    replicas: list[Replica] = field(default_factory=list)
    backend_note: str = ""
    haproxy: HAProxyProcess | None = None
    haproxy_note: str = ""
    quota: QuotaPod | None = None
    xds: XdsServerProcess | None = None
    xds_limits: Path | None = None
    """The directory the control plane serves (``xds``): edit it to change every sidecar's limits."""

    @property
    def envoy_urls(self) -> list[str]:
        return [replica.envoy.url for replica in self.replicas]


def _start_redis(group: ProcessGroup, directory: Path) -> tuple[RedisProcess | None, str]:
    """redis-server, or None and the reason when it is missing or will not start."""
    if not redis_available():
        return None, "redis-server is not installed"
    try:
        redis = group.start_ready(partial(RedisProcess, directory))
    except StartError as error:
        return None, f"redis-server did not start ({str(error).splitlines()[0]})"
    return redis, ""


def _serve_args(options: StackOptions, redis: RedisProcess | None) -> list[str]:
    args = ["--config", str(options.config), *options.sidecar_args]
    if redis is not None:
        return [*args, "--backend", "redis", "--redis-url", redis.url, "--mode", options.mode]
    return [*args, "--backend", "memory", "--instances", str(options.replicas)]


def quota_serve_args(options: StackOptions) -> list[str]:
    """The quota-mode pod's sidecar: the same config, the embedded backend (one Envoy holds
    the whole limit; shares across replicas need ``--backend redis``, docs/quota.md)."""
    return ["--config", str(options.config), "--backend", "memory"]


def _backend_note(options: StackOptions, redis: RedisProcess | None, reason: str) -> str:
    if redis is not None:
        return f"{options.replicas} sidecars in {options.mode} mode sharing redis-server at {redis.url}"
    why = reason or "Redis was not asked for"
    return (
        f"{why}: embedded in-memory backend, each of the {options.replicas} sidecars "
        f"enforces limit / {options.replicas} (--instances {options.replicas})"
    )


def _envoy(options: StackOptions, directory: Path, index: int, app_port: int, ratelimit_port: int) -> EnvoyProcess:
    """Envoy ``index`` (from 1) in front of its app, calling its sidecar; ports picked now."""
    wanted = options.envoy_ports[index - 1] if index <= len(options.envoy_ports) else None
    ports = EnvoyPorts(listen=preferred_port(wanted), admin=free_port(), app=app_port, ratelimit=ratelimit_port)
    return EnvoyProcess(
        f"envoy-{index}", options.envoy_template, ports, directory, failure_mode_deny=options.failure_mode_deny
    )


def start(group: ProcessGroup, directory: Path, options: StackOptions) -> Stack:
    """Start everything in dependency order and wait until each part serves."""
    redis, reason = _start_redis(group, directory) if options.use_redis else (None, "")
    mode = options.mode if redis is not None else "local"
    stack = Stack(group=group, redis=redis, mode=mode, backend_note=_backend_note(options, redis, reason))
    indexes = range(1, options.replicas + 1)
    apps = group.start_all_ready([partial(UpstreamProcess, f"app-{index}", directory) for index in indexes])
    serve_args = _serve_args(options, redis)
    if options.xds:
        stack.xds_limits, stack.xds = _start_xds(group, directory, options.config)
        serve_args += ["--config-source", "xds", "--xds-server", stack.xds.address, "--xds-backoff-max", "2"]
    sidecars = group.start_all_ready(
        [partial(SidecarProcess, f"sidecar-{index}", serve_args, directory) for index in indexes]
    )
    envoys = group.start_all_ready(
        [
            partial(_envoy, options, directory, index, app.port, sidecar.port)
            for index, app, sidecar in zip(indexes, apps, sidecars, strict=True)
        ]
    )
    stack.replicas = [Replica(*parts) for parts in zip(apps, sidecars, envoys, strict=True)]
    if options.haproxy:
        stack.haproxy, stack.haproxy_note = _start_haproxy(group, directory, options, apps[0].port)
    if options.quota:
        stack.quota = _start_quota(group, directory, options)
    return stack


def _start_xds(group: ProcessGroup, directory: Path, config: Path) -> tuple[Path, XdsServerProcess]:
    """A control plane serving a copy of ``config`` (a file or a directory of them)."""
    limits = directory / "xds-limits"
    shutil.rmtree(limits, ignore_errors=True)
    if config.is_dir():
        shutil.copytree(config, limits)
    else:
        limits.mkdir(parents=True)
        shutil.copy(config, limits / config.name)
    return limits, group.start_ready(partial(XdsServerProcess, limits, directory))


def _start_quota(group: ProcessGroup, directory: Path, options: StackOptions) -> QuotaPod:
    app = group.start_ready(partial(UpstreamProcess, "app-quota", directory))
    sidecar = group.start_ready(partial(SidecarProcess, "sidecar-quota", quota_serve_args(options), directory))

    def build() -> ShippedQuotaEnvoy:
        listen = preferred_port(options.quota_port)
        return ShippedQuotaEnvoy("envoy-quota", directory, app.port, sidecar.port, listen=listen)

    return QuotaPod(app, sidecar, group.start_ready(build))


def _start_haproxy(
    group: ProcessGroup, directory: Path, options: StackOptions, app_port: int
) -> tuple[HAProxyProcess | None, str]:
    """HAProxy with the same limits as stick tables, or None and why not."""
    try:
        binary = haproxy_binary()
    except FileNotFoundError as error:
        return None, str(error)
    fixed, sliding = options.haproxy_ports

    def build() -> HAProxyProcess:
        ports = HAProxyPorts(preferred_port(fixed), preferred_port(sliding), admin=free_port(), app=app_port)
        return HAProxyProcess("haproxy", ports, directory)

    try:
        return group.start_ready(build), ""
    except StartError as error:
        return None, f"{binary} did not start ({str(error).splitlines()[0]})"


@contextlib.contextmanager
def running_stack(directory: Path, options: StackOptions) -> Iterator[Stack]:
    """:func:`start` inside a process group that stops everything on exit."""
    group = ProcessGroup()
    try:
        yield start(group, directory, options)
    finally:
        group.close()
