"""The IETF ``RateLimit-Policy`` and ``RateLimit`` response fields (``--response-header-style``).

They follow draft-ietf-httpapi-ratelimit-headers-11 (May 2026), the latest revision:
both fields are Structured Field Lists (RFC 9651). ``RateLimit-Policy`` lists every
limit the request was checked against, each a String naming the policy with ``q``
(quota), ``w`` (window, whole seconds) and, for a counter per request value, ``pk``
(partition key, a Byte Sequence). ``RateLimit`` names one of them, the limit closest to
refusal (:func:`sidecar.service.reported.reported`, the same choice as the
``RateLimit-Limit`` style), with ``r`` (quota left) and ``t`` (seconds to its reset).

What each algorithm puts in the fields:

- fixed window: ``q`` = ``requests_per_unit``, ``w`` = the window (a calendar month:
  the current month's length), ``r`` = hits left, ``t`` = seconds to the window's end;
- sliding window: the same ``q`` and ``w``; ``r`` = the limit less the sliding estimate
  (the count the verdict used), ``t`` = seconds until the current window's hits start
  to weigh less;
- token bucket: ``q`` = ``burst``, ``w`` = seconds an empty bucket takes to fill,
  ``r`` = tokens left, ``t`` = seconds until the bucket is full again (for a refused
  request: until enough tokens are back for it).

Policy names are the rule's ``name``, else its stat key (``domain.key_value.key``, the
config's values, never the request's), with ``#n`` for the n-th unnamed limit of a
descriptor that has several. The partition key is a 16-byte BLAKE2b digest of the
counter's identity (the rule and the request values it counts per value): distinct
counters get distinct keys, the same counter the same key on every replica, and no
request value ever reaches the client, however long. A digest is not a secret: one
who knows the rule and guesses a value can confirm the guess.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from sidecar.limiter.algorithms import MICROSECONDS, Algorithm
from sidecar.limiter.counters import encode_counter
from sidecar.limiter.windows import CALENDAR_MONTH, month_end, month_start

if TYPE_CHECKING:
    from sidecar.config.model import RateLimitRule
    from sidecar.limiter.protocol import Check
    from sidecar.service.reported import Applied, Reported

POLICY_FIELD = "RateLimit-Policy"
LIMIT_FIELD = "RateLimit"
DRAFT = "draft-ietf-httpapi-ratelimit-headers-11"
MAX_NAME_CHARS = 128
"""Longest policy name sent; a longer one is cut and ends with a digest of the whole."""
NAME_DIGEST_HEX = 8
PARTITION_KEY_BYTES = 16
MAX_SF_INTEGER = 999_999_999_999_999
"""RFC 9651 Integers have at most 15 digits; a larger value is sent as this."""
PLAIN = frozenset(chr(code) for code in range(0x20, 0x7F)) - {"%"}
"""What a policy name keeps as it is: printable ASCII but ``%``, which escapes the rest."""


def escaped_name(text: str) -> str:
    """``text`` as the content of an sf-string: printable ASCII, ``%XX`` (UTF-8 bytes) for
    anything else and for ``%`` itself, so two different names never send the same one;
    cut to :data:`MAX_NAME_CHARS`, ending with a digest of the whole when cut."""
    return _escaped(text)


@functools.lru_cache(maxsize=4096)
def _escaped(text: str) -> str:
    # Cached: names come from the config (and the keys of request overrides), so the same
    # few strings recur on every request.
    if not set(text) <= PLAIN:
        text = "".join(char if char in PLAIN else _percent(char) for char in text)
    if len(text) > MAX_NAME_CHARS:
        digest = hashlib.blake2b(text.encode(), digest_size=NAME_DIGEST_HEX // 2).hexdigest()
        text = f"{text[: MAX_NAME_CHARS - NAME_DIGEST_HEX - 1]}~{digest}"
    return text


def _percent(char: str) -> str:
    return "".join(f"%{byte:02X}" for byte in char.encode("utf-8", "surrogatepass"))


def sf_string(text: str) -> str:
    """An RFC 9651 String of printable-ASCII ``text``: quoted, ``\\`` and ``"`` escaped."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def sf_integer(value: int) -> int:
    """``value`` within what an RFC 9651 Integer may hold (non-negative here)."""
    return min(max(value, 0), MAX_SF_INTEGER)


def policy_name(rule: RateLimitRule, position: int | None) -> str:
    """The policy's name (escaped, unquoted); ``position``: 1-based place of an unnamed
    limit among its descriptor's several limits, None when it has one."""
    if rule.name:
        return escaped_name(rule.name)
    base = rule.stat_key if position is None else f"{rule.stat_key}#{position}"
    return escaped_name(base)


def partition_key(check: Check) -> str | None:
    """``:base64:``, the digest of the counter's identity; None when the counter holds no
    request value (one counter for every request that matches the rule)."""
    if len(check.key) < 2:
        return None
    digest = hashlib.blake2b(encode_counter(check.key), digest_size=PARTITION_KEY_BYTES).digest()
    return ":" + base64.b64encode(digest).decode("ascii") + ":"


def window_seconds(rule: RateLimitRule, now: float) -> int:
    """``w``: the window, or the time an empty token bucket takes to fill (at least 1 s)."""
    if rule.algorithm is Algorithm.TOKEN_BUCKET:
        return max(1, math.ceil(rule.burst * rule.interval_us / MICROSECONDS))
    if rule.unit_seconds == CALENDAR_MONTH:
        start = month_start(now)
        return month_end(start) - start
    return rule.unit_seconds


def _named(applied: Sequence[Applied | None]) -> list[tuple[RateLimitRule, int, int | None]]:
    """``(rule, check index, position)`` of every enforced limit of the request, in order;
    shadow rules are left out, as in :func:`sidecar.service.reported.reported`."""
    limits: list[tuple[RateLimitRule, int, int | None]] = []
    for item in applied:
        if item is None or item.rule.shadow_mode:
            continue
        several = len(item.more) > 0
        for position, (rule, index) in enumerate(item.limits(), start=1):
            limits.append((rule, index, position if several else None))
    return limits


def fields(
    applied: Sequence[Applied | None], checks: Sequence[Check], now: float, chosen: Reported
) -> list[tuple[str, str]]:
    """``RateLimit-Policy`` (every limit, each once) and ``RateLimit`` (``chosen``)."""
    policies: dict[str, None] = {}  # ordered and without repeats: one descriptor sent twice
    chosen_item = ""
    for rule, index, position in _named(applied):
        name = sf_string(policy_name(rule, position))
        key = partition_key(checks[index])
        pk = f";pk={key}" if key else ""
        policies[f"{name};q={sf_integer(rule.limit)};w={sf_integer(window_seconds(rule, now))}{pk}"] = None
        if index == chosen.check:
            chosen_item = f"{name};r={sf_integer(chosen.remaining)};t={sf_integer(chosen.reset)}{pk}"
    found = [(POLICY_FIELD, ", ".join(policies))]
    return [*found, (LIMIT_FIELD, chosen_item)] if chosen_item else found
