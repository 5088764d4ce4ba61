"""The fuzz config and the handler driven in-process, without an event loop.

:func:`make_service` builds ``RateLimitService`` on the memory backend for a config
(:func:`fuzz_config`: ``examples/config`` plus :data:`FUZZ_RULES`, every feature once);
:func:`call` runs one call to its end with one ``send(None)`` (nothing awaited on the
memory backend ever suspends), so a case costs microseconds; :func:`time_limit` bounds a
block, so a hang fails with its input. Shared by ``bad_input.py`` and ``tests/fuzz``.

``sidecar`` is imported inside the functions, so importing this module stays cheap.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import threading
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "config"

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


@functools.cache
def fuzz_config() -> Any:
    """``examples/config`` plus :data:`FUZZ_RULES` (immutable, so loaded once)."""
    from sidecar.config.load import load_config, parse_text
    from sidecar.config.model import RateLimitConfig

    example = load_config(EXAMPLES)
    domain, issues = parse_text(FUZZ_RULES, "fuzz.yaml")
    if domain is None:
        raise RuntimeError(f"the fuzz rules do not load: {issues}")
    return RateLimitConfig({**example.domains, domain.name: domain}, (*example.files, "fuzz.yaml"), "fuzz")


class SteppingClock:
    """A clock the caller moves: ``clock()`` returns ``clock.now``."""

    def __init__(self, now: float = 1_700_000_000.25) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_service(config: Any, max_counters: int = 1000, clock: SteppingClock | None = None) -> tuple[Any, Any]:
    """``(RateLimitService, MemoryLimiter)`` for ``config``."""
    from sidecar.limiter.memory import MemoryLimiter
    from sidecar.service.servicer import RateLimitService

    limiter = MemoryLimiter(max_counters=max_counters)
    return RateLimitService(config, limiter, clock=clock or SteppingClock()), limiter


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
    """Run a coroutine that never suspends (the handler on the memory backend) to its end:
    one ``send(None)``, so a call costs microseconds and needs no event loop."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    coroutine.close()
    raise RuntimeError("the handler suspended; on the memory backend it never should")


def call(service: Any, request: Any) -> tuple[Any, AbortedError | None]:
    """``(response, None)`` or ``(None, abort)``; any other exception propagates."""
    try:
        return drive(service.ShouldRateLimit(request, AbortingContext())), None
    except AbortedError as abort:
        return None, abort


class TimeLimitExceeded(BaseException):
    """Raised by :func:`time_limit`; a BaseException so no ``except Exception`` in the code under test swallows it."""


@contextlib.contextmanager
def time_limit(seconds: float, what: str) -> Iterator[None]:
    """Raise :class:`TimeLimitExceeded` in the block once it runs longer than ``seconds``.

    SIGALRM, so in the main thread only (elsewhere the block runs unbounded). A timer
    already set (pytest-timeout's) is put back, minus the time spent here.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

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
