"""envoyproxy/ratelimit's environment variables as aliases of our settings.

Ours (flags, ``RLS_*``) win when both are set; a reference variable that changes nothing
here comes back as a note naming it and why; a value we cannot honour is refused.
"""

from __future__ import annotations

import argparse

import pytest

from sidecar.reference_env import REFERENCE_VARIABLES, redis_url
from sidecar.settings import Settings, SettingsError, add_serve_arguments, resolve_with_notes


def resolved(environ: dict[str, str], *flags: str) -> tuple[Settings, dict[str, str]]:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_serve_arguments(parser)
    settings, notes = resolve_with_notes(parser.parse_args(list(flags)), environ)
    return settings, dict(notes)


REFERENCE_POD = {
    "RUNTIME_ROOT": "/data",
    "RUNTIME_SUBDIRECTORY": "ratelimit",
    "REDIS_SOCKET_TYPE": "tcp",
    "REDIS_URL": "redis.internal:6379",
    "REDIS_AUTH": "s3cr/t",
    "GRPC_PORT": "8081",
    "PORT": "8080",
    "USE_PROMETHEUS": "true",
    "PROMETHEUS_ADDR": ":9090",
    "LOG_LEVEL": "WARN",
    "LOG_FORMAT": "text",
    "LIMIT_RESPONSE_HEADERS_ENABLED": "True",
    "SHADOW_MODE": "f",
    "NEAR_LIMIT_RATIO": "0.9",
    "CACHE_KEY_PREFIX": "rl_",
    "MERGE_DOMAIN_CONFIG": "true",
    "RESPONSE_DYNAMIC_METADATA": "1",
    "USE_CALENDAR_MONTH_RATE_LIMIT": "true",
    "USE_STATSD": "false",
    "REDIS_POOL_SIZE": "20",
}


def test_a_reference_deployment_maps_onto_our_settings() -> None:
    settings, notes = resolved(REFERENCE_POD)
    assert settings.config == "/data/ratelimit/config"
    assert (settings.backend, settings.redis_url) == ("redis", "redis://:s3cr%2Ft@redis.internal:6379")
    assert (settings.grpc_address, settings.json_address, settings.metrics_address) == (
        "0.0.0.0:8081",
        "0.0.0.0:8080",
        "0.0.0.0:9090",
    )
    assert (settings.log_level, settings.log_format) == ("warning", "console")
    assert (settings.response_headers, settings.shadow_mode, settings.near_limit_ratio) == (True, False, 0.9)
    assert (settings.redis_prefix, settings.merge_domain_config) == ("rl_", True)
    assert (settings.response_dynamic_metadata, settings.calendar_months) == (True, True)
    assert set(notes) == {"USE_STATSD", "REDIS_POOL_SIZE"}
    assert "Prometheus only" in notes["USE_STATSD"]


def test_ours_win_and_the_shadowed_variable_is_named() -> None:
    environ = {**REFERENCE_POD, "RLS_REDIS_URL": "redis://other:6379", "RLS_LOG_LEVEL": "debug"}
    settings, notes = resolved(environ, "--grpc-address", "127.0.0.1:9999")
    assert (settings.redis_url, settings.log_level, settings.grpc_address) == (
        "redis://other:6379",
        "debug",
        "127.0.0.1:9999",
    )
    assert notes["LOG_LEVEL"] == "RLS_LOG_LEVEL is set and wins"
    assert notes["GRPC_HOST, GRPC_PORT"] == "--grpc-address is set and wins"


def test_without_reference_variables_nothing_changes() -> None:
    assert resolved({}, "--config", "c") == (Settings(config="c"), {})


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({"REDIS_URL": "/var/run/redis.sock"}, "unix:///var/run/redis.sock"),
        ({"REDIS_URL": "/r.sock", "REDIS_AUTH": "user:pw"}, "unix:///r.sock?password=pw&username=user"),
        ({"REDIS_URL": "h:6379", "REDIS_SOCKET_TYPE": "tcp", "REDIS_TLS": "true"}, "rediss://h:6379"),
        (
            {"REDIS_URL": "h:6380", "REDIS_SOCKET_TYPE": "tcp", "REDIS_TLS": "t", "REDIS_TLS_CACERT": "/ca.pem"},
            "rediss://h:6380?ssl_ca_certs=%2Fca.pem",
        ),
        (
            {"REDIS_URL": "a:7000,b:7001", "REDIS_SOCKET_TYPE": "tcp", "REDIS_TYPE": "cluster"},
            "redis+cluster://a:7000",
        ),
        (
            {"REDIS_URL": "mymaster,s1:26379,s2:26379", "REDIS_SOCKET_TYPE": "tcp", "REDIS_TYPE": "SENTINEL"},
            "redis+sentinel://s1:26379,s2:26379/mymaster",
        ),
    ],
)
def test_redis_urls(environ: dict[str, str], expected: str) -> None:
    assert redis_url(environ) == expected


def test_gprc_on_a_unix_socket() -> None:
    settings, _ = resolved({"GRPC_UDS": "/tmp/rl.sock", "GRPC_PORT": "1"}, "--config", "c")
    assert settings.grpc_address == "unix:/tmp/rl.sock"
    assert resolved({}, "--config", "c", "--grpc-address", "unix:///run/rl.sock")[0].grpc_address == (
        "unix:///run/rl.sock"
    )
    with pytest.raises(SettingsError, match="unix:PATH"):
        resolved({}, "--config", "c", "--grpc-address", "unix:")


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"BACKEND_TYPE": "memcache"}, "memcached is not a backend here"),
        ({"CONFIG_TYPE": "GRPC_XDS_DELTA"}, "must be FILE or GRPC_XDS_SOTW"),
        ({"CONFIG_TYPE": "GRPC_XDS_SOTW", "CONFIG_GRPC_XDS_SERVER_USE_TLS": "yes"}, "must be true or false"),
        ({"XDS_CLIENT_BACKOFF_MAX_INTERVAL": "1 minute"}, "must be a Go duration"),
        ({"LOG_LEVEL": "loud"}, "LOG_LEVEL='loud'"),
        ({"SHADOW_MODE": "maybe"}, "SHADOW_MODE='maybe': must be true or false"),
        ({"REDIS_URL": "h:1", "REDIS_TYPE": "ring"}, "REDIS_TYPE='ring'"),
    ],
)
def test_values_we_cannot_honour_are_refused(environ: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        resolved({"RUNTIME_ROOT": "/data", **environ})


def test_refused_hits_are_never_counted_is_noted() -> None:
    _, notes = resolved({"RUNTIME_ROOT": "/d", "STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT": "false"})
    assert "count_past_limit" in notes["STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT"]


def test_every_reference_variable_is_listed_once() -> None:
    names = [variable.name for variable in REFERENCE_VARIABLES]
    assert len(names) == len(set(names))
    assert {"REDIS_URL", "GRPC_UDS", "RUNTIME_SUBDIRECTORY", "MERGE_DOMAIN_CONFIG", "TRACING_ENABLED"} <= set(names)


def test_the_xds_config_source_is_read_from_the_reference_variables() -> None:
    settings, notes = resolved(
        {
            "CONFIG_TYPE": "GRPC_XDS_SOTW",
            "CONFIG_GRPC_XDS_NODE_ID": "rls-7",
            "CONFIG_GRPC_XDS_NODE_METADATA": '{"zone": "a"}',
            "CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS": "x-tenant:blue,authorization:Bearer t",
            "XDS_CLIENT_BACKOFF_INITIAL_INTERVAL": "500ms",
            "XDS_CLIENT_BACKOFF_MAX_INTERVAL": "1m30s",
            "XDS_CLIENT_BACKOFF_JITTER": "false",
            "XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES": "1048576",
            "CONFIG_GRPC_XDS_SERVER_TLS_SAN": "cp.example",
        }
    )
    assert settings.config_source == "xds"
    assert settings.xds_server == "localhost:18000"  # the reference's default
    assert (settings.xds_node_id, settings.xds_node_metadata) == ("rls-7", '{"zone": "a"}')
    assert settings.xds_headers == "x-tenant:blue,authorization:Bearer t"
    assert (settings.xds_backoff_initial, settings.xds_backoff_max, settings.xds_backoff_jitter) == (0.5, 90.0, 0.0)
    assert settings.xds_max_message_bytes == 1048576
    assert notes["CONFIG_GRPC_XDS_SERVER_TLS_SAN"] == "read only with CONFIG_GRPC_XDS_SERVER_USE_TLS=true"
    assert not settings.xds_tls
    assert resolved({"CONFIG_TYPE": "FILE"}, "--config", "c")[0].config_source == "file"


def test_tls_to_the_control_plane_is_read_from_the_reference_variables() -> None:
    settings, notes = resolved(
        {
            "CONFIG_TYPE": "GRPC_XDS_SOTW",
            "CONFIG_GRPC_XDS_SERVER_URL": "cp.internal:18001",
            "CONFIG_GRPC_XDS_SERVER_USE_TLS": "true",
            "CONFIG_GRPC_XDS_SERVER_TLS_CACERT": "/certs/ca.pem",
            "CONFIG_GRPC_XDS_CLIENT_TLS_CERT": "/certs/tls.crt",
            "CONFIG_GRPC_XDS_CLIENT_TLS_KEY": "/certs/tls.key",
            "CONFIG_GRPC_XDS_SERVER_TLS_SAN": "envoy-gateway",
        }
    )
    assert settings.xds_server == "cp.internal:18001"
    assert settings.xds_tls
    assert (settings.xds_tls_ca, settings.xds_tls_cert, settings.xds_tls_key) == (
        "/certs/ca.pem",
        "/certs/tls.crt",
        "/certs/tls.key",
    )
    assert settings.xds_tls_server_name == "envoy-gateway"
    assert notes == {}
