"""The xDS control plane (stack/xds_server.py) and its benchmark (loadtest/xds_propagation.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from loadtest import xds_propagation
from sidecar.config.errors import ConfigError
from sidecar.config.xds_source import convert
from stack.xds_server import read_directory, snapshot_of


def test_a_directory_becomes_one_resource_per_file(tmp_path: Path) -> None:
    (tmp_path / "b.yaml").write_text(xds_propagation.limits(7, rules=3))
    (tmp_path / "a.yml").write_text("domain: other\ndescriptors:\n  - key: k\n    rate_limit: {unlimited: true}\n")
    (tmp_path / ".hidden.yaml").write_text("not: read")
    (tmp_path / "notes.txt").write_text("not read either")
    snapshot = snapshot_of(tmp_path)
    config = convert(snapshot.resources)
    assert config.files == ("xds:a", "xds:b")
    assert len(config.domains["bench"].rules) == 3
    assert snapshot.version == read_directory(tmp_path)[0]
    (tmp_path / "b.yaml").write_text(xds_propagation.limits(8, rules=3))
    assert snapshot_of(tmp_path).version != snapshot.version


def test_a_unit_the_proto_lacks_is_served_as_unknown_and_refused_by_the_sidecar(tmp_path: Path) -> None:
    (tmp_path / "w.yaml").write_text(
        "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: week, requests_per_unit: 1}\n"
    )
    with pytest.raises(ConfigError, match=r"xds:w: descriptors\[0\].rate_limit.unit: invalid unit 'unknown'"):
        convert(snapshot_of(tmp_path).resources)


def test_a_file_that_is_not_yaml_is_named(tmp_path: Path) -> None:
    (tmp_path / "bad.yaml").write_text("domain: [unclosed\n")
    with pytest.raises(ValueError, match=r"^bad: not YAML"):
        snapshot_of(tmp_path)


def event(kind: str, version: str, t: float, node: str = "") -> dict[str, Any]:
    return {"event": kind, "version": version, "t": t, "node": node}


def test_applied_waits_for_every_node() -> None:
    class Plane:
        def __init__(self, events: list[dict[str, Any]]) -> None:
            self.recorded = events

        def events(self) -> list[dict[str, Any]]:
            return self.recorded

    events = [event("sent", "v2", 10.0), event("ack", "v2", 10.2, "r0"), event("ack", "v1", 10.3, "r1")]
    assert xds_propagation.applied(Plane(events), "v2", {"r0", "r1"}) is None  # type: ignore[arg-type]
    events += [event("sent", "v2", 10.1), event("ack", "v2", 10.5, "r1")]
    assert xds_propagation.applied(Plane(events), "v2", {"r0", "r1"}) == (10.0, 10.5)  # type: ignore[arg-type]


@pytest.mark.slow
def test_the_benchmark_runs_and_prints_its_figures(capsys: pytest.CaptureFixture[str]) -> None:
    assert xds_propagation.main(["--replicas", "2", "--rounds", "2", "--rules", "3"]) == 0
    out = capsys.readouterr().out
    assert "2 changes, 2 replicas, 3 rules" in out
    assert "push to applied by every replica: median" in out
