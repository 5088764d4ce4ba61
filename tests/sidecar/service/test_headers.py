"""Service-side response headers (``--response-headers``) and soft limits (``warn_at``).

Through ``RateLimitService.decide`` with a fake clock: which descriptor the
``RateLimit-*`` headers describe, ``Retry-After``, the warning header and its metric,
and the config and settings errors. The real Envoy passing them on to the client is
checked in tests/e2e/test_headers_through_envoy.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from sidecar.admin import rule_json
from sidecar.client import describe
from sidecar.export.haproxy import Const, ExportOptions, Producer, Route, Sources, export
from sidecar.limiter.memory import MemoryLimiter
from sidecar.limiter.protocol import Check, Decision, decide
from sidecar.limiter.windows import Unit
from sidecar.metrics import RULE_STATS, WARNED
from sidecar.protos.envoy.service.ratelimit.v3 import rls_pb2
from sidecar.service.headers import HeaderNames, header_text
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
      - key: burst
        rate_limit: {name: burst, unit: second, requests_per_unit: 2}
      - key: free
        rate_limit: {unlimited: true}
      - key: shadow
        shadow_mode: true
        rate_limit: {name: shadowed, unit: hour, requests_per_unit: 1, warn_at: 0.5}
      - key: soft
        rate_limit: {name: soft, unit: minute, requests_per_unit: 20, warn_at: 0.85}
      - key: soft_unnamed
        descriptors:
          - key: tier
            rate_limit: {unit: hour, requests_per_unit: 4, warn_at: 0.5}
      - key: quota
        value: a
        quota_mode: true
        rate_limit: {name: quota_a, unit: minute, requests_per_unit: 1}
      - key: quota
        value: b
        quota_mode: true
        rate_limit: {name: quota_b, unit: minute, requests_per_unit: 5}
"""


@pytest.fixture
def make(h, clock):
    def build(response_headers: bool = True, limiter: Any = None, names: HeaderNames | None = None) -> RateLimitService:
        return RateLimitService(
            h.config_of(RULES),
            limiter or MemoryLimiter(),
            clock=clock,
            response_headers=response_headers,
            header_names=names,
        )

    return build


@pytest.fixture
def service(make) -> RateLimitService:
    return make()


@pytest.fixture
def ask(h, service):
    async def send(*descriptors: Sequence[tuple[str, str]], hits: int = 0, to: RateLimitService | None = None):
        built = [h.descriptor(*pairs) for pairs in descriptors]
        return await (to or service).decide(h.rate_request("h", *built, hits=hits))

    return send


def headers(response) -> list[tuple[str, str]]:
    return [(header.key, header.value) for header in response.response_headers_to_add]


def rate_headers(limit: int, remaining: int, reset: int, retry_after: int | None = None) -> list[tuple[str, str]]:
    found = [("RateLimit-Limit", str(limit)), ("RateLimit-Remaining", str(remaining)), ("RateLimit-Reset", str(reset))]
    return found if retry_after is None else [*found, ("Retry-After", str(retry_after))]


# -- --response-headers: which descriptor is reported ------------------------------------------


async def test_off_by_default_no_headers(make, ask):
    quiet = make(response_headers=False)
    for _ in range(7):
        response = await ask([("user", "u")], to=quiet)
        assert headers(response) == []
    assert response.overall_code == OVER


async def test_one_descriptor_reports_its_limit_remaining_and_reset(ask):
    for remaining in (4, 3, 2, 1, 0):
        response = await ask([("user", "u")])
        assert response.overall_code == OK
        assert headers(response) == rate_headers(5, remaining, UNTIL_MINUTE_END)
    refused = await ask([("user", "u")])
    assert refused.overall_code == OVER
    assert headers(refused) == rate_headers(5, 0, UNTIL_MINUTE_END, retry_after=UNTIL_MINUTE_END)


async def test_the_values_are_those_of_the_descriptor_status(ask):
    response = await ask([("user", "u")], [("ip", "1")])
    status = response.statuses[1]
    assert headers(response) == rate_headers(
        status.current_limit.requests_per_unit, status.limit_remaining, status.duration_until_reset.seconds
    )


async def test_the_fewest_remaining_wins_when_nothing_is_over(ask):
    # per_user 5/minute (4 left after this request) against per_ip 3/hour (2 left).
    assert headers(await ask([("user", "u")], [("ip", "1")])) == rate_headers(3, 2, UNTIL_HOUR_END)
    await ask([("user", "v")], [("user", "v")], [("user", "v")])  # 3 of v's 5 spent
    # v has 1 left, ip 2 has 2: per_user is reported, whatever the request order.
    assert headers(await ask([("ip", "2")], [("user", "v")])) == rate_headers(5, 1, UNTIL_MINUTE_END)


async def test_equal_remaining_reports_the_later_reset(ask):
    await ask([("user", "w")], [("user", "w")])  # 3 of 5 left for w
    # user w: 2 left after this request, resets in 30 s; ip 3: 2 left, resets in 2,790 s.
    assert headers(await ask([("user", "w")], [("ip", "3")])) == rate_headers(3, 2, UNTIL_HOUR_END)


async def test_an_over_limit_descriptor_wins_over_one_with_fewer_remaining(ask):
    await ask([("burst", "b")], [("burst", "b")])
    # burst is over (2/second) while ip still has 3: the refusing one is reported.
    response = await ask([("ip", "9")], [("burst", "b")])
    assert response.overall_code == OVER
    assert headers(response) == rate_headers(2, 0, 1, retry_after=1)


async def test_of_several_over_limit_descriptors_the_last_to_reset_is_reported(ask):
    await ask([("burst", "c")], [("burst", "c")], [("user", "c")], [("user", "c")], [("user", "c")], hits=1)
    await ask([("user", "c")], [("user", "c")])
    response = await ask([("burst", "c")], [("user", "c")])
    assert [status.code for status in response.statuses] == [OVER, OVER]
    # A client must wait for both windows: the minute (30 s), not the second.
    assert headers(response) == rate_headers(5, 0, UNTIL_MINUTE_END, retry_after=UNTIL_MINUTE_END)


async def test_unlimited_and_unmatched_descriptors_are_ignored(ask):
    assert headers(await ask([("free", "x")], [("nothing", "here")])) == []
    assert headers(await ask([("free", "x")], [("nothing", "here")], [("user", "f")])) == rate_headers(
        5, 4, UNTIL_MINUTE_END
    )


async def test_unknown_domain_gets_no_headers(h, service):
    response = await service.decide(h.rate_request("elsewhere", h.descriptor(("user", "u"))))
    assert headers(response) == []


async def test_shadow_descriptors_are_never_reported_and_never_give_retry_after(ask):
    for _ in range(3):
        response = await ask([("shadow", "s")])
        assert response.overall_code == OK
        assert headers(response) == [], "a shadow rule alone gives no headers"
    # Over its limit the shadow rule has 0 left, but the enforced rule is what is reported.
    response = await ask([("shadow", "s")], [("user", "s")])
    assert response.statuses[0].limit_remaining == 0
    assert headers(response) == rate_headers(5, 4, UNTIL_MINUTE_END)


async def test_global_shadow_mode_reports_over_but_never_retry_after(make, ask):
    shadowed = make(limiter=MemoryLimiter(admit_all=True))
    for _ in range(3):
        response = await ask([("burst", "g")], to=shadowed)
    assert response.overall_code == OK
    assert response.statuses[0].code == OVER
    assert headers(response) == rate_headers(2, 0, 1)


async def test_an_admitted_quota_request_with_an_over_quota_has_no_retry_after(ask):
    await ask([("quota", "a")])
    response = await ask([("quota", "a")], [("quota", "b")])
    assert response.overall_code == OK, "quota_b still has room"
    assert headers(response) == rate_headers(1, 0, UNTIL_MINUTE_END)
    for _ in range(4):
        await ask([("quota", "b")])
    refused = await ask([("quota", "a")], [("quota", "b")])
    assert refused.overall_code == OVER
    assert headers(refused)[-1] == ("Retry-After", str(UNTIL_MINUTE_END))


async def test_request_override_limits_are_reported(h, service):
    override = h.descriptor(("user", "o"), limit=(7, Unit.HOUR))
    response = await service.decide(h.rate_request("h", override))
    assert headers(response) == rate_headers(7, 6, UNTIL_HOUR_END)


async def test_with_instances_the_remaining_is_the_replica_share(make, ask):
    sharing = make(limiter=MemoryLimiter(instances=2))
    response = await ask([("user", "i")], to=sharing)
    # current_limit (and RateLimit-Limit) is the configured 5; this replica enforces 3.
    assert headers(response) == rate_headers(5, 2, UNTIL_MINUTE_END)
    assert response.statuses[0].limit_remaining == 2


async def test_header_names_are_configurable(make, ask):
    named = make(names=HeaderNames(limit="X-Limit", remaining="X-Left", reset="X-Reset", warning="X-Soft"))
    for _ in range(2):
        response = await ask([("burst", "n")], to=named)
    assert headers(response) == [("X-Limit", "2"), ("X-Left", "0"), ("X-Reset", "1")]
    refused = await ask([("burst", "n")], to=named)
    assert [key for key, _ in headers(refused)] == ["X-Limit", "X-Left", "X-Reset", "Retry-After"]


async def test_query_prints_the_headers(ask):
    lines = describe(await ask([("user", "q")]))
    assert lines[-3:] == [
        "  header RateLimit-Limit: 5",
        "  header RateLimit-Remaining: 4",
        "  header RateLimit-Reset: 30",
    ]


# -- warn_at: soft limits ----------------------------------------------------------------------


def warnings(response, name: str = "X-RateLimit-Warning") -> list[str]:
    return [value for key, value in headers(response) if key == name]


def warned(service: RateLimitService, stat_key: str) -> int:
    return service.stats.rules.rows[stat_key][WARNED]


async def test_warning_from_warn_at_of_the_limit_until_the_limit(make, ask):
    quiet = make(response_headers=False)
    seen = []
    for _ in range(21):
        response = await ask([("soft", "x")], to=quiet)
        seen.append((response.overall_code, warnings(response)))
    # 0.85 of 20 is exactly 17: no float rounding moves the threshold.
    assert seen[:16] == [(OK, [])] * 16
    assert seen[16:20] == [(OK, [f"soft: {percent}% of 20/minute used"]) for percent in (85, 90, 95, 100)]
    assert seen[20] == (OVER, []), "a refused request carries no warning"
    assert warned(quiet, "h.soft") == 4
    assert headers(response) == [], "warnings come with or without --response-headers"


async def test_warning_comes_with_the_rate_limit_headers(ask):
    response = await ask([("soft", "y")], hits=18)
    assert headers(response) == [
        ("X-RateLimit-Warning", "soft: 90% of 20/minute used"),
        *rate_headers(20, 2, UNTIL_MINUTE_END),
    ]


async def test_hits_addend_crossing_the_threshold_warns_and_counts_its_hits(service, ask):
    assert warnings(await ask([("soft", "z")], hits=16)) == []
    assert warnings(await ask([("soft", "z")], hits=3)) == ["soft: 95% of 20/minute used"]
    assert warned(service, "h.soft") == 3


async def test_a_rule_without_a_name_is_labelled_by_its_stat_key(service, ask):
    await ask([("soft_unnamed", "a"), ("tier", "gold")])
    response = await ask([("soft_unnamed", "a"), ("tier", "gold")])
    assert warnings(response) == ["h.soft_unnamed.tier: 50% of 4/hour used"]
    assert warned(service, "h.soft_unnamed.tier") == 1


async def test_no_warning_when_another_descriptor_refuses_the_request(service, ask):
    await ask([("soft", "r")], hits=17)
    await ask([("burst", "r")], [("burst", "r")])
    response = await ask([("soft", "r")], [("burst", "r")])
    assert response.overall_code == OVER
    assert warnings(response) == []
    assert warned(service, "h.soft") == 17, "the hits of the first request only"


async def test_shadow_rules_count_warnings_but_send_none(service, ask):
    response = await ask([("shadow", "w")])
    assert warnings(response) == []
    assert warned(service, "h.shadow") == 1
    await ask([("shadow", "w")])
    assert warned(service, "h.shadow") == 1, "over the limit is not a warning"


async def test_two_rules_past_warn_at_give_two_warnings(ask):
    await ask([("soft", "t")], hits=16)
    await ask([("soft_unnamed", "b"), ("tier", "t")])
    response = await ask([("soft", "t")], [("soft_unnamed", "b"), ("tier", "t")])
    assert warnings(response) == ["soft: 85% of 20/minute used", "h.soft_unnamed.tier: 50% of 4/hour used"]


async def test_warning_header_name_is_configurable(make, ask):
    named = make(names=HeaderNames(warning="X-Quota-Warning"))
    response = await ask([("soft", "n")], hits=20, to=named)
    assert warnings(response, "X-Quota-Warning") == ["soft: 100% of 20/minute used"]
    assert warnings(response) == []


async def test_a_domain_without_warn_at_never_looks_for_warnings(h, clock):
    rules = "domain: p\ndescriptors: [{key: k, rate_limit: {unit: second, requests_per_unit: 1}}]"
    plain = RateLimitService(h.config_of(rules), MemoryLimiter(), clock=clock)
    assert not plain.config.domains["p"].warns
    assert RateLimitService(h.config_of(RULES), MemoryLimiter()).config.domains["h"].warns
    response = await plain.decide(h.rate_request("p", h.descriptor(("k", "v"))))
    assert headers(response) == []


class FixedLimiter:
    """A backend that answers what the test says: as a sync or strict backend would,
    with the global count Redis reported, so headers and warnings need no Redis here."""

    def __init__(self, counts: Sequence[int], limits: Sequence[int]) -> None:
        self.counts, self.limits = tuple(counts), tuple(limits)

    async def check(self, checks: Sequence[Check], now: float) -> Decision:
        admitted, over, _ = decide(checks, self.counts, self.limits, admit_all=False)
        return Decision(admitted, over, self.counts, self.limits)


async def test_headers_and_warnings_come_from_the_decision_whatever_the_backend(make, ask):
    remote = make(limiter=FixedLimiter(counts=[18, 0], limits=[20, 3]))
    response = await ask([("soft", "redis")], [("ip", "redis")], to=remote)
    assert warnings(response) == ["soft: 90% of 20/minute used"]
    assert headers(response)[1:] == rate_headers(20, 2, UNTIL_MINUTE_END)
    refused = await ask([("soft", "redis")], [("ip", "redis")], to=make(limiter=FixedLimiter([21, 1], [20, 3])))
    assert headers(refused) == rate_headers(20, 0, UNTIL_MINUTE_END, retry_after=UNTIL_MINUTE_END)


def test_header_text_keeps_values_printable_ascii():
    assert header_text("per_user") == "per_user"
    assert header_text("a\r\nb\x00ü") == "a??b??"
    assert len(header_text("x" * 1000)) == 200


# -- config: warn_at ---------------------------------------------------------------------------


def test_warn_at_is_parsed_and_shown_in_config_json(h):
    domain = h.parse_domain(
        """
        domain: d
        descriptors:
          - key: a
            rate_limit: {unit: minute, requests_per_unit: 10, warn_at: 0.9}
          - key: b
            rate_limit: {unit: minute, requests_per_unit: 10}
        """
    )
    assert [rule.warn_at for rule in domain.rules] == [0.9, None]
    assert domain.warns
    assert rule_json(domain.rules[0])["warn_at"] == 0.9


@pytest.mark.parametrize("bad", ["0", "1", "1.5", "-0.2", "0.0", '"85%"', "true", "null", "[0.5]", ".nan"])
def test_invalid_warn_at_is_an_error_naming_file_line_and_field(h, bad):
    issues = h.parse_issues(
        f"""
        domain: d
        descriptors:
          - key: a
            rate_limit:
              unit: minute
              requests_per_unit: 10
              warn_at: {bad}
        """
    )
    issue = h.issue_at(issues, "descriptors[0].rate_limit.warn_at")
    assert str(issue).startswith(f"{h.TEST_FILE}:7: descriptors[0].rate_limit.warn_at: must be a fraction")
    assert len(issues) == 1


def test_warn_at_that_yaml_reads_as_text_says_so(h):
    issues = h.parse_issues(
        """
        domain: d
        descriptors:
          - key: a
            rate_limit: {unit: minute, requests_per_unit: 10, warn_at: 5e-1}
        """
    )
    assert str(h.issue_at(issues, "descriptors[0].rate_limit.warn_at")).endswith(
        "got '5e-1' (text, not a number: write a decimal such as 0.85)"
    )


def test_warn_at_on_an_unlimited_rule_is_an_error(h):
    issues = h.parse_issues(
        """
        domain: d
        descriptors:
          - key: a
            rate_limit: {unlimited: true, warn_at: 0.5}
        """
    )
    assert "must not be set when unlimited" in str(h.issue_at(issues, "descriptors[0].rate_limit.warn_at"))


def test_a_typo_of_warn_at_is_an_unknown_field(h):
    issues = h.parse_issues(
        """
        domain: d
        descriptors:
          - key: a
            rate_limit: {unit: minute, requests_per_unit: 1, warn: 0.5}
        """
    )
    assert "warn_at" in str(h.issue_at(issues, "descriptors[0].rate_limit.warn"))


def test_haproxy_export_keeps_the_limit_and_notes_the_soft_limit(h):
    domain = h.parse_domain(
        """
        domain: d
        descriptors:
          - key: generic_key
            value: api
            rate_limit: {name: api, unit: minute, requests_per_unit: 10, warn_at: 0.75}
        """
    )
    route = Route("every request", None, (Producer("test", (("generic_key", Const("api")),)),))
    sources = Sources("d", "test", (route,))
    result = export(domain, sources, ExportOptions())
    notes = [str(problem) for problem in result.problems]
    assert notes == [
        f"note: {h.TEST_FILE}:5: d.generic_key_api (api): warn_at 0.75: the limit is exported, "
        "the soft limit is not (HAProxy sends no warning header)"
    ]
    assert "not exported" not in result.text


def test_the_warned_metric_is_a_rule_stat():
    assert RULE_STATS[WARNED] == "warned"


# -- settings ------------------------------------------------------------------------------------


def settings_from(flags: list[str], environ: dict[str, str] | None = None):
    return resolved(flags, environ, config="c")


def test_settings_defaults_and_environment():
    settings = settings_from([])
    assert (settings.response_headers, settings.limit_header, settings.remaining_header) == (
        False,
        "RateLimit-Limit",
        "RateLimit-Remaining",
    )
    assert (settings.reset_header, settings.warn_header) == ("RateLimit-Reset", "X-RateLimit-Warning")
    environ = {"RLS_RESPONSE_HEADERS": "true", "RLS_LIMIT_HEADER": "X-Limit", "RLS_WARN_HEADER": "X-Soft"}
    settings = settings_from([], environ)
    assert (settings.response_headers, settings.limit_header, settings.warn_header) == (True, "X-Limit", "X-Soft")
    assert settings_from(["--response-headers", "--reset-header", "X-Reset"]).reset_header == "X-Reset"


@pytest.mark.parametrize("bad", ["", "Rate Limit", "X-Limit:", "ü", "a\nb"])
def test_a_header_name_must_be_a_token(bad):
    with pytest.raises(SettingsError, match=r"--limit-header='.*': must be an HTTP header name"):
        settings_from(["--limit-header", bad])


@pytest.mark.parametrize(
    "flags",
    [
        ["--remaining-header", "ratelimit-limit"],
        ["--warn-header", "RateLimit-Reset"],
        ["--reset-header", "retry-after"],
    ],
)
def test_header_names_must_differ(flags):
    with pytest.raises(SettingsError, match="must differ"):
        settings_from(flags)
