"""The HTTP/1.1 server under the sidecar's two HTTP listeners (the admin endpoint and ``POST /json``).

HTTP itself (request lines, headers, ``Content-Length`` framing, keep-alive, ``HEAD``,
``Expect: 100-continue``, what a malformed request is) is h11's: a sans-IO HTTP/1.1
implementation, so no parsing is written here. This module adds only the I/O on asyncio
streams of the sidecar's event loop, and the bounds a per-pod sidecar needs, because
every connection is served on the loop that answers Envoy:

- the request head is at most :data:`MAX_HEAD_BYTES` (h11's incomplete-event cap; 400),
  and must arrive in full within ``read_timeout`` of its first byte (408), body included;
- bodies are ``Content-Length`` only (``Transfer-Encoding`` gets 411: no chunked games),
  at most ``max_body`` bytes, refused from the header before any of it is read (413);
- a kept-alive connection may idle ``idle_timeout`` seconds between requests;
- a client gets ``write_timeout`` seconds to read an answer: one that stops reading is
  dropped, and its buffer freed;
- at most ``max_connections`` are open: the next one gets the ``busy`` answer at once,
  without its request being read, and is closed.

Anything malformed (a ``Content-Length`` of ``²`` or of 5,000 digits, a bad request line, a
missing ``Host`` in HTTP/1.1) is h11's ``RemoteProtocolError``: 400, no traceback.

A connection whose request kept the loop's thread busy for a while (a 63 KB ``/json`` body
parsed and refused, a ``/config`` render written out) **rests as long as that took** before
its next request is read, as bulk work does between chunks (``sidecar/turns.py``): a client
that loops such requests back to back would otherwise keep the loop busy all the time, and
gRPC's poller thread would wait for the GIL up to the switch interval per hand-off of every
``ShouldRateLimit`` call (probe p50 2 -> 21 ms under one client looping 63 KB bodies). A
cheap request (under :data:`PACE_FROM`) never rests.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus

import h11
import structlog

log = structlog.get_logger(__name__)

MAX_HEAD_BYTES = 8192
"""Request line plus headers."""
READ_CHUNK = 65536
JOIN_BODY_BYTES = 65536
"""Bodies up to this size go out with their head in one write; larger ones (a shared
``/metrics`` or ``/config`` render) are written as they are, not copied per client."""
MAX_REASON = 200
"""Characters of h11's reason for a malformed request quoted back (it may quote the request)."""
REFUSAL_LOG_SECONDS = 60.0
"""At most one log line per listener this often about connections refused at the cap."""
PACE_FROM = 0.002
"""Seconds of the loop thread's CPU one request may take before its connection rests (an
ordinary ``/json`` decision takes 0.1-1 ms here, a 63 KB body refused after parsing 3-7 ms)."""
MAX_PACE = 0.02
"""The longest rest after one request (as ``sidecar.turns.MAX_REST``)."""
LARGE_ANSWER_RATE = 100 * 1024 * 1024
"""Bytes a second a listener's large answers (over :data:`JOIN_BODY_BYTES`: the shared
``/metrics`` and ``/config`` renders) may take together; past it, the next one waits its
turn. Writing one costs the loop well under the connection rest's 2 ms, and a client may
open a new connection per request, so nothing else stopped one reader from looping
``GET /config`` 500-700 times a second (probe p99 2.7 -> 10 ms on 2 cores). At this rate a
0.4 MB ``/config`` takes a 4 ms turn and a 7.9 MiB ``/metrics`` 80 ms; the connection cap
bounds how many wait."""


class LargeAnswers:
    """The listener's turns for large answers: each starts once the previous ones' bytes,
    at :data:`LARGE_ANSWER_RATE`, are through."""

    def __init__(self, rate: float = LARGE_ANSWER_RATE, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.clock = clock
        self.free_at = 0.0

    def wait_for(self, size: int) -> float:
        """Seconds an answer of ``size`` bytes waits for its turn (its own bytes are then booked)."""
        now = self.clock()
        start = max(now, self.free_at)
        self.free_at = start + size / self.rate
        return start - now


def rest_after(busy: float) -> float:
    """Seconds a connection rests after a request that kept the loop's thread ``busy`` seconds."""
    return 0.0 if busy < PACE_FROM else min(busy, MAX_PACE)


@dataclass(frozen=True, slots=True)
class Request:
    """One request as a listener's handler sees it: method, path (no query), and the whole body."""

    method: str
    path: str
    body: bytes = b""
    peer: str = ""
    """The client's IP address ("" when the socket has none to give, a unix socket)."""


@dataclass(frozen=True, slots=True)
class Answer:
    """One response: status, body and its type; ``close``: end the connection after it."""

    status: int
    body: bytes
    content_type: str = "application/json"
    close: bool = False
    allow: str = ""


@dataclass(frozen=True, slots=True)
class Bounds:
    """What one listener lets a client hold; see the module docstring."""

    max_connections: int
    read_timeout: float
    idle_timeout: float
    write_timeout: float
    max_body: int
    length_required: frozenset[str] = frozenset()
    """Methods whose requests must say ``Content-Length`` (411 otherwise)."""


Handler = Callable[[Request], Awaitable[Answer]]
ErrorAnswer = Callable[[int, str], Answer]
"""The answer a listener gives for an HTTP-level refusal: ``(status, reason)``."""


class RequestError(Exception):
    """An HTTP-level refusal: the status, and a reason for the client. The connection closes."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


class ClientGoneError(Exception):
    """The client left (or stayed idle past the idle timeout): nothing to answer."""


def serialized(answer: Answer) -> bytes:
    """``answer`` as bytes on a connection of its own (written before any request is read): h11
    frames it for a client that is then refused (its request side put in error, unread)."""
    connection = h11.Connection(h11.SERVER)
    connection.receive_data(b"\0\r\n\r\n")
    with contextlib.suppress(h11.RemoteProtocolError):
        connection.next_event()
    return b"".join(
        connection.send(event)
        for event in (response_event(answer), h11.Data(data=answer.body), h11.EndOfMessage())
        if not isinstance(event, h11.Data) or answer.body
    )


def response_event(answer: Answer) -> h11.Response:
    headers = [("content-type", answer.content_type), ("content-length", str(len(answer.body)))]
    if answer.allow:
        headers.append(("allow", answer.allow))
    if answer.close:
        headers.append(("connection", "close"))
    return h11.Response(status_code=answer.status, headers=headers, reason=HTTPStatus(answer.status).phrase)


class HttpServer:
    """One listener: serves ``handler`` over HTTP/1.1 on the running event loop, within ``bounds``."""

    def __init__(self, name: str, handler: Handler, bounds: Bounds, error: ErrorAnswer, busy: Answer) -> None:
        self.name = name
        self.handler = handler
        self.bounds = bounds
        self.error = error
        self.busy = serialized(busy)
        self.server: asyncio.Server | None = None
        self.port = 0
        self.writers: set[asyncio.StreamWriter] = set()
        """Open connections (their writers), at most ``bounds.max_connections``."""
        self.refused = 0
        """Connections answered ``busy`` because ``max_connections`` were open (since start)."""
        self.dropped = 0
        """Clients dropped for not reading their answer within ``write_timeout`` (since start)."""
        self.rested = 0.0
        """Seconds connections rested after costly requests (see :func:`rest_after`; since start)."""
        self.large = LargeAnswers()
        """Whose turn it is to write a large answer."""
        self.paced = 0.0
        """Seconds large answers waited for their turn (:class:`LargeAnswers`; since start)."""
        self._refusal_logged = -REFUSAL_LOG_SECONDS

    async def start(self, address: str) -> None:
        host, _, port = address.rpartition(":")
        self.server = await asyncio.start_server(self._accept, host.strip("[]"), int(port), limit=READ_CHUNK)
        self.port = int(self.server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        """Stop listening and close every connection."""
        if self.server is not None:
            self.server.close()
            for writer in list(self.writers):
                writer.close()
            await self.server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self.writers) >= self.bounds.max_connections:
            self._refuse(writer)
            return
        self.writers.add(writer)
        try:
            await Exchange(self, reader, writer).run()
        except (ConnectionError, ClientGoneError):
            pass
        except Exception:
            log.exception("http_request_failed", listener=self.name)
        finally:
            self.writers.discard(writer)
            writer.close()

    def _refuse(self, writer: asyncio.StreamWriter) -> None:
        """The short ``busy`` answer without waiting for the client (it fits any socket buffer), then close."""
        self.refused += 1
        now = time.monotonic()
        if now - self._refusal_logged >= REFUSAL_LOG_SECONDS:
            self._refusal_logged = now
            log.warning("http_connections_refused", listener=self.name, open=len(self.writers), total=self.refused)
        with contextlib.suppress(ConnectionError, RuntimeError):
            writer.write(self.busy)
        writer.close()


class Exchange:
    """One connection: requests in, answers out, in turn, until either side closes."""

    def __init__(self, server: HttpServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.server = server
        self.bounds = server.bounds
        self.reader = reader
        self.writer = writer
        peer = writer.get_extra_info("peername")
        self.peer = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        self.http = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        self.loop = asyncio.get_running_loop()
        self.deadline = 0.0
        """When the request being read must have arrived (``loop.time()``)."""

    async def run(self) -> None:
        wait = self.bounds.read_timeout  # a new connection is expected to ask at once
        while True:
            method = "GET"
            busy = 0.0
            try:
                request = await self._receive(wait)
                method = request.method
                busy = time.thread_time()
                answer = await self._answer(request)
            except RequestError as refused:
                answer = self._close(self.server.error(refused.status, refused.reason))
            await self._send(answer, method)
            if self.http.our_state is not h11.DONE or self.http.their_state is not h11.DONE:
                return
            self.http.start_next_cycle()
            wait = self.bounds.idle_timeout
            rest = rest_after(time.thread_time() - busy) if busy else 0.0
            if rest:
                self.server.rested += rest
                await asyncio.sleep(rest)

    async def _answer(self, request: Request) -> Answer:
        """The handler's answer; a fault of ours is a 500 (logged) and the connection closes."""
        try:
            return await self.server.handler(request)
        except Exception:
            log.exception("http_request_failed", listener=self.server.name, path=request.path[:100])
            return self._close(self.server.error(500, "internal error; see the sidecar's logs"))

    @staticmethod
    def _close(answer: Answer) -> Answer:
        return Answer(answer.status, answer.body, answer.content_type, True, answer.allow)

    async def _receive(self, idle: float) -> Request:
        """The next whole request: the first byte within ``idle``, the rest within ``read_timeout``."""
        self.deadline = self.loop.time() + idle
        event = await self._next_event(first=True)
        if not isinstance(event, h11.Request):  # ConnectionClosed: the client left between requests
            raise ClientGoneError
        method = event.method.decode("ascii")
        path = event.target.decode("latin-1").split("?", 1)[0]
        length = self._content_length(event, method)
        if length and self.http.they_are_waiting_for_100_continue:
            go_on = h11.InformationalResponse(status_code=100, headers=[], reason=b"Continue")
            await self._write(self.http.send(go_on), 0)  # curl waits for this before a large body
        body = bytearray()
        while not isinstance(event := await self._next_event(), h11.EndOfMessage):
            if isinstance(event, h11.Data):
                body += event.data
            else:
                raise ClientGoneError
        return Request(method, path, bytes(body), self.peer)

    def _content_length(self, request: h11.Request, method: str) -> int:
        """The body's announced length, refused (411, 413) before any of it is read."""
        length: int | None = None
        for name, value in request.headers:
            if name == b"transfer-encoding":
                raise RequestError(411, "send the body with Content-Length, not Transfer-Encoding")
            if name == b"content-length":
                length = int(value)  # h11 has checked it: ASCII digits, one value
        if length is None:
            if method in self.bounds.length_required:
                raise RequestError(411, "Content-Length is required")
            return 0
        if length > self.bounds.max_body:
            raise RequestError(413, f"body over {self.bounds.max_body} bytes")
        return length

    async def _next_event(self, first: bool = False) -> h11.Event | type[h11.PAUSED]:
        """h11's next event, reading as it needs until :attr:`deadline`; ``first``: waiting for
        a request's first byte, after which the whole request has ``read_timeout``."""
        while True:
            try:
                event = self.http.next_event()
            except h11.RemoteProtocolError as error:
                raise RequestError(400, str(error)[:MAX_REASON] or "malformed request") from None
            if event is not h11.NEED_DATA:
                return event  # type: ignore[return-value]  # h11's sentinels are classes
            try:
                async with asyncio.timeout_at(self.deadline):
                    data = await self.reader.read(READ_CHUNK)
            except TimeoutError:
                if first:
                    raise ClientGoneError from None  # idle too long: close quietly
                raise RequestError(408, "request not received in time") from None
            if first and data:
                first = False
                self.deadline = self.loop.time() + self.bounds.read_timeout
            self.http.receive_data(data)

    async def _send(self, answer: Answer, method: str) -> None:
        if self.http.our_state is not h11.SEND_RESPONSE:  # no whole request head: answer, then close
            await self._write(serialized(self._close(answer)), len(answer.body))
            return
        head = self.http.send(response_event(answer))
        body = self.http.send(h11.Data(data=answer.body)) if answer.body and method != "HEAD" else b""
        end = self.http.send(h11.EndOfMessage())  # b"" with Content-Length framing
        if len(body) <= JOIN_BODY_BYTES:
            await self._write(head + body + end, len(body))  # one write: one send, one segment
            return
        wait = self.server.large.wait_for(len(body))
        if wait:
            self.server.paced += wait
            await asyncio.sleep(wait)
        self.writer.write(head)
        await self._write(body, len(body))  # the answer's own bytes (a shared render), not a copy

    async def _write(self, data: bytes, body_bytes: int) -> None:
        """Write and wait for the client to read, at most ``write_timeout``; a client that
        does not read would pin the buffer, so it is dropped."""
        self.writer.write(data)
        if not self.writer.transport.get_write_buffer_size():
            return  # all sent already (the usual case for a small answer): nothing to wait for
        try:
            async with asyncio.timeout(self.bounds.write_timeout):
                await self.writer.drain()
        except TimeoutError:
            self.server.dropped += 1
            log.info(
                "http_slow_reader_dropped",
                listener=self.server.name,
                write_timeout=self.bounds.write_timeout,
                body_bytes=body_bytes,
            )
            self.writer.transport.abort()
            raise ClientGoneError from None
