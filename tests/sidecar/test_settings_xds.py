"""--config-source and the --xds-* settings: what is required together, and bad values named."""

from __future__ import annotations

import pytest

from sidecar.config.xds_source import header_pairs
from sidecar.settings import Settings, SettingsError
from tests.support.settings import settings_from as resolved


def settings_from(*flags: str, environ: dict[str, str] | None = None) -> Settings:
    return resolved(flags, environ)


def test_xds_needs_a_server_but_no_config_file() -> None:
    with pytest.raises(SettingsError, match=r"^--config-source xds needs --xds-server"):
        settings_from("--config-source", "xds")
    settings = settings_from("--config-source", "xds", "--xds-server", "127.0.0.1:18000")
    assert settings.config == ""
    with pytest.raises(SettingsError, match=r"^--config \(or RLS_CONFIG\) is required$"):
        settings_from("--config-source", "file")


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--xds-node-metadata", "[1]", "must be a JSON object"),
        ("--xds-node-metadata", "{zone", "not JSON"),
        ("--xds-headers", "x-a:1,broken", "'broken' is not name:value"),
        ("--xds-server", "nowhere", "must be HOST:PORT"),
        ("--config-source", "consul", "must be one of file, xds"),
        ("--xds-backoff-jitter", "2", "between 0 and 1"),
    ],
)
def test_bad_xds_values_name_the_flag(flag: str, value: str, message: str) -> None:
    with pytest.raises(SettingsError, match=f"^{flag}="):
        settings_from("--config", "c", flag, value)
    with pytest.raises(SettingsError, match=message):
        settings_from("--config", "c", flag, value)


def test_header_pairs_are_grpc_metadata() -> None:
    assert header_pairs("X-Tenant: blue , authorization:Bearer a:b,") == (
        ("x-tenant", "blue"),
        ("authorization", "Bearer a:b"),
    )
    assert header_pairs("") == ()


def test_the_tls_files_need_tls_and_the_certificate_its_key() -> None:
    server = ("--config-source", "xds", "--xds-server", "127.0.0.1:18000")
    with pytest.raises(SettingsError, match=r"^--xds-tls-cert and --xds-tls-key"):
        settings_from(*server, "--xds-tls", "--xds-tls-cert", "c.pem")
    with pytest.raises(SettingsError, match=r"need --xds-tls \(RLS_XDS_TLS\)$"):
        settings_from(*server, "--xds-tls-ca", "ca.pem")
    settings = settings_from(*server, "--xds-tls", "--xds-tls-server-name", "cp")
    assert (settings.xds_tls, settings.xds_tls_server_name) == (True, "cp")
