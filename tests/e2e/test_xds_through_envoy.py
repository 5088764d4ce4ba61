"""A limit tightened on the xDS control plane turns 200s into 429s through a real Envoy, on every replica.

The project's control plane (stack/xds_server.py) serves one limits file; two sidecars with
``--config-source xds`` follow it, each behind its own Envoy running ``envoy/front.yaml``
(per request path: ``ShouldRateLimit``). Changes are polled for, each probe from a client
address never used before, so it reads the limit in force and not an old count.
"""

from __future__ import annotations

import functools
import itertools
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stack.envoy import ENVOY_CONFIGS, EnvoyPorts, EnvoyProcess
from stack.processes import process_group
from stack.sidecar import SidecarProcess
from stack.upstream import UpstreamProcess
from stack.xds_server import XdsServerProcess
from tests.support.envoys import COUNTING_TIMEOUT, Session, wait_for

pytestmark = [pytest.mark.envoy, pytest.mark.slow]
DEADLINE = 30.0


def limits(per_hour: int) -> str:
    rule = f"rate_limit: {{unit: hour, requests_per_unit: {per_hour}}}"
    return f"domain: demo\ndescriptors:\n  - key: remote_address\n    {rule}\n"


def publish(file: Path, text: str) -> None:
    scratch = file.with_suffix(".tmp")
    scratch.write_text(text)
    os.replace(scratch, file)


COUNTER = itertools.count(time.time_ns() % 1000)


def statuses(url: str, count: int) -> list[int]:
    """The statuses of ``count`` requests from one client address never used before."""
    session = Session(url)
    number = next(COUNTER)
    headers = {"x-forwarded-for": f"10.{number // 62500 % 250}.{number // 250 % 250}.{number % 250 + 1}"}
    try:
        return [session.send("/", headers).status for _ in range(count)]
    finally:
        session.close()


@pytest.fixture(scope="module")
def pods(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, list[str]]]:
    """(the control plane's limits file, the URLs of the Envoys in front of two xDS sidecars)."""
    directory = tmp_path_factory.mktemp("xds")
    limits_dir = directory / "limits"
    limits_dir.mkdir()
    limits_file = limits_dir / "demo.yaml"
    publish(limits_file, limits(100))
    with process_group() as group:
        plane = group.start_ready(lambda: XdsServerProcess(limits_dir, directory, poll=0.05))
        app = group.start(UpstreamProcess("app", directory))
        flags = ["--config-source", "xds", "--xds-server", plane.address]
        sidecars = group.start_all_ready(
            [
                functools.partial(SidecarProcess, f"sidecar-{n}", [*flags, "--xds-node-id", f"pod-{n}"], directory)
                for n in range(2)
            ]
        )
        app.wait_ready()
        urls = []
        for n, sidecar in enumerate(sidecars):
            ports = EnvoyPorts.free(app=app.port, ratelimit=sidecar.port)
            envoy = group.start(
                EnvoyProcess(
                    f"envoy-{n}", ENVOY_CONFIGS / "front.yaml", ports, directory, timeout_seconds=COUNTING_TIMEOUT
                )
            )
            envoy.wait_ready()
            urls.append(envoy.url)
        yield limits_file, urls


def test_a_tightened_limit_turns_200s_into_429s_on_every_replica(pods: tuple[Path, list[str]]) -> None:
    limits_file, urls = pods
    for url in urls:
        wait_for(lambda url=url: statuses(url, 3) == [200, 200, 200], DEADLINE, "the loose limit served")
    publish(limits_file, limits(2))
    for url in urls:
        wait_for(lambda url=url: statuses(url, 3) == [200, 200, 429], DEADLINE, "the tightened limit (2/hour)")
    publish(limits_file, limits(100))
    for url in urls:
        wait_for(lambda url=url: statuses(url, 3) == [200, 200, 200], DEADLINE, "the limit loosened again")
