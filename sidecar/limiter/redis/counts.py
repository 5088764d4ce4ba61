"""What ``decide.lua`` answers, read: each request's would-be counts, its checks' ban ends,
the totals of its pending adds, and the script's own verdict (:func:`verdict`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sidecar.limiter.protocol import Check, Role, decide


class Counts(list[int]):
    """One request's would-be counts from ``decide.lua`` (a list, index-aligned with its
    checks), when each check's ban ends where the request has bans (Unix seconds, 0 for
    none; empty when no check has a ban duration), and the script's own verdict."""

    ban_ends: tuple[float, ...] = ()
    totals: dict[str, int] = {}  # noqa: RUF012 - a class default, replaced per instance, never mutated
    """Each pending add's key with its value after the call (``decide_batch``'s ``adds``)."""
    admitted: bool | None = None
    """Whether the script admitted the request (and so wrote its hits); None when no one
    script decided it (Cluster, counters in several slots)."""


def counts_of(reply: Sequence[Any], checks: int, pending: int = 0, keys: Sequence[str] = ()) -> Counts:
    """The :class:`Counts` in a ``decide.lua`` reply (see its header for the layout);
    ``keys``: the pending adds' keys, whose totals go to :attr:`Counts.totals`."""
    counts = Counts(int(value) for value in reply[1 : 1 + checks])
    counts.admitted = int(reply[0]) == 1
    if keys:
        counts.totals = dict(zip(keys, (int(value) for value in reply[1 + checks : 1 + checks + pending]), strict=True))
    ends = reply[1 + checks + pending :]
    if ends:
        counts.ban_ends = tuple(float(value) for value in ends)
    return counts


def verdict(
    checks: Sequence[Check], counts: Sequence[int], limits: Sequence[int], admit_all: bool
) -> tuple[bool, tuple[bool, ...], tuple[bool, ...]]:
    """:func:`~sidecar.limiter.protocol.decide` over a script's counts, with the script's
    own verdict on the request where it gave one (:attr:`Counts.admitted`): the script
    wrote what it decided, so that is what happened, whatever the counts say."""
    admitted, over, consume = decide(checks, counts, limits, admit_all)
    script = getattr(counts, "admitted", None)
    if script is None or script == admitted:
        return admitted, over, consume
    spent = tuple(
        (script and (admit_all or not is_over or check.role is Role.SHADOW)) or check.count_past
        for check, is_over in zip(checks, over, strict=True)
    )
    return script, over, spent
