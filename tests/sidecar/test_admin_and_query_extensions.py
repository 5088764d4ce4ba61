"""``/config`` and ``query`` on the config extensions: algorithms, windows of several units,
bursts, bans and several limits on one descriptor."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

from sidecar.admin import AdminEndpoint, config_json, rule_json
from sidecar.client import describe
from sidecar.config import load_config
from sidecar.http_server import Request
from sidecar.limiter.memory import MemoryLimiter
from sidecar.service.servicer import RateLimitService

EXTENSIONS = Path(__file__).resolve().parents[2] / "examples" / "extensions"


def test_config_shows_algorithm_window_burst_and_ban_of_each_rule() -> None:
    loaded = config_json(load_config(EXTENSIONS), 0.0)
    rules = loaded["domains"]["extensions"]["rules"]
    shown = [
        (
            rule["path"],
            rule["algorithm"],
            rule["unit"],
            rule["unit_multiplier"],
            rule["window_seconds"],
            rule["burst"],
            rule["ban_duration_seconds"],
            rule["together_with"],
        )
        for rule in rules
    ]
    assert shown == [
        ("descriptors[0].rate_limit", "sliding_window", "second", 1, 1, None, None, []),
        ("descriptors[1].rate_limit", "token_bucket", "second", 1, 1, 50, None, []),
        (
            "descriptors[2].rate_limits[0]",
            "fixed_window",
            "second",
            1,
            1,
            None,
            None,
            ["descriptors[2].rate_limits[1]"],
        ),
        (
            "descriptors[2].rate_limits[1]",
            "fixed_window",
            "hour",
            1,
            3600,
            None,
            None,
            ["descriptors[2].rate_limits[0]"],
        ),
        ("descriptors[3].rate_limit", "fixed_window", "minute", 5, 300, None, 600, []),
    ]
    per_hour = rules[3]
    assert (per_hour["name"], per_hour["stat_key"], per_hour["requests_per_unit"], per_hour["warn_at"]) == (
        "api_key_per_hour",
        "extensions.api_key",
        1000,
        0.9,
    )


async def test_config_over_http_lists_every_limit_of_a_descriptor() -> None:
    config = load_config(EXTENSIONS)
    endpoint = AdminEndpoint(registry=None, config=lambda: lambda: config_json(config, 0.0), serving=lambda: True)
    answer = await endpoint.answer(Request("GET", "/config"))
    assert (answer.status, answer.content_type) == (200, "application/json")
    rules = json.loads(answer.body)["domains"]["extensions"]["rules"]
    api_key = [rule for rule in rules if rule["stat_key"] == "extensions.api_key"]
    assert [(rule["name"], rule["requests_per_unit"], rule["unit"]) for rule in api_key] == [
        ("api_key_per_second", 10, "second"),
        ("api_key_per_hour", 1000, "hour"),
    ]


def test_unlimited_rules_have_no_window_or_algorithm(h: SimpleNamespace) -> None:
    domain = h.parse_domain(
        """
        domain: d
        descriptors:
          - key: free
            rate_limit: {unlimited: true}
          - key: a
            rate_limit: {unit: minute, requests_per_unit: 10}
        """
    )
    free, plain = (rule_json(rule) for rule in domain.rules)
    assert {key: free[key] for key in ("algorithm", "unit_multiplier", "window_seconds", "burst")} == dict.fromkeys(
        ("algorithm", "unit_multiplier", "window_seconds", "burst")
    )
    assert (free["ban_duration_seconds"], free["together_with"]) == (None, [])
    assert (plain["algorithm"], plain["unit_multiplier"], plain["window_seconds"], plain["burst"]) == (
        "fixed_window",
        1,
        60,
        None,
    )


def ask(service: RateLimitService, h: SimpleNamespace, *pairs: tuple[str, str]) -> list[str]:
    request = h.rate_request("extensions", h.descriptor(*pairs))
    return describe(asyncio.run(service.decide(request)))


def test_query_describes_a_token_bucket_by_its_rate_and_tokens(h: SimpleNamespace) -> None:
    """``limit`` is the refill rate (10/second), ``remaining`` the tokens left of the burst of 50,
    ``reset`` the time until the bucket is full again."""
    clock = h.FakeClock(1_700_000_000.25)
    service = RateLimitService(load_config(EXTENSIONS), MemoryLimiter(), clock=clock)
    assert ask(service, h, ("generic_key", "uploads")) == [
        "overall: OK",
        "  [0] OK limit=10/second remaining=49 reset=1s",
    ]
    for _ in range(49):
        ask(service, h, ("generic_key", "uploads"))
    assert ask(service, h, ("generic_key", "uploads")) == [
        "overall: OVER_LIMIT",
        "  [0] OVER_LIMIT limit=10/second remaining=0 reset=1s",
    ]
    clock.advance(1.0)
    assert ask(service, h, ("generic_key", "uploads"))[1] == "  [0] OK limit=10/second remaining=9 reset=5s"


def test_query_reports_the_ban_and_the_window_of_several_units(h: SimpleNamespace) -> None:
    clock = h.FakeClock(1_700_000_000.0)  # 200 s into a 5-minute window
    service = RateLimitService(load_config(EXTENSIONS), MemoryLimiter(), clock=clock)
    first = ask(service, h, ("login_user", "ann"))
    assert first[1] == "  [0] OK limit=5/minute remaining=4 reset=100s", "the proto has no multiplier"
    for _ in range(4):
        ask(service, h, ("login_user", "ann"))
    assert ask(service, h, ("login_user", "ann"))[1] == "  [0] OVER_LIMIT limit=5/minute remaining=0 reset=600s"
