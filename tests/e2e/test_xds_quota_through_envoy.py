"""Quota mode with limits from the xDS control plane: a tightened limit re-assigns the live
buckets (pushed to Envoy on its RLQS stream) and a new client meets it through a real Envoy."""

from __future__ import annotations

import http.client
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from sidecar.quota.buckets import bucket_of
from stack.processes import process_group
from stack.quota_envoy import QuotaEnvoy, http_get
from stack.sidecar import SidecarProcess
from stack.upstream import UpstreamProcess
from stack.xds_server import XdsServerProcess
from tests.support.envoys import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.envoy]
DEADLINE = 30.0


def limits(per_minute: int) -> str:
    rule = f"rate_limit: {{unit: minute, requests_per_unit: {per_minute}}}"
    tier = "  - key: tier\n    value: minute\n    descriptors:\n"
    return f"domain: quota\ndescriptors:\n{tier}      - key: client\n        {rule}\n"


def publish(file: Path, text: str) -> None:
    scratch = file.with_suffix(".tmp")
    scratch.write_text(text)
    os.replace(scratch, file)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    directory = tmp_path_factory.mktemp("xds-quota")
    limits_dir = directory / "limits"
    limits_dir.mkdir()
    publish(limits_dir / "quota.yaml", limits(7))
    flags = ["--quota-ttl", "6", "--quota-idle-abandon", "10"]
    with process_group() as group:
        plane = group.start_ready(lambda: XdsServerProcess(limits_dir, directory, poll=0.05))
        app = group.start_ready(lambda: UpstreamProcess("app", directory))
        sidecar = group.start_ready(
            lambda: SidecarProcess(
                "quota-sidecar", ["--config-source", "xds", "--xds-server", plane.address, *flags], directory
            )
        )
        envoy = group.start_ready(lambda: QuotaEnvoy(directory, app.port, sidecar.port))
        yield SimpleNamespace(sidecar=sidecar, envoy=envoy, limits=limits_dir / "quota.yaml")


class Client:
    """One keep-alive connection to Envoy as one bucket (tier ``minute``, a client of its own)."""

    def __init__(self, stack: SimpleNamespace) -> None:
        self.stack = stack
        self.client = f"client-{time.time_ns()}"
        self.connection = http.client.HTTPConnection(stack.envoy.url.removeprefix("http://"), timeout=10)

    def get(self) -> int:
        self.connection.request("GET", "/", headers={"x-tier": "minute", "x-client": self.client})
        reply = self.connection.getresponse()
        reply.read()
        return reply.status

    def burst(self, count: int) -> int:
        return [self.get() for _ in range(count)].count(200)

    def assignment(self) -> dict[str, Any] | None:
        wanted = bucket_of("quota", [("tier", "minute"), ("client", self.client)])
        shown = json.loads(http_get(self.stack.sidecar.metrics_url + "/config"))["quota"]
        found = next((bucket for bucket in shown["buckets"] if bucket["bucket_id"] == wanted), None)
        return None if found is None else found["assignment"]

    def start(self, max_tokens: int) -> None:
        """The first request (on Envoy's fallback), then wait for the assignment to be in."""
        self.get()
        wait_for(lambda: (self.assignment() or {}).get("max_tokens") == max_tokens, DEADLINE, "the assignment")
        time.sleep(0.2)  # Envoy applies a pushed assignment within a few ms


def test_a_tightened_limit_reassigns_live_buckets_and_new_clients_meet_it(stack: SimpleNamespace) -> None:
    before = Client(stack)
    before.start(max_tokens=7)
    assert before.burst(12) == 7
    try:
        publish(stack.limits, limits(2))
        wait_for(lambda: (before.assignment() or {}).get("max_tokens") == 2, DEADLINE, "the live bucket re-assigned")
        after = Client(stack)
        after.start(max_tokens=2)
        assert after.burst(6) == 2
    finally:
        publish(stack.limits, limits(7))
