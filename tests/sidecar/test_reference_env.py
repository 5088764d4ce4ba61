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
        ({"CONFIG_TYPE": "GRPC_XDS_SOTW"}, "only FILE is supported"),
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
