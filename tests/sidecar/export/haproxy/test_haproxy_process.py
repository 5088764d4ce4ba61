"""The HAProxy export against the real HAProxy 2.6 and the real upstream app.

Every config this repository ships and every exporter output must pass ``haproxy -c``
(with ``-dW``: no warnings either); the shipped ``haproxy/haproxy.cfg`` then runs on free
ports and must refuse exactly what the sidecar refuses for the same requests: the
sidecar here is the real ``RateLimitService`` with the memory backend, in this process,
fed the descriptors that ``envoy/sidecar.yaml`` produces for each request.

Clients bind to distinct loopback addresses (127.0.0.0/8 is all local on Linux), so each
test has its own ``remote_address`` values; each test also gets its own HAProxy, so
tables start empty. Counts are only asserted for traffic that stayed inside one window.
"""

from __future__ import annotations

import asyncio
import http.client
import itertools
import math
import random
import re
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import pytest

from sidecar.config import load_config
from sidecar.limiter.memory import MemoryLimiter
from sidecar.service.servicer import RateLimitService
from stack.haproxy import (
    SHIPPED_CONFIG,
    HAProxyPorts,
    HAProxyProcess,
    check_config,
    export_fragment,
    generated_part,
)
from stack.processes import REPO, ProcessGroup
from stack.upstream import UpstreamProcess
from tests.support.envoy_snippets import EXTENSION_FLAGS, EXTENSIONS_ROUTES, minimal_envoy_config
from tests.support.sidecars import OK, request

pytestmark = [pytest.mark.haproxy]

DEMO = REPO / "examples" / "config"
ENVOY = REPO / "envoy" / "sidecar.yaml"
T = TypeVar("T")
_addresses = itertools.count(random.Random().randrange(0, 200) * 254 * 256)


def fresh_address() -> str:
    """A loopback address no other client of this test run uses (127.2.0.1 and up)."""
    number = next(_addresses)
    host, rest = number % 254 + 1, number // 254
    return f"127.{rest // 256 % 250 + 2}.{rest % 256}.{host}"


@dataclass
class Reply:
    status: int
    headers: dict[str, str]


class Client:
    """One keep-alive HTTP connection from a chosen loopback address."""

    def __init__(self, port: int, address: str | None = None) -> None:
        self.port = port
        self.address = address or fresh_address()
        self.connection = self._connect()

    def _connect(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=10, source_address=(self.address, 0))

    def send(self, method: str = "GET", path: str = "/", headers: dict[str, str] | None = None) -> Reply:
        for attempt in range(2):
            try:
                self.connection.request(method, path, headers=headers or {})
                response = self.connection.getresponse()
                response.read()
                return Reply(response.status, {name.lower(): value for name, value in response.getheaders()})
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                self.connection.close()
                self.connection = self._connect()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def statuses(
        self, count: int, method: str = "GET", path: str = "/", headers: dict[str, str] | None = None
    ) -> list[int]:
        return [self.send(method, path, headers).status for _ in range(count)]

    def close(self) -> None:
        self.connection.close()


def window_of(moment: float, unit: int) -> int:
    return math.floor(moment) // unit


def wait_for_window_start(unit: int = 1, margin: float = 0.005) -> None:
    """Sleep until a fresh window of ``unit`` seconds has just begun (at most one window)."""
    now = time.time()
    time.sleep(unit - now % unit + margin)


def until_on_time(attempt: Callable[[], T | None], tries: int = 3) -> T:
    """Run ``attempt`` (fresh values each time) until it returns something: None means a stall of the
    machine broke its timeline, which says nothing about what is tested."""
    for _ in range(tries):
        result = attempt()
        if result is not None:
            return result
    raise AssertionError(f"{attempt} could not keep its timeline in {tries} tries")


def in_fresh_second(run: Callable[[], T]) -> T | None:
    """``run()`` started right after a clock second begins; None if it did not end in that second."""
    wait_for_window_start()
    started = time.time()
    result = run()
    return result if window_of(started, 1) == window_of(time.time(), 1) else None


def in_one_window(attempt: Callable[[], T], unit: int = 1, tries: int = 4, fresh_start: bool = True) -> T:
    """Run ``attempt`` (with fresh values each time) until one run starts and ends in one window.

    Per-second tests start right after a boundary; longer windows only retry in the rare case a
    boundary passed during the run.
    """
    for _ in range(tries):
        if fresh_start:
            wait_for_window_start(unit)
        before = time.time()
        result = attempt()
        if window_of(before, unit) == window_of(time.time(), unit):
            return result
    raise AssertionError(f"no run of {attempt} fitted in one {unit}-second window in {tries} tries")


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpstreamProcess]:
    group = ProcessGroup()
    try:
        app = group.start(UpstreamProcess("app", tmp_path_factory.mktemp("upstream")))
        assert isinstance(app, UpstreamProcess)
        app.wait_ready()
        yield app
    finally:
        group.close()


@pytest.fixture
def start_haproxy(upstream: UpstreamProcess, tmp_path: Path) -> Iterator[Callable[[], HAProxyProcess]]:
    """Start the shipped config on free ports; every HAProxy started is stopped after the test."""
    group = ProcessGroup()

    def start() -> HAProxyProcess:
        haproxy = HAProxyProcess(f"haproxy{len(group.children)}", HAProxyPorts.free(upstream.port), tmp_path)
        group.start(haproxy)
        haproxy.wait_ready()
        return haproxy

    try:
        yield start
    finally:
        codes = group.close()
        assert all(code is not None for code in codes.values())


# ---------------------------------------------------------------- configs


def test_the_shipped_config_passes_haproxy_check(tmp_path: Path) -> None:
    for env in ({}, HAProxyPorts.free(app=8000).env()):
        result = check_config(SHIPPED_CONFIG, env)
        assert result.ok, result.output


@pytest.mark.parametrize("flavour", ["fixed", "sliding"])
def test_the_shipped_rules_are_the_exporters_current_output(flavour: str) -> None:
    shipped = generated_part(SHIPPED_CONFIG.read_text(), flavour)
    assert shipped == export_fragment(flavour), "haproxy/haproxy.cfg is stale: run `python -m stack.haproxy regenerate`"


EVERYTHING = textwrap.dedent(
    """\
    domain: every-thing
    descriptors:
      - key: user
        rate_limit: {unit: hour, requests_per_unit: 7}
        descriptors:
          - key: path
            rate_limit: {unit: minute, requests_per_unit: 3}
      - key: user
        value: "it's a #1 $HOME }"
        rate_limit: {unit: second, requests_per_unit: 1}
      - key: user
        value: "-i"
        rate_limit: {unit: second, requests_per_unit: 2}
      - key: user
        value: "a*b.c"
        shadow_mode: true
        rate_limit: {unit: day, requests_per_unit: 9, name: odd}
      - key: plan
        value: gold
        rate_limit: {unit: week, requests_per_unit: 1000, replaces: [{name: odd}]}
      - key: generic_key
        rate_limit: {unit: second, requests_per_unit: 5}
    """
)
FLAGS = (
    "--fetch",
    "user=req.fhdr(x-user,1)",
    "--fetch",
    "path=path",
    "--fetch",
    "generic_key=req.fhdr(x-g,1)",
    "--when",
    "plan=gold",
    "req.fhdr(x-plan,1) -m str gold",
)


def frontend_around(fragment: str, peers: bool = False) -> str:
    """A minimal complete config with ``fragment`` at the end of its frontend."""
    head = textwrap.dedent(
        """\
        global
            nbthread 1
        defaults
            mode http
            timeout connect 1s
            timeout client 5s
            timeout server 5s
        frontend test
            bind 127.0.0.1:1
            default_backend app
        """
    )
    tail = "\nbackend app\n    server app1 127.0.0.1:2\n"
    if peers:
        tail += f"\npeers rl_peers\n    peer {socket.gethostname()} 127.0.0.1:3\n"
    return head + fragment + tail


def export_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``export-haproxy ARGS --allow-dropped`` (tests here export rules HAProxy leaves out on purpose)."""
    return subprocess.run(
        [sys.executable, "-m", "sidecar", "export-haproxy", *args, "--allow-dropped"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize("flavour", ["fixed", "sliding"])
@pytest.mark.parametrize(
    "inputs",
    [
        pytest.param(("demo", "--envoy", str(ENVOY)), id="demo-envoy"),
        pytest.param(("demo",), id="demo-flags-only"),
        pytest.param(("everything", *FLAGS), id="everything-flags"),
        pytest.param(("everything", *FLAGS, "--peers", "rl_peers", "--table-size", "10k"), id="peers"),
    ],
)
def test_every_exporter_output_passes_haproxy_check(tmp_path: Path, flavour: str, inputs: tuple[str, ...]) -> None:
    config = str(DEMO)
    if inputs[0] == "everything":
        config = str(tmp_path / "everything.yaml")
        Path(config).write_text(EVERYTHING)
    completed = export_cli(config, *inputs[1:], "--flavour", flavour)
    assert completed.returncode == 0, completed.stderr
    assert "backend rl_" in completed.stdout
    path = tmp_path / "haproxy.cfg"
    path.write_text(frontend_around(completed.stdout, peers="--peers" in inputs))
    result = check_config(path)
    assert result.ok, result.output + "\n" + path.read_text()


def test_cli_errors_are_one_line_with_status_1() -> None:
    for args, message in [
        (("/nonexistent/rules",), "ratelimit-sidecar: error: /nonexistent/rules: no such file or directory"),
        (
            (str(DEMO), "--flavour", "leaky"),
            "ratelimit-sidecar: error: unknown flavour 'leaky' (choose from fixed, sliding)",
        ),
    ]:
        completed = export_cli(*args)
        assert completed.returncode == 1
        assert completed.stdout == ""
        assert completed.stderr.splitlines() == [message]


# ---------------------------------------------------------------- the fixed flavour


@pytest.mark.slow
def test_fixed_admits_exactly_the_limit_per_window(start_haproxy: Callable[[], HAProxyProcess]) -> None:
    haproxy = start_haproxy()
    port = haproxy.ports.fixed

    def per_address() -> list[Reply]:
        client = Client(port)
        return [client.send("GET", "/page") for _ in range(26)]

    replies = in_one_window(per_address)
    assert [reply.status for reply in replies] == [200] * 20 + [429] * 6
    denied = replies[-1].headers
    assert denied["retry-after"] == "1"
    assert denied["x-ratelimit-limit"] == "20, 20;w=1"

    key = f"k{time.time_ns()}"

    def per_api_key() -> tuple[float, list[Reply], float]:
        client = Client(port)
        before = time.time()
        replies = [client.send("GET", "/api/items", {"x-api-key": f"{key}-{before}"}) for _ in range(13)]
        return before, replies, time.time()

    before, replies, after = in_one_window(per_api_key, unit=60, fresh_start=False)
    assert [reply.status for reply in replies] == [200] * 10 + [429] * 3
    retry = int(replies[-1].headers["retry-after"])
    assert retry in {60 - math.floor(moment) % 60 for moment in (before, after)}
    assert replies[-1].headers["x-ratelimit-limit"] == "10, 10;w=60"


@pytest.mark.slow
def test_a_new_window_gives_a_new_budget(start_haproxy: Callable[[], HAProxyProcess]) -> None:
    haproxy = start_haproxy()

    def two_seconds() -> tuple[list[int], list[int]] | None:
        client = Client(haproxy.ports.fixed)
        first = in_fresh_second(lambda: client.statuses(21))
        second = in_fresh_second(lambda: client.statuses(21))
        return None if first is None or second is None else (first, second)

    first, second = until_on_time(two_seconds)
    assert first == second == [200] * 20 + [429]


@pytest.mark.slow
def test_a_denied_request_spends_no_other_limit(start_haproxy: Callable[[], HAProxyProcess]) -> None:
    """All or nothing: only admitted requests count, in every limit they passed."""
    haproxy = start_haproxy()
    port = haproxy.ports.fixed
    tag = time.time_ns()

    def denied_by_the_api_key() -> tuple[list[int], list[int]]:
        client = Client(port)
        key = {"x-api-key": f"spent-{tag}-{client.address}"}
        with_key = client.statuses(10, path="/api", headers=key) + client.statuses(8, path="/api", headers=key)
        # 10 admitted, 8 refused by per_api_key: the address has spent 10 of its 20.
        without_key = client.statuses(11, path="/api")
        return with_key, without_key

    with_key, without_key = in_one_window(denied_by_the_api_key)
    assert with_key == [200] * 10 + [429] * 8
    assert without_key == [200] * 10 + [429]

    def denied_by_the_address() -> tuple[list[int], list[int]] | None:
        client = Client(port)
        key = {"x-api-key": f"kept-{tag}-{client.address}"}
        # Over remote_address, the 5 requests with the key must leave per_api_key untouched.
        refused = in_fresh_second(
            lambda: client.statuses(20, path="/page") + client.statuses(5, path="/api", headers=key)
        )
        later = in_fresh_second(lambda: client.statuses(11, path="/api", headers=key))
        return None if refused is None or later is None else (refused, later)

    refused, later = until_on_time(denied_by_the_address)
    assert refused == [200] * 20 + [429] * 5
    assert later == [200] * 10 + [429]


@pytest.mark.slow
def test_premium_keys_replace_the_route_cap_and_monitoring_is_unlimited(
    start_haproxy: Callable[[], HAProxyProcess],
) -> None:
    haproxy = start_haproxy()
    port = haproxy.ports.fixed
    tag = time.time_ns()

    def saturate_the_route() -> tuple[list[int], Reply, Reply, Reply]:
        clients = [Client(port) for _ in range(3)]
        statuses = [status for client in clients for status in client.statuses(17, path="/api/x")]
        other = Client(port)
        capped = other.send("GET", "/api/x")
        premium = other.send("GET", "/api/x", {"x-api-key": f"premium-{tag}"})
        monitoring = other.send("GET", "/api/x", {"x-api-key": "internal-monitoring"})
        return statuses, capped, premium, monitoring

    statuses, capped, premium, monitoring = in_one_window(saturate_the_route)
    assert statuses.count(200) == 50 and statuses[-1] == 429
    assert (capped.status, capped.headers["x-ratelimit-limit"]) == (429, "50, 50;w=1")
    assert premium.status == 200, "premium_key replaces api_route"
    assert monitoring.status == 429, "internal-monitoring is exempt from the key limit, not from the route cap"

    def monitoring_key() -> list[int]:
        return [Client(port).send("GET", "/api", {"x-api-key": "internal-monitoring"}).status for _ in range(15)]

    assert in_one_window(monitoring_key) == [200] * 15


@pytest.mark.slow
def test_writes_share_one_limit_across_routes(start_haproxy: Callable[[], HAProxyProcess]) -> None:
    haproxy = start_haproxy()

    def writes() -> list[int]:
        client = Client(haproxy.ports.fixed)
        paths = ["/api/a", "/login", "/page"] * 3
        return [client.send("POST", path).status for path in paths]

    assert in_one_window(writes) == [200] * 5 + [429] * 4


@pytest.mark.slow
def test_the_shadow_rule_counts_and_logs_but_never_denies(start_haproxy: Callable[[], HAProxyProcess]) -> None:
    haproxy = start_haproxy()

    def logins() -> tuple[str, list[int]]:
        client = Client(haproxy.ports.fixed)
        return client.address, client.statuses(5, path="/login")

    address, statuses = in_one_window(logins, unit=60, fresh_start=False)
    assert statuses == [200] * 5
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        lines = [line for line in haproxy.log_text().splitlines() if line.startswith(f"{address}:")]
        if len(lines) == 5:
            break
        time.sleep(0.02)
    assert [line.rsplit(" ", 1)[-1] for line in lines] == ["rl_shadow=-"] * 3 + ["rl_shadow=/r6"] * 2


@pytest.mark.slow
def test_long_keys_are_hashed_not_truncated(start_haproxy: Callable[[], HAProxyProcess]) -> None:
    """Two keys longer than the table's key length that share a long prefix keep separate counters."""
    haproxy = start_haproxy()
    prefix = f"{time.time_ns()}-" + "x" * 80

    def two_long_keys() -> list[list[int]]:
        client = Client(haproxy.ports.fixed)
        keys = [prefix + "a", prefix + "b", "y" * 4096]
        return [client.statuses(6, path="/api", headers={"x-api-key": key}) for key in keys]

    results = in_one_window(two_long_keys, unit=60, fresh_start=False)
    assert results == [[200] * 6] * 3
    keys = haproxy.table("rl_demo_fixed_minute")
    hashed = [key for key in keys if re.fullmatch(r"[0-9A-F]{32}", key)]
    assert len(hashed) == 3 and all(keys[key]["gpc0"] == 6 for key in hashed)


# ---------------------------------------------------------------- the same verdicts as the sidecar


WRITES = {"POST", "PUT", "PATCH", "DELETE"}


@dataclass(frozen=True)
class Call:
    method: str
    path: str
    address: str
    api_key: str | None = None

    def headers(self) -> dict[str, str]:
        return {} if self.api_key is None else {"x-api-key": self.api_key}

    def descriptors(self) -> list[list[tuple[str, str]]]:
        """The descriptors envoy/sidecar.yaml's route rate_limits send for this request."""
        found = [[("remote_address", self.address)]]
        if self.path.startswith("/api"):
            found.append([("generic_key", "api")])
            if self.api_key is not None:
                found.append([("generic_key", "api"), ("api_key", self.api_key)])
        elif self.path.startswith("/login"):
            found.append([("generic_key", "login"), ("remote_address", self.address)])
        if self.method in WRITES:
            found.append([("header_match", "write")])
        return found


def mixed_traffic(seed: int) -> list[Call]:
    """Every limit of the demo reached at least once, shuffled: ~130 requests."""
    tag = f"{seed}-{time.time_ns()}"
    a, b, c, d, e, f, g, h = (fresh_address() for _ in range(8))
    calls = (
        [Call("GET", "/api/items", a, f"key-a-{tag}")] * 25  # per_api_key 10/minute, then the address
        + [Call("GET", "/other", b)] * 22  # remote_address 20/second
        + [Call("GET", "/api/items", c, f"premium-{tag}")] * 15  # premium_key, exempt from api_route
        + [Call("GET", "/api", d, "internal-monitoring")] * 12  # no key limit, api_route applies
        + [Call("GET", "/api/list", e)] * 18  # api_route 50/second
        + [Call("POST", "/other", f)] * 8  # writes 5/second
        + [Call("GET", "/login", g)] * 6  # login_attempts, shadow mode
        + [Call("DELETE", "/api/items", h, f"key-h-{tag}")] * 20  # writes, api_route, per_api_key
    )
    random.Random(seed).shuffle(calls)
    return calls


@dataclass
class Comparison:
    expected: list[bool] = field(default_factory=list)
    fixed: list[bool] = field(default_factory=list)
    sliding: list[bool] = field(default_factory=list)


def compare_with_the_sidecar(haproxy: HAProxyProcess, calls: Sequence[Call]) -> Comparison:
    """Send each call to both frontends and ask the sidecar about the same descriptors."""
    service = RateLimitService(load_config(DEMO), MemoryLimiter())
    loop = asyncio.new_event_loop()
    clients: dict[tuple[int, str], Client] = {}
    result = Comparison()
    try:
        for call in calls:
            for flavour, verdicts in (("fixed", result.fixed), ("sliding", result.sliding)):
                port = haproxy.ports.port(flavour)
                client = clients.setdefault((port, call.address), Client(port, call.address))
                verdicts.append(client.send(call.method, call.path, call.headers()).status == 200)
            answer = loop.run_until_complete(service.decide(request("demo", *call.descriptors())))
            result.expected.append(answer.overall_code == OK)
    finally:
        loop.close()
        for client in clients.values():
            client.close()
    return result


@pytest.mark.slow
def test_both_flavours_refuse_what_the_sidecar_refuses(start_haproxy: Callable[[], HAProxyProcess]) -> None:
    """Same requests, same verdicts, request by request.

    The sliding flavour agrees here because every counter is fresh and the run is shorter than
    one window: HAProxy starts an entry's rate period at its first increment, so nothing of a
    previous period is counted yet. Past that it differs on purpose (see the next test).
    """
    for seed in range(1, 5):
        haproxy = start_haproxy()  # empty tables for every try
        calls = mixed_traffic(seed)
        wait_for_window_start()
        before = time.time()
        result = compare_with_the_sidecar(haproxy, calls)
        if window_of(before, 1) == window_of(time.time(), 1):
            break
        haproxy.stop()
    else:
        raise AssertionError("no run fitted in one second")
    assert result.expected.count(False) >= 40, "the traffic must reach the limits"
    mismatches = [
        (index, calls[index], result.expected[index], result.fixed[index], result.sliding[index])
        for index in range(len(calls))
        if not result.expected[index] == result.fixed[index] == result.sliding[index]
    ]
    assert mismatches == []


def sleep_until(moment: float) -> None:
    time.sleep(max(0.0, moment - time.time()))


@dataclass
class Timeline:
    """Status lists of the three phases of the test below, and whether the run kept to its timeline."""

    spent: tuple[list[int], list[int]]
    next_clock_second: tuple[list[int], list[int]]
    after_rotation: list[int]
    on_time: bool


def rate_timeline(haproxy: HAProxyProcess) -> Timeline:
    wait_for_window_start()
    second = math.floor(time.time())
    fixed, sliding = Client(haproxy.ports.fixed), Client(haproxy.ports.sliding)
    sleep_until(second + 0.5)
    spent_fixed = fixed.statuses(21)
    period_from = time.time()  # the sliding entry's first period begins with its first increment
    spent = spent_fixed, sliding.statuses(21)
    period_to = time.time()
    sleep_until(second + 1.05)
    next_started = time.time()
    next_clock_second = fixed.statuses(21), sliding.statuses(20)
    next_ended = time.time()
    sleep_until(period_to + 1.25)
    rotation_started = time.time()
    after_rotation = sliding.statuses(20)
    rotation_ended = time.time()
    on_time = (
        period_to < second + 1 <= next_started
        and next_ended < period_from + 1
        and rotation_started - period_to - 1 >= 0.05  # the sliding period has rotated...
        and rotation_ended - period_from - 1 <= 0.45  # ...less than half a period ago
        and rotation_ended < second + 2
    )
    return Timeline(spent, next_clock_second, after_rotation, on_time)


@pytest.mark.slow
def test_sliding_counts_a_rate_not_clock_windows(start_haproxy: Callable[[], HAProxyProcess]) -> None:
    """The documented difference. A client spends its 20 per second half way through a clock second:
    at the next clock second the fixed flavour gives it 20 more (40 within about half a second), the
    sliding one gives nothing until its own period (which began at the first admitted request) ends,
    and then only what the decaying estimate of the previous period leaves room for."""
    haproxy = start_haproxy()
    for _ in range(3):
        timeline = rate_timeline(haproxy)  # fresh addresses every time
        if timeline.on_time:
            break
    else:
        raise AssertionError("the machine was too slow to keep the timeline in 3 tries")
    assert timeline.spent == ([200] * 20 + [429], [200] * 20 + [429])
    assert timeline.next_clock_second == ([200] * 20 + [429], [429] * 20)
    # The rotated period has room for at least one (it rotated 50 ms or more before), and the
    # previous period still weighs 20 * (1 - elapsed share), elapsed < 0.45. The estimate
    # decays while the 20 are sent, so on a slow machine a late one may find room a refused
    # one did not: the order of 200s and 429s is not checked, only the room.
    admitted = timeline.after_rotation.count(200)
    assert timeline.after_rotation[0] == 200, timeline.after_rotation
    assert 1 <= admitted <= 10, f"the previous period weighs 20 * (1 - elapsed share) still: got {admitted}"


@pytest.mark.slow
@pytest.mark.parametrize("flavour", ["fixed", "sliding"])
def test_waiting_retry_after_is_enough(start_haproxy: Callable[[], HAProxyProcess], flavour: str) -> None:
    """A refused client that waits Retry-After seconds (and sends nothing meanwhile) is admitted."""
    haproxy = start_haproxy()
    client = Client(haproxy.ports.port(flavour))
    statuses = client.statuses(20)
    refused = client.send()
    assert statuses == [200] * 20 and refused.status == 429
    time.sleep(int(refused.headers["retry-after"]) + 0.01)
    assert client.send().status == 200


# ---------------------------------------------------------------- config extensions

EXTENSIONS = REPO / "examples" / "extensions"


def envoy_yaml(domain: str, routes: str) -> str:
    """A minimal Envoy config: one listener, the rate-limit filter of ``domain``, ``routes`` (a YAML list)."""
    return minimal_envoy_config(routes, domain)


EXTENSIONS_ENVOY = envoy_yaml("extensions", EXTENSIONS_ROUTES)
"""Routes for examples/extensions that keep every route within HAProxy's three trackers."""


@pytest.mark.parametrize("flavour", ["fixed", "sliding"])
@pytest.mark.parametrize("inputs", ["envoy", "flags", "peers"])
def test_extension_exports_pass_haproxy_check(tmp_path: Path, flavour: str, inputs: str) -> None:
    """examples/extensions: sliding windows, windows of several units, several limits on one key and a
    ban (a token bucket is listed, not exported)."""
    envoy = tmp_path / "envoy.yaml"
    envoy.write_text(EXTENSIONS_ENVOY)
    args = {
        "envoy": ("--envoy", str(envoy)),
        "flags": EXTENSION_FLAGS,
        "peers": ("--envoy", str(envoy), "--peers", "rl_peers", "--table-size", "10k"),
    }[inputs]
    completed = export_cli(str(EXTENSIONS), *args, "--flavour", flavour)
    assert completed.returncode == 0, completed.stderr
    assert "token_bucket" in completed.stderr
    assert f"backend rl_extensions_{flavour}_second" in completed.stdout
    if inputs != "flags":
        assert f"backend rl_extensions_{flavour}_bans" in completed.stdout
        assert f"backend rl_extensions_{flavour}_300s" in completed.stdout
    path = tmp_path / "haproxy.cfg"
    path.write_text(frontend_around(completed.stdout, peers=inputs == "peers"))
    result = check_config(path)
    assert result.ok, result.output + "\n" + path.read_text()


CORNERS = textwrap.dedent(
    """\
    domain: corners
    descriptors:
      - key: user                  # four limits: the day one finds no tracker, the minute one no ban tracker
        rate_limits:
          - {unit: second, requests_per_unit: 1}
          - {unit: minute, requests_per_unit: 2, ban_duration: 30}
          - {unit: hour, requests_per_unit: 3}
          - {unit: day, requests_per_unit: 4}
      - key: long_ban              # a ban past HAProxy's timers: the limit alone
        rate_limit: {unit: second, requests_per_unit: 1, ban_duration: 30d}
      - key: both                  # two banned limits sharing one ban entry and tracker
        rate_limits:
          - {unit: second, requests_per_unit: 5, ban_duration: 20, algorithm: sliding_window}
          - {unit: second, requests_per_unit: 7, ban_duration: 40}
      - key: shadowed              # shadow, sliding, 60 x 1 s, a ban started on one route only
        shadow_mode: true
        rate_limit:
          {unit: second, unit_multiplier: 60, requests_per_unit: 3, ban_duration: 5, algorithm: sliding_window}
    """
)
CORNER_ROUTES = """\
- match: {prefix: "/u"}
  route: {rate_limits: [{actions: [{request_headers: {header_name: x-u, descriptor_key: user}}]}]}
- match: {prefix: "/l"}
  route: {rate_limits: [{actions: [{request_headers: {header_name: x-l, descriptor_key: long_ban}}]}]}
- match: {prefix: "/b"}
  route:
    rate_limits:
      - actions: [{request_headers: {header_name: x-b, descriptor_key: both}}]
      - actions: [{request_headers: {header_name: x-s, descriptor_key: shadowed}}]
- match: {prefix: "/"}
  route: {rate_limits: [{actions: [{request_headers: {header_name: x-s, descriptor_key: shadowed}}]}]}
"""


@pytest.mark.parametrize("flavour", ["fixed", "sliding"])
def test_corner_cases_of_the_extensions_pass_haproxy_check(tmp_path: Path, flavour: str) -> None:
    rules = tmp_path / "corners.yaml"
    rules.write_text(CORNERS)
    envoy = tmp_path / "envoy.yaml"
    envoy.write_text(envoy_yaml("corners", CORNER_ROUTES))
    completed = export_cli(str(rules), "--envoy", str(envoy), "--flavour", flavour)
    assert completed.returncode == 0, completed.stderr
    assert "a running ban is enforced, but no ban starts here" in completed.stderr
    assert "t.user" not in completed.stderr and "corners.user rate_limits[3]" in completed.stderr
    assert "store gpt(3)" in completed.stdout
    path = tmp_path / "haproxy.cfg"
    path.write_text(frontend_around(completed.stdout))
    result = check_config(path)
    assert result.ok, result.output + "\n" + path.read_text()


BEHAVIOUR = textwrap.dedent(
    """\
    domain: beh
    descriptors:
      - key: banned
        rate_limit: {unit: second, unit_multiplier: 2, requests_per_unit: 3, ban_duration: 3}
      - key: sliding
        rate_limit: {unit: second, requests_per_unit: 5, algorithm: sliding_window}
    """
)
BEHAVIOUR_FLAGS = ("--fetch", "banned=req.fhdr(x-ban,1)", "--fetch", "sliding=req.fhdr(x-slide,1)")


def two_frontends(fixed: str, sliding: str) -> str:
    """A config serving both flavours of an export on the ports of :class:`HAProxyPorts`, answering 200
    itself (no upstream) once the rules let a request through."""
    parts = []
    backends = []
    for name, fragment in (("fixed", fixed), ("sliding", sliding)):
        frontend, _, tables = fragment.partition("\nbackend ")
        port = f"RL_{name.upper()}_PORT"
        parts.append(
            f'frontend {name}\n    bind "${{RL_BIND_ADDR-127.0.0.1}}:${{{port}}}"\n{frontend}\n'
            "    http-request return status 200 content-type text/plain string ok\n"
        )
        backends.append("backend " + tables)
    head = textwrap.dedent(
        """\
        global
            nbthread 1
        defaults
            mode http
            timeout connect 1s
            timeout client 5s
            timeout server 5s
        """
    )
    return head + "\n".join(parts) + "\n" + "\n".join(backends)


@pytest.fixture
def behaviour_haproxy(tmp_path: Path) -> Iterator[tuple[HAProxyProcess, Path]]:
    """HAProxy running both flavours of the BEHAVIOUR rules, and the rules' file."""
    rules = tmp_path / "rules.yaml"
    rules.write_text(BEHAVIOUR)
    fragments = []
    for flavour in ("fixed", "sliding"):
        completed = export_cli(str(rules), *BEHAVIOUR_FLAGS, "--flavour", flavour)
        assert completed.returncode == 0, completed.stderr
        fragments.append(completed.stdout)
    config = tmp_path / "haproxy.cfg"
    config.write_text(two_frontends(*fragments))
    checked = check_config(config, HAProxyPorts.free(app=1).env())
    assert checked.ok, checked.output
    group = ProcessGroup()
    try:
        haproxy = HAProxyProcess("haproxy", HAProxyPorts.free(app=1), tmp_path, config=config)
        group.start(haproxy)
        haproxy.wait_ready()
        yield haproxy, rules
    finally:
        group.close()


@dataclass
class BanRun:
    before_ban: list[int]
    retry_after: str
    during: list[int]
    after: int
    on_time: bool


def ban_run(port: int) -> BanRun:
    """Spend 3 of 3 per 2 s, go over (a 3 s ban from then, ended at a whole second), keep sending during
    the ban, then send once just after it ends."""
    wait_for_window_start(2, margin=0.05)
    client = Client(port)
    key = {"x-ban": f"b{time.time_ns()}"}
    before_ban = client.statuses(3, headers=key)
    started = time.time()
    over = client.send(headers=key)
    ends = math.ceil(time.time() + 3)  # the latest end a ban started during that request can have
    earliest = math.ceil(started + 3)
    during = []
    last_answered = time.time()
    while time.time() < earliest - 0.15:
        during.append(client.send(headers=key).status)
        last_answered = time.time()
        time.sleep(0.1)
    # Late only if an answer during the ban came close to its earliest end (a stalled machine);
    # the loop's last sleep may run past that point without making any answer late.
    late = last_answered > earliest - 0.1
    sleep_until(ends + 0.05)
    after = client.send(headers=key).status
    return BanRun([*before_ban, over.status], over.headers.get("retry-after", ""), during, after, not late)


@pytest.mark.serial
@pytest.mark.slow
@pytest.mark.parametrize("flavour", ["fixed", "sliding"])
def test_a_ban_refuses_for_its_length_and_is_not_extended(
    behaviour_haproxy: tuple[HAProxyProcess, Path], flavour: str
) -> None:
    haproxy, _ = behaviour_haproxy

    def attempt() -> BanRun | None:
        run = ban_run(haproxy.ports.port(flavour))
        return run if run.on_time else None

    run = until_on_time(attempt)
    assert run.before_ban == [200, 200, 200, 429]
    assert run.retry_after in {"3", "4"}, "the ban's end, rounded up to a whole second"
    assert len(run.during) >= 20 and set(run.during) == {429}, "every request is refused while banned"
    assert run.after == 200, "requests during the ban did not extend it"


def sliding_run(port: int, rules: Path) -> tuple[list[tuple[float, list[bool], list[bool]]], bool]:
    """Bursts at chosen points of three clock seconds, each sent to HAProxy and then to the sidecar."""
    service = RateLimitService(load_config(rules), MemoryLimiter())
    loop = asyncio.new_event_loop()
    client = Client(port)
    key = f"s{time.time_ns()}"
    # Offsets within each second where the previous second's weight times any count 1..5 is at
    # least 0.1 away from a whole number: a millisecond between HAProxy and the sidecar cannot
    # change the rounding.
    plan = [(0.45, 7), (1.15, 5), (1.45, 4), (2.15, 6), (2.85, 3), (3.45, 4)]
    wait_for_window_start()
    base = math.floor(time.time())
    results = []
    on_time = True
    try:
        for offset, count in plan:
            sleep_until(base + offset)
            haproxy, sidecar = [], []
            for _ in range(count):
                haproxy.append(client.send(headers={"x-slide": key}).status == 200)
                answer = loop.run_until_complete(service.decide(request("beh", [("sliding", key)])))
                sidecar.append(answer.overall_code == OK)
            on_time = on_time and time.time() < base + offset + 0.04
            results.append((offset, haproxy, sidecar))
    finally:
        loop.close()
        client.close()
    return results, on_time


@pytest.mark.serial
@pytest.mark.slow
def test_the_fixed_flavour_computes_the_sidecars_sliding_window(
    behaviour_haproxy: tuple[HAProxyProcess, Path],
) -> None:
    """A sliding_window rule in the fixed flavour: the same verdicts as the sidecar, request by request
    (HAProxy's own gpc_rate would not agree: its periods start at the first request, not the clock)."""
    haproxy, rules = behaviour_haproxy

    def attempt() -> list[tuple[float, list[bool], list[bool]]] | None:
        results, on_time = sliding_run(haproxy.ports.fixed, rules)
        return results if on_time else None

    results = until_on_time(attempt)
    assert [(offset, got) for offset, got, _ in results] == [(offset, want) for offset, _, want in results]
    admitted = [sum(got) for _, got, _ in results]
    assert admitted[0] == 5 and admitted[1] < 5, "the previous second weighs in: fewer than a fixed window's 5"


HOSTS_RULES = textwrap.dedent(
    """\
    domain: hosts
    descriptors:
      - {key: generic_key, value: vh, rate_limit: {unit: second, requests_per_unit: 2}}
      - {key: generic_key, value: wild, rate_limit: {unit: second, requests_per_unit: 3}}
    """
)
HOSTS_ENVOY = textwrap.dedent(
    """\
    static_resources:
      listeners:
        - name: ingress
          filter_chains:
            - filters:
                - name: envoy.filters.network.http_connection_manager
                  typed_config:
                    route_config:
                      virtual_hosts:
                        - name: api
                          domains: [api.example.com]
                          routes: [{match: {prefix: /}, route: {cluster: app}}]
                        - name: tenants
                          domains: ["*.example.com"]
                          routes:
                            - match: {prefix: /}
                              route: {cluster: app, rate_limits: [{actions: [{generic_key: {descriptor_value: wild}}]}]}
                        - name: rest
                          domains: ["*"]
                          routes:
                            - match: {prefix: /}
                              route: {cluster: app, rate_limits: [{actions: [{generic_key: {descriptor_value: vh}}]}]}
                    http_filters:
                      - name: envoy.filters.http.ratelimit
                        typed_config: {domain: hosts}
    """
)


@pytest.mark.slow
def test_each_virtual_host_keeps_its_limits_in_haproxy(tmp_path: Path) -> None:
    """Issue 29 on the HAProxy side: a host's limits never count another host's requests
    (api.example.com has none; *.example.com and '*' have their own), Host read as Envoy does."""
    rules, envoy = tmp_path / "rules.yaml", tmp_path / "envoy.yaml"
    rules.write_text(HOSTS_RULES)
    envoy.write_text(HOSTS_ENVOY)
    fragments = []
    for flavour in ("fixed", "sliding"):
        completed = export_cli(str(rules), "--envoy", str(envoy), "--flavour", flavour)
        assert completed.returncode == 0, completed.stderr
        assert completed.stderr == ""
        fragments.append(completed.stdout)
    config = tmp_path / "haproxy.cfg"
    config.write_text(two_frontends(*fragments))
    ports = HAProxyPorts.free(app=1)
    checked = check_config(config, ports.env())
    assert checked.ok, checked.output
    group = ProcessGroup()
    try:
        haproxy = HAProxyProcess("haproxy", ports, tmp_path, config=config)
        group.start(haproxy)
        haproxy.wait_ready()
        for flavour in ("fixed", "sliding"):
            client = Client(ports.port(flavour))

            def burst(client: Client = client) -> list[int]:
                hosts = ("api.example.com", "www.example.com", "API.example.com", "other.org", "example.com")
                return [client.statuses(5, headers={"Host": host}).count(200) for host in hosts]

            # api: no limit; *.example.com: 3/s; the exact domain wins whatever its case; '*': 2/s,
            # shared by other.org and example.com (not *.example.com: the wildcard needs a character).
            assert in_one_window(burst) == [5, 3, 5, 2, 0], flavour
            client.close()
            time.sleep(1.1)  # the sliding flavour's rate: the next flavour starts on other tables anyway
    finally:
        group.close()
