"""The IETF ``RateLimit-Policy`` and ``RateLimit`` fields (``--response-header-style``).

Through ``RateLimitService.decide`` with a fake clock, every field value is read back
with ``http_sf``, an RFC 9651 parser, as a client would: a malformed value fails the
parse. Per algorithm (fixed and sliding windows, token bucket), several limits on one
descriptor and several descriptors, the partition key, the policy names, and the
settings. Through a real Envoy: tests/e2e/test_headers_through_envoy.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import http_sf
import pytest

from sidecar.limiter.memory import MemoryLimiter
from sidecar.limiter.windows import Unit
from sidecar.protos.envoy.service.ratelimit.v3 import rls_pb2
from sidecar.service.headers import HeaderNames, HeaderStyle
from sidecar.service.ratelimit_fields import MAX_NAME_CHARS, MAX_SF_INTEGER, escaped_name, sf_integer
from sidecar.service.servicer import RateLimitService
from sidecar.settings import SettingsError
from tests.support.settings import settings_from as resolved

OK = rls_pb2.RateLimitResponse.OK
OVER = rls_pb2.RateLimitResponse.OVER_LIMIT
UNTIL_MINUTE_END = 30
"""The ``clock`` fixture stands 30 s before the end of a minute ..."""
UNTIL_HOUR_END = 2790
"""... and 2,790 s before the end of an hour."""

RULES = """
    domain: h
    descriptors:
      - key: user
        rate_limit: {name: per_user, unit: minute, requests_per_unit: 5}
      - key: ip
        rate_limit: {name: per_ip, unit: hour, requests_per_unit: 3}
      - key: slide
        rate_limit: {name: sliding, unit: minute, requests_per_unit: 10, algorithm: sliding_window}
      - key: bucket
        rate_limit: {name: bucket, unit: second, requests_per_unit: 2, algorithm: token_bucket, burst: 6}
      - key: multi
        rate_limits:
          - {unit: second, requests_per_unit: 2}
          - {unit: hour, requests_per_unit: 100}
      - key: plan
        value: gold
        rate_limit: {unit: minute, requests_per_unit: 50}
      - key: odd
        rate_limit: {name: 'naïve "quota" 100%', unit: minute, requests_per_unit: 9}
      - key: shadow
        shadow_mode: true
        rate_limit: {name: shadowed, unit: hour, requests_per_unit: 1}
      - key: free
        rate_limit: {unlimited: true}
"""

Parsed = list[tuple[Any, dict[str, Any]]]


@pytest.fixture
def make(h, clock):
    def build(style: HeaderStyle = "ietf", limiter: Any = None) -> RateLimitService:
        return RateLimitService(
            h.config_of(RULES),
            limiter or MemoryLimiter(),
            clock=clock,
            response_headers=True,
            header_names=HeaderNames(style=style),
        )

    return build


@pytest.fixture
def ask(h, make):
    default = make()

    async def send(*descriptors: Sequence[tuple[str, str]], to: RateLimitService | None = None) -> Any:
        built = [h.descriptor(*pairs) for pairs in descriptors]
        return await (to or default).decide(h.rate_request("h", *built))

    return send


def headers(response: Any) -> list[tuple[str, str]]:
    return [(header.key, header.value) for header in response.response_headers_to_add]


def field(response: Any, name: str) -> Parsed:
    """One field parsed as an RFC 9651 List; it must be sent exactly once."""
    values = [value for key, value in headers(response) if key == name]
    assert len(values) == 1, (name, headers(response))
    parsed: Parsed = http_sf.parse(values[0].encode("ascii"), tltype="list")
    for member, _ in parsed:
        assert type(member) is str, "draft -11: each member is a String"
    return parsed


def policies(response: Any) -> dict[str, dict[str, Any]]:
    return dict(field(response, "RateLimit-Policy"))


def current(response: Any) -> tuple[str, dict[str, Any]]:
    (item,) = field(response, "RateLimit")
    return item[0], item[1]


def without_pk(parameters: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in parameters.items() if key != "pk"}


# -- one limit per algorithm ---------------------------------------------------------------------


async def test_fixed_window_policy_and_remaining_until_refused(ask):
    for remaining in (4, 3, 2, 1, 0):
        response = await ask([("user", "u")])
        assert response.overall_code == OK
        (pk,) = {policies(response)["per_user"]["pk"], current(response)[1]["pk"]}
        assert without_pk(policies(response)["per_user"]) == {"q": 5, "w": 60}
        name, limit = current(response)
        assert (name, without_pk(limit)) == ("per_user", {"r": remaining, "t": UNTIL_MINUTE_END})
    refused = await ask([("user", "u")])
    assert refused.overall_code == OVER
    assert current(refused)[1]["r"] == 0
    assert ("Retry-After", str(UNTIL_MINUTE_END)) in headers(refused)
    assert isinstance(pk, bytes) and len(pk) == 16


async def test_sliding_window_reports_the_window_and_what_its_estimate_leaves(ask, clock):
    for _ in range(6):
        await ask([("slide", "s")])
    clock.advance(60)  # the next minute, 30 s in: half of the previous one still counts
    response = await ask([("slide", "s")])
    # estimate = 1 (this minute) + floor(6 * 0.5) = 4 of 10
    assert response.statuses[0].limit_remaining == 6
    name, limit = current(response)
    assert (name, limit["r"], limit["t"]) == ("sliding", 6, UNTIL_MINUTE_END)
    assert without_pk(policies(response)["sliding"]) == {"q": 10, "w": 60}


async def test_token_bucket_quota_is_the_burst_window_the_time_to_refill_it(ask):
    response = await ask([("bucket", "b")])
    # burst 6 at 2 tokens a second: 3 s from empty to full
    assert without_pk(policies(response)["bucket"]) == {"q": 6, "w": 3}
    name, limit = current(response)
    assert (name, limit["r"], limit["t"]) == ("bucket", 5, 1)
    for _ in range(5):
        response = await ask([("bucket", "b")])
    assert (current(response)[1]["r"], current(response)[1]["t"]) == (0, 3), "empty: 3 s until full"
    refused = await ask([("bucket", "b")])
    assert refused.overall_code == OVER
    retry_after = dict(headers(refused))["Retry-After"]
    assert (current(refused)[1]["r"], current(refused)[1]["t"]) == (0, int(retry_after))


# -- several limits --------------------------------------------------------------------------------


async def test_several_limits_of_one_descriptor_are_each_a_policy_the_closest_is_named(ask):
    response = await ask([("multi", "m")])
    listed = policies(response)
    assert list(listed) == ["h.multi#1", "h.multi#2"]
    assert [(value["q"], value["w"]) for value in listed.values()] == [(2, 1), (100, 3600)]
    assert listed["h.multi#1"]["pk"] != listed["h.multi#2"]["pk"], "two counters, two partitions"
    name, limit = current(response)
    assert (name, limit["r"], limit["t"]) == ("h.multi#1", 1, 1)
    assert limit["pk"] == listed["h.multi#1"]["pk"]


async def test_several_descriptors_all_listed_fewest_remaining_then_over_limit_named(ask):
    response = await ask([("user", "u")], [("ip", "1")])
    assert list(policies(response)) == ["per_user", "per_ip"]
    assert current(response)[0] == "per_ip"  # 2 left of 3/hour against 4 left of 5/minute
    for _ in range(4):
        response = await ask([("user", "u")], [("ip", "2")])
    assert response.overall_code == OVER  # ip 2 is over on its 4th request
    name, limit = current(response)
    assert (name, limit["r"], limit["t"]) == ("per_ip", 0, UNTIL_HOUR_END)
    assert dict(headers(response))["Retry-After"] == str(UNTIL_HOUR_END)


async def test_the_same_descriptor_twice_is_listed_once(ask):
    response = await ask([("user", "u")], [("user", "u")])
    assert len(field(response, "RateLimit-Policy")) == 1


async def test_shadow_unlimited_and_unmatched_descriptors_are_not_listed(ask):
    response = await ask([("shadow", "s")], [("free", "f")], [("nothing", "n")], [("user", "u")])
    assert list(policies(response)) == ["per_user"]
    alone = await ask([("shadow", "s")], [("free", "f")])
    assert headers(alone) == []


# -- partition keys and names ---------------------------------------------------------------------


async def test_the_partition_key_is_per_counter_stable_and_never_the_value(ask, make):
    value = "alice@example.com" * 20
    first, again = await ask([("user", value)]), await ask([("user", value)])
    other = await ask([("user", "bob")])
    elsewhere = await ask([("user", value)], to=make())  # another replica, same config
    keys = [policies(response)["per_user"]["pk"] for response in (first, again, other, elsewhere)]
    assert keys[0] == keys[1] == keys[3] != keys[2]
    assert all(len(key) == 16 for key in keys)
    raw = "".join(value for _, value in headers(first))
    assert "alice" not in raw and len(raw) < 200


async def test_a_rule_on_a_fixed_value_has_no_partition_key(ask):
    response = await ask([("plan", "gold")])
    assert policies(response) == {"h.plan_gold": {"q": 50, "w": 60}}
    assert "pk" not in current(response)[1]


async def test_a_name_with_quotes_percent_and_non_ascii_is_escaped_reversibly(ask):
    response = await ask([("odd", "o")])
    assert current(response)[0] == 'na%C3%AFve "quota" 100%25'


def test_long_names_are_cut_and_stay_distinct():
    first, second = escaped_name("x" * 300 + "a"), escaped_name("x" * 300 + "b")
    assert len(first) == len(second) == MAX_NAME_CHARS
    assert first != second
    assert escaped_name("per_user") == "per_user"


def test_integers_are_kept_within_what_rfc_9651_allows():
    assert sf_integer(10**20) == MAX_SF_INTEGER
    assert http_sf.parse(f'"p";q={MAX_SF_INTEGER}'.encode(), tltype="list") == [("p", {"q": MAX_SF_INTEGER})]
    assert sf_integer(-1) == 0


async def test_a_request_override_is_named_by_its_keys(h, make):
    override = h.descriptor(("user", "o"), limit=(7, Unit.HOUR))
    response = await make().decide(h.rate_request("h", override))
    assert current(response)[0] == "h.user"
    assert (policies(response)["h.user"]["q"], policies(response)["h.user"]["w"]) == (7, 3600)


async def test_with_instances_the_quota_is_configured_and_remaining_the_share(make, ask):
    sharing = make(limiter=MemoryLimiter(instances=2))
    response = await ask([("user", "i")], to=sharing)
    assert policies(response)["per_user"]["q"] == 5
    assert current(response)[1]["r"] == 2 == response.statuses[0].limit_remaining


# -- styles ---------------------------------------------------------------------------------------


async def test_ietf_alone_sends_no_draft_03_headers(ask):
    response = await ask([("user", "u")])
    assert [key for key, _ in headers(response)] == ["RateLimit-Policy", "RateLimit"]


async def test_both_styles_agree(make, ask):
    response = await ask([("user", "u")], [("ip", "1")], to=make("both"))
    found = dict(headers(response))
    name, limit = current(response)
    assert int(found["RateLimit-Limit"]) == policies(response)[name]["q"]
    assert int(found["RateLimit-Remaining"]) == limit["r"]
    assert int(found["RateLimit-Reset"]) == limit["t"]


async def test_draft_03_is_the_default(h, clock):
    service = RateLimitService(h.config_of(RULES), MemoryLimiter(), clock=clock, response_headers=True)
    response = await service.decide(h.rate_request("h", h.descriptor(("user", "u"))))
    assert [key for key, _ in headers(response)] == ["RateLimit-Limit", "RateLimit-Remaining", "RateLimit-Reset"]


# -- settings -------------------------------------------------------------------------------------


def settings_from(flags: list[str], environ: dict[str, str] | None = None) -> Any:
    return resolved(flags, environ, config="c")


def test_style_from_flag_environment_and_with_the_reference_variable():
    assert settings_from([]).response_header_style == "draft-03"
    assert settings_from(["--response-headers", "--response-header-style", "IETF"]).response_header_style == "ietf"
    environ = {"RLS_RESPONSE_HEADER_STYLE": "both", "LIMIT_RESPONSE_HEADERS_ENABLED": "true"}
    settings = settings_from([], environ)
    assert (settings.response_headers, settings.response_header_style) == (True, "both")


def test_a_style_without_response_headers_is_an_error_naming_both():
    with pytest.raises(SettingsError, match=r"--response-header-style ietf .* needs --response-headers"):
        settings_from([], {"RLS_RESPONSE_HEADER_STYLE": "ietf"})


def test_an_unknown_style_is_an_error():
    with pytest.raises(SettingsError, match=r"--response-header-style='rfc': must be one of draft-03, ietf, both"):
        settings_from(["--response-headers", "--response-header-style", "rfc"])


def test_a_renamed_header_must_not_take_an_ietf_field_name():
    flags = ["--response-headers", "--response-header-style", "both", "--limit-header", "ratelimit"]
    with pytest.raises(SettingsError, match=r"must differ .* from Retry-After and RateLimit-Policy and RateLimit"):
        settings_from(flags)
    assert settings_from(flags[:1] + flags[-2:]).limit_header == "ratelimit", "draft-03 alone sends no RateLimit"
