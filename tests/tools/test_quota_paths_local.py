"""The in-process baselines of ``python -m loadtest.quota_paths`` (``loadtest/local_limits.py``):
(b) one bucket and (b') a bucket per client address are configs Envoy accepts, (b') really
keeps a bucket per client in a real Envoy (so it does the limit quota mode does), and the
report gives every variant's ratio to both."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from loadtest.local_limits import LOCAL_RATELIMIT, local_per_client
from loadtest.quota_paths import BENCH_CONFIG, PER_CLIENT, RunResult, summarize, variant_config
from loadtest.quota_shapes import TEMPLATE
from stack.envoy import RATELIMIT_FILTER, ConfiguredEnvoy, EnvoyPorts, ingress_manager, render, validate_config
from stack.processes import process_group
from stack.upstream import UpstreamProcess
from tests.support.envoys import Session


def bench_variant(tmp_path: Path, variant: str) -> dict[str, Any]:
    rules = tmp_path / "bench.yaml"
    rules.write_text(BENCH_CONFIG)
    return variant_config(variant, EnvoyPorts(10000, 10001, 10002, 10003), rules, ["route"])


def filter_names(config: dict[str, Any]) -> list[str]:
    return [item["name"] for item in ingress_manager(config, TEMPLATE)["http_filters"]]


@pytest.mark.envoy
@pytest.mark.parametrize("variant", ["local", PER_CLIENT])
def test_each_local_baseline_is_a_config_envoy_accepts(tmp_path: Path, variant: str) -> None:
    config = bench_variant(tmp_path, variant)
    # Envoy alone: no sidecar to ask, the local filter right before the router.
    assert RATELIMIT_FILTER not in filter_names(config)
    assert filter_names(config)[-2:] == [LOCAL_RATELIMIT, "envoy.filters.http.router"]
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(config))
    result = validate_config(path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_per_client_baseline_builds_a_descriptor_and_matches_it_with_a_wildcard(tmp_path: Path) -> None:
    """What makes (b') do (c)'s work: a descriptor from the client address per request, one
    configured descriptor with no value (a wildcard: a bucket per value), and only that bucket
    consumed; (b) has none of it."""
    (limiter,) = [item for item in ingress_manager(bench_variant(tmp_path, PER_CLIENT), TEMPLATE)["http_filters"]
                  if item["name"] == LOCAL_RATELIMIT]  # fmt: skip
    typed = limiter["typed_config"]
    assert typed["rate_limits"] == [{"actions": [{"remote_address": {}}]}]
    assert [descriptor["entries"] for descriptor in typed["descriptors"]] == [[{"key": "remote_address"}]]
    assert typed["always_consume_default_token_bucket"] is False
    (single,) = [item for item in ingress_manager(bench_variant(tmp_path, "local"), TEMPLATE)["http_filters"]
                 if item["name"] == LOCAL_RATELIMIT]  # fmt: skip
    assert "descriptors" not in single["typed_config"] and "rate_limits" not in single["typed_config"]


@pytest.mark.slow
@pytest.mark.envoy
@pytest.mark.serial
def test_the_per_client_baseline_keeps_a_bucket_per_client_address_in_envoy(tmp_path: Path) -> None:
    """Two tokens an hour per client (no refill within the test, however slow the machine):
    each of two clients gets two 200s then a 429. Were it one shared bucket (the default one,
    also two tokens), the second client would get 429 at once."""
    with process_group() as group:
        app = group.start(UpstreamProcess("app", tmp_path))
        app.wait_ready()
        ports = EnvoyPorts.free(app.port, app.port)
        config = local_per_client(render(TEMPLATE, ports, ratelimit=False), TEMPLATE, limit=2, fill_interval="3600s")
        envoy = group.start(ConfiguredEnvoy("envoy", config, tmp_path, listen=ports.listen, admin=ports.admin))
        envoy.wait_ready()
        session = Session(envoy.url)
        try:
            statuses = {
                client: [session.send("/bench", {"x-forwarded-for": client}).status for _ in range(3)]
                for client in ("10.0.0.1", "10.0.0.2")
            }
        finally:
            session.close()
    assert statuses == {"10.0.0.1": [200, 200, 429], "10.0.0.2": [200, 200, 429]}


def test_every_run_is_compared_with_both_baselines_of_its_round() -> None:
    def run(variant: str, number: int, rps: float, cpu: float) -> RunResult:
        return RunResult(variant, number, rps, int(rps), 0, 0, 1.0, 2.0, envoy_cpu_seconds=cpu)

    results = [
        run("local", 1, 1000, 1.0), run(PER_CLIENT, 1, 950, 1.0), run("quota", 1, 900, 1.0),
        run("local", 2, 2000, 1.0), run(PER_CLIENT, 2, 1600, 1.0), run("quota", 2, 1600, 1.0),
    ]  # fmt: skip
    rows = summarize(results, {"local": "(b)", PER_CLIENT: "(b')", "quota": "(c)"})
    assert rows["quota"]["round_ratios"] == [0.9, 0.8]
    assert rows["quota"]["round_ratios_per_client"] == pytest.approx([900 / 950, 1.0])
    assert rows["quota"]["ratio_per_client"] == pytest.approx(1250 / 1275)  # of the medians
    assert rows[PER_CLIENT]["ratio_per_client"] == 1.0
    assert rows[PER_CLIENT]["ratio"] == pytest.approx(1275 / 1500)  # (b') against (b), kept too
    # Envoy CPU per request: (b') 1/950, 1/1600; (c) 1/900, 1/1600
    assert rows["quota"]["cpu_ratios_per_client"] == pytest.approx([900 / 950, 1.0])
    # Without (b') measured, no ratio to it (not a ratio to something else).
    alone = summarize([run("local", 1, 1000, 1.0), run("quota", 1, 900, 1.0)], {"local": "(b)", "quota": "(c)"})
    assert alone["quota"]["ratio_per_client"] is None and alone["quota"]["round_ratios_per_client"] == []
