"""The Redis password never shows: not in logs (debug level included), metrics, /config or errors."""

from __future__ import annotations

import time
import urllib.parse
import urllib.request
from pathlib import Path

from tests.support.redis_servers import ACL_PASSWORD, ACL_USER, RedisServer, fresh_prefix
from tests.support.sidecars import SidecarFactory, clean_env, free_port, request, run_cli


def get(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as reply:
        return str(reply.read().decode())


def leaks(text: str) -> list[str]:
    quoted = urllib.parse.quote(ACL_PASSWORD, safe="")
    return [form for form in {ACL_PASSWORD, quoted, "s3cr"} if form in text]


def test_password_stays_out_of_logs_metrics_config_and_outage_reports(
    acl_redis: RedisServer, start_sidecar: SidecarFactory, config_dir: Path
) -> None:
    secret = urllib.parse.quote(ACL_PASSWORD, safe="")
    url = f"redis://{ACL_USER}:{secret}@127.0.0.1:{acl_redis.port}"
    port = free_port()
    env = clean_env(RLS_METRICS_ADDRESS=f"127.0.0.1:{port}", RLS_LOG_LEVEL="debug", RLS_REQUEST_LOG_SAMPLE="1")
    flags = ("--backend", "redis", "--redis-url", url, "--redis-prefix", fresh_prefix(), "--redis-timeout", "0.05")
    sidecar = start_sidecar(*flags, config=config_dir, env=env)
    for value in ("a", "b", "c"):
        sidecar.ask(request("it", [("per_minute", value)]))
    acl_redis.kill()  # an outage: the reports of it must not carry the URL either
    deadline = time.monotonic() + 10
    while "redis_unavailable" not in sidecar.stderr() and time.monotonic() < deadline:
        sidecar.ask(request("it", [("per_minute", "d")]))  # keeps a counter to flush
        time.sleep(0.05)
    published = get(port, "/metrics") + get(port, "/config")
    sidecar.kill()
    acl_redis.start()  # the fixture is shared by the module
    assert leaks(published) == []
    assert "redis_unavailable" in sidecar.stderr()
    assert leaks(sidecar.stderr() + sidecar.stdout()) == []


def test_a_wrong_password_is_reported_without_the_password(
    acl_redis: RedisServer, start_sidecar: SidecarFactory, config_dir: Path
) -> None:
    wrong = urllib.parse.quote(ACL_PASSWORD + "-wrong", safe="")
    url = f"redis://{ACL_USER}:{wrong}@127.0.0.1:{acl_redis.port}"
    sidecar = start_sidecar("--backend", "redis", "--redis-url", url, config=config_dir)
    sidecar.ask(request("it", [("per_minute", "w")]))  # answered by the failure mode
    deadline = time.monotonic() + 10
    while "redis_unavailable" not in sidecar.stderr() and time.monotonic() < deadline:
        time.sleep(0.05)
    sidecar.kill()
    assert "AuthenticationError" in sidecar.stderr(), "Redis refused the credentials (not a dead server)"
    assert leaks(sidecar.stderr()) == []
    result = run_cli(
        "serve", "--config", str(config_dir), "--backend", "redis", "--redis-url", url, "--redis-timeout", "x"
    )
    assert result.returncode == 1 and "--redis-timeout" in result.stderr
    assert leaks(result.stderr) == [], "a settings error echoes the bad value only"
