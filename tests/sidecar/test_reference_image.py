"""Swapping the image, keeping the environment: each promise of docs/migrating.md, step 2 and 3.

Unit level (the process level is tests/deploy/test_image_reference_env.py): the image's
default config path yields to the reference's RUNTIME_* variables; a reference deployment
gets its HTTP port, 0.0.0.0:8080, without setting PORT, where ``/healthcheck`` answers
everyone and ``POST /json`` only loopback clients unless ``--json-remote``; ``health`` and
``query`` dial where ``serve`` listens; ``REDIS_URL`` written as a URL is read as written,
and what cannot be honoured is named by the variable the user set.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from sidecar.__main__ import _parser, local_address
from sidecar.http_server import Request
from sidecar.service.json_api import JsonEndpoint
from sidecar.settings import Settings, SettingsError, resolve

RULES = """
    domain: api
    descriptors:
      - key: client
        rate_limit: {unit: minute, requests_per_unit: 2}
"""
IMAGE = {"RLS_CONFIG_DEFAULT": "/etc/ratelimit/config"}
RUNTIME = {**IMAGE, "RUNTIME_ROOT": "/data", "RUNTIME_SUBDIRECTORY": "ratelimit"}
DECISION = json.dumps({"domain": "api", "descriptors": [{"entries": [{"key": "client", "value": "a"}]}]}).encode()


def settings(environ: dict[str, str], *flags: str) -> Settings:
    return resolve(_parser().parse_args(["serve", *flags]), environ)


def test_the_image_default_never_shadows_runtime_root() -> None:
    assert settings(IMAGE).config == "/etc/ratelimit/config"
    assert settings(RUNTIME).config == "/data/ratelimit/config"
    assert settings({**RUNTIME, "RLS_CONFIG": "/mine"}).config == "/mine"
    with pytest.raises(SettingsError, match="RLS_CONFIG_DEFAULT=''"):
        settings({"RLS_CONFIG_DEFAULT": ""})


def test_a_reference_deployment_gets_its_http_port_without_setting_port() -> None:
    """Its probes hit /healthcheck on 8080; the reference listens there by default."""
    reference = settings(RUNTIME)
    assert (reference.json_address, reference.json_remote) == ("0.0.0.0:8080", False)
    assert settings({**RUNTIME, "PORT": "9000"}).json_address == "0.0.0.0:9000"
    assert settings({**RUNTIME, "RLS_JSON_ADDRESS": ""}).json_address == ""
    assert settings({**IMAGE, "RLS_CONFIG": "/c"}).json_address == "", "our own settings: off unless asked"
    assert settings({**RUNTIME, "RLS_JSON_REMOTE": "true"}).json_remote


async def answer(endpoint: JsonEndpoint, method: str, path: str, peer: str, body: bytes = b"") -> tuple[int, Any]:
    reply = await endpoint.answer(Request(method, path, body, peer))
    return reply.status, reply.body


@pytest.mark.parametrize("peer", ["10.1.2.3", "172.17.0.1", "::ffff:10.0.0.1", "fe80::1%eth0"])
async def test_json_answers_only_loopback_clients_unless_opened(h: Any, clock: Any, peer: str) -> None:
    endpoint = JsonEndpoint(h.memory_service(RULES, clock))
    assert (await answer(endpoint, "GET", "/healthcheck", peer))[0] == 200
    status, body = await answer(endpoint, "POST", "/json", peer, DECISION)
    assert status == 403
    assert "--json-remote (RLS_JSON_REMOTE=true)" in json.loads(body)["message"]
    for local in ("127.0.0.1", "127.0.0.2", "::1", "::ffff:127.0.0.1", ""):
        assert (await answer(endpoint, "POST", "/json", local, DECISION))[0] in (200, 429), local
    opened = JsonEndpoint(h.memory_service(RULES, clock), remote=True)
    assert (await answer(opened, "POST", "/json", peer, DECISION))[0] == 200


async def test_the_listener_hands_the_client_address_to_the_endpoint(h: Any, clock: Any) -> None:
    """A real connection: its peer reaches the check (127.0.0.1 here, so it is answered)."""
    endpoint = JsonEndpoint(h.memory_service(RULES, clock))
    seen: list[str] = []
    original = endpoint.answer

    async def spy(request: Request) -> Any:
        seen.append(request.peer)
        return await original(request)

    endpoint.http.handler = spy
    await endpoint.start("127.0.0.1:0")
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", endpoint.port)
        head = f"POST /json HTTP/1.1\r\nHost: x\r\nContent-Length: {len(DECISION)}\r\n\r\n".encode()
        writer.write(head + DECISION)
        status_line = await asyncio.wait_for(reader.readline(), 5)
        writer.close()
    finally:
        await endpoint.close()
    assert status_line.startswith(b"HTTP/1.1 200"), status_line
    assert seen == ["127.0.0.1"]


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, "127.0.0.1:8081"),
        ({"GRPC_PORT": "9001"}, "127.0.0.1:9001"),
        ({"GRPC_HOST": "127.0.0.5", "GRPC_PORT": "9001"}, "127.0.0.5:9001"),
        ({"GRPC_UDS": "/run/rl.sock", "GRPC_PORT": "9001"}, "unix:/run/rl.sock"),
        ({"RLS_GRPC_ADDRESS": "0.0.0.0:7000", "GRPC_PORT": "9001"}, "127.0.0.1:7000"),
    ],
)
def test_health_and_query_dial_where_serve_listens(environ: dict[str, str], expected: str) -> None:
    assert local_address(environ) == expected
    served = settings({"RLS_CONFIG": "/c", **environ}).grpc_address
    assert expected in (served, "127.0.0.1:" + served.rpartition(":")[2])


def test_redis_url_written_as_a_url_is_read_as_written() -> None:
    for url in ("redis://127.0.0.1:6379", "rediss://cache:6380/2", "unix:///run/redis.sock"):
        chosen = settings({**RUNTIME, "REDIS_URL": url})
        assert (chosen.redis_url, chosen.backend) == (url, "redis")


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"REDIS_URL": "memcache://m:11211"}, "REDIS_URL: takes HOST:PORT"),
        ({"REDIS_URL": "redis://h:6379", "REDIS_AUTH": "secret"}, "so REDIS_AUTH cannot be added"),
        ({"REDIS_URL": "redis://h:6379", "REDIS_TLS": "true"}, "so REDIS_TLS cannot be added"),
        ({"REDIS_URL": "redis://h:6379", "REDIS_TYPE": "CLUSTER"}, "so REDIS_TYPE cannot be added"),
        ({"REDIS_URL": "redis://h:port"}, "REDIS_URL (read as --redis-url): "),
    ],
)
def test_what_cannot_be_honoured_names_the_variable_the_user_set(extra: dict[str, str], named: str) -> None:
    with pytest.raises(SettingsError) as caught:
        settings({**RUNTIME, **extra})
    message = str(caught.value)
    assert named in message
    assert "secret" not in message
    assert "--redis-url / RLS_REDIS_URL" not in message
