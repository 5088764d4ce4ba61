"""Quota mode settings: flags, RLS_* variables, defaults and one-line errors."""

from __future__ import annotations

import pytest

from sidecar.limiter.redis.clock import SharedClock
from sidecar.quota.partition import hold_seconds
from sidecar.server import build_quota_leases, quota_settings
from sidecar.settings import Settings, SettingsError
from tests.support.settings import settings_from as resolved


def settings_from(flags: list[str], environ: dict[str, str] | None = None) -> Settings:
    return resolved(flags, environ, config="c.yaml")


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
        (["--quota-partition-hold", "-1"], "--quota-partition-hold='-1': must not be negative"),
        (["--quota-partition-hold", "nan"], "--quota-partition-hold='nan': must be a finite number"),
        (
            ["--quota-partition-hold", "69"],
            "--quota-partition-hold (69) must be at least one lease, --quota-ttl + 10 s = 70 s",
        ),
        (["--quota-ttl", "30", "--quota-partition-hold", "39.5"], "--quota-partition-hold (39.5) must be at least one"),
        (["--quota-after-hold", "open"], "--quota-after-hold='open': must be one of deny, share"),
    ],
)
def test_bad_values_are_refused_in_one_line(flags: list[str], message: str) -> None:
    with pytest.raises(SettingsError) as caught:
        settings_from(flags)
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


def test_the_partition_hold_follows_the_ttl_unless_set() -> None:
    """Default 0: four leases of the TTL in force (280 s at 60, 120 s at 20); a value is
    taken as it is, from the flag or RLS_QUOTA_PARTITION_HOLD; the policy likewise."""
    default = settings_from([])
    assert (default.quota_partition_hold, default.quota_after_hold) == (0.0, "deny")
    assert hold_seconds(default.quota_ttl, default.quota_partition_hold or None) == 280
    shorter = settings_from(["--quota-ttl", "20"])
    assert hold_seconds(shorter.quota_ttl, shorter.quota_partition_hold or None) == 120
    chosen = settings_from(["--quota-after-hold", "SHARE"], {"RLS_QUOTA_PARTITION_HOLD": "70"})
    assert (chosen.quota_partition_hold, chosen.quota_after_hold) == (70.0, "share")
    from_env = settings_from([], {"RLS_QUOTA_AFTER_HOLD": "share"})
    assert from_env.quota_after_hold == "share"


def test_the_builder_hands_the_partition_settings_to_the_leases() -> None:
    redis = ["--backend", "redis", "--redis-url", "redis://127.0.0.1:1"]
    chosen = build_quota_leases(
        settings_from([*redis, "--quota-partition-hold", "100", "--quota-after-hold", "share"]), SharedClock(0.0)
    )
    default = build_quota_leases(settings_from(redis), SharedClock(0.0))
    assert (chosen.hold, chosen.after_hold, default.hold, default.after_hold) == (100.0, "share", 280.0, "deny")
