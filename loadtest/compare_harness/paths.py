"""The four paths under comparison and the processes behind them, all on 127.0.0.1.

One sample app (``stack/upstream.py``) answers behind every path:

* ``envoy_memory``: one Envoy (``envoy/front.yaml``) calling one sidecar, memory backend;
* ``envoy_sync``: two Envoys, each calling its own sidecar, both in ``sync`` mode on one
  redis-server; the replay alternates each client's requests between the two Envoys, so
  the limit the two sidecars share is what is measured;
* ``haproxy_fixed`` and ``haproxy_sliding``: the two frontends of one HAProxy 2.6 running
  the comparison config (:mod:`compare_harness.haproxy_config`).

Envoys run with ``--concurrency 1`` and HAProxy with ``nbthread 1`` (the shipped config).
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import cpu_seconds

from compare_harness import haproxy_config
from stack.components import RedisProcess, SidecarProcess, UpstreamProcess
from stack.envoy import ENVOY_CONFIGS, EnvoyPorts, EnvoyProcess
from stack.haproxy import HAProxyPorts, HAProxyProcess
from stack.processes import REPO, Child, ProcessGroup

EXAMPLE_CONFIG = REPO / "examples" / "config"
ENVOY_TEMPLATE = ENVOY_CONFIGS / "front.yaml"
LABELS = {
    "envoy_memory": "(a) Envoy + sidecar, memory",
    "envoy_sync": "(b) 2 Envoys + 2 sidecars, sync, one Redis",
    "haproxy_fixed": "(c) HAProxy fixed windows",
    "haproxy_sliding": "(d) HAProxy sliding windows",
}
SHORT = {
    "envoy_memory": "(a) Envoy+sidecar memory",
    "envoy_sync": "(b) 2x Envoy+sidecar sync",
    "haproxy_fixed": "(c) HAProxy fixed",
    "haproxy_sliding": "(d) HAProxy sliding",
}
REPLICAS_TIMEOUT = 10.0


@dataclass
class Contender:
    """One path: where its traffic goes and which processes serve it."""

    name: str
    ports: list[int]
    """Where requests enter (two Envoys for ``envoy_sync``)."""
    pids: list[int]
    """The processes that proxy and limit on this path (proxies, sidecars, redis-server; not the app)."""
    envoys: list[EnvoyProcess] = field(default_factory=list)
    sidecars: list[SidecarProcess] = field(default_factory=list)

    @property
    def label(self) -> str:
        return LABELS[self.name]

    def envoy_counters(self) -> dict[str, int]:
        """The rate-limit filter's counters summed over this path's Envoys ({} for HAProxy)."""
        total: dict[str, int] = {}
        for envoy in self.envoys:
            for name, value in envoy.counters().items():
                total[name] = total.get(name, 0) + value
        return total


@dataclass
class Bench:
    """Every process of the comparison, and what the HAProxy config was made from."""

    group: ProcessGroup
    paths: dict[str, Contender] = field(default_factory=dict)
    haproxy: HAProxyProcess | None = None
    haproxy_config: haproxy_config.ComparisonConfig | None = None
    redis: RedisProcess | None = None


def _sidecar_args(*extra: str) -> list[str]:
    return ["--config", str(EXAMPLE_CONFIG), "--log-level", "info", "--shutdown-grace", "5", *extra]


def _wait_all(children: Sequence[Child]) -> None:
    for child in children:
        child.wait_ready()


def metric(url: str, name: str) -> float | None:
    """The value of an unlabelled metric at ``url``/metrics (None when absent or unreachable)."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=2) as reply:
            text = reply.read().decode()
    except OSError:
        return None
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else None


def wait_replicas(sidecars: Sequence[SidecarProcess], expected: int, timeout: float = REPLICAS_TIMEOUT) -> None:
    """Until every sidecar reports ``expected`` live replicas (so each uses the right blind cap)."""
    deadline = time.monotonic() + timeout
    while True:
        seen = [metric(sidecar.metrics_url, "ratelimit_sidecar_replicas") for sidecar in sidecars]
        if all(value == expected for value in seen):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"sync sidecars saw {seen} live replicas after {timeout:g} s, expected {expected}")
        time.sleep(0.05)


def start(directory: Path, names: Sequence[str], *, redis_timeout: float | None = None) -> Bench:
    """Start the processes of the paths ``names`` and wait until each serves; stopped on failure."""
    group = ProcessGroup()
    bench = Bench(group)
    try:
        _start(bench, directory, names, redis_timeout)
    except BaseException:
        group.close()
        raise
    return bench


def _start(bench: Bench, directory: Path, names: Sequence[str], redis_timeout: float | None) -> None:
    group = bench.group
    app = group.start(UpstreamProcess("app", directory))
    starting: list[Child] = [app]
    memory: SidecarProcess | None = None
    sync: list[SidecarProcess] = []
    if "envoy_memory" in names:
        memory = group.start(SidecarProcess("sidecar-memory", _sidecar_args("--backend", "memory"), directory))
        starting.append(memory)
    if "envoy_sync" in names:
        bench.redis = group.start(RedisProcess(directory))
        bench.redis.wait_ready()
        for index in (1, 2):
            args = _sidecar_args("--backend", "redis", "--redis-url", bench.redis.url, "--mode", "sync")
            if redis_timeout is not None:
                args += ["--redis-timeout", f"{redis_timeout:g}"]
            sync.append(group.start(SidecarProcess(f"sidecar-sync-{index}", args, directory)))
        starting += sync
    _wait_all(starting)
    envoys: dict[str, list[EnvoyProcess]] = {}
    if memory is not None:
        ports = EnvoyPorts.free(app.port, memory.port)
        envoys["envoy_memory"] = [group.start(EnvoyProcess("envoy-memory", ENVOY_TEMPLATE, ports, directory))]
    for index, sidecar in enumerate(sync, start=1):
        ports = EnvoyPorts.free(app.port, sidecar.port)
        envoy = group.start(EnvoyProcess(f"envoy-sync-{index}", ENVOY_TEMPLATE, ports, directory))
        envoys.setdefault("envoy_sync", []).append(envoy)
    _wait_all([envoy for group_envoys in envoys.values() for envoy in group_envoys])
    if sync:
        wait_replicas(sync, len(sync))
    if memory is not None:
        (envoy,) = envoys["envoy_memory"]
        bench.paths["envoy_memory"] = Contender(
            "envoy_memory", [envoy.ports.listen], [envoy.pid, memory.pid], envoys["envoy_memory"], [memory]
        )
    if sync:
        assert bench.redis is not None
        pids = [*(envoy.pid for envoy in envoys["envoy_sync"]), *(s.pid for s in sync), bench.redis.pid]
        ports_in = [envoy.ports.listen for envoy in envoys["envoy_sync"]]
        bench.paths["envoy_sync"] = Contender("envoy_sync", ports_in, pids, envoys["envoy_sync"], sync)
    if any(name.startswith("haproxy") for name in names):
        haproxy_ports = HAProxyPorts.free(app.port)
        bench.haproxy_config = haproxy_config.write(directory, haproxy_ports)
        haproxy = HAProxyProcess(
            "haproxy", haproxy_ports, directory, config=bench.haproxy_config.path, log_level="notice"
        )
        group.start(haproxy)
        haproxy.wait_ready()
        bench.haproxy = haproxy
        for flavour in ("fixed", "sliding"):
            name = f"haproxy_{flavour}"
            if name in names:
                bench.paths[name] = Contender(name, [haproxy_ports.port(flavour)], [haproxy.pid])


def sidecar_shutdown_stats(bench: Bench) -> dict[str, dict[str, Any]]:
    """Per sync sidecar, its ``sync_closed`` log event (escalations, failure-mode decisions, round
    trips), read after the group is closed; {} for a sidecar that did not log it."""
    stats: dict[str, dict[str, Any]] = {}
    path = bench.paths.get("envoy_sync")
    for sidecar in path.sidecars if path else []:
        for line in sidecar.log_text().splitlines():
            if '"sync_closed"' not in line:
                continue
            try:
                event = json.loads(line)
            except ValueError:
                continue
            stats[sidecar.label] = {key: value for key, value in event.items() if isinstance(value, int)}
    return stats


def cpu_seconds_of(pids: Sequence[int]) -> float | None:
    """User + system CPU seconds of the processes (None when one is gone)."""
    seconds = [cpu_seconds(pid) for pid in pids]
    return None if any(value is None for value in seconds) else sum(value or 0.0 for value in seconds)
