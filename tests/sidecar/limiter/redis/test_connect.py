"""``redis+sentinel://`` URLs: what they name, and a clear error for each malformed part."""

from __future__ import annotations

import argparse
import re

import pytest

from sidecar.limiter.redis.connect import DEFAULT_SENTINEL_PORT, SentinelTarget, SentinelUrlError, parse_sentinel_url
from sidecar.settings import SettingsError, add_serve_arguments, resolve


def test_hosts_service_and_defaults():
    assert parse_sentinel_url("redis+sentinel://10.0.0.1:26380,sentinel-b,[::1]:5000/mymaster") == SentinelTarget(
        sentinels=(("10.0.0.1", 26380), ("sentinel-b", DEFAULT_SENTINEL_PORT), ("::1", 5000)),
        service="mymaster",
    )


def test_credentials_database_and_sentinel_credentials():
    url = "redis+sentinel://limiter:s3cr%3Aet%40@s1:26379/cache/2?sentinel_password=pw%26&sentinel_username=watch"
    target = parse_sentinel_url(url)
    assert (target.username, target.password, target.db) == ("limiter", "s3cr:et@", 2)
    assert (target.sentinel_username, target.sentinel_password) == ("watch", "pw&")
    assert parse_sentinel_url("redis+sentinel://onlypassword@s1/cache").password == "onlypassword"


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("redis://s1:26379/mymaster", "must start with redis+sentinel:// or rediss+sentinel://"),
        ("redis+sentinel://s1/mymaster?ssl_ca_certs=/ca.pem", "ssl_* options need rediss+sentinel://"),
        ("rediss+sentinel://s1/mymaster?ssl_cert_reqs=maybe", "ssl_cert_reqs 'maybe' must be one of"),
        ("redis+sentinel://s1:26379", "needs the master's service name"),
        ("redis+sentinel://s1:26379/", "needs the master's service name"),
        ("redis+sentinel://s1:26379/mymaster/x", "database 'x' after the service name must be a number"),
        ("redis+sentinel://s1:26379,,s2/mymaster", "empty sentinel host"),
        ("redis+sentinel://:26379/mymaster", "has no host"),
        ("redis+sentinel://s1:port/mymaster", "port must be a number from 1 to 65535"),
        ("redis+sentinel://s1:70000/mymaster", "port must be a number from 1 to 65535"),
        ("redis+sentinel://s1/mymaster?password=x", "unknown query parameter"),
    ],
)
def test_malformed_urls_name_the_part_at_fault(url: str, message: str):
    with pytest.raises(SentinelUrlError, match=re.escape(message)):
        parse_sentinel_url(url)


def settings_error(*flags: str) -> str:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_serve_arguments(parser)
    with pytest.raises(SettingsError) as raised:
        resolve(parser.parse_args(["--config", "c", "--backend", "redis", *flags]), {})
    return str(raised.value)


def test_settings_refuse_a_bad_sentinel_url_without_repeating_its_password():
    message = settings_error("--redis-url", "redis+sentinel://user:hunter2@s1:26379")
    assert message.startswith("--redis-url / RLS_REDIS_URL (Sentinel): needs the master's service name")
    assert "hunter2" not in message


def test_settings_refuse_sentinel_with_cluster():
    message = settings_error("--redis-url", "redis+sentinel://s1/mymaster", "--redis-cluster")
    assert "--redis-cluster cannot be combined with a Sentinel URL" in message


def test_tls_scheme_takes_the_ssl_options_for_sentinels_and_master():
    target = parse_sentinel_url("rediss+sentinel://s1/cache?ssl_ca_certs=%2Fetc%2Fca.pem&ssl_cert_reqs=required")
    assert target.tls
    assert target.tls_options == (("ssl_ca_certs", "/etc/ca.pem"), ("ssl_cert_reqs", "required"))
    assert not parse_sentinel_url("redis+sentinel://s1/cache").tls
