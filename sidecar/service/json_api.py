"""HTTP/JSON decisions: ``POST /json`` with a ``RateLimitRequest`` as JSON, for apps in any language.

envoyproxy/ratelimit serves the same endpoint on its HTTP port; this one keeps its
contract: the body is a ``RateLimitRequest`` in protobuf's JSON mapping (the proto field
names and their lowerCamelCase JSON names are both accepted, unknown fields are refused),
the answer is the ``RateLimitResponse`` in the same mapping (lowerCamelCase names, enums by
name, proto3 defaults left out), with status **200** when admitted and **429** when
``overallCode`` is ``OVER_LIMIT`` (the body is the full response either way).

The request runs through :meth:`RateLimitService.handle`, the code path of the gRPC method,
so the bounds, the messages, the metrics and the drain are the same. Where the reference
answers a bare ``400 Bad Request``, this endpoint answers ``{"code": "INVALID_ARGUMENT",
"message": ...}`` with the message the gRPC path would send (``descriptors[0].entries[1].key:
must not be empty``); a body that is not a ``RateLimitRequest`` in JSON is 400 with the
parser's reason, an internal fault is 500 ``INTERNAL``.

A careful HTTP/1.1 server on the sidecar's event loop (asyncio streams, no dependency):
keep-alive, ``Content-Length`` bodies only (no chunked encoding, so no smuggling games),
a body cap checked before reading (413), a request head cap, a deadline for each request
to arrive once it has begun (:data:`READ_TIMEOUT`, else 408), a deadline for the client to
read its answer (:data:`WRITE_TIMEOUT`), an idle limit between requests
(:data:`IDLE_TIMEOUT`), and a cap on open connections (503 beyond it), as the admin
endpoint bounds its own. It listens
only when ``--json-address`` is set, loopback in the documented examples: it has no TLS,
so anything that reaches it can spend every limit.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import structlog
from google.protobuf import json_format

from sidecar.protos.envoy.service.ratelimit.v3 import rls_pb2
from sidecar.service.servicer import RateLimitService, Refusal

log = structlog.get_logger(__name__)

PATH = "/json"
HEALTH_PATH = "/healthcheck"
"""envoyproxy/ratelimit's health check on its HTTP port: 200 ``OK``, 500 while not serving."""
MAX_BODY_BYTES = 64 * 1024
"""Largest body parsed. JSON is parsed in Python on the event loop, so the cap also bounds
how long one request can hold it (about a millisecond per 10 KiB); every request the
bounds accept with ordinary values is far smaller."""
MAX_HEAD_BYTES = 8192
"""Request line plus headers."""
READ_TIMEOUT = 5.0
"""Seconds a request has to arrive in full once its first byte has (slow clients get 408)."""
WRITE_TIMEOUT = 5.0
"""Seconds a client gets to read an answer; one that stops reading is dropped."""
IDLE_TIMEOUT = 30.0
"""Seconds a kept-alive connection may sit idle between requests before it is closed."""
MAX_CONNECTIONS = 512
"""Open connections at most; the next one is answered 503 and closed."""
MAX_DETAIL = 200
"""Characters of the JSON parser's reason quoted back: it may echo the client's input."""

REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    411: "Length Required",
    413: "Content Too Large",
    429: "Too Many Requests",
    500: "Internal Server Error",
    503: "Service Unavailable",
}
HTTP_STATUS = {"INVALID_ARGUMENT": 400, "INTERNAL": 500}


class HttpError(Exception):
    """An HTTP-level problem: the status to answer with, and a short reason; the connection closes."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Answer:
    """One HTTP response: status, JSON body, and whether the connection must close after it."""

    status: int
    body: bytes
    close: bool = False
    allow: str = ""


def error_body(code: str, message: str) -> bytes:
    return json.dumps({"code": code, "message": message}, ensure_ascii=False).encode()


def refusal_answer(refusal: Refusal, detail: str = "") -> Answer:
    """What a request the service refuses gets: gRPC's code name and message, as JSON."""
    name = refusal.code.name
    message = f"{refusal.message}: {detail[:MAX_DETAIL]}" if detail else refusal.message
    return Answer(HTTP_STATUS.get(name, 500), error_body(name, message))


async def decide_json(service: RateLimitService, body: bytes) -> Answer:
    """A ``RateLimitRequest`` in JSON through the service's shared request path; no sockets involved."""
    request = rls_pb2.RateLimitRequest()
    try:
        value = json.loads(body)
        if not isinstance(value, dict):
            raise ValueError(f"expected a JSON object, got {type(value).__name__}")
        json_format.ParseDict(value, request)
    except Exception as error:  # ParseError, bad UTF-8, RecursionError, ...: all the client's doing
        refusal = await service.handle(None)  # counted as undecodable, answered as gRPC would
        assert isinstance(refusal, Refusal)
        return refusal_answer(refusal, str(error) or type(error).__name__)
    outcome = await service.handle(request)
    if isinstance(outcome, Refusal):
        return refusal_answer(outcome)
    response = rls_pb2.RateLimitResponse.FromString(outcome)
    text = json_format.MessageToJson(response, indent=None)
    over = response.overall_code == rls_pb2.RateLimitResponse.OVER_LIMIT
    return Answer(429 if over else 200, text.encode())


@dataclass
class Head:
    """A parsed request head."""

    method: str
    path: str
    version: str
    headers: Mapping[str, str]


def parse_head(data: bytes) -> Head:
    """The request line and headers (names lowercased); :class:`HttpError` when malformed."""
    try:
        text = data.decode("latin-1")
        line, *rest = text.split("\r\n")
        method, target, version = line.split(" ")
    except ValueError:
        raise HttpError(400, "malformed request line") from None
    if not version.startswith("HTTP/1."):
        raise HttpError(400, "only HTTP/1.x")
    headers: dict[str, str] = {}
    for field in rest:
        if not field:
            continue
        name, sep, value = field.partition(":")
        if not sep or not name or name != name.strip():
            raise HttpError(400, "malformed header")
        name = name.lower()
        value = value.strip()
        if name in headers and name in ("content-length", "transfer-encoding"):
            raise HttpError(400, f"repeated {name}")
        headers[name] = value
    return Head(method, target.split("?", 1)[0], version, headers)


def keep_alive(head: Head) -> bool:
    connection = head.headers.get("connection", "").lower()
    if head.version == "HTTP/1.0":
        return connection == "keep-alive"
    return connection != "close"


class JsonEndpoint:
    """The ``/json`` listener: serves :func:`decide_json` over HTTP/1.1 on the running event loop."""

    def __init__(
        self,
        service: RateLimitService,
        *,
        max_connections: int = MAX_CONNECTIONS,
        read_timeout: float = READ_TIMEOUT,
        idle_timeout: float = IDLE_TIMEOUT,
        max_body: int = MAX_BODY_BYTES,
        serving: Callable[[], bool] = lambda: True,
    ) -> None:
        self.service = service
        self.serving = serving
        """Whether ``GET /healthcheck`` answers 200 (envoyproxy/ratelimit's health path on its HTTP port)."""
        self.max_connections = max_connections
        self.read_timeout = read_timeout
        self.idle_timeout = idle_timeout
        self.max_body = max_body
        self.server: asyncio.Server | None = None
        self.port = 0
        self.writers: set[asyncio.StreamWriter] = set()
        self.refused_connections = 0
        """Connections answered 503 because :attr:`max_connections` were open."""

    async def start(self, address: str) -> None:
        host, _, port = address.rpartition(":")
        self.server = await asyncio.start_server(self._serve, host.strip("[]"), int(port), limit=MAX_HEAD_BYTES)
        self.port = int(self.server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        """Stop listening and close every connection (called once calls have stopped)."""
        if self.server is not None:
            self.server.close()
            for writer in list(self.writers):
                writer.close()
            await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self.writers) >= self.max_connections:
            self.refused_connections += 1
            await self._write(writer, Answer(503, error_body("UNAVAILABLE", "too many connections"), close=True))
            writer.close()
            return
        self.writers.add(writer)
        try:
            timeout = self.read_timeout
            while True:
                answer = await self._one(reader, writer, timeout)
                if answer is None:
                    break
                await self._write(writer, answer)
                if answer.close:
                    break
                timeout = self.idle_timeout
        except ConnectionError:
            pass
        except Exception:
            log.exception("json_request_failed")
        finally:
            self.writers.discard(writer)
            writer.close()

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, idle: float) -> Answer | None:
        """Read and answer one request; None when the client left or stayed idle too long."""
        received = await self._receive(reader, writer, idle)
        if received is None or isinstance(received, Answer):
            return received
        head, body = received
        close = not keep_alive(head)
        if head.path.split("?", 1)[0] == HEALTH_PATH and head.method in ("GET", "HEAD"):
            return Answer(200, b"OK", close) if self.serving() else Answer(500, b"NOT_SERVING", close)
        if head.path != PATH:
            return Answer(404, error_body("NOT_FOUND", f"the decision endpoint is POST {PATH}"), close)
        if head.method != "POST":
            return Answer(405, error_body("BAD_REQUEST", f"{PATH} takes POST"), close, allow="POST")
        answer = await decide_json(self.service, body)
        return Answer(answer.status, answer.body, close)

    async def _receive(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, idle: float
    ) -> tuple[Head, bytes] | Answer | None:
        """A request's head and body; an error answer (the connection then closes); None: nobody there."""
        try:
            async with asyncio.timeout(idle):
                first = await reader.read(1)
        except TimeoutError:
            first = b""  # idle too long: close quietly
        if not first:
            return None
        try:
            async with asyncio.timeout(self.read_timeout):
                head = parse_head(first + await reader.readuntil(b"\r\n\r\n"))
                return head, await self._body(reader, writer, head)
        except HttpError as bad:
            return Answer(bad.status, error_body("BAD_REQUEST", bad.reason), close=True)
        except TimeoutError:
            return Answer(408, error_body("BAD_REQUEST", "request not received in time"), close=True)
        except asyncio.LimitOverrunError:
            return Answer(400, error_body("BAD_REQUEST", f"request head over {MAX_HEAD_BYTES} bytes"), close=True)
        except asyncio.IncompleteReadError:
            return None

    async def _body(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: Head) -> bytes:
        if "transfer-encoding" in head.headers:
            raise HttpError(411, "send the body with Content-Length, not Transfer-Encoding")
        length_text = head.headers.get("content-length")
        if length_text is None:
            if head.method == "POST":
                raise HttpError(411, "Content-Length is required")
            return b""
        if not length_text.isdigit():
            raise HttpError(400, "Content-Length must be a number")
        length = int(length_text)
        if length > self.max_body:
            raise HttpError(413, f"body over {self.max_body} bytes")
        if length and head.headers.get("expect", "").lower() == "100-continue":
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # curl waits for this before a large body
        return await reader.readexactly(length) if length else b""

    async def _write(self, writer: asyncio.StreamWriter, answer: Answer) -> None:
        allow = f"allow: {answer.allow}\r\n" if answer.allow else ""
        head = (
            f"HTTP/1.1 {answer.status} {REASONS.get(answer.status, '')}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(answer.body)}\r\n{allow}connection: {'close' if answer.close else 'keep-alive'}"
            "\r\n\r\n"
        ).encode()
        writer.write(head + answer.body)
        try:
            async with asyncio.timeout(WRITE_TIMEOUT):
                await writer.drain()
        except TimeoutError:
            writer.transport.abort()  # a client that does not read would pin the buffer
            raise ConnectionResetError("client stopped reading") from None
