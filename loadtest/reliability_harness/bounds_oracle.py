"""The request-bounds oracle: what every call to ``ShouldRateLimit`` must end in.

README "Request bounds" (docs/limits.md), restated independently of
``sidecar.service.validate`` (:func:`bound_broken`), and the invariants of an answer
(:func:`response_problems`). Functions name what is wrong (None or nothing yielded when
nothing is), so a test asserts on them and the harness counts them. Shared by the
bad-input scenario of the reliability report (``bad_input.py``) and the fuzz tests
(``tests/fuzz``): one copy, in the product's tools, since tools never import tests.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import grpc

from sidecar.protos.envoy.service.ratelimit.v3 import rls_pb2

if TYPE_CHECKING:
    from loadtest.reliability_harness.in_process import AbortedError

UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1
KNOWN_UNITS = frozenset(range(1, 8))
"""``RateLimitResponse.RateLimit.Unit`` SECOND to YEAR."""
LONGEST_WINDOW = 365 * 86_400
OK = rls_pb2.RateLimitResponse.OK
OVER_LIMIT = rls_pb2.RateLimitResponse.OVER_LIMIT

REFUSAL_DETAILS = re.compile(r"(domain|descriptors|request)\b")
"""How an INVALID_ARGUMENT's details start: the part of the request at fault."""


def bound_broken(request: Any) -> bool:
    """docs/configuration.md's request bounds, written independently of ``sidecar.service.validate``
    (a descriptor without entries is within them: answered OK, as by the reference)."""
    if not 1 <= len(request.domain) <= 256 or not 1 <= len(request.descriptors) <= 64:
        return True
    for descriptor in request.descriptors:
        if len(descriptor.entries) > 32:
            return True
        if any(not 1 <= len(entry.key) <= 256 or len(entry.value) > 4096 for entry in descriptor.entries):
            return True
        if descriptor.HasField("limit") and not 1 <= descriptor.limit.unit <= 7:
            return True
        if descriptor.HasField("hits_addend") and descriptor.hits_addend.value > UINT32_MAX:
            return True
    return False


def response_problems(request: Any, response: Any) -> Iterator[str]:
    """What is wrong with an answer (the handler's wire bytes): one status per descriptor, codes
    and numbers in range."""
    parsed = rls_pb2.RateLimitResponse.FromString(response)
    if parsed.overall_code not in (OK, OVER_LIMIT):
        yield f"overall_code {parsed.overall_code}"
    if len(parsed.statuses) != len(request.descriptors):
        yield f"{len(parsed.statuses)} statuses for {len(request.descriptors)} descriptors"
    for index, status in enumerate(parsed.statuses):
        if status.code not in (OK, OVER_LIMIT):
            yield f"statuses[{index}].code {status.code}"
        if not 0 <= status.limit_remaining <= UINT32_MAX:
            yield f"statuses[{index}].limit_remaining {status.limit_remaining}"
        if status.HasField("current_limit") and (
            status.current_limit.unit not in KNOWN_UNITS
            or status.limit_remaining > status.current_limit.requests_per_unit
        ):
            yield f"statuses[{index}]: remaining {status.limit_remaining} of {status.current_limit}"
        if status.HasField("duration_until_reset") and not 1 <= status.duration_until_reset.seconds <= LONGEST_WINDOW:
            yield f"statuses[{index}].duration_until_reset {status.duration_until_reset.seconds} s"
    if parsed.overall_code == OVER_LIMIT and not any(status.code == OVER_LIMIT for status in parsed.statuses):
        yield "OVER_LIMIT overall with no descriptor OVER_LIMIT"


def response_problem(request: Any, response: Any) -> str | None:
    """The first of :func:`response_problems`, or None."""
    return next(response_problems(request, response), None)


def outcome_problem(request: Any, response: Any, abort: AbortedError | None) -> str | None:
    """What is wrong with how a call ended, or None: INVALID_ARGUMENT naming the part at fault
    exactly when the request breaks a bound (``request`` None: bytes that are no message),
    else a valid answer."""
    if abort is not None:
        if abort.code != grpc.StatusCode.INVALID_ARGUMENT:
            return f"{abort.code.name}: {abort.details}"
        if not REFUSAL_DETAILS.match(abort.details):
            return f"refused with details naming no part of the request: {abort.details!r}"
        if request is not None and not bound_broken(request):
            return f"a valid request was refused: {abort.details}"
        return None
    if request is None or bound_broken(request):
        return "a request breaking a bound was answered"
    return response_problem(request, response)
