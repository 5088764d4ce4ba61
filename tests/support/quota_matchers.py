"""Evaluate exported ``rate_limit_quota`` bucket matchers against a request, as Envoy does.

The unit tests ask which bucket each filter gives a request (first matching entry wins; no
entry, no bucket), so that a test says what happens to a request rather than how a predicate
is spelt. Only what the exporter writes is understood: header, query parameter and source
address inputs, the string matchers, dynamic metadata read by the metadata matcher (a string
matcher on a string value), and ``and``/``or``/``not``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, urlsplit

HEADER_INPUT = "type.googleapis.com/envoy.type.matcher.v3.HttpRequestHeaderMatchInput"
QUERY_INPUT = "type.googleapis.com/envoy.type.matcher.v3.HttpRequestQueryParamMatchInput"
SOURCE_IP = "type.googleapis.com/envoy.extensions.matching.common_inputs.network.v3.SourceIPInput"
METADATA_INPUT = "type.googleapis.com/envoy.extensions.matching.common_inputs.network.v3.DynamicMetadataInput"
METADATA_MATCHER = "type.googleapis.com/envoy.extensions.matching.input_matchers.metadata.v3.Metadata"


@dataclass
class Request:
    """One request: ``:path`` (with its query), ``:authority``, other headers, the client address,
    the dynamic metadata earlier filters set (namespace to struct)."""

    path: str = "/"
    host: str = "example.org"
    headers: dict[str, str] = field(default_factory=dict)
    address: str = "127.0.0.1"
    metadata: dict[str, Any] = field(default_factory=dict)

    def metadata_value(self, typed: dict[str, Any]) -> Any:
        """What the dynamic metadata input gives its matcher: the value at the path, or None."""
        assert typed["@type"] == METADATA_INPUT, typed
        value: Any = self.metadata.get(typed["filter"])
        for segment in typed["path"]:
            value = value.get(segment["key"]) if isinstance(value, dict) else None
        return value

    def read(self, typed: dict[str, Any]) -> str | None:
        kind = typed["@type"]
        if kind == HEADER_INPUT:
            name = typed["header_name"].lower()
            found = {":path": self.path, ":authority": self.host, ":method": "GET"} | {
                key.lower(): value for key, value in self.headers.items()
            }
            return found.get(name)
        if kind == QUERY_INPUT:
            return next(
                (
                    value
                    for key, value in parse_qsl(urlsplit(self.path).query, keep_blank_values=True)
                    if key == typed["query_param"]
                ),
                None,
            )
        assert kind == SOURCE_IP, kind
        return self.address


def string_matches(matcher: dict[str, Any], value: str) -> bool:
    fold = matcher.get("ignore_case", False)
    text, value = (value.lower(), value) if fold else (value, value)
    for kind in ("exact", "prefix", "suffix", "contains"):
        if kind in matcher:
            wanted = matcher[kind].lower() if fold else matcher[kind]
            outcome: bool = {
                "exact": text == wanted,
                "prefix": text.startswith(wanted),
                "suffix": text.endswith(wanted),
                "contains": wanted in text,
            }[kind]
            return outcome
    regex = matcher["safe_regex"]["regex"]
    return re.fullmatch(regex, value) is not None


def holds(predicate: dict[str, Any], request: Request) -> bool:
    if "single_predicate" in predicate:
        single = predicate["single_predicate"]
        if "custom_match" in single:
            matcher = single["custom_match"]["typed_config"]
            assert matcher["@type"] == METADATA_MATCHER and not matcher.get("invert"), matcher
            found = request.metadata_value(single["input"]["typed_config"])
            return isinstance(found, str) and string_matches(matcher["value"]["string_match"], found)
        value = request.read(single["input"]["typed_config"])
        return value is not None and string_matches(single["value_match"], value)
    if "and_matcher" in predicate:
        return all(holds(item, request) for item in predicate["and_matcher"]["predicate"])
    if "or_matcher" in predicate:
        return any(holds(item, request) for item in predicate["or_matcher"]["predicate"])
    return not holds(predicate["not_matcher"], request)


def bucket_value(builder: dict[str, Any], request: Request) -> str | None:
    if "string_value" in builder:
        return str(builder["string_value"])
    return request.read(builder["custom_value"]["typed_config"])


def bucket_id(builder: dict[str, Any], request: Request) -> dict[str, str | None]:
    """The bucket id as Envoy builds it: a field read from the request (``custom_value``) that
    is empty is left out of the id (Envoy 1.36.4 and 1.40.0); a ``string_value`` of ``""`` stays."""
    built = {key: bucket_value(value, request) for key, value in builder.items()}
    return {key: value for key, value in built.items() if value != "" or "string_value" in builder[key]}


def buckets(filters: list[dict[str, Any]], request: Request) -> list[dict[str, str | None]]:
    """The bucket id each filter gives ``request`` (filters giving none are left out)."""
    found = []
    for item in filters:
        for entry in item["typed_config"]["bucket_matchers"]["matcher_list"]["matchers"]:
            if holds(entry["predicate"], request):
                builder = entry["on_match"]["action"]["typed_config"]["bucket_id_builder"]["bucket_id_builder"]
                found.append(bucket_id(builder, request))
                break
    return found
