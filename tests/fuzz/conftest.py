"""Helpers for the fuzz tests, offered as one session fixture, ``fz``.

The handler is driven without an event loop: with the memory backend nothing it
awaits ever suspends, so one ``send(None)`` runs a call to its end and a fuzz case
costs microseconds. Loads and calls run under :func:`time_limit`, so a hang fails
the test with the input that caused it instead of stalling the run.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from types import FrameType, SimpleNamespace
from typing import Any

import pytest
from envoy.service.ratelimit.v3 import rls_pb2

from sidecar.config.load import load_config, parse_text
from sidecar.config.model import RateLimitConfig
from sidecar.limiter.memory import MemoryLimiter
from sidecar.service import RateLimitService

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "config"
UINT32_MAX = 2**32 - 1
OK = rls_pb2.RateLimitResponse.OK
OVER_LIMIT = rls_pb2.RateLimitResponse.OVER_LIMIT
KNOWN_UNITS = frozenset(range(1, 8))
LONGEST_WINDOW = 365 * 86_400

FUZZ_RULES = """\
# Every feature of the descriptor config once, next to examples/config (domain demo).
domain: fuzz
descriptors:
  - key: k
    rate_limit: {unit: second, requests_per_unit: 3}
  - key: k
    value: "*a*a*a*b"
    rate_limit: {name: stars, unit: minute, requests_per_unit: 2}
  - key: zero
    rate_limit: {unit: hour, requests_per_unit: 0}
  - key: max
    rate_limit: {unit: year, requests_per_unit: 4294967295}
  - key: shared
    value: "p-*"
    share_threshold: true
    rate_limit: {unit: day, requests_per_unit: 5}
  - key: quota
    quota_mode: true
    rate_limit: {unit: week, requests_per_unit: 1}
  - key: shadow
    shadow_mode: true
    rate_limit: {unit: month, requests_per_unit: 1}
  - key: detailed
    detailed_metric: true
    rate_limit: {unit: second, requests_per_unit: 10}
    descriptors:
      - key: inner
        rate_limit: {name: inner, unit: minute, requests_per_unit: 1, replaces: [{name: stars}]}
  - key: free
    rate_limit: {unlimited: true}
  - key: "ünï{c}:_ key"
    value: "x\\ty{}"
    rate_limit: {unit: second, requests_per_unit: 1}
"""


class TimeLimitExceeded(BaseException):
    """Raised by the alarm; a BaseException so no ``except Exception`` in the code swallows it."""


@contextlib.contextmanager
def time_limit(seconds: float, what: str) -> Iterator[None]:
    """Fail with :class:`TimeLimitExceeded` if the block runs longer than ``seconds``.

    SIGALRM is pytest-timeout's too: its timer is put back, minus the time spent here.
    """

    def expired(signum: int, frame: FrameType | None) -> None:
        raise TimeLimitExceeded(f"{what}: still running after {seconds} s")

    previous_handler = signal.signal(signal.SIGALRM, expired)
    previous_delay, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    started = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous_handler)
        if previous_delay:
            signal.setitimer(signal.ITIMER_REAL, max(0.001, previous_delay - (time.monotonic() - started)))


class AbortedError(Exception):
    """What :class:`AbortingContext` raises in place of gRPC's abort."""

    def __init__(self, code: Any, details: str) -> None:
        super().__init__(f"{code}: {details}")
        self.code = code
        self.details = details


class AbortingContext:
    """Enough of a ``ServicerContext`` for the handler."""

    async def abort(self, code: Any, details: str) -> None:
        raise AbortedError(code, details)


def drive(coroutine: Coroutine[Any, Any, Any]) -> Any:
    """Run a coroutine that never suspends (the handler on the memory backend) to its end."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    coroutine.close()
    raise AssertionError("the handler suspended; the memory backend never should")


def call(service: RateLimitService, request: Any) -> tuple[Any, AbortedError | None]:
    """``(response, None)`` or ``(None, abort)``; any other exception propagates."""
    try:
        return drive(service.ShouldRateLimit(request, AbortingContext())), None
    except AbortedError as abort:
        return None, abort


def check_response(request: Any, response: Any) -> None:
    """The invariants of every answer: one status per descriptor, codes and numbers in range."""
    parsed = rls_pb2.RateLimitResponse.FromString(response.SerializeToString())
    assert parsed.overall_code in (OK, OVER_LIMIT)
    assert len(parsed.statuses) == len(request.descriptors)
    for status in parsed.statuses:
        assert status.code in (OK, OVER_LIMIT)
        assert 0 <= status.limit_remaining <= UINT32_MAX
        if status.HasField("current_limit"):
            assert status.current_limit.unit in KNOWN_UNITS
            assert status.limit_remaining <= status.current_limit.requests_per_unit
        if status.HasField("duration_until_reset"):
            assert 1 <= status.duration_until_reset.seconds <= LONGEST_WINDOW
    if parsed.overall_code == OVER_LIMIT:
        assert any(status.code == OVER_LIMIT for status in parsed.statuses)


@functools.cache
def fuzz_config() -> RateLimitConfig:
    """``examples/config`` plus :data:`FUZZ_RULES` (immutable, so loaded once)."""
    example = load_config(EXAMPLES)
    domain, issues = parse_text(FUZZ_RULES, "fuzz.yaml")
    assert domain is not None, issues
    return RateLimitConfig({**example.domains, domain.name: domain}, (*example.files, "fuzz.yaml"), "fuzz")


class SteppingClock:
    """A clock the test moves: ``clock()`` returns ``clock.now``."""

    def __init__(self, now: float = 1_700_000_000.25) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_service(
    config: RateLimitConfig, max_counters: int = 1000, clock: SteppingClock | None = None
) -> tuple[RateLimitService, MemoryLimiter]:
    limiter = MemoryLimiter(max_counters=max_counters)
    return RateLimitService(config, limiter, clock=clock or SteppingClock()), limiter


HELPERS = SimpleNamespace(
    time_limit=time_limit,
    call=call,
    check_response=check_response,
    fuzz_config=fuzz_config,
    make_service=make_service,
    SteppingClock=SteppingClock,
)


@pytest.fixture(scope="session")
def fz() -> SimpleNamespace:
    """The helpers above: ``fz.call(service, request)``, ``fz.time_limit(5, "load")``, ..."""
    return HELPERS
