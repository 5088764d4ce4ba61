"""The Dockerfile lints clean with hadolint and has the shape we promise (no Docker needed).

Multi-stage: wheels are built in ``builder``; the default target ``sidecar`` runs as a
non-root user with no build tools, is health-checked with ``ratelimit-sidecar health``,
and reads its config from /etc/ratelimit/config unless the user names another
(``RLS_CONFIG_DEFAULT``, below ``RLS_CONFIG`` and the reference's ``RUNTIME_*``).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from sidecar.__main__ import _parser, local_address
from sidecar.reference_env import BY_NAME as REFERENCE
from sidecar.settings import SERVE_OPTIONS, resolve
from tests.support.deploy import (
    DOCKERFILE,
    DOCKERIGNORE,
    REPO,
    Stage,
    dockerfile_env,
    effective,
    read_dockerfile,
    stage_chain,
    tool,
)

BASE_IMAGE = "python:3.11-slim-bookworm"
BUILD_TOOLS = re.compile(
    r"\b(apt-get|apt|apk|dnf|yum|gcc|g\+\+|cc|clang|make|build-essential|[\w.-]+-dev|pip\s+wheel|pip\s+install)\b"
)
OPTIONS = {option.name: option for option in SERVE_OPTIONS}


def default_port(option: str) -> int:
    return int(str(OPTIONS[option].default).rpartition(":")[2])


@pytest.fixture(scope="module")
def stages() -> list[Stage]:
    return read_dockerfile()


def test_hadolint_reports_nothing(tmp_path: Path) -> None:
    """Every rule, down to style level, with no user config that could silence one."""
    result = subprocess.run(
        [tool("hadolint"), "--no-color", "--format", "json", "--failure-threshold", "style", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=REPO,
        env={"HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )
    assert json.loads(result.stdout or "[]") == [], result.stdout
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_does_report_a_bad_dockerfile(tmp_path: Path) -> None:
    """The check above can fail: the same call flags what we avoid."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN apt-get update && apt-get install gcc\nCMD python -m sidecar\n")
    result = subprocess.run(
        [tool("hadolint"), "--format", "json", "--failure-threshold", "style", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    codes = {finding["code"] for finding in json.loads(result.stdout)}
    assert result.returncode != 0
    assert {"DL3006", "DL3008", "DL3025"} <= codes


def test_stages_and_their_bases(stages: list[Stage]) -> None:
    assert [stage.name for stage in stages] == ["builder", "runtime", "demo-upstream", "sidecar"]
    assert stages[-1].name == "sidecar", "a plain `docker build` must give the sidecar"
    external = {stage.base for stage in stages if stage.base not in {other.name for other in stages}}
    assert external == {BASE_IMAGE}


def test_wheels_are_built_in_the_builder(stages: list[Stage]) -> None:
    builder = stage_chain(stages, "builder")[0]
    commands = " ".join(item.arguments for item in builder.all("RUN"))
    assert "pip wheel --wheel-dir /wheels ." in commands
    assert "venv --without-pip /opt/venv" in commands
    assert "--no-index --find-links /wheels" in commands, "the venv gets exactly the wheels built here"
    # What setuptools needs for the wheel: pyproject, the readme it names, the package.
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    copied = {word for item in builder.all("COPY") for word in item.rest().split()[:-1]}
    assert {"pyproject.toml", project["readme"], "sidecar"} <= copied


@pytest.mark.parametrize(
    ("extras", "installed"),
    [
        ("", "ratelimit_sidecar-0.1.0-py3-none-any.whl"),
        ("tracing", "ratelimit_sidecar-0.1.0-py3-none-any.whl[tracing]"),
    ],
)
def test_the_extras_build_argument_reaches_both_pip_commands(
    stages: list[Stage], tmp_path: Path, extras: str, installed: str
) -> None:
    """``--build-arg EXTRAS=tracing`` builds and installs the wheel with that extra (as
    tests/deploy/test_wheel.py installs it and proves it traces); empty, the plain wheel.
    The builder's RUN is run by sh with pip and python standing in, printing what they get."""
    builder = stage_chain(stages, "builder")[0]
    (run,) = builder.all("RUN")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "ratelimit_sidecar-0.1.0-py3-none-any.whl").touch()
    stand_ins = 'pip() { echo "pip $*"; }; python() { :; }; '
    script = stand_ins + run.arguments.replace("/wheels", str(wheels))
    result = subprocess.run(
        ["sh", "-c", script], env={"EXTRAS": extras}, capture_output=True, text=True, timeout=30, check=True
    )
    built, install = result.stdout.splitlines()
    assert built.endswith(f" .[{extras}]" if extras else " .")
    assert install.endswith(f"{wheels}/{installed}")


def test_final_image_has_no_build_tools_and_runs_as_non_root(stages: list[Stage]) -> None:
    chain = stage_chain(stages, "sidecar")
    assert [stage.name for stage in chain] == ["sidecar", "runtime"]
    for stage in chain:
        for run in stage.all("RUN"):
            assert not BUILD_TOOLS.search(run.arguments), f"line {run.line}: {run.arguments}"
        for copy in stage.all("COPY"):
            if "from" in copy.flags():
                assert copy.flags()["from"] == "builder"
                assert copy.rest() == "/opt/venv /opt/venv", f"line {copy.line}: only the venv leaves the builder"
    user = effective(chain, "USER")
    assert user is not None
    uid = user.arguments.split(":")[0]
    assert uid.isdigit() and int(uid) >= 1000, "numeric, so Kubernetes runAsNonRoot can verify it"
    assert "/opt/venv/bin" in dockerfile_env(chain)["PATH"]


def test_entrypoint_cmd_and_the_console_script(stages: list[Stage]) -> None:
    chain = stage_chain(stages, "sidecar")
    entrypoint, cmd = effective(chain, "ENTRYPOINT"), effective(chain, "CMD")
    assert entrypoint is not None and cmd is not None
    assert entrypoint.exec_form() == ["ratelimit-sidecar"]
    assert cmd.exec_form() == ["serve"]
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert "ratelimit-sidecar" in scripts


def test_healthcheck_runs_the_health_command_where_serve_listens(stages: list[Stage]) -> None:
    """No address in the command: ``health`` reads the same variables as ``serve`` (it dialed a
    hard-coded 127.0.0.1:8081, so a reference deployment's GRPC_PORT failed every check)."""
    chain = stage_chain(stages, "sidecar")
    check = effective(chain, "HEALTHCHECK")
    assert check is not None
    argv = check.exec_form()
    assert argv[:2] == ["ratelimit-sidecar", "health"]
    arguments = _parser().parse_args(argv[1:])
    assert arguments.address is None
    image = dockerfile_env(chain)
    assert local_address(image) == f"127.0.0.1:{default_port('grpc_address')}"
    assert local_address({**image, "GRPC_PORT": "9999"}) == "127.0.0.1:9999"
    assert local_address({**image, "RLS_GRPC_ADDRESS": "10.0.0.5:7000"}) == "10.0.0.5:7000"
    assert {"interval", "timeout", "retries"} <= set(check.flags())


def test_exposed_ports_and_config_directory(stages: list[Stage]) -> None:
    chain = stage_chain(stages, "sidecar")
    exposed = {int(port) for stage in chain for item in stage.all("EXPOSE") for port in item.arguments.split()}
    wanted = {default_port("grpc_address"), default_port("metrics_address"), int(REFERENCE["PORT"].default)}
    assert exposed == wanted
    env = dockerfile_env(chain)
    settings = {option.env for option in SERVE_OPTIONS}
    assert {key for key in env if key.startswith("RLS_")} == {"RLS_CONFIG_DEFAULT"}
    assert env["RLS_CONFIG_DEFAULT"] == "/etc/ratelimit/config"
    assert not settings & set(env), "a variable the image sets would win over the reference's the user sets"
    assert not set(REFERENCE) & set(env)


def test_the_image_default_config_yields_to_what_the_user_sets(stages: list[Stage]) -> None:
    """The image's config path is a default: RLS_CONFIG and the reference's RUNTIME_* win."""
    image = dockerfile_env(stage_chain(stages, "sidecar"))
    arguments = _parser().parse_args(["serve"])
    assert resolve(arguments, image).config == "/etc/ratelimit/config"
    assert resolve(arguments, {**image, "RLS_CONFIG": "/cfg"}).config == "/cfg"
    runtime = {**image, "RUNTIME_ROOT": "/data", "RUNTIME_SUBDIRECTORY": "ratelimit"}
    assert resolve(arguments, runtime).config == "/data/ratelimit/config"
    assert resolve(_parser().parse_args(["serve", "--config", "/flag"]), runtime).config == "/flag"


def test_the_demo_upstream_runs_from_the_files_the_image_gets(stages: list[Stage], tmp_path: Path) -> None:
    """stack/ is not in the wheel: the stage copies three files, which must be enough."""
    stage = stage_chain(stages, "demo-upstream")[0]
    (copy,) = stage.all("COPY")
    *sources, target = copy.rest().split()
    workdir = stage.all("WORKDIR")[-1].arguments
    entrypoint = stage.all("ENTRYPOINT")[-1].exec_form()
    assert entrypoint == ["python", "-m", "stack.upstream"]
    assert target == "./stack/"
    image_dir = tmp_path / workdir.lstrip("/")
    (image_dir / "stack").mkdir(parents=True)
    for source in sources:
        shutil.copy(REPO / source, image_dir / "stack")
    for argv, expected in (
        (["-m", "stack.upstream", "--help"], "usage:"),
        (["-c", "import stack.upstream; print(stack.upstream.__file__)"], str(image_dir / "stack" / "upstream.py")),
    ):
        result = subprocess.run(
            [sys.executable, *argv], capture_output=True, text=True, timeout=30, check=False, cwd=image_dir
        )
        assert result.returncode == 0, result.stderr
        assert expected in result.stdout
    cmd = stage.all("CMD")[-1].exec_form()
    assert cmd[cmd.index("--host") + 1] == "0.0.0.0", "another container (HAProxy) reaches it in compose"
    assert str(cmd[cmd.index("--port") + 1]) == "8080"


def dockerignore_patterns() -> list[tuple[bool, re.Pattern[str]]]:
    """(excludes?, regex) per line, in Docker's order: the last matching line wins."""
    patterns = []
    for raw in DOCKERIGNORE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        glob = line.removeprefix("!").strip("/")
        regex = ""
        index = 0
        while index < len(glob):
            if glob.startswith("**/", index):
                regex, index = regex + "(?:.*/)?", index + 3
            elif glob.startswith("**", index):
                regex, index = regex + ".*", index + 2
            elif glob[index] == "*":
                regex, index = regex + "[^/]*", index + 1
            elif glob[index] == "?":
                regex, index = regex + "[^/]", index + 1
            elif glob[index] == "[":
                end = glob.index("]", index)
                regex, index = regex + glob[index : end + 1], end + 1
            else:
                regex, index = regex + re.escape(glob[index]), index + 1
        patterns.append((not negated, re.compile(regex + r"\Z")))
    return patterns


def in_context(relative: str) -> bool:
    """Whether Docker sends ``relative`` in the build context (a parent's match counts too)."""
    parts = relative.split("/")
    prefixes = ["/".join(parts[: index + 1]) for index in range(len(parts))]
    included = True
    for excludes, pattern in dockerignore_patterns():
        if any(pattern.match(prefix) for prefix in prefixes):
            included = not excludes
    return included


def test_dockerignore_sends_what_the_dockerfile_copies_and_nothing_else(stages: list[Stage]) -> None:
    copied = [
        source
        for stage in stages
        for copy in stage.all("COPY")
        if "from" not in copy.flags()
        for source in copy.rest().split()[:-1]
    ]
    for source in copied:
        path = REPO / source
        assert path.exists(), source
        files = [path] if path.is_file() else [item for item in path.rglob("*") if item.is_file()]
        for file in files:
            relative = file.relative_to(REPO).as_posix()
            cached = "__pycache__" in relative or file.suffix in {".pyc", ".pyo"}
            assert in_context(relative) != cached, relative
    for kept_out in (".git/HEAD", ".venv/bin/python", "tests/deploy/test_dockerfile.py", "loadtest/grpc_bench/cli.py"):
        assert not in_context(kept_out), kept_out
    assert in_context("sidecar/limiter/redis/lua/decide.lua")
