"""What the end-to-end tests share: HTTP through Envoy, window alignment, a recording RLS server."""

from __future__ import annotations

import http.client
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc

from sidecar.protos.envoy.service.ratelimit.v3 import rls_pb2
from stack.processes import free_port

METHOD = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
COUNTING_TIMEOUT = 2.0
"""The rate-limit filter's timeout in tests that count exact 200s and 429s: with the shipped
20-25 ms, a sidecar slowed by a loaded machine lets Envoy's failure mode admit the request
(the failure mode has tests of its own, which keep the short timeout)."""


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def header(self, name: str) -> str | None:
        return self.headers.get(name.lower())


def exchange(connection: http.client.HTTPConnection, path: str, headers: dict[str, str] | None, method: str) -> Reply:
    connection.request(method, path, headers=headers or {})
    response = connection.getresponse()
    body = response.read()
    return Reply(response.status, {name.lower(): value for name, value in response.getheaders()}, body)


def send(url: str, path: str = "/", headers: dict[str, str] | None = None, method: str = "GET") -> Reply:
    """One request on a fresh connection."""
    connection = http.client.HTTPConnection(url.removeprefix("http://"), timeout=10)
    try:
        return exchange(connection, path, headers, method)
    finally:
        connection.close()


class Session:
    """Keep-alive connections to several Envoys; request ``i`` goes to Envoy ``i % n``."""

    def __init__(self, *urls: str) -> None:
        self.connections = [http.client.HTTPConnection(url.removeprefix("http://"), timeout=10) for url in urls]
        self.sent = 0

    def send(self, path: str = "/", headers: dict[str, str] | None = None, method: str = "GET") -> Reply:
        connection = self.connections[self.sent % len(self.connections)]
        self.sent += 1
        return exchange(connection, path, headers, method)

    def close(self) -> None:
        for connection in self.connections:
            connection.close()


def fresh_window(unit: int, needed: float = 3.0) -> float:
    """Sleep to the start of the next second (and of the next ``unit`` window when fewer
    than ``needed`` seconds are left); returns seconds left in the window."""
    now = time.time()
    left = unit - now % unit
    time.sleep((left if left < needed else 1 - now % 1) + 0.02)
    return unit - time.time() % unit


class RecordingRateLimitService:
    """A gRPC RateLimitService that answers OK and records every request Envoy sends:
    the descriptors the real filter builds, not what we assume it builds."""

    def __init__(self) -> None:
        self.port = free_port()
        self.requests: list[Any] = []
        self.lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        handler = grpc.method_handlers_generic_handler(
            "envoy.service.ratelimit.v3.RateLimitService",
            {
                "ShouldRateLimit": grpc.unary_unary_rpc_method_handler(
                    self._answer,
                    request_deserializer=rls_pb2.RateLimitRequest.FromString,
                    response_serializer=rls_pb2.RateLimitResponse.SerializeToString,
                )
            },
        )
        self.server.add_generic_rpc_handlers((handler,))
        self.server.add_insecure_port(f"127.0.0.1:{self.port}")

    def _answer(self, request: Any, context: Any) -> Any:
        with self.lock:
            self.requests.append(request)
        statuses = [rls_pb2.RateLimitResponse.DescriptorStatus(code=1) for _ in request.descriptors]
        return rls_pb2.RateLimitResponse(overall_code=1, statuses=statuses)

    def take(self) -> list[Any]:
        with self.lock:
            taken, self.requests = self.requests, []
        return taken

    def __enter__(self) -> RecordingRateLimitService:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop(grace=None)


def descriptors(request: Any) -> list[list[tuple[str, str]]]:
    """A request's descriptors as lists of ``(key, value)``."""
    return [[(entry.key, entry.value) for entry in descriptor.entries] for descriptor in request.descriptors]


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``predicate`` every 50 ms; AssertionError naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
