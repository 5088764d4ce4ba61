"""POST /json: ShouldRateLimit as JSON, through the same request path as gRPC.

In-process tests drive :func:`decide_json` and :class:`JsonEndpoint` on a memory service;
the process tests start a real sidecar with ``--json-address`` and ask it over HTTP and
gRPC side by side. The bad-input cases are the gRPC tests' own (``INVALID`` of the
validation tests, ``BAD_REQUESTS`` of the gRPC service tests), so both paths answer
every one of them with the same message.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import uuid
from typing import Any

import pytest
from google.protobuf import json_format

from sidecar.service.json_api import MAX_BODY_BYTES, JsonEndpoint, decide_json
from sidecar.service.validate import request_problem
from tests.sidecar.service.test_grpc_service import BAD_REQUESTS
from tests.sidecar.service.test_validate import INVALID
from tests.support.sidecars import OK, OVER_LIMIT, Sidecar, SidecarFactory, clean_env, free_port, request

RULES = """
    domain: api
    descriptors:
      - key: client
        rate_limit:
          unit: minute
          requests_per_unit: 2
"""


def body_of(message: Any) -> bytes:
    return json_format.MessageToJson(message).encode()


async def test_admitted_then_over_limit_like_the_reference(h, clock):
    service = h.memory_service(RULES, clock)
    request_json = b'{"domain": "api", "descriptors": [{"entries": [{"key": "client", "value": "a"}]}]}'
    first = await decide_json(service, request_json)
    assert first.status == 200
    answer = json.loads(first.body)
    assert answer["overallCode"] == "OK"
    status = answer["statuses"][0]
    assert status["code"] == "OK"
    assert status["currentLimit"] == {"requestsPerUnit": 2, "unit": "MINUTE"}
    assert status["limitRemaining"] == 1
    assert status["durationUntilReset"] == "30s"  # the clock stands 30 s into a minute
    await decide_json(service, request_json)
    refused = await decide_json(service, request_json)
    assert refused.status == 429  # envoyproxy/ratelimit: 429 with the full response as the body
    assert json.loads(refused.body)["overallCode"] == "OVER_LIMIT"
    assert service.stats.requests == 3
    assert service.stats.over_limit_requests == 1


async def test_proto_field_names_are_accepted_too(h, clock):
    service = h.memory_service(RULES, clock)
    body = b'{"domain": "api", "hits_addend": 2, "descriptors": [{"entries": [{"key": "client", "value": "b"}]}]}'
    answer = await decide_json(service, body)
    assert answer.status == 200
    assert "limitRemaining" not in json.loads(answer.body)["statuses"][0]  # 2 of 2 spent: 0, a default


async def test_the_answer_is_the_grpc_answer_in_json(h, clock):
    service = h.memory_service(RULES, clock)
    other = h.memory_service(RULES, clock)
    built = h.rate_request("api", h.descriptor(("client", "c")), h.descriptor(("nothing", "x")))
    by_grpc = await service.decide(built)
    by_json = await decide_json(other, body_of(built))
    assert json.loads(by_json.body) == json.loads(json_format.MessageToJson(by_grpc))


@pytest.mark.parametrize(("build", "message"), list(INVALID.values()), ids=list(INVALID))
async def test_bad_requests_get_the_grpc_message(h, clock, build, message):
    service = h.memory_service(RULES, clock)
    built = build(h)
    assert request_problem(built) == message
    answer = await decide_json(service, body_of(built))
    assert answer.status == 400
    assert json.loads(answer.body) == {"code": "INVALID_ARGUMENT", "message": message}
    assert service.stats.errors["invalid_argument"] == 1


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"", "Expecting value"),
        (b"not json", "Expecting value"),
        (b"[1, 2]", "JSON object"),
        (b'{"domain": "api", "surprise": 1}', "surprise"),
        (b'{"domain": 5}', "domain"),
        (b'{"domain": "\xff\xfe"}', "decode"),
        (b"[" * 5000 + b"]" * 5000, ""),
        (b'{"domain": "api", "descriptors": [{"entries": [{"key": "k"}], "limit": {"unit": "FORTNIGHT"}}]}', "unit"),
    ],
    ids=["empty", "text", "array", "unknown-field", "wrong-type", "bad-utf8", "deep", "unknown-enum"],
)
async def test_bodies_that_are_not_a_request(h, clock, body, reason):
    service = h.memory_service(RULES, clock)
    answer = await decide_json(service, body)
    assert answer.status == 400
    refusal = json.loads(answer.body)
    assert refusal["code"] == "INVALID_ARGUMENT"
    assert refusal["message"].startswith("request: not a valid RateLimitRequest message: ")
    assert reason in refusal["message"]
    assert len(refusal["message"]) < 300
    assert service.stats.errors["undecodable"] == 1


async def test_internal_fault_is_500(h, clock):
    service = h.memory_service(RULES, clock)

    async def broken(checks: Any, now: float) -> Any:
        raise RuntimeError("boom")

    service.limiter.check = broken
    answer = await decide_json(service, b'{"domain": "api", "descriptors": [{"entries": [{"key": "client"}]}]}')
    assert answer.status == 500
    assert json.loads(answer.body)["code"] == "INTERNAL"


# ---------------------------------------------------------------------------- the listener, in process


async def raw_exchange(port: int, data: bytes, read_until_close: bool = True) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    got = await asyncio.wait_for(reader.read(), 5) if read_until_close else b""
    writer.close()
    return got


def post(body: bytes, extra: str = "", path: str = "/json") -> bytes:
    return f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\n{extra}\r\n".encode() + body


async def test_listener_keeps_alive_and_refuses_what_a_careful_server_refuses(h, clock):
    endpoint = JsonEndpoint(h.memory_service(RULES, clock), read_timeout=0.3, idle_timeout=0.5, max_connections=2)
    await endpoint.start("127.0.0.1:0")
    try:
        good = b'{"domain": "api", "descriptors": [{"entries": [{"key": "client", "value": "k"}]}]}'
        reader, writer = await asyncio.open_connection("127.0.0.1", endpoint.port)
        for expected in (b"200 OK", b"200 OK", b"429 Too Many Requests"):  # three on one connection
            writer.write(post(good))
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 " + expected), head
            length = int(head.split(b"content-length: ")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
        # Idle past idle_timeout: the server closes the connection.
        assert await asyncio.wait_for(reader.read(), 2) == b""
        writer.close()

        cases = {
            post(b"{}", "expect: 100-continue\r\n"): b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 400",
            post(b"x" * (MAX_BODY_BYTES + 1)): b"HTTP/1.1 413",
            b"POST /json HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n": b"HTTP/1.1 411",
            b"POST /json HTTP/1.1\r\nhost: x\r\n\r\n": b"HTTP/1.1 411",
            b"POST /json HTTP/1.1\r\nhost: x\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n{": b"HTTP/1.1 400",
            b"GET /json HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n": b"HTTP/1.1 405",
            post(good, "connection: close\r\n", path="/other"): b"HTTP/1.1 404",
            b"POST /json HTTP/1.1\r\nx: " + b"y" * 9000 + b"\r\n\r\n": b"HTTP/1.1 400",
            b"BREW /json\r\n\r\n": b"HTTP/1.1 400",
            b"POST /json HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\n{": b"HTTP/1.1 408",  # the body never comes
        }
        for sent, expected in cases.items():
            got = await raw_exchange(endpoint.port, sent)
            assert got.startswith(expected), (sent[:60], got[:200])

        # The connection cap: two held open, the third gets 503 at once.
        held = [await asyncio.open_connection("127.0.0.1", endpoint.port) for _ in range(2)]
        await asyncio.sleep(0.05)
        assert (await raw_exchange(endpoint.port, b"")).startswith(b"HTTP/1.1 503")
        assert endpoint.refused_connections == 1
        for _, held_writer in held:
            held_writer.close()
    finally:
        await endpoint.close()


# ---------------------------------------------------------------------------- a real sidecar process


@pytest.fixture(scope="module")
def json_sidecar(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from tests.support.sidecars import sidecar_factory, write_config

    config = write_config(tmp_path_factory.mktemp("json-config"))
    port = free_port()
    with sidecar_factory(tmp_path_factory.mktemp("json")) as start:
        sidecar = start("--json-address", f"127.0.0.1:{port}", config=config)
        sidecar.json_port = port  # type: ignore[attr-defined]
        yield sidecar


def http_post(port: int, body: bytes) -> tuple[int, dict[str, Any]]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        connection.request("POST", "/json", body=body, headers={"content-type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


@pytest.mark.slow
def test_process_answers_json_as_it_answers_grpc(json_sidecar: Sidecar) -> None:
    value = uuid.uuid4().hex
    statuses = [http_post(json_sidecar.json_port, body_of(request("it", [("pair_b", value)]))) for _ in range(2)]
    assert [status for status, _ in statuses] == [200, 200]
    by_grpc = json_sidecar.ask(request("it", [("pair_b", value)]))  # the third hit of 2 per minute
    assert by_grpc.overall_code == OVER_LIMIT
    status, refused = http_post(json_sidecar.json_port, body_of(request("it", [("pair_b", value)])))
    assert status == 429
    assert refused["overallCode"] == "OVER_LIMIT"
    assert refused["statuses"][0]["currentLimit"] == {"requestsPerUnit": 2, "unit": "MINUTE"}
    assert json_sidecar.ask(request("it", [("pair_a", value)])).overall_code == OK


@pytest.mark.slow
@pytest.mark.parametrize(("bad", "message"), BAD_REQUESTS)
def test_process_bad_requests_name_the_part_as_grpc_does(json_sidecar: Sidecar, bad: Any, message: str) -> None:
    status, refusal = http_post(json_sidecar.json_port, body_of(bad))
    assert status == 400
    assert refusal["code"] == "INVALID_ARGUMENT"
    assert refusal["message"].startswith(message)


@pytest.mark.slow
def test_json_address_off_by_default_and_refused_when_taken(start_sidecar: SidecarFactory, tmp_path) -> None:
    from tests.support.sidecars import run_cli, write_config

    config = write_config(tmp_path / "config")
    sidecar = start_sidecar(config=config)
    assert '"json_address": null' in sidecar.stderr()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_cli(
            "serve", "--config", str(config), "--grpc-address", f"127.0.0.1:{free_port()}",
            "--json-address", f"127.0.0.1:{port}", env=clean_env(),
        )  # fmt: skip
    assert result.returncode != 0
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr


# ---------------------------------------------------------------------------- issue 25: bounds before parsing


class ParseSpy:
    """Records what ``json_format.ParseDict`` is handed, and the yields to the loop between."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from sidecar.service import json_api

        self.calls: list[Any] = []
        self.entries_between_yields: list[int] = [0]
        real_parse, real_sleep = json_format.ParseDict, asyncio.sleep

        def parse(value: Any, message: Any, *args: Any, **kwargs: Any) -> Any:
            self.calls.append(value)
            found = [value] if "entries" in value else value.get("descriptors", [])
            self.entries_between_yields[-1] += sum(len(d.get("entries", [])) for d in found if isinstance(d, dict))
            return real_parse(value, message, *args, **kwargs)

        async def sleep(delay: float) -> None:
            self.entries_between_yields.append(0)
            await real_sleep(delay)

        monkeypatch.setattr(json_format, "ParseDict", parse)
        monkeypatch.setattr(json_api.asyncio, "sleep", sleep)

    def descriptors_parsed(self) -> int:
        return sum(("entries" in value) + len(value.get("descriptors", [])) for value in self.calls)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"domain": "api", "descriptors": [{}] * 21_000}, "descriptors: more than 64 descriptors"),
        ({"domain": "", "descriptors": [{}] * 21_000}, "domain: must not be empty"),
        (
            {"domain": "api", "descriptors": [{"entries": [{"key": "k"}] * 5_000}]},
            "descriptors[0].entries: more than 32 entries",
        ),
    ],
    ids=["21000-descriptors", "empty-domain-first", "5000-entries"],
)
async def test_bounds_are_checked_before_protobuf_parses_the_body(h, clock, monkeypatch, value, message):
    """Defect 4: 21,000 empty descriptors (63 KB) took 130-170 ms in ParseDict before the bounds refused them."""
    service = h.memory_service(RULES, clock)
    body = json.dumps(value, separators=(",", ":")).encode()
    assert len(body) <= MAX_BODY_BYTES
    spy = ParseSpy(monkeypatch)
    answer = await decide_json(service, body)
    assert (answer.status, json.loads(answer.body)) == (400, {"code": "INVALID_ARGUMENT", "message": message})
    assert spy.descriptors_parsed() <= 1, "an over-bound body reached protobuf"
    assert sum(spy.entries_between_yields) <= 1, "an over-bound descriptor reached protobuf"
    assert service.stats.errors["invalid_argument"] == 1


async def test_a_request_at_the_bounds_is_parsed_in_chunks_between_loop_turns(h, clock, monkeypatch):
    """64 descriptors of 32 entries (what the bounds admit) are parsed a few hundred entries per loop turn."""
    from sidecar.service.json_api import PARSE_CHUNK_ENTRIES

    service = h.memory_service(RULES, clock)
    value = {
        "domain": "api",
        "descriptors": [{"entries": [{"key": f"k{j}", "value": str(i)} for j in range(32)]} for i in range(64)],
    }
    spy = ParseSpy(monkeypatch)
    answer = await decide_json(service, json.dumps(value).encode())
    assert answer.status == 200
    assert sum(spy.entries_between_yields) == 64 * 32
    assert max(spy.entries_between_yields) <= PARSE_CHUNK_ENTRIES + 32


async def test_a_bound_is_named_in_the_grpc_order_across_descriptors(h, clock):
    """An earlier descriptor's own fault (its unit) is named before a later one's oversize entry, as gRPC does."""
    service = h.memory_service(RULES, clock)
    value = {
        "domain": "api",
        "descriptors": [
            {"entries": [{"key": "k"}], "limit": {"requestsPerUnit": 1, "unit": 9}},
            {"entries": [{"key": "k"}] * 40},
        ],
    }
    answer = await decide_json(service, json.dumps(value).encode())
    assert json.loads(answer.body)["message"] == "descriptors[0].limit.unit: unknown unit 9"
