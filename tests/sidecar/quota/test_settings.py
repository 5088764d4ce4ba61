"""Quota mode settings: flags, RLS_* variables, defaults and one-line errors."""

from __future__ import annotations

import argparse

import pytest

from sidecar.server import quota_settings
from sidecar.settings import Settings, SettingsError, add_serve_arguments, resolve


def settings_from(flags: list[str], environ: dict[str, str] | None = None) -> Settings:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return resolve(parser.parse_args(["--config", "c.yaml", *flags]), environ or {})


def test_defaults_and_what_the_quota_service_gets() -> None:
    settings = settings_from(["--instances", "3", "--shadow-mode"])
    quota = quota_settings(settings)
    assert (quota.ttl, quota.idle_abandon, quota.max_buckets, quota.max_buckets_per_stream) == (
        60,
        120,
        100_000,
        20_000,
    )
    assert (quota.instances, quota.admit_all, quota.refresh_after) == (3, True, 20.0)


def test_flags_and_environment() -> None:
    settings = settings_from(
        ["--quota-ttl", "9"],
        {"RLS_QUOTA_IDLE_ABANDON": "30", "RLS_QUOTA_MAX_BUCKETS": "7", "RLS_QUOTA_MAX_BUCKETS_PER_STREAM": "7"},
    )
    assert (settings.quota_ttl, settings.quota_idle_abandon, settings.quota_max_buckets) == (9, 30, 7)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--quota-ttl", "2"], "--quota-ttl='2': must be a whole number of seconds, at least 3"),
        (["--quota-ttl", "0.5"], "--quota-ttl='0.5'"),
        (["--quota-idle-abandon", "5"], "at least 10 (Envoy reports usage every 5 s)"),
        (["--quota-max-buckets", "0"], "--quota-max-buckets='0': must be at least 1"),
        (["--quota-max-buckets", "10", "--quota-max-buckets-per-stream", "11"], "must not exceed --quota-max-buckets"),
    ],
)
def test_bad_values_are_refused_in_one_line(flags: list[str], message: str) -> None:
    with pytest.raises(SettingsError) as caught:
        settings_from(flags)
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)
