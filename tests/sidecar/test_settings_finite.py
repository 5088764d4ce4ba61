"""Float settings refuse NaN and infinities (issue 21, defect 11).

``--clock-offset nan`` used to start SERVING and answer every call INTERNAL (Envoy then
admits everything), and ``--shutdown-grace nan`` skipped the drain. Every float option
is found by asking its parser, so an option added later is covered without naming it.
Each one is refused through ``serve``'s own command-line path in this process
(:mod:`tests.support.serve_refusal`); one real ``serve`` process per path, flag and
environment, proves the exit status and that stderr is that same line.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from sidecar.settings import SERVE_OPTIONS, Option, SettingsError, add_serve_arguments, resolve
from tests.support.serve_refusal import Refusal, serve_in_process
from tests.support.sidecars import clean_env, run_cli

NON_FINITE = ("nan", "NaN", "-nan", "inf", "-inf", "Infinity", "+infinity", "1e999", "-1e999")


def parses_floats(option: Option) -> bool:
    """Whether the option's parser reads floats: it takes ``0.5`` and gives a float back."""
    try:
        return isinstance(option.parse("0.5"), float)
    except ValueError:
        return False


FLOAT_OPTIONS = [option for option in SERVE_OPTIONS if parses_floats(option)]


def test_the_float_options_are_found() -> None:
    names = {option.name for option in FLOAT_OPTIONS}
    assert {"clock_offset", "shutdown_grace", "sync_interval", "redis_timeout", "near_limit_ratio"} <= names


@pytest.mark.parametrize("option", FLOAT_OPTIONS, ids=lambda option: option.flag)
@pytest.mark.parametrize("text", NON_FINITE)
def test_every_float_option_refuses_non_finite_numbers(option: Option, text: str) -> None:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_serve_arguments(parser)
    with pytest.raises(SettingsError, match=f"^{option.flag}=.*must be a finite number"):
        resolve(parser.parse_args(["--config", "c", f"{option.flag}={text}"]), {})
    with pytest.raises(SettingsError, match=f"^{option.env}=.*must be a finite number"):
        resolve(parser.parse_args(["--config", "c"]), {option.env: text})


@pytest.mark.parametrize("option", FLOAT_OPTIONS, ids=lambda option: option.flag)
def test_finite_values_still_parse(option: Option) -> None:
    assert option.parse("0.5") == 0.5


RULES = "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1}\n"
REFUSED = ("nan", "inf", "-inf")
"""Tried through serve's path for every float option, by flag and by environment: what
loadtest/reliability_harness/hardening_input.py starts real processes with, and more than
this file once did (``nan`` by environment; ``--clock-offset nan``/``inf``, ``--shutdown-grace
nan``). Every spelling of NON_FINITE reaches resolve() above."""


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("config") / "rules.yaml"
    path.write_text(RULES)
    return path


def by_flag(config: Path, flag: str, value: str) -> Refusal:
    """``FLAG=VALUE``: as a separate word, argparse would take ``-inf`` for an option."""
    return serve_in_process("--config", str(config), "--grpc-address", "127.0.0.1:0", f"{flag}={value}")


def by_environment(config: Path, variable: str, value: str) -> Refusal:
    return serve_in_process("--config", str(config), env={variable: value, "RLS_GRPC_ADDRESS": "127.0.0.1:0"})


@pytest.mark.parametrize("option", FLOAT_OPTIONS, ids=lambda option: option.flag)
@pytest.mark.parametrize("value", REFUSED)
def test_serve_refuses_a_non_finite_flag_with_one_line(config: Path, option: Option, value: str) -> None:
    done = by_flag(config, option.flag, value)
    assert done.code == 1, done.stderr
    assert done.lines == [f"ratelimit-sidecar: error: {option.flag}={value!r}: must be a finite number"]
    assert done.stdout == ""


@pytest.mark.parametrize("option", FLOAT_OPTIONS, ids=lambda option: option.env)
@pytest.mark.parametrize("value", REFUSED)
def test_serve_refuses_a_non_finite_variable_with_one_line(config: Path, option: Option, value: str) -> None:
    done = by_environment(config, option.env, value)
    assert done.code == 1, done.stderr
    assert done.lines == [f"ratelimit-sidecar: error: {option.env}={value!r}: must be a finite number"]
    assert done.stdout == ""


def test_a_real_serve_refuses_a_non_finite_flag_with_that_one_line(config: Path) -> None:
    """The process behind the in-process checks: exit 1 before serving, and nothing on
    stderr but the line they saw (``--clock-offset nan`` once served, answering INTERNAL)."""
    flags = ("--config", str(config), "--grpc-address", "127.0.0.1:0", "--clock-offset", "nan")
    done = run_cli("serve", *flags, timeout=15)
    assert done.returncode == 1, done.stderr
    assert done.stderr.splitlines() == by_flag(config, "--clock-offset", "nan").lines
    assert done.stderr == "ratelimit-sidecar: error: --clock-offset='nan': must be a finite number\n"


def test_a_real_serve_refuses_a_non_finite_variable_with_that_one_line(config: Path) -> None:
    env = clean_env(RLS_SHUTDOWN_GRACE="nan", RLS_GRPC_ADDRESS="127.0.0.1:0")
    done = run_cli("serve", "--config", str(config), env=env, timeout=15)
    assert done.returncode == 1, done.stderr
    assert done.stderr.splitlines() == by_environment(config, "RLS_SHUTDOWN_GRACE", "nan").lines
    assert done.stderr == "ratelimit-sidecar: error: RLS_SHUTDOWN_GRACE='nan': must be a finite number\n"
