"""deploy/recipes: the Istio EnvoyFilter, checked as far as this machine allows.

No Istio here, so the test does what istiod would do with the three patches (add the
cluster, insert the filter before the router of the inbound HTTP connection manager,
merge ``rate_limits`` into the inbound routes) on an inbound listener shaped like the
one Istio generates, and has the real Envoy 1.40 validate the result
(``envoy --mode validate``): every typed config in the patches is checked by Envoy itself.
"""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from sidecar.__main__ import _parser
from sidecar.settings import SettingsError, resolve
from stack.envoy import envoy_binary
from tests.support.deploy import KUBERNETES, REPO

ENVOY_FILTER = REPO / "deploy" / "recipes" / "istio" / "envoyfilter.yaml"
HCM = "envoy.filters.network.http_connection_manager"
ROUTER = "envoy.filters.http.router"

pytestmark = pytest.mark.envoy


def istio_inbound(port: int = 8080) -> dict[str, Any]:
    """The parts of istio-proxy's config the patches touch: the virtualInbound listener with one
    HTTP filter chain for the app's port, its route and its inbound cluster (names as Istio's)."""
    cluster = f"inbound|{port}||"
    return {
        "static_resources": {
            "listeners": [
                {
                    "name": "virtualInbound",
                    "address": {"socket_address": {"address": "0.0.0.0", "port_value": 15006}},
                    "filter_chains": [
                        {
                            "filter_chain_match": {"destination_port": port},
                            "filters": [
                                {
                                    "name": HCM,
                                    "typed_config": {
                                        "@type": "type.googleapis.com/envoy.extensions.filters.network."
                                        "http_connection_manager.v3.HttpConnectionManager",
                                        "stat_prefix": f"inbound_0.0.0.0_{port}",
                                        "route_config": {
                                            "name": cluster,
                                            "virtual_hosts": [
                                                {
                                                    "name": f"inbound|http|{port}",
                                                    "domains": ["*"],
                                                    "routes": [
                                                        {
                                                            "name": "default",
                                                            "match": {"prefix": "/"},
                                                            "route": {"cluster": cluster, "timeout": "0s"},
                                                        }
                                                    ],
                                                }
                                            ],
                                        },
                                        "http_filters": [
                                            {
                                                "name": ROUTER,
                                                "typed_config": {
                                                    "@type": "type.googleapis.com/"
                                                    "envoy.extensions.filters.http.router.v3.Router"
                                                },
                                            }
                                        ],
                                    },
                                }
                            ],
                        }
                    ],
                }
            ],
            "clusters": [
                {
                    "name": cluster,
                    "type": "STATIC",
                    "connect_timeout": "10s",
                    "load_assignment": {
                        "cluster_name": cluster,
                        "endpoints": [
                            {
                                "lb_endpoints": [
                                    {
                                        "endpoint": {
                                            "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}
                                        }
                                    }
                                ]
                            }
                        ],
                    },
                }
            ],
        }
    }


def merge(target: dict[str, Any], patch: dict[str, Any]) -> None:
    """Istio's MERGE: maps merge recursively, everything else is replaced."""
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            merge(target[key], value)
        else:
            target[key] = copy.deepcopy(value)


def apply_patches(config: dict[str, Any], envoy_filter: dict[str, Any]) -> dict[str, Any]:
    """The three patch kinds the recipe uses, as istiod applies them to a sidecar's inbound config."""
    patched = copy.deepcopy(config)
    resources = patched["static_resources"]
    managers = [
        item["typed_config"]
        for listener in resources["listeners"]
        for chain in listener["filter_chains"]
        for item in chain["filters"]
        if item["name"] == HCM
    ]
    for patch in envoy_filter["spec"]["configPatches"]:
        kind, operation, value = patch["applyTo"], patch["patch"]["operation"], patch["patch"]["value"]
        if (kind, operation) == ("CLUSTER", "ADD"):
            resources["clusters"].append(copy.deepcopy(value))
        elif (kind, operation) == ("HTTP_FILTER", "INSERT_BEFORE"):
            assert patch["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"] == ROUTER
            for manager in managers:
                names = [item["name"] for item in manager["http_filters"]]
                manager["http_filters"].insert(names.index(ROUTER), copy.deepcopy(value))
        elif (kind, operation) == ("HTTP_ROUTE", "MERGE"):
            assert patch["match"]["routeConfiguration"]["vhost"]["route"] == {"action": "ANY"}
            for manager in managers:
                for host in manager["route_config"]["virtual_hosts"]:
                    for route in host["routes"]:
                        merge(route, value)
        else:
            raise AssertionError(f"the recipe uses a patch this test does not apply: {kind} {operation}")
    return patched


def envoy_validate(config: dict[str, Any], path: Path) -> subprocess.CompletedProcess[str]:
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(path), "--log-level", "error"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.fixture(scope="module")
def envoy_filter() -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load(ENVOY_FILTER.read_text())
    return document


def test_the_patched_inbound_listener_validates_in_envoy(envoy_filter: dict[str, Any], tmp_path: Path) -> None:
    patched = apply_patches(istio_inbound(), envoy_filter)
    result = envoy_validate(patched, tmp_path / "patched.yaml")
    assert result.returncode == 0, result.stdout + result.stderr
    manager = patched["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    assert [item["name"] for item in manager["http_filters"]] == ["envoy.filters.http.ratelimit", ROUTER]
    (route,) = manager["route_config"]["virtual_hosts"][0]["routes"]
    assert route["route"]["cluster"] == "inbound|8080||", "MERGE kept the route's own fields"
    assert route["route"]["rate_limits"] == [{"actions": [{"remote_address": {}}]}]


def test_envoy_validate_refuses_a_broken_patch(envoy_filter: dict[str, Any], tmp_path: Path) -> None:
    """The check above means something: a misspelt field in the filter's typed config fails."""
    broken = copy.deepcopy(envoy_filter)
    filter_patch = next(p for p in broken["spec"]["configPatches"] if p["applyTo"] == "HTTP_FILTER")
    filter_patch["patch"]["value"]["typed_config"]["failure_mode_denied"] = True
    result = envoy_validate(apply_patches(istio_inbound(), broken), tmp_path / "broken.yaml")
    assert result.returncode != 0
    assert "failure_mode_denied" in result.stdout + result.stderr


def test_the_recipe_points_at_the_sidecar_of_deploy_kubernetes(envoy_filter: dict[str, Any]) -> None:
    assert (envoy_filter["apiVersion"], envoy_filter["kind"]) == ("networking.istio.io/v1alpha3", "EnvoyFilter")
    patches = {patch["applyTo"]: patch["patch"]["value"] for patch in envoy_filter["spec"]["configPatches"]}
    cluster, ratelimit = patches["CLUSTER"], patches["HTTP_FILTER"]
    address = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    deployment = yaml.safe_load((KUBERNETES / "base" / "app-deployment.yaml").read_text())
    spec = deployment["spec"]["template"]
    (sidecar,) = spec["spec"]["initContainers"]
    environment = {item["name"]: item["value"] for item in sidecar["env"]}
    assert f"{address['address']}:{address['port_value']}" == environment["RLS_GRPC_ADDRESS"]
    assert (
        ratelimit["typed_config"]["rate_limit_service"]["grpc_service"]["envoy_grpc"]["cluster_name"]
        == (cluster["name"])
    )
    assert ratelimit["typed_config"]["domain"] == "demo"
    assert envoy_filter["spec"]["workloadSelector"]["labels"].items() <= spec["metadata"]["labels"].items()


@pytest.mark.parametrize("address", ["unix:/run/ratelimit/grpc.sock", "unix:///run/ratelimit/grpc.sock"])
def test_unix_socket_addresses_are_not_supported_yet(address: str) -> None:
    """deploy/recipes/README.md says the ratelimit cluster cannot be a unix socket: true while this holds."""
    with pytest.raises(SettingsError, match="HOST:PORT"):
        resolve(_parser().parse_args(["serve", "--config", "c", "--grpc-address", address]), environ={})
