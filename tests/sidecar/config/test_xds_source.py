"""The xDS config source's pure parts: resources to config, NACK details, backoff; and one
ADS exchange against an in-test server (ACK, NACK keeping the last good config)."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from google.protobuf import any_pb2

from sidecar.config.errors import ConfigError
from sidecar.config.load import SYNC_MODE
from sidecar.config.reload import ConfigReloader
from sidecar.config.xds_source import (
    TYPE_URL,
    XdsConfigSource,
    XdsOptions,
    backoff,
    convert,
    empty_config,
    nack_detail,
)
from sidecar.protos.envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from sidecar.protos.ratelimit.config.ratelimit.v3 import rls_conf_pb2 as rls_conf

Config = rls_conf.RateLimitConfig
Descriptor = rls_conf.RateLimitDescriptor
Policy = rls_conf.RateLimitPolicy


def packed(*configs: Any) -> list[Any]:
    resources = []
    for config in configs:
        resource = any_pb2.Any()
        resource.Pack(config)
        resources.append(resource)
    return resources


def tenant(name: str = "tenants", domain: str = "api", per_second: int = 5, **policy: Any) -> Any:
    limit = Policy(unit=rls_conf.SECOND, requests_per_unit=per_second, **policy)
    nested = Descriptor(key="path", value="/login", rate_limit=Policy(unit=rls_conf.MINUTE, requests_per_unit=3))
    return Config(
        name=name,
        domain=domain,
        descriptors=[Descriptor(key="tenant", rate_limit=limit, descriptors=[nested], shadow_mode=False)],
    )


def test_a_resource_becomes_the_domain_a_file_would() -> None:
    config = convert(packed(tenant(), Config(name="free", domain="other", descriptors=[Descriptor(key="k")])))
    assert sorted(config.domains) == ["api", "other"]
    rules = {rule.where: rule for rule in config.domains["api"].rules}
    assert len(rules) == 2
    assert config.files == ("xds:tenants", "xds:free")
    assert all(rule.source_file == "xds:tenants" for rule in config.domains["api"].rules)


def test_unlimited_needs_no_unit_and_shadow_mode_is_kept() -> None:
    resource = Config(
        name="r",
        domain="d",
        descriptors=[
            Descriptor(key="open", rate_limit=Policy(unlimited=True)),
            Descriptor(key="watch", shadow_mode=True, rate_limit=Policy(unit=rls_conf.HOUR, requests_per_unit=9)),
        ],
    )
    rules = convert(packed(resource)).domains["d"].rules
    assert sorted((rule.unlimited, rule.shadow_mode) for rule in rules) == [(False, True), (True, False)]


def test_the_digest_follows_the_content() -> None:
    assert convert(packed(tenant())).digest == convert(packed(tenant())).digest
    assert convert(packed(tenant())).digest != convert(packed(tenant(per_second=6))).digest
    assert convert(packed()).domains == {}


def issues_of(*resources: Any, mode: str | None = None) -> list[str]:
    with pytest.raises(ConfigError) as refused:
        convert(resources, mode)
    return [str(issue) for issue in refused.value.issues]


def test_a_missing_unit_is_named_by_resource_and_field() -> None:
    bad = Config(name="broken", domain="api", descriptors=[Descriptor(key="k", rate_limit=Policy(requests_per_unit=3))])
    (issue,) = issues_of(*packed(bad))
    assert issue.startswith("xds:broken: descriptors[0].rate_limit.unit: invalid unit 'unknown'")


def test_every_issue_is_listed_with_its_resource() -> None:
    duplicate = tenant(name="again")
    nameless = Config(name="", domain="", descriptors=[])
    issues = issues_of(*packed(tenant(), duplicate, nameless))
    assert any(issue.startswith("xds:again: domain: duplicate domain 'api' (also in xds:tenants)") for issue in issues)
    assert any(issue.startswith("xds:resources[2]: domain: must be a non-empty string") for issue in issues)


def test_unknown_replaces_and_mode_refusals_are_the_file_messages() -> None:
    replacing = tenant(name="r", replaces=[rls_conf.RateLimitReplace(name="nowhere")])
    (issue,) = issues_of(*packed(replacing))
    assert issue.startswith("xds:r: descriptors[0].rate_limit.replaces")
    assert "nowhere" in issue


def test_a_resource_of_another_type_or_undecodable_is_refused() -> None:
    other = any_pb2.Any(type_url="type.googleapis.com/envoy.config.cluster.v3.Cluster", value=b"")
    garbage = any_pb2.Any(type_url=TYPE_URL, value=b"\xff\xff\xff")
    issues = issues_of(other, garbage)
    assert issues[0].startswith("xds:resources[0]: type 'type.googleapis.com/envoy.config.cluster.v3.Cluster'")
    assert issues[1].startswith("xds:resources[1]: cannot decode")


def test_two_resources_with_one_name_are_refused() -> None:
    issues = issues_of(*packed(tenant(name="x"), tenant(name="x", domain="b")))
    assert issues == ["xds:x: name: two resources have this name: names must be unique"]


def test_nack_detail_is_invalid_argument_and_bounded() -> None:
    code, message = nack_detail([f"issue {n}" for n in range(25)])
    assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    lines = message.splitlines()
    assert lines[0] == "issue 0"
    assert lines[-1] == "(and 5 more)"
    assert len(lines) == 21


def test_backoff_doubles_up_to_the_cap_and_jitter_spreads_it() -> None:
    options = XdsOptions(server="x", backoff_initial=0.5, backoff_max=4.0, backoff_jitter=0.5)
    middle = [backoff(attempt, options, lambda: 0.5) for attempt in range(6)]
    assert middle == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert backoff(2, options, lambda: 0.0) == 1.0
    assert backoff(2, options, lambda: 1.0) == 3.0
    assert backoff(10_000, options, lambda: 0.5) == 4.0
    still = XdsOptions(server="x", backoff_initial=1.0, backoff_max=8.0, backoff_jitter=0.0)
    assert backoff(1, still, lambda: 0.9) == 2.0


class OneShotAds(ads_pb2_grpc.AggregatedDiscoveryServiceServicer):  # type: ignore[misc]
    """Sends the queued responses one per request received; records the requests."""

    def __init__(self, responses: list[Any]) -> None:
        self.responses = responses
        self.requests: list[Any] = []
        self.done = asyncio.Event()

    async def StreamAggregatedResources(self, requests: Any, context: Any) -> Any:  # noqa: N802 - gRPC's name
        async for request in requests:
            self.requests.append(request)
            if not self.responses:
                self.done.set()
                continue
            yield self.responses.pop(0)


def response(version: str, nonce: str, *configs: Any) -> Any:
    return discovery_pb2.DiscoveryResponse(
        version_info=version, nonce=nonce, type_url=TYPE_URL, resources=packed(*configs)
    )


async def test_ack_then_nack_keeps_the_last_good_config() -> None:
    bad = Config(name="bad", domain="api", descriptors=[Descriptor(key="k", rate_limit=Policy(requests_per_unit=1))])
    ads = OneShotAds([response("v1", "n1", tenant()), response("v2", "n2", bad)])
    server = grpc.aio.server()
    ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(ads, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    active = [empty_config()]
    reloader = ConfigReloader("", lambda: active[0], lambda config: active.__setitem__(0, config), lambda: None)
    options = XdsOptions(server=f"127.0.0.1:{port}", node_id="replica-7", node_metadata={"zone": "a"})
    source = XdsConfigSource(options, reloader, lambda resources: convert(resources, SYNC_MODE))
    task = asyncio.create_task(source.run())
    try:
        await asyncio.wait_for(ads.done.wait(), 30)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await server.stop(0)
    first, ack, nack = ads.requests
    assert (first.version_info, first.response_nonce, first.type_url) == ("", "", TYPE_URL)
    assert first.node.id == "replica-7"
    assert first.node.metadata.fields["zone"].string_value == "a"
    assert (ack.version_info, ack.response_nonce, ack.HasField("error_detail")) == ("v1", "n1", False)
    assert (nack.version_info, nack.response_nonce) == ("v1", "n2")
    assert nack.error_detail.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert nack.error_detail.message.startswith("xds:bad: descriptors[0].rate_limit.unit: invalid unit 'unknown'")
    assert sorted(active[0].domains) == ["api"]
    assert active[0].files == ("xds:tenants",)
    assert (source.state.version, source.state.applied, source.state.rejected) == ("v1", 1, 1)


async def test_a_failure_while_applying_reconnects_instead_of_ending_the_source() -> None:
    ads = OneShotAds([response("v1", "n1", tenant()), response("v1", "n2", tenant())])
    server = grpc.aio.server()
    ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(ads, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    active = [empty_config()]
    reloader = ConfigReloader("", lambda: active[0], lambda config: active.__setitem__(0, config), lambda: None)
    builds = []

    def flaky(resources: Any) -> Any:
        builds.append(len(resources))
        if len(builds) == 1:
            raise RuntimeError("a bug")
        return convert(resources)

    options = XdsOptions(server=f"127.0.0.1:{port}", backoff_initial=0.01, backoff_max=0.05)
    source = XdsConfigSource(options, reloader, flaky)
    task = asyncio.create_task(source.run())
    try:
        await asyncio.wait_for(ads.done.wait(), 30)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await server.stop(0)
    assert builds == [1, 1]
    assert sorted(active[0].domains) == ["api"]
    assert source.state.version == "v1"
    assert [request.response_nonce for request in ads.requests] == ["", "", "n2"]  # a new stream, then the ACK
