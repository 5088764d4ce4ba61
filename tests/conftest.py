"""Fixtures for every test: plain helpers, and real processes (redis-server, sidecars) killed in teardown.

The helpers are offered as fixtures too.

The helpers are plain functions; the fixtures only hand them to tests, so test
modules never import from ``conftest``. They are session-scoped because they hold
no state, which also keeps Hypothesis' function-scoped-fixture health check quiet.
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from google.protobuf.wrappers_pb2 import UInt64Value

from sidecar.config.errors import ConfigIssue
from sidecar.config.load import parse_text
from sidecar.config.model import DomainConfig, RateLimitConfig
from sidecar.limiter.windows import Unit
from sidecar.protos.envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from sidecar.protos.envoy.service.ratelimit.v3 import rls_pb2
from tests.support.redis_servers import (
    acl_redis,
    own_redis,
    own_sentinel,
    redis_cluster,
    redis_sentinel,
    redis_server,
    tls_redis,
    tls_sentinel,
)
from tests.support.sidecars import Sidecar, SidecarFactory, sidecar_factory, write_config

TEST_FILE = "rules/test.yaml"
"""The file name every parsed text is reported under."""


@dataclass(frozen=True, slots=True)
class Entry:
    """A descriptor entry without protobuf, for fast matcher tests."""

    key: str
    value: str = ""


class FakeClock:
    """A clock the test moves by hand: ``clock()`` returns ``clock.now``."""

    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def dedent(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


def parse_result(text: str, file: str = TEST_FILE) -> tuple[DomainConfig | None, list[ConfigIssue]]:
    """``parse_text`` on dedented text."""
    return parse_text(dedent(text), file)


def parse_domain(text: str, file: str = TEST_FILE) -> DomainConfig:
    """Parse a YAML text that must be valid."""
    domain, issues = parse_result(text, file)
    assert issues == [], "\n".join(str(issue) for issue in issues)
    assert domain is not None
    return domain


def parse_issues(text: str, file: str = TEST_FILE) -> list[ConfigIssue]:
    """Parse a YAML text that must be refused; returns every issue."""
    domain, issues = parse_result(text, file)
    assert domain is None
    assert issues, "expected the config to be refused"
    return issues


def issue_at(issues: Sequence[ConfigIssue], path: str) -> ConfigIssue:
    """The single issue reported for ``path``."""
    found = [issue for issue in issues if issue.path == path]
    assert len(found) == 1, f"no single issue at {path!r} in {[str(i) for i in issues]}"
    return found[0]


def config_of(*texts: str) -> RateLimitConfig:
    """A whole config from YAML texts, one domain each, without touching disk."""
    domains = {}
    for index, text in enumerate(texts):
        domain = parse_domain(text, f"rules/{index}.yaml")
        assert domain.name not in domains
        domains[domain.name] = domain
    return RateLimitConfig(domains, tuple(domain.source for domain in domains.values()), "test")


def descriptor(
    *pairs: tuple[str, str] | str,
    limit: tuple[int, Unit] | None = None,
    hits: int | None = None,
) -> Any:
    """A ``RateLimitDescriptor``; a bare string is a key with an empty value."""
    entries = [
        ratelimit_pb2.RateLimitDescriptor.Entry(key=pair, value="")
        if isinstance(pair, str)
        else ratelimit_pb2.RateLimitDescriptor.Entry(key=pair[0], value=pair[1])
        for pair in pairs
    ]
    built = ratelimit_pb2.RateLimitDescriptor(entries=entries)
    if limit is not None:
        requests, unit = limit
        built.limit.CopyFrom(
            ratelimit_pb2.RateLimitDescriptor.RateLimitOverride(requests_per_unit=requests, unit=int(unit))
        )
    if hits is not None:
        built.hits_addend.CopyFrom(UInt64Value(value=hits))
    return built


def rate_request(domain: str, *descriptors: Any, hits: int = 0) -> Any:
    """A ``RateLimitRequest``; ``hits`` is the request-level ``hits_addend``."""
    return rls_pb2.RateLimitRequest(domain=domain, descriptors=list(descriptors), hits_addend=hits)


def memory_service(rules: str, clock: FakeClock, instances: int = 1, response_headers: bool = False) -> Any:
    """A ``RateLimitService`` deciding ``rules`` (YAML text) with a fresh ``MemoryLimiter``."""
    from sidecar.limiter.memory import MemoryLimiter
    from sidecar.service.servicer import RateLimitService

    limiter = MemoryLimiter(instances=instances)
    return RateLimitService(config_of(rules), limiter, clock=clock, response_headers=response_headers)


def asker(domain: str, service: Any) -> Callable[..., Awaitable[Any]]:
    """``await ask(("key", "value"), ..., hits=0, to=other_service)``: one request to a
    service's ``decide`` in ``domain``; tuples become descriptors, protos pass as they are."""

    async def send(*descriptors: Any, hits: int = 0, to: Any = None) -> Any:
        built = [item if not isinstance(item, tuple) else descriptor(item) for item in descriptors]
        return await (to or service).decide(rate_request(domain, *built, hits=hits))

    return send


HELPERS = SimpleNamespace(
    asker=asker,
    memory_service=memory_service,
    Entry=Entry,
    FakeClock=FakeClock,
    TEST_FILE=TEST_FILE,
    dedent=dedent,
    parse_result=parse_result,
    parse_domain=parse_domain,
    parse_issues=parse_issues,
    issue_at=issue_at,
    config_of=config_of,
    descriptor=descriptor,
    rate_request=rate_request,
)


@pytest.fixture(scope="session")
def h() -> SimpleNamespace:
    """The helpers above: ``h.parse_domain(text)``, ``h.descriptor(("k", "v"))``, ..."""
    return HELPERS


@pytest.fixture
def clock() -> FakeClock:
    """A fresh fake clock at a fixed Unix time in the middle of a minute."""
    return FakeClock(1_700_000_010.0)


@pytest.fixture
def redis_snapshot() -> Any:
    """What a Redis backend reports at scrape time: every Redis metric present."""
    from sidecar.metrics import Buckets, LimiterSnapshot

    return LimiterSnapshot(
        counters=0,
        evictions=0,
        redis_up=True,
        replicas=3,
        round_trips_request_path=7,
        round_trips_background=11,
        pending_hits=4,
        flush_seconds=Buckets((0.01,)),
        flush_keys=Buckets((10,)),
    )


# ---------------------------------------------------------------- real processes

__all__ = [
    "acl_redis",
    "own_redis",
    "own_sentinel",
    "redis_cluster",
    "redis_sentinel",
    "redis_server",
    "tls_redis",
    "tls_sentinel",
]
"""Real redis-server fixtures (see ``tests.support.redis_servers``), offered to every test."""


@pytest.fixture
def start_sidecar(tmp_path: Path) -> Iterator[SidecarFactory]:
    """Start sidecars for one test: ``start_sidecar(*serve_flags, config=dir, env=...)``.

    Every process it started is killed (SIGKILL if still running) when the test ends.
    """
    with sidecar_factory(tmp_path) as start:
        yield start


@pytest.fixture(scope="session")
def config_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding the integration config (domain ``it``)."""
    return write_config(tmp_path_factory.mktemp("config"))


@pytest.fixture(scope="session")
def shared_sidecar(tmp_path_factory: pytest.TempPathFactory, config_dir: Path) -> Iterator[Sidecar]:
    """One sidecar for the whole session; tests must use their own descriptor values."""
    with sidecar_factory(tmp_path_factory.mktemp("shared")) as start:
        sidecar = start(config=config_dir)
        yield sidecar
        assert sidecar.alive(), f"the shared sidecar died during the tests:\n{sidecar.stderr()}"


REDIS_FIXTURES = frozenset(__all__)
"""A test using one of these starts (or shares) a real redis-server: it gets the ``redis`` marker."""


PIN_WORKERS = "TEST_PIN_WORKERS"
"""Set by ``scripts/test`` for the serial phase: each pytest-xdist worker gets a core of its own."""


def pytest_configure(config: pytest.Config) -> None:
    """Pin this xdist worker (and every process its tests start, which inherit it) to one core.

    The serial tests are serial because a test must not lose its CPU to another (timelines
    within a clock second, accuracy under load), not because it needs the whole machine:
    two of them, each alone on its core, do not starve each other.
    """
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not os.environ.get(PIN_WORKERS) or worker is None:
        return
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[int(worker.removeprefix("gw")) % len(cores)]})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark tests by what they start: ``redis`` from the fixtures they use (modules that
    start Redis, Envoy or HAProxy themselves say so in their ``pytestmark``)."""
    for item in items:
        if REDIS_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.redis)
        if item.get_closest_marker("alone") is not None:
            item.add_marker(pytest.mark.serial)  # kept out of the parallel phase as well
    # Files with slow tests first (each file kept whole, for its module fixtures): the xdist
    # workers take them while there is other work to fill the cores, instead of the last
    # directory's long harness runs (tests/tools/) leaving the other workers idle at the end.
    slow_files = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow_files)
