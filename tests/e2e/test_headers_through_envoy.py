"""Service-side response headers and soft limits, seen by an HTTP client through a real Envoy.

Two sidecars with the same config (a ``warn_at`` rule, written to tmp), each behind its
own Envoy running ``envoy/front.yaml``: one with ``--response-headers``, one without
(and with a renamed warning header). What we check is what Envoy's rate-limit filter
does with ``response_headers_to_add``: it must pass them to the client on 200 and on
its own 429, next to the ``x-ratelimit-*`` headers of ``enable_x_ratelimit_headers``.
A third pair (``--response-header-style both``) sends the IETF ``RateLimit-Policy`` and
``RateLimit`` fields, which the client reads back with an RFC 9651 parser (``http_sf``).
"""

from __future__ import annotations

import functools
import itertools
import math
import textwrap
import time
from collections.abc import Iterator

import http_sf
import pytest

from stack.envoy import ENVOY_CONFIGS, EnvoyPorts, EnvoyProcess
from stack.processes import process_group
from stack.sidecar import SidecarProcess
from stack.upstream import UpstreamProcess
from tests.support.envoys import COUNTING_TIMEOUT, Reply, Session, fresh_window

pytestmark = [pytest.mark.envoy, pytest.mark.slow]
ADDRESSES = (f"198.51.100.{number}" for number in itertools.count(101))
"""A new client address per test (X-Forwarded-For: front.yaml trusts one hop)."""

CONFIG = textwrap.dedent(
    """\
    domain: demo
    descriptors:
      - key: remote_address
        rate_limit: {name: per_address, unit: hour, requests_per_unit: 10, warn_at: 0.8}
      - key: generic_key
        value: api
        descriptors:
          - key: api_key
            rate_limit: {name: per_api_key, unit: minute, requests_per_unit: 3}
    """
)


@pytest.fixture(scope="module")
def pods(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """Envoy URLs: (sidecar with --response-headers, sidecar without it but with --warn-header X-Quota-Warning)."""
    directory = tmp_path_factory.mktemp("headers")
    config = directory / "rules.yaml"
    config.write_text(CONFIG)
    flags = {
        "on": ["--response-headers"],
        "off": ["--warn-header", "X-Quota-Warning"],
    }
    with process_group() as group:
        app = group.start(UpstreamProcess("app", directory))
        sidecars = group.start_all_ready(
            [
                functools.partial(SidecarProcess, f"sidecar-{name}", ["--config", str(config), *extra], directory)
                for name, extra in flags.items()
            ]
        )
        app.wait_ready()
        envoys = []
        for sidecar, name in zip(sidecars, flags, strict=True):
            ports = EnvoyPorts.free(app=app.port, ratelimit=sidecar.port)
            envoy = group.start(
                EnvoyProcess(
                    f"envoy-{name}", ENVOY_CONFIGS / "front.yaml", ports, directory, timeout_seconds=COUNTING_TIMEOUT
                )
            )
            envoy.wait_ready()
            envoys.append(envoy)
        yield envoys[0].url, envoys[1].url
        for child in [*sidecars, *envoys]:
            assert child.alive(), child.log_tail()


def client(headers: dict[str, str] | None = None) -> dict[str, str]:
    return {"x-forwarded-for": next(ADDRESSES), **(headers or {})}


def burst(url: str, count: int, path: str, headers: dict[str, str]) -> list[Reply]:
    session = Session(url)
    try:
        return [session.send(path, headers) for _ in range(count)]
    finally:
        session.close()


def seconds_to_hour_end() -> float:
    return 3600 - time.time() % 3600


def test_ratelimit_headers_on_200_and_429_retry_after_and_the_warning(pods: tuple[str, str]) -> None:
    on, _ = pods
    fresh_window(3600, needed=10)
    replies = burst(on, 11, "/", client())
    left = seconds_to_hour_end()
    assert [reply.status for reply in replies] == [200] * 10 + [429]
    for sent, reply in enumerate(replies[:10], start=1):
        assert reply.header("ratelimit-limit") == "10"
        assert reply.header("ratelimit-remaining") == str(10 - sent)
        assert abs(int(reply.header("ratelimit-reset") or -1) - math.ceil(left)) <= 2
        assert reply.header("retry-after") is None
        # Envoy's own draft-03 headers (enable_x_ratelimit_headers) come too: both sets.
        assert reply.header("x-ratelimit-limit") == '10, 10;w=3600;name="per_address"'
        assert reply.header("x-ratelimit-remaining") == str(10 - sent)
        warning = reply.header("x-ratelimit-warning")
        if sent < 8:
            assert warning is None, sent
        else:
            assert warning == f"per_address: {sent * 10}% of 10/hour used"
    refused = replies[10]
    assert refused.header("x-envoy-ratelimited") == "true"
    assert (refused.header("ratelimit-limit"), refused.header("ratelimit-remaining")) == ("10", "0")
    assert refused.header("retry-after") == refused.header("ratelimit-reset")
    assert abs(int(refused.header("retry-after") or -1) - math.ceil(left)) <= 2
    assert refused.header("x-ratelimit-warning") is None, "a refused request carries no warning"
    assert refused.header("x-ratelimit-remaining") == "0"


def test_the_descriptor_with_the_fewest_remaining_is_reported_then_the_refusing_one(pods: tuple[str, str]) -> None:
    on, _ = pods
    left = fresh_window(60, needed=5)
    replies = burst(on, 4, "/api/items", client({"x-api-key": f"key-{time.time_ns()}"}))
    assert [reply.status for reply in replies] == [200, 200, 200, 429]
    for sent, reply in enumerate(replies[:3], start=1):
        # per_api_key (3/minute) has fewer hits left than per_address (10/hour).
        assert (reply.header("ratelimit-limit"), reply.header("ratelimit-remaining")) == ("3", str(3 - sent))
    refused = replies[3]
    assert (refused.header("ratelimit-limit"), refused.header("ratelimit-remaining")) == ("3", "0")
    assert abs(int(refused.header("retry-after") or -1) - math.ceil(left)) <= 2


def test_without_the_flag_only_the_warning_is_added_under_its_configured_name(pods: tuple[str, str]) -> None:
    _, off = pods
    fresh_window(3600, needed=10)
    replies = burst(off, 11, "/", client())
    assert [reply.status for reply in replies] == [200] * 10 + [429]
    for reply in replies:
        assert reply.header("ratelimit-limit") is None
        assert reply.header("ratelimit-remaining") is None
        assert reply.header("retry-after") is None
        assert reply.header("x-ratelimit-warning") is None
        assert reply.header("x-ratelimit-limit") is not None, "Envoy's draft-03 headers do not depend on the flag"
    assert [reply.header("x-quota-warning") for reply in replies[6:]] == [
        None,
        "per_address: 80% of 10/hour used",
        "per_address: 90% of 10/hour used",
        "per_address: 100% of 10/hour used",
        None,
    ]


# -- --response-header-style both: the IETF fields (draft-ietf-httpapi-ratelimit-headers-11) --------

IETF_CONFIG = textwrap.dedent(
    """\
    domain: demo
    descriptors:
      - key: remote_address
        rate_limits:
          - {name: per_address_minute, unit: minute, requests_per_unit: 4, algorithm: sliding_window}
          - {unit: hour, requests_per_unit: 50}
      - key: generic_key
        value: api
        descriptors:
          - key: api_key
            rate_limit: {name: per_api_key, unit: minute, requests_per_unit: 1, algorithm: token_bucket, burst: 3}
    """
)
Parsed = dict[str, dict[str, object]]


@pytest.fixture(scope="module")
def ietf_pod(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The URL of an Envoy (front.yaml, in front of a real upstream) whose sidecar sends both
    header styles. Fail closed with a 2 s filter timeout: a late sidecar is a 500, never a
    reply that passes without headers."""
    directory = tmp_path_factory.mktemp("ietf")
    config = directory / "rules.yaml"
    config.write_text(IETF_CONFIG)
    flags = ["--config", str(config), "--response-headers", "--response-header-style", "both"]
    with process_group() as group:
        app = group.start(UpstreamProcess("app", directory))
        sidecar = group.start_ready(functools.partial(SidecarProcess, "sidecar-ietf", flags, directory))
        app.wait_ready()
        ports = EnvoyPorts.free(app=app.port, ratelimit=sidecar.port)
        envoy = group.start(
            EnvoyProcess(
                "envoy-ietf", ENVOY_CONFIGS / "front.yaml", ports, directory, failure_mode_deny=True, timeout_seconds=2
            )
        )
        envoy.wait_ready()
        yield envoy.url
        for child in (sidecar, envoy):
            assert child.alive(), child.log_tail()


def structured(reply: Reply) -> tuple[Parsed, tuple[str, dict[str, object]]]:
    """RateLimit-Policy and RateLimit as the client got them, read by an RFC 9651 parser
    (which raises on anything malformed); both must be Lists of Strings with parameters."""
    policy_text, limit_text = reply.header("ratelimit-policy"), reply.header("ratelimit")
    assert policy_text is not None and limit_text is not None, reply.headers
    policy = http_sf.parse(policy_text.encode("ascii"), tltype="list")
    (limit,) = http_sf.parse(limit_text.encode("ascii"), tltype="list")
    assert all(type(name) is str for name, _ in [*policy, limit])
    return dict(policy), limit


def test_ietf_fields_reach_the_client_and_parse_on_200_and_429(ietf_pod: str) -> None:
    left = fresh_window(60, needed=5)
    replies = burst(ietf_pod, 5, "/", client())
    assert [reply.status for reply in replies] == [200] * 4 + [429]
    for sent, reply in enumerate(replies, start=1):
        policy, (name, limit) = structured(reply)
        assert list(policy) == ["per_address_minute", "demo.remote_address#2"]
        assert {key: policy["per_address_minute"][key] for key in ("q", "w")} == {"q": 4, "w": 60}
        assert {key: policy["demo.remote_address#2"][key] for key in ("q", "w")} == {"q": 50, "w": 3600}
        assert name == "per_address_minute", "the sliding minute is closer to refusal than the hour"
        assert limit["r"] == max(0, 4 - sent)
        assert abs(int(str(limit["t"])) - math.ceil(left)) <= 2
        assert isinstance(limit["pk"], bytes) and limit["pk"] == policy[name]["pk"]
        # The draft-03 headers describe the same limit (--response-header-style both).
        assert reply.header("ratelimit-remaining") == str(limit["r"])
        assert reply.header("ratelimit-limit") == str(policy[name]["q"])
    refused = replies[4]
    assert refused.header("retry-after") == str(structured(refused)[1][1]["t"])


def test_ietf_token_bucket_and_several_descriptors_through_envoy(ietf_pod: str) -> None:
    replies = burst(ietf_pod, 4, "/api/items", client({"x-api-key": f"key-{time.time_ns()}"}))
    assert [reply.status for reply in replies] == [200, 200, 200, 429]
    for sent, reply in enumerate(replies[:3], start=1):
        policy, (name, limit) = structured(reply)
        assert list(policy) == ["per_address_minute", "demo.remote_address#2", "per_api_key"]
        # burst 3 at 1 token a minute: 180 s from empty to full
        assert (policy["per_api_key"]["q"], policy["per_api_key"]["w"]) == (3, 180)
        assert (name, limit["r"], limit["t"]) == ("per_api_key", 3 - sent, 60 * sent)
    policy, (name, limit) = structured(replies[3])
    assert (name, limit["r"]) == ("per_api_key", 0)
    assert replies[3].header("retry-after") == str(limit["t"])
