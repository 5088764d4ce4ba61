"""The rendered Kubernetes overlays, rendered once per test module that asks for them."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.deploy.kubernetes_support import OVERLAYS, Resources, parse, render
from tests.support.deploy import KUBERNETES


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """overlay -> the file of its rendered resources."""
    directory = tmp_path_factory.mktemp("kustomize")
    paths = {}
    for overlay in OVERLAYS:
        paths[overlay] = directory / f"{overlay}.yaml"
        paths[overlay].write_text(render(KUBERNETES / "overlays" / overlay))
    return paths


@pytest.fixture(scope="module")
def overlays(rendered: dict[str, Path]) -> dict[str, Resources]:
    """overlay -> (kind, name) -> resource."""
    return {overlay: parse(path.read_text()) for overlay, path in rendered.items()}
