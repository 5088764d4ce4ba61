"""Counter keys that hold something that is not a counter: found, counted, logged, avoided.

A counter key that another client overwrote (a hash, a list, ``"many"``, ``"1.5"``) or
set beyond what Lua counts exactly (its numbers are doubles: integers are exact up to
2^53; 2^63-1 came back from ``decide.lua`` as -2^63) cannot be counted on. The scripts
refuse such a key before writing anything (``CORRUPT <key> <why>``) and flushes skip
it; the request that met it is decided by the failure mode, Redis stays up for the
others. Each key is logged once a minute at most (and at most
:data:`MAX_LINES_PER_MINUTE` lines a minute for all keys), and every meeting is counted
for ``/metrics``.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable

import structlog

log = structlog.get_logger(__name__)

MAX_EXACT = 2**53
"""Largest magnitude a counter may hold: Lua's numbers are doubles, exact up to here."""
INTEGER = re.compile(r"-?\d+")
CORRUPT_REPLY = "CORRUPT"
"""First word of the error ``decide.lua`` and ``flush_once.lua`` answer for such a key."""
LOG_EVERY = 60.0
"""Seconds before the same key is logged again."""
MAX_LINES_PER_MINUTE = 10
MAX_TRACKED = 10_000
"""Keys remembered at most (the oldest are forgotten, and found again if still corrupt)."""


def problem_with(value: object) -> str | None:
    """Why a value read from a counter key (GET, INCRBY) is not a counter; None if it is one."""
    if value is None or isinstance(value, int):
        number = value or 0
    elif isinstance(value, bytes | str):
        text = value.decode() if isinstance(value, bytes) else value
        if not INTEGER.fullmatch(text):
            return "holds a value that is not an integer"
        number = int(text[:20])  # enough digits to tell it is beyond 2^53
    else:
        return "holds a value that is not an integer"
    if abs(number) > MAX_EXACT:
        return f"holds an integer beyond +-2^53 ({number})"
    return None


def key_of_reply(message: str) -> tuple[str, str] | None:
    """``(key, why)`` of a script's ``CORRUPT <key> <why>`` error; None for other errors."""
    word, _, rest = message.partition(" ")
    if word != CORRUPT_REPLY:
        return None
    key, _, why = rest.partition(" ")
    return key, why.partition(" script:")[0] or "holds no counter"


class CorruptKeys:
    """What this process found corrupt, for the limiters, the metrics and the log."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.found_times = 0
        """Calls (a request's script, a flush's key) that met a corrupt key."""
        self.refused_hits = 0
        """Admitted hits a flush could not add to a corrupt key (they are lost to Redis)."""
        self.keys: dict[str, float] = {}
        """Corrupt keys (oldest first) and when each was last logged; empty in the usual case."""
        self._minute = (-LOG_EVERY, 0, 0)
        """Start of the current log minute, lines logged in it, lines held back."""

    def found(self, key: str, why: str, hits: int = 0) -> None:
        """A call met ``key`` holding no counter; ``hits``: admitted hits it could not add."""
        self.found_times += 1
        self.refused_hits += hits
        now = self.clock()
        last = self.keys.pop(key, None)
        if (last is None or now - last >= LOG_EVERY) and self._may_log(now):
            log.error(
                "redis_corrupt_key",
                key=key,
                problem=why,
                refused_hits=hits,
                decided_by="failure mode",
                hint="delete the key (or wait for its window to end): it is not a counter of ours",
                other_keys_not_logged=self._take_held(),
            )
            last = now
        self.keys[key] = now - LOG_EVERY if last is None else last  # not logged yet: next time
        while len(self.keys) > MAX_TRACKED:
            del self.keys[next(iter(self.keys))]

    def _may_log(self, now: float) -> bool:
        start, lines, held = self._minute
        if now - start >= LOG_EVERY:
            start, lines = now, 0
        if lines >= MAX_LINES_PER_MINUTE:
            self._minute = (start, lines, held + 1)
            return False
        self._minute = (start, lines + 1, held)
        return True

    def _take_held(self) -> int:
        start, lines, held = self._minute
        self._minute = (start, lines, 0)
        return held

    def repaired(self, key: str) -> None:
        """``key`` held a counter again (deleted, expired, rewritten)."""
        if self.keys.pop(key, None) is not None:
            log.info("redis_corrupt_key_repaired", key=key)

    def any_of(self, keys: Iterable[str | None]) -> bool:
        """Whether one of ``keys`` is known to be corrupt (cheap when none is)."""
        return bool(self.keys) and any(key in self.keys for key in keys if key is not None)
