"""Helpers for the fuzz tests, offered as one session fixture, ``fz``.

The inputs, the in-process handler and the invariants are those of the reliability
report's bad-input scenario, ``loadtest/reliability_harness/hostile.py`` (importable
here: this file puts ``loadtest/`` on ``sys.path``); the tests draw with Hypothesis
what that scenario draws with a seeded ``random``.

The handler is driven without an event loop: with the memory backend nothing it
awaits ever suspends, so one ``send(None)`` runs a call to its end and a fuzz case
costs microseconds. Loads and calls run under ``time_limit``, so a hang fails
the test with the input that caused it instead of stalling the run.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

LOADTEST = Path(__file__).resolve().parents[2] / "loadtest"
if str(LOADTEST) not in sys.path:
    sys.path.insert(0, str(LOADTEST))

from reliability_harness import hostile  # noqa: E402


def check_response(request: Any, response: Any) -> None:
    """The invariants of every answer: one status per descriptor, codes and numbers in range."""
    problems = list(hostile.response_problems(request, response))
    assert not problems, problems


HELPERS = SimpleNamespace(
    time_limit=hostile.time_limit,
    call=hostile.call,
    check_response=check_response,
    fuzz_config=hostile.fuzz_config,
    make_service=hostile.make_service,
    SteppingClock=hostile.SteppingClock,
)


@pytest.fixture(scope="session")
def fz() -> SimpleNamespace:
    """The helpers above: ``fz.call(service, request)``, ``fz.time_limit(5, "load")``, ..."""
    return HELPERS
