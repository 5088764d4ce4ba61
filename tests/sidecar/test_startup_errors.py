"""A Redis URL the sidecar cannot use ends in one line on stderr that never holds the password.

Issue 21, defect 9: a mistyped scheme repeated the whole URL in the error, and a
password with an unencoded ``#``, ``/`` or ``?`` ended in a redis-py traceback whose
last line showed the start of the password (or, with ``/`` and no user name, in
connection attempts to a "host" made of the password's first part, logged as the
``redis_unavailable`` reason). Every URL goes through ``serve``'s own command-line path
in this process (:mod:`tests.support.serve_refusal`); one real ``serve`` process per
path, flag and environment, proves the exit status and that stderr is that same line.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

import pytest

from tests.support.serve_refusal import Refusal, serve_in_process
from tests.support.sidecars import clean_env, log_events, run_cli

SECRET = "Sup3rS3cret"
"""The password's two halves; an unencoded special character goes between them."""
HALVES = ("Sup3r", "S3cret")
SERVE_TIMEOUT = 15.0
"""A URL the sidecar wrongly accepts makes it serve: the test then fails on the timeout."""

BAD_URLS = [
    pytest.param(f"redis+sentinal://user:{SECRET}@127.0.0.1:26379/mymaster", id="sentinel-typo"),
    pytest.param(f"REDIS://user:{SECRET}@127.0.0.1:6379", id="upper-case-scheme"),
    pytest.param(f"user:{SECRET}@127.0.0.1:6379", id="no-scheme"),
    pytest.param("redis://user:Sup3r#S3cret@127.0.0.1:6379", id="hash"),
    pytest.param("redis://user:Sup3r/S3cret@127.0.0.1:6379", id="slash"),
    pytest.param("redis://user:Sup3r?S3cret@127.0.0.1:6379", id="question-mark"),
    pytest.param("redis://Sup3r/S3cret@127.0.0.1:6379", id="slash-password-only"),
    pytest.param("rediss://user:Sup3r#S3cret@127.0.0.1:6379", id="tls-hash"),
    pytest.param("redis+cluster://user:Sup3r?S3cret@127.0.0.1:7000", id="cluster-question-mark"),
    pytest.param("redis+sentinel://user:Sup3r/S3cret@127.0.0.1:26379", id="sentinel-slash"),
    pytest.param("redis+sentinel://user:Sup3r?S3cret@127.0.0.1:26379/mymaster", id="sentinel-question-mark"),
    pytest.param(f"redis://user:{SECRET}@127.0.0.1:99999", id="port-out-of-range"),
    pytest.param(f"redis://user:{SECRET}@127.0.0.1:6379/zero", id="database-not-a-number"),
    pytest.param(f"redis://user:{SECRET}@127.0.0.1:6379/0?socket_timeout=soon", id="bad-query-value"),
]


def leaked(text: str) -> list[str]:
    return [half for half in HALVES if half in text]


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("config") / "rules.yaml"
    path.write_text("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1}\n")
    return path


PREFIX = "ratelimit-sidecar: error: --redis-url / RLS_REDIS_URL"
SERVE_FLAGS = ("--grpc-address", "127.0.0.1:0", "--backend", "redis")


def by_flag(config: Path, url: str) -> Refusal:
    return serve_in_process("--config", str(config), *SERVE_FLAGS, "--redis-url", url, "--log-format", "json")


def by_environment(config: Path, url: str) -> Refusal:
    env = {"RLS_BACKEND": "redis", "RLS_REDIS_URL": url, "RLS_GRPC_ADDRESS": "127.0.0.1:0"}
    return serve_in_process("--config", str(config), env=env)


@pytest.mark.parametrize("url", BAD_URLS)
def test_a_bad_redis_url_is_one_line_without_the_password(config: Path, url: str) -> None:
    done = by_flag(config, url)
    assert done.code == 1, done.stderr
    assert len(done.lines) == 1, done.stderr
    assert done.lines[0].startswith(PREFIX), done.lines[0]
    assert leaked(done.stderr + done.stdout) == []


@pytest.mark.parametrize("url", BAD_URLS)
def test_the_same_urls_through_the_environment(config: Path, url: str) -> None:
    done = by_environment(config, url)
    assert done.code == 1, done.stderr
    assert len(done.lines) == 1, done.stderr
    assert done.lines[0].startswith(PREFIX), done.lines[0]
    assert leaked(done.stderr + done.stdout) == []


def test_a_scheme_typo_gets_a_suggestion(config: Path) -> None:
    done = by_flag(config, f"redis+sentinal://user:{SECRET}@127.0.0.1:26379/mymaster")
    assert "'redis+sentinal'" in done.stderr
    assert "redis+sentinel://" in done.stderr


def test_a_real_serve_refuses_a_bad_url_flag_with_that_one_line(config: Path) -> None:
    """The process behind the in-process checks: exit 1, nothing but the line they saw
    (an unencoded '#': once a redis-py traceback quoting the password)."""
    url = "redis://user:Sup3r#S3cret@127.0.0.1:6379"
    flags = ("serve", "--config", str(config), *SERVE_FLAGS, "--redis-url", url, "--log-format", "json")
    done = run_cli(*flags, timeout=SERVE_TIMEOUT)
    assert done.returncode == 1, done.stderr
    assert done.stderr.splitlines() == by_flag(config, url).lines
    assert done.stdout == ""
    assert leaked(done.stderr) == []


def test_a_real_serve_refuses_a_bad_url_variable_with_that_one_line(config: Path) -> None:
    url = f"redis+sentinal://user:{SECRET}@127.0.0.1:26379/mymaster"
    env = clean_env(RLS_BACKEND="redis", RLS_REDIS_URL=url, RLS_GRPC_ADDRESS="127.0.0.1:0")
    done = run_cli("serve", "--config", str(config), env=env, timeout=SERVE_TIMEOUT)
    assert done.returncode == 1, done.stderr
    assert done.stderr.splitlines() == by_environment(config, url).lines
    assert "redis+sentinel://" in done.stderr
    assert leaked(done.stderr + done.stdout) == []


def test_an_encoded_password_with_special_characters_still_works_in_settings() -> None:
    from sidecar.limiter.redis.connect import check_url

    for special in "#/?@:":
        password = urllib.parse.quote(f"Sup3r{special}S3cret", safe="")
        check_url(f"redis://user:{password}@127.0.0.1:6379/0")
        check_url(f"redis+sentinel://user:{password}@127.0.0.1:26379/mymaster")


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://user:Sup3rS3cret@host:6379/0", "redis://***@host:6379/0"),
        ("redis://Sup3r/S3cret@host:6379", "redis://***@host:6379"),
        ("redis://user:Sup3r?S3cret@host:6379", "redis://***@host:6379"),
        ("redis://host:6379/0?password=Sup3rS3cret&db=1", "redis://host:6379/0?password=***&db=1"),
        ("redis+sentinel://h1,h2/m?sentinel_password=Sup3rS3cret", "redis+sentinel://h1,h2/m?sentinel_password=***"),
        ("redis://host:6379", "redis://host:6379"),
    ],
)
def test_redact_hides_credentials(url: str, shown: str) -> None:
    from sidecar.limiter.redis.connect import redact

    assert redact(url) == shown
    assert leaked(redact(url)) == []


async def test_an_outage_reason_never_carries_the_password() -> None:
    """redis_unavailable reasons come from redis-py's messages, which may quote the URL's parts."""
    from sidecar.limiter.redis.store import RedisStore

    url = f"redis://user:{SECRET}@127.0.0.1:1/0"
    store = RedisStore.for_url(url, redis_timeout=0.05)
    reasons: list[str] = []
    store.add_listener(lambda available, reason: reasons.append(reason))
    store.availability.mark_down(f"ConnectionError: cannot reach {url} as user:{SECRET}")
    assert reasons and leaked(reasons[0] + store.last_error) == [], reasons
    await store.close()


def test_an_unreachable_redis_is_logged_without_the_password(config: Path, tmp_path: Path) -> None:
    """A URL that parses but leads nowhere: serve, log redis_unavailable, and no password."""
    url = f"redis://user:{SECRET}@127.0.0.1:1/0"
    env = clean_env(RLS_BACKEND="redis", RLS_REDIS_URL=url, RLS_LOG_FORMAT="json")
    err = tmp_path / "stderr"
    with err.open("wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "sidecar", "serve", "--config", str(config), "--grpc-address", "127.0.0.1:0"],
            stderr=sink,
            stdout=subprocess.DEVNULL,
            env=env,
        )
        try:
            deadline = time.monotonic() + 15
            while "sidecar_started" not in err.read_text() and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            process.terminate()
            process.wait(timeout=15)
    text = err.read_text()
    events = [event["event"] for event in log_events(text)]
    assert "redis_unavailable" in events, text
    assert leaked(text) == []
    assert not re.search(r"Traceback", text)
