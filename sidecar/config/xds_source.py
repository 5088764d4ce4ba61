"""Limits pushed by a control plane: envoyproxy/ratelimit's xDS config source (State of the World).

The sidecar opens one ``AggregatedDiscoveryService/StreamAggregatedResources`` stream and
subscribes (wildcard) to :data:`TYPE_URL`, the reference's ``RateLimitConfig`` resource: one
domain's descriptors each. Every response is the whole set of resources. It is converted to
the YAML document shape a config file has and validated by the same parser
(:mod:`sidecar.config.parse`), so a refused push gets the messages ``check-config`` prints,
with ``xds:<resource name>`` where a file name would be. Then:

* valid: installed through :meth:`ConfigReloader.swap_in` (built in a worker thread, swapped
  in one assignment, quota buckets re-assigned, counters of unchanged rules kept), and ACKed
  with the response's version and nonce;
* invalid: NACKed (the last applied version, this nonce, ``error_detail`` listing every issue)
  and the last good config keeps serving.

When the stream ends or cannot be opened, the client reconnects after an exponential
backoff with jitter, announcing the version it still serves; meanwhile nothing changes.
JSON is a subset of YAML, so the document is handed to the parser as JSON text.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import grpc
import structlog
from google.protobuf import json_format, struct_pb2
from google.protobuf.message import DecodeError
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from sidecar.config.errors import ConfigError, ConfigIssue
from sidecar.config.load import DEFAULT_OPTIONS, MERGE_HINT, LoadOptions, merge_domains, mode_issues, parse_named
from sidecar.config.model import DomainConfig, RateLimitConfig
from sidecar.config.reload import ConfigReloader
from sidecar.config.yaml_source import MAX_FILE_BYTES
from sidecar.protos.envoy.config.core.v3 import base_pb2
from sidecar.protos.envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from sidecar.protos.ratelimit.config.ratelimit.v3 import rls_conf_pb2

log = structlog.get_logger(__name__)

TYPE_URL = "type.googleapis.com/ratelimit.config.ratelimit.v3.RateLimitConfig"
SOURCE_PREFIX = "xds:"
"""What stands for a file name in the issues and in ``/config``: ``xds:<resource name>``."""
MAX_DETAIL_ISSUES = 20
"""A NACK's ``error_detail`` lists this many issues at most (and counts the rest)."""
USER_AGENT = "ratelimit-sidecar"
KEEPALIVE_MS = 300_000


@dataclass(frozen=True)
class XdsOptions:
    """Where the control plane is and how to talk to it (``--xds-*``, ``CONFIG_GRPC_XDS_*``)."""

    server: str
    node_id: str = "default"
    node_metadata: dict[str, Any] = field(default_factory=dict)
    headers: tuple[tuple[str, str], ...] = ()
    backoff_initial: float = 0.5
    backoff_max: float = 30.0
    backoff_jitter: float = 0.5
    """Random factor: each delay is spread uniformly over ``delay * (1 ± jitter)``."""
    max_message_bytes: int = 4 * 1024 * 1024
    tls: bool = False
    tls_ca: str = ""
    """PEM file of the CAs the control plane's certificate must chain to; empty: gRPC's default roots."""
    tls_cert: str = ""
    tls_key: str = ""
    """The client certificate and key, for a control plane that asks for one (mutual TLS)."""
    tls_server_name: str = ""
    """The name the certificate must carry when it is not the address's host (the reference's SAN)."""


def json_object(text: str) -> dict[str, Any]:
    """Node metadata: a JSON object (empty text is none); ``ValueError`` says what is wrong."""
    try:
        value = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as error:
        raise ValueError(f"not JSON: {error}") from None
    if not isinstance(value, dict):
        raise ValueError("must be a JSON object")
    return value


def header_pairs(text: str) -> tuple[tuple[str, str], ...]:
    """``name:value,name:value`` (the reference's map syntax) as gRPC metadata; names lowercased."""
    pairs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition(":")
        if not sep or not name.strip():
            raise ValueError(f"{item!r} is not name:value")
        pairs.append((name.strip().lower(), value.strip()))
    return tuple(pairs)


def backoff(attempt: int, options: XdsOptions, draw: Callable[[], float] = random.random) -> float:
    """Seconds to wait before reconnect ``attempt`` (0 for the first retry): doubling from
    ``backoff_initial`` up to ``backoff_max``, spread by the jitter so replicas that lost the
    same control plane do not all come back in the same instant."""
    delay = min(options.backoff_max, options.backoff_initial * 2 ** min(attempt, 32))
    return max(0.0, float(delay * (1 + options.backoff_jitter * (2 * draw() - 1))))


def descriptor_document(descriptor: Any) -> dict[str, Any]:
    """One ``RateLimitDescriptor`` as the mapping a YAML file would hold for it. Proto3 cannot
    tell an unset scalar from its default, so defaults are left out (the parser then applies
    its own rule), except a limit's unit, which is required unless the limit is unlimited."""
    document: dict[str, Any] = {"key": descriptor.key}
    if descriptor.value:
        document["value"] = descriptor.value
    if descriptor.HasField("rate_limit"):
        document["rate_limit"] = policy_document(descriptor.rate_limit)
    if descriptor.shadow_mode:
        document["shadow_mode"] = True
    if descriptor.descriptors:
        document["descriptors"] = [descriptor_document(child) for child in descriptor.descriptors]
    return document


def policy_document(policy: Any) -> dict[str, Any]:
    """A ``RateLimitPolicy`` as a ``rate_limit`` mapping (``unit: SECOND`` becomes ``second``)."""
    document: dict[str, Any] = {}
    if policy.unlimited:
        document["unlimited"] = True
    if policy.unit != rls_conf_pb2.UNKNOWN or not policy.unlimited:
        document["unit"] = rls_conf_pb2.RateLimitUnit.Name(policy.unit).lower()
    if policy.requests_per_unit or not policy.unlimited:
        document["requests_per_unit"] = policy.requests_per_unit
    if policy.name:
        document["name"] = policy.name
    if policy.replaces:
        document["replaces"] = [{"name": replaced.name} for replaced in policy.replaces]
    return document


def resource_document(config: Any) -> dict[str, Any]:
    """A ``RateLimitConfig`` resource as a config file's document (its ``name`` names the
    source, not a rule, so it is not part of it)."""
    return {"domain": config.domain, "descriptors": [descriptor_document(item) for item in config.descriptors]}


def unpacked(resources: Sequence[Any]) -> tuple[list[tuple[str, Any]], list[ConfigIssue]]:
    """``(source name, RateLimitConfig)`` of each ``Any`` in a response, and an issue for each
    one that is not a RateLimitConfig or does not decode."""
    configs: list[tuple[str, Any]] = []
    issues: list[ConfigIssue] = []
    for index, resource in enumerate(resources):
        config = rls_conf_pb2.RateLimitConfig()
        place = f"resources[{index}]"
        if resource.type_url != TYPE_URL:
            issues.append(ConfigIssue(f"{SOURCE_PREFIX}{place}", 0, "", f"type {resource.type_url!r}, not {TYPE_URL}"))
            continue
        try:
            config.ParseFromString(resource.value)
        except DecodeError as error:
            issues.append(ConfigIssue(f"{SOURCE_PREFIX}{place}", 0, "", f"cannot decode: {error}"))
            continue
        configs.append((f"{SOURCE_PREFIX}{config.name or place}", config))
    return configs, issues


def convert(
    resources: Sequence[Any],
    mode: str | None = None,
    max_bytes: int = MAX_FILE_BYTES,
    options: LoadOptions = DEFAULT_OPTIONS,
) -> RateLimitConfig:
    """The config a response's resources stand for, validated as files are (one resource is
    one file: duplicate domains, merging, the mode's refusals); :class:`ConfigError` lists
    every issue. For a worker thread: the work grows with the rules."""
    configs, issues = unpacked(resources)
    domains: dict[str, DomainConfig] = {}
    claimed: dict[str, str] = {}
    digest = hashlib.sha256()
    seen: set[str] = set()
    for name, config in configs:
        if name in seen:
            issues.append(ConfigIssue(name, 0, "name", "two resources have this name: names must be unique"))
            continue
        seen.add(name)
        text = json.dumps(resource_document(config), indent=1)
        digest.update(name.encode() + b"\0" + text.encode() + b"\0")
        domain, found, named = parse_named(text, name, max_bytes, options)
        issues.extend(found)
        if named is not None and not options.merge_domains and named[0] in claimed:
            problem = f"duplicate domain {named[0]!r} (also in {claimed[named[0]]}): {MERGE_HINT}"
            issues.append(ConfigIssue(name, 0, "domain", problem))
            continue
        if named is not None:
            claimed.setdefault(named[0], name)
        if domain is not None:
            known = domains.get(domain.name)
            domains[domain.name] = domain if known is None else merge_domains(known, domain, issues)
    issues += mode_issues(domains, mode)
    if issues:
        # Lines of the JSON text mean nothing to whoever wrote the resource: the path names the place.
        raise ConfigError([replace(issue, line=0) for issue in issues])
    return RateLimitConfig(domains, tuple(name for name, _ in configs), digest.hexdigest())


def empty_config() -> RateLimitConfig:
    """No limits: what an xDS sidecar serves before the first push when no ``--config`` is given."""
    return RateLimitConfig({}, (), hashlib.sha256(b"xds: no resources yet").hexdigest())


def nack_detail(issues: Sequence[str]) -> tuple[int, str]:
    """``error_detail`` of a NACK (a ``google.rpc.Status``): INVALID_ARGUMENT and the issues, one a line."""
    shown = list(issues[:MAX_DETAIL_ISSUES])
    if len(issues) > MAX_DETAIL_ISSUES:
        shown.append(f"(and {len(issues) - MAX_DETAIL_ISSUES} more)")
    return grpc.StatusCode.INVALID_ARGUMENT.value[0], "\n".join(shown)


def node(options: XdsOptions) -> Any:
    """The ``Node`` this sidecar announces: the id and metadata the control plane selects by."""
    metadata = struct_pb2.Struct()
    json_format.ParseDict(options.node_metadata, metadata)
    return base_pb2.Node(id=options.node_id, metadata=metadata, user_agent_name=USER_AGENT)


def channel_credentials(options: XdsOptions) -> grpc.ChannelCredentials:
    """TLS credentials from the option's files; ``OSError`` naming the file that cannot be read."""

    def read(path: str) -> bytes | None:
        return Path(path).read_bytes() if path else None

    return grpc.ssl_channel_credentials(read(options.tls_ca), read(options.tls_key), read(options.tls_cert))


@dataclass
class XdsState:
    """What the source has done, for ``/config``, ``/metrics``, logs and tests."""

    version: str = ""
    """The version of the last applied (ACKed) response; empty before the first."""
    nonce: str = ""
    connected: bool = False
    applied: int = 0
    rejected: int = 0
    last_error: str = ""

    def frozen(self) -> FrozenXdsState:
        """A copy for one scrape (taken on the loop, rendered in a thread)."""
        return FrozenXdsState(self.version, self.connected, self.applied, self.rejected)


MAX_VERSION_LABEL = 64
"""Characters of the control plane's version string a metric label carries (the server picks
it: a longer one is cut, so one scrape's series stay small)."""


@dataclass(frozen=True, slots=True)
class FrozenXdsState:
    """``ratelimit_sidecar_xds_*``: the stream's state and the updates applied or refused."""

    version: str
    connected: bool
    applied: int
    rejected: int

    def collect(self) -> Iterator[Metric]:
        connected = GaugeMetricFamily(
            "ratelimit_sidecar_xds_connected", "1 while the ADS stream to the control plane is open"
        )
        connected.add_metric([], float(self.connected))
        yield connected
        updates = CounterMetricFamily(
            "ratelimit_sidecar_xds_updates",
            "Config pushes from the control plane: applied (ACKed) or rejected (NACKed, the last good kept)",
            labels=("result",),
        )
        updates.add_metric(["applied"], self.applied)
        updates.add_metric(["rejected"], self.rejected)
        yield updates
        info = GaugeMetricFamily(
            "ratelimit_sidecar_xds_config_version",
            "1, labelled with the version of the config pushed last and applied (empty before the first)",
            labels=("version",),
        )
        info.add_metric([self.version[:MAX_VERSION_LABEL]], 1.0)
        yield info


class XdsConfigSource:
    """Runs the ADS stream for the sidecar's lifetime; :meth:`run` returns only when cancelled."""

    def __init__(
        self,
        options: XdsOptions,
        reloader: ConfigReloader,
        build: Callable[[Sequence[Any]], RateLimitConfig],
    ) -> None:
        self.options = options
        self.reloader = reloader
        self.build = build
        """Resources to config (:func:`convert` with the process's mode and options)."""
        self.state = XdsState()

    async def run(self) -> None:
        """Connect, follow the stream, and reconnect with backoff whenever it ends."""
        attempt = 0
        while True:
            try:
                received = await self._session()
            except Exception as error:  # a bug in a push's handling must not end the source for good
                log.exception("xds_session_failed", server=self.options.server, error=repr(error))
                self.state.last_error, received = repr(error), False
            attempt = 0 if received else attempt + 1
            delay = backoff(attempt, self.options)
            log.warning("xds_reconnecting", server=self.options.server, in_seconds=round(delay, 3), attempt=attempt)
            await asyncio.sleep(delay)

    async def _session(self) -> bool:
        """One stream, until it ends; True when it delivered at least one response."""
        channel_options: list[tuple[str, Any]] = [
            ("grpc.max_receive_message_length", self.options.max_message_bytes),
            ("grpc.primary_user_agent", USER_AGENT),
            # A control plane that vanished without closing the connection (a node lost) would
            # otherwise hold the stream open for ever: ping it. Every 5 minutes, the least
            # interval gRPC servers accept by default (more often, they close the connection).
            ("grpc.keepalive_time_ms", KEEPALIVE_MS),
            ("grpc.keepalive_timeout_ms", 20_000),
        ]
        received = False
        if self.options.tls_server_name:
            channel_options.append(("grpc.ssl_target_name_override", self.options.tls_server_name))
        async with await self._channel(channel_options) as channel:
            stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel)
            requests: asyncio.Queue[Any] = asyncio.Queue()
            requests.put_nowait(self._request())
            call = stub.StreamAggregatedResources(outgoing(requests), metadata=self.options.headers or None)
            try:
                async for response in call:
                    if not received:
                        log.info("xds_connected", server=self.options.server, node_id=self.options.node_id)
                    received = self.state.connected = True
                    requests.put_nowait(await self._answer(response))
            except grpc.aio.AioRpcError as error:
                self.state.last_error = f"{error.code().name}: {error.details()}"
                log.warning("xds_stream_failed", server=self.options.server, error=self.state.last_error)
            finally:
                self.state.connected = False
                call.cancel()
        return received

    async def _channel(self, channel_options: list[tuple[str, Any]]) -> grpc.aio.Channel:
        """Plaintext, or TLS with the files read now (a rotated certificate is used from the next
        connection on)."""
        if not self.options.tls:
            return grpc.aio.insecure_channel(self.options.server, options=channel_options)
        credentials = await asyncio.to_thread(channel_credentials, self.options)
        return grpc.aio.secure_channel(self.options.server, credentials, options=channel_options)

    def _request(self, nonce: str = "", detail: tuple[int, str] | None = None) -> Any:
        """A request announcing the version served now (ACK, or NACK with ``detail``)."""
        request = discovery_pb2.DiscoveryRequest(
            version_info=self.state.version, node=node(self.options), type_url=TYPE_URL, response_nonce=nonce
        )
        if detail is not None:
            request.error_detail.code, request.error_detail.message = detail
        return request

    async def _answer(self, response: Any) -> Any:
        """Apply a response; the ACK or NACK to send back."""
        self.state.nonce = response.nonce
        if response.type_url != TYPE_URL:
            issue = f"type {response.type_url!r} was not subscribed to (only {TYPE_URL})"
            return self._refused(response, [issue])
        resources = list(response.resources)
        issues = await self.reloader.swap_in(f"xds {response.version_info}", lambda: self.build(resources))
        if issues:
            return self._refused(response, issues)
        self.state.version = response.version_info
        self.state.applied += 1
        log.info("xds_applied", version=response.version_info, resources=len(resources))
        return self._request(response.nonce)

    def _refused(self, response: Any, issues: list[str]) -> Any:
        self.state.rejected += 1
        self.state.last_error = issues[0] if issues else ""
        log.error(
            "xds_rejected", version=response.version_info, issues=issues[:MAX_DETAIL_ISSUES], kept=self.state.version
        )
        return self._request(response.nonce, nack_detail(issues))


async def outgoing(requests: asyncio.Queue[Any]) -> AsyncIterator[Any]:
    """The request stream: whatever the source queues, in order."""
    while True:
        yield await requests.get()
