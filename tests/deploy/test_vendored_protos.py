"""sidecar/protos/ is exactly the pinned xds-protos closure, and the sidecar imports no other copy.

The sidecar carries its own generated Envoy API modules instead of depending on xds-protos,
whose wheel also overwrites opentelemetry-proto's files (scripts/vendor_envoy_protos.py says why).
"""

from __future__ import annotations

import ast
import subprocess
import sys

from tests.support.deploy import REPO

VENDORED_TOP_LEVELS = {"envoy", "udpa", "validate", "xds"}


def test_sidecar_protos_match_the_pinned_xds_protos_closure() -> None:
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "vendor_envoy_protos.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr


def test_the_sidecar_package_imports_envoy_protos_only_from_its_own_copy() -> None:
    offenders = []
    for path in sorted((REPO / "sidecar").rglob("*.py")):
        if (REPO / "sidecar" / "protos") in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            offenders += [
                f"{path.relative_to(REPO)}:{node.lineno}: {name}"
                for name in names
                if name.split(".")[0] in VENDORED_TOP_LEVELS
            ]
    assert offenders == [], "import these from sidecar.protos instead:\n" + "\n".join(offenders)
