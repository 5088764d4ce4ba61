"""The command line as an operator uses it: check-config, serve's failures and settings,
query and health against a running sidecar.

What a command prints and returns is checked through ``main`` in this process
(:mod:`tests.support.serve_refusal`: a ``python -m sidecar`` start costs about a CPU-second,
mostly imports); one real process per kind of exit (a config check refused, a serve
refused for its config and for a setting, a health check that passes, a reader that left)
proves that the process says and returns the same.
"""

from __future__ import annotations

import re
import socket
import subprocess
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.support.serve_refusal import cli_in_process, serve_in_process
from tests.support.sidecars import (
    OK,
    OVER_LIMIT,
    SERVICE_NAME,
    Sidecar,
    SidecarFactory,
    clean_env,
    cli_argv,
    free_port,
    in_one_window,
    request,
    run_cli,
    write_config,
)

pytestmark = pytest.mark.slow

PROG = "ratelimit-sidecar"
OTHER_DOMAIN = textwrap.dedent(
    """\
    domain: other
    descriptors:
      - key: a
        rate_limit: {unit: second, requests_per_unit: 1}
      - key: b
        rate_limit: {unlimited: true}
    """
)
BAD_CONFIG = textwrap.dedent(
    """\
    domain: broken
    descriptors:
      - key: a
        rate_limit: {unit: fortnight, requests_per_unit: 1}
      - key: b
        rate_limit: {unit: second, requests_per_unit: -3}
      - key: ""
        rate_limit: {unit: second, requests_per_unit: 1}
    """
)
ISSUE_LINE = re.compile(r"^(?P<file>.+\.yaml):(?P<line>\d+): (?P<path>[\w.\[\]]+): (?P<message>.+)$")


def stderr_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def non_log_lines(text: str) -> list[str]:
    """stderr lines that are not JSON log events: what the operator is told."""
    return [line for line in stderr_lines(text) if not line.startswith("{")]


# -- check-config ---------------------------------------------------------------------------


def test_check_config_summarises_each_domain(tmp_path: Path) -> None:
    directory = write_config(tmp_path / "config")
    write_config(directory, OTHER_DOMAIN, name="other.yml")
    (directory / "notes.txt").write_text("not a config")

    result = cli_in_process("check-config", str(directory))

    assert result.code == 0, result.stderr
    assert result.stderr == ""
    lines = result.stdout.splitlines()
    assert len(lines) == 2
    assert lines[0] == f"domain 'it' ({directory / 'it.yaml'}): 6 rules, 5 limited, 1 unlimited"
    assert lines[1] == f"domain 'other' ({directory / 'other.yml'}): 2 rules, 1 limited, 1 unlimited"


def test_check_config_lists_every_error_with_file_line_and_path(tmp_path: Path) -> None:
    directory = write_config(tmp_path / "config", BAD_CONFIG, name="broken.yaml")
    bad_file = str(directory / "broken.yaml")

    result = run_cli("check-config", str(directory))

    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr == cli_in_process("check-config", str(directory)).stderr
    *issues, verdict = result.stderr.splitlines()
    assert verdict == "3 error(s); config refused"
    parsed = [ISSUE_LINE.match(issue) for issue in issues]
    assert all(parsed), issues
    found = [(m["file"], int(m["line"]), m["path"]) for m in parsed if m]
    assert found == [
        (bad_file, 4, "descriptors[0].rate_limit.unit"),
        (bad_file, 6, "descriptors[1].rate_limit.requests_per_unit"),
        (bad_file, 7, "descriptors[2].key"),
    ]
    assert "fortnight" in issues[0]
    assert "-3" in issues[1]


def test_check_config_reports_a_control_character_without_a_traceback(tmp_path: Path) -> None:
    """PyYAML's reader refuses control characters while the loader is being built."""
    config = tmp_path / "control.yaml"
    config.write_text("domain: x\ndescriptors:\n  - key: a\x01\n")

    result = cli_in_process("check-config", str(config))

    assert result.code == 1
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines() == [
        f"{config}:3: invalid YAML: unacceptable character #x0001: special characters are not allowed",
        "1 error(s); config refused",
    ]


# -- serve failures -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(BAD_CONFIG, "descriptors[0].rate_limit.unit", id="invalid-rules"),
        pytest.param("domain: x\ndescriptors: [\n", "invalid YAML", id="invalid-yaml"),
        pytest.param("domain: x\x00\n", "unacceptable character #x0000", id="control-character"),
    ],
)
def test_serve_with_a_bad_config_fails_with_one_line(tmp_path: Path, text: str, expected: str) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(text)

    result = serve_in_process("--config", str(config), "--grpc-address", "127.0.0.1:0", load=True)

    assert result.code != 0
    assert "Traceback" not in result.stderr
    (line,) = stderr_lines(result.stderr)
    assert line.startswith(f"{PROG}: error: invalid rate limit config: {config}:")
    assert expected in line
    assert f"check-config {config}" in line


def test_a_real_serve_with_a_bad_config_fails_with_that_one_line(tmp_path: Path) -> None:
    """The process behind the in-process checks above: exit 1, stderr that same line."""
    config = tmp_path / "bad.yaml"
    config.write_text(BAD_CONFIG)
    flags = ("--config", str(config), "--grpc-address", f"127.0.0.1:{free_port()}")

    result = run_cli("serve", *flags)

    assert result.returncode == 1
    assert stderr_lines(result.stderr) == serve_in_process(*flags, load=True).lines


def test_serve_with_a_missing_config_fails_with_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    result = serve_in_process("--config", str(missing), "--grpc-address", "127.0.0.1:0", load=True)
    assert result.code != 0
    (line,) = stderr_lines(result.stderr)
    assert f"{missing}: no such file or directory" in line


def test_serve_on_a_port_in_use_fails_with_one_clear_line(config_dir: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as occupant:
        occupant.bind(("127.0.0.1", 0))
        occupant.listen()
        port = occupant.getsockname()[1]
        result = serve_in_process("--config", str(config_dir), "--grpc-address", f"127.0.0.1:{port}")

    assert result.code != 0
    assert "Traceback" not in result.stderr
    assert non_log_lines(result.stderr) == [f"{PROG}: error: cannot listen on 127.0.0.1:{port}: Address already in use"]
    assert "sidecar_started" not in result.stderr


@pytest.mark.parametrize(
    ("flags", "env", "culprit"),
    [
        pytest.param([], {"RLS_INSTANCES": "0"}, "RLS_INSTANCES='0': must be at least 1", id="env-instances"),
        pytest.param(["--instances", "0"], {}, "--instances='0': must be at least 1", id="flag-instances"),
        pytest.param([], {"RLS_GRPC_ADDRESS": "nowhere"}, "RLS_GRPC_ADDRESS='nowhere'", id="env-address"),
        pytest.param(["--shutdown-grace", "-1"], {}, "--shutdown-grace='-1'", id="flag-grace"),
    ],
)
def test_serve_with_a_bad_setting_names_it(
    config_dir: Path, flags: list[str], env: dict[str, str], culprit: str
) -> None:
    result = serve_in_process("--config", str(config_dir), *flags, env=env)
    assert result.code != 0
    assert "Traceback" not in result.stderr
    (line,) = stderr_lines(result.stderr)
    assert line.startswith(f"{PROG}: error: {culprit}")


def test_a_real_serve_with_a_bad_variable_names_it_in_that_one_line(config_dir: Path) -> None:
    """The process behind the in-process checks above: the variable is read at its start."""
    result = run_cli("serve", "--config", str(config_dir), env=clean_env(RLS_INSTANCES="0"))
    assert result.returncode == 1
    assert (
        stderr_lines(result.stderr) == serve_in_process("--config", str(config_dir), env={"RLS_INSTANCES": "0"}).lines
    )
    assert result.stderr.startswith(f"{PROG}: error: RLS_INSTANCES='0': must be at least 1")


def test_serve_without_config_says_it_is_required() -> None:
    result = serve_in_process("--grpc-address", "127.0.0.1:0")
    assert result.code != 0
    assert stderr_lines(result.stderr) == [f"{PROG}: error: --config (or RLS_CONFIG) is required"]


# -- serve settings --------------------------------------------------------------------------


def test_environment_variables_replace_flags(start_sidecar: SidecarFactory, config_dir: Path) -> None:
    port = free_port()
    env = clean_env(RLS_GRPC_ADDRESS=f"127.0.0.1:{port}", RLS_CONFIG=str(config_dir), RLS_INSTANCES="5")
    sidecar = start_sidecar(env=env, port=port, pass_address=False)

    started = sidecar.event("sidecar_started")
    assert started["address"] == f"127.0.0.1:{port}"
    assert started["port"] == port
    assert started["instances"] == 5
    assert started["domains"] == ["it"]

    # 5 per minute shared by 5 instances: one hit each.
    def attempt() -> list[Any]:
        one = request("it", [("per_minute", uuid.uuid4().hex)])
        return [sidecar.ask(one) for _ in range(2)]

    answers = in_one_window(60, attempt)
    assert [a.overall_code for a in answers] == [OK, OVER_LIMIT]


def test_flags_win_over_environment_and_instances_take_the_ceiling_of_the_share(
    start_sidecar: SidecarFactory, config_dir: Path
) -> None:
    """One sidecar for both: variables a flag overrides (one refused, one naming no config)
    must not count, and the flag's --instances sets the share."""
    env = clean_env(RLS_INSTANCES="0", RLS_CONFIG="/nonexistent")
    sidecar = start_sidecar("--instances", "2", config=config_dir, env=env)
    started = sidecar.event("sidecar_started")
    assert started["instances"] == 2

    def attempt() -> list[Any]:
        value = uuid.uuid4().hex
        return [sidecar.ask(request("it", [("per_minute", value)])) for _ in range(4)]

    answers = in_one_window(60, attempt)
    # ceil(5 / 2) = 3 hits for this replica.
    assert [a.overall_code for a in answers] == [OK, OK, OK, OVER_LIMIT]
    assert [a.statuses[0].limit_remaining for a in answers] == [2, 1, 0, 0]


def test_shadow_mode_reports_over_limit_but_admits(start_sidecar: SidecarFactory, config_dir: Path) -> None:
    sidecar = start_sidecar("--shadow-mode", config=config_dir)

    def attempt() -> list[Any]:
        value = uuid.uuid4().hex
        both = request("it", [("pair_b", value)], [("pair_a", value)])
        return [sidecar.ask(both) for _ in range(4)]

    answers = in_one_window(60, attempt)
    assert all(a.overall_code == OK for a in answers)
    # pair_b allows 2 per minute: its verdict is still reported per descriptor.
    codes = [[s.code for s in a.statuses] for a in answers]
    assert codes == [[OK, OK], [OK, OK], [OVER_LIMIT, OK], [OVER_LIMIT, OK]]
    assert [a.statuses[1].limit_remaining for a in answers] == [9, 8, 7, 6]
    started = sidecar.event("sidecar_started")
    assert started["shadow_mode"] is True


# -- query and health against a running sidecar ------------------------------------------------


def test_query_prints_the_decision(shared_sidecar: Sidecar) -> None:
    value = uuid.uuid4().hex

    def attempt() -> list[Any]:
        key = f"{value}-{uuid.uuid4().hex}"
        first = cli_in_process("query", "--address", shared_sidecar.address, "--domain", "it", f"per_minute={key}")
        rest = cli_in_process(
            "query",
            "--address",
            shared_sidecar.address,
            "--domain",
            "it",
            "--hits",
            "5",
            f"per_minute={key}",
            "free=x",
            "nothing=here",
        )
        return [first, rest]

    first, rest = in_one_window(60, attempt)
    assert first.code == 0, first.stderr
    overall, status = first.stdout.splitlines()
    assert overall == "overall: OK"
    assert re.fullmatch(r"  \[0\] OK limit=5/minute name=five_per_minute remaining=4 reset=\d+s", status)
    assert rest.code == 0, rest.stderr
    lines = rest.stdout.splitlines()
    assert lines[0] == "overall: OVER_LIMIT"
    assert re.fullmatch(r"  \[0\] OVER_LIMIT limit=5/minute name=five_per_minute remaining=0 reset=\d+s", lines[1])
    assert lines[2:] == ["  [1] OK unlimited", "  [2] OK no limit: no rule matched, or replaced (--config tells which)"]
    assert "a query is a real request" in rest.stderr


def test_query_into_a_reader_that_left_ends_quietly(shared_sidecar: Sidecar) -> None:
    """``query ... | head -1``: the reader closes the pipe before the answer is written."""
    argv = cli_argv("query", "--address", shared_sidecar.address, "--domain", "it", f"per_minute={uuid.uuid4().hex}")
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=clean_env())
    assert child.stdout is not None and child.stderr is not None
    child.stdout.close()
    stderr = child.stderr.read().decode()
    assert child.wait(timeout=60) == 141, stderr
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr


def test_query_reports_invalid_argument(shared_sidecar: Sidecar) -> None:
    result = cli_in_process("query", "--address", shared_sidecar.address, "--domain", "", "k=v")
    assert result.code == 1
    assert stderr_lines(result.stderr) == [
        f"{PROG}: error: {shared_sidecar.address}: INVALID_ARGUMENT: domain: must not be empty"
    ]


@pytest.mark.parametrize("service", ["", SERVICE_NAME])
def test_health_command_says_serving(shared_sidecar: Sidecar, service: str) -> None:
    result = cli_in_process("health", "--address", shared_sidecar.address, "--service", service)
    assert result.code == 0, result.stderr
    assert result.stdout == "SERVING\n"


def test_a_real_health_command_exits_0_saying_serving(shared_sidecar: Sidecar) -> None:
    """The process a container's health check runs."""
    result = run_cli("health", "--address", shared_sidecar.address)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "SERVING\n"


def test_health_command_fails_for_unknown_service_and_dead_address(shared_sidecar: Sidecar) -> None:
    unknown = cli_in_process("health", "--address", shared_sidecar.address, "--service", "no.Such")
    assert unknown.code == 1
    assert stderr_lines(unknown.stderr) == [f"{PROG}: error: {shared_sidecar.address}: NOT_FOUND: "]

    dead = f"127.0.0.1:{free_port()}"
    result = cli_in_process("health", "--address", dead)
    assert result.code == 1
    (line,) = stderr_lines(result.stderr)
    assert line.startswith(f"{PROG}: error: {dead}: UNAVAILABLE")


def test_query_with_the_config_names_a_replaced_rule(start_sidecar: SidecarFactory) -> None:
    """examples/config: an api_key matching premium-* replaces api_route, so the (generic_key, api)
    descriptor gets a bare OK; ``query --config`` says so instead of "no rule matched"."""
    demo = Path(__file__).resolve().parents[2] / "examples" / "config"
    sidecar = start_sidecar(config=demo)
    premium = f"generic_key=api,api_key=premium-{uuid.uuid4().hex}"
    args = ("query", "--address", sidecar.address, "--domain", "demo", "generic_key=api", premium)
    told = cli_in_process(*args, "--config", str(demo))
    assert told.code == 0, told.stderr
    assert told.stdout.splitlines()[1] == "  [0] OK no limit: api_route replaced by premium_key"
    from_environment = cli_in_process(*args, env={"RLS_CONFIG": str(demo)})
    assert from_environment.stdout.splitlines()[1] == "  [0] OK no limit: api_route replaced by premium_key"
