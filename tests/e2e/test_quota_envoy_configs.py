"""``export-envoy-quota`` output against the real Envoy 1.40: ``envoy --mode validate`` on the
shipped ``envoy/quota.yaml`` and on other exports, and ``envoy/quota.yaml`` kept current."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
import yaml

from sidecar.__main__ import main
from stack.envoy import ENVOY_CONFIGS, ingress_manager, validate_config

REPO = ENVOY_CONFIGS.parent
QUOTA = ENVOY_CONFIGS / "quota.yaml"
REGENERATE = ("export-envoy-quota", "examples/config", "--envoy", "envoy/front.yaml", "--full")
"""What envoy/quota.yaml is the output of (stdout), run in the repository."""


def export(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def test_quota_yaml_is_current(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    code, out, err = export(*REGENERATE)
    assert code == 0, err
    assert QUOTA.read_text() == out, (
        f"envoy/quota.yaml is stale: python -m sidecar {' '.join(REGENERATE)} > envoy/quota.yaml"
    )


def test_quota_yaml_keeps_front_yaml_listener_routes_and_upstream() -> None:
    front, quota = (yaml.safe_load(path.read_text()) for path in (ENVOY_CONFIGS / "front.yaml", QUOTA))
    front_manager, quota_manager = ingress_manager(front, ENVOY_CONFIGS), ingress_manager(quota, ENVOY_CONFIGS)
    for host in quota_manager["route_config"]["virtual_hosts"]:  # the route shape turns quota filters on per route
        for route in host["routes"]:
            configs = route.pop("typed_per_filter_config", {})
            assert all(name.startswith("envoy.filters.http.rate_limit_quota") for name in configs)
    assert quota_manager["route_config"] == front_manager["route_config"]
    assert {key: value for key, value in quota_manager.items() if key != "http_filters"} == {
        key: value for key, value in front_manager.items() if key != "http_filters"
    }
    names = [item["name"] for item in quota_manager["http_filters"]]
    assert names[-1] == "envoy.filters.http.router"
    assert all(name.startswith("envoy.filters.http.rate_limit_quota") for name in names[:-1])
    clusters = {item["name"]: item for item in quota["static_resources"]["clusters"]}
    assert set(clusters) == {"app", "rlqs"}
    rlqs = clusters["rlqs"]
    assert rlqs["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"][
        "explicit_http_config"
    ] == {"http2_protocol_options": {}}
    assert rlqs["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"] == {
        "address": "127.0.0.1",
        "port_value": 8081,
    }


@pytest.mark.envoy
def test_quota_yaml_validates() -> None:
    result = validate_config(QUOTA)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK" in result.stdout


@pytest.mark.envoy
def test_other_exports_validate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Deny-all fallback and another cluster name; and the filters alone, inserted by hand into
    front.yaml in place of its ratelimit filter (what a user pasting the default output does)."""
    monkeypatch.chdir(REPO)
    code, out, err = export(*REGENERATE, "--no-assignment", "deny", "--cluster", "limits")
    assert code == 0, err
    deny = tmp_path / "deny.yaml"
    deny.write_text(out)
    code, out, err = export(*REGENERATE[:-1])
    assert code == 0, err
    front = yaml.safe_load((ENVOY_CONFIGS / "front.yaml").read_text())
    manager = ingress_manager(front, ENVOY_CONFIGS)
    manager["http_filters"] = [*yaml.safe_load(out), manager["http_filters"][-1]]
    front["static_resources"]["clusters"][1]["name"] = "rlqs"
    pasted = tmp_path / "pasted.yaml"
    pasted.write_text(yaml.safe_dump(front))
    for path in (deny, pasted):
        result = validate_config(path)
        assert result.returncode == 0, f"{path.name}: {result.stdout}{result.stderr}"


@pytest.mark.envoy
def test_envoy_accepts_a_token_bucket_fallback_so_the_check_must_refuse_it(tmp_path: Path) -> None:
    """Envoy 1.40 validates (and starts with) a token-bucket no_assignment_behavior, then
    segfaults on the bucket's second request: only our check stands in the way."""
    document = yaml.safe_load(QUOTA.read_text())
    chain = ingress_manager(document, QUOTA)["http_filters"]
    matcher = chain[0]["typed_config"]["bucket_matchers"]
    action = (matcher.get("on_no_match") or matcher["matcher_list"]["matchers"][0]["on_match"])["action"]
    action["typed_config"]["no_assignment_behavior"] = {
        "fallback_rate_limit": {"token_bucket": {"max_tokens": 5, "tokens_per_fill": 5, "fill_interval": "1s"}}
    }
    path = tmp_path / "crash.yaml"
    path.write_text(yaml.safe_dump(document))
    assert validate_config(path).returncode == 0
    code, _, err = export("export-envoy-quota", "--envoy", str(path), "--check")
    assert code == 1
    assert "filter 'envoy.filters.http.rate_limit_quota'" in err
