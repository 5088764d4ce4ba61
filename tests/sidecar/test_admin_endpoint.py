"""The admin HTTP endpoint of a real sidecar process: /metrics, /config, /healthz."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from sidecar.admin import AdminEndpoint
from sidecar.http_server import Request
from tests.support.redis_servers import RedisServer, fresh_prefix
from tests.support.sidecars import Sidecar, SidecarFactory, clean_env, free_port, metric, request, run_cli


def get(port: int, path: str) -> tuple[int, str, str]:
    """``(status, content type, body)`` of a GET on the admin port."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as reply:
            return reply.status, reply.headers["content-type"], reply.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.headers["content-type"], error.read().decode()


def with_admin(start_sidecar: SidecarFactory, config_dir: Path, *flags: str) -> tuple[Sidecar, int]:
    port = free_port()
    sidecar = start_sidecar(*flags, config=config_dir, env=clean_env(RLS_METRICS_ADDRESS=f"127.0.0.1:{port}"))
    return sidecar, port


def test_metrics_count_rule_hits_requests_and_config(start_sidecar: SidecarFactory, config_dir: Path) -> None:
    sidecar, port = with_admin(start_sidecar, config_dir)
    for _ in range(7):
        sidecar.ask(request("it", [("per_minute", "metrics-user")]))
    status, content_type, text = get(port, "/metrics")
    assert status == 200 and content_type.startswith("text/plain")
    assert metric(text, "ratelimit_service_rate_limit_total_hits", domain="it", key="per_minute") == 7
    assert metric(text, "ratelimit_service_rate_limit_over_limit", domain="it", key="per_minute") == 2
    assert metric(text, "ratelimit_service_rate_limit_within_limit", domain="it", key="per_minute") == 5
    # the 5th hit only passes floor(0.8 * 5) = 4: the reference's near-limit threshold
    assert metric(text, "ratelimit_service_rate_limit_near_limit", domain="it", key="per_minute") == 1
    assert metric(text, "ratelimit_sidecar_requests_total", code="OK") == 5
    assert metric(text, "ratelimit_sidecar_requests_total", code="OVER_LIMIT") == 2
    assert metric(text, "ratelimit_sidecar_decision_seconds_count") == 7
    assert metric(text, "ratelimit_sidecar_config_loads_total", result="ok") == 1
    assert metric(text, "ratelimit_sidecar_counters") == 1
    assert metric(text, "process_resident_memory_bytes") is not None


def test_invalid_requests_are_counted_by_kind(start_sidecar: SidecarFactory, config_dir: Path) -> None:
    sidecar, port = with_admin(start_sidecar, config_dir)
    with pytest.raises(Exception, match=r"INVALID_ARGUMENT|domain"):
        sidecar.ask(request("", [("per_minute", "x")]))
    _, _, text = get(port, "/metrics")
    assert metric(text, "ratelimit_sidecar_request_errors_total", kind="invalid_argument") == 1


def test_config_lists_the_loaded_rules_with_their_source(start_sidecar: SidecarFactory, config_dir: Path) -> None:
    _, port = with_admin(start_sidecar, config_dir)
    status, content_type, body = get(port, "/config")
    assert (status, content_type) == (200, "application/json")
    loaded = json.loads(body)
    assert len(loaded["sha256"]) == 64
    rules = {rule["stat_key"]: rule for rule in loaded["domains"]["it"]["rules"]}
    assert rules["it.per_minute"]["requests_per_unit"] == 5
    assert rules["it.per_minute"]["unit"] == "minute"
    assert rules["it.per_minute"]["source"].startswith(str(config_dir))
    assert rules["it.free"]["unlimited"] is True


def test_config_shows_the_extensions_of_every_limit(start_sidecar: SidecarFactory) -> None:
    """examples/extensions through a real sidecar: algorithm, window, burst, ban, and both limits of api_key."""
    extensions = Path(__file__).resolve().parents[2] / "examples" / "extensions"
    _, port = with_admin(start_sidecar, extensions)
    status, _, body = get(port, "/config")
    assert status == 200
    rules = json.loads(body)["domains"]["extensions"]["rules"]
    assert [(rule["name"] or rule["stat_key"], rule["algorithm"], rule["window_seconds"]) for rule in rules] == [
        ("extensions.remote_address", "sliding_window", 1),
        ("extensions.generic_key_uploads", "token_bucket", 1),
        ("api_key_per_second", "fixed_window", 1),
        ("api_key_per_hour", "fixed_window", 3600),
        ("extensions.login_user", "fixed_window", 300),
    ]
    assert rules[1]["burst"] == 50
    assert (rules[4]["unit"], rules[4]["unit_multiplier"], rules[4]["ban_duration_seconds"]) == ("minute", 5, 600)
    assert rules[2]["together_with"] == [rules[3]["path"]] and rules[3]["together_with"] == [rules[2]["path"]]


def test_healthz_and_unknown_paths(start_sidecar: SidecarFactory, config_dir: Path) -> None:
    _, port = with_admin(start_sidecar, config_dir)
    assert get(port, "/healthz")[::2] == (200, "SERVING\n")
    assert get(port, "/nope")[0] == 404
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        raw.sendall(b"garbage\r\n\r\n")
        assert raw.recv(100).startswith(b"HTTP/1.1 400")
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        raw.sendall(b"POST /metrics HTTP/1.1\r\nhost: x\r\n\r\n")
        assert raw.recv(100).startswith(b"HTTP/1.1 405")


async def test_healthz_answers_503_while_not_serving() -> None:
    endpoint = AdminEndpoint(registry=None, config=lambda: dict, serving=lambda: False)
    answer = await endpoint.answer(Request("GET", "/healthz"))
    assert (answer.status, answer.content_type) == (503, "text/plain")


def test_a_taken_metrics_port_fails_startup_with_one_line(config_dir: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_cli(
            "serve",
            "--config",
            str(config_dir),
            "--grpc-address",
            f"127.0.0.1:{free_port()}",
            "--metrics-address",
            f"127.0.0.1:{port}",
        )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        f"ratelimit-sidecar: error: cannot listen on 127.0.0.1:{port}: Address already in use"
    )


def test_sync_mode_exposes_redis_state(
    start_sidecar: SidecarFactory, config_dir: Path, redis_server: RedisServer
) -> None:
    flags = ("--backend", "redis", "--redis-url", redis_server.url, "--redis-prefix", fresh_prefix())
    sidecar, port = with_admin(start_sidecar, config_dir, *flags)
    sidecar.ask(request("it", [("per_minute", "redis-metrics")]))
    _, _, text = get(port, "/metrics")
    assert metric(text, "ratelimit_sidecar_redis_up") == 1
    assert metric(text, "ratelimit_sidecar_replicas") == 1
    assert metric(text, "ratelimit_sidecar_redis_round_trips_total", path="background") is not None
    assert metric(text, "ratelimit_sidecar_pending_hits") is not None
