"""``export-envoy-quota`` on a corpus of Envoy configs written as users write them
(``tests/e2e/quota_corpus/``, its README says the format), through real Envoys.

Each case is exported with ``--full`` and run twice on the same requests against one real
sidecar: through Envoy with the per-request ``ratelimit`` filter, then through Envoy with the
exported ``rate_limit_quota`` filters. Both must admit, per group of requests, the counts the
case writes down: a limit on the wrong host or route, a lost limit or a limit too many shows
as a count that differs. A case whose limits quota mode cannot express must be refused, the
route and the reason printed.

A case may keep routes on the per-request filter (``per_request``: ``--per-request``): one
Envoy then runs both paths, and the ``ratelimit`` filter must be asked about exactly the
requests of those routes.

The cases whose entries become alternatives (metadata, values read from the request: empty,
absent, ``skip_if_absent``) also run in the ``list`` shape (the filters alone, as printed
without ``--full``), where a route's alternatives share one filter with the other routes'
descriptors and a request whose entry reaches no rule must not fall to a later route's.

Timing: every request is sent once to start its buckets (quota mode allows a bucket's
first requests until its assignment lands), then, in a new second once the assignments are
in, each group is sent back to back. Limits are per second and small, so a burst within one
second sees the per-request path's fixed window and Envoy's token bucket admit the same.
"""

from __future__ import annotations

import contextlib
import http.client
import io
import json
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from sidecar.__main__ import main
from sidecar.config import load_config
from sidecar.export.envoy_quota.export import DEFAULT_CLUSTER, export_quota, quota_document
from stack.envoy import admin_get
from stack.processes import process_group
from stack.quota_envoy import LocalEnvoy, http_get, quota_sidecar
from stack.upstream import UpstreamProcess
from tests.support.envoys import fresh_window

pytestmark = [pytest.mark.slow, pytest.mark.envoy]
CORPUS = Path(__file__).resolve().parent / "quota_corpus"
CASES = sorted(path.name for path in CORPUS.iterdir() if path.is_dir())
RATELIMIT_STATS = re.compile(r"^cluster\.[^.]+\.ratelimit\.(ok|over_limit|error|failure_mode_allowed): ")


def export(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def export_case(case: Path, *flags: str) -> tuple[int, str, str]:
    return export("export-envoy-quota", str(case / "rules.yaml"), "--envoy", str(case / "envoy.yaml"), "--full", *flags)


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    """One upstream and one sidecar holding every case's domain (both services on one port)."""
    directory = tmp_path_factory.mktemp("corpus")
    config = directory / "config"
    config.mkdir()
    for name in CASES:
        shutil.copy(CORPUS / name / "rules.yaml", config / f"{name}.yaml")
    with process_group() as group:
        app = group.start_ready(lambda: UpstreamProcess("app", directory))
        sidecar = group.start_ready(lambda: quota_sidecar(directory, config, "--quota-ttl", "6"))
        yield SimpleNamespace(group=group, app=app, sidecar=sidecar, dir=directory)
        assert sidecar.alive(), sidecar.log_tail()


class Sender:
    """Keep-alive connections to one Envoy, one per client address a group names."""

    def __init__(self, url: str) -> None:
        self.target = url.removeprefix("http://")
        self.connections: dict[str, http.client.HTTPConnection] = {}

    def send(self, group: dict[str, Any]) -> int:
        source = str(group.get("from", "127.0.0.1"))
        if source not in self.connections:
            host, port = self.target.split(":")
            self.connections[source] = http.client.HTTPConnection(
                host, int(port), timeout=10, source_address=(source, 0)
            )
        connection = self.connections[source]
        headers = {"Host": str(group.get("host", "example.org")), **(group.get("headers") or {})}
        connection.request(str(group.get("method", "GET")), str(group.get("path", "/")), headers=headers)
        reply = connection.getresponse()
        reply.read()
        assert reply.status in (200, 429), f"{group}: status {reply.status}"
        return reply.status

    def close(self) -> None:
        for connection in self.connections.values():
            connection.close()


def bucket_count(services: SimpleNamespace) -> int:
    shown = json.loads(http_get(services.sidecar.metrics_url + "/config"))["quota"]
    return len(shown["buckets"])


def settle(services: SimpleNamespace) -> None:
    """Wait until the sidecar's live buckets stopped growing (every assignment pushed)."""
    time.sleep(0.5)
    last, stable_since = bucket_count(services), time.monotonic()
    deadline = time.monotonic() + 10
    while time.monotonic() - stable_since < 0.6 and time.monotonic() < deadline:
        time.sleep(0.1)
        count = bucket_count(services)
        if count != last:
            last, stable_since = count, time.monotonic()
    time.sleep(0.3)  # Envoy applies a pushed assignment within a few ms


def admitted(envoy: LocalEnvoy, groups: list[dict[str, Any]], services: SimpleNamespace) -> list[int]:
    """Start every bucket with one request per group, then in a fresh second send each group;
    how many of each group got 200."""
    sender = Sender(envoy.url)
    try:
        for group in groups:
            sender.send(group)
        settle(services)
        fresh_window(1, needed=1)
        return [[sender.send(group) for _ in range(int(group["count"]))].count(200) for group in groups]
    finally:
        sender.close()


def ratelimit_counters(envoy: LocalEnvoy) -> dict[str, int]:
    """The per-request ``ratelimit`` filter's answer counters (``ok``, ``over_limit``, ``error``,
    ``failure_mode_allowed``), summed over the upstream clusters."""
    text = admin_get(envoy.admin, "/stats?usedonly&filter=ratelimit")
    found: dict[str, int] = {}
    for line in text.splitlines():
        matched = RATELIMIT_STATS.search(line)
        if matched:
            found[matched.group(1)] = found.get(matched.group(1), 0) + int(line.rpartition(": ")[2])
    return found


def run_config(
    services: SimpleNamespace, name: str, config: dict[str, Any], groups: list[dict[str, Any]]
) -> tuple[list[int], int]:
    """The admitted count of each group through Envoy on ``config``, and how many requests the
    ``ratelimit`` filter asked the sidecar about (every answer in time: a late one would fail
    open and admit what the limit refuses)."""
    envoy = services.group.start_ready(
        lambda: LocalEnvoy(name, config, services.dir, services.app.port, services.sidecar.port)
    )
    try:
        counts = admitted(envoy, groups, services)
        answers = ratelimit_counters(envoy)
        assert answers.get("error", 0) == answers.get("failure_mode_allowed", 0) == 0, answers
        return counts, answers.get("ok", 0) + answers.get("over_limit", 0)
    finally:
        assert envoy.alive(), envoy.log_tail()
        services.group.stop([envoy])


@pytest.mark.parametrize("name", CASES)
def test_corpus_case_admits_what_the_per_request_path_admits(name: str, services: SimpleNamespace) -> None:
    case = CORPUS / name
    spec = yaml.safe_load((case / "requests.yaml").read_text())
    flags = [word for route in spec.get("per_request") or [] for word in ("--per-request", route)]
    code, out, err = export_case(case, *flags)
    if "refused" in spec:
        assert (code, out) == (1, ""), err
        for text in spec["refused"]:
            assert text in err, (text, err)
        assert "--allow-dropped" in err
        return
    assert code == 0, err
    groups = spec["groups"]
    expected = [int(group["admitted"]) for group in groups]
    original = yaml.safe_load((case / "envoy.yaml").read_text())
    per_request, every_call = run_config(services, f"{name}-per-request", original, groups)
    quota, calls = run_config(services, f"{name}-quota", yaml.safe_load(out), groups)
    assert (per_request, quota) == (expected, expected), f"expected {expected}: {err}"
    assert every_call > 0
    # Only the routes kept per request still ask the sidecar per request (warm-up included).
    assert calls == sum(int(group["count"]) + 1 for group in groups if group.get("per_request"))


@pytest.mark.parametrize("name", ["metadata", "read_values"])
def test_the_list_shape_admits_what_the_per_request_path_admits(name: str, services: SimpleNamespace) -> None:
    case = CORPUS / name
    spec = yaml.safe_load((case / "requests.yaml").read_text())
    groups, expected = spec["groups"], [int(group["admitted"]) for group in spec["groups"]]
    document = yaml.safe_load((case / "envoy.yaml").read_text())
    origin = case / "envoy.yaml"
    result = export_quota(load_config(str(case / "rules.yaml")).domains, document, origin)
    assert result.dropped == ()
    assert len(result.filters) == 1  # every route sends one entry's alternatives: they share one filter
    config = quota_document(document, origin, result.filters, DEFAULT_CLUSTER)
    admitted, calls = run_config(services, f"{name}-list", config, groups)
    assert admitted == expected
    assert calls == 0  # no request asked the sidecar per request
