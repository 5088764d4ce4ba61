"""``--max-config-bytes`` (``RLS_MAX_CONFIG_BYTES``): the size cap of a config file, for
``serve`` at startup and on every reload, and for ``check-config`` (issue 21, defect 10).
Checked through ``main`` in this process (:mod:`tests.support.serve_refusal`), with one real
``serve`` and one real ``check-config`` refusing the flag's cap; the refusal of a huge file
without reading it is in ``test_config_size.py``.
"""

from __future__ import annotations

import time
from pathlib import Path

from tests.support.serve_refusal import cli_in_process, serve_in_process
from tests.support.sidecars import SidecarFactory, log_events, request, run_cli

RULES = "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 2}\n"
SIZE = len(RULES)


def config_dir(base: Path) -> Path:
    directory = base / "conf"
    directory.mkdir()
    (directory / "d.yaml").write_text(RULES)
    return directory


def test_serve_takes_the_cap_as_a_flag_and_a_variable(tmp_path: Path) -> None:
    directory = config_dir(tmp_path)
    base = ("--config", str(directory), "--grpc-address", "127.0.0.1:0")
    done = run_cli("serve", *base, "--max-config-bytes", str(SIZE - 1), timeout=15)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert f"file is {SIZE} bytes, over the {SIZE - 1}-byte cap (--max-config-bytes)" in lines[0]
    assert lines == serve_in_process(*base, "--max-config-bytes", str(SIZE - 1), load=True).lines
    refused = serve_in_process(*base, env={"RLS_MAX_CONFIG_BYTES": str(SIZE - 1)}, load=True)
    assert refused.code == 1 and f"over the {SIZE - 1}-byte cap" in refused.stderr
    refused = serve_in_process(*base, "--max-config-bytes", "0")
    assert refused.code == 1
    assert refused.stderr.strip() == "ratelimit-sidecar: error: --max-config-bytes='0': must be at least 1"


def test_check_config_takes_the_cap_as_a_flag_and_a_variable(tmp_path: Path) -> None:
    directory = config_dir(tmp_path)
    done = run_cli("check-config", str(directory), "--max-config-bytes", str(SIZE - 1))
    assert done.returncode == 1 and f"over the {SIZE - 1}-byte cap" in done.stderr
    assert done.stderr == cli_in_process("check-config", str(directory), "--max-config-bytes", str(SIZE - 1)).stderr
    assert cli_in_process("check-config", str(directory), "--max-config-bytes", str(SIZE)).code == 0
    checked = cli_in_process("check-config", str(directory), env={"RLS_MAX_CONFIG_BYTES": str(SIZE - 1)})
    assert checked.code == 1 and f"over the {SIZE - 1}-byte cap" in checked.stderr
    checked = cli_in_process("check-config", str(directory), "--max-config-bytes", "lots")
    assert checked.code == 1
    assert checked.stderr.strip().startswith("ratelimit-sidecar: error: --max-config-bytes='lots':")


def test_a_reload_applies_the_cap(tmp_path: Path, start_sidecar: SidecarFactory) -> None:
    directory = config_dir(tmp_path)
    sidecar = start_sidecar("--max-config-bytes", str(SIZE + 10), config=directory)
    bigger = directory / "e.yaml"
    bigger.write_text(RULES.replace("domain: d", "domain: e") + "# " + "x" * 20 + "\n")
    deadline = time.monotonic() + 20
    while "config_reload_refused" not in sidecar.stderr() and time.monotonic() < deadline:
        time.sleep(0.05)
    refused = [event for event in log_events(sidecar.stderr()) if event["event"] == "config_reload_refused"]
    assert refused, sidecar.stderr()
    assert any(
        f"{bigger}: file is" in issue and f"over the {SIZE + 10}-byte cap" in issue for issue in refused[0]["issues"]
    )
    assert sidecar.ask(request("d", [("k", "a")])).overall_code == 1  # the old config still serves
