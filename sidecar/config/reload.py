"""Hot reload: load the config path again and swap it in as a whole, or keep the last good one.

Triggered by the file watcher and by SIGHUP. Loading runs in a worker thread so the
request path keeps answering from the old config meanwhile; the swap itself is one
reference assignment. Counters are keyed by rule identity (domain, window, config
path), not by config version, so counters of rules a reload leaves unchanged carry on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog

from sidecar.config.errors import ConfigError
from sidecar.config.load import load_config
from sidecar.config.model import RateLimitConfig

log = structlog.get_logger(__name__)

MAX_LOGGED_ISSUES = 20


def rule_count(config: RateLimitConfig) -> int:
    return sum(len(domain.rules) for domain in config.domains.values())


class ConfigReloader:
    """Reloads ``path``; ``apply`` installs a new config, ``refused`` hears of a broken one."""

    def __init__(
        self,
        path: str,
        current: Callable[[], RateLimitConfig],
        apply: Callable[[RateLimitConfig], None],
        refused: Callable[[], None],
        mode: str | None = None,
    ) -> None:
        self.path = path
        self.mode = mode
        """The Redis mode enforcing the config (see :func:`~sidecar.config.load.mode_issues`)."""
        self.current = current
        self.apply = apply
        self.refused = refused
        self._lock = asyncio.Lock()

    async def reload(self, trigger: str) -> bool:
        """Load and swap; True when a new config is active. One reload at a time."""
        async with self._lock:
            try:
                config = await asyncio.to_thread(load_config, self.path, self.mode)
            except ConfigError as error:
                self._refuse(trigger, [str(issue) for issue in error.issues])
                return False
            except OSError as error:
                self._refuse(trigger, [f"{self.path}: {error.strerror or error}"])
                return False
            previous = self.current()
            if config.digest == previous.digest:
                log.debug("config_unchanged", trigger=trigger, config_digest=config.digest[:12])
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
