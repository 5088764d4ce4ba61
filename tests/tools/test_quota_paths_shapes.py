"""``python -m loadtest.quota_paths --quota-shapes`` (``loadtest/quota_shapes.py``): each shape
is a config Envoy accepts, the measurement-only shapes (tree, CEL) refuse what they could not
express exactly, and the report's per-round ratios pair each run with the same round's (b)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
import yaml

from loadtest.quota_paths import BENCH_CONFIG, RunResult, summarize
from loadtest.quota_shapes import QUOTA_SHAPES, TEMPLATE, add_routes, prefix_tree, quota_config, shape_list
from stack.envoy import EnvoyPorts, ingress_manager, render, validate_config


def bench_config(tmp_path: Path, shape: str, extra_routes: int = 0) -> dict[str, Any]:
    rules = tmp_path / "bench.yaml"
    rules.write_text(BENCH_CONFIG)
    config = add_routes(render(TEMPLATE, EnvoyPorts(10000, 10001, 10002, 10003)), extra_routes)
    return quota_config(config, rules, shape)


def quota_filters(config: dict[str, Any]) -> list[dict[str, Any]]:
    chain = ingress_manager(config, TEMPLATE)["http_filters"]
    return [item for item in chain if "bucket_matchers" in item.get("typed_config", {})]


@pytest.mark.envoy
@pytest.mark.parametrize("shape", QUOTA_SHAPES)
def test_every_shape_is_a_config_envoy_accepts(tmp_path: Path, shape: str) -> None:
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(bench_config(tmp_path, shape, extra_routes=12)))
    result = validate_config(path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_shapes_of_the_bench_route(tmp_path: Path) -> None:
    """The bench's one descriptor (the client address, every route): ``route`` tests nothing,
    ``list`` three prefixes in route order, ``tree`` the same prefixes in a map."""
    directory = tmp_path
    (route,) = quota_filters(bench_config(directory, "route"))
    assert set(route["typed_config"]["bucket_matchers"]) == {"on_no_match"}
    (listed,) = quota_filters(bench_config(directory, "list"))
    entries = listed["typed_config"]["bucket_matchers"]["matcher_list"]["matchers"]
    assert [entry["predicate"]["single_predicate"]["value_match"] for entry in entries] == [
        {"prefix": "/api"}, {"prefix": "/login"}, {"prefix": "/"}
    ]  # fmt: skip
    (tree,) = quota_filters(bench_config(directory, "tree"))
    assert list(tree["typed_config"]["bucket_matchers"]["matcher_tree"]["prefix_match_map"]["map"]) == [
        "/api", "/login", "/"
    ]  # fmt: skip
    assert len(quota_filters(bench_config(directory, "list-all"))) == 4
    assert len(quota_filters(bench_config(directory, "route-all"))) == 5
    # --extra-routes: more :path tests in the list and the tree, still none in the route shape.
    (listed,) = quota_filters(bench_config(directory, "list", extra_routes=12))
    assert len(listed["typed_config"]["bucket_matchers"]["matcher_list"]["matchers"]) == 15
    (tree,) = quota_filters(bench_config(directory, "tree", extra_routes=12))
    assert "/extra/11/" in tree["typed_config"]["bucket_matchers"]["matcher_tree"]["prefix_match_map"]["map"]
    (route,) = quota_filters(bench_config(directory, "route", extra_routes=12))
    assert set(route["typed_config"]["bucket_matchers"]) == {"on_no_match"}


def test_a_tree_is_refused_where_the_longest_prefix_would_pick_another_route() -> None:
    """``/`` before ``/api``: the router (and the list) give ``/api/x`` to ``/``, a prefix map to ``/api``."""

    def entry(prefix: str) -> dict[str, Any]:
        header = {"typed_config": {"header_name": ":path"}}
        return {"predicate": {"single_predicate": {"input": header, "value_match": {"prefix": prefix}}}, "on_match": {}}

    with pytest.raises(ValueError, match="'/' is before '/api'"):
        prefix_tree({"matcher_list": {"matchers": [entry("/"), entry("/api")]}})
    with pytest.raises(ValueError, match="tests more than a :path prefix"):
        prefix_tree({"matcher_list": {"matchers": [{"predicate": {"and_matcher": {}}, "on_match": {}}]}})


def test_shape_lists_are_distinct_known_names() -> None:
    assert shape_list("route, list") == "route,list"
    for bad in ("", "route,route", "route,nope"):
        with pytest.raises(argparse.ArgumentTypeError):
            shape_list(bad)


def test_each_run_is_compared_with_the_same_rounds_reference() -> None:
    def run(variant: str, number: int, rps: float, cpu: float) -> RunResult:
        return RunResult(variant, number, rps, int(rps), 0, 0, 1.0, 2.0, envoy_cpu_seconds=cpu)

    results = [
        run("local", 1, 1000, 1.0), run("quota", 1, 900, 1.0),
        run("local", 2, 2000, 1.0), run("quota", 2, 2000, 2.0),
        run("local", 3, 500, 1.0), run("quota", 3, 400, 0.5),
    ]  # fmt: skip
    rows = summarize(results, {"local": "(b)", "quota": "(c)"})
    assert rows["quota"]["round_ratios"] == [0.9, 1.0, 0.8]
    assert rows["quota"]["ratio"] == pytest.approx(900 / 1000)  # of the medians
    # CPU per request: (b) 1/1000, 1/2000, 1/500; (c) 1/900, 2/2000, 0.5/400
    assert rows["quota"]["cpu_ratios"] == pytest.approx([0.9, 0.5, 1.6])
    assert rows["quota"]["cpu_ratio"] == pytest.approx((3.0 / 3500) / (3.5 / 3300))
