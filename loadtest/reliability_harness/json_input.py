"""Bad input to ``POST /json`` (issue 20): the gRPC path's attacks, as HTTP bodies, at a real sidecar.

    python -m loadtest.reliability_harness.json_input [--full]
    python -m loadtest.reliability --areas json-input

One row, the ``raw bytes to gRPC`` row of ``bad_input.py`` for the JSON listener: a real
``python -m sidecar serve --json-address`` on ``examples/config``, sent (over keep-alive
connections, 8 at a time) the same hostile requests of
:mod:`~loadtest.reliability_harness.hostile_requests`, each way they can reach a JSON
endpoint:

* ``RateLimitRequest`` messages (random and wild: giant and empty strings, any unicode,
  0 to 1000 descriptors, every unit number, hits at the uint32/uint64 bounds) in
  protobuf's JSON mapping;
* those JSON bodies mutated byte by byte (flips, inserts, cuts, truncation, repeats);
* invalid UTF-8 in a string field of the JSON text;
* the raw wire payloads the gRPC method gets (random bytes, serialized and mutated
  messages, the hand-made specials, one over 1 MiB), which are no JSON at all;
* JSON of its own: deep nesting, NaN and huge numbers, lone surrogates, duplicate and
  unknown fields, other top-level types, UTF-16 and a BOM.

The oracle decides each body's answer independently of the endpoint's code: over the
64 KiB cap, 413 (or the connection reset as the sidecar closes it unread); a body that
``json.loads`` + ``json_format.ParseDict`` cannot turn into a ``RateLimitRequest``, 400
``INVALID_ARGUMENT`` ``request: ...``; a request breaking a README bound
(:func:`~loadtest.reliability_harness.bounds_oracle.bound_broken`), 400 naming the part at
fault; any other, 200 or 429 as its ``overallCode`` says, with a response that passes
:func:`~loadtest.reliability_harness.bounds_oracle.response_problems`. The process must stay
up (gRPC SERVING, ``/healthcheck`` 200), log no exception, count no internal error, and grow
its RSS by less than :data:`~loadtest.reliability_harness.hostile_requests.RSS_GROWTH_LIMIT`.
"""

from __future__ import annotations

import http.client
import json
import random
import threading
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

from google.protobuf import json_format

from loadtest.reliability_harness.bad_input import Tally, flood_verdict, warm_then_flood
from loadtest.reliability_harness.bounds_oracle import REFUSAL_DETAILS, bound_broken, response_problems
from loadtest.reliability_harness.hostile_requests import (
    INVALID_UTF8,
    PLACEHOLDER,
    STRING_FIELDS,
    mutate,
    random_edits,
    random_request,
    raw_payloads,
)
from loadtest.reliability_harness.support import (
    Child,
    Context,
    Row,
    failed_row,
    free_port,
    main,
    process_group,
    start_sidecar,
)
from sidecar.config.model import MAX_DESCRIPTORS, MAX_ENTRIES
from sidecar.protos.envoy.service.ratelimit.v3 import rls_pb2

AREA = "bad input"
SCENARIO = "hostile bodies to POST /json"
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "config"
MAX_BODY_BYTES = 64 * 1024
"""The endpoint's documented body cap (``sidecar.service.json_api.MAX_BODY_BYTES``), restated."""
CONNECTIONS = 8
RESET = "reset"
"""The outcome of an oversized body whose connection the sidecar closed before the client read the 413."""


def json_specials() -> list[bytes]:
    """Bodies only a JSON parser meets: nesting, numbers, escapes, encodings, shapes."""
    entry = '{"descriptors": [{"entries": [{"key": "k", "value": "v"}]}], "domain": "demo"'
    return [
        b"[" * 100_000 + b"]" * 100_000,  # deep nesting, over the cap
        b"[" * 30_000,  # deep nesting under the cap: RecursionError in the parser
        b'{"a":' * 10_000 + b"1" + b"}" * 10_000,
        b"null",
        b"[]",
        b'"demo"',
        b"1e400",
        b"NaN",
        (entry + ', "hitsAddend": NaN}').encode(),
        (entry + ', "hitsAddend": 1e400}').encode(),
        (entry + ', "hitsAddend": -1}').encode(),
        (entry + ', "hitsAddend": 1.5}').encode(),
        (entry + ', "hitsAddend": "4294967296"}').encode(),
        (entry + ', "hitsAddend": 4294967295}').encode(),
        (entry + ', "hitsAddend": ' + "9" * 5000 + "}").encode(),
        (entry + ', "domain": "other"}').encode(),  # a duplicate key: the last one wins
        (entry + ', "unknownField": 1}').encode(),
        (entry + ', "hits_addend": 2, "hitsAddend": 3}').encode(),  # both spellings of one field
        entry.replace('"v"', '"\\ud800"').encode() + b"}",  # a lone surrogate, escaped
        entry.replace('"v"', '"\\u0000"').encode() + b"}",
        entry.replace('"demo"', '"\\ud83d\\ude00"').encode() + b"}",
        ("\ufeff" + entry + "}").encode(),  # a byte order mark
        (entry + "}").encode("utf-16"),
        (entry + "}").encode("utf-32-le"),
        (entry + "}" + " " * 60_000).encode(),  # whitespace up to the cap
        (entry + "} trailing").encode(),
        entry.replace('"descriptors"', '"descriptors": {}, "x"').encode() + b"}",
        b'{"domain": "demo", "descriptors": [{"entries": [{"key": "k", "value": "v"}], "limit": '
        b'{"requestsPerUnit": 5, "unit": "FORTNIGHT"}}]}',
        b'{"domain": "demo", "descriptors": [{"entries": [{"key": "k", "value": "v"}], "limit": '
        b'{"requestsPerUnit": 5, "unit": 99}}]}',
        b'{"domain": "demo", "descriptors": [{"entries": [{"key": "k", "value": "v"}], "hitsAddend": '
        b'"18446744073709551615"}]}',
        b'{"domain": "demo", "descriptors": [{"entries": [{"key": "k", "value": "v"}], "hitsAddend": '
        b'"18446744073709551616"}]}',
    ]


def as_json(request: Any) -> bytes:
    return json_format.MessageToJson(request, indent=None).encode()


def json_with_invalid_utf8(rng: random.Random, request: Any) -> bytes:
    """``request`` as JSON with invalid UTF-8 bytes in the domain or in a key or value."""
    field = rng.choice(STRING_FIELDS)
    entries = [entry for descriptor in request.descriptors for entry in descriptor.entries]
    if field == "domain" or not entries:
        request.domain = PLACEHOLDER
    else:
        setattr(rng.choice(entries), field, PLACEHOLDER)
    return as_json(request).replace(PLACEHOLDER.encode(), rng.choice(INVALID_UTF8) + b"x", 1)


def bodies(seed: int, count: int) -> Iterator[bytes]:
    """``count`` bodies: the JSON specials, then messages as JSON, mutated JSON, invalid UTF-8
    in JSON and the gRPC path's raw payloads in turn (its specials first)."""
    rng = random.Random(seed)
    specials = json_specials()
    yield from specials[:count]
    raw = raw_payloads(seed, count)
    for index in range(max(0, count - len(specials))):
        kind = index % 4
        if kind == 0:
            yield as_json(random_request(rng))
        elif kind == 1:
            yield mutate(as_json(random_request(rng, wild=False)), random_edits(rng))
        elif kind == 2:
            yield json_with_invalid_utf8(rng, random_request(rng))
        else:
            yield next(raw, b"")


def parsed(body: bytes) -> Any | None:
    """The ``RateLimitRequest`` a JSON endpoint can read from ``body``, or None."""
    request = rls_pb2.RateLimitRequest()
    try:
        value = json.loads(body)
        if not isinstance(value, dict):
            return None
        json_format.ParseDict(value, request)
    except Exception:  # whatever the parser raises, the body is not a request
        return None
    return request


def body_problem(body: bytes, status: int | str, answer: bytes) -> str | None:
    """What is wrong with how ``body`` was answered, or None (see the module docstring)."""
    if len(body) > MAX_BODY_BYTES:
        return None if status in (413, RESET) else f"{status} for a {len(body)}-byte body (cap {MAX_BODY_BYTES})"
    if status == RESET:
        return "connection reset"
    request = parsed(body)
    if status == 400:
        return refusal_problem(request, answer, body)
    if request is None or bound_broken(request):
        return f"{status} for a body that is no valid RateLimitRequest"
    return answer_problem(request, status, answer)


def refusal_problem(request: Any | None, answer: bytes, body: bytes = b"") -> str | None:
    """A 400 must be ``INVALID_ARGUMENT``: ``request: ...`` for no request, else naming a broken bound.
    A body too large to parse (over the descriptor or entry count) is refused from its JSON
    before protobuf parses it (issue 25), so it may name that bound even if it is no request."""
    try:
        error = json.loads(answer)
    except ValueError:
        return f"400 with a body that is no JSON: {answer[:80]!r}"
    message = str(error.get("message", "")) if isinstance(error, dict) else ""
    if not isinstance(error, dict) or error.get("code") != "INVALID_ARGUMENT" or not REFUSAL_DETAILS.match(message):
        problem: str | None = f"400 {error}"
    elif request is None:
        accepted = message.startswith("request: ") or too_large_to_parse(body)
        problem = None if accepted else f"no request, refused as {error}"
    else:
        problem = None if bound_broken(request) else f"a valid request was refused: {message}"
    return problem


def too_large_to_parse(body: bytes) -> bool:
    """Whether ``body`` decodes to more descriptors, or entries in one, than a request may have."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return False
    descriptors = value.get("descriptors") if isinstance(value, dict) else None
    if not isinstance(descriptors, list):
        return False
    entries = [d.get("entries") for d in descriptors if isinstance(d, dict)]
    return len(descriptors) > MAX_DESCRIPTORS or any(isinstance(e, list) and len(e) > MAX_ENTRIES for e in entries)


def answer_problem(request: Any, status: int | str, answer: bytes) -> str | None:
    """A valid request must get 200 or 429 as its ``overallCode`` says, with a sound response."""
    if status not in (200, 429):
        return f"status {status}: {answer[:200]!r}"
    try:
        response = json_format.Parse(answer, rls_pb2.RateLimitResponse())
    except Exception as error:  # reported as the problem
        return f"an answer that is no RateLimitResponse: {error}"
    if (status == 429) != (response.overall_code == rls_pb2.RateLimitResponse.OVER_LIMIT):
        return f"status {status} for overallCode {response.overall_code}"
    return next(response_problems(request, response.SerializeToString()), None)


def post(connection: http.client.HTTPConnection, body: bytes) -> tuple[int | str, bytes]:
    """One ``POST /json``; a connection the sidecar closed is opened again on the next call."""
    try:
        connection.request("POST", "/json", body=body, headers={"content-type": "application/json"})
        reply = connection.getresponse()
        return reply.status, reply.read()
    except (ConnectionError, http.client.HTTPException, OSError):
        connection.close()
        return RESET, b""


def send_all(port: int, payloads: Iterator[bytes], tally: Tally) -> None:
    """Every body through :data:`CONNECTIONS` keep-alive connections, each checked by :func:`body_problem`."""
    lock = threading.Lock()

    def lane() -> None:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            while True:
                with lock:
                    body = next(payloads, None)
                if body is None:
                    return
                status, answer = post(connection, body)
                problem = body_problem(body, status, answer)
                with lock:
                    tally.cases += 1
                    tally.outcomes[str(status)] += 1
                    if problem is not None:
                        tally.violation(f"{len(body)} bytes {body[:40]!r}: {problem}")
        finally:
            connection.close()

    lanes = [threading.Thread(target=lane, name=f"json-lane-{index}") for index in range(CONNECTIONS)]
    for thread in lanes:
        thread.start()
    for thread in lanes:
        thread.join()


def healthcheck(port: int) -> int:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        connection.request("GET", "/healthcheck")
        return connection.getresponse().status
    except OSError:
        return 0
    finally:
        connection.close()


def hostile_bodies(context: Context) -> Row:
    """The hostile bodies to a real sidecar's ``POST /json``."""

    count = 1_500 if context.quick else 12_000
    where = context.directory / "json-input"
    where.mkdir(parents=True, exist_ok=True)
    children: list[Child] = []
    with process_group() as group:
        try:
            json_port = free_port()
            args = [
                *("--config", str(EXAMPLES), "--watch-config", "false", "--max-counters", "10000"),
                *("--json-address", f"127.0.0.1:{json_port}"),
            ]
            sidecar = start_sidecar(group, context, "sidecar", args, where)
            children.append(sidecar)
            flood = warm_then_flood(sidecar, partial(send_all, json_port), bodies, context.seed, count)
            health = healthcheck(json_port) if flood.after.alive else 0
            logged = flood.after.exceptions + sidecar.log_text().count("json_request_failed")
            flood = flood._replace(after=flood.after._replace(exceptions=logged))
        except Exception as error:
            return failed_row(AREA, SCENARIO, error, children)
    ok, notes, common = flood_verdict("bodies", flood, checks=[(health == 200, f"/healthcheck {health}")])
    tally = flood.tally
    figures = {
        "bodies": float(tally.cases),
        "answered_200": float(tally.outcomes["200"]),
        "answered_429": float(tally.outcomes["429"]),
        "refused_400": float(tally.outcomes["400"]),
        "refused_413": float(tally.outcomes["413"]),
        "reset": float(tally.outcomes[RESET]),
        **common,
    }
    return Row(AREA, SCENARIO, inputs=tally.cases, ok=ok, notes=notes, figures=figures)


def run(context: Context) -> list[Row]:
    try:
        return [hostile_bodies(context)]
    except Exception as error:
        return [failed_row(AREA, SCENARIO, error)]


if __name__ == "__main__":
    raise SystemExit(main(run))
