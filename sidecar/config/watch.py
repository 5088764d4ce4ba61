"""Watch the config path and say when the config *may* have changed, for hot reload.

The watcher is deliberately dumb: it never reads or parses the config. It calls an
async callback after a burst of filesystem events settles, and the caller loads the
config, compares its digest with the active one and swaps it only if it differs and
is valid (a bad config is refused as a whole; the last good one stays active). So a
spurious signal costs one load, never a wrong config, and the watcher can afford to
err toward signalling.

What it watches, and why:

* **A directory** (the usual case: a Kubernetes ConfigMap mount) is watched
  recursively, and every event under it counts, dot entries included. The kubelet
  updates a mount atomically without touching the visible files: ``demo.yaml`` is a
  symlink to ``..data/demo.yaml``, ``..data`` a symlink to a timestamped directory;
  an update writes a new timestamped directory, points a ``..data_tmp`` symlink at
  it, renames ``..data_tmp`` over ``..data`` and deletes the old directory. Only dot
  entries change, so filtering them out (or watching the resolved files) would miss
  every ConfigMap update.
* **A single file** is watched through its parent directory, non-recursively, and
  filtered to that file's name: editors and config tools replace a file by writing
  a temporary one and renaming it over the original, which a watch on the file's
  inode would never see. Entries of the parent whose names start with ``..`` count
  too, so a file inside a ConfigMap mount (a symlink through ``..data``) is seen to
  change when the kubelet swaps ``..data``.
* **A missing path** (or a directory replaced or removed while watched) is not an
  error: the watcher checks every ``recheck`` seconds whether what it should watch
  exists and is still the same directory (device and inode), re-arms the watch when
  it changed, and then signals once, since anything may have happened meanwhile.

Events are debounced by watchfiles itself: a batch is delivered once no new event
arrived for ``quiet`` seconds (or after ``max_delay`` during a continuous stream),
so a burst of writes, or the kubelet's four steps, gives one callback. Events that
arrive while the callback runs are kept and give one more callback afterwards.

inotify is used where available. ``force_polling=True`` polls instead (network
filesystems, some container runtimes); if inotify cannot be set up at all (for
example when the per-user watch limit is exhausted) the watcher falls back to
polling by itself and logs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import structlog
from watchfiles import Change, awatch

log = structlog.get_logger(__name__)

OnChange = Callable[[], Awaitable[None]]
"""The callback: "the config may have changed". It should load, compare and swap."""

KUBELET_PREFIX = ".."
"""Names the kubelet's atomic writer uses (``..data``, ``..data_tmp``, ``..2024_...``)."""


@dataclass(frozen=True, slots=True)
class WatchPlan:
    """What to hand to watchfiles for the config path as it is right now.

    Two plans compare equal while the same directory (device and inode) is watched
    the same way; a different plan means the watch must be re-armed.
    """

    root: Path
    """The directory watchfiles watches: the config directory, or a file's parent."""
    recursive: bool
    only: str | None
    """File mode: the name of the config file within ``root``; None for a directory."""
    identity: tuple[int, int]
    """``(st_dev, st_ino)`` of ``root`` (symlinks followed) when the plan was made."""

    def relevant(self, _change: Change, path: str) -> bool:
        """watchfiles filter: in file mode, only the file and the kubelet's ``..`` entries."""
        if self.only is None:
            return True
        name = os.path.basename(path)
        return name == self.only or name.startswith(KUBELET_PREFIX)


def plan_for(path: Path) -> WatchPlan | None:
    """How to watch ``path`` now; None when neither it nor its parent directory exists."""
    try:
        if path.is_dir():
            return WatchPlan(path, True, None, _identity(path))
        parent = path.parent
        return WatchPlan(parent, False, path.name, _identity(parent))
    except OSError:
        return None


def _identity(directory: Path) -> tuple[int, int]:
    """Raises OSError (FileNotFoundError, NotADirectoryError) unless ``directory`` is one."""
    info = directory.stat()
    if not directory.is_dir():
        raise NotADirectoryError(str(directory))
    return info.st_dev, info.st_ino


class ConfigWatcher:
    """Calls ``on_change`` whenever the config at ``path`` may have changed.

    Use::

        watcher = ConfigWatcher(settings.config, reload)
        task = asyncio.create_task(watcher.run())
        await watcher.ready.wait()      # armed: from here on no change is missed
        await reload()                  # covers a change between the first load and arming
        ...
        watcher.stop()                  # or task.cancel(); both end run() within ~quiet seconds
        await task

    ``run`` never raises for filesystem trouble or a failing callback (both are
    logged and survived: a watcher that died silently would quietly turn hot
    reload off); it returns after :meth:`stop` and raises CancelledError when cancelled.
    One watcher runs once.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        on_change: OnChange,
        *,
        quiet: float = 0.1,
        max_delay: float = 1.0,
        recheck: float = 1.0,
        force_polling: bool | None = None,
        poll_interval: float = 0.3,
    ) -> None:
        """``quiet``: seconds without events that end a burst; ``max_delay``: longest a
        continuous stream of events is held back; ``recheck``: how often a missing or
        replaced path is looked at again; ``force_polling``: poll instead of inotify (None:
        watchfiles' default, which honours ``WATCHFILES_FORCE_POLLING``), every
        ``poll_interval`` seconds."""
        self.path = Path(os.path.abspath(path))
        """Absolute, symlinks *not* resolved: a swapped symlink must stay the thing watched."""
        self.on_change = on_change
        self.quiet = quiet
        self.max_delay = max(max_delay, quiet)
        self.recheck = recheck
        self.force_polling = force_polling
        self.poll_interval = poll_interval
        self.ready = asyncio.Event()
        """Set once the first watch is armed: changes made after this are never missed."""
        self.signals = 0
        """How many times ``on_change`` was called (for logs, metrics and tests)."""
        self._stop = asyncio.Event()
        self._failures = 0

    @property
    def polling(self) -> bool:
        """True when polling: forced, the fallback after inotify failed, or watchfiles'
        ``WATCHFILES_FORCE_POLLING`` environment variable (honoured when not told either way)."""
        if self.force_polling is None:
            return "WATCHFILES_FORCE_POLLING" in os.environ
        return self.force_polling

    def stop(self) -> None:
        """Ask :meth:`run` to return; it does within about ``quiet`` seconds. Idempotent."""
        self._stop.set()

    async def run(self) -> None:
        """Watch until :meth:`stop` (or cancellation), calling ``on_change`` after each burst."""
        armed_before = False
        while not self._stop.is_set():
            plan = plan_for(self.path)
            if plan is None:
                await self._pause()
                continue
            if armed_before:
                # The watched directory appeared, vanished or was replaced: whatever
                # happened in between went unseen, so the config may differ.
                await self._signal()
            armed_before = await self._watch(plan) or armed_before

    async def _watch(self, plan: WatchPlan) -> bool:
        """Watch under one plan until it no longer holds or we stop; True if it was armed."""
        batches = self._batches(plan)
        first: asyncio.Future[set[tuple[Change, str]]] | None = None
        armed = False
        try:
            first = asyncio.ensure_future(anext(batches))
            # awatch sets up the inotify watch synchronously in its first step, before
            # its first await, so once that step has run no later change is missed.
            await asyncio.sleep(0)
            if not first.done() or first.exception() is None:
                armed = True
                self._armed(plan)
            changes = await first
            while True:
                if changes:
                    log.debug("config_watch_event", changes=sorted(path for _, path in changes)[:20])
                    await self._signal()
                if self._stop.is_set() or plan_for(self.path) != plan:
                    return armed
                changes = await anext(batches)
        except StopAsyncIteration:
            return armed  # stopped
        except FileNotFoundError:
            # The directory vanished between planning and arming: plan again, unhurried.
            await self._pause()
            return armed
        except OSError as error:
            if not armed and not self.polling:
                # inotify unavailable (watch or instance limit, unsupported filesystem).
                log.warning("config_watch_polling_fallback", path=str(self.path), reason=str(error))
                self.force_polling = True
                return False
            await self._failed()
            return armed
        except RuntimeError:  # watchfiles' internal errors (WatchfilesRustInternalError)
            await self._failed()
            return armed
        finally:
            if first is not None and not first.done():
                # Cancelled before the first batch: the generator is still running in
                # that task, and a running generator cannot be closed.
                first.cancel()
                with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration, Exception):
                    await first
            await batches.aclose()

    def _batches(self, plan: WatchPlan) -> AsyncGenerator[set[tuple[Change, str]], None]:
        # yield_on_timeout: an empty batch every ``recheck`` seconds lets _watch notice a
        # replaced or removed directory even when the watch itself reports nothing.
        return awatch(
            plan.root,
            watch_filter=plan.relevant,
            debounce=_ms(self.max_delay),
            step=_ms(self.quiet),
            stop_event=self._stop,
            rust_timeout=_ms(self.recheck),
            yield_on_timeout=True,
            force_polling=self.force_polling,
            poll_delay_ms=_ms(self.poll_interval),
            recursive=plan.recursive,
        )

    def _armed(self, plan: WatchPlan) -> None:
        self._failures = 0
        if not self.ready.is_set():
            log.info(
                "config_watch_started",
                path=str(self.path),
                watching=str(plan.root),
                mode="file" if plan.only else "directory",
                polling=self.polling,
            )
            self.ready.set()
        else:
            log.info("config_watch_rearmed", path=str(self.path), watching=str(plan.root))

    async def _signal(self) -> None:
        self.signals += 1
        try:
            await self.on_change()
        except Exception:
            log.exception("config_watch_callback_failed", path=str(self.path))

    async def _failed(self) -> None:
        """Log a watch failure (the first of a run in full, repeats briefly) and wait before retrying."""
        self._failures += 1
        if self._failures == 1:
            log.exception("config_watch_failed", path=str(self.path))
        else:
            log.warning("config_watch_still_failing", path=str(self.path), failures=self._failures)
        await self._pause()

    async def _pause(self) -> None:
        """Sleep ``recheck`` seconds, or less if stopped meanwhile."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), self.recheck)


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))
