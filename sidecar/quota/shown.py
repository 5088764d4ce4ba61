"""What quota mode shows of what clients send: ``/config`` ids and log lines, both capped.

Bucket ids come from request headers, so a client decides how long they are; a stream
is opened per Envoy connection, so a client decides how many there are. Neither may make
``/config`` or the log large: an id is shown cut to :data:`SHOWN_ID_CHARS`, and the
per-stream log lines are limited to :data:`STREAM_LOG_BURST` per :data:`LOG_INTERVAL`.
"""

from __future__ import annotations

from collections.abc import Mapping

import structlog

log = structlog.get_logger("sidecar.quota.registry")

SHOWN_ID_CHARS = 256
"""Characters of one bucket id shown in ``/config`` (names and values together)."""
SHOWN_FIELD_CHARS = 96
"""Characters of one name or value shown."""
LOG_INTERVAL = 60.0
"""Recurring warnings (overflow, malformed input) are logged at most this often each."""
STREAM_LOG_BURST = 20
"""Per-stream info lines (opened, closed) logged per :data:`LOG_INTERVAL`; the rest are counted."""
CUT = "…"


def cut(text: str, chars: int) -> str:
    return text if len(text) <= chars else text[: max(0, chars - 1)] + CUT


def shown_id(bucket: Mapping[str, str]) -> tuple[dict[str, str], int]:
    """A bucket id as ``/config`` shows it, and the characters that takes: each name and
    value cut to :data:`SHOWN_FIELD_CHARS`, fields listed until :data:`SHOWN_ID_CHARS`."""
    shown: dict[str, str] = {}
    used = 0
    for name, value in bucket.items():
        if used >= SHOWN_ID_CHARS:
            shown[CUT] = f"{len(bucket) - len(shown)} more fields"
            break
        shown_name = cut(name, SHOWN_FIELD_CHARS)
        shown_value = cut(value, min(SHOWN_FIELD_CHARS, SHOWN_ID_CHARS - used))
        shown[shown_name] = shown_value
        used += len(shown_name) + len(shown_value)
    return shown, used


class RateLimitedLog:
    """Log each event at most once per ``interval`` (and each distinct reason once)."""

    def __init__(self, interval: float = LOG_INTERVAL, burst: int = STREAM_LOG_BURST) -> None:
        self.interval = interval
        self.burst = burst
        self.last: dict[str, float] = {}
        self.reasons: set[str] = set()
        self.budgets: dict[str, tuple[float, int, int]] = {}
        """``event -> (window start, lines logged in it, lines suppressed since the last one)``."""

    def every(self, event: str, now: float, **fields: object) -> None:
        if now - self.last.get(event, -self.interval) >= self.interval:
            self.last[event] = now
            log.warning(event, **fields)

    def once(self, event: str, reason: str, **fields: object) -> None:
        if reason not in self.reasons and len(self.reasons) < 1000:
            self.reasons.add(reason)
            log.warning(event, reason=reason, **fields)

    def limited(self, event: str, now: float, **fields: object) -> bool:
        """Log at info, at most ``burst`` lines per ``interval``; a line after a quiet spell
        says how many were suppressed. True when logged."""
        start, logged, suppressed = self.budgets.get(event, (now, 0, 0))
        if now - start >= self.interval:
            start, logged = now, 0
        if logged >= self.burst:
            self.budgets[event] = (start, logged, suppressed + 1)
            return False
        self.budgets[event] = (start, logged + 1, 0)
        if suppressed:
            fields["suppressed_before"] = suppressed
        log.info(event, **fields)
        return True
