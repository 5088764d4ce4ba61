"""``export-envoy-quota --per-request``: chosen routes keep the per-request ``ratelimit`` filter,
the rest go to quota mode, in one Envoy config. Through a real Envoy:
``tests/e2e/quota_corpus/one_envoy_both_paths`` (``tests/e2e/test_quota_envoy_corpus.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from sidecar.config import load_config
from sidecar.export.envoy_quota.export import FILTER_CONFIG, export_quota, quota_document
from sidecar.export.envoy_routes import RATELIMIT_FILTER
from sidecar.export.problems import ExportError
from tests.sidecar.export.envoy_quota.test_export import run_cli
from tests.sidecar.export.envoy_quota.test_virtual_hosts import RULES, envoy_config, generic, key
from tests.support.quota_matchers import Request, buckets

ORIGIN = Path("envoy.yaml")
HOSTS = f"""\
- name: app
  domains: ["*"]
  routes:
    - name: legacy
      match: {{prefix: /legacy}}
      route: {{cluster: a, rate_limits: [{{actions: [{{masked_remote_address: {{}}}}]}}]}}
    - {{match: {{prefix: /}}, route: {{cluster: a, rate_limits: {key("api")}}}}}
"""


def document() -> dict[str, Any]:
    found = envoy_config(HOSTS)
    manager = found["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    manager["http_filters"][0]["typed_config"]["rate_limit_service"] = {
        "grpc_service": {"envoy_grpc": {"cluster_name": "ratelimit"}}
    }
    found["static_resources"]["clusters"] = [{"name": "ratelimit"}, {"name": "a"}]
    return found


def domains(tmp_path: Path) -> Any:
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES + "  - {key: masked_remote_address, rate_limit: {unit: second, requests_per_unit: 5}}\n")
    return load_config(str(rules)).domains


def test_a_route_kept_per_request_gets_no_bucket_and_drops_nothing(tmp_path: Path) -> None:
    with_all = export_quota(domains(tmp_path), document(), ORIGIN)
    assert [str(item) for item in with_all.dropped] != []  # masked_remote_address alone: refused
    result = export_quota(domains(tmp_path), document(), ORIGIN, per_request=["legacy"])
    assert result.dropped == ()
    assert result.per_request == (("app", 0),)
    assert buckets(result.filters, Request("/legacy/x")) == []  # never falls through to route 1's bucket
    assert buckets(result.filters, Request("/x")) == [generic("api")]
    same = export_quota(domains(tmp_path), document(), ORIGIN, per_request=["app:0"])
    assert same.filters == result.filters


def test_the_full_config_keeps_the_ratelimit_filter_and_turns_it_off_elsewhere(tmp_path: Path) -> None:
    result = export_quota(domains(tmp_path), document(), ORIGIN, per_request=["legacy"])
    full = quota_document(document(), ORIGIN, result.filters, "rlqs", result.per_request)
    manager = full["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    names = [item["name"] for item in manager["http_filters"]]
    assert names == ["envoy.filters.http.rate_limit_quota", RATELIMIT_FILTER]
    legacy, rest = manager["route_config"]["virtual_hosts"][0]["routes"]
    assert "typed_per_filter_config" not in legacy
    assert rest["typed_per_filter_config"][RATELIMIT_FILTER] == {"@type": FILTER_CONFIG, "disabled": True}
    assert [item["name"] for item in full["static_resources"]["clusters"]] == ["ratelimit", "a", "rlqs"]


def test_a_descriptor_on_both_paths_is_a_limit_not_kept(tmp_path: Path) -> None:
    hosts = f"""\
    - name: app
      domains: ["*"]
      routes:
        - {{name: legacy, match: {{prefix: /legacy}}, route: {{cluster: a, rate_limits: {key("api")}}}}}
        - {{match: {{prefix: /}}, route: {{cluster: a, rate_limits: {key("api")}}}}}
    """
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    result = export_quota(load_config(str(rules)).domains, envoy_config(hosts), ORIGIN, per_request=["legacy"])
    (dropped,) = result.dropped
    assert "route 0 'legacy' (prefix /legacy) rate_limits[0]" in str(dropped)
    assert "the two paths count it apart" in str(dropped)


def test_an_unknown_route_and_a_missing_full_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match=r"--per-request nope: no such route \(routes: app:0 \(legacy\), app:1\)"):
        export_quota(domains(tmp_path), document(), ORIGIN, per_request=["nope"])
    rules = tmp_path / "rules.yaml"
    envoy = tmp_path / "envoy.yaml"
    envoy.write_text(yaml.safe_dump(document()))
    code, out, err = run_cli("export-envoy-quota", str(rules), "--envoy", str(envoy), "--per-request", "legacy")
    assert (code, out) == (1, "")
    assert "--per-request changes the routes too: it needs --full" in err
    code, out, err = run_cli(
        "export-envoy-quota", str(rules), "--envoy", str(envoy), "--per-request", "legacy", "--full"
    )
    assert code == 0, err
    assert "--full --per-request legacy" in out.splitlines()[0]
    assert "Routes kept on the per-request envoy.filters.http.ratelimit filter" in out


def test_untranslated_routes_can_be_kept_per_request_at_once(tmp_path: Path) -> None:
    """``--per-request-untranslated``: every route with a limit quota mode cannot express keeps
    the per-request filter, so nothing is left out."""
    result = export_quota(domains(tmp_path), document(), ORIGIN, untranslated_per_request=True)
    assert result.dropped == ()
    assert result.per_request == (("app", 0),)
    assert buckets(result.filters, Request("/legacy")) == []
    assert buckets(result.filters, Request("/x")) == [generic("api")]
    envoy = tmp_path / "envoy.yaml"
    envoy.write_text(yaml.safe_dump(document()))
    rules = str(tmp_path / "rules.yaml")
    code, out, err = run_cli("export-envoy-quota", rules, "--envoy", str(envoy), "--per-request-untranslated", "--full")
    assert code == 0, err
    assert "Routes kept on the per-request envoy.filters.http.ratelimit filter (off on every other route): app:0" in out
