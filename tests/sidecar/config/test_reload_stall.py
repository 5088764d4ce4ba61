"""Issue 21, defect 7: a hot reload of a large valid config must not stall the request path.

The figures are in ``python -m loadtest.reload_stall``; these tests pin the mechanism:
no full garbage collection runs while a config loads (unless the frozen heap doubled
since the last full pass: sidecar/heap.py), what a load leaves is frozen out of later
full collections, and a reload whose files did not change parses nothing (the look the
watcher takes right after SERVING included, in a real sidecar process).
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sidecar import heap
from sidecar.config import load_config, reload
from sidecar.config.reload import ConfigReloader
from tests.support.sidecars import SidecarFactory, clean_env, log_events, write_config

RULES = 3000


def large_config(rules: int, limit: int = 100) -> str:
    lines = ["domain: stall", "descriptors:"]
    for index in range(rules):
        lines += [f"  - key: k{index}", f"    rate_limit: {{unit: minute, requests_per_unit: {limit}}}"]
    return "\n".join(lines) + "\n"


@pytest.fixture
def full_collections() -> Iterator[list[float]]:
    """Start times of every full (oldest generation) collection while the test runs."""
    seen: list[float] = []

    def watch(phase: str, info: dict[str, Any]) -> None:
        if phase == "start" and info["generation"] == 2:
            seen.append(time.monotonic())

    gc.collect()
    gc.callbacks.append(watch)
    try:
        yield seen
    finally:
        gc.callbacks.remove(watch)
        gc.unfreeze()


def reloader_for(path: Path, active: list[Any]) -> ConfigReloader:
    return ConfigReloader(str(path), lambda: active[-1], active.append, lambda: None)


def test_no_full_collection_runs_while_a_large_config_loads(
    tmp_path: Path, full_collections: list[float], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reload pays no full collection unless the frozen heap doubled since the last full
    pass (sidecar.heap's bound on frozen garbage): this test's process settles first, as a
    started sidecar has, so the 3,000 rules loaded after are far from doubling it."""
    monkeypatch.setattr(heap, "SETTLER", heap.HeapSettler())
    config = tmp_path / "stall.yaml"
    config.write_text(large_config(RULES))
    active = [load_config(config)]
    heap.settle()
    config.write_text(large_config(RULES, limit=101))
    threshold = gc.get_threshold()
    started = time.monotonic()
    assert asyncio.run(reloader_for(config, active).reload("test")) is True
    during = [moment for moment in full_collections if moment >= started]
    assert during == [], f"{len(during)} full collections during a {RULES}-rule reload"
    assert gc.get_threshold() == threshold, "the collector's thresholds are restored"
    assert gc.get_freeze_count() > 0, "what the load left is frozen out of full collections"


def test_a_reload_of_unchanged_files_parses_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "stall.yaml"
    config.write_text(large_config(10))
    active = [load_config(config)]
    parsed: list[str] = []

    def counting(path: Any, *args: Any, **kwargs: Any) -> Any:
        parsed.append(str(path))
        return load_config(path, *args, **kwargs)

    monkeypatch.setattr(reload, "load_config", counting)
    reloader = reloader_for(config, active)
    assert asyncio.run(reloader.reload("watch")) is False
    assert parsed == [], "unchanged files were parsed again"
    config.write_text(large_config(10, limit=7))
    assert asyncio.run(reloader.reload("watch")) is True
    assert len(parsed) == 1 and len(active) == 2


def test_no_parse_right_after_serving(start_sidecar: SidecarFactory, tmp_path: Path) -> None:
    """The watcher's first look (a change between the startup load and arming the watch)
    compares digests; it used to load and parse the whole config again."""
    directory = write_config(tmp_path / "config", large_config(RULES), "stall.yaml")
    sidecar = start_sidecar("--log-level", "debug", config=directory, env=clean_env())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        unchanged = [e for e in log_events(sidecar.stderr()) if e.get("event") == "config_unchanged"]
        if unchanged:
            break
        time.sleep(0.05)
    time.sleep(0.5)
    events = log_events(sidecar.stderr())
    unchanged = [event for event in events if event.get("event") == "config_unchanged"]
    assert unchanged, "the watcher takes one look after SERVING"
    assert all(event.get("parsed") is False for event in unchanged), unchanged
    assert not [event for event in events if event.get("event") == "config_reloaded"]
