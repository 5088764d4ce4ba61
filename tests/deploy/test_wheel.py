"""The package as a user gets it: the sdist and wheel build, pass ``twine check``, and the
built wheel (not the source tree, not editable), installed with ``[tracing]`` into a venv of
its own, runs every command a newcomer runs and exports real spans.

The tracing half is the regression test for the xds-protos conflict: xds-protos ships an old
copy of the OpenTelemetry protos at opentelemetry-proto's paths, so an install that pulled
it in could leave an OTLP exporter unable to encode a span. The sidecar no longer depends on
it (sidecar/protos/, scripts/vendor_envoy_protos.py); this install must not contain it.

The venv is built once per module with pip's cache and the machine's find-links, so after
the first run it takes seconds, not a download.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

from sidecar.tracing import SPAN_NAME
from stack.sidecar import SidecarProcess
from tests.support.deploy import REPO

pytest.importorskip("opentelemetry.proto", reason="the in-test OTLP receiver needs the [tracing] extra")
from tests.support.otlp import OtlpReceiver

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # the first build and install may download

DEMO_CONFIG = REPO / "examples" / "config"
BUILD_TIMEOUT = 600


@dataclass(frozen=True)
class Installed:
    """A venv holding only the built wheel and its dependencies."""

    venv: Path
    dist: Path

    @property
    def script(self) -> Path:
        return self.venv / "bin" / "ratelimit-sidecar"

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"


def user_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This environment without what would let the source tree leak in (PYTHONPATH) or
    configure the sidecar (RLS_*)."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH" and not key.startswith("RLS_")}
    return {**env, **(extra or {})}


def run(argv: list[str | Path], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [str(part) for part in argv],
        cwd=cwd,
        env=user_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    return result


def must(argv: list[str | Path], cwd: Path, timeout: float = 120) -> str:
    result = run(argv, cwd, timeout)
    assert result.returncode == 0, f"{' '.join(map(str, argv))} exited {result.returncode}:\n{result.stderr[-3000:]}"
    return result.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    """``python -m build`` (sdist, then the wheel from the sdist), then ``pip install WHEEL[tracing]``."""
    scratch = tmp_path_factory.mktemp("wheel")
    dist = scratch / "dist"
    must([sys.executable, "-m", "build", "--outdir", dist, REPO], scratch, timeout=BUILD_TIMEOUT)
    venv = scratch / "venv"
    must([sys.executable, "-m", "venv", "--without-pip", venv], scratch)
    (wheel,) = dist.glob("ratelimit_sidecar-*.whl")
    # This venv's pip installs into the new one (as the Dockerfile does): no pip copied in, no bytecode compiled.
    install = ["--python", venv / "bin" / "python", "install", "--quiet", "--no-compile", f"{wheel}[tracing]"]
    must([sys.executable, "-m", "pip", *install], scratch, BUILD_TIMEOUT)
    yield Installed(venv, dist)


def test_the_sdist_and_wheel_pass_twine_check(installed: Installed) -> None:
    artifacts = sorted(installed.dist.iterdir())
    assert sorted(path.suffix for path in artifacts) == [".gz", ".whl"], artifacts
    output = must([sys.executable, "-m", "twine", "check", "--strict", *artifacts], installed.dist)
    assert output.count("PASSED") == 2, output


def test_the_install_is_the_wheel_and_pulls_no_second_copy_of_the_otlp_protos(
    installed: Installed, tmp_path: Path
) -> None:
    where = must([installed.python, "-c", "import sidecar; print(sidecar.__file__)"], tmp_path)
    assert Path(where.strip()).is_relative_to(installed.venv), f"sidecar imported from {where}, not the venv"
    pip = [sys.executable, "-m", "pip", "--python", installed.python]
    packages = must([*pip, "list", "--format=freeze"], tmp_path).lower()
    assert "xds-protos" not in packages and "xds_protos" not in packages, packages
    must([*pip, "check"], tmp_path)
    scope_spans = "from opentelemetry.proto.trace.v1 import trace_pb2; trace_pb2.ResourceSpans(scope_spans=[])"
    must([installed.python, "-c", scope_spans], tmp_path)


def test_check_config_serve_query_and_health_from_the_installed_script(installed: Installed, tmp_path: Path) -> None:
    summary = must([installed.script, "check-config", DEMO_CONFIG], tmp_path)
    assert "demo" in summary, summary
    service = f"wheel-{uuid.uuid4().hex[:8]}"
    tracing = {
        "OTEL_SERVICE_NAME": service,
        "OTEL_BSP_SCHEDULE_DELAY": "100",  # ms: export soon, not after the default 5 s
    }
    with OtlpReceiver() as receiver:
        sidecar = SidecarProcess(
            "wheel-sidecar",
            ["--config", str(DEMO_CONFIG)],
            tmp_path,
            program=[str(installed.script)],
            env=user_env({**tracing, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint}),
        )
        sidecar.start()
        try:
            sidecar.wait_ready()
            health = must([installed.script, "health", "--address", sidecar.address], tmp_path)
            assert health.strip() == "SERVING"
            answer = must(
                [installed.script, "query", "--address", sidecar.address, "--domain", "demo", "generic_key=api"],
                tmp_path,
            )
            assert answer.startswith("overall: OK"), answer
            receiver.wait_for(lambda span: span.service == service and span.name == SPAN_NAME, what=SPAN_NAME)
        finally:
            code = sidecar.stop()
        assert code == 0, sidecar.log_tail()
