"""A config file over ``--max-config-bytes`` is refused before it is read (issue 21, defect 10).

A 300 MB ``*.yaml`` dropped into the watched directory used to be refused only after
being read whole and decoded (+1.2 GB RSS). The size is now checked first, at startup,
by ``check-config`` and on every reload; the issue names the file and its size. Real
processes, with a sparse file (no disk cost) and their peak RSS read back.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sidecar.config import ConfigError, load_config
from tests.support.sidecars import SidecarFactory, clean_env, log_events, request

HUGE = 100 * 1024 * 1024
"""Bytes of the sparse file: reading it whole costs 3-4x this in RSS (bytes, str, UTF-8 again)."""
RSS_ALLOWANCE = 40 * 1024 * 1024
"""Peak RSS a refusal may add: far below one copy of the file."""
RULES = "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 2}\n"


def config_dir(base: Path) -> Path:
    directory = base / "conf"
    directory.mkdir()
    (directory / "d.yaml").write_text(RULES)
    return directory


def sparse(path: Path, size: int = HUGE) -> Path:
    with path.open("wb") as file:
        file.truncate(size)
    return path


def peak_rss_of(command: list[str], env: dict[str, str]) -> tuple[subprocess.CompletedProcess[str], int]:
    """Run ``command`` alone in a fresh process group and return its peak RSS in bytes."""
    runner = (
        "import resource, subprocess, sys\n"
        "done = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
        "sys.stdout.write(done.stdout); sys.stderr.write(done.stderr)\n"
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)\n"
        "sys.exit(done.returncode)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", runner, *command], capture_output=True, text=True, env=env, timeout=60, check=False
    )
    *lines, peak = done.stderr.strip().splitlines()
    return subprocess.CompletedProcess(done.args, done.returncode, done.stdout, "\n".join(lines)), int(peak) * 1024


def baseline_rss(directory: Path) -> int:
    _, peak = peak_rss_of([sys.executable, "-m", "sidecar", "check-config", str(directory)], clean_env())
    return peak


def test_check_config_refuses_a_huge_file_without_reading_it(tmp_path: Path) -> None:
    directory = config_dir(tmp_path)
    normal = baseline_rss(directory)
    huge = sparse(directory / "zz-huge.yaml")
    done, peak = peak_rss_of([sys.executable, "-m", "sidecar", "check-config", str(directory)], clean_env())
    assert done.returncode == 1
    assert peak - normal < RSS_ALLOWANCE, f"peak RSS {peak >> 20} MiB against {normal >> 20} MiB without the file"
    assert f"{huge}: file is {HUGE:,} bytes, over the {8 * 1024 * 1024:,}-byte cap (--max-config-bytes)" in done.stderr


def test_serve_refuses_a_huge_file_in_one_line_without_reading_it(tmp_path: Path) -> None:
    directory = config_dir(tmp_path)
    normal = baseline_rss(directory)
    huge = sparse(directory / "zz-huge.yaml")
    command = [sys.executable, "-m", "sidecar", "serve", "--config", str(directory), "--grpc-address", "127.0.0.1:0"]
    done, peak = peak_rss_of(command, clean_env())
    assert done.returncode == 1
    assert peak - normal < RSS_ALLOWANCE + 30 * 1024 * 1024, f"peak RSS {peak >> 20} MiB"
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ratelimit-sidecar: error: "), done.stderr
    assert f"{huge}: file is {HUGE:,} bytes" in lines[0]


def test_load_config_takes_the_cap(tmp_path: Path) -> None:
    directory = config_dir(tmp_path)
    with pytest.raises(ConfigError) as refused:
        load_config(directory, max_bytes=10)
    (issue,) = refused.value.issues
    assert issue.file == str(directory / "d.yaml")
    assert f"file is {len(RULES)} bytes, over the 10-byte cap" in issue.message
    assert load_config(directory, max_bytes=len(RULES)).domains.keys() == {"d"}


def vm_hwm(pid: int) -> int:
    """Peak RSS of a running process, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def test_a_reload_refuses_a_huge_file_without_reading_it(tmp_path: Path, start_sidecar: SidecarFactory) -> None:
    directory = config_dir(tmp_path)
    sidecar = start_sidecar(config=directory)
    assert sidecar.process is not None
    sidecar.ask(request("d", [("k", "a")]))
    before = vm_hwm(sidecar.process.pid)
    huge = sparse(directory / "zz-huge.yaml")
    deadline = time.monotonic() + 20
    while "config_reload_refused" not in sidecar.stderr() and time.monotonic() < deadline:
        time.sleep(0.05)
    refused = [event for event in log_events(sidecar.stderr()) if event["event"] == "config_reload_refused"]
    assert refused, sidecar.stderr()
    assert vm_hwm(sidecar.process.pid) - before < RSS_ALLOWANCE
    assert any(f"{huge}: file is {HUGE:,} bytes" in issue for issue in refused[0]["issues"]), refused
    assert sidecar.ask(request("d", [("k", "a")])).overall_code == 1  # still serving the old config
    os.unlink(huge)
