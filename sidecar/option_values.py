"""How the text of one option (a flag or an environment variable) becomes its value.

Each parser raises ``ValueError`` saying what the text must be; :mod:`sidecar.settings`
names the flag or variable at fault. Kept apart from the option table, so that the table
reads as the list of settings and this module as the rules for their values.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, get_args


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError("must be at least 1")
    return value


def finite_float(text: str) -> float:
    """A float that is a number: ``nan`` and the infinities (``inf``, ``1e999``) are refused,
    since every float setting is a duration, an offset or a fraction, and comparisons with
    NaN are all false (``--clock-offset nan`` made every window NaN)."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError("must be a finite number")
    return value


def non_negative_float(text: str) -> float:
    value = finite_float(text)
    if value < 0:
        raise ValueError("must not be negative")
    return value


def non_empty(text: str) -> str:
    if not text.strip():
        raise ValueError("must not be empty")
    return text


def key_prefix(text: str) -> str:
    """A Redis key prefix: no braces, which would become the hash tag of every key and
    put all counters in one Redis Cluster slot, and no whitespace."""
    if not text or any(char in text for char in "{}") or any(char.isspace() for char in text):
        raise ValueError("must be non-empty, without braces or whitespace")
    return text


def positive_float(text: str) -> float:
    value = finite_float(text)
    if not value > 0:
        raise ValueError("must be greater than 0")
    return value


def at_least(minimum: int, why: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise ValueError(f"must be a whole number of seconds, at least {minimum} ({why})")
        return value

    return parse


def fraction(text: str) -> float:
    value = finite_float(text)
    if not 0 <= value <= 1:
        raise ValueError("must be between 0 and 1")
    return value


def boolean(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off", ""}:
        return False
    raise ValueError("must be true or false")


HEADER_NAME_CHARACTERS = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
"""RFC 9110 ``tchar``: what an HTTP field name is made of."""


def header_name(text: str) -> str:
    name = text.strip()
    if not name or not set(name) <= HEADER_NAME_CHARACTERS:
        raise ValueError("must be an HTTP header name (letters, digits and !#$%&'*+-.^_`|~)")
    return name


UNIX_PREFIX = "unix:"


def grpc_address(text: str) -> str:
    """HOST:PORT, or ``unix:PATH`` (``unix:///abs/path`` too) for a unix domain socket."""
    if text.startswith(UNIX_PREFIX):
        path = text.removeprefix(UNIX_PREFIX).removeprefix("//")
        if not path.strip() or not (path.startswith("/") or text.count(":") == 1):
            raise ValueError("must be unix:PATH, for example unix:/var/run/ratelimit.sock")
        return text
    return host_port(text)


def host_port(text: str) -> str:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError("must be HOST:PORT, for example 127.0.0.1:8081")
    return text


def optional_host_port(text: str) -> str:
    return host_port(text) if text.strip() else ""


def one_of(closed_set: Any) -> Callable[[str], str]:
    """A parser for one of a ``Literal``'s values (case-insensitive)."""
    allowed: tuple[str, ...] = get_args(closed_set)

    def parse(text: str) -> str:
        lowered = text.strip().lower()
        if lowered not in allowed:
            raise ValueError(f"must be one of {', '.join(allowed)}")
        return lowered

    return parse
