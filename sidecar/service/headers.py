"""Headers the sidecar asks Envoy to add to the client's response (``response_headers_to_add``).

Two features, both computed from a request's :class:`~sidecar.limiter.protocol.Decision`,
so they work the same with every backend:

- ``--response-headers``: ``RateLimit-Limit``, ``RateLimit-Remaining`` and
  ``RateLimit-Reset`` for one descriptor, as envoyproxy/ratelimit's
  ``LIMIT_RESPONSE_HEADERS_ENABLED`` does, plus ``Retry-After`` when the request is
  refused. The descriptor reported is an over-limit one if there is any (the one whose
  window resets last: a refused client must wait for all of them), else the one with
  the fewest hits remaining (ties: the later reset). Unmatched, unlimited and
  shadow-mode descriptors are never reported: a shadow rule must not change what a
  client sees. ``--response-header-style`` picks these fields (``draft-03``, the
  default), the IETF ``RateLimit-Policy`` and ``RateLimit`` structured fields
  (``ietf``, :mod:`sidecar.service.ratelimit_fields`), or both.
- soft limits (``warn_at`` in a ``rate_limit``): an admitted request whose count
  reaches ``warn_at`` of the limit gets a warning header, one per such rule, and the
  rule's ``warned`` metric counts its hits (shadow rules count, but send no header).

Both run only when switched on (the service checks one flag and the domain's
``warns``), so they cost nothing otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from sidecar.service import ratelimit_fields
from sidecar.service.reported import Applied, reported

if TYPE_CHECKING:
    from sidecar.config.model import RateLimitRule
    from sidecar.limiter.protocol import Check, Decision
    from sidecar.metrics import RuleStats

RETRY_AFTER = "Retry-After"
PARTS_PER_MILLION = 1_000_000
"""``warn_at`` is compared in integers at this resolution, so 0.85 of 100 is exactly 85."""
MAX_LABEL_CHARS = 200
HeaderStyle = Literal["draft-03", "ietf", "both"]
"""``--response-header-style``: ``RateLimit-Limit``/``-Remaining``/``-Reset`` (as
envoyproxy/ratelimit sends them), the IETF draft's structured fields, or both."""


@dataclass(frozen=True, slots=True)
class HeaderNames:
    """The header names used (``--limit-header``, ``--remaining-header``, ``--reset-header``,
    ``--warn-header``) and which rate-limit fields are sent (``--response-header-style``)."""

    limit: str = "RateLimit-Limit"
    remaining: str = "RateLimit-Remaining"
    reset: str = "RateLimit-Reset"
    warning: str = "X-RateLimit-Warning"
    style: HeaderStyle = "draft-03"


def header_text(text: str) -> str:
    """``text`` made safe for a header value: printable ASCII only, bounded in length.

    Rule names and config values come from YAML and may hold anything; Envoy rejects a
    response header with control characters.
    """
    if not (text.isascii() and text.isprintable()):
        text = "".join(char if " " <= char <= "~" else "?" for char in text)
    return text[:MAX_LABEL_CHARS]


def warnings(
    checks: Sequence[Check], applied: Sequence[Applied | None], decision: Decision, stats: RuleStats
) -> list[str]:
    """Warning texts of an admitted request, one per rule past its ``warn_at``; counts them.

    A rule is past it when the count after this request's hits is at least ``warn_at``
    of the limit this backend enforced (the replica's share with ``--instances``) and
    still within it. Shadow rules are counted but send no text.
    """
    texts: list[str] = []
    for item in applied:
        if item is None:
            continue
        counted = False
        for rule, index in item.limits():
            text = warning(rule, index, checks, decision)
            if text is None:
                continue
            if item.stats is not None and not counted:
                # Once per descriptor: its limits share one stats row, and hits must not
                # count twice when two of them are past their warn_at.
                stats.warned(item.stats, checks[index].hits)
                counted = True
            if not rule.shadow_mode and text not in texts:
                texts.append(text)
    return texts


def warning(rule: RateLimitRule, index: int, checks: Sequence[Check], decision: Decision) -> str | None:
    """The warning text of one limit past its ``warn_at``, or None."""
    warn_at = rule.warn_at
    if warn_at is None or decision.over[index]:
        return None
    count, limit = decision.counts[index], decision.limits[index]
    if limit <= 0 or count * PARTS_PER_MILLION < round(warn_at * PARTS_PER_MILLION) * limit:
        return None
    label = header_text(rule.name or rule.stat_key)
    return f"{label}: {count * 100 // limit}% of {rate_text(rule)} used"


def rate_text(rule: RateLimitRule) -> str:
    """``100/minute``, ``100/5 minutes`` with a multiplier, ``burst 20 at 10/second`` for a bucket."""
    unit = rule.unit.name.lower() if rule.unit else "window"
    per = f"{rule.unit_multiplier} {unit}s" if rule.unit_multiplier > 1 else unit
    if rule.burst and rule.algorithm.label == "token_bucket":
        return f"burst {rule.burst} at {rule.requests_per_unit}/{per}"
    return f"{rule.requests_per_unit}/{per}"


class ResponseHeaders:
    """Works out the headers of a response; one per service, configured from the settings."""

    def __init__(self, names: HeaderNames, rate_limit_headers: bool) -> None:
        self.names = names
        self.rate_limit_headers = rate_limit_headers
        """``--response-headers``: warnings are sent whether or not this is on."""
        self.plain = names.style != "ietf"
        """``RateLimit-Limit``/``-Remaining``/``-Reset`` are sent."""
        self.structured = names.style != "draft-03"
        """``RateLimit-Policy`` and ``RateLimit`` are sent."""

    def pairs(
        self,
        checks: Sequence[Check],
        applied: Sequence[Applied | None],
        decision: Decision,
        now: float,
        *,
        warns: bool,
        stats: RuleStats,
    ) -> list[tuple[str, str]]:
        """The ``(name, value)`` headers to add; ``warns``: the domain has soft limits."""
        names = self.names
        headers: list[tuple[str, str]] = []
        if warns and decision.admitted:
            headers.extend((names.warning, text) for text in warnings(checks, applied, decision, stats))
        if not self.rate_limit_headers:
            return headers
        chosen = reported(applied, checks, decision, now)
        if chosen is None:
            return headers
        if self.plain:
            headers.append((names.limit, str(chosen.limit)))
            headers.append((names.remaining, str(chosen.remaining)))
            headers.append((names.reset, str(chosen.reset)))
        if self.structured:
            headers.extend(ratelimit_fields.fields(applied, checks, now, chosen))
        if chosen.over and not decision.admitted:
            headers.append((RETRY_AFTER, str(chosen.reset)))
        return headers
