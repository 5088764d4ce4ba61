"""Typed settings from command-line flags and ``RLS_*`` environment variables.

Each setting is declared once in :data:`SERVE_OPTIONS`; the flag, the environment
variable, the parser and the README table all come from that declaration, so they
cannot drift apart. A flag wins over its environment variable, which wins over an
envoyproxy/ratelimit variable standing for it (:mod:`sidecar.reference_env`), which
wins over ``RLS_<NAME>_DEFAULT`` (a default an image can bake in without shadowing
what a user sets: the Dockerfile's ``RLS_CONFIG_DEFAULT``), which wins over the default.
"""

from __future__ import annotations

import argparse
import difflib
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, dataclass
from typing import Any, Literal

from sidecar import admin
from sidecar.config.xds_source import XdsOptions, header_pairs, json_object
from sidecar.config.yaml_source import MAX_FILE_BYTES
from sidecar.limiter.bounds import DEFAULT_MAX_COUNTERS
from sidecar.limiter.budget import DEFAULT_REDIS_TIMEOUT
from sidecar.limiter.failure import FailureMode
from sidecar.limiter.redis.connect import SCHEME, RedisUrlError, SentinelUrlError, check_url, is_sentinel_url
from sidecar.option_values import (
    at_least,
    boolean,
    finite_float,
    fraction,
    grpc_address,
    header_name,
    host_port,
    key_prefix,
    non_empty,
    non_negative_float,
    one_of,
    optional_host_port,
    positive_float,
    positive_int,
)
from sidecar.quota.partition import HOLD_LEASES, AfterHold, lease_seconds
from sidecar.reference_env import Note, ReferenceEnvError, reference_aliases
from sidecar.service.headers import HeaderStyle

ENV_PREFIX = "RLS_"
REDIS_SCHEMES = (
    "redis://",
    "rediss://",
    "redis+cluster://",
    "rediss+cluster://",
    "redis+sentinel://",
    "rediss+sentinel://",
    "unix://",
)


Backend = Literal["memory", "redis"]
RedisMode = Literal["sync", "strict"]
ClockSource = Literal["redis", "local"]
LogLevel = Literal["debug", "info", "warning", "error"]
LogFormat = Literal["json", "console", "auto"]
ConfigSource = Literal["file", "xds"]
QuotaProcess = Literal["worker", "inline"]


class SettingsError(ValueError):
    """A flag or environment variable has a value we cannot use; names which one."""


def _json_object(text: str) -> str:
    json_object(text)
    return text


def _header_pairs(text: str) -> str:
    header_pairs(text)
    return text


@dataclass(frozen=True)
class Option:
    """One setting: its flag, environment variable, parser, default and help."""

    name: str
    parse: Callable[[str], Any]
    help: str
    is_flag: bool = False

    @property
    def default(self) -> Any:
        """The default, written once: on :class:`Settings` (None for a required setting)."""
        default = Settings.__dataclass_fields__[self.name].default
        return None if default is MISSING else default

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()


SERVE_OPTIONS: tuple[Option, ...] = (
    Option(
        "config",
        non_empty,
        "descriptor config: one YAML file or a directory of them (required with --config-source file; with xds, "
        "the limits served until the control plane's first push)",
    ),
    Option("config_source", one_of(ConfigSource), "file (--config, reloaded on change) or xds (--xds-server)"),
    Option("xds_server", host_port, "--config-source xds: the control plane's ADS address, HOST:PORT (plaintext)"),
    Option("xds_node_id", non_empty, "--config-source xds: the node id announced to the control plane"),
    Option("xds_node_metadata", _json_object, "--config-source xds: node metadata, a JSON object"),
    Option("xds_headers", _header_pairs, "--config-source xds: gRPC metadata on the stream, name:value,name:value"),
    Option("xds_tls", boolean, "--config-source xds: TLS to the control plane", is_flag=True),
    Option("xds_tls_ca", non_empty, "--xds-tls: CAs the control plane's certificate must chain to (else the system's)"),
    Option("xds_tls_cert", non_empty, "--xds-tls: client certificate (PEM) for mutual TLS, with --xds-tls-key"),
    Option("xds_tls_key", non_empty, "--xds-tls: the client certificate's private key (PEM)"),
    Option("xds_tls_server_name", non_empty, "--xds-tls: name the certificate must carry, if not the host's"),
    Option("xds_backoff_initial", positive_float, "--config-source xds: first reconnect delay, seconds (doubling)"),
    Option("xds_backoff_max", positive_float, "--config-source xds: longest reconnect delay, seconds"),
    Option("xds_backoff_jitter", fraction, "--config-source xds: each delay is spread over delay x (1 +/- this)"),
    Option("xds_max_message_bytes", positive_int, "--config-source xds: largest DiscoveryResponse accepted, bytes"),
    Option(
        "max_config_bytes",
        positive_int,
        "largest config file, in bytes: a larger *.yaml is refused before it is read (startup, check-config, reload)",
    ),
    Option(
        "grpc_address",
        grpc_address,
        "where the gRPC service listens: HOST:PORT (loopback by default), or unix:PATH for a unix socket",
    ),
    Option(
        "backend",
        one_of(Backend),
        "where counters live: memory (embedded) or redis",
    ),
    Option(
        "instances",
        positive_int,
        "memory backend: replicas sharing each limit without Redis; each enforces ceil(limit / N)",
    ),
    Option(
        "max_counters",
        positive_int,
        "cap on live counters held in this process; the window that ends first is evicted first",
    ),
    Option(
        "shadow_mode",
        boolean,
        "report verdicts but admit every request (overall_code always OK)",
        is_flag=True,
    ),
    Option(
        "redis_url",
        str,
        "redis://[user:password@]host:port[/db], rediss:// for TLS, redis+cluster:// for Redis Cluster, "
        "redis+sentinel://host:26379[,host:26379]/service[/db] for Sentinel (rediss+sentinel:// with TLS)",
    ),
    Option(
        "redis_cluster",
        boolean,
        "treat --redis-url as a Redis Cluster seed node",
        is_flag=True,
    ),
    Option(
        "mode",
        one_of(RedisMode),
        "redis backend: sync (local windows reconciled off the request path) or strict (an atomic script per request)",
    ),
    Option(
        "sync_interval",
        positive_float,
        "seconds between two flushes of pending hits to Redis (sync mode)",
    ),
    Option(
        "sync_max_overshoot",
        fraction,
        "sync mode: proven bound on hits admitted beyond a limit, as a fraction of it (0 = exact near the limit)",
    ),
    Option(
        "redis_timeout",
        positive_float,
        "longest a request waits for Redis (strict mode, sync-mode escalation), seconds: the budget of callers "
        "without a gRPC deadline, and the upper bound for those with one (who wait until shortly before it)",
    ),
    Option(
        "redis_failure_mode",
        one_of(FailureMode),
        "while Redis is unreachable: local (enforce limit / live replicas here), open (admit), closed (reject)",
    ),
    Option("redis_prefix", key_prefix, "prefix of every Redis key this sidecar writes"),
    Option(
        "clock_source",
        one_of(ClockSource),
        "redis backend: cut windows on Redis's clock (TIME, sampled each heartbeat), so host clock skew "
        "does not matter; local: this host's clock",
    ),
    Option(
        "clock_offset",
        finite_float,
        "seconds added to this host's clock: a deliberate skew, for testing what skew does",
    ),
    Option(
        "heartbeat_interval",
        positive_float,
        "seconds between replica heartbeats in Redis; a replica missing 3 is dead",
    ),
    Option(
        "shutdown_grace",
        non_negative_float,
        "seconds in-flight calls get to finish on SIGTERM/SIGINT",
    ),
    Option(
        "tls_cert",
        str,
        "PEM certificate (chain) for the gRPC server; with --tls-key turns TLS on",
    ),
    Option("tls_key", str, "PEM private key of --tls-cert"),
    Option(
        "tls_client_ca",
        str,
        "PEM CA bundle: require client certificates signed by it (mutual TLS)",
    ),
    Option(
        "watch_config",
        boolean,
        "reload the config when its file or directory changes (ConfigMap updates too); SIGHUP always reloads",
    ),
    Option(
        "metrics_address",
        optional_host_port,
        "plain HTTP for /metrics (Prometheus), /config and /healthz; empty turns it off",
    ),
    Option(
        "admin_write_timeout",
        positive_float,
        "seconds an admin client (/metrics, /config, /healthz) gets to read its whole answer; "
        "slower readers are dropped",
    ),
    Option(
        "admin_max_connections",
        positive_int,
        "admin connections open at once; more get a short 503",
    ),
    Option(
        "json_address",
        optional_host_port,
        "plain HTTP POST /json: ShouldRateLimit as JSON for apps that do not speak gRPC (no TLS: keep it on "
        "loopback, for example 127.0.0.1:8082); empty turns it off",
    ),
    Option(
        "json_remote",
        boolean,
        "answer POST /json from clients beyond loopback too (plain HTTP, no TLS: they can spend every limit); "
        "without it they get 403, and only /healthcheck answers everyone",
        is_flag=True,
    ),
    Option(
        "near_limit_ratio",
        fraction,
        "a hit counts as near_limit in the metrics once it takes its counter past floor(limit x this fraction)",
    ),
    Option(
        "response_headers",
        boolean,
        "add RateLimit-Limit/-Remaining/-Reset (and Retry-After when refused) for the tightest limit "
        "to each response through Envoy (response_headers_to_add)",
        is_flag=True,
    ),
    Option("limit_header", header_name, "--response-headers: name of the limit header"),
    Option(
        "remaining_header",
        header_name,
        "--response-headers: name of the remaining-hits header",
    ),
    Option(
        "reset_header",
        header_name,
        "--response-headers: name of the seconds-until-reset header",
    ),
    Option(
        "response_header_style",
        one_of(HeaderStyle),
        "--response-headers: draft-03 (RateLimit-Limit/-Remaining/-Reset), ietf (the RateLimit-Policy and "
        "RateLimit structured fields of draft-ietf-httpapi-ratelimit-headers-11) or both",
    ),
    Option(
        "response_dynamic_metadata",
        boolean,
        "answer with envoyproxy/ratelimit's dynamic metadata (domain, descriptors, and the metadata of the "
        "descriptors that pass), which Envoy stores under envoy.filters.http.ratelimit",
        is_flag=True,
    ),
    Option(
        "merge_domain_config",
        boolean,
        "merge config files that name the same domain (their top-level descriptors must differ)",
        is_flag=True,
    ),
    Option(
        "calendar_months",
        boolean,
        "unit: month is the UTC calendar month (reset at the first of the month), not 30 days from the epoch",
        is_flag=True,
    ),
    Option(
        "warn_header",
        header_name,
        "header sent on admitted requests past a rule's warn_at (soft limit), with or without --response-headers",
    ),
    Option(
        "request_log_sample",
        positive_int,
        "at --log-level debug, log one decision in this many (1 = every request)",
    ),
    Option(
        "quota_ttl",
        at_least(3, "refreshed every third of it, Envoy needs whole seconds"),
        "quota mode: assignment_time_to_live (whole seconds) of every bucket assignment; pushed again every TTL/3",
    ),
    Option(
        "quota_idle_abandon",
        at_least(10, "Envoy reports usage every 5 s"),
        "quota mode: seconds without a request after which a bucket is abandoned (abandon_action) and forgotten",
    ),
    Option(
        "quota_max_buckets",
        positive_int,
        "quota mode: cap on live buckets in this process; new buckets beyond it get ALLOW_ALL and no state",
    ),
    Option(
        "quota_max_buckets_per_stream",
        positive_int,
        "quota mode: cap on live buckets per Envoy stream; new buckets beyond it get ALLOW_ALL and no state",
    ),
    Option(
        "quota_max_streams",
        positive_int,
        "quota mode: cap on open StreamRateLimitQuotas streams in this process; more are refused RESOURCE_EXHAUSTED",
    ),
    Option(
        "quota_partition_hold",
        non_negative_float,
        "quota mode, --backend redis: seconds a silent replica's last lease stays reserved in Redis, and a replica "
        f"cut from Redis keeps its last grant; at least one lease (--quota-ttl + 10 s); 0: {HOLD_LEASES} leases, "
        "280 s at --quota-ttl 60",
    ),
    Option(
        "quota_after_hold",
        one_of(AfterHold),
        "quota mode, --backend redis: what a replica cut from Redis enforces once the hold ended: deny (nothing: "
        "within the limit in every partition) or share (ceil(limit / live replicas): a full Redis outage stays "
        "available, a longer partition may exceed the limit by that much per cut replica)",
    ),
    Option(
        "quota_process",
        one_of(QuotaProcess),
        "quota mode: worker (RLQS streams, buckets and shares in a child process started on the first stream; "
        "this process relays the streams as bytes, so their work never delays a ShouldRateLimit) or inline "
        "(all in this process: one process less, but a 20,000-bucket reconnect costs the decisions 10-30 ms)",
    ),
    Option("log_level", one_of(LogLevel), "log level"),
    Option(
        "log_format",
        one_of(LogFormat),
        "json, console, or auto (console on a terminal)",
    ),
)


@dataclass(frozen=True)
class Settings:
    """Everything ``serve`` needs, validated."""

    config: str = ""
    config_source: ConfigSource = "file"
    xds_server: str = ""
    xds_node_id: str = XdsOptions.node_id
    xds_node_metadata: str = ""
    xds_headers: str = ""
    xds_tls: bool = False
    xds_tls_ca: str = ""
    xds_tls_cert: str = ""
    xds_tls_key: str = ""
    xds_tls_server_name: str = ""
    xds_backoff_initial: float = XdsOptions.backoff_initial
    xds_backoff_max: float = XdsOptions.backoff_max
    xds_backoff_jitter: float = XdsOptions.backoff_jitter
    xds_max_message_bytes: int = XdsOptions.max_message_bytes
    max_config_bytes: int = MAX_FILE_BYTES
    grpc_address: str = "127.0.0.1:8081"
    backend: Backend = "memory"
    instances: int = 1
    max_counters: int = DEFAULT_MAX_COUNTERS
    shadow_mode: bool = False
    redis_url: str = ""
    redis_cluster: bool = False
    mode: RedisMode = "sync"
    sync_interval: float = 0.05
    sync_max_overshoot: float = 0.05
    redis_timeout: float = DEFAULT_REDIS_TIMEOUT
    redis_failure_mode: FailureMode = "local"
    redis_prefix: str = "rls"
    clock_source: ClockSource = "redis"
    clock_offset: float = 0.0
    heartbeat_interval: float = 1.0
    shutdown_grace: float = 10.0
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    watch_config: bool = True
    metrics_address: str = "127.0.0.1:9090"
    admin_write_timeout: float = admin.WRITE_TIMEOUT
    admin_max_connections: int = admin.MAX_CONNECTIONS
    json_address: str = ""
    json_remote: bool = False
    near_limit_ratio: float = 0.8
    response_headers: bool = False
    limit_header: str = "RateLimit-Limit"
    remaining_header: str = "RateLimit-Remaining"
    reset_header: str = "RateLimit-Reset"
    response_header_style: HeaderStyle = "draft-03"
    response_dynamic_metadata: bool = False
    merge_domain_config: bool = False
    calendar_months: bool = False
    warn_header: str = "X-RateLimit-Warning"
    request_log_sample: int = 100
    quota_ttl: int = 60
    quota_idle_abandon: int = 120
    quota_max_buckets: int = 100_000
    quota_max_buckets_per_stream: int = 20_000
    quota_max_streams: int = 100
    quota_partition_hold: float = 0.0
    quota_after_hold: AfterHold = "deny"
    quota_process: QuotaProcess = "worker"
    log_level: LogLevel = "info"
    log_format: LogFormat = "auto"


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare every serve option as a flag; values stay strings until :func:`resolve`."""
    for option in SERVE_OPTIONS:
        help_text = f"{option.help} [env {option.env}; default {option.default}]"
        if option.is_flag:
            parser.add_argument(option.flag, dest=option.name, action="store_const", const="true", help=help_text)
        else:
            parser.add_argument(option.flag, dest=option.name, metavar=option.name.upper(), help=help_text)


DEFAULT_SUFFIX = "_DEFAULT"


def _value(option: Option, raw: str | None, environ: Mapping[str, str], alias: tuple[str, str] | None = None) -> Any:
    """One option's value: the flag's text, else its variable's, else the envoyproxy/ratelimit
    variable that stands for it (``alias``: its text and name), else ``RLS_<NAME>_DEFAULT``
    (an image's default, below everything a user sets), else the default."""
    source = option.flag
    if raw is None:
        raw, source = environ.get(option.env), option.env
    if raw is None and alias is not None:
        raw, source = alias
    if raw is None:
        raw, source = environ.get(option.env + DEFAULT_SUFFIX), option.env + DEFAULT_SUFFIX
    if raw is None:
        if option.default is None:
            raise SettingsError(f"{option.flag} (or {option.env}) is required")
        return option.default
    try:
        return option.parse(raw)
    except ValueError as error:
        raise SettingsError(f"{source}={raw!r}: {error}") from None


def option_value(name: str, flag: str | None, environ: Mapping[str, str] = os.environ) -> Any:
    """One serve option read as :func:`resolve` reads it (envoyproxy/ratelimit's variables
    included), for another command that takes it too (``check-config --max-config-bytes``,
    ``health``'s address); ``flag`` is the flag's text, if given. A reference variable this
    option does not read but ``serve`` would refuse (``LOG_LEVEL=verbose``) is left to
    ``serve`` to report: ``check-config`` and ``health`` still work."""
    (option,) = (option for option in SERVE_OPTIONS if option.name == name)
    try:
        alias = reference_aliases(environ)[0].get(name)
    except ReferenceEnvError:
        alias = None
    return _value(option, flag, environ, alias)


def resolve(arguments: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> Settings:
    """Combine flags, environment and defaults; raises :class:`SettingsError` naming the culprit."""
    return resolve_with_notes(arguments, environ)[0]


def resolve_with_notes(
    arguments: argparse.Namespace, environ: Mapping[str, str] = os.environ
) -> tuple[Settings, list[Note]]:
    """:func:`resolve`, with notes on the envoyproxy/ratelimit variables that changed nothing:
    ``(variable, why)``, to be logged as warnings once logging is set up."""
    try:
        aliases, notes = reference_aliases(environ)
    except ReferenceEnvError as error:
        raise SettingsError(str(error)) from None
    values: dict[str, Any] = {}
    for option in SERVE_OPTIONS:
        flag = getattr(arguments, option.name, None)
        alias = aliases.get(option.name)
        if alias is not None and (flag is not None or environ.get(option.env) is not None):
            notes.append((alias[1], f"{option.flag if flag is not None else option.env} is set and wins"))
        values[option.name] = _value(option, flag, environ, alias)
    settings = Settings(**values)
    from_reference = "redis_url" in aliases and getattr(arguments, "redis_url", None) is None
    from_reference = from_reference and "RLS_REDIS_URL" not in environ
    check_together(settings, "REDIS_URL (read as --redis-url)" if from_reference else "--redis-url / RLS_REDIS_URL")
    return settings, notes


def check_together(settings: Settings, redis_source: str = "--redis-url / RLS_REDIS_URL") -> None:
    """Settings that are valid alone but not together; :class:`SettingsError` says which."""
    if settings.config_source == "file" and not settings.config:
        raise SettingsError("--config (or RLS_CONFIG) is required")
    if settings.config_source == "xds" and not settings.xds_server:
        raise SettingsError("--config-source xds needs --xds-server (or RLS_XDS_SERVER, CONFIG_GRPC_XDS_SERVER_URL)")
    if bool(settings.xds_tls_cert) != bool(settings.xds_tls_key):
        raise SettingsError("--xds-tls-cert and --xds-tls-key (RLS_XDS_TLS_CERT, RLS_XDS_TLS_KEY) go together")
    tls_files = settings.xds_tls_ca or settings.xds_tls_cert or settings.xds_tls_server_name
    if tls_files and not settings.xds_tls:
        raise SettingsError("--xds-tls-ca, --xds-tls-cert/-key and --xds-tls-server-name need --xds-tls (RLS_XDS_TLS)")
    if bool(settings.tls_cert) != bool(settings.tls_key):
        raise SettingsError("--tls-cert and --tls-key (RLS_TLS_CERT, RLS_TLS_KEY) go together")
    if settings.tls_client_ca and not settings.tls_cert:
        raise SettingsError("--tls-client-ca needs --tls-cert and --tls-key: mutual TLS is TLS first")
    check_header_names(settings)
    if settings.quota_max_buckets_per_stream > settings.quota_max_buckets:
        raise SettingsError(
            f"--quota-max-buckets-per-stream ({settings.quota_max_buckets_per_stream}) must not exceed "
            f"--quota-max-buckets ({settings.quota_max_buckets})"
        )
    lease = lease_seconds(settings.quota_ttl)
    if 0 < settings.quota_partition_hold < lease:
        raise SettingsError(
            f"--quota-partition-hold ({settings.quota_partition_hold:g}) must be at least one lease, "
            f"--quota-ttl + 10 s = {lease:g} s (or 0 for {HOLD_LEASES} leases)"
        )
    if settings.backend == "redis" and not settings.redis_url:
        raise SettingsError("--backend redis needs --redis-url (or RLS_REDIS_URL)")
    if settings.redis_url:
        check_redis_url(settings, redis_source)


def check_header_names(settings: Settings) -> None:
    """The headers a response may carry must have distinct names (ignoring case), and a
    header style other than the default is only read with --response-headers."""
    style = settings.response_header_style
    if style != "draft-03" and not settings.response_headers:
        raise SettingsError(
            f"--response-header-style {style} (RLS_RESPONSE_HEADER_STYLE) needs --response-headers "
            "(RLS_RESPONSE_HEADERS, or LIMIT_RESPONSE_HEADERS_ENABLED=true)"
        )
    headers = [settings.limit_header, settings.remaining_header, settings.reset_header, settings.warn_header]
    fixed = ["Retry-After", *(["RateLimit-Policy", "RateLimit"] if style != "draft-03" else [])]
    if len({name.lower() for name in [*headers, *fixed]}) != len(headers) + len(fixed):
        raise SettingsError(
            "--limit-header, --remaining-header, --reset-header and --warn-header must differ "
            f"from each other and from {' and '.join(fixed)} (header names ignore case), got {', '.join(headers)}"
        )


def check_redis_url(settings: Settings, source: str = "--redis-url / RLS_REDIS_URL") -> None:
    """The Redis URL must have a scheme we know and parse as redis-py will read it; a
    Sentinel URL cannot also be a Cluster.

    Messages never repeat the URL, nor any piece of it that may belong to a password
    (only a scheme is shown, when it looks like one).
    """
    url = settings.redis_url
    if not url.startswith(REDIS_SCHEMES):
        scheme, sep, _ = url.partition("://")
        named = f" {scheme!r}" if sep and SCHEME.fullmatch(scheme) else ""
        known = [option.removesuffix("://") for option in REDIS_SCHEMES]
        close = difflib.get_close_matches(scheme.lower(), known, n=1) if named else []
        hint = f" (did you mean {close[0]}://?)" if close else ""
        raise SettingsError(f"{source}: unknown scheme{named}{hint}; must start with one of {', '.join(REDIS_SCHEMES)}")
    try:
        check_url(url)
    except SentinelUrlError as error:
        raise SettingsError(f"{source} (Sentinel): {error}") from None
    except RedisUrlError as error:
        raise SettingsError(f"{source}: {error}") from None
    if is_sentinel_url(url) and settings.redis_cluster:
        raise SettingsError("--redis-cluster cannot be combined with a Sentinel URL: Sentinel serves one master")


def reference_table(options: Sequence[Option] = SERVE_OPTIONS) -> str:
    """The configuration reference as a Markdown table, for README."""
    rows = ["| flag | environment | default | meaning |", "|---|---|---|---|"]
    for option in options:
        default = (
            "(required)" if option.default is None else f"`{option.default}`" if option.default != "" else "(none)"
        )
        rows.append(f"| `{option.flag}` | `{option.env}` | {default} | {option.help} |")
    return "\n".join(rows)
