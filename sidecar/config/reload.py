"""Hot reload: load the config path again and swap it in as a whole, or keep the last good one.

Triggered by the file watcher and by SIGHUP. Loading runs in a worker thread so the
request path keeps answering from the old config meanwhile; the swap itself is one
reference assignment. Counters are keyed by rule identity (domain, window, config
path), not by config version, so counters of rules a reload leaves unchanged carry on.

What a reload must not do is stall the event loop, which shares the GIL with the
loading thread. Building a large config makes hundreds of thousands of objects (YAML
nodes, marks, rules) that live until the load ends, so CPython's full collections ran
again and again during it, each walking every object of the process while holding the
GIL: 14,000 rules reloaded in 5.8 s and ShouldRateLimit waited up to half a second.
So (see ``python -m loadtest.reload_stall``):

* the collector's oldest generation is paused while a config loads (young collections
  still run; the load's objects are either kept, as the config, or freed by reference
  counting: the config holds no cycles);
* after every load (the startup one too) everything alive is moved to the permanent
  generation (``gc.freeze``, by :mod:`sidecar.heap`), so later full collections skip
  the config and the process's other long-lived objects;
* a reload first compares the digest of the files' bytes with the active config's and
  stops there when they are equal, so the look the watcher takes right after SERVING
  (and any spurious watch event) costs a read of the files, not a parse.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import structlog

from sidecar import heap
from sidecar.config.errors import ConfigError
from sidecar.config.load import DEFAULT_OPTIONS, LoadOptions, config_files, load_config
from sidecar.config.model import RateLimitConfig
from sidecar.config.yaml_source import MAX_FILE_BYTES

log = structlog.get_logger(__name__)

MAX_LOGGED_ISSUES = 20
PAUSE_GC_DURING_LOAD = True
"""Pause full collections while a config loads (``loadtest.reload_stall`` turns it off to compare)."""
FREEZE_AFTER_LOAD = True
"""``gc.freeze()`` after each load (``loadtest.reload_stall`` turns it off to compare)."""
LOAD_SWITCH_INTERVAL = 0.001
"""Seconds a thread may hold the GIL while another waits, during a load (CPython's default
is 0.005): the loading thread gives the event loop its turn sooner. 0 leaves it alone."""
PAUSED_THRESHOLD = 1 << 30
"""The oldest generation's threshold while paused: never reached by a load."""
_pauses = 0


@contextlib.contextmanager
def full_collections_paused() -> Iterator[None]:
    """No full (oldest generation) collection in this block; young ones still run.

    Process-wide, so nested and concurrent uses (the reloader runs one load at a time,
    but the startup load may use it too) restore the threshold only when the last ends.
    """
    global _pauses  # noqa: PLW0603 - one process-wide collector
    if not PAUSE_GC_DURING_LOAD:
        yield
        return
    young, middle, oldest = gc.get_threshold()
    _pauses += 1
    if _pauses == 1:
        gc.set_threshold(young, middle, PAUSED_THRESHOLD)
    try:
        yield
    finally:
        _pauses -= 1
        if _pauses == 0:
            gc.set_threshold(young, middle, oldest if oldest != PAUSED_THRESHOLD else 10)


def settle_after_load() -> None:
    """Move every live object to the permanent generation, so full collections skip them
    (:func:`sidecar.heap.settle`: the one policy, shared with the quota buckets)."""
    if FREEZE_AFTER_LOAD:
        heap.settle()


def load_quietly(
    path: str | Path, mode: str | None = None, max_bytes: int = MAX_FILE_BYTES, options: LoadOptions = DEFAULT_OPTIONS
) -> RateLimitConfig:
    """:func:`load_config` with full collections paused, and the GIL handed over more often
    (:data:`LOAD_SWITCH_INTERVAL`) so the event loop waits less for it: for a worker thread."""
    return build_quietly(lambda: load_config(path, mode, max_bytes, options))


def build_quietly(build: Callable[[], RateLimitConfig]) -> RateLimitConfig:
    """Run ``build`` (a file load, or an xDS push's conversion) as :func:`load_quietly` does."""
    interval = sys.getswitchinterval()
    if LOAD_SWITCH_INTERVAL:
        sys.setswitchinterval(min(interval, LOAD_SWITCH_INTERVAL))
    try:
        with full_collections_paused():
            return build()
    finally:
        sys.setswitchinterval(interval)


def files_digest(path: str | Path, max_bytes: int = MAX_FILE_BYTES) -> str | None:
    """The digest :func:`load_config` would give the config at ``path``, from the files'
    bytes alone (no parsing); None when it cannot tell (a file missing, unreadable, or
    too large to read: then the full load reports it)."""
    try:
        files = config_files(Path(path))
        digest = hashlib.sha256()
        for file in files:
            if file.stat().st_size > max_bytes:
                return None
            digest.update(str(file).encode() + b"\0" + file.read_bytes() + b"\0")
    except (ConfigError, OSError):
        return None
    return digest.hexdigest()


def rule_count(config: RateLimitConfig) -> int:
    return sum(len(domain.rules) for domain in config.domains.values())


OPERATOR_TRIGGERS = frozenset({"SIGHUP"})
"""Reloads an operator asked for: their outcome is logged at info even when nothing changed,
so whoever sent the signal can see it arrived (a file watcher's no-op stays at debug)."""


def unchanged(trigger: str, *, parsed: bool, digest: str) -> None:
    """Log a reload that found the active config (``parsed``: the files changed, the rules did not)."""
    level = log.info if trigger in OPERATOR_TRIGGERS else log.debug
    level("config_unchanged", trigger=trigger, parsed=parsed, config_digest=digest[:12])


class ConfigReloader:
    """Reloads ``path``; ``apply`` installs a new config, ``refused`` hears of a broken one."""

    def __init__(
        self,
        path: str,
        current: Callable[[], RateLimitConfig],
        apply: Callable[[RateLimitConfig], None],
        refused: Callable[[], None],
        mode: str | None = None,
        *,
        max_bytes: int = MAX_FILE_BYTES,
        options: LoadOptions = DEFAULT_OPTIONS,
    ) -> None:
        self.path = path
        self.mode = mode
        """The Redis mode enforcing the config (see :func:`~sidecar.config.load.mode_issues`)."""
        self.options = options
        """Merging domains, calendar months: as the startup load had them."""
        self.max_bytes = max_bytes
        """``--max-config-bytes``: a larger file is refused before it is read."""
        self.current = current
        self.apply = apply
        self.refused = refused
        self._lock = asyncio.Lock()

    async def reload(self, trigger: str) -> bool:
        """Load and swap; True when a new config is active. One reload at a time."""
        async with self._lock:
            if await asyncio.to_thread(files_digest, self.path, self.max_bytes) == self.current().digest:
                unchanged(trigger, parsed=False, digest=self.current().digest)
                return False
            try:
                config = await asyncio.to_thread(load_quietly, self.path, self.mode, self.max_bytes, self.options)
            except ConfigError as error:
                self._refuse(trigger, [str(issue) for issue in error.issues])
                return False
            except OSError as error:
                self._refuse(trigger, [f"{self.path}: {error.strerror or error}"])
                return False
            finally:
                settle_after_load()
            return self._swap(trigger, config)

    async def swap_in(self, trigger: str, build: Callable[[], RateLimitConfig]) -> list[str]:
        """Build a config in a worker thread (an xDS push: :mod:`sidecar.config.xds_source`) and
        install it as a reload would; the issues that refused it, empty when it is active (or
        was already). One swap or reload at a time."""
        async with self._lock:
            try:
                config = await asyncio.to_thread(build_quietly, build)
            except ConfigError as error:
                issues = [str(issue) for issue in error.issues]
                self._refuse(trigger, issues)
                return issues
            finally:
                settle_after_load()
            self._swap(trigger, config)
            return []

    def _swap(self, trigger: str, config: RateLimitConfig) -> bool:
        previous = self.current()
        if config.digest == previous.digest:
            unchanged(trigger, parsed=True, digest=config.digest)
            return False
        self.apply(config)
        log.info(
            "config_reloaded",
            trigger=trigger,
            files=len(config.files),
            domains=sorted(config.domains),
            rules=rule_count(config),
            config_digest=config.digest[:12],
            previous_digest=previous.digest[:12],
        )
        return True

    def _refuse(self, trigger: str, issues: list[str]) -> None:
        self.refused()
        log.error(
            "config_reload_refused",
            trigger=trigger,
            issues=issues[:MAX_LOGGED_ISSUES],
            issue_count=len(issues),
            active_digest=self.current().digest[:12],
        )
