"""The HAProxy exporter's vocabulary: what the proxy sends (sources, tests, producers, routes), in
HAProxy's terms (sample expressions, ACL bodies), and the HAProxy 2.6 limits every other module of
:mod:`sidecar.export.haproxy` works within. :class:`Problem` and :class:`ExportError` are the
exporters' shared ones (:mod:`sidecar.export.problems`)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from sidecar.export.problems import Problem

Flavour = Literal["fixed", "sliding"]
FLAVOURS: tuple[Flavour, ...] = ("fixed", "sliding")
TRACKERS = 3
"""HAProxy 2.6 tracks at most sc0..sc2 per request (``MAX_SESS_STKCTR``, a build-time constant)."""
MAX_SLOTS = 100
"""A ``gpc``/``gpc_rate`` array holds at most 100 counters: the rules of one window length share a
table, one slot each, so an entry (one key) holds every such rule's count and needs one tracker."""
KEY_LENGTH = 64
"""``len`` of every table's string keys. An IP address or a typical API key fits with the
window number and stays readable in ``show table``; a longer key is replaced by a hash,
since HAProxy would silently truncate it and let two keys share a counter."""
HASH_BYTES = 16
"""Long keys become the first 128 bits of their SHA-256, in hex (32 characters, no ``:``,
so never equal to a raw key, which always holds one). A cryptographic hash, because a
client who can choose a value must not be able to land on someone else's counter, which
``xxh64`` with its public seed would not prevent."""
MAX_TIMER_SECONDS = (2**31 - 1) // 1000
"""HAProxy refuses an ``expire`` or a rate period longer than 2^31 - 1 ms (~24.8 days)."""
DEFAULT_TABLE_SIZE = "1m"
FLAGS_ROUTE = "all requests"
"""The one route of an export from flags: every descriptor may come with any request."""
ADDRESS_LENGTH = 45
"""Longest text form of an IPv6 address (with an embedded IPv4 one)."""


# ---------------------------------------------------------------- what the proxy sends


@dataclass(frozen=True, slots=True)
class Fetch:
    """An entry value HAProxy reads from the request, as a sample expression (``src``)."""

    sample: str
    always: bool = False
    """Present on every request (the client address): no presence test needed."""
    max_length: int | None = None
    """A known bound on the value's length: keys that surely fit skip the hashing step."""


@dataclass(frozen=True, slots=True)
class Const:
    """An entry value fixed by the proxy config (Envoy's ``generic_key``)."""

    value: str


Source = Fetch | Const


@dataclass(frozen=True, slots=True)
class Test:
    """One ACL: ``body`` is everything after the ACL's name; ``hint`` helps name it."""

    body: str
    hint: str
    negated: bool = False

    def negate(self) -> Test:
        """The same ACL, used with ``!``."""
        return replace(self, negated=not self.negated)


Condition = tuple[Test, ...]
"""All tests must hold (HAProxy's ``if a b c``)."""


@dataclass(frozen=True, slots=True)
class Producer:
    """A descriptor the proxy sends whenever ``condition`` holds: one Envoy ``rate_limits`` entry."""

    origin: str
    entries: tuple[tuple[str, Source], ...]
    condition: Condition = ()


@dataclass(frozen=True, slots=True)
class Route:
    """Requests a route takes (``match``; None takes all) and the descriptors it sends for them."""

    label: str
    match: Test | None
    producers: tuple[Producer, ...]
    host: Test | None = None
    """With several virtual hosts: the test that Envoy would give the request this route's host."""


@dataclass(frozen=True, slots=True)
class Sources:
    """Everything known about the requests: the domain, the routes in match order, problems."""

    domain: str
    origin: str
    routes: tuple[Route, ...]
    problems: tuple[Problem, ...] = ()
    hosts: tuple[tuple[int, Test], ...] = ()
    """With several virtual hosts: ``(host number, domain test)`` in the order Envoy tries domains."""
