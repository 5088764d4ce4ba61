"""deploy/recipes: the Istio EnvoyFilter and the plain-Envoy unix-socket cluster, checked as far
as this machine allows.

No Istio here, so the test does what istiod would do with the three patches (add the
cluster, insert the filter before the router of the inbound HTTP connection manager,
merge ``rate_limits`` into the inbound routes) on an inbound listener shaped like the
one Istio generates, and has the real Envoy 1.40 validate the result
(``envoy --mode validate``): every typed config in the patches is checked by Envoy itself.

The unix-socket recipe runs for real: a sidecar serving on ``unix:PATH``, Envoy with
``envoy/sidecar.yaml`` whose ``ratelimit`` cluster is the recipe's ``pipe`` cluster, and
the sample upstream; a burst over the per-address limit gets its 429s through the socket.
"""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from sidecar.__main__ import _parser
from sidecar.client import health_status
from sidecar.settings import resolve
from stack.envoy import ENVOY_CONFIGS, EnvoyPorts, EnvoyProcess, validate_config
from stack.processes import Child, free_port, process_group
from stack.sidecar import clean_env, serve_argv
from stack.topology import EXAMPLE_CONFIG
from stack.upstream import UpstreamProcess
from tests.support.deploy import KUBERNETES, REPO
from tests.support.envoys import Session, fresh_window

ENVOY_FILTER = REPO / "deploy" / "recipes" / "istio" / "envoyfilter.yaml"
UNIX_SOCKET = REPO / "deploy" / "recipes" / "envoy" / "ratelimit-unix-socket.yaml"
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
    return validate_config(path)


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


# ------------------------------------------------------------------------- plain Envoy, unix socket


@pytest.fixture(scope="module")
def unix_cluster() -> dict[str, Any]:
    document = yaml.safe_load(UNIX_SOCKET.read_text())
    (cluster,) = document["clusters"]
    assert isinstance(cluster, dict)
    return cluster


def pipe_of(cluster: dict[str, Any]) -> dict[str, Any]:
    pipe: dict[str, Any] = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["pipe"]
    return pipe


def test_the_unix_socket_recipe_is_envoy_sidecar_yaml_on_the_sidecar_flag(unix_cluster: dict[str, Any]) -> None:
    """Only the address differs from envoy/sidecar.yaml's cluster, and the flag the recipe
    gives the sidecar (and its RLS_* form) resolves to the same path."""
    config = yaml.safe_load((ENVOY_CONFIGS / "sidecar.yaml").read_text())
    (tcp,) = [item for item in config["static_resources"]["clusters"] if item["name"] == "ratelimit"]
    assert {key: value for key, value in unix_cluster.items() if key != "load_assignment"} == {
        key: value for key, value in tcp.items() if key != "load_assignment"
    }
    path = pipe_of(unix_cluster)["path"]
    text = UNIX_SOCKET.read_text()
    (flag,) = re.findall(r"--grpc-address (unix:[\w/.-]+)", text)
    (variable,) = re.findall(r"RLS_GRPC_ADDRESS=(unix:[\w/.-]+)", text)
    by_flag = resolve(_parser().parse_args(["serve", "--config", "c", "--grpc-address", flag]), environ={})
    by_variable = resolve(_parser().parse_args(["serve", "--config", "c"]), environ={"RLS_GRPC_ADDRESS": variable})
    assert by_flag.grpc_address == by_variable.grpc_address == f"unix:{path}"


class UnixSidecar(Child):
    """``python -m sidecar serve --grpc-address unix:PATH``, ready once SERVING on the socket."""

    ready_sign = "gRPC health SERVING on the unix socket"

    def __init__(self, socket: Path, directory: Path) -> None:
        self.address = f"unix:{socket}"
        argv = serve_argv(
            ["--config", str(EXAMPLE_CONFIG), "--backend", "memory"],
            grpc_address=self.address,
            metrics_address=f"127.0.0.1:{free_port()}",
        )
        super().__init__("sidecar", argv, directory / "sidecar.log", env=clean_env())

    def ready(self) -> bool:
        try:
            return health_status(self.address, timeout=0.5) == "SERVING"
        except grpc.RpcError:
            return False


@pytest.fixture
def socket_directory() -> Iterator[Path]:
    """A short directory under /tmp: a unix socket path must fit in 108 bytes."""
    directory = Path(tempfile.mkdtemp(prefix="rls-", dir="/tmp"))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.slow
def test_over_the_limit_gets_429_through_the_unix_socket_cluster(
    unix_cluster: dict[str, Any], socket_directory: Path, tmp_path: Path
) -> None:
    socket = socket_directory / "rls.sock"
    cluster = copy.deepcopy(unix_cluster)
    pipe_of(cluster)["path"] = str(socket)
    with process_group() as group:
        upstream = group.start_ready(lambda: UpstreamProcess("app", tmp_path))
        sidecar = group.start_ready(lambda: UnixSidecar(socket, tmp_path))
        assert socket.is_socket()

        def build() -> EnvoyProcess:
            # envoy/sidecar.yaml on free ports, then the recipe's cluster in place of the TCP one.
            envoy = EnvoyProcess(
                "envoy", ENVOY_CONFIGS / "sidecar.yaml", EnvoyPorts.free(upstream.port, free_port()), tmp_path
            )
            config = yaml.safe_load(envoy.config_path.read_text())
            clusters = config["static_resources"]["clusters"]
            clusters[:] = [item for item in clusters if item["name"] != "ratelimit"] + [cluster]
            envoy.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
            return envoy

        envoy = group.start_ready(build)
        session = Session(envoy.url)
        fresh_window(1)
        # examples/config/demo.yaml: 20/second per client address (all 127.0.0.1 here).
        statuses = [session.send("/").status for _ in range(25)]
        session.close()
        assert statuses == [200] * 20 + [429] * 5, statuses
        # The verdicts came from the sidecar over the socket, not from a failure (fail open).
        filter_counters = envoy.counters()
        assert filter_counters.get("over_limit") == 5 and "error" not in filter_counters, filter_counters
        assert envoy.counters("cluster.ratelimit.")["upstream_cx_total"] >= 1
        assert sidecar.alive(), sidecar.log_tail()
