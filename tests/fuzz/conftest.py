"""Helpers for the fuzz tests, offered as one session fixture, ``fz``.

The inputs, the in-process handler and the invariants are those of the reliability
report's bad-input scenario: the handler in ``loadtest/reliability_harness/in_process.py``,
the request-bounds oracle in ``loadtest/reliability_harness/bounds_oracle.py``; the tests
draw with Hypothesis what that scenario draws with a seeded ``random``.

The handler is driven without an event loop: with the memory backend nothing it
awaits ever suspends, so one ``send(None)`` runs a call to its end and a fuzz case
costs microseconds. Loads and calls run under ``time_limit``, so a hang fails
the test with the input that caused it instead of stalling the run.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from loadtest.reliability_harness import bounds_oracle, in_process


def check_response(request: Any, response: Any) -> None:
    """The invariants of every answer: one status per descriptor, codes and numbers in range."""
    problems = list(bounds_oracle.response_problems(request, response))
    assert not problems, problems


HELPERS = SimpleNamespace(
    time_limit=in_process.time_limit,
    call=in_process.call,
    check_response=check_response,
    fuzz_config=in_process.fuzz_config,
    make_service=in_process.make_service,
    SteppingClock=in_process.SteppingClock,
)


@pytest.fixture(scope="session")
def fz() -> SimpleNamespace:
    """The helpers above: ``fz.call(service, request)``, ``fz.time_limit(5, "load")``, ..."""
    return HELPERS
