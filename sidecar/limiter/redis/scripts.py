"""Lua scripts run by Redis, kept in ``lua/*.lua`` and called by SHA.

The scripts live in their own files so they can be read, linted and reviewed as
Lua, not as Python strings. Their SHA1 is computed here, so the request path sends
only ``EVALSHA`` (about 40 bytes instead of the script body); if Redis answers
``NOSCRIPT`` (restart, ``SCRIPT FLUSH``, failover to a node that never saw it),
:meth:`~sidecar.limiter.redis.store.RedisStore.run_scripts` sends the calls that did not
run again with the body (``EVAL``), which also caches it again.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources

from sidecar.limiter.algorithms import Algorithm
from sidecar.limiter.protocol import Check, Role
from sidecar.limiter.redis.keys import EXPIRY_GRACE_SECONDS, previous_window, sibling_ban_key

ROLE_CODES: Mapping[Role, int] = {Role.ENFORCED: 0, Role.SHADOW: 1, Role.QUOTA: 2}
"""How ``decide.lua`` spells each role (ARGV carries strings, numbers are cheapest)."""


@dataclass(frozen=True, slots=True)
class Script:
    """A Lua script's body and the SHA1 Redis knows it by."""

    name: str
    source: str
    sha: str


def load_script(name: str) -> Script:
    """Read ``lua/<name>`` from the package and compute its SHA1 (as ``SCRIPT LOAD`` does)."""
    source = resources.files("sidecar.limiter.redis").joinpath("lua", name).read_text(encoding="utf-8")
    return Script(name, source, hashlib.sha1(source.encode("utf-8"), usedforsecurity=False).hexdigest())


DECIDE = load_script("decide.lua")
"""The atomic all-or-nothing decision; see the header of ``lua/decide.lua``."""

FLUSH_ONCE = load_script("flush_once.lua")
"""An idempotent flush of one counter; see the header of ``lua/flush_once.lua``."""

FLUSH_BATCH = load_script("flush_batch.lua")
"""A whole idempotent flush in one call (plain Redis); see the header of ``lua/flush_batch.lua``."""

SCRIPTS: tuple[Script, ...] = (DECIDE, FLUSH_ONCE, FLUSH_BATCH)
"""Every script, loaded with ``SCRIPT LOAD`` when a connection is (re)established."""


def decide_arguments(
    keys: Sequence[str],
    checks: Sequence[Check],
    expire_ats: Sequence[int],
    admit_all: bool,
    pending: Mapping[str, tuple[int, int]],
    *,
    now_us: int = 0,
) -> tuple[list[str], list[int | str]]:
    """``KEYS`` and ``ARGV`` of ``decide.lua``: checks first, then pending adds.

    ``keys`` holds one key per check (see :func:`~sidecar.limiter.redis.keys.check_window`);
    the other keys a check needs (a sliding window's previous window, a ban) are
    derived from it here, so callers need not know them. Every check gets three keys,
    its own key standing in for those it does not need, so the script indexes them
    with a fixed stride. ``now_us`` is the script's clock; 0 means Redis ``TIME``.
    """
    script_keys: list[str] = []
    args: list[int | str] = [int(admit_all), len(checks), now_us, EXPIRY_GRACE_SECONDS]
    for key, check, expire_at in zip(keys, checks, expire_ats, strict=True):
        previous, start = key, 0
        if check.algorithm is Algorithm.SLIDING_WINDOW:
            previous, start = previous_window(key, check.unit_seconds)
        script_keys += (key, previous, sibling_ban_key(key) if check.ban_seconds else key)
        args += (
            check.limit,
            check.hits,
            ROLE_CODES[check.role],
            expire_at,
            int(check.algorithm),
            check.unit_seconds,
            start,
            check.interval_us,
            check.ban_seconds,
            int(check.count_past),
        )
    for hits, expire_at in pending.values():
        args += (hits, expire_at)
    return [*script_keys, *pending], args
