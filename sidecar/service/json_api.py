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

What makes protobuf's JSON parser costly is refused before it runs: the number of
descriptors and of entries per descriptor (:mod:`sidecar.service.validate`'s bounds) are
checked on the decoded JSON, with the gRPC path's messages, in its order. So a body of
21,000 empty descriptors is refused from a list length, never handed to
``json_format.ParseDict``; a request within them (up to 64 x 32 entries) is parsed whole
as before (so a body that is no request still gets the parser's reason first), a large one
a descriptor at a time, yielding to the event loop every :data:`PARSE_CHUNK_ENTRIES`.

HTTP is :mod:`sidecar.http_server`'s (h11 under asyncio streams, on the sidecar's event
loop): keep-alive, ``Content-Length`` bodies only (411 otherwise), a body cap checked
before reading (413), a request head cap, a deadline for each request to arrive once it
has begun (:data:`READ_TIMEOUT`, else 408), a deadline for the client to read its answer
(:data:`WRITE_TIMEOUT`), an idle limit between requests (:data:`IDLE_TIMEOUT`), and a cap
on open connections (503 beyond it), as the admin endpoint bounds its own. It listens
only when ``--json-address`` is set (or the reference's ``HOST``/``PORT``, whose
deployments probe ``/healthcheck`` there). It has no TLS, so anything that reaches it can
spend every limit: ``POST /json`` answers loopback clients only (others get 403) unless
``--json-remote`` says otherwise; ``/healthcheck`` answers everyone.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf import json_format

from sidecar.config.model import MAX_DESCRIPTORS, MAX_DOMAIN_LENGTH, MAX_ENTRIES
from sidecar.http_server import Answer, Bounds, HttpServer, Request
from sidecar.protos.envoy.service.ratelimit.v3 import rls_pb2
from sidecar.service.servicer import RateLimitService, Refusal
from sidecar.service.validate import descriptor_problem

PATH = "/json"
HEALTH_PATH = "/healthcheck"
"""envoyproxy/ratelimit's health check on its HTTP port: 200 ``OK``, 500 while not serving."""
MAX_BODY_BYTES = 64 * 1024
"""Largest body read. JSON is decoded on the event loop (about 0.5 ms for 64 KiB); what
protobuf then parses is bounded by the request bounds, checked first."""
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
PARSE_CHUNK_ENTRIES = 256
"""Descriptor entries parsed by protobuf between two yields to the event loop (about 7 ms
of ``ParseDict`` on this machine's 2 cores)."""

HTTP_STATUS = {"INVALID_ARGUMENT": 400, "INTERNAL": 500}


class OutOfBoundsError(Exception):
    """A request bound broken, found on the decoded JSON: the gRPC path's message for it."""


def error_body(code: str, message: str) -> bytes:
    return json.dumps({"code": code, "message": message}, ensure_ascii=False).encode()


def http_error(status: int, reason: str) -> Answer:
    """What an HTTP-level refusal (400, 408, 411, 413) gets on this endpoint."""
    return Answer(status, error_body("BAD_REQUEST", reason), close=True)


def refusal_answer(refusal: Refusal, detail: str = "") -> Answer:
    """What a request the service refuses gets: gRPC's code name and message, as JSON."""
    name = refusal.code.name
    message = f"{refusal.message}: {detail[:MAX_DETAIL]}" if detail else refusal.message
    return Answer(HTTP_STATUS.get(name, 500), error_body(name, message))


def domain_problem(value: dict[str, Any]) -> str | None:
    """``request_problem``'s first checks, on the JSON (a non-string domain is the parser's to refuse)."""
    domain = value.get("domain", "")
    if not isinstance(domain, str):
        return None
    if not domain:
        return "domain: must not be empty"
    if len(domain) > MAX_DOMAIN_LENGTH:
        return f"domain: longer than {MAX_DOMAIN_LENGTH} characters"
    return None


def too_many_entries(descriptor: Any) -> bool:
    """Whether a JSON descriptor has more entries than a request may (what makes parsing it costly)."""
    entries = descriptor.get("entries") if isinstance(descriptor, dict) else None
    return isinstance(entries, list) and len(entries) > MAX_ENTRIES


async def parse_request(value: dict[str, Any]) -> Any:
    """``value`` as a ``RateLimitRequest``; what makes parsing costly is refused before protobuf sees it.

    The bounds on sizes (descriptors per request, entries per descriptor) are checked on the
    JSON first; a request within them (at most 64 x 32 entries) is parsed whole, so a body
    that is no request gets the parser's reason and every other bound is checked afterwards by
    ``RateLimitService.handle``, all as on the gRPC path. Raises :class:`OutOfBoundsError` with
    the gRPC path's message for the first bound broken, or the parser's error."""
    request = rls_pb2.RateLimitRequest()
    descriptors = value.get("descriptors", [])
    if not isinstance(descriptors, list):
        json_format.ParseDict(value, request)  # the parser names the wrong type
        return request
    too_many = len(descriptors) > MAX_DESCRIPTORS  # then their entries are not even looked at
    over = None if too_many else next((i for i, d in enumerate(descriptors) if too_many_entries(d)), None)
    if not too_many and over is None:
        if entry_count(descriptors) <= PARSE_CHUNK_ENTRIES:
            json_format.ParseDict(value, request)  # small: one call
        else:
            json_format.ParseDict({name: part for name, part in value.items() if name != "descriptors"}, request)
            await parse_descriptors(descriptors, request)
        return request
    # Too large to parse: name the first bound broken, in the gRPC path's order.
    json_format.ParseDict({name: part for name, part in value.items() if name != "descriptors"}, request)
    problem = domain_problem(value)
    if problem is None and too_many:
        problem = f"descriptors: more than {MAX_DESCRIPTORS} descriptors"
    if problem is not None:
        raise OutOfBoundsError(problem)
    assert over is not None
    await parse_descriptors(descriptors[:over], request)  # each within the entry bound
    raise OutOfBoundsError(f"descriptors[{over}].entries: more than {MAX_ENTRIES} entries")


def entry_count(descriptors: list[Any]) -> int:
    """Entries in ``descriptors`` (each already within :data:`MAX_ENTRIES`)."""
    lists = (descriptor.get("entries") for descriptor in descriptors if isinstance(descriptor, dict))
    return sum(len(entries) for entries in lists if isinstance(entries, list))


async def parse_descriptors(descriptors: list[Any], request: Any) -> None:
    """Parse ``descriptors`` (each within the entry bounds) into ``request`` one at a time,
    checking each as the gRPC path would (so an earlier fault is named first), and yielding
    to the event loop every :data:`PARSE_CHUNK_ENTRIES` entries."""
    parsed = 0
    for index, descriptor in enumerate(descriptors):
        try:
            json_format.ParseDict(descriptor, request.descriptors.add())
        except json_format.ParseError as error:
            raise json_format.ParseError(f"descriptors[{index}]: {error}") from None
        problem = descriptor_problem(request.descriptors[index])
        if problem is not None:
            raise OutOfBoundsError(f"descriptors[{index}].{problem}")
        parsed += len(request.descriptors[index].entries) + 1
        if parsed >= PARSE_CHUNK_ENTRIES:
            parsed = 0
            await asyncio.sleep(0)


async def decide_json(service: RateLimitService, body: bytes) -> Answer:
    """A ``RateLimitRequest`` in JSON through the service's shared request path; no sockets involved."""
    try:
        value = json.loads(body)
        if not isinstance(value, dict):
            raise ValueError(f"expected a JSON object, got {type(value).__name__}")
        request = await parse_request(value)
    except OutOfBoundsError as bound:
        service.stats.error("invalid_argument")  # as RateLimitService.handle counts its own refusals
        return refusal_answer(Refusal(grpc.StatusCode.INVALID_ARGUMENT, str(bound)))
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


class JsonEndpoint:
    """The ``/json`` listener: serves :func:`decide_json` over HTTP/1.1 on the running event loop."""

    def __init__(
        self,
        service: RateLimitService,
        *,
        max_connections: int = MAX_CONNECTIONS,
        read_timeout: float = READ_TIMEOUT,
        idle_timeout: float = IDLE_TIMEOUT,
        write_timeout: float = WRITE_TIMEOUT,
        max_body: int = MAX_BODY_BYTES,
        serving: Callable[[], bool] = lambda: True,
        remote: bool = False,
    ) -> None:
        self.service = service
        self.remote = remote
        """``--json-remote``: decisions for clients beyond loopback too."""
        self.serving = serving
        """Whether ``GET /healthcheck`` answers 200 (envoyproxy/ratelimit's health path on its HTTP port)."""
        bounds = Bounds(
            max_connections=max_connections,
            read_timeout=read_timeout,
            idle_timeout=idle_timeout,
            write_timeout=write_timeout,
            max_body=max_body,
            length_required=frozenset({"POST"}),
        )
        busy = Answer(503, error_body("UNAVAILABLE", "too many connections"), close=True)
        self.http = HttpServer("json", self.answer, bounds, http_error, busy)

    @property
    def port(self) -> int:
        return self.http.port

    @property
    def refused_connections(self) -> int:
        """Connections answered 503 because ``max_connections`` were open."""
        return self.http.refused

    async def start(self, address: str) -> None:
        await self.http.start(address)

    async def close(self) -> None:
        """Stop listening and close every connection (called once calls have stopped)."""
        await self.http.close()

    async def answer(self, request: Request) -> Answer:
        """One request: the health check, or a decision."""
        if request.path == HEALTH_PATH and request.method in ("GET", "HEAD"):
            return Answer(200, b"OK", "text/plain") if self.serving() else Answer(500, b"NOT_SERVING", "text/plain")
        if request.path != PATH:
            return Answer(404, error_body("NOT_FOUND", f"the decision endpoint is POST {PATH}"))
        if request.method != "POST":
            return Answer(405, error_body("BAD_REQUEST", f"{PATH} takes POST"), allow="POST")
        if not self.remote and not is_local_peer(request.peer):
            return Answer(403, error_body("PERMISSION_DENIED", REMOTE_REFUSED))
        return await decide_json(self.service, request.body)


REMOTE_REFUSED = f"{PATH} answers clients on this host only; --json-remote (RLS_JSON_REMOTE=true) opens it"


def is_local_peer(peer: str) -> bool:
    """Whether a client address is this host's: loopback, or none (a unix socket)."""
    if not peer:
        return True
    try:
        address = ipaddress.ip_address(peer.partition("%")[0])
    except ValueError:
        return False
    mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
    return (mapped or address).is_loopback
