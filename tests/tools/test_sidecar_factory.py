"""The tests' sidecar launcher (tests/support/sidecars.py): a start that finds a port taken
between choosing it and binding it starts again on fresh ports, the metrics port included."""

from __future__ import annotations

import socket
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import sidecars
from tests.support.sidecars import sidecar_factory, write_config


def test_a_taken_metrics_port_is_chosen_again_with_the_grpc_port(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seen in a parallel run: the metrics port, chosen by the test once, was taken by the
    time the sidecar bound it, and every retry (a new gRPC port only) failed on it again."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        real_free_port = sidecars.free_port
        ports: Iterator[int] = iter([real_free_port(), taken.getsockname()[1]])
        monkeypatch.setattr(sidecars, "free_port", lambda: next(ports, None) or real_free_port())
        with sidecar_factory(tmp_path / "run") as start:
            sidecar = start(config=write_config(tmp_path / "config"), metrics=True)
            assert sidecar.metrics_port not in (0, taken.getsockname()[1])
            with urllib.request.urlopen(f"http://127.0.0.1:{sidecar.metrics_port}/healthz", timeout=5) as answer:
                assert answer.status == 200
