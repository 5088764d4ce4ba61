"""The comparison's HAProxy config: ``haproxy/haproxy.cfg`` with its rules re-exported for ``envoy/front.yaml``.

Envoy (``envoy/front.yaml``, one trusted ``X-Forwarded-For`` hop) takes the client address
from the last ``X-Forwarded-For`` entry; the shipped HAProxy config counts per connection
source (``src``). For HAProxy to see the same clients, both generated parts are exported
again by ``ratelimit-sidecar export-haproxy`` with
``--fetch remote_address=req.hdr_ip(x-forwarded-for,-1)`` (the last address of the header)
and spliced into a copy of the shipped file (:func:`stack.haproxy.splice`), which must pass
``haproxy -c -dW`` (no warnings) before it is used.
"""

from __future__ import annotations

import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

from stack.haproxy import FLAVOURS, SHIPPED_CONFIG, HAProxyPorts, check_config, splice
from stack.processes import REPO
from stack.sidecar import cli_argv

CLIENT_FETCH = "req.hdr_ip(x-forwarded-for,-1)"
"""HAProxy sample for the client address Envoy uses with ``xff_num_trusted_hops: 1``."""
EXPORT_TIMEOUT = 60.0


def export_args(flavour: str) -> list[str]:
    """The ``export-haproxy`` arguments of the comparison's rules for ``flavour`` (run from the repository)."""
    return [
        "examples/config",
        "--envoy", "envoy/front.yaml",
        "--flavour", flavour,
        "--fetch", f"remote_address={CLIENT_FETCH}",
    ]  # fmt: skip


@dataclass(frozen=True)
class ComparisonConfig:
    path: Path
    commands: list[str]
    """The exporter command lines, as a user would type them."""
    notes: list[str]
    """What the exporter printed on stderr (rules it could not export or exported with a difference)."""


def exported(flavour: str) -> tuple[str, str]:
    """The exporter's output (fragment, notes) for ``flavour``; RuntimeError when it fails."""
    completed = subprocess.run(
        cli_argv("export-haproxy", *export_args(flavour)),
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=EXPORT_TIMEOUT,
        check=False,
    )
    if completed.returncode != 0:
        raise RuntimeError(f"export-haproxy --flavour {flavour} failed: {completed.stderr.strip()}")
    if f"set-var(txn.rl_v0) {CLIENT_FETCH}" not in completed.stdout:
        raise RuntimeError(f"export-haproxy --flavour {flavour}: the client address is not read from {CLIENT_FETCH}")
    return completed.stdout, completed.stderr.strip()


def write(directory: Path, ports: HAProxyPorts) -> ComparisonConfig:
    """Write the comparison config into ``directory`` and check it with the variables of ``ports``."""
    text = SHIPPED_CONFIG.read_text()
    commands, notes = [], []
    for flavour in FLAVOURS:
        fragment, stderr = exported(flavour)
        text = splice(text, flavour, fragment)
        commands.append(shlex.join(["ratelimit-sidecar", "export-haproxy", *export_args(flavour)]))
        notes += [line for line in stderr.splitlines() if line.strip()]
    path = directory / "haproxy-compare.cfg"
    path.write_text(text)
    result = check_config(path, ports.env())
    if not result.ok:
        raise RuntimeError(f"haproxy -c -dW refused {path}:\n{result.output.strip()}")
    return ComparisonConfig(path, commands, notes)
