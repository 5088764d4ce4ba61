"""What every reproducer here shares: a scripted RLQS server, an upstream, one Envoy.

Each reproducer (``envoy/repro/*.py``, README.md beside them) starts a real Envoy on a
config of this folder whose ``rate_limit_quota`` filter puts each request in the bucket
``{"name": <the x-bucket header>}``, routes it to a real upstream (rate-limit filters do
nothing on ``direct_response`` routes) and streams RLQS to :class:`ScriptedRlqs`. That
server answers a new bucket with the assignment the reproducer planned for its name and
records every usage report, so what Envoy does with one exact assignment is seen alone,
without the sidecar's own logic in between.

The configs are complete and valid as written (fixed ports: listener 10000, admin 9901,
upstream 8080, RLQS 18081, what an upstream report attaches); :func:`run_envoy` moves them
to free ports so several runs can share a machine. Needs grpcio, PyYAML and the RLQS
protos vendored in this repository (``sidecar/protos``), so run from a checkout.
"""

from __future__ import annotations

import argparse
import http.client
import http.server
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))  # the repository, for its vendored protos

from sidecar.protos.envoy.service.rate_limit_quota.v3 import rlqs_pb2, rlqs_pb2_grpc  # noqa: E402

Action = rlqs_pb2.RateLimitQuotaResponse.BucketAction
Observed = dict[str, Any]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def token_bucket(max_tokens: int, per_fill: int, seconds: int, nanos: int = 0, ttl: int | None = 60) -> Action:
    """A token-bucket assignment (``ttl`` None leaves ``assignment_time_to_live`` unset)."""
    action = Action()
    assignment = action.quota_assignment_action
    bucket = assignment.rate_limit_strategy.token_bucket
    bucket.max_tokens = max_tokens
    bucket.tokens_per_fill.value = per_fill
    bucket.fill_interval.seconds, bucket.fill_interval.nanos = seconds, nanos
    if ttl is not None:
        assignment.assignment_time_to_live.seconds = ttl
    else:
        assignment.SetInParent()
    return action


@dataclass
class Report:
    """One bucket's usage in one report, with when the server read it (monotonic)."""

    at: float
    name: str
    allowed: int
    denied: int
    elapsed: float


@dataclass
class ScriptedRlqs(rlqs_pb2_grpc.RateLimitQuotaServiceServicer):
    """An RLQS server that answers a new bucket with ``plan[name]`` (nothing when the name is
    not planned), records each usage report, and pushes more with :meth:`push`."""

    plan: dict[str, Action] = field(default_factory=dict)
    reports: list[Report] = field(default_factory=list)
    assigned: set[str] = field(default_factory=set)
    streams: list[queue.Queue[rlqs_pb2.RateLimitQuotaResponse | None]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def StreamRateLimitQuotas(  # noqa: N802 (the gRPC method's name)
        self, request_iterator: Iterator[rlqs_pb2.RateLimitQuotaUsageReports], context: grpc.ServicerContext
    ) -> Iterator[rlqs_pb2.RateLimitQuotaResponse]:
        outbox: queue.Queue[rlqs_pb2.RateLimitQuotaResponse | None] = queue.Queue()
        with self.lock:
            self.streams.append(outbox)
        threading.Thread(target=self._read, args=(request_iterator, outbox), daemon=True).start()
        while (reply := outbox.get()) is not None:
            yield reply

    def _read(
        self,
        requests: Iterator[rlqs_pb2.RateLimitQuotaUsageReports],
        outbox: queue.Queue[rlqs_pb2.RateLimitQuotaResponse | None],
    ) -> None:
        try:
            for report in requests:
                for usage in report.bucket_quota_usages:
                    self._record(usage, outbox)
        except grpc.RpcError:
            pass
        finally:
            outbox.put(None)

    def _record(
        self,
        usage: rlqs_pb2.RateLimitQuotaUsageReports.BucketQuotaUsage,
        outbox: queue.Queue[rlqs_pb2.RateLimitQuotaResponse | None],
    ) -> None:
        name = usage.bucket_id.bucket.get("name", "")
        elapsed = usage.time_elapsed.seconds + usage.time_elapsed.nanos / 1e9
        with self.lock:
            self.reports.append(
                Report(time.monotonic(), name, usage.num_requests_allowed, usage.num_requests_denied, elapsed)
            )
            answer = self.plan.get(name) if name not in self.assigned else None
            if answer is not None:
                self.assigned.add(name)
        if answer is not None:
            outbox.put(response(name, answer))

    def push(self, name: str, action: Action) -> None:
        """Send ``action`` for bucket ``name`` on every open stream now."""
        with self.lock:
            self.plan[name] = action
            for outbox in self.streams:
                outbox.put(response(name, action))

    def of(self, name: str) -> list[Report]:
        with self.lock:
            return [report for report in self.reports if report.name == name]


def response(name: str, action: Action) -> rlqs_pb2.RateLimitQuotaResponse:
    answer = Action()
    answer.CopyFrom(action)
    answer.bucket_id.bucket["name"] = name
    return rlqs_pb2.RateLimitQuotaResponse(bucket_action=[answer])


class _Ok(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, format: str, *args: Any) -> None:
        pass


@dataclass
class Stack:
    """The running Envoy (``process``), its ports and the scripted server."""

    process: subprocess.Popen[bytes]
    listen: int
    admin: int
    rlqs: ScriptedRlqs
    log: Path

    def alive(self) -> bool:
        return self.process.poll() is None

    def admin_get(self, path: str) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin}{path}", timeout=5) as reply:
            return str(reply.read().decode())

    def burst(self, name: str, count: int) -> list[int]:
        """``count`` requests of bucket ``name`` on one keep-alive connection: their statuses
        (0 for a request Envoy did not answer, e.g. because it died)."""
        connection = http.client.HTTPConnection("127.0.0.1", self.listen, timeout=10)
        statuses = []
        try:
            for _ in range(count):
                try:
                    connection.request("GET", "/", headers={"x-bucket": name})
                    reply = connection.getresponse()
                    reply.read()
                    statuses.append(reply.status)
                except OSError:  # http.client's errors included
                    statuses.append(0)
                    connection.close()
                    connection = http.client.HTTPConnection("127.0.0.1", self.listen, timeout=10)
        finally:
            connection.close()
        return statuses

    def admitted(self, name: str, count: int) -> int:
        return self.burst(name, count).count(200)

    def start_bucket(self, name: str) -> int:
        """The bucket's first request (on the ``no_assignment_behavior``), then wait until the
        planned assignment was sent and a little more for Envoy to apply it; the status."""
        (status,) = self.burst(name, 1)
        wait_for(lambda: name in self.rlqs.assigned, 10, f"the assignment of bucket {name!r}")
        time.sleep(0.3)
        return status


def wait_for(condition: Callable[[], bool], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {seconds:g} s")
        time.sleep(0.05)


def at(start: float, offset: float) -> None:
    """Sleep until ``offset`` seconds after ``start`` (monotonic)."""
    time.sleep(max(0.0, start + offset - time.monotonic()))


def render(config: Path, listen: int, admin: int, app: int, rlqs: int) -> dict[str, Any]:
    """``config`` with its listener, admin, ``app`` and ``rlqs`` clusters on the given ports."""
    rendered: dict[str, Any] = yaml.safe_load(config.read_text())
    rendered["admin"]["address"]["socket_address"]["port_value"] = admin
    resources = rendered["static_resources"]
    resources["listeners"][0]["address"]["socket_address"]["port_value"] = listen
    for cluster in resources["clusters"]:
        endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
        endpoint["address"]["socket_address"]["port_value"] = {"app": app, "rlqs": rlqs}[cluster["name"]]
    return rendered


def envoy_version(binary: str) -> str:
    """The ``x.y.z`` of ``envoy --version``."""
    found = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60, check=True)
    for word in found.stdout.replace("/", " ").split():
        parts = word.split(".")
        if len(parts) == 3 and all(part.isdigit() for part in parts):
            return word
    raise ValueError(f"{binary} --version: no x.y.z version in {found.stdout!r}")


@contextmanager
def run_envoy(binary: str, config: Path, plan: dict[str, Action] | None = None) -> Iterator[Stack]:
    """An upstream, a :class:`ScriptedRlqs` with ``plan`` and Envoy on ``config``, on free
    ports, until the block ends (Envoy's log is kept in a temporary directory)."""
    upstream = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Ok)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    rlqs = ScriptedRlqs(plan=dict(plan or {}))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    rlqs_pb2_grpc.add_RateLimitQuotaServiceServicer_to_server(rlqs, server)
    rlqs_port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    listen, admin = free_port(), free_port()
    workdir = Path(tempfile.mkdtemp(prefix="envoy-repro-"))
    rendered = workdir / config.name
    rendered.write_text(yaml.safe_dump(render(config, listen, admin, upstream.server_port, rlqs_port)))
    log = workdir / "envoy.log"
    with log.open("wb") as sink:
        command = [binary, "-c", str(rendered), "--concurrency", "1", "--disable-hot-restart", "--log-level", "warning"]
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
    stack = Stack(process, listen, admin, rlqs, log)
    try:
        wait_for(lambda: _live(stack), 30, f"Envoy ready on {config.name} (log: {log})")
        yield stack
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        server.stop(grace=None)
        upstream.shutdown()
        upstream.server_close()


def _live(stack: Stack) -> bool:
    if not stack.alive():
        raise RuntimeError(f"Envoy exited with {stack.process.returncode}: {stack.log.read_text()[-2000:]}")
    try:
        return stack.admin_get("/ready").strip() == "LIVE"
    except OSError:
        return False


def main(probe: Callable[[str], Observed], describe: str) -> None:
    """The command line of each reproducer: ``--envoy BINARY`` (default ``$SIDECAR_ENVOY_BIN``,
    else ``envoy`` beside this Python), prints what was observed, ``--json`` as one JSON line."""
    parser = argparse.ArgumentParser(description=describe)
    default = os.environ.get("SIDECAR_ENVOY_BIN") or str(Path(sys.executable).parent / "envoy")
    parser.add_argument("--envoy", default=default, help=f"the envoy binary (default {default})")
    parser.add_argument("--json", action="store_true", help="print the observation as one JSON line")
    arguments = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so Envoy is stopped on the way out
    observed = {"envoy": envoy_version(arguments.envoy), **probe(arguments.envoy)}
    if arguments.json:
        print(json.dumps(observed))
    else:
        print(describe)
        for key, value in observed.items():
            print(f"  {key}: {value}")
