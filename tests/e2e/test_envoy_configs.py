"""Every Envoy config we ship passes ``envoy --mode validate``, and so does every copy we render."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from stack.envoy import (
    ENVOY_CONFIGS,
    EnvoyPorts,
    ingress_manager,
    ratelimit_filter,
    render,
    validate_config,
)

pytestmark = [pytest.mark.envoy]

SHIPPED = sorted(ENVOY_CONFIGS.glob("*.yaml"))
PER_REQUEST = [path for path in SHIPPED if path.name != "quota.yaml"]
"""The configs with the ratelimit filter, which ``render`` rewrites (quota.yaml: test_quota_envoy_configs.py)."""


def test_both_configs_are_shipped() -> None:
    assert {path.name for path in SHIPPED} >= {"sidecar.yaml", "front.yaml"}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda path: path.name)
def test_shipped_config_validates(path: Path) -> None:
    result = validate_config(path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK" in result.stdout


@pytest.mark.parametrize("path", PER_REQUEST, ids=lambda path: path.name)
def test_rendered_copies_validate_and_change_only_addresses(path: Path, tmp_path: Path) -> None:
    ports = EnvoyPorts(listen=20001, admin=20002, app=20003, ratelimit=20004)
    for variant, options in {
        "deny": {"failure_mode_deny": True, "timeout_seconds": 0.5},
        "no-filter": {"ratelimit": False},
    }.items():
        rendered = render(path, ports, **options)  # type: ignore[arg-type]
        target = tmp_path / f"{variant}.yaml"
        target.write_text(yaml.safe_dump(rendered))
        result = validate_config(target)
        assert result.returncode == 0, f"{variant}: {result.stdout}{result.stderr}"
    original = yaml.safe_load(path.read_text())
    copy = render(path, ports)
    assert ingress_manager(copy, path)["route_config"] == ingress_manager(original, path)["route_config"]
    assert ratelimit_filter(copy, path) == ratelimit_filter(original, path)
    assert copy["admin"]["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 20002}


def test_front_and_sidecar_send_the_same_descriptors_to_the_same_filter() -> None:
    """The demo must show what a pod does: only the trusted X-Forwarded-For hops differ."""
    pod = yaml.safe_load((ENVOY_CONFIGS / "sidecar.yaml").read_text())
    front = yaml.safe_load((ENVOY_CONFIGS / "front.yaml").read_text())
    pod_manager, front_manager = ingress_manager(pod, ENVOY_CONFIGS), ingress_manager(front, ENVOY_CONFIGS)
    assert pod_manager["route_config"] == front_manager["route_config"]
    assert pod_manager["http_filters"] == front_manager["http_filters"]
    assert (pod_manager["xff_num_trusted_hops"], front_manager["xff_num_trusted_hops"]) == (0, 1)
    assert pod["static_resources"]["clusters"] == front["static_resources"]["clusters"]


def test_the_filter_is_configured_as_documented() -> None:
    limiter = ratelimit_filter(yaml.safe_load((ENVOY_CONFIGS / "sidecar.yaml").read_text()), ENVOY_CONFIGS)
    assert limiter["domain"] == "demo"
    assert limiter["failure_mode_deny"] is False
    assert limiter["enable_x_ratelimit_headers"] == "DRAFT_VERSION_03"
    assert limiter["rate_limit_service"]["transport_api_version"] == "V3"
    assert limiter["rate_limit_service"]["grpc_service"]["envoy_grpc"]["cluster_name"] == "ratelimit"


def test_a_broken_template_is_named_in_the_error(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    config = yaml.safe_load((ENVOY_CONFIGS / "sidecar.yaml").read_text())
    config["static_resources"]["clusters"][1]["name"] = "limits"
    broken.write_text(yaml.safe_dump(config))
    with pytest.raises(ValueError, match=r"broken\.yaml: no cluster named 'ratelimit'"):
        render(broken, EnvoyPorts(1, 2, 3, 4))
