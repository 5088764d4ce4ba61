"""Structural checks on the rendered Kubernetes overlays, for what an SRE reviews first:
who may connect to what (NetworkPolicies against the labels and ports of the pods they
mean), that no credential is written in plain text, that no pod carries an API token,
and that every image is one the documented build produces or a pinned public one.

The overlays are rendered by ``kubectl kustomize`` (tests/deploy/conftest.py); the build
commands are read from docs/deployment.md, the stages from the Dockerfile.
"""

from __future__ import annotations

import itertools
import re
import shutil
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from tests.deploy.kubernetes_support import (
    BASE,
    OVERLAYS,
    REFERENCE,
    Resources,
    containers,
    named,
    parse,
    pod,
    pod_templates,
    render,
)
from tests.support.deploy import KUBERNETES, REPO, read_dockerfile

DEPLOYMENT_DOC = REPO / "docs" / "deployment.md"
CLUSTER_SETTINGS = BASE / "cluster-settings.yaml"
BUILD = re.compile(r"^docker build -t (?P<tag>\S+)(?: --target (?P<target>\S+))? \.$", re.MULTILINE)
KIND_LOAD = re.compile(r"^kind load docker-image (?P<tags>[^\n]+?)(?: --name \S+)?$", re.MULTILINE)
CREDENTIAL_FLAGS = {"--requirepass", "--masterauth"}
"""Server arguments whose next argument is a password."""
EXAMPLE_ANNOTATION = "ratelimit-sidecar/example"
"""A Secret may carry a value in the repository only when it says it is an example."""


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A label selector (matchLabels only: the only form these manifests use) against labels."""
    assert set(selector) <= {"matchLabels"}, f"unsupported selector form: {sorted(selector)}"
    match: dict[str, str] = selector.get("matchLabels", {})
    return match.items() <= labels.items()


def policies(resources: Resources) -> dict[str, dict[str, Any]]:
    return {name: resource for (kind, name), resource in resources.items() if kind == "NetworkPolicy"}


def settings() -> dict[str, str]:
    data: dict[str, str] = yaml.safe_load(CLUSTER_SETTINGS.read_text())["data"]
    return data


# ------------------------------------------------------------------------- NetworkPolicies


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pod_is_selected_by_the_network_policy_named_after_it(
    overlays: dict[str, Resources], overlay: str
) -> None:
    """Each workload has its own policy (same name), and a policy selects its pods and no other's."""
    templates = pod_templates(overlays[overlay])
    found = policies(overlays[overlay])
    assert {name for _, name in templates} == set(found)
    for name, policy in found.items():
        selected = [
            key
            for key, template in templates.items()
            if selects(policy["spec"]["podSelector"], template["metadata"]["labels"])
        ]
        assert [key[1] for key in selected] == [name], (name, selected)
        assert policy["spec"]["policyTypes"] == ["Ingress"], name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policy_ports_and_peers_exist(overlays: dict[str, Resources], overlay: str) -> None:
    """Named ports are ports of the selected pods' containers; pod peers are the app pods."""
    resources = overlays[overlay]
    templates = pod_templates(resources)
    app_labels = templates["Deployment", "app"]["metadata"]["labels"]
    for name, policy in policies(resources).items():
        (template,) = [t for (_, n), t in templates.items() if n == name]
        declared = {port["name"] for c in containers(template["spec"]) for port in c.get("ports", [])}
        for rule in policy["spec"]["ingress"]:
            assert {port["port"] for port in rule["ports"]} <= declared, (name, rule)
            for peer in rule.get("from", []):
                if "podSelector" in peer:
                    assert selects(peer["podSelector"], app_labels), (name, peer)
                    assert "namespaceSelector" not in peer, "same namespace only"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_app_pods_admit_envoy_from_anywhere_and_metrics_only_from_prometheus(
    overlays: dict[str, Resources], overlay: str
) -> None:
    policy = policies(overlays[overlay])["app"]
    admitted = {port["port"]: rule.get("from") for rule in policy["spec"]["ingress"] for port in rule["ports"]}
    assert set(admitted) == {"http", "metrics"}, "the JSON port (8080) and gRPC (8081): nothing from outside"
    assert admitted["http"] is None, "the app's own traffic, through Envoy"
    namespace = {"kubernetes.io/metadata.name": settings()["prometheusNamespace"]}
    assert admitted["metrics"] == [{"namespaceSelector": {"matchLabels": namespace}}]
    sidecar = named(containers(pod(overlays[overlay])), "ratelimit")
    assert named(sidecar["ports"], "metrics"), "the admin port the policy names"


def test_redis_admits_only_the_app_pods_on_its_port(overlays: dict[str, Resources]) -> None:
    policy = policies(overlays["sync-dev"])["redis-dev"]
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"port": "redis", "protocol": "TCP"}]
    assert rule["from"] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "app"}}}]


def test_selector_check_can_fail(overlays: dict[str, Resources]) -> None:
    policy = policies(overlays["sync-dev"])["redis-dev"]
    templates = pod_templates(overlays["sync-dev"])
    wrong = {"matchLabels": {"app.kubernetes.io/name": "redis"}}  # the component's old label
    assert selects(policy["spec"]["podSelector"], templates["StatefulSet", "redis-dev"]["metadata"]["labels"])
    assert not selects(wrong, templates["StatefulSet", "redis-dev"]["metadata"]["labels"])


def test_cluster_settings_are_set_in_one_place(tmp_path: Path) -> None:
    """Changing cluster-settings.yaml alone moves the Prometheus namespace and the PodMonitor's
    release label; the file itself is never applied."""
    copy = tmp_path / "kubernetes"
    shutil.copytree(KUBERNETES, copy)
    edited = (copy / "base" / "cluster-settings.yaml").read_text()
    edited = edited.replace("prometheusNamespace: monitoring", "prometheusNamespace: observability")
    edited = edited.replace("prometheusRelease: kube-prometheus-stack", "prometheusRelease: prom")
    (copy / "base" / "cluster-settings.yaml").write_text(edited)
    resources = parse(render(copy / "overlays" / "memory"))
    assert ("ConfigMap", "cluster-settings") not in resources
    assert resources["PodMonitor", "ratelimit-sidecar"]["metadata"]["labels"]["release"] == "prom"
    (_, rule) = resources["NetworkPolicy", "app"]["spec"]["ingress"]
    assert rule["from"][0]["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "observability"}
    text = render(copy / "overlays" / "memory")
    assert "PROMETHEUS_" not in text, "a placeholder no replacement reached"


# ------------------------------------------------------------------------- secrets and tokens


def plain_credentials(template: dict[str, Any]) -> list[str]:
    """Where a pod template carries a password itself rather than a $(NAME) read from a Secret:
    the password of a URL in an env value or argument, or the argument after --requirepass."""
    found = []
    for container in containers(template["spec"]):
        env = container.get("env", [])
        from_secret = {item["name"] for item in env if "secretKeyRef" in item.get("valueFrom", {})}
        arguments: list[str] = container.get("args", [])
        secrets = [
            (value, urlsplit(value).password)
            for value in [item["value"] for item in env if "value" in item] + arguments
            if "://" in value
        ]
        secrets += [(word, following) for word, following in itertools.pairwise(arguments) if word in CREDENTIAL_FLAGS]
        for where, secret in secrets:
            reference = REFERENCE.fullmatch(secret or "")
            if secret is not None and (reference is None or reference[1] not in from_secret):
                found.append(f"{container['name']}: {where}")
    return found


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_secret_value_in_plain_text(overlays: dict[str, Resources], overlay: str) -> None:
    resources = overlays[overlay]
    for (kind, name), resource in resources.items():
        if kind == "Secret":
            assert resource["metadata"].get("annotations", {}).get(EXAMPLE_ANNOTATION) == "true", name
    for key, template in pod_templates(resources).items():
        assert plain_credentials(template) == [], key


def test_plain_credential_check_can_fail(overlays: dict[str, Resources]) -> None:
    template = pod_templates(overlays["sync-dev"])["StatefulSet", "redis-dev"]
    (server,) = template["spec"]["containers"]
    leaked = {**server, "args": ["--requirepass", "hunter2"]}
    assert plain_credentials({"spec": {"containers": [leaked]}}) == ["redis: --requirepass"]
    url = {"name": "app", "env": [{"name": "RLS_REDIS_URL", "value": "redis://:hunter2@redis:6379"}]}
    assert plain_credentials({"spec": {"containers": [url]}}) == ["app: redis://:hunter2@redis:6379"]
    unknown = {"name": "app", "env": [{"name": "RLS_REDIS_URL", "value": "redis://:$(NOT_A_SECRET)@redis:6379"}]}
    assert len(plain_credentials({"spec": {"containers": [unknown]}})) == 1


def test_no_secret_manifest_in_the_repository() -> None:
    for path in KUBERNETES.rglob("*.yaml"):
        for document in yaml.safe_load_all(path.read_text()):
            if isinstance(document, dict) and document.get("kind") == "Secret":
                assert document["metadata"].get("annotations", {}).get(EXAMPLE_ANNOTATION) == "true", path


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_pod_mounts_a_service_account_token(overlays: dict[str, Resources], overlay: str) -> None:
    for key, template in pod_templates(overlays[overlay]).items():
        assert template["spec"]["automountServiceAccountToken"] is False, key


# ------------------------------------------------------------------------- images


def documented_builds() -> dict[str, str]:
    """image:tag -> Dockerfile target, from the `docker build` lines of docs/deployment.md
    (no --target: the last stage, what a plain build gives)."""
    stages = read_dockerfile()
    names = [stage.name for stage in stages]
    builds = {}
    for match in BUILD.finditer(DEPLOYMENT_DOC.read_text()):
        target = match["target"] or names[-1]
        assert target in names, f"docs/deployment.md builds --target {target}: no such stage"
        builds[match["tag"]] = target
    return builds


def test_docs_build_and_load_both_targets_into_kind() -> None:
    builds = documented_builds()
    assert set(builds.values()) == {"sidecar", "demo-upstream"}
    loaded = {tag for match in KIND_LOAD.finditer(DEPLOYMENT_DOC.read_text()) for tag in match["tags"].split()}
    assert set(builds) <= loaded, "every built image is loaded into kind"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_image_is_built_by_the_docs_or_a_pinned_public_one(overlays: dict[str, Resources], overlay: str) -> None:
    builds = documented_builds()
    expected_target = {"ratelimit": "sidecar", "app": "demo-upstream"}
    for key, template in pod_templates(overlays[overlay]).items():
        for container in containers(template["spec"]):
            image = container["image"]
            if container["name"] in expected_target:
                assert builds.get(image) == expected_target[container["name"]], (key, container["name"], image)
                continue
            name, _, tag = image.rpartition(":")
            assert name and re.fullmatch(r"v?\d+(\.\d+)+(-[a-z]+)?", tag), f"{image}: a pinned version"
            assert image not in builds


def test_image_names_are_set_only_in_kustomize_images() -> None:
    """No manifest carries a tag: every tag comes from an `images:` entry of a kustomization."""
    pinned = {
        entry["name"]
        for path in KUBERNETES.rglob("kustomization.yaml")
        for entry in yaml.safe_load(path.read_text()).get("images", [])
    }
    for path in KUBERNETES.rglob("*.yaml"):
        for document in yaml.safe_load_all(path.read_text()):
            spec = (
                (document or {}).get("spec", {}).get("template", {}).get("spec") if isinstance(document, dict) else None
            )
            for container in containers(spec) if spec and "containers" in spec else []:
                if "image" in container:
                    assert ":" not in container["image"], f"{path}: {container['image']}: set its tag in images:"
                    assert container["image"] in pinned, f"{path}: {container['image']} has no images: entry"
