"""The local demo: the whole stack on 127.0.0.1 and a scripted run through both Envoys.

Run through ``scripts/demo`` (which sets everything up first). It starts redis-server,
two sidecars in sync mode sharing it, two Envoys (``envoy/front.yaml``) each calling
its own sidecar, two sample upstream apps, and HAProxy when its config is shipped;
then it sends requests through both Envoys, shows where the 429s start and the
``x-ratelimit-*`` headers, and prints admitted vs limit per limit. Without Redis it
runs on the embedded backend and says so. A quota-mode pod (``envoy/quota.yaml``, the same
limits exported by ``export-envoy-quota``: Envoy enforces in-process, its sidecar assigns)
gets the same bursts, and its admitted counts are shown beside the per-request path's.
Ctrl-C (or SIGTERM) stops every process.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import shutil
import signal
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sidecar.settings import Settings
from stack.processes import REPO, StartError
from stack.topology import Stack, StackOptions, running_stack

LOG_DIR = REPO / ".run" / "demo"
RATELIMIT_HEADERS = (
    "x-envoy-ratelimited",
    "x-ratelimit-limit",
    "x-ratelimit-remaining",
    "x-ratelimit-reset",
    "retry-after",
)
ENVOYS = "envoys"
"""A step's ``via``: alternate between every Envoy (otherwise a HAProxy flavour)."""


@dataclass
class Reply:
    """One HTTP answer: which proxy gave it, its status and the rate-limit headers."""

    via: str
    status: int
    headers: dict[str, str]


class Clients:
    """One keep-alive HTTP connection per proxy; requests alternate between them."""

    def __init__(self, targets: Sequence[tuple[str, str]]) -> None:
        self.names = [name for name, _ in targets]
        self.connections = [http.client.HTTPConnection(url.removeprefix("http://"), timeout=5) for _, url in targets]

    def send(self, index: int, method: str, path: str, headers: dict[str, str]) -> Reply:
        slot = index % len(self.connections)
        connection = self.connections[slot]
        try:
            connection.request(method, path, headers=headers)
            response = connection.getresponse()
        except (OSError, http.client.HTTPException):
            connection.close()  # Envoy closed the idle connection: reconnect once
            connection.request(method, path, headers=headers)
            response = connection.getresponse()
        response.read()
        kept = {name.lower(): value for name, value in response.getheaders() if name.lower() in RATELIMIT_HEADERS}
        return Reply(self.names[slot], response.status, kept)

    def close(self) -> None:
        for connection in self.connections:
            connection.close()


@dataclass
class Step:
    """One scripted burst and the limit it is meant to reach."""

    title: str
    limit_label: str
    expected: int | None
    """Admitted hits the limit allows for this burst (None: all of them, nothing enforced)."""
    method: str
    path: str
    headers: dict[str, str]
    count: int
    unit_seconds: int
    via: str = ENVOYS
    replies: list[Reply] = field(default_factory=list)
    quota_replies: list[Reply] = field(default_factory=list)
    """The same burst through the quota-mode Envoy (Envoy steps, when it runs)."""
    quota_seconds: float = 0.0
    """How long that burst took: the token bucket refills meanwhile."""

    @property
    def admitted(self) -> int:
        return sum(reply.status == 200 for reply in self.replies)

    @property
    def quota_admitted(self) -> int:
        return sum(reply.status == 200 for reply in self.quota_replies)


def steps(haproxy: bool = False) -> list[Step]:
    """The tour: each step uses its own client address, so steps never share a counter."""
    return [*envoy_steps(), *(haproxy_steps() if haproxy else [])]


def haproxy_steps() -> list[Step]:
    """The per-address limit again, as HAProxy stick tables enforce it (haproxy/haproxy.cfg).

    HAProxy keys it by the connection's source (the config trusts no X-Forwarded-For),
    so all of the demo's requests count as one client there.
    """
    return [
        Step(
            f"HAProxy, {flavour} flavour: the same 20/second per address as stick tables, 30 requests",
            f"HAProxy {flavour}: 20/second per address",
            20, "GET", "/", {}, 30, 1, via=flavour,
        )
        for flavour in ("fixed", "sliding")
    ]  # fmt: skip


def envoy_steps() -> list[Step]:
    """Steps through the Envoys and sidecars."""
    return [
        Step(
            "One client address, 30 requests within one second, alternating between the Envoys",
            "remote_address: 20/second per address",
            20, "GET", "/", {"x-forwarded-for": "203.0.113.7"}, 30, 1,
        ),
        Step(
            "API key 'alice': 12 requests (x-api-key header) on /api",
            "per_api_key: 10/minute per key",
            10, "GET", "/api/items", {"x-forwarded-for": "203.0.113.8", "x-api-key": "alice"}, 12, 60,
        ),
        Step(
            "Premium key 'premium-bob': 12 requests; its own limit, and it replaces the route cap",
            "premium_key: 100/minute per key",
            None, "GET", "/api/items", {"x-forwarded-for": "203.0.113.9", "x-api-key": "premium-bob"}, 12, 60,
        ),
        Step(
            "Writes: 8 POSTs within one second",
            "header_match=write: 5/second",
            5, "POST", "/orders", {"x-forwarded-for": "203.0.113.10"}, 8, 1,
        ),
        Step(
            "Login attempts: 5 in a minute; the 3/minute limit is in shadow mode (counted, never enforced)",
            "login_attempts: 3/minute (shadow)",
            None, "POST", "/login", {"x-forwarded-for": "203.0.113.11"}, 5, 60,
        ),
    ]  # fmt: skip


def wait_for_fresh_window(unit_seconds: int, needed: float = 2.0) -> None:
    """Sleep to the next second (so per-second counters start from zero, whatever the
    step before spent), and to the next window when fewer than ``needed`` seconds are
    left in this one: a burst is counted in one window (aligned to the Unix clock)."""
    now = time.time()
    left = unit_seconds - now % unit_seconds
    time.sleep((left if left < needed else 1 - now % 1) + 0.01)


SECOND_STEP_ATTEMPTS = 3
"""A per-second burst that a stalled machine stretched across a second boundary (two windows,
so more is admitted than one window allows) is sent again in the next second, this often at most."""


def run_step(stack: Stack, step: Step) -> None:
    clients = Clients(targets(stack, step.via))
    try:
        for _ in range(SECOND_STEP_ATTEMPTS if step.unit_seconds == 1 else 1):
            wait_for_fresh_window(step.unit_seconds)
            began = time.time()
            step.replies = [clients.send(index, step.method, step.path, step.headers) for index in range(step.count)]
            if int(began // step.unit_seconds) == int(time.time() // step.unit_seconds):
                break
    finally:
        clients.close()
    if stack.quota is not None and step.via == ENVOYS:
        run_quota_step(stack, step)


QUOTA_GAP = 1.05
"""Seconds between two quota bursts: some buckets are not per step (the 5/second ``write``
limit counts every POST), and a per-second token bucket is full again after a second."""
_last_quota_burst = [-math.inf]


ASSIGNMENT_WAIT = 0.2
"""Seconds after a burst's first request, so its new buckets have their assignments (a few ms)."""


def run_quota_step(stack: Stack, step: Step) -> None:
    """The step's burst through the quota-mode Envoy (token buckets: no window to wait for).

    Its first request creates the step's buckets: Envoy answers it by their
    ``no_assignment_behavior`` (ALLOW_ALL, no token spent) and asks the sidecar, which
    assigns them within a few ms; the rest of the burst follows :data:`ASSIGNMENT_WAIT` later.
    """
    assert stack.quota is not None
    time.sleep(max(0.0, _last_quota_burst[0] + QUOTA_GAP - time.monotonic()))
    quota = Clients([(stack.quota.envoy.label, stack.quota.envoy.url)])
    try:
        first = quota.send(0, step.method, step.path, step.headers)
        time.sleep(ASSIGNMENT_WAIT)
        started = time.monotonic()
        rest = [quota.send(0, step.method, step.path, step.headers) for _ in range(step.count - 1)]
        step.quota_seconds = time.monotonic() - started
        step.quota_replies = [first, *rest]
    finally:
        quota.close()
        _last_quota_burst[0] = time.monotonic()


def open_quota_streams(stack: Stack, tour: Sequence[Step], timeout: float = 5.0) -> None:
    """Each step's request once, from an address of its own, so that Envoy opens the RLQS
    stream of every quota filter the tour uses (one per filter, opened by its first bucket)
    before the bursts; waits until the sidecar has them all."""
    assert stack.quota is not None
    quota = Clients([(stack.quota.envoy.label, stack.quota.envoy.url)])
    try:
        for step in tour:
            quota.send(0, step.method, step.path, {**step.headers, "x-forwarded-for": "192.0.2.1"})
    finally:
        quota.close()
    filters = quota_filter_count(stack.quota.envoy.config_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and len(quota_config(stack)["streams"]) < filters:
        time.sleep(0.05)
    time.sleep(ASSIGNMENT_WAIT)


def quota_filter_count(config_path: Path) -> int:
    return config_path.read_text().count("name: envoy.filters.http.rate_limit_quota")


def quota_config(stack: Stack) -> dict[str, Any]:
    """The quota sidecar's ``/config`` ``quota`` object (streams, live buckets)."""
    assert stack.quota is not None
    with urllib.request.urlopen(stack.quota.sidecar.metrics_url + "/config", timeout=2) as reply:
        found: dict[str, Any] = json.load(reply)["quota"]
    return found


def quota_bound(step: Step) -> int:
    """What the quota path may admit beyond the limit for this burst: the first request (its new
    buckets' ALLOW_ALL, no token spent), and the refill at limit / window while the burst runs."""
    assert step.expected is not None
    return 1 + math.ceil(step.expected * step.quota_seconds / step.unit_seconds)


def targets(stack: Stack, via: str) -> list[tuple[str, str]]:
    """``(name, url)`` of the proxies a step goes through."""
    if via == ENVOYS:
        return [(replica.envoy.label, replica.envoy.url) for replica in stack.replicas]
    assert stack.haproxy is not None
    return [(f"haproxy {via}", stack.haproxy.url(via))]


def describe_step(step: Step) -> list[str]:
    """What a user should see: admitted per proxy, the first 429 and its headers."""
    per_proxy: dict[str, tuple[int, int]] = {}
    for reply in step.replies:
        sent, admitted = per_proxy.get(reply.via, (0, 0))
        per_proxy[reply.via] = (sent + 1, admitted + (reply.status == 200))
    spread = ", ".join(f"{via} {admitted}/{sent}" for via, (sent, admitted) in sorted(per_proxy.items()))
    lines = [f"  {step.count} requests -> {step.admitted} admitted ({spread})"]
    rejected = [index for index, reply in enumerate(step.replies) if reply.status == 429]
    if rejected:
        first = step.replies[rejected[0]]
        lines.append(f"  first 429 at request {rejected[0] + 1} (through {first.via}); its headers:")
        shown = first
    else:
        lines.append("  no 429; headers of the last response:")
        shown = step.replies[-1]
    lines += [f"    {name}: {shown.headers[name]}" for name in RATELIMIT_HEADERS if name in shown.headers]
    if step.quota_replies:
        lines.append(
            f"  quota mode ({step.quota_replies[0].via}, Envoy enforces in-process): the same"
            f" {len(step.quota_replies)} requests -> {step.quota_admitted} admitted"
            f" in {step.quota_seconds * 1000:.0f} ms"
        )
    return lines


def overshoot_bound(mode: str, limit: int, replicas: int) -> int:
    """Hits a mode may admit beyond ``limit`` across ``replicas`` (README, accuracy):
    sync ``(R - 1) * Q`` with the default 5 % overshoot; local (``--instances R``) each
    replica enforces ``ceil(limit / R)``; strict none."""
    if replicas <= 1 or mode == "strict":
        return 0
    if mode == "local":
        return replicas * math.ceil(limit / replicas) - limit
    return (replicas - 1) * math.floor(Settings.sync_max_overshoot * limit / (replicas - 1))


def verdict(step: Step, allowed: int, mode: str, bound: int) -> str:
    if step.admitted == allowed:
        return "exact"
    if allowed < step.admitted <= allowed + bound:
        return f"within {mode} mode's bound (+{bound})"
    return "DIFFERS from the config"


def summary(done: Sequence[Step], stack: Stack) -> list[str]:
    """One line per limit: admitted vs what the limit allows for that burst."""
    lines = ["", "Summary (admitted vs what the limit allows, per burst):"]
    for step in done:
        allowed = step.count if step.expected is None else step.expected
        mode, replicas = (stack.mode, len(stack.replicas)) if step.via == ENVOYS else ("haproxy", 1)
        bound = overshoot_bound(mode, allowed, replicas) if step.expected is not None else 0
        lines.append(
            f"  {step.limit_label:<40} admitted {step.admitted:>3} of {step.count:<3} allowed {allowed:<3} "
            + verdict(step, allowed, mode, bound)
        )
    quota = [step for step in done if step.quota_replies]
    if quota:
        lines += ["", "Quota mode, the same bursts (envoy/quota.yaml: a token bucket per bucket, in Envoy):"]
        for step in quota:
            allowed = step.count if step.expected is None else step.expected
            bound = quota_bound(step) if step.expected is not None else 0
            label = "quota " + step.limit_label
            lines.append(
                f"  {label:<46} admitted {step.quota_admitted:>3} of {step.count:<3} allowed {allowed:<3} "
                + quota_verdict(step.quota_admitted, allowed, bound)
            )
    return lines


def quota_verdict(admitted: int, allowed: int, bound: int) -> str:
    if admitted == allowed:
        return "exact"
    if allowed < admitted <= allowed + bound:
        return f"within quota mode's bound (+{bound}: the first request before the assignment, the refill)"
    return "DIFFERS from the config"


def tour(stack: Stack) -> list[Step]:
    """Send the scripted traffic through the proxies and print what happened."""
    done = []
    tour_steps = steps(haproxy=stack.haproxy is not None)
    if stack.quota is not None:
        open_quota_streams(stack, [step for step in tour_steps if step.via == ENVOYS])
    for number, step in enumerate(tour_steps, start=1):
        run_step(stack, step)
        print(f"\n{number}. {step.title}")
        print("\n".join(describe_step(step)))
        done.append(step)
    print("\n".join(summary(done, stack)))
    return done


def describe_stack(stack: Stack) -> Iterator[str]:
    """Where everything listens, and curl lines to try."""
    if stack.redis is not None:
        yield f"  redis-server   {stack.redis.url}"
    for replica in stack.replicas:
        yield (
            f"  {replica.envoy.label:<14} {replica.envoy.url}  (admin 127.0.0.1:{replica.envoy.ports.admin})"
            f" -> {replica.sidecar.label} {replica.sidecar.address} -> {replica.app.label} :{replica.app.port}"
        )
    sidecars = ", ".join(f"{replica.sidecar.metrics_url}/metrics" for replica in stack.replicas)
    yield f"  metrics        {sidecars} (also /config, /healthz)"
    yield f"  backend        {stack.backend_note}"
    if stack.xds is not None and stack.xds_limits is not None:
        where = stack.xds_limits.relative_to(REPO) if stack.xds_limits.is_relative_to(REPO) else stack.xds_limits
        yield (
            f"  xds-server     {stack.xds.address} serves {where}/ to the sidecars (--config-source xds):"
            " edit a file there and every sidecar takes it"
        )
    if stack.haproxy is not None:
        yield (
            f"  haproxy        {stack.haproxy.url('fixed')} (fixed windows), {stack.haproxy.url('sliding')}"
            f" (sliding) -> app-1, the same limits as stick tables (haproxy/haproxy.cfg)"
        )
    elif stack.haproxy_note:
        yield f"  haproxy        not started: {stack.haproxy_note}"
    if stack.quota is not None:
        pod = stack.quota
        yield (
            f"  {pod.envoy.label:<14} {pod.envoy.url}  (admin 127.0.0.1:{pod.envoy.admin}) quota mode,"
            f" envoy/quota.yaml -> {pod.sidecar.label} {pod.sidecar.address} (RLQS, embedded backend)"
            f" -> {pod.app.label} :{pod.app.port}"
        )
    yield f"  logs           {LOG_DIR.relative_to(REPO)}/"
    first = stack.envoy_urls[0]
    yield ""
    yield "Point curl at either Envoy, for example:"
    yield f"  curl -i {first}/api/items -H 'x-api-key: alice'"
    yield f"  curl -i {first}/ -H 'x-forwarded-for: 198.51.100.1'"
    yield f"  curl -i -X POST {first}/orders"


def parse_arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="scripts/demo", description=__doc__.splitlines()[0])
    parser.add_argument("--once", action="store_true", help="run the scripted tour and stop")
    parser.add_argument("--no-redis", action="store_true", help="use the embedded in-memory backend")
    parser.add_argument("--replicas", type=int, default=2, help="pods to start (default 2)")
    parser.add_argument("--no-haproxy", action="store_true", help="do not start HAProxy")
    parser.add_argument("--no-quota", action="store_true", help="do not start the quota-mode Envoy")
    parser.add_argument(
        "--xds",
        action="store_true",
        help="the sidecars' limits from a control plane (stack.xds_server) instead of files",
    )
    return parser.parse_args(argv)


def raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    arguments = parse_arguments(argv)
    signal.signal(signal.SIGTERM, raise_interrupt)
    shutil.rmtree(LOG_DIR, ignore_errors=True)
    LOG_DIR.mkdir(parents=True)
    options = StackOptions(
        replicas=arguments.replicas,
        use_redis=not arguments.no_redis,
        envoy_ports=[10000 + index for index in range(arguments.replicas)],
        haproxy=not arguments.no_haproxy,
        quota=not arguments.no_quota,
        quota_port=10000 + arguments.replicas,
        xds=arguments.xds,
    )
    print("Starting the local stack on 127.0.0.1 ...", flush=True)
    try:
        with running_stack(LOG_DIR, options) as stack:
            print("\n".join(describe_stack(stack)), flush=True)
            tour(stack)
            if not arguments.once:
                print("\nEverything keeps running. Ctrl-C stops it.", flush=True)
                while True:
                    signal.pause()  # until SIGINT or SIGTERM raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass
    except StartError as error:
        print(f"demo: {error}", file=sys.stderr)
        return 1
    print("\nDemo stopped; every process it started has exited.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
