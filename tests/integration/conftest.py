"""Fixtures for the integration tests: real sidecar processes, killed in teardown."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from redis_fixtures import (
    acl_redis,
    own_redis,
    own_sentinel,
    redis_cluster,
    redis_sentinel,
    redis_server,
    tls_redis,
    tls_sentinel,
)
from sidecar_harness import Sidecar, SidecarFactory, sidecar_factory, write_config

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
"""Real redis-server fixtures (see ``redis_fixtures``), offered to every integration test."""


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
