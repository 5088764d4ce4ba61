"""Issue 25: the two HTTP listeners (``/json`` and the admin endpoint) at the HTTP layer, over real sockets.

Malformed framing gets 400 (never a traceback and silence), ``HEAD`` answers carry no body
on a kept-alive connection, slow and non-reading clients and extra connections are
bounded, and ``/config`` renders off the event loop, once for concurrent GETs, capped in bytes.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from sidecar.admin import AdminEndpoint, SharedRender, config_json
from sidecar.config import load_config
from sidecar.http_server import (
    LARGE_ANSWER_RATE,
    MAX_PACE,
    Answer,
    Bounds,
    HttpServer,
    LargeAnswers,
    Request,
    rest_after,
)
from sidecar.service.json_api import JsonEndpoint, decide_json

RULES = """
    domain: api
    descriptors:
      - key: client
        rate_limit: {unit: minute, requests_per_unit: 2}
"""


@pytest.fixture
async def json_port(h: Any, clock: Any) -> AsyncIterator[int]:
    endpoint = JsonEndpoint(h.memory_service(RULES, clock), read_timeout=0.3, idle_timeout=2.0)
    await endpoint.start("127.0.0.1:0")
    yield endpoint.port
    await endpoint.close()


def document(calls: list[int] | None = None, gate: threading.Event | None = None) -> Any:
    def build() -> dict[str, Any]:
        if calls is not None:
            calls.append(threading.get_ident())
        if gate is not None:
            gate.wait(5)
        return {"sha256": "x", "domains": {}}

    return build


@pytest.fixture
async def admin() -> AsyncIterator[AdminEndpoint]:
    endpoint = AdminEndpoint(registry=CollectorRegistry(), config=document, serving=lambda: True)
    await endpoint.start("127.0.0.1:0")
    yield endpoint
    await endpoint.close()


async def exchange(port: int, data: bytes, wait: float = 5.0) -> bytes:
    """Send ``data``, read until the server closes (or ``wait`` passes)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    received = b""
    try:
        async with asyncio.timeout(wait):
            while chunk := await reader.read(65536):
                received += chunk
    except TimeoutError:
        pass
    writer.close()
    return received


@pytest.mark.parametrize(
    "length", [b"\xb2", b"9" * 5000, b"-1", b"1, 2"], ids=["superscript-two", "5000-digits", "negative", "list"]
)
async def test_a_bad_content_length_is_400_on_json(json_port: int, length: bytes) -> None:
    """Defect 13: ``Content-Length: ²`` (or 5,000 digits) got no answer and a logged traceback."""
    sent = b"POST /json HTTP/1.1\r\nhost: x\r\ncontent-length: " + length + b"\r\n\r\n{}"
    got = await exchange(json_port, sent)
    assert got.startswith(b"HTTP/1.1 400"), got[:100]


@pytest.mark.parametrize("length", [b"\xb2", b"9" * 5000])
async def test_a_bad_content_length_is_400_on_admin(admin: AdminEndpoint, length: bytes) -> None:
    got = await exchange(admin.port, b"GET /healthz HTTP/1.1\r\nhost: x\r\ncontent-length: " + length + b"\r\n\r\n")
    assert got.startswith(b"HTTP/1.1 400"), got[:100]


@pytest.mark.parametrize(
    ("path", "next_path"),
    [("/healthcheck", "/healthcheck"), ("/json", "/healthcheck")],
    ids=["healthcheck", "json-405"],
)
async def test_head_has_no_body_on_a_kept_alive_json_connection(json_port: int, path: str, next_path: str) -> None:
    """Defect 14: ``HEAD`` was answered with a body, which the next response on the connection was read from."""
    sent = f"HEAD {path} HTTP/1.1\r\nhost: x\r\n\r\nGET {next_path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
    got = await exchange(json_port, sent.encode())
    first_head, _, rest = got.partition(b"\r\n\r\n")
    assert first_head.startswith(b"HTTP/1.1 "), got[:100]
    assert b"content-length: " in first_head
    assert rest.startswith(b"HTTP/1.1 200"), f"bytes after the HEAD answer's head: {rest[:60]!r}"


@pytest.mark.parametrize("path", ["/healthz", "/config", "/metrics"])
async def test_head_has_no_body_on_a_kept_alive_admin_connection(admin: AdminEndpoint, path: str) -> None:
    sent = f"HEAD {path} HTTP/1.1\r\nhost: x\r\n\r\nGET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
    got = await exchange(admin.port, sent.encode())
    _, _, rest = got.partition(b"\r\n\r\n")
    assert rest.startswith(b"HTTP/1.1 200") and rest.endswith(b"SERVING\n"), rest[:80]


async def test_healthcheck_answers_ok_as_plain_text(json_port: int) -> None:
    """``/healthcheck`` says ``OK`` as the reference does, typed as what it is (it said JSON)."""
    got = await exchange(json_port, b"GET /healthcheck HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and body == b"OK", got[:200]
    assert b"content-type: text/plain" in head.lower(), head


async def test_a_trickling_request_head_is_cut_at_the_read_timeout(json_port: int) -> None:
    """Slowloris: a head sent a byte at a time never completes; the server answers 408 and closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", json_port)
    answer = b""
    for byte in b"POST /json HTTP/1.1\r\nhost: x\r\n" + b"x-pad: " + b"y" * 200:
        writer.write(bytes([byte]))
        try:
            answer = await asyncio.wait_for(reader.read(4096), 0.05)
        except TimeoutError:
            continue
        break
    writer.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer[:80]


async def test_admin_connection_cap_answers_503_without_reading() -> None:
    endpoint = AdminEndpoint(registry=None, config=document, serving=lambda: True, max_connections=2)
    await endpoint.start("127.0.0.1:0")
    try:
        held = [await asyncio.open_connection("127.0.0.1", endpoint.port) for _ in range(2)]
        await asyncio.sleep(0.05)
        assert (await exchange(endpoint.port, b"")).startswith(b"HTTP/1.1 503")
        assert endpoint.refused == 1
        for _, writer in held:
            writer.close()
    finally:
        await endpoint.close()


# ---------------------------------------------------------------------------- /config (defect 8)


async def test_config_is_built_off_the_loop_once_for_concurrent_gets() -> None:
    """Defect 8: ``/config`` was built and serialized on the event loop, once per GET."""
    calls: list[int] = []
    gate = threading.Event()
    snapshots: list[int] = []

    def snapshot() -> Any:
        snapshots.append(threading.get_ident())
        return document(calls, gate)

    endpoint = AdminEndpoint(registry=None, config=snapshot, serving=lambda: True)
    await endpoint.start("127.0.0.1:0")
    try:
        get = b"GET /config HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
        readers = [asyncio.ensure_future(exchange(endpoint.port, get)) for _ in range(3)]
        await asyncio.sleep(0.2)  # all three have asked while the first render waits at the gate
        gate.set()
        answers = await asyncio.gather(*readers)
    finally:
        await endpoint.close()
    assert all(answer.startswith(b"HTTP/1.1 200") for answer in answers)
    assert len({answer.partition(b"\r\n\r\n")[2] for answer in answers}) == 1
    assert snapshots == [threading.get_ident()], "the snapshot is taken on the loop, once"
    assert len(calls) == 1 and calls[0] != threading.get_ident(), "built once, in a worker thread"


def many_rules(directory: Path, count: int) -> Path:
    directory.mkdir()
    rules = "".join(
        f"  - key: k{index}\n    rate_limit: {{unit: minute, requests_per_unit: {index + 1}}}\n"
        for index in range(count)
    )
    (directory / "big.yaml").write_text(f"domain: big\ndescriptors:\n{rules}")
    return directory


async def test_config_is_capped_in_bytes_with_the_rules_left_out_counted(tmp_path: Path) -> None:
    config = load_config(many_rules(tmp_path / "config", 3000))
    cap = 64 * 1024
    endpoint = AdminEndpoint(
        registry=None,
        config=lambda: lambda: {**config_json(config, 0.0), "quota": {"buckets": []}},
        serving=lambda: True,
        max_config_bytes=cap,
    )
    answer = await endpoint.config_body()
    assert len(answer) <= cap
    shown = json.loads(answer)
    rules = shown["domains"]["big"]["rules"]
    assert 0 < len(rules) < 3000
    assert [rule["requests_per_unit"] for rule in rules] == list(range(1, len(rules) + 1)), "a prefix, in order"
    assert shown["domains"]["big"]["rules_total"] == 3000
    assert shown["truncated"] == {"max_bytes": cap, "rules_left_out": 3000 - len(rules)}
    assert shown["quota"] == {"buckets": []}
    uncapped = AdminEndpoint(None, lambda: lambda: config_json(config, 0.0), lambda: True, max_config_bytes=10**8)
    whole = json.loads(await uncapped.config_body())
    assert len(whole["domains"]["big"]["rules"]) == 3000 and "truncated" not in whole


async def test_a_client_that_never_reads_a_large_config_is_dropped(tmp_path: Path) -> None:
    config = load_config(many_rules(tmp_path / "config", 10_000))  # about 7 MB: more than socket buffers hold
    endpoint = AdminEndpoint(
        registry=None,
        config=lambda: lambda: config_json(config, 0.0),
        serving=lambda: True,
        write_timeout=0.3,
        max_config_bytes=16 * 1024 * 1024,
    )
    await endpoint.start("127.0.0.1:0")
    try:
        raw = socket.socket()
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        raw.connect(("127.0.0.1", endpoint.port))
        raw.sendall(b"GET /config HTTP/1.1\r\nhost: x\r\n\r\n")
        for _ in range(200):
            if endpoint.dropped:
                break
            await asyncio.sleep(0.05)
        raw.close()
        assert endpoint.dropped == 1
        assert not endpoint.http.writers, "the connection and its buffer were let go"
    finally:
        await endpoint.close()


async def test_a_fault_in_a_handler_is_a_500_and_the_listener_goes_on() -> None:
    class Broken:
        def collect(self) -> Any:
            raise RuntimeError("collector broke")

    endpoint = AdminEndpoint(registry=Broken(), config=document, serving=lambda: True)
    await endpoint.start("127.0.0.1:0")
    try:
        got = await exchange(endpoint.port, b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n")
        assert got.startswith(b"HTTP/1.1 500"), got[:80]
        assert b"connection: close" in got.lower()
        healthy = await exchange(endpoint.port, b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        assert healthy.startswith(b"HTTP/1.1 200")
    finally:
        await endpoint.close()


async def test_a_config_render_is_shown_again_for_its_max_age_unless_the_config_changed() -> None:
    """One client looping GET /config costs one render per max_age, and a reload shows at once."""
    now = [100.0]
    shared = SharedRender(max_age=1.0, clock=lambda: now[0])
    made: list[str] = []

    def snapshot(text: str) -> Any:
        def render() -> bytes:
            made.append(text)
            return text.encode()

        return lambda: render

    first, second = object(), object()
    assert await shared.get(snapshot("a"), first) == b"a"
    now[0] += 0.5
    assert await shared.get(snapshot("b"), first) == b"a", "within max_age, the same config: reused"
    assert await shared.get(snapshot("c"), second) == b"c", "another config: rendered at once"
    now[0] += 1.0
    assert await shared.get(snapshot("d"), second) == b"d", "past max_age: rendered again"
    assert made == ["a", "c", "d"] and shared.renders == 3


def test_a_connection_rests_as_long_as_its_request_kept_the_loop_busy() -> None:
    assert rest_after(0.001) == 0.0  # a cheap request never waits
    assert rest_after(0.004) == 0.004
    assert rest_after(5.0) == MAX_PACE  # a slow machine does not stretch the rest without bound


def blocking_exchange(port: int, data: bytes) -> bytes:
    """:func:`exchange` from another thread: the loop thread's CPU is then the server's alone."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
        client.sendall(data)
        received = b""
        while chunk := client.recv(65536):
            received += chunk
    return received


async def test_a_looped_costly_json_body_rests_its_connection_and_a_cheap_one_does_not(h: Any, clock: Any) -> None:
    """Issue 25: a client looping 63 KB bodies, each refused after parsing, kept the loop busy
    all the time (ShouldRateLimit p50 2 -> 21 ms); its connection now rests between them."""
    endpoint = JsonEndpoint(h.memory_service(RULES, clock), read_timeout=2.0, idle_timeout=2.0)
    await endpoint.start("127.0.0.1:0")
    try:
        cheap = b'{"domain": "api", "descriptors": [{"entries": [{"key": "client", "value": "a"}]}]}'
        costly = ('{"domain": "api", "descriptors": [' + ",".join(["{}"] * 21000) + "]}").encode()
        await decide_json(endpoint.service, cheap)  # first-use costs (imports, caches) are not a request's
        health = b"GET /healthcheck HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
        for body, answers in ((cheap, b"HTTP/1.1 200"), (costly, b"HTTP/1.1 400")):
            before = endpoint.http.rested
            head = f"POST /json HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\n\r\n".encode()
            got = await asyncio.to_thread(blocking_exchange, endpoint.port, (head + body) * 2 + health)
            assert got.count(b"HTTP/1.1 ") == 3, got[:200]
            assert got.startswith(answers), got[:200]
            assert (endpoint.http.rested > before) is (body is costly)
    finally:
        await endpoint.close()


def test_large_answers_take_turns_at_the_listeners_rate() -> None:
    now = [10.0]
    large = LargeAnswers(rate=1000, clock=lambda: now[0])
    assert large.wait_for(500) == 0.0  # the first goes at once and books 0.5 s
    assert large.wait_for(500) == 0.5  # the next waits for it
    now[0] = 12.0
    assert large.wait_for(1000) == 0.0  # turns unused are not saved up


async def test_a_reader_looping_large_answers_on_new_connections_waits_its_turns() -> None:
    """A client may open a connection per request, so the connection's rest never applies:
    the listener's large answers share :data:`LARGE_ANSWER_RATE` instead."""
    body = b"x" * (2 * 1024 * 1024)

    async def handler(request: Request) -> Answer:
        return Answer(200, body, "text/plain")

    bounds = Bounds(max_connections=4, read_timeout=2.0, idle_timeout=2.0, write_timeout=5.0, max_body=1024)
    server = HttpServer("test", handler, bounds, lambda status, reason: Answer(status, b""), Answer(503, b""))
    server.large = LargeAnswers(clock=lambda: 0.0)  # a stopped clock: the turns are the bytes alone
    await server.start("127.0.0.1:0")
    try:
        for _ in range(3):  # three 2 MiB answers at 100 MiB/s: the second waits 20 ms, the third 40
            reply = await exchange(server.port, b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert reply.endswith(body)
        assert server.paced == pytest.approx((0 + 1 + 2) * len(body) / LARGE_ANSWER_RATE)
    finally:
        await server.close()
