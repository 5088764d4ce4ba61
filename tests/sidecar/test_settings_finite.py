"""Float settings refuse NaN and infinities (issue 21, defect 11).

``--clock-offset nan`` used to start SERVING and answer every call INTERNAL (Envoy then
admits everything), and ``--shutdown-grace nan`` skipped the drain. Every float option
is found by asking its parser, so an option added later is covered without naming it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from sidecar.settings import SERVE_OPTIONS, Option, SettingsError, add_serve_arguments, resolve
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


@pytest.mark.parametrize(
    ("flag", "value"), [("--clock-offset", "nan"), ("--shutdown-grace", "nan"), ("--clock-offset", "inf")]
)
def test_serve_refuses_a_non_finite_flag_with_one_line(tmp_path: Path, flag: str, value: str) -> None:
    """A real ``serve`` process: exit status 1 and one line on stderr, before serving."""
    config = tmp_path / "rules.yaml"
    config.write_text("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1}\n")
    done = run_cli("serve", "--config", str(config), "--grpc-address", "127.0.0.1:0", flag, value, timeout=15)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1, done.stderr
    assert lines == [f"ratelimit-sidecar: error: {flag}={value!r}: must be a finite number"]


def test_every_float_option_is_refused_through_the_environment_by_a_real_process(tmp_path: Path) -> None:
    config = tmp_path / "rules.yaml"
    config.write_text("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1}\n")
    for option in FLOAT_OPTIONS:
        env = clean_env(**{option.env: "nan", "RLS_GRPC_ADDRESS": "127.0.0.1:0"})
        done = run_cli("serve", "--config", str(config), env=env, timeout=15)
        assert done.returncode == 1, (option.env, done.stderr)
        assert done.stderr.strip().splitlines() == [
            f"ratelimit-sidecar: error: {option.env}='nan': must be a finite number"
        ]
