"""The bucket id convention: how an RLQS bucket id names a descriptor of the config.

A bucket id is a string map. Ours holds ``"domain": <domain>`` and, for each descriptor
entry ``i`` (0-based, in descriptor order) with key ``K``, ``"entry.<i>.<K>": <value>``::

    {"domain": "edge", "entry.0.remote_address": "10.0.0.1"}

is the descriptor ``[(remote_address, 10.0.0.1)]`` of domain ``edge``. The Envoy config
generator builds ids to this convention, so it is fixed. Parsing is strict: anything
that :func:`bucket_of` would not have produced is refused with a short reason, which
the service counts and treats as "no match" (never an error on the stream).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

from sidecar.config.model import MAX_DOMAIN_LENGTH, MAX_ENTRIES, MAX_KEY_LENGTH, MAX_VALUE_LENGTH

DOMAIN_KEY = "domain"
ENTRY_PREFIX = "entry."
MAX_BUCKET_FIELDS = MAX_ENTRIES + 1
"""The same bounds as a ``ShouldRateLimit`` descriptor (sidecar/validate.py)."""

BucketKey = tuple[tuple[str, str], ...]
"""A bucket id as a hashable value: its items, sorted."""


class DescriptorEntry(NamedTuple):
    """One descriptor entry; satisfies :class:`sidecar.config.match.Entry`."""

    key: str
    value: str


class ParsedBucket(NamedTuple):
    """A bucket id read as a descriptor of one domain."""

    domain: str
    entries: tuple[DescriptorEntry, ...]


class BucketIdError(ValueError):
    """A bucket id outside the convention; ``reason`` is a short label for metrics."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def bucket_of(domain: str, entries: Sequence[tuple[str, str]]) -> dict[str, str]:
    """The bucket id of a descriptor: the inverse of :func:`parse_bucket`."""
    bucket = {DOMAIN_KEY: domain}
    for index, (key, value) in enumerate(entries):
        bucket[f"{ENTRY_PREFIX}{index}.{key}"] = value
    return bucket


def bucket_key(bucket: Mapping[str, str]) -> BucketKey:
    """A hashable identity of a bucket id (map order does not matter)."""
    return tuple(sorted(bucket.items()))


def parse_bucket(bucket: Mapping[str, str]) -> ParsedBucket:
    """The descriptor a bucket id names; :class:`BucketIdError` when it breaks the convention."""
    if len(bucket) > MAX_BUCKET_FIELDS:
        raise BucketIdError("too_many_entries", f"{len(bucket)} fields, at most {MAX_BUCKET_FIELDS}")
    domain = bucket.get(DOMAIN_KEY)
    if domain is None:
        raise BucketIdError("missing_domain", f"no {DOMAIN_KEY!r} field")
    if not domain or len(domain) > MAX_DOMAIN_LENGTH:
        raise BucketIdError("bad_domain", f"domain must be 1 to {MAX_DOMAIN_LENGTH} characters")
    by_index: dict[int, DescriptorEntry] = {}
    for name, value in bucket.items():
        if name == DOMAIN_KEY:
            continue
        index, key = _entry_name(name)
        if index in by_index:
            raise BucketIdError("duplicate_index", f"two entries with index {index}")
        if len(value) > MAX_VALUE_LENGTH:
            raise BucketIdError("too_long", f"value of {name[:64]!r} longer than {MAX_VALUE_LENGTH}")
        by_index[index] = DescriptorEntry(key, value)
    if not by_index:
        raise BucketIdError("no_entries", "a descriptor needs at least one entry")
    if max(by_index) != len(by_index) - 1:
        raise BucketIdError("index_gap", f"indexes {sorted(by_index)[:8]} are not 0..{len(by_index) - 1}")
    return ParsedBucket(domain, tuple(by_index[index] for index in range(len(by_index))))


def _entry_name(name: str) -> tuple[int, str]:
    """``(index, key)`` of an ``entry.<i>.<K>`` field name."""
    if not name.startswith(ENTRY_PREFIX):
        raise BucketIdError("unknown_field", f"field {name[:64]!r} is neither domain nor entry.<i>.<key>")
    digits, dot, key = name[len(ENTRY_PREFIX) :].partition(".")
    # Only what bucket_of writes: plain decimal, no sign, no leading zero, no spaces.
    if not dot or not digits.isascii() or not digits.isdigit() or (len(digits) > 1 and digits[0] == "0"):
        raise BucketIdError("bad_index", f"field {name[:64]!r}: index must be a plain decimal number")
    if len(digits) > 3:
        raise BucketIdError("too_many_entries", f"field {name[:64]!r}: index too large")
    if not key or len(key) > MAX_KEY_LENGTH:
        raise BucketIdError("bad_key", f"field {name[:64]!r}: key must be 1 to {MAX_KEY_LENGTH} characters")
    return int(digits), key
