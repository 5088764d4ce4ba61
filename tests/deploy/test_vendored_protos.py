"""sidecar/protos/ is exactly the pinned xds-protos closure, and the sidecar imports no other copy.

The sidecar carries its own generated Envoy API modules instead of depending on xds-protos,
whose wheel also overwrites opentelemetry-proto's files (scripts/vendor_envoy_protos.py says why).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

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


def python_files() -> list[Path]:
    """The project's Python: the package, its tests and tools (not the generated copy)."""
    roots = [REPO / name for name in ("sidecar", "tests", "loadtest", "stack", "examples", "scripts")]
    files = [path for root in roots for path in sorted(root.rglob("*.py"))]
    return [path for path in files if (REPO / "sidecar" / "protos") not in path.parents]


def test_the_project_imports_envoy_protos_only_from_the_sidecars_copy() -> None:
    """Not even a test or tool: xds-protos is no dependency, not even a dev one, so an
    ``import envoy...`` would work only where it happens to be installed."""
    offenders = []
    for path in python_files():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            offenders += [
                f"{path.relative_to(REPO)}:{node.lineno}: {name}"
                for name in names
                if name.split(".")[0] in VENDORED_TOP_LEVELS
            ]
    assert offenders == [], "import these from sidecar.protos instead:\n" + "\n".join(offenders)
