"""The README's hand-run demo listens on 127.0.0.1 only, as it promises: every
``redis-server`` line binds loopback, and every Envoy it starts gets a config whose
listeners are all on 127.0.0.1 (the shipped envoy/sidecar.yaml listens on 0.0.0.0, as a
pod's Envoy must; the README makes a loopback copy, and this runs that very line)."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.docs.docs_support import README, ROOT
from tests.support.deploy import tool

LOOPBACK = "127.0.0.1"


def shell_lines() -> list[str]:
    """The lines of README's ```sh blocks, comments dropped."""
    lines, inside = [], False
    for line in README.read_text().splitlines():
        if line.strip().startswith("```"):
            inside = line.strip() == "```sh"
            continue
        if inside:
            lines.append(re.sub(r"\s+#.*$", "", line).strip())
    return lines


def socket_addresses(node: Any) -> list[str]:
    """Every ``socket_address.address`` in a parsed Envoy config."""
    if isinstance(node, dict):
        own = [node["socket_address"]["address"]] if isinstance(node.get("socket_address"), dict) else []
        return own + [address for value in node.values() for address in socket_addresses(value)]
    if isinstance(node, list):
        return [address for value in node for address in socket_addresses(value)]
    return []


def test_every_redis_server_line_binds_loopback() -> None:
    lines = [line for line in shell_lines() if line.startswith("redis-server")]
    assert lines, "the README starts no redis-server: update this test"
    for line in lines:
        words = shlex.split(line)
        assert "--bind" in words and words[words.index("--bind") + 1] == LOOPBACK, line


@pytest.mark.envoy
def test_every_envoy_the_readme_starts_listens_on_loopback_only(tmp_path: Path) -> None:
    lines = shell_lines()
    configs = [shlex.split(line)[shlex.split(line).index("-c") + 1] for line in lines if "bin/envoy -c" in line]
    assert configs, "the README starts no Envoy: update this test"
    for config in configs:
        made_by = [line for line in lines if line.endswith(f"> {config}")]
        if made_by:  # the README writes it: run that line, into tmp_path
            local = tmp_path / Path(config).name
            command = made_by[0].removesuffix(config) + shlex.quote(str(local))
            subprocess.run(["bash", "-c", command], cwd=ROOT, check=True, timeout=30)
        else:
            local = ROOT / config
        addresses = socket_addresses(yaml.safe_load(local.read_text()))
        assert addresses and set(addresses) == {LOOPBACK}, f"{config}: listens on {sorted(set(addresses))}"
        validate = subprocess.run(
            [tool("envoy"), "--mode", "validate", "-c", str(local)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert validate.returncode == 0, validate.stdout[-2000:] + validate.stderr[-2000:]
