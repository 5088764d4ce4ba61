"""The response's ``dynamic_metadata``, as envoyproxy/ratelimit writes it (``RESPONSE_DYNAMIC_METADATA``).

Only with ``--response-dynamic-metadata``: the request's domain and descriptors (their
entries as ``key=value`` strings, a request override's limit, a descriptor's
``hitsAddend``), the request's ``hitsAddend`` when set, and ``metadata``: the
``metadata`` of every limited descriptor whose status is OK, merged (the first
descriptor's value wins where two disagree; mappings are merged key by key). Envoy
puts it in the ``envoy.filters.http.ratelimit`` namespace of the stream's dynamic
metadata, where routes and access logs can read it (for example to route on quota).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from google.protobuf.struct_pb2 import Struct

from sidecar.limiter.protocol import Decision
from sidecar.protos.envoy.service.ratelimit.v3 import rls_pb2
from sidecar.service.reported import Applied
from sidecar.service.wire import length_delimited

DYNAMIC_METADATA_TAG = b"\x32"
"""``RateLimitResponse.dynamic_metadata`` is field 6, length-delimited."""
UNIT_NAMES = rls_pb2.RateLimitResponse.RateLimit.Unit.Name


def dynamic_metadata_field(fields: Mapping[str, Any]) -> bytes:
    """The ``dynamic_metadata`` field of a response: a ``google.protobuf.Struct``, map keys sorted
    (as ``SerializeToString(deterministic=True)`` writes it); nothing for no fields, as protobuf."""
    if not fields:
        return b""
    message = Struct()
    message.update(fields)
    return length_delimited(DYNAMIC_METADATA_TAG, message.SerializeToString(deterministic=True))


def descriptor_fields(descriptor: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {"entries": [f"{entry.key}={entry.value}" for entry in descriptor.entries]}
    if descriptor.HasField("limit"):
        limit = descriptor.limit
        fields["limit"] = f"requests_per_unit:{limit.requests_per_unit} unit:{UNIT_NAMES(limit.unit)}"
    if descriptor.HasField("hits_addend"):
        fields["hitsAddend"] = descriptor.hits_addend.value
    return fields


def merge_into(target: dict[str, Any], source: Mapping[str, Any]) -> None:
    """Add ``source`` to ``target``: keys already there keep their value, mappings merge."""
    for key, value in source.items():
        present = target.get(key)
        if present is None and key not in target:
            target[key] = dict(value) if isinstance(value, Mapping) else value
        elif isinstance(present, dict) and isinstance(value, Mapping):
            merge_into(present, value)


def passed(item: Applied, decision: Decision | None) -> bool:
    """Whether a limited descriptor's status is OK (every limit within, or in shadow mode)."""
    if decision is None:
        return False
    return all(not decision.over[index] or rule.shadow_mode for rule, index in item.limits())


def response_metadata(request: Any, applied: Sequence[Applied | None], decision: Decision | None) -> dict[str, Any]:
    """The ``dynamic_metadata`` of one response, as a JSON-like mapping."""
    fields: dict[str, Any] = {
        "domain": request.domain,
        "descriptors": [descriptor_fields(descriptor) for descriptor in request.descriptors],
    }
    if request.hits_addend:
        fields["hitsAddend"] = request.hits_addend
    merged: dict[str, Any] = {}
    for item in applied:
        if item is not None and item.check is not None and item.rule.metadata and passed(item, decision):
            merge_into(merged, item.rule.metadata)
    if merged:
        fields["metadata"] = merged
    return fields
