"""Settings: a flag beats its environment variable, which beats the default."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from sidecar.limiter.bounds import DEFAULT_MAX_COUNTERS
from sidecar.settings import (
    SERVE_OPTIONS,
    Settings,
    SettingsError,
    reference_table,
    resolve,
)
from tests.support.settings import settings_from


def test_defaults():
    settings = settings_from(["--config", "rules"])
    assert settings == Settings(config="rules")
    assert (settings.grpc_address, settings.backend, settings.instances) == ("127.0.0.1:8081", "memory", 1)
    assert (settings.max_counters, settings.shadow_mode, settings.log_level) == (DEFAULT_MAX_COUNTERS, False, "info")


@pytest.mark.parametrize(
    ("flags", "environ", "expected"),
    [
        ([], {}, 1),
        ([], {"RLS_INSTANCES": "3"}, 3),
        (["--instances", "5"], {"RLS_INSTANCES": "3"}, 5),
        (["--instances", "5"], {}, 5),
    ],
)
def test_flag_beats_env_beats_default(flags, environ, expected):
    assert settings_from(["--config", "c", *flags], environ).instances == expected


def test_flag_beats_env_for_every_option():
    environ = {"RLS_CONFIG": "from-env", "RLS_GRPC_ADDRESS": "0.0.0.0:1", "RLS_LOG_LEVEL": "error"}
    settings = settings_from(["--config", "from-flag", "--grpc-address", "[::1]:9000", "--log-level", "DEBUG"], environ)
    assert (settings.config, settings.grpc_address, settings.log_level) == (
        "from-flag",
        "[::1]:9000",
        "debug",
    )
    assert settings_from([], environ).config == "from-env"


@pytest.mark.parametrize(
    ("flags", "environ", "expected"),
    [
        ([], {}, False),
        ([], {"RLS_SHADOW_MODE": "yes"}, True),
        ([], {"RLS_SHADOW_MODE": "TRUE"}, True),
        ([], {"RLS_SHADOW_MODE": "0"}, False),
        ([], {"RLS_SHADOW_MODE": ""}, False),
        (["--shadow-mode"], {}, True),
        (["--shadow-mode"], {"RLS_SHADOW_MODE": "off"}, True),
    ],
)
def test_shadow_mode_switch(flags, environ, expected):
    assert settings_from(["--config", "c", *flags], environ).shadow_mode is expected


@pytest.mark.parametrize(
    ("variable", "value", "fragment"),
    [
        ("RLS_INSTANCES", "zero", "invalid literal"),
        ("RLS_INSTANCES", "0", "must be at least 1"),
        ("RLS_MAX_COUNTERS", "-5", "must be at least 1"),
        ("RLS_SHADOW_MODE", "maybe", "must be true or false"),
        ("RLS_SHUTDOWN_GRACE", "-1", "must not be negative"),
        ("RLS_SHUTDOWN_GRACE", "soon", "could not convert"),
        ("RLS_GRPC_ADDRESS", "8081", "must be HOST:PORT"),
        ("RLS_GRPC_ADDRESS", "localhost:http", "must be HOST:PORT"),
        ("RLS_GRPC_ADDRESS", "localhost:70000", "must be HOST:PORT"),
        ("RLS_GRPC_ADDRESS", ":8081", "must be HOST:PORT"),
        ("RLS_BACKEND", "cassandra", "must be one of memory"),
        ("RLS_LOG_LEVEL", "verbose", "must be one of debug, info, warning, error"),
        ("RLS_LOG_FORMAT", "xml", "must be one of json, console, auto"),
    ],
)
def test_bad_env_value_names_the_variable(variable, value, fragment):
    with pytest.raises(SettingsError) as caught:
        settings_from(["--config", "c"], {variable: value})
    message = str(caught.value)
    assert message.startswith(f"{variable}={value!r}: ")
    assert fragment in message


def test_bad_flag_value_names_the_flag():
    with pytest.raises(SettingsError, match=r"^--instances='-2': must be at least 1$"):
        settings_from(["--config", "c", "--instances", "-2"], {"RLS_INSTANCES": "2"})


def test_config_is_required():
    with pytest.raises(SettingsError, match=r"^--config \(or RLS_CONFIG\) is required$"):
        settings_from([], {"RLS_INSTANCES": "2"})


def test_every_option_matches_a_settings_field():
    fields = {field.name: field for field in dataclasses.fields(Settings)}
    assert [option.name for option in SERVE_OPTIONS] == list(fields)
    for option in SERVE_OPTIONS:
        field = fields[option.name]
        if option.default is None:
            assert field.default is dataclasses.MISSING
        else:
            assert field.default == option.default
        assert option.flag == "--" + option.name.replace("_", "-")
        assert option.env == "RLS_" + option.name.upper()


def test_reference_table_lists_every_option():
    table = reference_table()
    for option in SERVE_OPTIONS:
        assert f"`{option.flag}` | `{option.env}`" in table
    assert "| `--config` | `RLS_CONFIG` | (none) | descriptor config: one YAML file or a directory" in table


def test_redis_backend_needs_a_url():
    with pytest.raises(SettingsError, match="--backend redis needs --redis-url"):
        settings_from(["--config", "c", "--backend", "redis"])
    settings = settings_from(["--config", "c"], {"RLS_BACKEND": "Redis", "RLS_REDIS_URL": "redis://127.0.0.1:6379"})
    assert (settings.backend, settings.redis_url) == ("redis", "redis://127.0.0.1:6379")


def test_redis_url_needs_a_known_scheme():
    with pytest.raises(SettingsError, match="must start with one of redis://"):
        settings_from(["--config", "c", "--redis-url", "http://127.0.0.1:6379"])


@pytest.mark.parametrize(
    ("configured", "expected"),
    [
        (None, "127.0.0.1:8081"),
        ("127.0.0.1:9000", "127.0.0.1:9000"),
        ("0.0.0.0:9001", "127.0.0.1:9001"),
        ("[::]:9002", "127.0.0.1:9002"),
        ("10.0.0.5:9003", "10.0.0.5:9003"),
    ],
)
def test_health_and_query_default_to_where_serve_listens(configured: str | None, expected: str) -> None:
    from sidecar.__main__ import local_address

    environ = {} if configured is None else {"RLS_GRPC_ADDRESS": configured}
    assert local_address(environ) == expected


@pytest.mark.parametrize("prefix", ["a{b}", "{x", "y}", "has space", ""])
def test_redis_prefix_refuses_braces_and_spaces(prefix: str) -> None:
    from sidecar.settings import SettingsError

    with pytest.raises(SettingsError, match="--redis-prefix"):
        resolve(argparse.Namespace(config="c", redis_prefix=prefix), environ={})
