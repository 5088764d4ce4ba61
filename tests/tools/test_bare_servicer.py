"""The benchmark's reference servers answer over real gRPC as their docstrings say.

``python -m loadtest.grpc_bench compare`` divides the sidecar's throughput by these servers';
a reference that answered wrongly (or errored fast) would make the ratio meaningless.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from sidecar.protos.envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from tests.support.sidecars import CHANNEL_OPTIONS, OK, OVER_LIMIT, free_port, request

REPO = Path(__file__).resolve().parents[2]
EXAMPLE_CONFIG = REPO / "examples" / "config"


@pytest.fixture
def start_bare() -> Iterator[Any]:
    processes: list[subprocess.Popen[bytes]] = []

    def start(*arguments: str) -> Any:
        address = f"127.0.0.1:{free_port()}"
        command = [sys.executable, "-m", "loadtest.bare_servicer", "--grpc-address", address]
        command += ["--max-seconds", "60", "--config", str(EXAMPLE_CONFIG), *arguments]
        processes.append(subprocess.Popen(command, cwd=REPO, stderr=subprocess.DEVNULL))
        channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        grpc.channel_ready_future(channel).result(timeout=20)
        return rls_pb2_grpc.RateLimitServiceStub(channel).ShouldRateLimit

    yield start
    for process in processes:
        process.terminate()
        process.wait(timeout=10)


def address_request(address: str) -> rls_pb2.RateLimitRequest:
    return request("demo", [("remote_address", address)])


def test_the_baseline_answers_ok_without_statuses(start_bare):
    answer = start_bare()(address_request("10.0.0.1"), timeout=5)
    assert answer.overall_code == OK
    assert len(answer.statuses) == 0


def test_sized_answers_a_typical_response(start_bare):
    answer = start_bare("--work", "sized")(address_request("10.0.0.1"), timeout=5)
    assert answer.overall_code == OK
    assert [status.current_limit.requests_per_unit for status in answer.statuses] == [20, 20]
    assert answer.ByteSize() == 60


@pytest.mark.parametrize("work", ["floor", "handler"])
def test_floor_and_handler_count_to_the_limit(start_bare, work):
    """20 per second per address in examples/config: the 21st call in one second is refused."""
    should_rate_limit = start_bare("--work", work)
    for attempt in range(3):  # a second boundary inside the burst would split it: try again
        started = int(time.time())
        address = f"10.9.{attempt}.{started % 256}"
        answers = [should_rate_limit(address_request(address), timeout=5) for _ in range(21)]
        if int(time.time()) == started:
            break
    assert [answer.overall_code for answer in answers] == [OK] * 20 + [OVER_LIMIT]
    last = answers[-1].statuses[0]
    assert last.code == OVER_LIMIT
    assert last.current_limit.requests_per_unit == 20
    assert last.limit_remaining == 0
