"""Hot reload of a running sidecar process: SIGHUP, file edits, Kubernetes ConfigMap swaps."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
import urllib.request
from pathlib import Path

import pytest

from tests.support.sidecars import OK, OVER_LIMIT, Sidecar, SidecarFactory, clean_env, free_port, log_events, request

RELOAD_DEADLINE = 10.0

BASE = """\
domain: reload
descriptors:
  - key: kept
    rate_limit: {unit: hour, requests_per_unit: 5}
  - key: changed
    rate_limit: {unit: hour, requests_per_unit: 10}
"""
CHANGED = BASE.replace("requests_per_unit: 10", "requests_per_unit: 2")
BROKEN = BASE.replace("unit: hour, requests_per_unit: 10", "unit: fortnight, requests_per_unit: 10")


def codes(sidecar: Sidecar, key: str, value: str, count: int) -> list[int]:
    return [sidecar.ask(request("reload", [(key, value)])).overall_code for _ in range(count)]


def active_digest(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/config", timeout=5) as reply:
        return str(json.loads(reply.read())["sha256"])


def wait_for_event(sidecar: Sidecar, name: str, count: int = 1) -> dict[str, object]:
    """The ``count``-th log event called ``name``, waiting for it."""
    deadline = time.monotonic() + RELOAD_DEADLINE
    while time.monotonic() < deadline:
        found = [event for event in log_events(sidecar.stderr()) if event.get("event") == name]
        if len(found) >= count:
            return found[count - 1]
        time.sleep(0.05)
    pytest.fail(f"no {name} event #{count} within {RELOAD_DEADLINE} s:\n{sidecar.stderr()[-3000:]}")


def started(start_sidecar: SidecarFactory, config: Path, *flags: str) -> tuple[Sidecar, int]:
    port = free_port()
    env = clean_env(RLS_METRICS_ADDRESS=f"127.0.0.1:{port}", RLS_LOG_FORMAT="json")
    return start_sidecar(*flags, config=config, env=env), port


@pytest.fixture
def config_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "config"
    directory.mkdir()
    (directory / "reload.yaml").write_text(BASE)
    return directory


def test_sighup_reloads_and_counters_of_unchanged_rules_survive(
    start_sidecar: SidecarFactory, config_dir: Path
) -> None:
    sidecar, port = started(start_sidecar, config_dir, "--watch-config", "false")
    before = active_digest(port)
    assert codes(sidecar, "kept", "a", 3) == [OK] * 3
    (config_dir / "reload.yaml").write_text(CHANGED)
    sidecar.send_signal(signal.SIGHUP)
    event = wait_for_event(sidecar, "config_reloaded")
    assert event["trigger"] == "SIGHUP"
    assert active_digest(port) != before
    assert codes(sidecar, "kept", "a", 3) == [OK, OK, OVER_LIMIT], "3 spent before the reload still count"
    assert codes(sidecar, "changed", "b", 3) == [OK, OK, OVER_LIMIT], "the new limit applies"


def test_a_sighup_that_finds_nothing_new_says_so_at_info(start_sidecar: SidecarFactory, config_dir: Path) -> None:
    sidecar, _ = started(start_sidecar, config_dir, "--watch-config", "false")
    sidecar.send_signal(signal.SIGHUP)
    event = wait_for_event(sidecar, "config_unchanged")
    assert (event["trigger"], event["level"]) == ("SIGHUP", "info"), event
    assert event["parsed"] is False, "the files' digest matched: nothing was parsed"


def test_a_broken_config_is_refused_and_the_last_good_one_stays(
    start_sidecar: SidecarFactory, config_dir: Path
) -> None:
    sidecar, port = started(start_sidecar, config_dir, "--watch-config", "false")
    before = active_digest(port)
    (config_dir / "reload.yaml").write_text(BROKEN)
    sidecar.send_signal(signal.SIGHUP)
    event = wait_for_event(sidecar, "config_reload_refused")
    assert any("reload.yaml:6" in issue and "fortnight" in issue for issue in event["issues"]), event  # type: ignore[union-attr]
    assert active_digest(port) == before
    assert codes(sidecar, "changed", "c", 11) == [OK] * 10 + [OVER_LIMIT], "still the old limit of 10"
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    assert 'ratelimit_sidecar_config_loads_total{result="error"} 1.0' in text
    assert sidecar.alive()


def test_editing_the_file_reloads_without_a_signal(start_sidecar: SidecarFactory, config_dir: Path) -> None:
    sidecar, port = started(start_sidecar, config_dir)
    before = active_digest(port)
    (config_dir / "reload.yaml").write_text(CHANGED)
    event = wait_for_event(sidecar, "config_reloaded")
    assert event["trigger"] == "watch"
    assert active_digest(port) != before
    assert codes(sidecar, "changed", "d", 3) == [OK, OK, OVER_LIMIT]


def configmap_mount(directory: Path, text: str) -> None:
    """A volume as the kubelet writes a ConfigMap: ``..data`` -> a timestamped dir, and
    ``reload.yaml -> ..data/reload.yaml``."""
    directory.mkdir()
    version = directory / "..2026_11_21_00_00_00.000000001"
    version.mkdir()
    (version / "reload.yaml").write_text(text)
    (directory / "..data").symlink_to(version.name)
    (directory / "reload.yaml").symlink_to("..data/reload.yaml")


def kubelet_update(directory: Path, text: str, stamp: str) -> None:
    """The kubelet's atomic update: new dir, ``..data_tmp`` symlink, rename over ``..data``,
    old dir removed."""
    old = (directory / "..data").resolve()
    version = directory / f"..2026_11_21_00_00_{stamp}"
    version.mkdir()
    (version / "reload.yaml").write_text(text)
    (directory / "..data_tmp").symlink_to(version.name)
    os.rename(directory / "..data_tmp", directory / "..data")
    shutil.rmtree(old)


def test_a_configmap_update_reloads(start_sidecar: SidecarFactory, tmp_path: Path) -> None:
    mount = tmp_path / "configmap"
    configmap_mount(mount, BASE)
    sidecar, port = started(start_sidecar, mount)
    before = active_digest(port)
    assert codes(sidecar, "kept", "e", 2) == [OK, OK]
    kubelet_update(mount, CHANGED, "01.000000002")
    wait_for_event(sidecar, "config_reloaded")
    assert active_digest(port) != before
    assert codes(sidecar, "changed", "e", 3) == [OK, OK, OVER_LIMIT]
    assert codes(sidecar, "kept", "e", 4) == [OK, OK, OK, OVER_LIMIT], "2 spent before the update still count"
    kubelet_update(mount, BROKEN, "02.000000003")
    wait_for_event(sidecar, "config_reload_refused")
    assert codes(sidecar, "changed", "f", 3) == [OK, OK, OVER_LIMIT], "the last good config stays"
