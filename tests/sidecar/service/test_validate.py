"""Request validation: INVALID_ARGUMENT messages name the part at fault."""

from __future__ import annotations

import pytest

from sidecar.config.model import (
    MAX_DESCRIPTORS,
    MAX_DOMAIN_LENGTH,
    MAX_ENTRIES,
    MAX_HITS,
    MAX_KEY_LENGTH,
    MAX_VALUE_LENGTH,
)
from sidecar.limiter.windows import Unit
from sidecar.service.validate import request_problem


def test_valid_requests_pass(h):
    d = h.descriptor
    valid = [
        h.rate_request("d", d(("k", "v"))),
        h.rate_request("d", d("key_only")),
        h.rate_request("d", d(("k", ""))),
        h.rate_request("d" * MAX_DOMAIN_LENGTH, d(("k", "v")), hits=4_000_000_000),
        h.rate_request("d", *[d(("k", str(n))) for n in range(MAX_DESCRIPTORS)]),
        h.rate_request("d", d(*[(f"k{n}", "v") for n in range(MAX_ENTRIES)])),
        h.rate_request("d", d(("k" * MAX_KEY_LENGTH, "v" * MAX_VALUE_LENGTH))),
        h.rate_request("d", d(("k", "v"), limit=(5, Unit.YEAR), hits=MAX_HITS)),
        h.rate_request("d", d(("k", "v"), limit=(0, Unit.SECOND), hits=0)),
        h.rate_request("d", d(("k", "ünïcødé\n{x}:_"))),
        h.rate_request("d", d(("k", "v")), d()),  # no entries: no rule applies (OK, as the reference)
    ]
    for request in valid:
        assert request_problem(request) is None


INVALID = {
    "empty domain": (lambda h: h.rate_request("", h.descriptor(("k", "v"))), "domain: must not be empty"),
    "oversized domain": (
        lambda h: h.rate_request("d" * (MAX_DOMAIN_LENGTH + 1), h.descriptor(("k", "v"))),
        f"domain: longer than {MAX_DOMAIN_LENGTH} characters",
    ),
    "no descriptors": (
        lambda h: h.rate_request("d"),
        "descriptors: at least one descriptor is required",
    ),
    "too many descriptors": (
        lambda h: h.rate_request("d", *[h.descriptor(("k", "v"))] * (MAX_DESCRIPTORS + 1)),
        f"descriptors: more than {MAX_DESCRIPTORS} descriptors",
    ),
    "too many entries": (
        lambda h: h.rate_request("d", h.descriptor(*[("k", "v")] * (MAX_ENTRIES + 1))),
        f"descriptors[0].entries: more than {MAX_ENTRIES} entries",
    ),
    "empty key": (
        lambda h: h.rate_request("d", h.descriptor(("k", "v"), ("", "v"))),
        "descriptors[0].entries[1].key: must not be empty",
    ),
    "oversized key": (
        lambda h: h.rate_request("d", h.descriptor(("k" * (MAX_KEY_LENGTH + 1), "v"))),
        f"descriptors[0].entries[0].key: longer than {MAX_KEY_LENGTH} characters",
    ),
    "oversized value": (
        lambda h: h.rate_request("d", h.descriptor(("k", "v")), h.descriptor(("k", "v" * (MAX_VALUE_LENGTH + 1)))),
        f"descriptors[1].entries[0].value: longer than {MAX_VALUE_LENGTH} characters",
    ),
    "unknown override unit": (
        lambda h: h.rate_request("d", h.descriptor(("k", "v"), limit=(5, 0))),
        "descriptors[0].limit.unit: unknown unit 0",
    ),
    "override unit out of range": (
        lambda h: h.rate_request("d", h.descriptor(("k", "v"), limit=(5, 8))),
        "descriptors[0].limit.unit: unknown unit 8",
    ),
    "hits_addend too large": (
        lambda h: h.rate_request("d", h.descriptor(("k", "v"), hits=MAX_HITS + 1)),
        f"descriptors[0].hits_addend: larger than {MAX_HITS}",
    ),
}


@pytest.mark.parametrize(("build", "message"), list(INVALID.values()), ids=list(INVALID))
def test_invalid_requests_name_the_part_at_fault(h, build, message):
    assert request_problem(build(h)) == message


def test_first_problem_is_reported(h):
    request = h.rate_request("d", h.descriptor(("k", "v")), h.descriptor(("", "v")), h.descriptor())
    assert request_problem(request) == "descriptors[1].entries[0].key: must not be empty"
