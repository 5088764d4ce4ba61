"""Whether one descriptor-config rule fits HAProxy 2.6 (why not: ``rule_problem``, ``ban_problem``),
and how the HAProxy output writes its rate and window."""

from __future__ import annotations

from sidecar.config.model import RateLimitRule
from sidecar.export.haproxy.model import MAX_TIMER_SECONDS, Flavour
from sidecar.limiter.algorithms import Algorithm


def window_text(rule: RateLimitRule) -> str:
    """``unit minute``, or ``unit minute x 5 (300 s)`` for a window of several units."""
    unit = rule.unit.name.lower() if rule.unit else "?"
    if rule.unit_multiplier == 1:
        return f"unit {unit}"
    return f"unit {unit} x {rule.unit_multiplier} ({rule.unit_seconds} s)"


def rate_of(rule: RateLimitRule) -> str:
    """``20/second``, or ``5/5 minutes`` for a window of several units."""
    unit = rule.unit.name.lower() if rule.unit else "?"
    per = f"{rule.unit_multiplier} {unit}s" if rule.unit_multiplier > 1 else unit
    return f"{rule.requests_per_unit}/{per}"


def is_sliding(rule: RateLimitRule) -> bool:
    return rule.algorithm is Algorithm.SLIDING_WINDOW


def keeps_previous_window(rule: RateLimitRule, flavour: Flavour) -> bool:
    """Whether the rule's table must keep an entry one window past its end: every rate of the
    sliding flavour, and a ``sliding_window`` rule of the fixed flavour (which reads the
    previous window's count)."""
    return flavour == "sliding" or rule.algorithm is Algorithm.SLIDING_WINDOW


def option_problem(rule: RateLimitRule) -> str | None:
    """Why a rule option HAProxy has no counterpart for keeps the rule out, or None."""
    if rule.quota_mode:
        return "quota_mode (reject only when every quota descriptor is over) is not exported"
    if rule.count_past:
        return (
            "count_past_limit (costs reported after the response, counted past the limit) is not exported: "
            "HAProxy counts one hit per request and has no response-phase cost"
        )
    if rule.suppress:
        return (
            "overload: suppress (each request admitted with a probability from the attempted demand) is not "
            "exported: HAProxy's stick tables refuse once the count is past the limit and draw no probability"
        )
    return None


def rule_problem(rule: RateLimitRule, flavour: Flavour) -> str | None:
    """Why a rule cannot be exported in ``flavour`` at all, or None."""
    if rule.unlimited:
        return None
    option = option_problem(rule)
    if option is not None:
        return option
    if rule.algorithm is Algorithm.TOKEN_BUCKET:
        return (
            f"algorithm token_bucket (burst {rule.burst}, refilled at {rate_of(rule)}): HAProxy 2.6 has no token "
            "bucket (its stick tables count hits per period; nothing refills over time), and no window admits "
            "the same requests"
        )
    unit = rule.unit_seconds
    needed = 2 * unit + 1 if keeps_previous_window(rule, flavour) else unit + 1
    if needed > MAX_TIMER_SECONDS:
        if flavour == "sliding":
            what = "a sliding window needs a rate period and expire"
        elif rule.algorithm is Algorithm.SLIDING_WINDOW:
            what = "a sliding_window rule keeps the previous window: it needs a table expire"
        else:
            what = "a fixed window needs a table expire"
        return (
            f"{window_text(rule)}: {what} of {needed} s; HAProxy 2.6 allows at most {MAX_TIMER_SECONDS} s (~24.8 days)"
        )
    return None


def ban_problem(rule: RateLimitRule) -> str | None:
    """Why a rule's ``ban_duration`` cannot be exported (the limit itself still is), or None."""
    needed = rule.ban_seconds + 1
    if needed > MAX_TIMER_SECONDS:
        return (
            f"ban_duration {rule.ban_seconds} s not exported (the limit is): a ban is kept in a table whose expire "
            f"would be {needed} s; HAProxy 2.6 allows at most {MAX_TIMER_SECONDS} s (~24.8 days)"
        )
    return None
