"""``export-envoy-quota`` without Envoy: the bucket matchers each route action becomes, what is
listed as not exported, and the refusal of a token-bucket ``no_assignment_behavior``.

Whether Envoy accepts the output is checked with the real binary in
``tests/e2e/test_quota_envoy_configs.py``; these tests pin the translation itself.
"""

from __future__ import annotations

import contextlib
import io
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from sidecar.__main__ import main
from sidecar.config import load_config
from sidecar.export.envoy_quota.export import check_quota_filters, export_quota
from sidecar.export.problems import ExportError
from tests.support.envoy_snippets import minimal_envoy_config

REPO = Path(__file__).resolve().parents[4]
HEADER_INPUT = "type.googleapis.com/envoy.type.matcher.v3.HttpRequestHeaderMatchInput"
SOURCE_IP = "type.googleapis.com/envoy.extensions.matching.common_inputs.network.v3.SourceIPInput"
ORIGIN = Path("envoy.yaml")

RULES = """\
domain: t
descriptors:
  - key: remote_address
    rate_limit: {unit: second, requests_per_unit: 20}
  - key: api_key
    rate_limit: {unit: minute, requests_per_unit: 10}
  - key: generic_key
    value: api
    rate_limit: {unit: second, requests_per_unit: 50}
    descriptors:
      - key: api_key
        rate_limit: {unit: minute, requests_per_unit: 10}
  - key: header_match
    value: write
    rate_limit: {unit: second, requests_per_unit: 5}
  - key: header_match
    value: read
    rate_limit: {unit: second, requests_per_unit: 500}
"""


def export(routes: str, tmp_path: Path, **options: Any) -> tuple[list[dict[str, Any]], list[str]]:
    """The filters exported for ``routes`` under :data:`RULES`, and the problems as text."""
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    document = yaml.safe_load(minimal_envoy_config(routes))
    result = export_quota(load_config(str(rules)).domains, document, ORIGIN, **options)
    return result.filters, [str(problem) for problem in result.problems]


def header(name: str, **match: Any) -> dict[str, Any]:
    """The predicate testing header ``name`` with the string matcher ``match``."""
    return {
        "single_predicate": {
            "input": {"name": "request-headers", "typed_config": {"@type": HEADER_INPUT, "header_name": name}},
            "value_match": match,
        }
    }


def regex(text: str) -> dict[str, Any]:
    return {"safe_regex": {"google_re2": {}, "regex": text}}


def present(name: str) -> dict[str, Any]:
    return header(name, **regex(".*"))


def filled(name: str) -> dict[str, Any]:
    """Header ``name`` present and not empty."""
    return header(name, **regex("(?s).+"))


def both(*predicates: dict[str, Any]) -> dict[str, Any]:
    return {"and_matcher": {"predicate": list(predicates)}}


def either(*predicates: dict[str, Any]) -> dict[str, Any]:
    return {"or_matcher": {"predicate": list(predicates)}}


def negated(predicate: dict[str, Any]) -> dict[str, Any]:
    return {"not_matcher": predicate}


def entries(filter_config: dict[str, Any]) -> list[dict[str, Any]]:
    matchers: list[dict[str, Any]] = filter_config["typed_config"]["bucket_matchers"]["matcher_list"]["matchers"]
    return matchers


def settings(entry: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, Any] = entry["on_match"]["action"]["typed_config"]
    return found


def bucket(entry: dict[str, Any]) -> dict[str, Any]:
    """The bucket id builder, each value shortened: a constant, ``header:<name>`` or ``source_ip``."""
    shortened = {}
    for key, value in settings(entry)["bucket_id_builder"]["bucket_id_builder"].items():
        if "string_value" in value:
            shortened[key] = value["string_value"]
        else:
            typed = value["custom_value"]["typed_config"]
            shortened[key] = f"header:{typed['header_name']}" if typed["@type"] == HEADER_INPUT else "source_ip"
            assert typed["@type"] in (HEADER_INPUT, SOURCE_IP)
    return shortened


def only_entry(routes: str, tmp_path: Path) -> dict[str, Any]:
    filters, _ = export(routes, tmp_path)
    assert len(filters) == 1
    (entry,) = entries(filters[0])
    return entry


# ---------------------------------------------------------------- each action kind


def test_remote_address_is_the_source_ip_input(tmp_path: Path) -> None:
    entry = only_entry("- match: {prefix: /}\n  route: {rate_limits: [{actions: [{remote_address: {}}]}]}", tmp_path)
    assert entry["predicate"] == header(":path", prefix="/")
    assert bucket(entry) == {"domain": "t", "entry.0.remote_address": "source_ip"}


def test_request_headers_reads_the_header_and_writes_an_empty_one_as_a_constant(tmp_path: Path) -> None:
    """The bucket id builder leaves out a field read empty (Envoy 1.36.4, 1.40.0), the
    ``ratelimit`` filter sends ``(api_key, "")``: an empty header is the constant ``""``."""
    routes = """\
    - match: {prefix: /}
      route: {rate_limits: [{actions: [{request_headers: {header_name: x-api-key, descriptor_key: api_key}}]}]}
    """
    filters, _ = export(routes, tmp_path)
    (only,) = filters
    value, empty = entries(only)
    assert value["predicate"] == both(header(":path", prefix="/"), filled("x-api-key"))
    assert bucket(value) == {"domain": "t", "entry.0.api_key": "header:x-api-key"}
    assert empty["predicate"] == both(header(":path", prefix="/"), header("x-api-key", exact=""))
    assert bucket(empty) == {"domain": "t", "entry.0.api_key": ""}


def test_generic_key_is_a_constant_and_entries_keep_their_order(tmp_path: Path) -> None:
    routes = """\
    - match: {prefix: /api}
      route:
        rate_limits:
          - actions:
              - generic_key: {descriptor_value: api}
              - request_headers: {header_name: x-api-key, descriptor_key: api_key}
    """
    filters, _ = export(routes, tmp_path)
    entry = entries(filters[0])[0]
    assert bucket(entry) == {"domain": "t", "entry.0.generic_key": "api", "entry.1.api_key": "header:x-api-key"}


def test_header_value_match_is_a_constant_under_the_header_predicate(tmp_path: Path) -> None:
    routes = """\
    - match: {prefix: /}
      route:
        rate_limits:
          - actions:
              - header_value_match:
                  descriptor_value: write
                  headers: [{name: ":method", string_match: {safe_regex: {regex: "POST|PUT"}}}]
    """
    entry = only_entry(routes, tmp_path)
    assert entry["predicate"] == both(header(":path", prefix="/"), header(":method", **regex("POST|PUT")))
    assert bucket(entry) == {"domain": "t", "entry.0.header_match": "write"}


def test_header_value_match_expect_false_inverted_and_legacy_matchers(tmp_path: Path) -> None:
    routes = """\
    - match: {prefix: /}
      route:
        rate_limits:
          - actions:
              - header_value_match:
                  descriptor_value: read
                  expect_match: false
                  headers:
                    - {name: ":method", exact_match: POST}
                    - {name: x-debug, string_match: {prefix: "y", ignore_case: true}, invert_match: true}
    """
    entry = only_entry(routes, tmp_path)
    method = header(":method", exact="POST", ignore_case=False)
    method["single_predicate"]["value_match"].pop("ignore_case")
    debug = (present("x-debug"), negated(header("x-debug", prefix="y", ignore_case=True)))
    assert entry["predicate"] == both(header(":path", prefix="/"), negated(both(method, *debug)))


def test_route_path_kinds_ignore_the_query_string_as_envoy_does(tmp_path: Path) -> None:
    routes = """\
    - match: {path: /login, case_sensitive: false}
      route: {rate_limits: [{actions: [{remote_address: {}}]}]}
    - match: {path_separated_prefix: /v1}
      route: {rate_limits: [{actions: [{remote_address: {}}]}]}
    - match: {safe_regex: {regex: "/items/[0-9]+"}}
      route: {rate_limits: [{actions: [{remote_address: {}}]}]}
    """
    filters, _ = export(routes, tmp_path)
    login, v1, items = (entry["predicate"] for entry in entries(filters[0]))
    assert login == either(
        header(":path", exact="/login", ignore_case=True), header(":path", prefix="/login?", ignore_case=True)
    )
    assert v1 == either(header(":path", exact="/v1"), header(":path", prefix="/v1/"), header(":path", prefix="/v1?"))
    assert items == header(":path", **regex("(?:/items/[0-9]+)(?:\\?.*)?"))


# ---------------------------------------------------------------- routes and filters


def test_a_request_an_earlier_route_takes_never_falls_through_to_a_later_route(tmp_path: Path) -> None:
    """Envoy takes the first matching route: a /login request without the header gets no bucket,
    not the catch-all route's; /health (no rate_limits at all) neither."""
    routes = """\
    - match: {prefix: /login}
      route: {rate_limits: [{actions: [{request_headers: {header_name: x-api-key, descriptor_key: api_key}}]}]}
    - match: {prefix: /health}
      route: {cluster: app}
    - match: {prefix: /}
      route: {rate_limits: [{actions: [{request_headers: {header_name: x-api-key, descriptor_key: api_key}}]}]}
    """
    filters, _ = export(routes, tmp_path)
    login, login_empty, rest, rest_empty = entries(filters[0])
    earlier = negated(either(header(":path", prefix="/login"), header(":path", prefix="/health")))
    assert rest["predicate"] == both(header(":path", prefix="/"), earlier, filled("x-api-key"))
    assert (bucket(login), bucket(login_empty)) == (bucket(rest), bucket(rest_empty))


def test_an_unconditional_earlier_route_needs_no_exclusion(tmp_path: Path) -> None:
    routes = """\
    - match: {prefix: /api}
      route: {rate_limits: [{actions: [{remote_address: {}}]}]}
    - match: {prefix: /}
      route: {rate_limits: [{actions: [{remote_address: {}}]}]}
    """
    filters, _ = export(routes, tmp_path)
    assert [entry["predicate"] for entry in entries(filters[0])] == [
        header(":path", prefix="/api"),
        header(":path", prefix="/"),
    ]


def test_one_filter_per_descriptor_a_route_sends_and_shared_descriptors_share_a_filter(tmp_path: Path) -> None:
    routes = """\
    - match: {prefix: /api}
      route:
        rate_limits:
          - actions: [{remote_address: {}}]
          - actions: [{generic_key: {descriptor_value: api}}]
          - actions: [{header_value_match: {descriptor_value: write, headers: [{name: ":method", exact_match: POST}]}}]
    - match: {prefix: /}
      route:
        rate_limits:
          - actions: [{header_value_match: {descriptor_value: write, headers: [{name: ":method", exact_match: POST}]}}]
          - actions: [{remote_address: {}}]
    """
    filters, _ = export(routes, tmp_path)
    assert [item["name"] for item in filters] == [
        "envoy.filters.http.rate_limit_quota",
        "envoy.filters.http.rate_limit_quota.1",
        "envoy.filters.http.rate_limit_quota.2",
    ]
    shapes = [[bucket(entry) for entry in entries(item)] for item in filters]
    address = {"domain": "t", "entry.0.remote_address": "source_ip"}
    write = {"domain": "t", "entry.0.header_match": "write"}
    assert shapes == [[address, address], [{"domain": "t", "entry.0.generic_key": "api"}], [write, write]]


def test_bucket_settings_never_hold_a_token_bucket_and_say_429(tmp_path: Path) -> None:
    entry = only_entry("- match: {prefix: /}\n  route: {rate_limits: [{actions: [{remote_address: {}}]}]}", tmp_path)
    assert settings(entry) | {"bucket_id_builder": None} == {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.rate_limit_quota.v3.RateLimitQuotaBucketSettings",
        "bucket_id_builder": None,
        "reporting_interval": "5s",
        "deny_response_settings": {"http_status": {"code": "TooManyRequests"}},
        "no_assignment_behavior": {"fallback_rate_limit": {"blanket_rule": "ALLOW_ALL"}},
        "expired_assignment_behavior": {
            "expired_assignment_behavior_timeout": "60s",
            "fallback_rate_limit": {"blanket_rule": "ALLOW_ALL"},
        },
    }


def test_deny_all_fallback_and_the_cluster_name(tmp_path: Path) -> None:
    routes = "- match: {prefix: /}\n  route: {rate_limits: [{actions: [{remote_address: {}}]}]}"
    filters, problems = export(routes, tmp_path, cluster="limits", fallback="deny")
    typed = filters[0]["typed_config"]
    assert typed["rlqs_server"] == {"envoy_grpc": {"cluster_name": "limits"}}
    assert typed["domain"] == "t"
    found = settings(entries(filters[0])[0])
    assert found["no_assignment_behavior"]["fallback_rate_limit"] == {"blanket_rule": "DENY_ALL"}
    assert found["expired_assignment_behavior"]["fallback_rate_limit"] == {"blanket_rule": "DENY_ALL"}
    assert any("failure_mode_deny differs from --no-assignment deny" in line for line in problems)


# ---------------------------------------------------------------- not exported


def test_what_cannot_be_translated_is_listed_one_line_each(tmp_path: Path) -> None:
    routes = """\
    - match: {prefix: /q, grpc: {}}
      route: {rate_limits: [{actions: [{remote_address: {}}]}]}
    - match: {prefix: /}
      route:
        rate_limits:
          - actions: [{masked_remote_address: {v4_prefix_mask_len: 24}}]
          - actions: [{extension: {name: acme.descriptor}}]
          - actions: [{generic_key: {descriptor_value: nowhere}}]
          - actions: [{remote_address: {}}]
            limit: {dynamic_metadata: {metadata_key: {key: k, path: [{key: p}]}}}
          - stage: 1
            actions: [{remote_address: {}}]
          - actions: [{remote_address: {}}]
    """
    filters, problems = export(routes, tmp_path)
    assert len(filters) == 1
    assert [bucket(entry) for entry in entries(filters[0])] == [{"domain": "t", "entry.0.remote_address": "source_ip"}]
    expected = [
        "not exported: envoy.yaml: route 0 (prefix /q) rate_limits[0]: the route's match on grpc is not exported",
        "not exported: envoy.yaml: route 0 (prefix /q): match not translated; its requests would land in the "
        "buckets of route 1 (prefix /)",
        "route 1 (prefix /) rate_limits[0]: action 'masked_remote_address': a bucket id cannot hold a masked address",
        "rate_limits[1]: action 'extension': an extension's descriptor is not known here; descriptor not exported",
        "note: envoy.yaml: route 1 (prefix /) rate_limits[2]: matches no rule of domain 't'",
        "rate_limits[3]: limit not supported; descriptor not exported",
        "note: envoy.yaml: route 1 (prefix /) rate_limits[4]: stage 1: not applied by the filter (stage 0)",
    ]
    for text in expected:
        assert sum(text in line for line in problems) == 1, (text, problems)
    assert all("\n" not in line for line in problems)


def test_an_envoy_config_without_anything_to_export_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match="no route sends a descriptor"):
        export("- match: {prefix: /}\n  route: {cluster: app}", tmp_path)


# ---------------------------------------------------------------- the token-bucket refusal


def token_bucket_config(tmp_path: Path) -> Path:
    """envoy/quota.yaml with the second filter's first bucket falling back to a token bucket."""
    document = yaml.safe_load((REPO / "envoy" / "quota.yaml").read_text())
    listener = document["static_resources"]["listeners"][0]
    chain = listener["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]
    first = chain[1]["typed_config"]["bucket_matchers"]  # the route shape: nothing tested, on_no_match
    first["on_no_match"]["action"]["typed_config"]["no_assignment_behavior"] = {
        "fallback_rate_limit": {
            "token_bucket": {"max_tokens": 10, "tokens_per_fill": 10, "fill_interval": "1s"},
        }
    }
    path = tmp_path / "crash.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def test_a_token_bucket_no_assignment_behavior_is_refused_naming_the_filter(tmp_path: Path) -> None:
    path = token_bucket_config(tmp_path)
    errors = check_quota_filters(yaml.safe_load(path.read_text()), str(path))
    assert len(errors) == 1
    assert "filter 'envoy.filters.http.rate_limit_quota.1'" in errors[0]
    assert "no_assignment_behavior is a token_bucket" in errors[0]
    assert "crashes" in errors[0]


def run_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def test_check_flag_exit_codes(tmp_path: Path) -> None:
    code, out, err = run_cli("export-envoy-quota", "--envoy", str(token_bucket_config(tmp_path)), "--check")
    assert (code, out) == (1, "")
    assert "token_bucket" in err
    code, out, err = run_cli("export-envoy-quota", "--envoy", str(REPO / "envoy" / "quota.yaml"), "--check")
    assert code == 0, err
    assert "5 rate_limit_quota filter(s) checked: OK" in out  # one per descriptor (route shape)


def test_cli_prints_filters_and_lists_problems_on_stderr(tmp_path: Path) -> None:
    """A limit left out fails the export, its reasons on stderr and nothing on stdout;
    ``--allow-dropped`` accepts the loss and prints the rest."""
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    envoy = tmp_path / "envoy.yaml"
    envoy.write_text(
        minimal_envoy_config(
            """\
            - match: {prefix: /}
              route:
                rate_limits:
                  - actions: [{remote_address: {}}]
                  - actions: [{masked_remote_address: {}}]
            """
        )
    )
    reason = (
        f"not exported: {envoy}: route 0 (prefix /) rate_limits[1]: action 'masked_remote_address': a bucket id "
        "cannot hold a masked address (no matcher input masks one); descriptor not exported"
    )
    code, out, err = run_cli("export-envoy-quota", str(rules), "--envoy", str(envoy))
    assert (code, out) == (1, "")
    assert err.splitlines()[0] == reason
    assert "1 limit(s) or descriptor(s) above would be left out" in err.splitlines()[1]
    assert "--allow-dropped" in err.splitlines()[1]
    code, out, err = run_cli("export-envoy-quota", str(rules), "--envoy", str(envoy), "--allow-dropped")
    assert code == 0
    assert out.startswith(
        f"# Generated by `ratelimit-sidecar export-envoy-quota {rules} --envoy {envoy} --allow-dropped`"
    )
    filters = yaml.safe_load(out)
    assert [item["name"] for item in filters] == ["envoy.filters.http.rate_limit_quota"]
    assert err.splitlines() == [reason]
    code, _, err = run_cli("export-envoy-quota", "--envoy", str(envoy))
    assert code == 1
    assert "a descriptor config is required" in err


def test_a_failed_export_prints_its_reasons(tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    envoy = tmp_path / "envoy.yaml"
    envoy.write_text(
        minimal_envoy_config(
            "- match: {prefix: /}\n  route: {rate_limits: [{actions: [{metadata: {descriptor_key: k}}]}]}"
        )
    )
    code, out, err = run_cli("export-envoy-quota", str(rules), "--envoy", str(envoy), "--allow-dropped")
    assert (code, out) == (1, "")
    assert "no route sends a descriptor that could be exported" in err
    assert (
        "route 0 (prefix /) rate_limits[0]: action 'metadata': descriptor_key and metadata_key.key are required" in err
    )


def test_front_yaml_buckets_follow_the_convention() -> None:
    config = load_config(str(REPO / "examples" / "config"))
    document = yaml.safe_load((REPO / "envoy" / "front.yaml").read_text())
    result = export_quota(config.domains, document, Path("envoy/front.yaml"))
    assert len(result.filters) == 4
    for item in result.filters:
        for entry in entries(item):
            keys = list(bucket(entry))
            assert keys[0] == "domain"
            assert all(key.startswith(f"entry.{index}.") for index, key in enumerate(keys[1:]))
    assert "token_bucket" not in textwrap.dedent(yaml.safe_dump(result.filters))
