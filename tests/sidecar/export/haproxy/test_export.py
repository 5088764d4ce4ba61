"""The HAProxy exporter without HAProxy: what it generates, in which order, and what it reports.

Whether HAProxy accepts and enforces the output is checked against the real binary in
``tests/sidecar/export/haproxy/test_haproxy_process.py``; these tests pin the translation itself.
"""

from __future__ import annotations

import contextlib
import io
import re
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from sidecar.__main__ import main
from sidecar.config import load_config
from sidecar.export.haproxy import (
    KEY_LENGTH,
    MAX_SLOTS,
    Const,
    ExportError,
    ExportOptions,
    Flavour,
    Producer,
    Route,
    Sources,
    export,
    header_tests,
    header_value_match,
    patterns,
    quote,
    route_test,
    sources_from_envoy,
    sources_from_flags,
)
from tests.support.envoy_snippets import EXTENSION_FLAGS, EXTENSIONS_ROUTES, minimal_envoy_config

REPO = Path(__file__).resolve().parents[4]
DEMO = REPO / "examples" / "config"
ENVOY = REPO / "envoy" / "sidecar.yaml"


def demo_export(flavour: Flavour = "fixed") -> tuple[str, list[str]]:
    config = load_config(DEMO)
    sources = sources_from_envoy(ENVOY, {})
    result = export(config.domains["demo"], sources, ExportOptions(flavour=flavour))
    return result.text, [str(problem) for problem in result.problems]


def rule_lines(text: str) -> list[str]:
    """The http-request lines, without comments."""
    return [line.strip().split("  #")[0] for line in text.splitlines() if line.strip().startswith("http-request")]


def envoy_config(routes: str, domain: str = "t") -> str:
    """A minimal Envoy config: one listener, the rate-limit filter, ``routes`` (YAML list text)."""
    return minimal_envoy_config(routes, domain)


def run_cli(
    tmp_path: Path, config: str, *args: str, envoy: str | None = None, allow_dropped: bool = True
) -> SimpleNamespace:
    """``ratelimit-sidecar export-haproxy`` in-process on a config text (and an Envoy config text);
    with ``--allow-dropped`` unless told (these tests look at what is left out)."""
    config_file = tmp_path / "rules.yaml"
    config_file.write_text(textwrap.dedent(config))
    argv = ["export-haproxy", str(config_file), *args, *(["--allow-dropped"] if allow_dropped else [])]
    if envoy is not None:
        envoy_file = tmp_path / "envoy.yaml"
        envoy_file.write_text(envoy)
        argv += ["--envoy", str(envoy_file)]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return SimpleNamespace(code=code, out=out.getvalue(), err=err.getvalue().splitlines())


# ---------------------------------------------------------------- the demo


def test_demo_exports_every_rule_with_one_note() -> None:
    text, problems = demo_export()
    assert problems == [
        f"note: {DEMO / 'demo.yaml'}:55: demo.generic_key_login.remote_address (login_attempts): "
        "shadow_mode: counted like the sidecar but never denied; a request over it gets /r6 in the "
        "txn.rl_shadow variable (log it with %[var(txn.rl_shadow)])"
    ]
    assert "not exported" not in text
    summary = [line.strip() for line in text.splitlines() if line.strip().startswith("#   r")]
    assert summary == [
        "#   r0: demo.remote_address 20/second: rl_demo_fixed_second slot 0",
        "#   r1: demo.generic_key_api (api_route) 50/second: rl_demo_fixed_second slot 1",
        "#   r2: demo.generic_key_api.api_key (per_api_key) 10/minute: rl_demo_fixed_minute slot 0",
        "#   r3: demo.generic_key_api.api_key_premium-* (premium_key) 100/minute: rl_demo_fixed_minute slot 1",
        "#   r4: demo.generic_key_api.api_key_internal-monitoring unlimited: nothing counted",
        "#   r5: demo.header_match_write 5/second: rl_demo_fixed_second slot 2",
        "#   r6: demo.generic_key_login.remote_address (login_attempts) 3/minute shadow: rl_demo_fixed_minute slot 2",
    ]


def test_every_check_runs_before_any_counter_moves() -> None:
    """All-or-nothing: a request refused by one limit must not have spent another."""
    for flavour in ("fixed", "sliding"):
        lines = rule_lines(demo_export(flavour)[0])
        kinds = [line.split()[1].split("(")[0] for line in lines]
        checks = [i for i, line in enumerate(lines) if " deny " in line or "set-var(txn.rl_shadow)" in line]
        tracks = [i for i, kind in enumerate(kinds) if kind.startswith("track-sc")]
        first_count = kinds.index("sc-inc-gpc")
        assert max(tracks) < min(checks) < max(checks) < first_count
        assert set(kinds[first_count:]) == {"sc-inc-gpc"}


def test_checks_go_longest_window_first_with_retry_after() -> None:
    """The first denial that fires names the longest window, so its Retry-After is the largest."""
    fixed = [line for line in rule_lines(demo_export("fixed")[0]) if " deny " in line]
    windows = [int(re.search(r";w=(\d+)", line).group(1)) for line in fixed]  # type: ignore[union-attr]
    assert windows == sorted(windows, reverse=True)
    minute = next(line for line in fixed if ";w=60" in line)
    assert 'hdr Retry-After "%[date,mod(60),neg,add(60)]"' in minute
    assert "status 429" in minute
    second = next(line for line in fixed if ";w=1" in line)
    assert "hdr Retry-After 1 " in second
    sliding = [line for line in rule_lines(demo_export("sliding")[0]) if " deny " in line]
    assert all("hdr Retry-After 60 " in line for line in sliding if ";w=60" in line)


def test_fixed_keys_hold_the_window_and_sliding_ones_do_not() -> None:
    fixed, _ = demo_export("fixed")
    assert "http-request set-var(txn.rl_w60) date,div(60)" in fixed
    assert "http-request set-var(txn.rl_w1) date" in fixed
    assert "sc_get_gpc(" in fixed and "sc_gpc_rate(" not in fixed
    assert "store gpc(3)" in fixed and "expire 61s" in fixed and "expire 2s" in fixed
    sliding, _ = demo_export("sliding")
    assert "date" not in "\n".join(line for line in rule_lines(sliding) if "set-var(txn.rl_k" in line)
    assert "sc_gpc_rate(" in sliding and "sc_get_gpc(" not in sliding
    assert "store gpc_rate(3,60s)" in sliding and "expire 121s" in sliding
    assert "http_req_rate" not in fixed + sliding, "denied requests must not count"


def test_demo_fits_three_trackers_by_sharing_entries() -> None:
    """Rules with the same key values and window share one table entry (one gpc slot each)."""
    lines = rule_lines(demo_export()[0])
    trackers = {int(match) for line in lines for match in re.findall(r"track-sc(\d)", line)}
    assert trackers == {0, 1, 2}
    api_route = next(line for line in lines if '"50, 50;w=1"' in line)
    writes = [line for line in lines if '"5, 5;w=1"' in line]
    assert "sc_get_gpc(1,1)" in api_route
    assert writes == [next(line for line in writes if "if rl_routed rl_write { sc_get_gpc(2,1) ge 5 }" in line)]
    track = "http-request track-sc1 var(txn.rl_k1) table rl_demo_fixed_second"
    assert f"{track} if rl_route0 !rl_replaced0 || rl_routed rl_write" in lines


def test_replaced_limits_are_skipped_when_the_replacing_rule_applies() -> None:
    lines = rule_lines(demo_export()[0])
    setter = [line for line in lines if "set-var(txn.rl_replaced0)" in line]
    assert setter == [
        "http-request set-var(txn.rl_replaced0) bool(1) if rl_route0 rl_has_api_key "
        "!rl_api_key_is_internal_monitoring rl_api_key_like_premium"
    ]
    api_route = [line for line in lines if '"50, 50;w=1"' in line or "sc-inc-gpc(1,1)" in line]
    assert len(api_route) == 2
    assert all("!rl_replaced0" in line for line in api_route)


def test_branches_follow_the_match_order_exact_wildcard_default() -> None:
    text = demo_export()[0]
    assert "acl rl_api_key_is_internal_monitoring req.fhdr(x-api-key,1) -m str internal-monitoring" in text
    assert "acl rl_api_key_like_premium req.fhdr(x-api-key,1) -m beg premium-" in text
    lines = rule_lines(text)
    per_key = next(line for line in lines if '"10, 10;w=60"' in line)
    premium = next(line for line in lines if '"100, 100;w=60"' in line)
    assert "!rl_api_key_is_internal_monitoring !rl_api_key_like_premium" in per_key
    assert "!rl_api_key_is_internal_monitoring rl_api_key_like_premium" in premium
    assert not any("internal" in line and "sc-inc" in line and "!rl_api" not in line for line in lines)


def test_routes_are_picked_first_match_wins() -> None:
    lines = rule_lines(demo_export()[0])
    routing = [line for line in lines if "set-var(txn.rl_route)" in line]
    assert routing == [
        "http-request set-var(txn.rl_route) int(0) if rl_prefix_api",
        "http-request set-var(txn.rl_route) int(1) if !rl_routed rl_prefix_login",
        "http-request set-var(txn.rl_route) int(2) if !rl_routed rl_prefix",
    ]


def test_shadow_rule_is_counted_but_never_denies() -> None:
    lines = rule_lines(demo_export()[0])
    shadow = [line for line in lines if " ge 3 }" in line]
    assert shadow == [
        "http-request set-var(txn.rl_shadow) str(),concat(,txn.rl_shadow,/r6) if rl_route1 { sc_get_gpc(2,2) ge 3 }"
    ]
    assert "http-request sc-inc-gpc(2,2) if rl_route1" in lines


def test_long_keys_are_hashed_and_addresses_are_not() -> None:
    lines = rule_lines(demo_export()[0])
    hashed = [line for line in lines if "sha2(256)" in line]
    assert hashed == [
        "http-request set-var(txn.rl_k2) var(txn.rl_k2),sha2(256),bytes(0,16),hex"
        f" if {{ var(txn.rl_k2),length gt {KEY_LENGTH} }}"
    ]
    assert "http-request set-var(txn.rl_k2) var(txn.rl_w60),concat(:,txn.rl_v1,) if rl_route0" in lines
    assert "http-request set-var(txn.rl_v1) req.fhdr(x-api-key,1)" in lines


# ---------------------------------------------------------------- quoting


@pytest.mark.parametrize(
    ("word", "quoted"),
    [
        ("premium-", "premium-"),
        ("/api", "/api"),
        ("it's", "'it'\\''s'"),
        ("a b", "'a b'"),
        ("$HOME", "'$HOME'"),
        ("#x", "'#x'"),
        ("}", "'}'"),
        ("-x", "'-x'"),
    ],
)
def test_quote(word: str, quoted: str) -> None:
    assert quote(word) == quoted


def test_patterns_that_look_like_flags_follow_a_double_dash() -> None:
    assert patterns(["-i"]) == "-- '-i'"
    assert patterns(["a", "b c"]) == "a 'b c'"


# ---------------------------------------------------------------- what cannot be exported


UNSUPPORTED = """\
domain: t
descriptors:
  - key: monthly
    rate_limit: {unit: month, requests_per_unit: 1}
  - key: weekly
    rate_limit: {unit: week, requests_per_unit: 1}
  - key: quota
    quota_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: never_sent
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: masked
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: a
    rate_limit: {unit: second, requests_per_unit: 1}
  - key: b
    rate_limit: {unit: second, requests_per_unit: 1}
  - key: c
    rate_limit: {unit: second, requests_per_unit: 1}
  - key: d
    rate_limit: {unit: second, requests_per_unit: 1}
  - key: generic_key
    rate_limit: {unit: second, requests_per_unit: 1}
"""
UNSUPPORTED_ROUTES = """\
- match: {prefix: "/h", headers: [{name: x, exact_match: y}]}
  route: {rate_limits: [{actions: [{request_headers: {header_name: x-a, descriptor_key: a}}]}]}
- match: {prefix: "/"}
  route:
    rate_limits:
      - actions: [{request_headers: {header_name: x-m, descriptor_key: monthly}}]
      - actions: [{request_headers: {header_name: x-w, descriptor_key: weekly}}]
      - actions: [{request_headers: {header_name: x-q, descriptor_key: quota}}]
      - actions: [{masked_remote_address: {v4_prefix_mask_len: 24}}]
      - actions: [{request_headers: {header_name: x-s, descriptor_key: a, skip_if_absent: true}}]
      - actions: [{request_headers: {header_name: x-a, descriptor_key: a}}]
      - actions: [{request_headers: {header_name: x-b, descriptor_key: b}}]
      - actions: [{request_headers: {header_name: x-c, descriptor_key: c}}]
      - actions: [{request_headers: {header_name: x-d, descriptor_key: d}}]
      - actions: [{generic_key: {descriptor_value: "has space"}}]
      - stage: 1
        actions: [{remote_address: {}}]
"""


def test_every_rule_that_cannot_be_exported_is_reported_with_its_reason(tmp_path: Path) -> None:
    result = run_cli(tmp_path, UNSUPPORTED, envoy=envoy_config(UNSUPPORTED_ROUTES))
    assert result.code == 0
    rules = tmp_path / "rules.yaml"
    envoy = tmp_path / "envoy.yaml"
    trackers = "needs a stick counter beyond sc2; HAProxy 2.6 tracks sc0..sc2 per request (rules sharing key values "
    assert result.err == [
        f"not exported: {envoy}: route 0: match on headers is not exported; its requests fall through to later "
        "routes in HAProxy",
        f"not exported: {envoy}: route 1 (prefix /) rate_limits[3]: action 'masked_remote_address' has no HAProxy "
        "translation here; descriptor not exported",
        f"not exported: {envoy}: route 1 (prefix /) rate_limits[4]: request_headers with skip_if_absent is not "
        "supported; descriptor not exported",
        f"note: {envoy}: route 1 (prefix /) rate_limits[10]: stage 1: not applied by the filter (stage 0)",
        f"not exported: {rules}:4: t.monthly: unit month: a fixed window needs a table expire of 2592001 s; "
        "HAProxy 2.6 allows at most 2147483 s (~24.8 days)",
        f"not exported: {rules}:9: t.quota: quota_mode (reject only when every quota descriptor is over) is not "
        "exported",
        f"not exported: {rules}:11: t.never_sent: no descriptor that {envoy} sends lands on it (nothing to enforce)",
        f"not exported: {rules}:13: t.masked: no descriptor that {envoy} sends lands on it (nothing to enforce)",
        f"not exported: {rules}:19: t.c: on route 1 (prefix /): {trackers}and window share one)",
        f"not exported: {rules}:21: t.d: on route 1 (prefix /): {trackers}and window share one)",
        f"not exported: {rules}:23: t.generic_key: constant value 'has space' in the counter key needs quoting the "
        "exporter does not do",
    ]
    assert "t.weekly 1/week: rl_t_fixed_week slot 0" in result.out
    assert "expire 604801s" in result.out
    assert "t.a 1/second: rl_t_fixed_second slot 0" in result.out


def test_units_beyond_haproxys_timers_are_reported_per_flavour(tmp_path: Path) -> None:
    config = """\
    domain: t
    descriptors:
      - key: w
        rate_limit: {unit: week, requests_per_unit: 1}
      - key: y
        rate_limit: {unit: year, requests_per_unit: 1}
    """
    result = run_cli(tmp_path, config, "--flavour", "sliding", "--fetch", "w=src", "--fetch", "y=src")
    assert result.code == 0
    assert result.err == [
        f"not exported: {tmp_path / 'rules.yaml'}:6: t.y: unit year: a sliding window needs a rate period and "
        "expire of 63072001 s; HAProxy 2.6 allows at most 2147483 s (~24.8 days)"
    ]
    assert "store gpc_rate(1,604800s)" in result.out and "expire 1209601s" in result.out


def test_without_envoy_unmapped_keys_and_constants_are_reported(tmp_path: Path) -> None:
    result = run_cli(tmp_path, (DEMO / "demo.yaml").read_text())
    demo = tmp_path / "rules.yaml"
    assert result.code == 0
    api = "no --when generic_key=api says when HAProxy sends it (or --fetch generic_key=SAMPLE)"
    assert result.err == [
        f"not exported: {demo}:15: demo.generic_key_api (api_route): {api}",
        f"not exported: {demo}:22: demo.generic_key_api.api_key (per_api_key): {api}",
        f"not exported: {demo}:29: demo.generic_key_api.api_key_premium-* (premium_key): {api}",
        f"not exported: {demo}:38: demo.generic_key_api.api_key_internal-monitoring: {api}",
        f"not exported: {demo}:44: demo.header_match_write: no --when header_match=write says when HAProxy "
        "sends it (or --fetch header_match=SAMPLE)",
        f"not exported: {demo}:55: demo.generic_key_login.remote_address (login_attempts): no --when "
        "generic_key=login says when HAProxy sends it (or --fetch generic_key=SAMPLE)",
    ]
    assert "#   r0: demo.remote_address 20/second: rl_demo_fixed_second slot 0" in result.out


def test_flags_describe_the_requests_without_envoy(tmp_path: Path) -> None:
    """Without routes every descriptor may come with any request: the demo then needs four trackers,
    and the shadow rule is the one left out."""
    result = run_cli(
        tmp_path,
        (DEMO / "demo.yaml").read_text(),
        "--fetch",
        "api_key=req.fhdr(x-api-key,1)",
        "--when",
        "generic_key=api",
        "path_beg /api",
        "--when",
        "generic_key=login",
        "path_beg /login",
        "--when",
        "header_match=write",
        "method POST PUT PATCH DELETE",
    )
    assert result.code == 0
    assert result.err == [
        f"not exported: {tmp_path / 'rules.yaml'}:55: demo.generic_key_login.remote_address (login_attempts): on "
        "all requests: needs a stick counter beyond sc2; HAProxy 2.6 tracks sc0..sc2 per request (rules sharing "
        "key values and window share one); Envoy routes (--envoy) keep descriptors of different routes apart"
    ]
    assert "acl rl_when_api path_beg /api" in result.out
    assert "set-var(txn.rl_route)" not in result.out, "one catch-all route: nothing to pick"
    for rule in ("r0", "r1", "r2", "r3", "r5"):
        assert f"  # {rule}\n" in result.out


def test_fetch_overrides_where_a_key_comes_from() -> None:
    config = load_config(DEMO)
    sources = sources_from_envoy(ENVOY, {"remote_address": "req.hdr_ip(x-forwarded-for,-1)"})
    text = export(config.domains["demo"], sources, ExportOptions()).text
    assert "http-request set-var(txn.rl_v0) req.hdr_ip(x-forwarded-for,-1)" in text
    assert " src" not in text.replace("# ", "")


def test_several_values_in_a_key_are_length_prefixed(h: SimpleNamespace) -> None:
    domain = h.parse_domain(
        """
        domain: t
        descriptors:
          - key: user
            descriptors:
              - key: path
                rate_limit: {unit: minute, requests_per_unit: 5}
        """
    )
    sources = sources_from_flags(domain, {"user": "req.fhdr(x-user,1)", "path": "path"}, {})
    text = export(domain, sources, ExportOptions()).text
    assert "http-request set-var(txn.rl_l0) var(txn.rl_v0),length" in text
    assert (
        "http-request set-var(txn.rl_k0) var(txn.rl_w60),concat(:,txn.rl_l0,:),concat(,txn.rl_v0,),concat(:,txn.rl_v1,)"
        in text
    )


def test_constants_in_a_key_keep_the_sidecars_counter_identity(h: SimpleNamespace) -> None:
    """A constant landing on a key-only rule counts per value, like the sidecar."""
    domain = h.parse_domain(
        """
        domain: t
        descriptors:
          - key: generic_key
            rate_limit: {unit: second, requests_per_unit: 5}
        """
    )
    producer = Producer("test", (("generic_key", Const("api")),))
    sources = Sources("t", "test", (Route("all", None, (producer,)),))
    text = export(domain, sources, ExportOptions()).text
    assert "http-request set-var(txn.rl_k0) var(txn.rl_w1),concat(:api)" in text


def test_values_with_line_breaks_never_reach_the_config(h: SimpleNamespace) -> None:
    domain = h.parse_domain(
        """
        domain: t
        descriptors:
          - key: k
            value: "a\\nb"
            rate_limit: {unit: second, requests_per_unit: 1}
          - key: k
            rate_limit: {unit: second, requests_per_unit: 2}
        """
    )
    result = export(domain, sources_from_flags(domain, {"k": "req.fhdr(x-k,1)"}, {}), ExportOptions())
    assert [str(problem) for problem in result.problems] == [
        "not exported: rules/test.yaml:5: t.k_a\nb: its path holds a value with a line break: no config line "
        "(and no HTTP request) carries it"
    ]
    assert "a\nb" not in result.text and "t.k_a\\x0ab" in result.text


def test_wildcards_in_the_middle_become_anchored_regexes(h: SimpleNamespace) -> None:
    domain = h.parse_domain(
        """
        domain: t
        descriptors:
          - key: k
            value: "a*b.c"
            rate_limit: {unit: second, requests_per_unit: 1}
        """
    )
    text = export(domain, sources_from_flags(domain, {"k": "req.fhdr(x-k,1)"}, {}), ExportOptions()).text
    assert r"acl rl_k_like_a_b_c req.fhdr(x-k,1) -m reg '(?s)^a.*b\.c$'" in text


def test_peers_and_table_size_reach_every_table(tmp_path: Path) -> None:
    result = run_cli(tmp_path, (DEMO / "demo.yaml").read_text(), "--peers", "rl_peers", "--table-size", "200k")
    tables = [line for line in result.out.splitlines() if "stick-table" in line]
    assert tables and all("size 200k" in line and " peers rl_peers " in line for line in tables)


# ---------------------------------------------------------------- command line errors


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--flavour", "rolling"], "unknown flavour 'rolling' (choose from fixed, sliding)"),
        (["--table-size", "lots"], "--table-size 'lots': expected a number with an optional k, m or g"),
        (["--fetch", "api_key"], "--fetch 'api_key': expected KEY=VALUE"),
        (["--domain", "other"], "domain 'other' is not in the config (domains: demo)"),
        (["--envoy", "/nonexistent/envoy.yaml"], "/nonexistent/envoy.yaml: cannot read: No such file or directory"),
        (
            ["--envoy", str(ENVOY), "--when", "generic_key=api", "path_beg /api"],
            "--when describes requests without Envoy; it cannot be combined with --envoy",
        ),
    ],
)
def test_bad_arguments_give_one_line_and_status_1(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["export-haproxy", str(DEMO), *args]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"ratelimit-sidecar: error: {message}\n"


def test_missing_config_gives_one_line_and_status_1(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export-haproxy", "/nonexistent/rules"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == "ratelimit-sidecar: error: /nonexistent/rules: no such file or directory\n"


def test_envoy_config_without_the_filter_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    envoy = tmp_path / "envoy.yaml"
    envoy.write_text("static_resources: {listeners: []}\n")
    assert main(["export-haproxy", str(DEMO), "--envoy", str(envoy)]) == 1
    assert capsys.readouterr().err == (
        f"ratelimit-sidecar: error: {envoy}: expected one HTTP listener with envoy.filters.http.ratelimit, found 0\n"
    )


def test_output_goes_to_stdout_and_problems_to_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export-haproxy", str(DEMO), "--envoy", str(ENVOY), "--flavour", "sliding"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("    # ---- generated by: ratelimit-sidecar export-haproxy ")
    assert "backend rl_demo_sliding_second" in captured.out
    assert all(line.startswith(("note: ", "not exported: ")) for line in captured.err.splitlines())


# ---------------------------------------------------------------- Envoy translations


@pytest.mark.parametrize(
    ("match", "body", "text"),
    [
        ({"prefix": "/api"}, "path_beg /api", "prefix /api"),
        ({"prefix": "/API", "case_sensitive": False}, "path_beg -i /API", "prefix /API"),
        ({"path": "/login"}, "path -m str /login", "path /login"),
        ({"safe_regex": {"regex": "/v[0-9]+/.*"}}, "path -m reg '^(?:/v[0-9]+/.*)$'", "safe_regex /v[0-9]+/.*"),
        ({"path_separated_prefix": "/a.b"}, r"path -m reg '^/a\.b(?:/.*)?$'", "path_separated_prefix /a.b"),
    ],
)
def test_route_matches(match: dict[str, object], body: str, text: str) -> None:
    test, described = route_test(match)
    assert test is not None and (test.body, described) == (body, text)


@pytest.mark.parametrize(
    ("matcher", "tests"),
    [
        ({"name": ":method", "exact_match": "GET"}, ["method -m str GET"]),
        ({"name": ":method", "string_match": {"safe_regex": {"regex": "POST|PUT"}}}, ["method -m str POST PUT"]),
        ({"name": ":method", "string_match": {"safe_regex": {"regex": "P.*"}}}, ["method -m reg '^(?:P.*)$'"]),
        (
            {"name": "X-Env", "string_match": {"prefix": "prod", "ignore_case": True}},
            ["req.fhdr(x-env,1) -m beg -i prod"],
        ),
        ({"name": "x-env", "suffix_match": "-eu"}, ["req.fhdr(x-env,1) -m end -- '-eu'"]),
        ({"name": "x-env", "present_match": True}, ["req.fhdr(x-env,1) -m found"]),
        ({"name": "x-env", "present_match": True, "invert_match": True}, ["!req.fhdr(x-env,1) -m found"]),
        (
            {"name": "x-env", "string_match": {"contains": "test"}, "invert_match": True},
            ["req.fhdr(x-env,1) -m found", "!req.fhdr(x-env,1) -m sub test"],
        ),
        ({"name": ":path", "string_match": {"prefix": "/admin"}}, ["pathq -m beg /admin"]),
    ],
)
def test_header_matchers(matcher: dict[str, object], tests: list[str]) -> None:
    result = header_tests(matcher, "hint")
    assert not isinstance(result, str)
    assert [("!" if test.negated else "") + test.body for test in result] == tests


@pytest.mark.parametrize(
    "matcher",
    [
        {"name": ":scheme", "exact_match": "https"},
        {"name": "x", "range_match": {"start": 1, "end": 2}},
        {"name": "x", "string_match": {"exact": "a\nb"}},
    ],
)
def test_header_matchers_that_are_not_translated(matcher: dict[str, object]) -> None:
    assert isinstance(header_tests(matcher, "hint"), str)


def test_expect_match_false_negates_a_single_test() -> None:
    body = {"descriptor_value": "reads", "expect_match": False, "headers": [{"name": ":method", "exact_match": "GET"}]}
    result = header_value_match(body)
    assert not isinstance(result, str)
    key, source, tests = result
    assert (key, source) == ("header_match", Const("reads"))
    assert [(test.body, test.negated) for test in tests] == [("method -m str GET", True)]


def test_a_malformed_envoy_config_is_one_clean_error(tmp_path: Path) -> None:
    envoy = tmp_path / "envoy.yaml"
    envoy.write_text("static_resources: {listeners: [{filter_chains: [{filters: [7]}]}]}\n")
    with pytest.raises(ExportError, match="not the shape of an Envoy v3 config"):
        sources_from_envoy(envoy, {})


def test_more_rules_per_window_than_gpc_slots_are_reported(h: SimpleNamespace) -> None:
    rules = "\n".join(
        f"  - key: k{index}\n    rate_limit: {{unit: second, requests_per_unit: 1}}" for index in range(MAX_SLOTS + 1)
    )
    domain = h.parse_domain(f"domain: t\ndescriptors:\n{rules}\n")
    producers = tuple(Producer("test", ((f"k{index}", Const("v")),)) for index in range(MAX_SLOTS + 1))
    sources = Sources(
        "t", "test", tuple(Route(f"r{index}", None, (producer,)) for index, producer in enumerate(producers))
    )
    result = export(domain, sources, ExportOptions())
    assert [str(problem) for problem in result.problems] == [
        f"not exported: rules/test.yaml:{2 * MAX_SLOTS + 4}: t.k{MAX_SLOTS}: more than {MAX_SLOTS} rules with this "
        f"window: a HAProxy gpc array holds {MAX_SLOTS} counters"
    ]
    assert f"store gpc({MAX_SLOTS})" in result.text


def test_a_rule_reached_by_two_descriptors_of_a_route_is_noted(tmp_path: Path) -> None:
    config = """\
    domain: t
    descriptors:
      - key: remote_address
        rate_limit: {unit: second, requests_per_unit: 5}
    """
    routes = """\
    - match: {prefix: "/"}
      route:
        rate_limits:
          - actions: [{remote_address: {}}]
          - actions: [{remote_address: {}}]
    """
    result = run_cli(tmp_path, config, envoy=envoy_config(routes))
    assert result.err == [
        f"note: {tmp_path / 'rules.yaml'}:4: t.remote_address: on route 0 (prefix /): 2 descriptors may land on it; "
        "HAProxy checks for room for one hit, the sidecar for 2 (the limit can be passed by 1)"
    ]


# ---------------------------------------------------------------- config extensions

EXTENSIONS = REPO / "examples" / "extensions"
EXTENSIONS_FILE = EXTENSIONS / "extensions.yaml"


def extensions_export(tmp_path: Path, flavour: Flavour, *args: str, envoy: bool = True) -> SimpleNamespace:
    """The extensions example exported (its token-bucket rule is left out: ``--allow-dropped``)."""
    argv = ["export-haproxy", str(EXTENSIONS), "--flavour", flavour, "--allow-dropped", *args]
    if envoy:
        envoy_file = tmp_path / "envoy.yaml"
        envoy_file.write_text(envoy_config(EXTENSIONS_ROUTES, domain="extensions"))
        argv += ["--envoy", str(envoy_file)]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return SimpleNamespace(code=code, out=out.getvalue(), err=err.getvalue().splitlines())


def summaries(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip().startswith("#   r")]


TOKEN_BUCKET_REASON = (
    f"not exported: {EXTENSIONS_FILE}:14: extensions.generic_key_uploads: algorithm token_bucket (burst 50, "
    "refilled at 10/second): HAProxy 2.6 has no token bucket (its stick tables count hits per period; nothing "
    "refills over time), and no window admits the same requests"
)
WARN_NOTE = (
    f"note: {EXTENSIONS_FILE}:20: extensions.api_key (api_key_per_hour) rate_limits[1]: warn_at 0.9: the limit is "
    "exported, the soft limit is not (HAProxy sends no warning header)"
)
BAN_NOTE = (
    f"note: {EXTENSIONS_FILE}:24: extensions.login_user: ban_duration 600 s: set by the request that goes over, "
    "never extended, kept as its end in whole Unix seconds rounded up (it can last up to 1 s longer than in the "
    "sidecar)"
)


@pytest.mark.parametrize("flavour", ["fixed", "sliding"])
def test_the_extensions_example_exports_all_but_the_token_bucket(tmp_path: Path, flavour: Flavour) -> None:
    """Through Envoy routes every rule fits: exactly the token bucket is listed, plus two notes."""
    result = extensions_export(tmp_path, flavour)
    assert result.code == 0
    assert result.err == [TOKEN_BUCKET_REASON, WARN_NOTE, BAN_NOTE]
    table = f"rl_extensions_{flavour}"
    assert summaries(result.out) == [
        f"#   r0: extensions.remote_address 20/second sliding_window: {table}_second slot 0",
        "#   r1: extensions.generic_key_uploads 10/second token_bucket burst 50: not exported (see stderr)",
        f"#   r2: extensions.api_key (api_key_per_second) rate_limits[0] 10/second: {table}_second slot 1",
        f"#   r3: extensions.api_key (api_key_per_hour) rate_limits[1] 1000/hour: {table}_hour slot 0",
        f"#   r4: extensions.login_user 5/5 minutes ban 600s: {table}_300s slot 0, ban in {table}_bans gpt slot 0",
    ]
    lines = rule_lines(result.out)
    # The two limits of api_key: own tables and trackers, both checked before either counts.
    kinds = [line.split()[1].split("(")[0] for line in lines]
    checks = [i for i, line in enumerate(lines) if " deny " in line]
    assert max(checks) < kinds.index("sc-inc-gpc") and set(kinds[kinds.index("sc-inc-gpc") :]) == {"sc-inc-gpc"}
    assert f"http-request track-sc1 var(txn.rl_k2) table {table}_second if rl_route2 rl_has_api_key" in lines
    assert f"http-request track-sc2 var(txn.rl_k3) table {table}_hour if rl_route2 rl_has_api_key" in lines
    # The login route uses all three trackers: address, user, and the user's ban entry.
    assert f"http-request track-sc1 var(txn.rl_k1) table {table}_300s if rl_route0 rl_has_login_user" in lines
    assert any(line.startswith(f"http-request track-sc2 var(txn.rl_b0) table {table}_bans if") for line in lines)
    assert "uploads" not in "\n".join(lines), "the token bucket has no counter"
    tables = [line.strip() for line in result.out.splitlines() if "stick-table" in line]
    if flavour == "fixed":
        assert tables == [
            "stick-table type string len 64 size 1m expire 3s store gpc(2)",  # keeps the previous second
            "stick-table type string len 64 size 1m expire 301s store gpc(1)",
            "stick-table type string len 64 size 1m expire 3601s store gpc(1)",
            "stick-table type string len 64 size 1m expire 601s store gpt(1)",
        ]
    else:
        assert tables == [
            "stick-table type string len 64 size 1m expire 3s store gpc_rate(2,1s)",
            "stick-table type string len 64 size 1m expire 601s store gpc_rate(1,300s)",
            "stick-table type string len 64 size 1m expire 7201s store gpc_rate(1,3600s)",
            "stick-table type string len 64 size 1m expire 601s store gpt(1)",
        ]


def test_fixed_windows_of_several_units_are_keyed_by_date_over_their_length(tmp_path: Path) -> None:
    lines = rule_lines(extensions_export(tmp_path, "fixed").out)
    assert "http-request set-var(txn.rl_w300) date,div(300)" in lines
    assert "http-request set-var(txn.rl_k1) var(txn.rl_w300),concat(:,txn.rl_v1,) if rl_route0" in lines
    deny = next(line for line in lines if '"5, 5;w=300"' in line and "sc_get_gpc" in line)
    assert 'hdr Retry-After "%[date,mod(300),neg,add(300)]"' in deny
    sliding = rule_lines(extensions_export(tmp_path, "sliding").out)
    assert any('"5, 5;w=300"' in line and "hdr Retry-After 300 " in line for line in sliding)


def test_sliding_window_rules_compute_the_sidecars_estimate_in_the_fixed_flavour(tmp_path: Path) -> None:
    """Current clock window + the previous one's count x the share still covered, rounded down."""
    result = extensions_export(tmp_path, "fixed")
    lines = rule_lines(result.out)
    assert "http-request set-var(txn.rl_w1p) date,sub(1)" in lines
    assert "http-request set-var(txn.rl_e1) date(0,ms),mod(1000),neg,add(1000)" in lines
    assert "http-request set-var(txn.rl_k0p) var(txn.rl_w1p),concat(:,txn.rl_v0,) if rl_routed" in lines
    assert (
        "http-request set-var(txn.rl_p0_0) var(txn.rl_k0p),table_gpc(0,rl_extensions_fixed_second),"
        "mul(txn.rl_e1),div(1000) if rl_routed"
    ) in lines
    deny = next(line for line in lines if '"20, 20;w=1"' in line)
    assert deny.endswith("if rl_routed { sc_get_gpc(0,0),add(txn.rl_p0_0) ge 20 }")
    assert "# sliding_window rules, even in this flavour, as the sidecar computes them" in result.out
    assert "gpc_rate" not in "\n".join(lines)
    sliding = extensions_export(tmp_path, "sliding")
    assert any(line.endswith("if rl_routed { sc_gpc_rate(0,0) ge 20 }") for line in rule_lines(sliding.out))
    assert "txn.rl_p" not in sliding.out and "# sliding_window rules: gpc_rate is the sidecar's estimate" in sliding.out


@pytest.mark.parametrize("flavour", ["fixed", "sliding"])
def test_a_ban_is_started_once_and_refuses_until_it_ends(tmp_path: Path, flavour: Flavour) -> None:
    lines = rule_lines(extensions_export(tmp_path, flavour).out)
    over = "{ sc_get_gpc(0,1) ge 5 }" if flavour == "fixed" else "{ sc_gpc_rate(0,1) ge 5 }"
    left = f"var(txn.rl_b0),table_gpt(0,rl_extensions_{flavour}_bans),sub(txn.rl_now)"
    starts = f"if rl_route0 rl_has_login_user {over} !{{ {left} gt 0 }}"
    assert "http-request set-var(txn.rl_now) date" in lines
    assert "http-request set-var(txn.rl_b0) str(),concat(:,txn.rl_v1,) if rl_route0" in lines
    assert f"http-request track-sc2 var(txn.rl_b0) table rl_extensions_{flavour}_bans {starts}" in lines
    assert f"http-request sc-set-gpt(0,2) date(0,ms),add(600999),div(1000) {starts}" in lines
    banned = [line for line in lines if f"{{ {left} gt 0 }}" in line and " deny " in line]
    assert banned == [
        'http-request deny status 429 content-type text/plain string "Too Many Requests\\n" '
        f'hdr Retry-After "%[{left}]" hdr x-ratelimit-limit "5, 5;w=300" if rl_route0 rl_has_login_user '
        f"{{ {left} gt 0 }}"
    ]
    order = [line for line in lines if "track-sc2 var(txn.rl_b0)" in line or "sc-set-gpt" in line or line in banned]
    assert [lines.index(line) for line in order] == sorted(lines.index(line) for line in order)


def test_without_routes_the_extensions_run_out_of_trackers(tmp_path: Path) -> None:
    """All descriptors may come with one request: address, API key per second and per hour take
    sc0..sc2, so the login limit is listed."""
    result = extensions_export(tmp_path, "fixed", *EXTENSION_FLAGS, envoy=False)
    assert result.code == 0
    assert result.err == [
        TOKEN_BUCKET_REASON,
        WARN_NOTE,
        f"not exported: {EXTENSIONS_FILE}:24: extensions.login_user: on all requests: needs a stick counter beyond "
        "sc2; HAProxy 2.6 tracks sc0..sc2 per request (rules sharing key values and window share one); Envoy "
        "routes (--envoy) keep descriptors of different routes apart",
    ]
    assert "rl_w300" not in result.out and "_bans" not in result.out, "nothing is left of the unplaced rule"


SEVERAL = """\
domain: t
descriptors:
  - key: user
    rate_limits:
      - {unit: second, requests_per_unit: 1}
      - {unit: minute, requests_per_unit: 2, ban_duration: 30}
      - {unit: hour, requests_per_unit: 3}
      - {unit: day, requests_per_unit: 4}
  - key: long_ban
    rate_limit: {unit: second, requests_per_unit: 1, ban_duration: 30d}
  - key: tail
    rate_limit: {unit: second, requests_per_unit: 1, unit_multiplier: 1100000, algorithm: sliding_window}
"""


SEVERAL_ROUTES = """\
- match: {prefix: "/u"}
  route: {rate_limits: [{actions: [{request_headers: {header_name: x-u, descriptor_key: user}}]}]}
- match: {prefix: "/l"}
  route: {rate_limits: [{actions: [{request_headers: {header_name: x-l, descriptor_key: long_ban}}]}]}
- match: {prefix: "/t"}
  route: {rate_limits: [{actions: [{request_headers: {header_name: x-t, descriptor_key: tail}}]}]}
"""


def test_limits_beyond_the_trackers_and_bans_beyond_the_timers_are_reported(tmp_path: Path) -> None:
    """Four limits on one descriptor: three trackers go to the first three (counters before bans),
    the fourth is listed and so is the ban that found no tracker; a ban longer than HAProxy's
    timers leaves its limit; a window too long to keep the previous one is listed."""
    result = run_cli(tmp_path, SEVERAL, envoy=envoy_config(SEVERAL_ROUTES))
    rules = tmp_path / "rules.yaml"
    trackers = "needs a stick counter beyond sc2; HAProxy 2.6 tracks sc0..sc2 per request (rules sharing key values "
    assert result.err == [
        f"note: {rules}:6: t.user rate_limits[1]: ban_duration not exported (the limit is): starting a ban needs a "
        "stick counter beyond sc2 for its entry (keyed by the values, without the window) on every route that "
        "reaches it",
        f"not exported: {rules}:8: t.user rate_limits[3]: on route 0 (prefix /u): {trackers}and window share one)",
        f"note: {rules}:10: t.long_ban: ban_duration 2592000 s not exported (the limit is): a ban is kept in a "
        "table whose expire would be 2592001 s; HAProxy 2.6 allows at most 2147483 s (~24.8 days)",
        f"not exported: {rules}:12: t.tail: unit second x 1100000 (1100000 s): a sliding_window rule keeps the "
        "previous window: it needs a table expire of 2200001 s; HAProxy 2.6 allows at most 2147483 s (~24.8 days)",
    ]
    assert "sc-set-gpt" not in result.out and "store gpt" not in result.out and "txn.rl_b" not in result.out
    assert "expire 61s store gpc(1)" in result.out, "the minute limit is kept without its ban"
    assert "t.user rate_limits[2] 3/hour: rl_t_fixed_hour slot 0" in result.out


def test_a_shadow_rule_with_a_ban_logs_while_banned(h: SimpleNamespace) -> None:
    domain = h.parse_domain(
        """
        domain: t
        descriptors:
          - key: k
            shadow_mode: true
            rate_limit: {unit: second, requests_per_unit: 2, ban_duration: 1m}
        """
    )
    result = export(domain, sources_from_flags(domain, {"k": "req.fhdr(x-k,1)"}, {}), ExportOptions())
    lines = rule_lines(result.text)
    shadow = next(line for line in lines if "set-var(txn.rl_shadow)" in line)
    left = "var(txn.rl_b0),table_gpt(0,rl_t_fixed_bans),sub(txn.rl_now)"
    assert shadow == (
        "http-request set-var(txn.rl_shadow) str(),concat(,txn.rl_shadow,/r0) if rl_has_k { sc_get_gpc(0,0) ge 2 } "
        f"|| rl_has_k {{ {left} gt 0 }}"
    )
    assert not any(" deny " in line for line in lines)
    assert "expire 61s store gpt(1)" in result.text


def test_a_route_without_a_tracker_for_the_ban_still_enforces_running_bans(tmp_path: Path) -> None:
    """Route 0 spends its three trackers on counters, route 1 has one left to start bans; a client banned
    through route 1 is refused on route 0 too (reading the ban needs no tracker)."""
    config = """\
    domain: t
    descriptors:
      - key: a
        rate_limit: {unit: second, requests_per_unit: 1}
      - key: b
        rate_limit: {unit: second, requests_per_unit: 1}
      - key: k
        rate_limit: {unit: minute, requests_per_unit: 3, ban_duration: 1h}
    """
    routes = """\
    - match: {prefix: "/busy"}
      route:
        rate_limits:
          - actions: [{request_headers: {header_name: x-a, descriptor_key: a}}]
          - actions: [{request_headers: {header_name: x-b, descriptor_key: b}}]
          - actions: [{request_headers: {header_name: x-k, descriptor_key: k}}]
    - match: {prefix: "/"}
      route: {rate_limits: [{actions: [{request_headers: {header_name: x-k, descriptor_key: k}}]}]}
    """
    result = run_cli(tmp_path, config, envoy=envoy_config(routes))
    where = f"{tmp_path / 'rules.yaml'}:8: t.k"
    assert result.err == [
        f"note: {where}: on route 0 (prefix /busy): a running ban is enforced, but no ban starts here: that needs "
        "a stick counter beyond sc2 for the ban entry (keyed by the values, without the window)",
        f"note: {where}: ban_duration 3600 s: set by the request that goes over, never extended, kept as its end "
        "in whole Unix seconds rounded up (it can last up to 1 s longer than in the sidecar)",
    ]
    lines = rule_lines(result.out)
    assert "http-request set-var(txn.rl_b0) str(),concat(:,txn.rl_v2,) if rl_routed" in lines
    starts = [line for line in lines if "table rl_t_fixed_bans" in line or "sc-set-gpt" in line]
    assert [line.split(" if ")[0] for line in starts] == [
        "http-request track-sc1 var(txn.rl_b0) table rl_t_fixed_bans",
        "http-request sc-set-gpt(0,1) date(0,ms),add(3600999),div(1000)",
    ]
    assert all(" if rl_route1 " in line for line in starts)
    banned = [
        line for line in lines if " deny " in line and "table_gpt(0,rl_t_fixed_bans),sub(txn.rl_now) gt 0" in line
    ]
    assert [line.split(" if ")[1].split(" {")[0] for line in banned] == ["rl_route0 rl_has_k", "rl_route1 rl_has_k"]


def test_costs_counted_past_the_limit_are_not_exported() -> None:
    from sidecar.config.load import parse_text
    from sidecar.export.haproxy.fit import rule_problem

    text = (
        "domain: t\ndescriptors:\n"
        "  - {key: user, rate_limit: {unit: hour, requests_per_unit: 9, count_past_limit: true}}\n"
    )
    domain, _ = parse_text(text, "t.yaml")
    assert domain is not None
    problem = rule_problem(domain.rules[0], "fixed")
    assert problem is not None and problem.startswith("count_past_limit")


def test_suppressed_overload_is_not_exported() -> None:
    """HAProxy refuses once a count is past the limit: a rule with ``overload: suppress`` is
    listed as not exported, with why, rather than exported as a plain window."""
    from sidecar.config.load import parse_text
    from sidecar.export.haproxy.fit import rule_problem

    text = (
        "domain: t\ndescriptors:\n"
        "  - {key: user, rate_limit: {unit: second, requests_per_unit: 9, overload: suppress}}\n"
        "  - {key: ip, rate_limit: {unit: second, requests_per_unit: 9}}\n"
    )
    domain, _ = parse_text(text, "t.yaml")
    assert domain is not None
    problem = rule_problem(domain.rules[0], "fixed")
    assert problem is not None and problem.startswith("overload: suppress")
    assert rule_problem(domain.rules[1], "fixed") is None


def test_a_limit_left_out_fails_the_export_unless_allowed(tmp_path: Path) -> None:
    """The extensions example holds a token-bucket rule HAProxy cannot enforce: without
    ``--allow-dropped`` nothing is written and stderr says which rule and why."""
    envoy = envoy_config(EXTENSIONS_ROUTES, domain="extensions")
    strict = run_cli(tmp_path, (EXTENSIONS / "extensions.yaml").read_text(), envoy=envoy, allow_dropped=False)
    assert (strict.code, strict.out) == (1, "")
    assert any(line.startswith("not exported: ") and "token_bucket" in line for line in strict.err), strict.err
    assert strict.err[-1].startswith("export-haproxy: error: 1 limit(s) or descriptor(s) above would be left out")
    allowed = run_cli(tmp_path, (EXTENSIONS / "extensions.yaml").read_text(), envoy=envoy)
    assert allowed.code == 0
    assert "--allow-dropped" in allowed.out.splitlines()[0]
    assert strict.err[:-1] == allowed.err


def test_several_virtual_hosts_pick_the_host_as_envoy_does_then_the_route(tmp_path: Path) -> None:
    """Exact domains first, then wildcards longest first, then '*'; each route tests its host."""
    envoy = textwrap.dedent(
        """\
        static_resources:
          listeners:
            - name: ingress
              filter_chains:
                - filters:
                    - name: envoy.filters.network.http_connection_manager
                      typed_config:
                        route_config:
                          ignore_port_in_host_matching: true
                          virtual_hosts:
                            - {name: rest, domains: ["*"], routes: [{match: {prefix: /}, route: {cluster: a}}]}
                            - name: tenants
                              domains: ["*.example.com", "api.*"]
                              routes: [{match: {prefix: /}, route: {rate_limits: [{actions: [{remote_address: {}}]}]}}]
                            - name: api
                              domains: [API.example.com]
                              routes: [{match: {prefix: /}, route: {cluster: a}}]
                        http_filters:
                          - name: envoy.filters.http.ratelimit
                            typed_config: {domain: t}
        """
    )
    rules = "domain: t\ndescriptors:\n  - {key: remote_address, rate_limit: {unit: second, requests_per_unit: 5}}\n"
    result = run_cli(tmp_path, rules, envoy=envoy, allow_dropped=False)
    assert result.code == 0, result.err
    lines = [line.strip() for line in result.out.splitlines()]
    port = "(?::[0-9]*)?$'"
    assert "acl rl_host_api_example_com req.hdr(host),lower -m reg '^api\\.example\\.com" + port in lines
    assert "acl rl_host_example_com req.hdr(host),lower -m reg '^[^:]+\\.example\\.com" + port in lines
    assert "acl rl_host_any req.hdr(host) -m found" in lines
    picks = [line for line in lines if line.startswith("http-request set-var(txn.rl_host)")]
    assert picks == [
        "http-request set-var(txn.rl_host) int(2) if rl_host_api_example_com",
        "http-request set-var(txn.rl_host) int(1) if !rl_host_chosen rl_host_example_com",
        "http-request set-var(txn.rl_host) int(1) if !rl_host_chosen rl_host_api",
        "http-request set-var(txn.rl_host) int(0) if !rl_host_chosen rl_host_any",
    ]
    routes = [line.split("  #")[0] for line in lines if line.startswith("http-request set-var(txn.rl_route)")]
    assert routes[1] == "http-request set-var(txn.rl_route) int(1) if !rl_routed rl_host1 rl_prefix"


def test_virtual_host_rate_limits_reach_the_routes_without_their_own(tmp_path: Path) -> None:
    """Envoy's default: a host's rate_limits apply to its routes with none of their own."""
    envoy = textwrap.dedent(
        """\
        static_resources:
          listeners:
            - name: ingress
              filter_chains:
                - filters:
                    - name: envoy.filters.network.http_connection_manager
                      typed_config:
                        route_config:
                          virtual_hosts:
                            - name: app
                              domains: ["*"]
                              rate_limits: [{actions: [{remote_address: {}}]}]
                              routes:
                                - match: {prefix: /static}
                                  route: {rate_limits: [{actions: [{generic_key: {descriptor_value: s}}]}]}
                                - {match: {prefix: /}, route: {cluster: a}}
                        http_filters:
                          - name: envoy.filters.http.ratelimit
                            typed_config: {domain: t}
        """
    )
    rules = """\
    domain: t
    descriptors:
      - {key: remote_address, rate_limit: {unit: second, requests_per_unit: 5}}
      - {key: generic_key, value: s, rate_limit: {unit: second, requests_per_unit: 9}}
    """
    result = run_cli(tmp_path, rules, envoy=envoy, allow_dropped=False)
    assert result.code == 0, result.err
    lines = [line.strip() for line in result.out.splitlines()]
    assert "http-request set-var(txn.rl_v0) src" in lines
    keys = {line.rsplit(" if ", 1)[1]: line for line in lines if line.startswith("http-request set-var(txn.rl_k")}
    assert "txn.rl_v0" in keys["rl_route1"]  # the catch-all route: the host's per-address limit
    assert "txn.rl_v0" not in keys["rl_route0"]  # /static has its own rate_limits: not the host's
