"""Bounds on what a client may send, checked before any work is done.

Every bound exists so that no request can make the sidecar allocate without limit
or build an unbounded counter key; the message names the request part at fault so
a misconfigured Envoy route is easy to find. The bounds are declared beside the
descriptor model (:mod:`sidecar.config.model`) and documented in README.
"""

from __future__ import annotations

from typing import Any

from sidecar.config.model import (
    MAX_DESCRIPTORS,
    MAX_DOMAIN_LENGTH,
    MAX_ENTRIES,
    MAX_HITS,
    MAX_KEY_LENGTH,
    MAX_VALUE_LENGTH,
)
from sidecar.limiter.windows import Unit

KNOWN_UNITS = frozenset(int(unit) for unit in Unit)


def request_problem(request: Any) -> str | None:
    """Describe what is wrong with a ``RateLimitRequest``, or None when it is acceptable."""
    domain = request.domain
    if not domain:
        return "domain: must not be empty"
    if len(domain) > MAX_DOMAIN_LENGTH:
        return f"domain: longer than {MAX_DOMAIN_LENGTH} characters"
    descriptors = request.descriptors
    if not descriptors:
        return "descriptors: at least one descriptor is required"
    if len(descriptors) > MAX_DESCRIPTORS:
        return f"descriptors: more than {MAX_DESCRIPTORS} descriptors"
    for index, descriptor in enumerate(descriptors):
        problem = descriptor_problem(descriptor)
        if problem is not None:
            return f"descriptors[{index}].{problem}"
    return None


def descriptor_problem(descriptor: Any) -> str | None:
    """Describe what is wrong with one ``RateLimitDescriptor``, relative to it."""
    entries = descriptor.entries  # none is fine: no rule applies (OK, as the reference answers)
    if len(entries) > MAX_ENTRIES:
        return f"entries: more than {MAX_ENTRIES} entries"
    for index, entry in enumerate(entries):
        problem = entry_problem(entry)
        if problem is not None:
            return f"entries[{index}].{problem}"
    if descriptor.HasField("limit") and descriptor.limit.unit not in KNOWN_UNITS:
        return f"limit.unit: unknown unit {descriptor.limit.unit}"
    if descriptor.HasField("hits_addend") and descriptor.hits_addend.value > MAX_HITS:
        return f"hits_addend: larger than {MAX_HITS}"
    return None


def entry_problem(entry: Any) -> str | None:
    """Describe what is wrong with one descriptor entry, relative to it."""
    if not entry.key:
        return "key: must not be empty"
    if len(entry.key) > MAX_KEY_LENGTH:
        return f"key: longer than {MAX_KEY_LENGTH} characters"
    if len(entry.value) > MAX_VALUE_LENGTH:
        return f"value: longer than {MAX_VALUE_LENGTH} characters"
    return None
