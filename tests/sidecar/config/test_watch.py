"""ConfigWatcher on the real filesystem: edits, new files, ConfigMap swaps, renames, stop.

Every test arms a real watcher (inotify, or polling where named) on ``tmp_path``,
waits until it is armed, changes the filesystem the way an operator, an editor or the
kubelet does, and counts the callbacks. Waits are bounded; "no further callback" is
checked by waiting a few quiet periods after the expected one.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import watchfiles

from sidecar.config import watch as watch_module
from sidecar.config.load import load_config
from sidecar.config.watch import ConfigWatcher

pytestmark = pytest.mark.timeout(30)

QUIET = 0.1
"""The watcher's quiet period in these tests (its default)."""
SETTLE = 3 * QUIET + 0.1
"""How long to wait for a callback that must *not* come."""
ARRIVE = 5.0
"""Longest wait for a callback that must come: generous for a loaded machine."""
RECHECK = 0.1
NEVER = 3600.0
"""A recheck period no test waits out: a run that ends within ``ARRIVE`` did not wait for it."""


def domain_yaml(limit: int, domain: str = "demo") -> str:
    rule = f"  - key: k\n    rate_limit:\n      unit: second\n      requests_per_unit: {limit}\n"
    return f"domain: {domain}\ndescriptors:\n{rule}"


class Recorder:
    """The callback: counts calls; optionally loads the config as the real one would."""

    def __init__(self, load_from: Path | None = None) -> None:
        self.calls = 0
        self.load_from = load_from
        self.digests: list[str] = []
        self.changed = asyncio.Condition()
        self.fail = False

    async def __call__(self) -> None:
        if self.load_from is not None:
            self.digests.append(load_config(self.load_from).digest)
        async with self.changed:
            self.calls += 1
            self.changed.notify_all()
        if self.fail:
            raise RuntimeError("callback failed on purpose")

    async def reach(self, calls: int, timeout: float = ARRIVE) -> None:
        """Wait until at least ``calls`` callbacks happened."""
        async with self.changed:
            await asyncio.wait_for(self.changed.wait_for(lambda: self.calls >= calls), timeout)

    async def exactly(self, calls: int) -> None:
        """Wait for ``calls`` callbacks, then make sure no other one follows."""
        await self.reach(calls)
        await asyncio.sleep(SETTLE)
        assert self.calls == calls


@asynccontextmanager
async def watching(path: Path, recorder: Recorder, **options: Any) -> AsyncIterator[ConfigWatcher]:
    """A running watcher on ``path``, armed; stopped (and checked to end) afterwards."""
    options.setdefault("recheck", RECHECK)
    watcher = ConfigWatcher(path, recorder, quiet=QUIET, **options)
    task = asyncio.create_task(watcher.run())
    try:
        if path.exists() or path.parent.exists():
            await asyncio.wait_for(watcher.ready.wait(), ARRIVE)
        yield watcher
    finally:
        watcher.stop()
        await asyncio.wait_for(task, ARRIVE)


def configmap(root: Path, files: dict[str, str], stamp: str) -> Path:
    """Lay out a ConfigMap volume as the kubelet's atomic writer does; returns ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    data = root / stamp
    data.mkdir()
    for name, text in files.items():
        (data / name).write_text(text)
    (root / "..data").symlink_to(stamp)
    for name in files:
        (root / name).symlink_to(Path("..data") / name)
    return root


def kubelet_update(root: Path, files: dict[str, str], stamp: str) -> None:
    """The kubelet's update, step by step: new timestamped dir, ``..data_tmp``, rename, remove the old."""
    old = os.readlink(root / "..data")
    data = root / stamp
    data.mkdir()
    for name, text in files.items():
        (data / name).write_text(text)
    (root / "..data_tmp").symlink_to(stamp)
    os.rename(root / "..data_tmp", root / "..data")
    shutil.rmtree(root / old)


async def test_a_burst_of_writes_to_a_file_in_the_directory_gives_one_callback(tmp_path: Path) -> None:
    config = tmp_path / "config"
    config.mkdir()
    target = config / "demo.yaml"
    target.write_text(domain_yaml(1))
    recorder = Recorder(load_from=config)
    async with watching(config, recorder):
        for limit in range(2, 7):  # five writes, 10 ms apart: well inside the quiet period
            target.write_text(domain_yaml(limit))
            await asyncio.sleep(0.01)
        await recorder.exactly(1)
        assert recorder.digests == [load_config(config).digest]  # it saw the end of the burst

        target.write_text(domain_yaml(7))  # a later, separate edit is a second burst
        await recorder.exactly(2)


async def test_a_new_file_in_the_directory_triggers(tmp_path: Path) -> None:
    config = tmp_path / "config"
    config.mkdir()
    (config / "demo.yaml").write_text(domain_yaml(1))
    recorder = Recorder(load_from=config)
    async with watching(config, recorder):
        (config / "other.yaml").write_text(domain_yaml(1, domain="other"))
        await recorder.exactly(1)
        assert sorted(load_config(config).domains) == ["demo", "other"]


@pytest.mark.parametrize("polling", [False, True], ids=["inotify", "polling"])
async def test_a_configmap_symlink_swap_triggers_once(tmp_path: Path, polling: bool) -> None:
    root = configmap(tmp_path / "mount", {"demo.yaml": domain_yaml(1)}, "..2024_01_01_00_00_00.000000001")
    before = load_config(root).digest
    recorder = Recorder(load_from=root)
    async with watching(root, recorder, force_polling=polling, poll_interval=0.05):
        kubelet_update(root, {"demo.yaml": domain_yaml(2)}, "..2024_01_01_00_01_00.000000002")
        await recorder.exactly(1)
        after = load_config(root).digest
        assert after != before
        assert recorder.digests == [after]

        kubelet_update(root, {"demo.yaml": domain_yaml(3)}, "..2024_01_01_00_02_00.000000003")
        await recorder.exactly(2)


async def test_a_single_file_inside_a_configmap_mount_sees_the_swap(tmp_path: Path) -> None:
    # --config pointing at one file of the mount: the file is a symlink that never
    # changes itself; only ..data moves underneath it.
    root = configmap(tmp_path / "mount", {"demo.yaml": domain_yaml(1)}, "..2024_01_01_00_00_00.000000001")
    target = root / "demo.yaml"
    recorder = Recorder(load_from=target)
    async with watching(target, recorder):
        kubelet_update(root, {"demo.yaml": domain_yaml(2)}, "..2024_01_01_00_01_00.000000002")
        await recorder.exactly(1)
        assert recorder.digests == [load_config(target).digest]


async def test_a_file_replaced_by_rename_triggers_and_stays_watched(tmp_path: Path) -> None:
    target = tmp_path / "demo.yaml"
    target.write_text(domain_yaml(1))
    recorder = Recorder(load_from=target)
    async with watching(target, recorder):
        for round_, limit in enumerate((2, 3), start=1):
            # What editors and config tools do: write a temporary file, rename it over.
            temporary = tmp_path / f".demo.yaml.{limit}.tmp"
            temporary.write_text(domain_yaml(limit))
            os.replace(temporary, target)
            await recorder.exactly(round_)
            assert recorder.digests[-1] == load_config(target).digest


async def test_a_single_file_ignores_its_neighbours(tmp_path: Path) -> None:
    target = tmp_path / "demo.yaml"
    target.write_text(domain_yaml(1))
    recorder = Recorder()
    async with watching(target, recorder):
        (tmp_path / "unrelated.yaml").write_text("x")
        (tmp_path / ".demo.yaml.swp").write_text("x")
        await asyncio.sleep(SETTLE)
        assert recorder.calls == 0
        target.write_text(domain_yaml(2))
        await recorder.exactly(1)


async def test_reading_the_config_in_the_callback_does_not_retrigger(tmp_path: Path) -> None:
    # The real callback reads every file; access events must not start a reload loop.
    root = configmap(tmp_path / "mount", {"demo.yaml": domain_yaml(1)}, "..2024_01_01_00_00_00.000000001")
    recorder = Recorder(load_from=root)
    async with watching(root, recorder):
        kubelet_update(root, {"demo.yaml": domain_yaml(2)}, "..2024_01_01_00_01_00.000000002")
        await recorder.exactly(1)
        for _ in range(3):
            load_config(root)
        await asyncio.sleep(SETTLE)
        assert recorder.calls == 1


async def test_a_missing_directory_is_watched_once_it_appears(tmp_path: Path) -> None:
    config = tmp_path / "later" / "config"
    recorder = Recorder()
    async with watching(config, recorder) as watcher:
        await asyncio.sleep(3 * RECHECK)
        assert not watcher.ready.is_set()
        config.mkdir(parents=True)
        (config / "demo.yaml").write_text(domain_yaml(1))
        await asyncio.wait_for(watcher.ready.wait(), ARRIVE)
        (config / "demo.yaml").write_text(domain_yaml(2))
        await recorder.reach(1)


async def test_a_directory_removed_and_recreated_is_watched_again(tmp_path: Path) -> None:
    config = tmp_path / "config"
    config.mkdir()
    (config / "demo.yaml").write_text(domain_yaml(1))
    recorder = Recorder()
    async with watching(config, recorder) as watcher:
        roots: list[Path] = []
        arm = watcher._armed
        watcher._armed = lambda plan: (roots.append(plan.root), arm(plan))[1]  # type: ignore[method-assign]
        shutil.rmtree(config)
        await asyncio.sleep(3 * RECHECK)
        ready = tmp_path / "ready"  # the new directory appears whole: nothing changes in it after
        ready.mkdir()
        (ready / "demo.yaml").write_text(domain_yaml(2))
        ready.rename(config)
        await recorder.reach(1)  # the removal, the re-arming, or both
        # Re-armed on the new directory: its signal came first, so no callback of the gap
        # is still to come (an ordering, not a quiet period a loaded machine may overrun).
        deadline = time.monotonic() + ARRIVE
        while config not in roots and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert config in roots, f"never re-armed on the new directory: {roots}"
        seen = recorder.calls
        (config / "demo.yaml").write_text(domain_yaml(3))  # the new directory is really watched
        await recorder.exactly(seen + 1)


async def test_falls_back_to_polling_when_inotify_cannot_be_set_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_awatch = watchfiles.awatch

    async def no_inotify(*paths: Any, **options: Any) -> AsyncIterator[Any]:
        if not options.get("force_polling"):
            raise OSError(28, "OS file watch limit reached")  # what an exhausted inotify gives
        async with aclosing(real_awatch(*paths, **options)) as batches:
            async for batch in batches:
                yield batch

    monkeypatch.setattr(watch_module, "awatch", no_inotify)
    config = tmp_path / "config"
    config.mkdir()
    recorder = Recorder()
    async with watching(config, recorder, poll_interval=0.05) as watcher:
        assert watcher.polling
        (config / "demo.yaml").write_text(domain_yaml(1))
        await recorder.exactly(1)


async def test_a_failing_callback_does_not_stop_the_watcher(tmp_path: Path) -> None:
    target = tmp_path / "demo.yaml"
    target.write_text(domain_yaml(1))
    recorder = Recorder()
    recorder.fail = True
    async with watching(target, recorder):
        target.write_text(domain_yaml(2))
        await recorder.exactly(1)
        target.write_text(domain_yaml(3))
        await recorder.exactly(2)


async def test_stop_ends_run_promptly(tmp_path: Path) -> None:
    target = tmp_path / "demo.yaml"
    target.write_text(domain_yaml(1))
    # recheck (the watch's own timeout) is an hour: ending within ARRIVE means stop did not
    # wait for it (no wall-time figure asserted; ARRIVE only bounds the wait).
    watcher = ConfigWatcher(target, Recorder(), recheck=NEVER)
    task = asyncio.create_task(watcher.run())
    await asyncio.wait_for(watcher.ready.wait(), ARRIVE)
    watcher.stop()
    await asyncio.wait_for(task, ARRIVE)
    assert task.done() and task.exception() is None


async def test_cancel_ends_run_promptly(tmp_path: Path) -> None:
    watcher = ConfigWatcher(tmp_path, Recorder(), recheck=NEVER)
    task = asyncio.create_task(watcher.run())
    await asyncio.wait_for(watcher.ready.wait(), ARRIVE)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, ARRIVE)
    assert task.cancelled()


async def test_stop_ends_run_promptly_while_the_path_is_missing(tmp_path: Path) -> None:
    watcher = ConfigWatcher(tmp_path / "nope" / "config", Recorder(), recheck=NEVER)
    task = asyncio.create_task(watcher.run())
    await asyncio.sleep(0.05)
    watcher.stop()
    await asyncio.wait_for(task, ARRIVE)  # not the hour's pause before the next look
    assert task.done() and task.exception() is None
    assert not watcher.ready.is_set()
