"""What ``query`` prints for a descriptor that got no limit (sidecar/client.py describe()).

The service answers a bare OK both for a descriptor no rule matched and for one whose rules
another matched rule ``replaces``; only the config tells them apart, so ``query --config``
(default ``RLS_CONFIG``) names the replaced rule and its replacer, and without a config the
line says it cannot tell instead of claiming no rule matched.
"""

from __future__ import annotations

from pathlib import Path

from sidecar.client import Replaced, build_request, describe, replaced_rules
from sidecar.config import load_config
from sidecar.protos.envoy.service.ratelimit.v3 import rls_pb2

DEMO_CONFIG = Path(__file__).resolve().parents[2] / "examples" / "config"
OK = rls_pb2.RateLimitResponse.OK


def premium_request() -> object:
    """The demo's /api request with a premium key: premium_key replaces api_route."""
    return build_request("demo", ["generic_key=api", "generic_key=api,api_key=premium-1", "nothing=here"])


def answer_with_bare_ok_first() -> object:
    limited = rls_pb2.RateLimitResponse.DescriptorStatus(code=OK, limit_remaining=99)
    limited.current_limit.requests_per_unit = 100
    limited.current_limit.unit = 3  # MINUTE
    limited.current_limit.name = "premium_key"
    bare = rls_pb2.RateLimitResponse.DescriptorStatus(code=OK)
    return rls_pb2.RateLimitResponse(overall_code=OK, statuses=[bare, limited, bare])


def test_replaced_rules_name_the_dropped_rule_and_its_replacer() -> None:
    found = replaced_rules(load_config(DEMO_CONFIG), premium_request())
    assert found == {0: Replaced(rules=("api_route",), by=("premium_key",))}


def test_a_replaced_rule_is_not_reported_as_no_match() -> None:
    replaced = replaced_rules(load_config(DEMO_CONFIG), premium_request())
    lines = describe(answer_with_bare_ok_first(), replaced)
    assert lines[1] == "  [0] OK no limit: api_route replaced by premium_key"
    assert lines[3] == "  [2] OK no rule matched"


def test_without_a_config_the_line_does_not_claim_no_match() -> None:
    lines = describe(answer_with_bare_ok_first())
    assert lines[1] == "  [0] OK no limit: no rule matched, or replaced (--config tells which)"


def test_a_domain_the_config_lacks_replaces_nothing() -> None:
    assert replaced_rules(load_config(DEMO_CONFIG), build_request("elsewhere", ["generic_key=api"])) == {}
