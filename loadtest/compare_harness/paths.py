"""The four paths under comparison and the processes behind them, all on 127.0.0.1.

One sample app (``stack/upstream.py``) answers behind every path:

* ``envoy_memory``: one Envoy (``envoy/front.yaml``) calling one sidecar, memory backend;
* ``envoy_sync``: two Envoys, each calling its own sidecar, both in ``sync`` mode on one
  redis-server; the replay alternates each client's requests between the two Envoys, so
  the limit the two sidecars share is what is measured;
* ``haproxy_fixed`` and ``haproxy_sliding``: the two frontends of one HAProxy 2.6 running
  the comparison config (:mod:`compare_harness.haproxy_config`);
* ``envoy_sliding``: one Envoy calling one sidecar, memory backend, whose per-address rule has
  ``algorithm: sliding_window`` (``examples/config`` otherwise): HAProxy's estimate, enforced by
  the sidecar, next to ``haproxy_sliding``.

Envoys run with ``--concurrency 1`` and HAProxy with ``nbthread 1`` (the shipped config).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from loadtest.common import scrape_metrics
from loadtest.compare_harness import haproxy_config
from stack.envoy import ENVOY_CONFIGS, EnvoyPorts, EnvoyProcess
from stack.haproxy import HAProxyPorts, HAProxyProcess
from stack.processes import REPO, ProcessGroup
from stack.redis import RedisProcess
from stack.sidecar import SidecarProcess
from stack.upstream import UpstreamProcess

EXAMPLE_CONFIG = REPO / "examples" / "config"
ENVOY_TEMPLATE = ENVOY_CONFIGS / "front.yaml"
LABELS = {
    "envoy_memory": "(a) Envoy + sidecar, memory",
    "envoy_sync": "(b) 2 Envoys + 2 sidecars, sync, one Redis",
    "haproxy_fixed": "(c) HAProxy fixed windows",
    "haproxy_sliding": "(d) HAProxy sliding windows",
    "envoy_sliding": "(e) Envoy + sidecar, sliding_window, memory",
}
SHORT = {
    "envoy_memory": "(a) Envoy+sidecar memory",
    "envoy_sync": "(b) 2x Envoy+sidecar sync",
    "haproxy_fixed": "(c) HAProxy fixed",
    "haproxy_sliding": "(d) HAProxy sliding",
    "envoy_sliding": "(e) Envoy+sidecar sliding",
}
SLIDING_RULE_KEY = "remote_address"
"""The top-level rule of ``examples/config/demo.yaml`` the ``envoy_sliding`` path turns into a sliding window."""
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


def sliding_config(directory: Path) -> Path:
    """``examples/config`` with ``algorithm: sliding_window`` on the per-address rule, in ``directory``."""
    import yaml

    target = directory / "sliding-config"
    target.mkdir(parents=True, exist_ok=True)
    for source in sorted(EXAMPLE_CONFIG.glob("*.yaml")):
        document = yaml.safe_load(source.read_text())
        changed = 0
        for descriptor in document.get("descriptors", []):
            if descriptor.get("key") == SLIDING_RULE_KEY and "value" not in descriptor and "rate_limit" in descriptor:
                descriptor["rate_limit"]["algorithm"] = "sliding_window"
                changed += 1
        if document.get("domain") == "demo" and changed != 1:
            raise RuntimeError(f"{source}: no single top-level {SLIDING_RULE_KEY} rule to make a sliding window")
        header = f"# {source.name} with algorithm: sliding_window on the {SLIDING_RULE_KEY} rule (compare.py)\n"
        (target / source.name).write_text(header + yaml.safe_dump(document, sort_keys=False))
    return target


def metric(url: str, name: str) -> float | None:
    """The value of an unlabelled metric at ``url``/metrics (None when absent or unreachable)."""
    try:
        return scrape_metrics(url, timeout=2).get(name)
    except OSError:
        return None


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


def _single_sidecars(names: Sequence[str], directory: Path) -> dict[str, tuple[str, list[str]]]:
    """The one-Envoy, one-memory-sidecar paths among ``names``: path -> (process name, serve arguments)."""
    single: dict[str, tuple[str, list[str]]] = {}
    if "envoy_memory" in names:
        single["envoy_memory"] = ("memory", _sidecar_args("--backend", "memory"))
    if "envoy_sliding" in names:
        config = ["--config", str(sliding_config(directory))]
        single["envoy_sliding"] = ("sliding", [*config, *_sidecar_args("--backend", "memory")[2:]])
    return single


def _sync_builds(bench: Bench, directory: Path, redis_timeout: float | None) -> list[Callable[[], SidecarProcess]]:
    """redis-server, serving, and the builds of the two sync-mode sidecars (started with the others)."""
    bench.redis = redis = bench.group.start_ready(lambda: RedisProcess(directory))
    args = _sidecar_args("--backend", "redis", "--redis-url", redis.url, "--mode", "sync")
    if redis_timeout is not None:
        args += ["--redis-timeout", f"{redis_timeout:g}"]
    return [partial(SidecarProcess, f"sidecar-sync-{index}", args, directory) for index in (1, 2)]


def _start_envoys(
    group: ProcessGroup, app: UpstreamProcess, sidecars: dict[str, SidecarProcess], directory: Path
) -> list[EnvoyProcess]:
    """One Envoy per ``label -> sidecar``, in front of ``app``, serving. Every child here is
    started through the launchers that build it again on fresh ports when another process
    took one between choosing and binding it (a loaded CI saw it)."""

    def envoy(label: str, sidecar: SidecarProcess) -> Callable[[], EnvoyProcess]:
        return lambda: EnvoyProcess(label, ENVOY_TEMPLATE, EnvoyPorts.free(app.port, sidecar.port), directory)

    return group.start_all_ready([envoy(label, sidecar) for label, sidecar in sidecars.items()])


def _start(bench: Bench, directory: Path, names: Sequence[str], redis_timeout: float | None) -> None:
    group = bench.group
    app = group.start_ready(lambda: UpstreamProcess("app", directory))
    wanted = _single_sidecars(names, directory)
    builds: list[Callable[[], SidecarProcess]] = [
        partial(SidecarProcess, f"sidecar-{label}", args, directory) for label, args in wanted.values()
    ]
    sync_builds = _sync_builds(bench, directory, redis_timeout) if "envoy_sync" in names else []
    started = group.start_all_ready([*builds, *sync_builds])  # every sidecar comes up at once
    single = dict(zip(wanted, started[: len(builds)], strict=True))
    sync = started[len(builds) :]
    fronts = {path.replace("_", "-"): sidecar for path, sidecar in single.items()}
    fronts.update({f"envoy-sync-{index}": sidecar for index, sidecar in enumerate(sync, start=1)})
    envoys = dict(zip(fronts, _start_envoys(group, app, fronts, directory), strict=True))
    if sync:
        wait_replicas(sync, len(sync))
    for path, sidecar in single.items():
        envoy = envoys[path.replace("_", "-")]
        bench.paths[path] = Contender(path, [envoy.ports.listen], [envoy.pid, sidecar.pid], [envoy], [sidecar])
    if sync:
        assert bench.redis is not None
        sync_envoys = [envoys[f"envoy-sync-{index}"] for index in range(1, len(sync) + 1)]
        pids = [*(envoy.pid for envoy in sync_envoys), *(s.pid for s in sync), bench.redis.pid]
        ports_in = [envoy.ports.listen for envoy in sync_envoys]
        bench.paths["envoy_sync"] = Contender("envoy_sync", ports_in, pids, sync_envoys, sync)
    if any(name.startswith("haproxy") for name in names):

        def build_haproxy() -> HAProxyProcess:
            ports = HAProxyPorts.free(app.port)
            bench.haproxy_config = haproxy_config.write(directory, ports)
            return HAProxyProcess("haproxy", ports, directory, config=bench.haproxy_config.path, log_level="notice")

        bench.haproxy = haproxy = group.start_ready(build_haproxy)
        for flavour in ("fixed", "sliding"):
            name = f"haproxy_{flavour}"
            if name in names:
                bench.paths[name] = Contender(name, [haproxy.ports.port(flavour)], [haproxy.pid])


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
