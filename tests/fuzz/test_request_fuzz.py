"""Arbitrary ``RateLimitRequest`` messages through ``ShouldRateLimit`` (memory backend, in-process).

Every call must end in one of two ways: a valid response (one status per descriptor,
codes OK/OVER_LIMIT, numbers within uint32), or ``INVALID_ARGUMENT`` exactly when the
request breaks a documented bound (README "Request bounds", restated as an independent
oracle in ``loadtest/reliability_harness/bounds_oracle.py``, which the reliability report's
bad-input scenario shares). Never INTERNAL, never another exception, never a hang, and
the limiter's live counters never pass ``--max-counters``.
"""

from __future__ import annotations

import re
from typing import Any

import grpc
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from loadtest.reliability_harness.bounds_oracle import UINT32_MAX, UINT64_MAX, outcome_problem
from loadtest.reliability_harness.hostile_requests import (
    CONFIG_KEYS,
    CONFIG_VALUES,
    DESCRIPTOR_REPEATS,
    ENTRY_REPEATS,
    GIANT_LENGTHS,
    INVALID_UTF8,
    ODD_UNITS,
    STRING_FIELDS,
    Descriptor,
    Entry,
    Override,
    mutate,
    with_invalid_utf8,
)
from sidecar.config.model import wildcard_matcher
from sidecar.limiter.counters import MAX_INLINE_CHARS
from sidecar.metrics import MAX_STAT_KEY_LENGTH
from sidecar.protos.envoy.service.ratelimit.v3 import rls_pb2
from sidecar.service.servicer import parse_request

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
"""60 examples (was 150, two and a half times the CPU): a request bound dropped or off by one
in ``sidecar.service.validate`` fails the random tests below at 60 as at 150 (or escapes both:
a bound a lone drawn value must break; test_bounds_at_their_edges fails for every one). The
reliability report's bad-input scenario (loadtest/) draws the full volume."""

# Keys and values of the fuzz config (``in_process.FUZZ_RULES``) so requests reach real rules,
# plus anything at all: unicode without lone surrogates (a protobuf string is UTF-8).
SOME_KEY = st.sampled_from(CONFIG_KEYS)
SOME_VALUE = st.sampled_from(CONFIG_VALUES)
TEXT = st.text(st.characters(exclude_categories=["Cs"]), max_size=12)
GIANT = st.sampled_from(GIANT_LENGTHS).map(lambda n: "ж" * n)
KEYS = st.one_of(SOME_KEY, TEXT, GIANT)
VALUES = st.one_of(SOME_VALUE, TEXT, GIANT)
UNITS = st.one_of(st.integers(0, 8), st.sampled_from(ODD_UNITS))
REQUESTS_PER_UNIT = st.one_of(st.sampled_from([0, 1, UINT32_MAX]), st.integers(0, UINT32_MAX))
DESCRIPTOR_HITS = st.one_of(st.sampled_from([0, 1, UINT32_MAX, UINT32_MAX + 1, UINT64_MAX]), st.integers(0, UINT64_MAX))
REQUEST_HITS = st.one_of(st.sampled_from([0, 1, UINT32_MAX]), st.integers(0, UINT32_MAX))
PLAUSIBLE_UNITS = st.integers(1, 7)
PLAUSIBLE_DESCRIPTOR_HITS = st.one_of(st.sampled_from([0, 1, UINT32_MAX]), st.integers(0, UINT32_MAX))
ENTRIES = st.builds(Entry, key=KEYS, value=VALUES)
SMALL_ENTRIES = st.builds(Entry, key=st.one_of(SOME_KEY, TEXT), value=st.one_of(SOME_VALUE, TEXT))
PLAUSIBLE_ENTRIES = st.builds(Entry, key=SOME_KEY, value=st.one_of(SOME_VALUE, TEXT))


def repeated(strategy: st.SearchStrategy[Any], counts: list[int]) -> st.SearchStrategy[list[Any]]:
    """One drawn item ``n`` times: how to reach a bound without drawing hundreds of items."""
    return st.tuples(strategy, st.sampled_from(counts)).map(lambda pair: [pair[0]] * pair[1])


@st.composite
def descriptors(draw: st.DrawFn, wild: bool, small: bool = False) -> Any:
    """Wild: up to 4 entries of anything, or one small entry up to 500 times (32 is the
    bound), any override and hits. Otherwise keys of the config and in-range numbers."""
    if not wild:
        entries = st.one_of(st.lists(PLAUSIBLE_ENTRIES, min_size=1, max_size=3), repeated(PLAUSIBLE_ENTRIES, [32]))
    elif small:
        entries = st.lists(SMALL_ENTRIES, max_size=4)
    else:
        entries = st.one_of(st.lists(ENTRIES, max_size=4), repeated(SMALL_ENTRIES, list(ENTRY_REPEATS)))
    built = Descriptor(entries=draw(entries))
    if draw(st.integers(0, 3)) == 0:
        units = UNITS if wild else PLAUSIBLE_UNITS
        built.limit.CopyFrom(Override(requests_per_unit=draw(REQUESTS_PER_UNIT), unit=draw(units)))
    if draw(st.integers(0, 2)) == 0:
        built.hits_addend.SetInParent()
        built.hits_addend.value = draw(DESCRIPTOR_HITS if wild else PLAUSIBLE_DESCRIPTOR_HITS)
    return built


@st.composite
def requests(draw: st.DrawFn, wild: bool | None = None) -> Any:
    """Half wild (any domain, 0 to 1000 descriptors of anything), half plausible (config
    domains, 1 to 64 descriptors that reach its rules), so both refusals and answers are many."""
    if wild is None:
        wild = draw(st.booleans())
    if wild:
        domain = draw(st.one_of(st.sampled_from(["demo", "fuzz", "unknown", ""]), TEXT, GIANT))
        listed = st.one_of(
            st.lists(descriptors(wild=True), min_size=1, max_size=5),
            repeated(descriptors(wild=True, small=True), list(DESCRIPTOR_REPEATS)),
        )
    else:
        domain = draw(st.sampled_from(["demo", "fuzz"]))
        listed = st.one_of(
            st.lists(descriptors(wild=False), min_size=1, max_size=5), repeated(descriptors(wild=False), [64])
        )
    return rls_pb2.RateLimitRequest(domain=domain, descriptors=draw(listed), hits_addend=draw(REQUEST_HITS))


def check_outcome(request: Any, response: Any, abort: Any) -> None:
    """INVALID_ARGUMENT exactly when the request breaks a README bound (``bounds_oracle.bound_broken``,
    written independently of ``sidecar.service.validate``), else a valid answer."""
    event("refused" if abort is not None else "answered")
    problem = outcome_problem(request, response, abort)
    assert problem is None, problem


@FUZZ
@given(batch=st.lists(st.tuples(requests(), st.floats(0, 90_000)), min_size=1, max_size=12))
def test_any_request_is_answered_or_invalid_argument(fz, batch):
    """A sequence of requests on one service, the clock moving between them (window expiry),
    with a tiny ``--max-counters`` so eviction runs too."""
    clock = fz.SteppingClock()
    service, limiter = fz.make_service(fz.fuzz_config(), max_counters=4, clock=clock)
    for request, step in batch:
        clock.now += step
        with fz.time_limit(5, f"request {request.domain[:40]!r}"):
            response, abort = fz.call(service, request)
        check_outcome(request, response, abort)
        assert limiter.live_counters <= limiter.max_counters
    assert "internal" not in service.stats.errors


@FUZZ
@given(request=requests(), field=st.sampled_from(STRING_FIELDS), bad=st.sampled_from(INVALID_UTF8), index=st.integers())
def test_invalid_utf8_in_any_string_field_is_invalid_argument(fz, request, field, bad, index):
    """Python cannot build such a message, so a placeholder's bytes are swapped on the wire
    (same length, so no length prefix changes); upb refuses them at parse time."""
    broken = with_invalid_utf8(request, field, bad, index)
    assume(broken is not None)
    assert parse_request(broken) is None
    service, _ = fz.make_service(fz.fuzz_config())
    response, abort = fz.call(service, parse_request(broken))
    assert response is None and abort is not None and abort.code == grpc.StatusCode.INVALID_ARGUMENT


EDITS = st.lists(st.tuples(st.integers(0, 4), st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=6)


@FUZZ
@given(request=requests(wild=False), edits=EDITS)
def test_mutated_serialized_requests(fz, request, edits):
    """Bytes that were a request once: parse to anything or nothing, then the same invariants."""
    service, _ = fz.make_service(fz.fuzz_config())
    parsed = parse_request(mutate(request.SerializeToString(), edits))
    response, abort = fz.call(service, parsed)
    check_outcome(parsed, response, abort)


@FUZZ
@given(data=st.binary(max_size=600))
def test_random_bytes(fz, data):
    service, _ = fz.make_service(fz.fuzz_config())
    parsed = parse_request(data)
    response, abort = fz.call(service, parsed)
    check_outcome(parsed, response, abort)


def test_bounds_at_their_edges(fz):
    """The largest request the bounds allow is answered; one more of anything is refused."""
    service, _ = fz.make_service(fz.fuzz_config())
    widest = Descriptor(entries=[Entry(key="k" * 256, value="v" * 4096)] * 32)
    widest.limit.CopyFrom(Override(requests_per_unit=UINT32_MAX, unit=7))
    widest.hits_addend.value = UINT32_MAX
    assert widest.HasField("hits_addend")
    request = rls_pb2.RateLimitRequest(domain="fuzz", descriptors=[widest] * 64, hits_addend=UINT32_MAX)
    for domain in ("fuzz", "d" * 256):
        request.domain = domain
        response, abort = fz.call(service, request)
        assert abort is None
        fz.check_response(request, response)
    for edit in (
        lambda r: setattr(r, "domain", "d" * 257),
        lambda r: r.descriptors.add().CopyFrom(r.descriptors[0]),
        lambda r: r.descriptors[5].entries.add(key="k"),
        lambda r: setattr(r.descriptors[7].entries[3], "key", "k" * 257),
        lambda r: setattr(r.descriptors[7].entries[3], "value", "v" * 4097),
        lambda r: setattr(r.descriptors[9].limit, "unit", 8),
        lambda r: setattr(r.descriptors[9].hits_addend, "value", UINT32_MAX + 1),
    ):
        broken = rls_pb2.RateLimitRequest()
        broken.CopyFrom(request)
        edit(broken)
        response, abort = fz.call(service, broken)
        assert abort is not None and abort.code == grpc.StatusCode.INVALID_ARGUMENT


def test_huge_hits_and_zero_limits_stay_in_range(fz):
    """Counters far beyond uint32 (shadow and global-shadow keep adding) still answer in range."""
    service, _ = fz.make_service(fz.fuzz_config())
    for domain, key in (("fuzz", "shadow"), ("fuzz", "zero"), ("fuzz", "max"), ("demo", "remote_address")):
        for _ in range(5):
            descriptor = Descriptor(entries=[Entry(key=key, value="v")])
            descriptor.hits_addend.value = UINT32_MAX
            request = rls_pb2.RateLimitRequest(domain=domain, descriptors=[descriptor] * 64)
            response, abort = fz.call(service, request)
            assert abort is None
            fz.check_response(request, response)


# -- regression: wildcard values used a backtracking regex ---------------------------------


def reference_wildcard(pattern: str, value: str) -> bool:
    """What a ``*`` value means: any run of characters, possibly empty (the old regex)."""
    regex = ".*".join(re.escape(part) for part in pattern.split("*"))
    return re.fullmatch(regex, value, re.DOTALL) is not None


@settings(max_examples=500, deadline=None)
@given(pattern=st.text("ab*.\n", max_size=8), value=st.text("ab.\n", max_size=10))
def test_wildcard_matcher_means_what_the_regex_meant(pattern, value):
    assert wildcard_matcher(pattern)(value) is reference_wildcard(pattern, value)


def test_many_star_wildcard_against_a_long_value_is_fast(fz):
    """``*a*a*a*a*b`` against 4096 ``a`` took minutes with the regex (one request, loop stalled)."""
    service, _ = fz.make_service(fz.fuzz_config())
    request = rls_pb2.RateLimitRequest(
        domain="fuzz", descriptors=[Descriptor(entries=[Entry(key="k", value="a" * 4096)])] * 64
    )
    with fz.time_limit(2, "64 wildcard matches"):
        response, abort = fz.call(service, request)
    assert abort is None
    fz.check_response(request, response)
    with fz.time_limit(2, "a 40-star pattern"):
        assert not wildcard_matcher("*a" * 40 + "*b")("a" * 4096)
        assert wildcard_matcher("*a" * 40 + "*b")("a" * 4096 + "b")


# -- regression: memory per counter and per metric row grew with the request's values -------


def test_long_values_keep_counters_and_metric_rows_small(fz):
    """A counter held its request values (a request override: 32 entries of 4096 characters,
    130 kB per counter, so ``--max-counters`` bounded nothing), and so did a metric row."""
    service, limiter = fz.make_service(fz.fuzz_config(), max_counters=100_000)
    checks = []
    decide = limiter.check

    async def recording(batch, now):
        checks.extend(batch)
        return await decide(batch, now)

    limiter.check = recording
    for n in range(20):
        value = f"{n}-" + "x" * 4000
        override = Descriptor(entries=[Entry(key=f"k{index}", value=value) for index in range(32)])
        override.limit.CopyFrom(Override(requests_per_unit=5, unit=4))
        key_only = Descriptor(entries=[Entry(key="remote_address", value=value)])
        request = rls_pb2.RateLimitRequest(domain="demo", descriptors=[override, key_only])
        response, abort = fz.call(service, request)
        assert abort is None
        fz.check_response(request, response)
    assert len(checks) == 40 and limiter.live_counters == 40  # still one counter per value
    assert max(sum(map(len, check.key[1:])) for check in checks) <= MAX_INLINE_CHARS
    assert max(map(len, service.stats.rules.rows)) <= MAX_STAT_KEY_LENGTH
