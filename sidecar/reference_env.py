"""envoyproxy/ratelimit's environment variables, read as aliases of our settings.

A deployment of the reference service keeps its environment when it switches image:
``REDIS_URL``, ``RUNTIME_ROOT``, ``USE_PROMETHEUS`` ... are translated here into the
raw values of our settings (:data:`sidecar.settings.SERVE_OPTIONS`). A flag or an
``RLS_*`` variable wins over an alias of the same setting. Every reference variable
that is set but changes nothing here is named in a note (logged at startup as a
warning) saying why, so nothing is silently dropped.

:data:`REFERENCE_VARIABLES` lists every variable the reference reads, with what it
becomes here; docs/migrating.md shows it as a table (kept equal by tests/docs).
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass

RUNTIME_ROOT_DEFAULT = "/srv/runtime_data/current"
RUNTIME_APPDIRECTORY_DEFAULT = "config"
RUNTIME = ("RUNTIME_ROOT", "RUNTIME_SUBDIRECTORY", "RUNTIME_APPDIRECTORY")
REDIS_URL_SCHEMES = ("redis://", "rediss://", "unix://")
GO_TRUE = frozenset({"1", "t", "true"})
GO_FALSE = frozenset({"0", "f", "false"})
LOG_LEVELS = {"trace": "debug", "debug": "debug", "info": "info", "warn": "warning", "warning": "warning"}
LOG_LEVELS |= {"error": "error", "fatal": "error", "panic": "error"}
LOG_FORMATS = {"text": "console", "json": "json"}


class ReferenceEnvError(ValueError):
    """A reference variable has a value this sidecar cannot honour; the message names it."""


@dataclass(frozen=True)
class ReferenceVariable:
    """One variable of envoyproxy/ratelimit's settings and what it becomes here."""

    name: str
    default: str
    """The reference's default, as its settings declare it."""
    here: str
    """What it maps to (a setting), or why it is not read."""
    read: bool = True
    """False: set or not, it changes nothing here (a note says so when it is set)."""


def _ignored(name: str, default: str, why: str) -> ReferenceVariable:
    return ReferenceVariable(name, default, why, read=False)


STATS = "statsd statistics: this sidecar exposes Prometheus only (/metrics)"
PER_SECOND = "one Redis holds every window here; a second Redis for per-second limits is not supported"
POOL = "redis-py manages its connections and pipelining itself (one round trip per event-loop iteration)"
XDS_SERVER_DEFAULT = "localhost:18000"
GO_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
GO_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
TRACING = "tracing is configured with the standard OTEL_* variables (OTEL_EXPORTER_OTLP_ENDPOINT ...)"
MEMCACHE = "memcached is not a backend here: use Redis, or the embedded memory backend"

REFERENCE_VARIABLES: tuple[ReferenceVariable, ...] = (
    ReferenceVariable("HOST", "0.0.0.0", "host of `--json-address` (serves `/healthcheck`, and `/json`), with PORT"),
    ReferenceVariable(
        "PORT",
        "8080",
        "`--json-address` HOST:PORT, also at its default when a RUNTIME_* variable is set: `/healthcheck` for "
        "everyone, `/json` for loopback clients unless `--json-remote`",
    ),
    _ignored("DEBUG_HOST", "0.0.0.0", "no debug port: /config on `--metrics-address` shows the loaded rules"),
    _ignored("DEBUG_PORT", "6070", "no debug port: /config on `--metrics-address` shows the loaded rules"),
    ReferenceVariable("GRPC_UDS", "", "`--grpc-address unix:PATH` (wins over GRPC_HOST and GRPC_PORT)"),
    ReferenceVariable("GRPC_HOST", "0.0.0.0", "host of `--grpc-address`, with GRPC_PORT"),
    ReferenceVariable("GRPC_PORT", "8081", "`--grpc-address` GRPC_HOST:GRPC_PORT"),
    _ignored("GRPC_MAX_CONNECTION_AGE", "24h", "connections are kept healthy by keepalive pings instead"),
    _ignored("GRPC_MAX_CONNECTION_AGE_GRACE", "1h", "connections are kept healthy by keepalive pings instead"),
    ReferenceVariable("GRPC_SERVER_USE_TLS", "false", "true: TLS with GRPC_SERVER_TLS_CERT and _KEY"),
    ReferenceVariable("GRPC_SERVER_TLS_CERT", "", "`--tls-cert` (with GRPC_SERVER_USE_TLS=true)"),
    ReferenceVariable("GRPC_SERVER_TLS_KEY", "", "`--tls-key` (with GRPC_SERVER_USE_TLS=true)"),
    ReferenceVariable("GRPC_CLIENT_TLS_CACERT", "", "`--tls-client-ca` (mutual TLS)"),
    _ignored("GRPC_CLIENT_TLS_SAN", "", "client certificates are checked against the CA only"),
    ReferenceVariable("LOG_LEVEL", "WARN", "`--log-level` (WARN is warning; TRACE is debug; FATAL, PANIC are error)"),
    ReferenceVariable("LOG_FORMAT", "text", "`--log-format` (text is console)"),
    ReferenceVariable("CONFIG_TYPE", "FILE", "`--config-source`: FILE is file, GRPC_XDS_SOTW is xds"),
    _ignored(
        "FORCE_START_WITHOUT_INITIAL_CONFIG",
        "false",
        "files must hold a valid config to start; with GRPC_XDS_SOTW the sidecar always starts, serving the "
        "`--config` fallback (or no limits) until the first push",
    ),
    ReferenceVariable("CONFIG_GRPC_XDS_NODE_ID", "default", "`--xds-node-id`"),
    ReferenceVariable("CONFIG_GRPC_XDS_NODE_METADATA", "", "`--xds-node-metadata` (a JSON object)"),
    ReferenceVariable("CONFIG_GRPC_XDS_SERVER_URL", XDS_SERVER_DEFAULT, "`--xds-server`"),
    _ignored(
        "CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL",
        "3s",
        "every reconnect, the first included, follows XDS_CLIENT_BACKOFF_* (`--xds-backoff-*`)",
    ),
    ReferenceVariable("CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS", "", "`--xds-headers` (name:value,name:value)"),
    ReferenceVariable("CONFIG_GRPC_XDS_SERVER_USE_TLS", "false", "`--xds-tls`"),
    ReferenceVariable("CONFIG_GRPC_XDS_CLIENT_TLS_CERT", "", "`--xds-tls-cert` (with CONFIG_GRPC_XDS_SERVER_USE_TLS)"),
    ReferenceVariable("CONFIG_GRPC_XDS_CLIENT_TLS_KEY", "", "`--xds-tls-key` (with CONFIG_GRPC_XDS_SERVER_USE_TLS)"),
    ReferenceVariable("CONFIG_GRPC_XDS_SERVER_TLS_CACERT", "", "`--xds-tls-ca` (with CONFIG_GRPC_XDS_SERVER_USE_TLS)"),
    ReferenceVariable(
        "CONFIG_GRPC_XDS_SERVER_TLS_SAN", "", "`--xds-tls-server-name` (with CONFIG_GRPC_XDS_SERVER_USE_TLS)"
    ),
    ReferenceVariable("XDS_CLIENT_BACKOFF_INITIAL_INTERVAL", "10s", "`--xds-backoff-initial` (a Go duration)"),
    ReferenceVariable("XDS_CLIENT_BACKOFF_MAX_INTERVAL", "60s", "`--xds-backoff-max` (a Go duration)"),
    ReferenceVariable("XDS_CLIENT_BACKOFF_RANDOM_FACTOR", "0.5", "`--xds-backoff-jitter`"),
    ReferenceVariable("XDS_CLIENT_BACKOFF_JITTER", "true", "false: `--xds-backoff-jitter 0`"),
    ReferenceVariable("XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES", "", "`--xds-max-message-bytes`"),
    *(
        _ignored(name, default, STATS)
        for name, default in (
            ("USE_DOG_STATSD", "false"),
            ("USE_DOG_STATSD_MOGRIFIERS", ""),
            ("USE_STATSD", "true"),
            ("STATSD_HOST", "localhost"),
            ("STATSD_PORT", "8125"),
            ("EXTRA_TAGS", ""),
            ("STATS_FLUSH_INTERVAL", "10s"),
            ("DISABLE_STATS", "false"),
        )
    ),
    ReferenceVariable("USE_PROMETHEUS", "false", "true: `--metrics-address` from PROMETHEUS_ADDR"),
    ReferenceVariable("PROMETHEUS_ADDR", ":9090", "`--metrics-address` (`:9090` is 0.0.0.0:9090), with USE_PROMETHEUS"),
    ReferenceVariable("PROMETHEUS_PATH", "/metrics", "/metrics only; another path is noted and ignored"),
    _ignored("PROMETHEUS_MAPPER_YAML", "", "series follow the default mapping (key1, key2) and add `key`"),
    _ignored("PROMETHEUS_RESPONSE_TIME_AS_MILLISECONDS", "false", "latency is ratelimit_sidecar_decision_seconds"),
    ReferenceVariable(
        "RUNTIME_ROOT", RUNTIME_ROOT_DEFAULT, "`--config` RUNTIME_ROOT/RUNTIME_SUBDIRECTORY/RUNTIME_APPDIRECTORY"
    ),
    ReferenceVariable("RUNTIME_SUBDIRECTORY", "", "part of `--config` (see RUNTIME_ROOT)"),
    ReferenceVariable("RUNTIME_APPDIRECTORY", "config", "part of `--config` (see RUNTIME_ROOT)"),
    _ignored("RUNTIME_IGNOREDOTFILES", "false", "dot-files and dot-directories are always skipped (ConfigMap mounts)"),
    _ignored(
        "RUNTIME_WATCH_ROOT", "true", "the config directory is always watched: symlink swaps and edits both reload"
    ),
    _ignored("EXPIRATION_JITTER_MAX_SECONDS", "300", "keys expire a fixed grace after their window ends"),
    _ignored(
        "LOCAL_CACHE_SIZE_IN_BYTES",
        "0",
        "both modes refuse windows known to be full without a round trip (sync from its windows, strict from "
        "what Redis last reported), bounded by --max-counters",
    ),
    ReferenceVariable("NEAR_LIMIT_RATIO", "0.8", "`--near-limit-ratio`"),
    ReferenceVariable("CACHE_KEY_PREFIX", "", "`--redis-prefix` (when not empty)"),
    ReferenceVariable("BACKEND_TYPE", "redis", "redis: Redis when REDIS_URL is set; memcache is refused"),
    ReferenceVariable(
        "STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT",
        "false",
        "always so here (all-or-nothing); false is noted: use `count_past_limit` on rules that must count refused hits",
    ),
    ReferenceVariable("LIMIT_RESPONSE_HEADERS_ENABLED", "false", "`--response-headers`"),
    ReferenceVariable("LIMIT_LIMIT_HEADER", "RateLimit-Limit", "`--limit-header`"),
    ReferenceVariable("LIMIT_REMAINING_HEADER", "RateLimit-Remaining", "`--remaining-header`"),
    ReferenceVariable("LIMIT_RESET_HEADER", "RateLimit-Reset", "`--reset-header`"),
    ReferenceVariable(
        "HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED",
        "false",
        "always so here with files: the sidecar starts only with a valid config (with GRPC_XDS_SOTW, before a push)",
    ),
    ReferenceVariable("REDIS_SOCKET_TYPE", "unix", "tcp: REDIS_URL is HOST:PORT; unix: a socket path"),
    ReferenceVariable("REDIS_TYPE", "SINGLE", "SINGLE, CLUSTER (`redis+cluster://`, first address as seed), SENTINEL"),
    ReferenceVariable(
        "REDIS_URL",
        "/var/run/nutcracker/ratelimit.sock",
        "`--redis-url` and `--backend redis`; a `redis://`, `rediss://` or `unix://` URL is taken as written",
    ),
    _ignored("REDIS_POOL_SIZE", "10", POOL),
    ReferenceVariable("REDIS_AUTH", "", "the password (or user:password) in `--redis-url`"),
    ReferenceVariable("REDIS_TLS", "false", "`rediss://` (TLS)"),
    ReferenceVariable("REDIS_TLS_CLIENT_CERT", "", "`ssl_certfile` in `--redis-url`"),
    ReferenceVariable("REDIS_TLS_CLIENT_KEY", "", "`ssl_keyfile` in `--redis-url`"),
    ReferenceVariable("REDIS_TLS_CACERT", "", "`ssl_ca_certs` in `--redis-url`"),
    _ignored(
        "REDIS_TLS_SKIP_HOSTNAME_VERIFICATION",
        "false",
        "hostnames are verified (`ssl_cert_reqs=none` skips all checks)",
    ),
    _ignored("REDIS_PIPELINE_WINDOW", "0", POOL),
    _ignored("REDIS_PIPELINE_LIMIT", "0", POOL),
    _ignored("REDIS_CLUSTER_PIPELINE_PARALLELISM", "1", POOL),
    ReferenceVariable("REDIS_SENTINEL_AUTH", "", "`sentinel_password` in `--redis-url`"),
    *(
        _ignored(name, default, PER_SECOND)
        for name, default in (
            ("REDIS_PERSECOND", "false"),
            ("REDIS_PERSECOND_SOCKET_TYPE", "unix"),
            ("REDIS_PERSECOND_TYPE", "SINGLE"),
            ("REDIS_PERSECOND_URL", "/var/run/nutcracker/ratelimitpersecond.sock"),
            ("REDIS_PERSECOND_POOL_SIZE", "10"),
            ("REDIS_PERSECOND_AUTH", ""),
            ("REDIS_PERSECOND_TLS", "false"),
            ("REDIS_PERSECOND_SENTINEL_AUTH", ""),
            ("REDIS_PERSECOND_PIPELINE_WINDOW", "0"),
            ("REDIS_PERSECOND_PIPELINE_LIMIT", "0"),
            ("REDIS_PERSECOND_CLUSTER_PIPELINE_PARALLELISM", "1"),
            ("REDIS_PERSECOND_TIMEOUT", "10s"),
            ("REDIS_PERSECOND_POOL_ON_EMPTY_BEHAVIOR", "WAIT"),
        )
    ),
    _ignored(
        "REDIS_HEALTH_CHECK_ACTIVE_CONNECTION",
        "false",
        "Redis state is in ratelimit_sidecar_redis_up and the failure mode",
    ),
    _ignored(
        "REDIS_TIMEOUT",
        "10s",
        "`--redis-timeout` is a request budget in seconds (default 0.1, shortened by a caller's gRPC deadline), "
        "not an I/O timeout",
    ),
    _ignored("REDIS_POOL_ON_EMPTY_BEHAVIOR", "WAIT", POOL),
    _ignored(
        "REDIS_STARTUP_INITIAL_INTERVAL",
        "1s",
        "the sidecar serves at once; the failure mode decides until Redis answers",
    ),
    _ignored(
        "REDIS_STARTUP_MAX_INTERVAL", "30s", "the sidecar serves at once; the failure mode decides until Redis answers"
    ),
    _ignored(
        "REDIS_STARTUP_MAX_ELAPSED_TIME",
        "0",
        "the sidecar serves at once; the failure mode decides until Redis answers",
    ),
    *(
        _ignored(name, default, MEMCACHE)
        for name, default in (
            ("MEMCACHE_HOST_PORT", ""),
            ("MEMCACHE_MAX_IDLE_CONNS", "2"),
            ("MEMCACHE_SRV", ""),
            ("MEMCACHE_SRV_REFRESH", "0"),
            ("MEMCACHE_TLS", "false"),
            ("MEMCACHE_TLS_CLIENT_CERT", ""),
            ("MEMCACHE_TLS_CLIENT_KEY", ""),
            ("MEMCACHE_TLS_CACERT", ""),
            ("MEMCACHE_TLS_SKIP_HOSTNAME_VERIFICATION", "false"),
        )
    ),
    ReferenceVariable("SHADOW_MODE", "false", "`--shadow-mode`"),
    _ignored("QUOTA_MODE", "false", "no global quota mode: set `quota_mode: true` on the descriptors"),
    ReferenceVariable("RESPONSE_DYNAMIC_METADATA", "false", "`--response-dynamic-metadata`"),
    ReferenceVariable("MERGE_DOMAIN_CONFIG", "false", "`--merge-domain-config`"),
    ReferenceVariable("USE_CALENDAR_MONTH_RATE_LIMIT", "false", "`--calendar-months`"),
    *(
        _ignored(name, default, TRACING)
        for name, default in (
            ("TRACING_ENABLED", "false"),
            ("TRACING_SERVICE_NAME", "RateLimit"),
            ("TRACING_SERVICE_NAMESPACE", ""),
            ("TRACING_SERVICE_INSTANCE_ID", ""),
            ("TRACING_EXPORTER_PROTOCOL", "http"),
            ("TRACING_SAMPLING_RATE", "1"),
        )
    ),
)
BY_NAME = {variable.name: variable for variable in REFERENCE_VARIABLES}

Note = tuple[str, str]
"""``(variable, why it changes nothing here)``."""
Aliases = dict[str, tuple[str, str]]
"""Our setting's name to ``(raw value, the variables it came from)``."""


def go_bool(name: str, text: str) -> bool:
    """A boolean as Go's ``strconv.ParseBool`` reads it (case-insensitive here)."""
    lowered = text.strip().lower()
    if lowered in GO_TRUE:
        return True
    if lowered in GO_FALSE:
        return False
    raise ReferenceEnvError(f"{name}={text!r}: must be true or false")


def go_duration(name: str, text: str) -> float:
    """Seconds from a Go duration (``10s``, ``1m30s``, ``500ms``)."""
    stripped = text.strip()
    parts = GO_DURATION.findall(stripped)
    if not parts or "".join(number + unit for number, unit in parts) != stripped:
        raise ReferenceEnvError(f"{name}={text!r}: must be a Go duration such as 10s, 1m30s or 500ms")
    return sum(float(number) * GO_UNITS[unit] for number, unit in parts)


def listen_address(text: str, default_host: str) -> str:
    """``HOST:PORT`` from a Go listen address (``:9090`` listens on every interface)."""
    host, _, port = text.strip().rpartition(":")
    return f"{host or default_host}:{port}"


class Translation:
    """Reads one environment; :meth:`aliases` and :attr:`notes` are what it found."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        self.env = {name: environ[name] for name in BY_NAME if name in environ}
        self.values: Aliases = {}
        self.notes: list[Note] = []

    def set(self, setting: str, value: str, *sources: str) -> None:
        self.values[setting] = (value, ", ".join(sources))

    def flag(self, name: str) -> bool | None:
        return go_bool(name, self.env[name]) if name in self.env else None

    def translate(self) -> Aliases:
        env = self.env
        for variable in REFERENCE_VARIABLES:
            if variable.name in env and not variable.read:
                self.notes.append((variable.name, variable.here))
        self._listeners()
        self._logs()
        self._config()
        self._redis()
        self._switches()
        return self.values

    def _listeners(self) -> None:
        env = self.env
        if env.get("GRPC_UDS"):
            self.set("grpc_address", "unix:" + env["GRPC_UDS"], "GRPC_UDS")
        elif "GRPC_HOST" in env or "GRPC_PORT" in env:
            address = f"{env.get('GRPC_HOST') or '0.0.0.0'}:{env.get('GRPC_PORT') or '8081'}"
            self.set("grpc_address", address, "GRPC_HOST", "GRPC_PORT")
        if "HOST" in env or "PORT" in env or self.runtime_config():
            # The reference always listens on HOST:PORT: its deployments probe /healthcheck there.
            # /json on it answers loopback clients only, unless --json-remote (see docs/migrating.md).
            self.set("json_address", f"{env.get('HOST') or '0.0.0.0'}:{env.get('PORT') or '8080'}", "HOST", "PORT")
        if self.flag("USE_PROMETHEUS"):
            address = listen_address(env.get("PROMETHEUS_ADDR", ":9090"), "0.0.0.0")
            self.set("metrics_address", address, "USE_PROMETHEUS", "PROMETHEUS_ADDR")
        elif "PROMETHEUS_ADDR" in env:
            self.notes.append(("PROMETHEUS_ADDR", "read only with USE_PROMETHEUS=true"))
        if env.get("PROMETHEUS_PATH", "/metrics") != "/metrics":
            self.notes.append(("PROMETHEUS_PATH", "metrics are served at /metrics only"))
        if self.flag("GRPC_SERVER_USE_TLS"):
            for name, setting in (("GRPC_SERVER_TLS_CERT", "tls_cert"), ("GRPC_SERVER_TLS_KEY", "tls_key")):
                if env.get(name):
                    self.set(setting, env[name], name)
        elif env.get("GRPC_SERVER_TLS_CERT") or env.get("GRPC_SERVER_TLS_KEY"):
            self.notes.append(("GRPC_SERVER_TLS_CERT", "read only with GRPC_SERVER_USE_TLS=true"))
        if env.get("GRPC_CLIENT_TLS_CACERT"):
            self.set("tls_client_ca", env["GRPC_CLIENT_TLS_CACERT"], "GRPC_CLIENT_TLS_CACERT")

    def _logs(self) -> None:
        env = self.env
        if "LOG_LEVEL" in env:
            level = LOG_LEVELS.get(env["LOG_LEVEL"].strip().lower())
            if level is None:
                raise ReferenceEnvError(f"LOG_LEVEL={env['LOG_LEVEL']!r}: must be one of {', '.join(LOG_LEVELS)}")
            self.set("log_level", level, "LOG_LEVEL")
        if "LOG_FORMAT" in env:
            shown = LOG_FORMATS.get(env["LOG_FORMAT"].strip().lower())
            if shown is None:
                raise ReferenceEnvError(f"LOG_FORMAT={env['LOG_FORMAT']!r}: must be text or json")
            self.set("log_format", shown, "LOG_FORMAT")

    def _config(self) -> None:
        env = self.env
        kind = env.get("CONFIG_TYPE", "FILE").strip().upper()
        if kind not in {"FILE", "GRPC_XDS_SOTW"}:
            raise ReferenceEnvError(f"CONFIG_TYPE={env['CONFIG_TYPE']!r}: must be FILE or GRPC_XDS_SOTW")
        if "CONFIG_TYPE" in env:
            self.set("config_source", "file" if kind == "FILE" else "xds", "CONFIG_TYPE")
        self._xds()
        if self.runtime_config():
            root = (env.get("RUNTIME_ROOT") or RUNTIME_ROOT_DEFAULT).rstrip("/") or "/"
            below = [env.get("RUNTIME_SUBDIRECTORY", ""), env.get("RUNTIME_APPDIRECTORY") or "config"]
            self.set("config", "/".join([root, *(part.strip("/") for part in below if part.strip("/"))]), *RUNTIME)

    def _xds(self) -> None:
        """The xDS client's variables (read whatever CONFIG_TYPE says, as the reference does)."""
        env = self.env
        texts = {
            "CONFIG_GRPC_XDS_NODE_ID": "xds_node_id",
            "CONFIG_GRPC_XDS_NODE_METADATA": "xds_node_metadata",
            "CONFIG_GRPC_XDS_SERVER_URL": "xds_server",
            "CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS": "xds_headers",
            "XDS_CLIENT_BACKOFF_RANDOM_FACTOR": "xds_backoff_jitter",
            "XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES": "xds_max_message_bytes",
        }
        for name, setting in texts.items():
            if env.get(name, "").strip():
                self.set(setting, env[name], name)
        if self.values.get("config_source", ("",))[0] == "xds" and "xds_server" not in self.values:
            self.set("xds_server", XDS_SERVER_DEFAULT, "CONFIG_GRPC_XDS_SERVER_URL")  # the reference's default
        for name, setting in (
            ("XDS_CLIENT_BACKOFF_INITIAL_INTERVAL", "xds_backoff_initial"),
            ("XDS_CLIENT_BACKOFF_MAX_INTERVAL", "xds_backoff_max"),
        ):
            if env.get(name, "").strip():
                self.set(setting, repr(go_duration(name, env[name])), name)
        if self.flag("XDS_CLIENT_BACKOFF_JITTER") is False:
            self.set("xds_backoff_jitter", "0", "XDS_CLIENT_BACKOFF_JITTER")
        self._xds_tls()

    def _xds_tls(self) -> None:
        """TLS to the control plane: its files are read only with CONFIG_GRPC_XDS_SERVER_USE_TLS, as there."""
        env = self.env
        files = {
            "CONFIG_GRPC_XDS_SERVER_TLS_CACERT": "xds_tls_ca",
            "CONFIG_GRPC_XDS_CLIENT_TLS_CERT": "xds_tls_cert",
            "CONFIG_GRPC_XDS_CLIENT_TLS_KEY": "xds_tls_key",
            "CONFIG_GRPC_XDS_SERVER_TLS_SAN": "xds_tls_server_name",
        }
        if not self.flag("CONFIG_GRPC_XDS_SERVER_USE_TLS"):
            self.notes += [
                (name, "read only with CONFIG_GRPC_XDS_SERVER_USE_TLS=true") for name in files if env.get(name)
            ]
            return
        self.set("xds_tls", "true", "CONFIG_GRPC_XDS_SERVER_USE_TLS")
        for name, setting in files.items():
            if env.get(name, "").strip():
                self.set(setting, env[name], name)

    def runtime_config(self) -> bool:
        """Whether the config is read where the reference reads it (a RUNTIME_* variable is
        set): the sign of a reference deployment, which also gets the reference's HTTP port."""
        return any(name in self.env for name in RUNTIME)

    def _redis(self) -> None:
        env = self.env
        backend = env.get("BACKEND_TYPE", "redis").strip().lower()
        if backend not in {"redis", ""}:
            raise ReferenceEnvError(f"BACKEND_TYPE={env['BACKEND_TYPE']!r}: {MEMCACHE}")
        if not env.get("REDIS_URL"):
            if "BACKEND_TYPE" in env:
                self.notes.append(("BACKEND_TYPE", "no REDIS_URL: the embedded memory backend decides"))
            return
        given = env["REDIS_URL"].strip()
        url = url_as_given(env, given) if "://" in given else redis_url(env)
        self.set("redis_url", url, "REDIS_URL", "REDIS_TYPE", "REDIS_SOCKET_TYPE", "REDIS_AUTH", "REDIS_TLS")
        self.set("backend", "redis", "REDIS_URL")
        if env.get("REDIS_TYPE", "").strip().lower() == "cluster" and "," in env["REDIS_URL"]:
            self.notes.append(("REDIS_URL", "Redis Cluster: the first address is the seed; the others are discovered"))

    def _switches(self) -> None:
        env = self.env
        plain = {
            "SHADOW_MODE": "shadow_mode",
            "LIMIT_RESPONSE_HEADERS_ENABLED": "response_headers",
            "RESPONSE_DYNAMIC_METADATA": "response_dynamic_metadata",
            "MERGE_DOMAIN_CONFIG": "merge_domain_config",
            "USE_CALENDAR_MONTH_RATE_LIMIT": "calendar_months",
        }
        for name, setting in plain.items():
            if name in env:
                self.set(setting, str(go_bool(name, env[name])).lower(), name)
        texts = {
            "NEAR_LIMIT_RATIO": "near_limit_ratio",
            "LIMIT_LIMIT_HEADER": "limit_header",
            "LIMIT_REMAINING_HEADER": "remaining_header",
            "LIMIT_RESET_HEADER": "reset_header",
            "CACHE_KEY_PREFIX": "redis_prefix",
        }
        for name, setting in texts.items():
            if env.get(name, "").strip():
                self.set(setting, env[name], name)
        if self.flag("STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT") is False:
            self.notes.append(
                (
                    "STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT",
                    "refused hits are never counted here (all-or-nothing); set count_past_limit: true on the "
                    "rate limits whose refused hits must count",
                )
            )
        if self.flag("HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED") is False:
            self.notes.append(
                ("HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED", "with files it never serves without a valid config")
            )


def redis_url(env: Mapping[str, str]) -> str:
    """``--redis-url`` from ``REDIS_URL``, ``REDIS_TYPE``, ``REDIS_SOCKET_TYPE``, ``REDIS_AUTH``,
    ``REDIS_TLS``, ``REDIS_TLS_*`` and ``REDIS_SENTINEL_AUTH``."""
    address = env["REDIS_URL"].strip()
    kind = env.get("REDIS_TYPE", "SINGLE").strip().lower()
    socket = env.get("REDIS_SOCKET_TYPE", "unix").strip().lower()
    tls = go_bool("REDIS_TLS", env["REDIS_TLS"]) if "REDIS_TLS" in env else False
    auth = env.get("REDIS_AUTH", "")
    user, _, password = auth.rpartition(":") if ":" in auth else ("", "", auth)
    userinfo = ""
    if password:
        quoted = urllib.parse.quote(password, safe="")
        userinfo = f"{urllib.parse.quote(user, safe='')}:{quoted}@" if user else f":{quoted}@"
    query: dict[str, str] = {}
    for name, option in (
        ("REDIS_TLS_CACERT", "ssl_ca_certs"),
        ("REDIS_TLS_CLIENT_CERT", "ssl_certfile"),
        ("REDIS_TLS_CLIENT_KEY", "ssl_keyfile"),
    ):
        if env.get(name):
            query[option] = env[name]
    if kind not in {"single", "cluster", "sentinel"}:
        raise ReferenceEnvError(f"REDIS_TYPE={env['REDIS_TYPE']!r}: must be SINGLE, CLUSTER or SENTINEL")
    if socket not in {"tcp", "unix"}:
        raise ReferenceEnvError(f"REDIS_SOCKET_TYPE={env['REDIS_SOCKET_TYPE']!r}: must be tcp or unix")
    if socket == "unix" and kind == "single" and address.startswith("/"):
        if password:
            query["password"] = password
            if user:
                query["username"] = user
        return "unix://" + address + (("?" + urllib.parse.urlencode(query)) if query else "")
    secure = "s" if tls else ""
    if kind == "sentinel":
        service, _, hosts = address.partition(",")
        if not hosts:
            raise ReferenceEnvError("REDIS_URL: with REDIS_TYPE=SENTINEL it is MASTER_NAME,HOST:PORT[,HOST:PORT...]")
        if env.get("REDIS_SENTINEL_AUTH"):
            query["sentinel_password"] = env["REDIS_SENTINEL_AUTH"]
        suffix = ("?" + urllib.parse.urlencode(query)) if query else ""
        return f"redis{secure}+sentinel://{userinfo}{hosts}/{service}{suffix}"
    suffix = ("?" + urllib.parse.urlencode(query)) if query else ""
    if kind == "cluster":
        return f"redis{secure}+cluster://{userinfo}{address.split(',')[0].strip()}{suffix}"
    return f"redis{secure}://{userinfo}{address}{suffix}"


def url_as_given(env: Mapping[str, str], address: str) -> str:
    """``REDIS_URL`` already written as a URL (``redis://host:port``, where the reference takes
    ``host:port``): used as given when it is a plain Redis URL and nothing else would have to
    be folded into it; otherwise :class:`ReferenceEnvError` says what to write instead. The
    message never repeats the URL (it may hold a password)."""
    scheme = address.partition("://")[0].lower() + "://"
    if scheme not in REDIS_URL_SCHEMES:
        raise ReferenceEnvError(
            "REDIS_URL: takes HOST:PORT (or a socket path, or a redis://, rediss:// or unix:// URL), "
            f"not a {scheme} URL; for Cluster or Sentinel set REDIS_TYPE and list HOST:PORT addresses"
        )
    folded = ("REDIS_AUTH", "REDIS_TLS_CACERT", "REDIS_TLS_CLIENT_CERT", "REDIS_TLS_CLIENT_KEY")
    clashing = [name for name in folded if env.get(name)]
    if env.get("REDIS_TYPE", "SINGLE").strip().lower() != "single":
        clashing.append("REDIS_TYPE")
    if "REDIS_TLS" in env and go_bool("REDIS_TLS", env["REDIS_TLS"]) != (scheme == "rediss://"):
        clashing.append("REDIS_TLS")
    if clashing:
        raise ReferenceEnvError(
            f"REDIS_URL is a URL, so {', '.join(clashing)} cannot be added to it: write REDIS_URL as HOST:PORT "
            "(the reference's form), or put everything in the URL and unset them"
        )
    return address


def reference_aliases(environ: Mapping[str, str]) -> tuple[Aliases, list[Note]]:
    """Raw values of our settings from the reference's variables in ``environ``, and the
    notes on variables that change nothing; :class:`ReferenceEnvError` for a value that
    cannot be honoured."""
    translation = Translation(environ)
    values = translation.translate()
    return values, translation.notes


def variables_table() -> str:
    """Every reference variable and what it becomes here, as a Markdown table (docs/migrating.md)."""
    rows = ["| envoyproxy/ratelimit | its default | here |", "|---|---|---|"]
    for variable in REFERENCE_VARIABLES:
        default = f"`{variable.default}`" if variable.default else "(none)"
        here = variable.here if variable.read else f"not read: {variable.here}"
        rows.append(f"| `{variable.name}` | {default} | {here} |")
    return "\n".join(rows)
