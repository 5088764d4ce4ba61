"""The ``json-input`` reliability area (issue 20): the gRPC path's bad input, as bodies to ``POST /json``."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest import reliability
from loadtest.reliability_harness import Context, json_input
from sidecar.service.json_api import MAX_BODY_BYTES


def test_the_area_is_registered_and_its_cap_is_the_endpoints() -> None:
    assert reliability.AREAS["json-input"] == json_input.__name__
    assert json_input.MAX_BODY_BYTES == MAX_BODY_BYTES


def test_the_oracle_refuses_wrong_answers() -> None:
    valid = b'{"domain": "demo", "descriptors": [{"entries": [{"key": "k", "value": "v"}]}]}'
    broken = b'{"domain": "", "descriptors": [{"entries": [{"key": "k", "value": "v"}]}]}'
    refusal = b'{"code": "INVALID_ARGUMENT", "message": "domain: must not be empty"}'
    answer = b'{"overallCode": "OK", "statuses": [{"code": "OK"}]}'
    assert json_input.body_problem(valid, 200, answer) is None
    assert json_input.body_problem(valid, 429, answer) is not None  # 429 for an OK answer
    assert json_input.body_problem(valid, 400, refusal) is not None  # a valid request refused
    assert json_input.body_problem(broken, 400, refusal) is None
    assert json_input.body_problem(broken, 200, answer) is not None
    assert json_input.body_problem(b"\xff{", 400, b'{"code": "INVALID_ARGUMENT", "message": "request: x"}') is None
    assert json_input.body_problem(b"\xff{", 500, b"") is not None
    assert json_input.body_problem(b" " * (MAX_BODY_BYTES + 1), json_input.RESET, b"") is None
    assert json_input.body_problem(valid, json_input.RESET, b"") is not None


@pytest.mark.slow
def test_every_hostile_body_gets_its_answer_and_the_sidecar_survives(tmp_path: Path) -> None:
    (row,) = json_input.run(Context(tmp_path, quick=True))
    assert row.ok, row.notes
    figures = row.figures
    assert figures["bodies"] == row.inputs == 1_500
    # Every kind of answer really happened: decisions, refusals of junk and of the cap.
    assert figures["answered_200"] > 50 and figures["refused_400"] > 500, row.notes
    assert figures["refused_413"] + figures["reset"] > 50, row.notes
