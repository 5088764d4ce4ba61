"""Quota mode end to end: real Envoy 1.40's ``rate_limit_quota`` filter, a real sidecar
process serving RLQS, a real upstream.

Envoy refills an assigned token bucket continuously at ``tokens_per_fill / fill_interval``
tokens per second, up to ``max_tokens``, and a new assignment starts full. So with
``M = max_tokens`` and ``r`` that rate, a burst at time ``t`` admits
``min(M, tokens left + r * (t - previous burst))`` (whole tokens, rounded down), and
bursts at least ``M / r`` seconds apart each admit exactly ``M``. Over a steady stream
of ``T`` seconds from a full bucket, ``M + floor(r * T)`` requests are admitted. The
tests send bursts at moments chosen away from token boundaries, so the counts are exact.
"""

from __future__ import annotations

import http.client
import itertools
import json
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from sidecar.client import health_status
from sidecar.protos.envoy.service.rate_limit_quota.v3 import rlqs_pb2
from sidecar.quota.buckets import bucket_of
from stack.processes import process_group
from stack.quota_envoy import (
    QUOTA_CONFIG,
    RELOADED_CONFIG,
    QuotaEnvoy,
    http_get,
    metrics,
    quota_sidecar,
    rss_kib,
)
from stack.upstream import UpstreamProcess
from tests.support.envoys import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.envoy]
CLIENTS = (f"client-{time.time_ns()}-{n}" for n in itertools.count())
"""A new client per test: every test has buckets of its own."""
STREAM_CAP = 2000
"""The module's per-stream bucket cap (the default is 20,000): the hostile stream crosses it by 500."""
FLAGS = ("--quota-ttl", "6", "--quota-idle-abandon", "10", "--quota-max-buckets-per-stream", str(STREAM_CAP))


@contextmanager
def quota_stack(directory: Path, *flags: str) -> Iterator[SimpleNamespace]:
    config = directory / "config"
    config.mkdir(parents=True, exist_ok=True)
    (config / "quota.yaml").write_text(QUOTA_CONFIG)
    with process_group() as group:
        app = group.start_ready(lambda: UpstreamProcess("app", directory))
        sidecar = group.start_ready(lambda: quota_sidecar(directory, config, *FLAGS, *flags))
        envoy = group.start_ready(lambda: QuotaEnvoy(directory, app.port, sidecar.port))
        yield SimpleNamespace(group=group, app=app, sidecar=sidecar, envoy=envoy, config=config, dir=directory)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    with quota_stack(tmp_path_factory.mktemp("quota")) as running:
        yield running
        assert running.sidecar.alive(), running.sidecar.log_tail()
        assert running.envoy.alive(), running.envoy.log_tail()


class Client:
    """One keep-alive connection to Envoy, sending as one bucket (tier, client)."""

    def __init__(self, stack: SimpleNamespace, tier: str, fallback: str = "") -> None:
        self.stack = stack
        self.tier = tier
        self.client = next(CLIENTS)
        self.headers = {"x-tier": tier, "x-client": self.client}
        if fallback:
            self.headers["x-fallback"] = fallback
        self.connection = http.client.HTTPConnection(stack.envoy.url.removeprefix("http://"), timeout=10)
        self.last_admitted = 0.0
        """When the last 200 came back (monotonic): about when the bucket's last token was taken."""

    def get(self) -> int:
        self.connection.request("GET", "/", headers=self.headers)
        reply = self.connection.getresponse()
        reply.read()
        if reply.status == 200:
            self.last_admitted = time.monotonic()
        return reply.status

    def burst(self, count: int) -> int:
        """Send ``count`` requests back to back; how many got 200."""
        return [self.get() for _ in range(count)].count(200)

    def bucket(self) -> dict[str, Any] | None:
        """This client's bucket in the sidecar's ``/config``, None until it is live."""
        wanted = bucket_of("quota", [("tier", self.tier), ("client", self.client)])
        shown = json.loads(http_get(self.stack.sidecar.metrics_url + "/config"))["quota"]
        return next((found for found in shown["buckets"] if found["bucket_id"] == wanted), None)

    def start(self) -> int:
        """The bucket's first request (on Envoy's fallback), then wait until the assignment is in."""
        status = self.get()
        wait_for(lambda: self.bucket() is not None, 20, "the bucket's assignment")
        time.sleep(0.2)  # Envoy applies a pushed assignment within a few ms
        return status


def at(start: float, offset: float) -> None:
    """Sleep until ``offset`` seconds after ``start`` (monotonic)."""
    time.sleep(max(0.0, start + offset - time.monotonic()))


def test_per_second_limit_admits_exactly_max_tokens_per_spaced_burst(stack: SimpleNamespace) -> None:
    client = Client(stack, "second")
    assert client.start() == 200  # ALLOW_ALL until the assignment lands
    time.sleep(1.1)
    t0 = time.monotonic()
    admitted = []
    for n, offset in enumerate((0.0, 1.3, 2.6, 3.9)):
        at(t0, offset)
        admitted.append(client.burst(10))
        assert n == 0 or time.monotonic() - t0 < offset + 0.9, "a burst took too long to be exact"
    # M = 5, r = 5/s: bursts >= 1 s apart admit M each.
    assert admitted == [5, 5, 5, 5]
    # Half a refill later: floor(5 * 0.5) = 2, sent 0.5 s after the last token was taken (timed
    # from the burst's end instead, the 429s of a slow burst on a loaded machine made it 3).
    at(client.last_admitted, 0.5)
    assert client.burst(10) == 2
    # Envoy's reports carry the same numbers the client saw (1 + 22 allowed, 28 denied).
    wait_for(lambda: (client.bucket() or {}).get("allowed") == 23, 40, "the report of 23 allowed")
    assert client.bucket()["denied"] == 28  # type: ignore[index]


def test_per_minute_limit_counts_over_several_seconds(stack: SimpleNamespace) -> None:
    client = Client(stack, "minute")
    client.start()
    t0 = time.monotonic()
    assert client.burst(12) == 7  # M = 7
    at(t0, 3.0)
    assert client.burst(5) == 0  # r = 7/60: 0.35 tokens after 3 s
    at(t0, 10.0)
    assert client.burst(5) == 1  # floor(7 * 10 / 60) = 1 (the second token needs 17.1 s)
    bucket = client.bucket()
    assert bucket is not None
    assert bucket["assignment"] == {
        "action": "token_bucket",
        "why": "fixed_window",
        "rule": "quota.tier_minute.client",
        "source": bucket["assignment"]["source"],
        "max_tokens": 7,
        "tokens_per_fill": 7,
        "fill_interval_seconds": 60,
    }


def test_token_bucket_rule_uses_burst_and_rate(stack: SimpleNamespace) -> None:
    client = Client(stack, "bucket")  # burst 4, 2 per second
    client.start()
    t0 = time.monotonic()
    assert client.burst(8) == 4
    at(t0, 1.25)
    assert client.burst(8) == 2  # floor(2 * 1.25)
    at(t0, 4.0)
    assert client.burst(8) == 4  # full again (capped at the burst)


def test_unlimited_and_shadow_rules_admit_everything(stack: SimpleNamespace) -> None:
    free, shadow = Client(stack, "free"), Client(stack, "shadow")
    free.start()
    shadow.start()
    assert free.burst(30) == 30
    assert shadow.burst(30) == 30  # the rule says 2 per minute, but it is in shadow mode
    assert [free.bucket()["assignment"]["why"], shadow.bucket()["assignment"]["why"]] == ["unlimited", "shadow"]  # type: ignore[index]
    key = (("domain", "quota"), ("key", "tier_shadow.client"))
    wait_for(
        lambda: metrics(stack.sidecar).get(("ratelimit_sidecar_quota_shadow_allowed_total", key), 0) >= 31,
        40,
        "the shadow rule's allowed requests in the metrics",
    )


def test_a_new_bucket_follows_the_no_assignment_behavior_until_assigned(stack: SimpleNamespace) -> None:
    allowing, denying = Client(stack, "second"), Client(stack, "second", fallback="deny")
    assert allowing.start() == 200  # ALLOW_ALL fallback
    assert denying.start() == 429  # DENY_ALL fallback
    assert denying.burst(10) == 5  # then the assignment


def test_a_reload_that_changes_only_the_fill_seconds_is_seen_by_envoy(stack: SimpleNamespace) -> None:
    client = Client(stack, "reload")  # 3 per second
    client.start()
    t0 = time.monotonic()
    assert client.burst(6) == 3
    at(t0, 1.3)
    assert client.burst(6) == 3
    at(t0, 2.6)  # full again: Envoy gives the new bucket the old one's fill ratio
    try:
        (stack.config / "quota.yaml").write_text(RELOADED_CONFIG)  # 3 per 10 s: only fill seconds change
        stack.sidecar.signal(signal.SIGHUP)
        wait_for(lambda: client.bucket()["assignment"]["fill_interval_seconds"] == 10, 20, "the reload")  # type: ignore[index]
        time.sleep(0.3)
        t1 = time.monotonic()
        assert client.burst(6) == 3
        at(t1, 1.3)
        assert client.burst(6) == 0  # 0.39 tokens at 3 per 10 s (3 at the old rate)
        at(t1, 4.0)
        assert client.burst(6) == 1  # floor(0.3 * 4) = 1
    finally:
        (stack.config / "quota.yaml").write_text(QUOTA_CONFIG)
        stack.sidecar.signal(signal.SIGHUP)


def rlqs_stream(address: str, messages: list[bytes], buckets: int) -> list[Any]:
    """Send ``messages`` raw on one stream, keep it open until ``buckets`` distinct buckets are
    answered (or 60 s), then read what comes back until the sidecar ends it."""
    replies: list[Any] = []
    answered: set[tuple[tuple[str, str], ...]] = set()
    all_answered = threading.Event()
    with grpc.insecure_channel(address) as channel:
        method = channel.stream_stream(
            "/envoy.service.rate_limit_quota.v3.RateLimitQuotaService/StreamRateLimitQuotas",
            request_serializer=lambda data: data,
            response_deserializer=rlqs_pb2.RateLimitQuotaResponse.FromString,
        )

        def requests() -> Iterator[bytes]:
            yield from messages
            all_answered.wait(60)

        for reply in method(requests(), timeout=90):  # a guard: the buckets are read in rested chunks
            replies.append(reply)
            answered.update(tuple(sorted(action.bucket_id.bucket.items())) for action in reply.bucket_action)
            if len(answered) >= buckets:
                all_answered.set()
    return replies


def raw_report(buckets: list[dict[str, str]]) -> bytes:
    usage = rlqs_pb2.RateLimitQuotaUsageReports.BucketQuotaUsage
    usages = [usage(bucket_id=rlqs_pb2.BucketId(bucket=b), num_requests_allowed=2**63) for b in buckets]
    return bytes(
        rlqs_pb2.RateLimitQuotaUsageReports(domain="x" * 10_000, bucket_quota_usages=usages).SerializeToString()
    )


def test_a_hostile_report_stream_does_not_hurt_the_sidecar(stack: SimpleNamespace) -> None:
    sent = STREAM_CAP + 500  # new buckets: the cap and 500 over it
    sidecar = stack.sidecar
    hostile = [
        b"\x0a\xff\xff\xff\xff\x0f garbage",
        raw_report(
            [{"entry.0.a": "no domain"}, {"domain": "quota", "entry.x.a": "1"}, {"domain": "", "entry.0.a": ""}]
        ),
        raw_report([{"domain": "quota", f"entry.{n}.k": "v"} for n in range(1, 500)]),
        *(
            raw_report([bucket_of("quota", [("tier", "second"), ("client", f"hostile-{n}")]) for n in part])
            for part in (range(start, start + sent // 4) for start in range(0, sent, sent // 4))
        ),
    ]
    replies = rlqs_stream(sidecar.address, hostile, 3 + 499 + sent)
    answered = {tuple(sorted(action.bucket_id.bucket.items())) for reply in replies for action in reply.bucket_action}
    # Every bucket answered (in messages of at most 1000); a TTL refresh may answer one again
    # while the stream is open (the report is read a chunk at a time, resting between chunks).
    assert len(answered) == 3 + 499 + sent
    assert max(len(reply.bucket_action) for reply in replies) <= 1000
    assert sidecar.alive() and health_status(sidecar.address) == "SERVING"
    logs = sidecar.log_text()
    for reason in ("missing_domain", "bad_index", "bad_domain", "index_gap"):
        assert logs.count(f'"reason": "{reason}"') == 1, reason  # logged once per distinct reason
    assert logs.count("quota_bucket_overflow") <= 2  # rate-limited
    found = metrics(sidecar)
    assert found[("ratelimit_sidecar_quota_malformed_total", (("kind", "undecodable"),))] >= 1
    # 2,500 new buckets on one stream: 2,000 kept (the module's per-stream cap), 500 not.
    assert found[("ratelimit_sidecar_quota_bucket_overflow_total", (("cap", "stream"),))] == sent - STREAM_CAP
    # The stream closed, so its buckets are gone; Envoy's own stream is untouched.
    live = ("ratelimit_sidecar_quota_buckets", ())
    wait_for(lambda: metrics(sidecar)[live] < 100, 20, "the hostile stream's 2,000 buckets being dropped")
    client = Client(stack, "second")
    client.start()
    assert client.burst(10) == 5


def test_the_sidecar_restarted_mid_run(stack: SimpleNamespace) -> None:
    """On the module's stack (the last test of it: the sidecar it leaves is a new process)."""
    client = Client(stack, "second")
    client.start()
    time.sleep(1.1)
    assert client.burst(10) == 5
    port = stack.sidecar.port
    stack.group.stop([stack.sidecar])
    stopped = time.monotonic()
    seen = []  # (seconds since the stop, admitted of 10) once a second
    while time.monotonic() - stopped < 9:
        time.sleep(1.1)
        seen.append((time.monotonic() - stopped, client.burst(10)))
    # Envoy keeps enforcing the last assignment until its TTL (6 s, last pushed at most
    # 2 s before the stop), then falls back to no_assignment_behavior: ALLOW_ALL.
    assert all(admitted == 5 for since, admitted in seen if since < 3.9), seen
    assert all(admitted == 10 for since, admitted in seen if since > 6.5), seen
    stack.sidecar = stack.group.start_ready(lambda: quota_sidecar(stack.dir, stack.config, *FLAGS, port=port))
    restarted = time.monotonic()
    # Envoy reconnects on its 5 s tick and reports every bucket; the assignment comes back.
    wait_for(lambda: client.bucket() is not None, 30, "Envoy reporting the bucket to the new sidecar")
    time.sleep(1.2)
    assert client.burst(10) == 5
    assert time.monotonic() - restarted < 9


FLOOD_CAP = 200
"""The flood test's per-stream cap: small, so a flood a half over it is sent in well under a second."""


@pytest.mark.timeout(240)  # two idle periods and Envoy's 5 s reports, with room for a loaded machine
def test_a_flood_of_unique_clients_is_abandoned_and_memory_stays_bounded(tmp_path: Path) -> None:
    # The flood (1.5 times the cap) must all land before the first bucket goes idle (the
    # module's 10 s, the least the sidecar takes), or the live count never reaches the cap:
    # 300 requests take a fraction of that even on a loaded machine.
    with quota_stack(tmp_path, "--quota-max-buckets-per-stream", str(FLOOD_CAP)) as stack:
        sidecar = stack.sidecar
        warm = Client(stack, "second")
        warm.start()
        before = rss_kib(sidecar.pid)
        connection = http.client.HTTPConnection(stack.envoy.url.removeprefix("http://"), timeout=10)
        flood = FLOOD_CAP * 3 // 2
        for n in range(flood):
            connection.request("GET", "/", headers={"x-tier": "second", "x-client": f"flood-{n}"})
            connection.getresponse().read()
        connection.close()
        live = ("ratelimit_sidecar_quota_buckets", ())
        wait_for(lambda: metrics(sidecar)[live] >= FLOOD_CAP, 40, "the flood's buckets")
        peak = metrics(sidecar)[live]
        assert peak <= FLOOD_CAP  # the per-stream cap
        # Idle for 10 s: abandoned, and the ones over the cap are adopted on a later report
        # and abandoned in turn; Envoy forgets every one of them.
        abandoned = ("ratelimit_sidecar_quota_abandoned_buckets_total", (("reason", "idle"),))
        wait_for(lambda: metrics(sidecar).get(abandoned, 0) >= flood + 1, 100, "every flood bucket abandoned")
        assert metrics(sidecar)[live] == 0
        grown = rss_kib(sidecar.pid) - before
        assert grown < 40_000, f"sidecar RSS grew by {grown} KiB"
        time.sleep(6)  # one more report period: Envoy reports no abandoned bucket again
        assert metrics(sidecar)[live] == 0
        assert sidecar.alive() and stack.envoy.alive()
