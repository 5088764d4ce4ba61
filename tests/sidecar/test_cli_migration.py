"""The CLI as someone switching from envoyproxy/ratelimit uses it.

``check-config`` lists every error at once (a file refused for a bad ``replaces`` still
claims its domain, so a second file with the same domain is reported in the same run), and
``health`` and ``query`` reach a sidecar started with the reference's GRPC_HOST/GRPC_PORT
without being told its address. Outputs are checked through ``main`` in this process
(:mod:`tests.support.serve_refusal`); real processes where the exit or the variables a
process starts with are the point.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from tests.support.serve_refusal import cli_in_process, serve_in_process
from tests.support.sidecars import Sidecar, clean_env, free_port, run_cli

REPLACES_NOTHING = """\
domain: shop
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 5, name: per_user, replaces: [{name: missing}]}
"""
SAME_DOMAIN = """\
domain: shop
descriptors:
  - key: cart
    rate_limit: {unit: minute, requests_per_unit: 5}
"""


def test_check_config_reports_a_duplicate_domain_beside_a_bad_replaces(tmp_path: Path) -> None:
    config = tmp_path / "config"
    config.mkdir()
    (config / "a.yaml").write_text(REPLACES_NOTHING)
    (config / "b.yaml").write_text(SAME_DOMAIN)

    result = run_cli("check-config", str(config))

    assert result.returncode == 1
    *issues, verdict = result.stderr.splitlines()
    assert verdict == "2 error(s); config refused"
    assert "missing" in issues[0] and "a.yaml" in issues[0]
    assert issues[1].startswith(
        f"{config / 'b.yaml'}:1: domain: duplicate domain 'shop' (also in {config / 'a.yaml'}:1)"
    )


def test_check_config_reports_a_duplicate_of_a_file_refused_for_anything(tmp_path: Path) -> None:
    """The first file is refused for a bad unit: its domain still counts."""
    config = tmp_path / "config"
    config.mkdir()
    (config / "a.yaml").write_text(SAME_DOMAIN.replace("minute", "fortnight"))
    (config / "b.yaml").write_text(SAME_DOMAIN)
    result = cli_in_process("check-config", str(config))
    assert result.stderr.splitlines()[-1] == "2 error(s); config refused"
    assert "duplicate domain 'shop'" in result.stderr


def test_health_and_query_follow_the_reference_grpc_variables(tmp_path: Path) -> None:
    root = tmp_path / "runtime"
    (root / "config").mkdir(parents=True)
    (root / "config" / "shop.yaml").write_text(SAME_DOMAIN)
    port = free_port()
    env = clean_env(RUNTIME_ROOT=str(root), GRPC_HOST="127.0.0.1", GRPC_PORT=str(port), PORT=str(free_port()))
    sidecar = Sidecar(tmp_path, [], env).start(port=port, pass_address=False)
    try:
        health = run_cli("health", env=env)
        assert (health.returncode, health.stdout.strip()) == (0, "SERVING"), health.stderr
        reference = {name: env[name] for name in ("RUNTIME_ROOT", "GRPC_HOST", "GRPC_PORT", "PORT")}
        asked = cli_in_process("query", "--domain", "shop", "cart=1", env=reference)
        assert asked.code == 0, asked.stderr
        assert asked.stdout.splitlines()[1].strip().startswith("[0] OK limit=5/minute remaining=4")
    finally:
        sidecar.kill()


def test_health_names_a_reference_variable_serve_would_refuse(tmp_path: Path) -> None:
    result = cli_in_process("health", env={"GRPC_PORT": "http"})
    assert result.code == 1
    assert textwrap.shorten(result.stderr, 200).startswith("ratelimit-sidecar: error: GRPC_HOST, GRPC_PORT=")


def test_check_config_is_not_stopped_by_a_reference_variable_it_does_not_read(tmp_path: Path) -> None:
    """``LOG_LEVEL=verbose`` stops ``serve`` (named there), not a config check."""
    config = tmp_path / "config"
    config.mkdir()
    (config / "shop.yaml").write_text(SAME_DOMAIN)
    result = cli_in_process("check-config", str(config), env={"LOG_LEVEL": "verbose"})
    assert result.code == 0, result.stderr
    served = serve_in_process(env={"LOG_LEVEL": "verbose", "RLS_CONFIG": str(config)})
    assert served.code == 1
    assert "LOG_LEVEL='verbose'" in served.stderr
