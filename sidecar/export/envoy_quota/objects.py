"""Envoy objects of the ``rate_limit_quota`` filter, built with the typed classes of ``envoy-data-plane``.

Typed classes, not hand-written dicts: a misspelt field or a value of the wrong type
fails here, with the field's name, instead of in ``envoy --mode validate`` (or worse,
being ignored). The package is imported only by ``export-envoy-quota`` (off the request
path; it brings pydantic). Everything leaves this module as plain dicts in Envoy's
YAML shape (``snake_case``, ``"@type"`` for ``Any``), ready for ``yaml.safe_dump``.
"""

from __future__ import annotations

import datetime
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import betterproto2

from sidecar.export.hosts import Domain, HostTest

with warnings.catch_warnings():
    # The generated classes use a pydantic idiom deprecated since pydantic 2.12: a warning per
    # class at import, about the package and not about this code.
    warnings.simplefilter("ignore", DeprecationWarning)
    from envoy_data_plane.envoy.config.core.v3 import GrpcService, GrpcServiceEnvoyGrpc
    from envoy_data_plane.envoy.config.core.v3 import TypedExtensionConfig as EnvoyTypedConfig
    from envoy_data_plane.envoy.extensions.filters.http.rate_limit_quota.v3 import (
        RateLimitQuotaBucketSettings,
        RateLimitQuotaBucketSettingsBucketIdBuilder,
        RateLimitQuotaBucketSettingsBucketIdBuilderValueBuilder,
        RateLimitQuotaBucketSettingsDenyResponseSettings,
        RateLimitQuotaBucketSettingsExpiredAssignmentBehavior,
        RateLimitQuotaBucketSettingsNoAssignmentBehavior,
        RateLimitQuotaFilterConfig,
    )
    from envoy_data_plane.envoy.extensions.filters.network.http_connection_manager.v3 import HttpFilter
    from envoy_data_plane.envoy.extensions.matching.common_inputs.network.v3 import (
        DynamicMetadataInput,
        DynamicMetadataInputPathSegment,
        SourceIpInput,
    )
    from envoy_data_plane.envoy.extensions.matching.input_matchers.metadata.v3 import Metadata as MetadataMatcher
    from envoy_data_plane.envoy.type.matcher.v3 import (
        HttpRequestHeaderMatchInput,
        HttpRequestQueryParamMatchInput,
        ValueMatcher,
    )
    from envoy_data_plane.envoy.type.matcher.v3 import RegexMatcher as EnvoyRegexMatcher
    from envoy_data_plane.envoy.type.matcher.v3 import StringMatcher as EnvoyStringMatcher
    from envoy_data_plane.envoy.type.v3 import HttpStatus, RateLimitStrategy, RateLimitStrategyBlanketRule, StatusCode
    from envoy_data_plane.google.protobuf import Any as AnyMessage
    from envoy_data_plane.xds.core.v3 import TypedExtensionConfig
    from envoy_data_plane.xds.type.matcher.v3 import (
        Matcher,
        MatcherMatcherList,
        MatcherMatcherListFieldMatcher,
        MatcherMatcherListPredicate,
        MatcherMatcherListPredicatePredicateList,
        MatcherMatcherListPredicateSinglePredicate,
        MatcherOnMatch,
        RegexMatcher,
        RegexMatcherGoogleRe2,
        StringMatcher,
    )

Predicate = MatcherMatcherListPredicate
BucketMatcher = Matcher
Fallback = Literal["allow", "deny"]

FILTER_NAME = "envoy.filters.http.rate_limit_quota"
REPORTING_SECONDS = 5
"""Envoy 1.40 reports every 5 s whatever ``reporting_interval`` says (one message for all
buckets); 5 s is written so that the config says what happens."""
EXPIRED_FALLBACK_SECONDS = 60
"""How long an expired assignment (sidecar unreachable past the TTL) is replaced by the
fallback before Envoy abandons the bucket. Unset means 0 in Envoy 1.40: the bucket would be
abandoned and re-created (a new subscription) at once. Whole seconds, like every duration there."""
DOMAIN_KEY = "domain"
"""Bucket ids: ``domain`` plus ``entry.<i>.<key>`` per descriptor entry (the service parses exactly this)."""

_BLANKET = {"allow": RateLimitStrategyBlanketRule.ALLOW_ALL, "deny": RateLimitStrategyBlanketRule.DENY_ALL}


def entry_field(index: int, key: str) -> str:
    """The bucket id field of descriptor entry ``index`` with key ``key``."""
    return f"entry.{index}.{key}"


# ---------------------------------------------------------------- inputs and predicates


def header_input(name: str) -> TypedExtensionConfig:
    """A request header as matcher input (pseudo-headers too: ``:path``, ``:method``)."""
    return TypedExtensionConfig(name="request-headers", typed_config=AnyMessage.pack(header_value_input(name)))


def header_value_input(name: str) -> HttpRequestHeaderMatchInput:
    return HttpRequestHeaderMatchInput(header_name=name)


def source_ip_input() -> TypedExtensionConfig:
    """The downstream address as matcher input: the address Envoy's ``remote_address`` action
    sends, i.e. after ``use_remote_address`` / ``xff_num_trusted_hops`` have been applied."""
    return TypedExtensionConfig(name="source-ip", typed_config=AnyMessage.pack(SourceIpInput()))


def string_matcher(kind: str, value: str, *, ignore_case: bool = False) -> StringMatcher:
    """``exact``, ``prefix``, ``suffix``, ``contains`` or ``safe_regex`` (RE2, whole value)."""
    if kind == "safe_regex":
        regex = f"(?i){value}" if ignore_case else value
        return StringMatcher(safe_regex=RegexMatcher(google_re2=RegexMatcherGoogleRe2(), regex=regex))
    if kind == "exact":
        return StringMatcher(exact=value, ignore_case=ignore_case)
    if kind == "prefix":
        return StringMatcher(prefix=value, ignore_case=ignore_case)
    if kind == "suffix":
        return StringMatcher(suffix=value, ignore_case=ignore_case)
    return StringMatcher(contains=value, ignore_case=ignore_case)


def single(input_config: TypedExtensionConfig, matcher: StringMatcher) -> Predicate:
    return Predicate(
        single_predicate=MatcherMatcherListPredicateSinglePredicate(input=input_config, value_match=matcher)
    )


def header_predicate(name: str, kind: str, value: str, *, ignore_case: bool = False) -> Predicate:
    """True when header ``name`` is present and its value matches (an absent header never matches)."""
    return single(header_input(name), string_matcher(kind, value, ignore_case=ignore_case))


def query_predicate(name: str, kind: str, value: str, *, ignore_case: bool = False) -> Predicate:
    """True when query parameter ``name`` is present and its (first, decoded) value matches."""
    config = TypedExtensionConfig(name="query-param", typed_config=AnyMessage.pack(query_value_input(name)))
    return single(config, string_matcher(kind, value, ignore_case=ignore_case))


def query_present(name: str) -> Predicate:
    """True when query parameter ``name`` is present (any value, empty included)."""
    return query_predicate(name, "safe_regex", ".*")


def query_value_input(name: str) -> HttpRequestQueryParamMatchInput:
    return HttpRequestQueryParamMatchInput(query_param=name)


def metadata_is(namespace: str, path: Sequence[str], value: str) -> Predicate:
    """True when the request's dynamic metadata holds the string ``value`` at ``namespace`` /
    ``path``: Envoy's dynamic metadata input read by its metadata input matcher (the input gives
    that matcher a structured value, never a string, so a string matcher cannot test it)."""
    return _metadata_test(namespace, path, EnvoyStringMatcher(exact=value))


def metadata_has_string(namespace: str, path: Sequence[str]) -> Predicate:
    """True when the dynamic metadata at ``namespace`` / ``path`` is a non-empty string: what
    Envoy's ``metadata`` rate-limit action sends (a number, a struct, ``""`` or nothing count as
    absent there)."""
    # Envoy's RegexMatcher is RE2 whatever it says (its google_re2 field is deprecated).
    return _metadata_test(namespace, path, EnvoyStringMatcher(safe_regex=EnvoyRegexMatcher(regex="(?s).+")))


def _metadata_test(namespace: str, path: Sequence[str], matcher: EnvoyStringMatcher) -> Predicate:
    segments = [DynamicMetadataInputPathSegment(key=key) for key in path]
    read = DynamicMetadataInput(filter=namespace, path=segments)
    test = MetadataMatcher(value=ValueMatcher(string_match=matcher))
    return Predicate(
        single_predicate=MatcherMatcherListPredicateSinglePredicate(
            input=TypedExtensionConfig(name="dynamic-metadata", typed_config=AnyMessage.pack(read)),
            custom_match=TypedExtensionConfig(name="metadata", typed_config=AnyMessage.pack(test)),
        )
    )


AUTHORITY = ":authority"
_PORT = "(?::[0-9]*)?"


def domain_predicate(domain: Domain, ignore_port: bool) -> Predicate:
    """``:authority`` matching one ``domains`` entry as Envoy matches it (case-insensitive, a
    wildcard standing for one character or more, the port ignored when the route config says)."""
    if domain.kind == "any":
        return header_present(AUTHORITY)
    if domain.kind == "exact" and not ignore_port:
        return header_predicate(AUTHORITY, "exact", domain.text, ignore_case=True)
    text = re.escape(domain.text)
    if domain.kind == "suffix":
        regex = (".+" if not ignore_port else "[^:]+") + text
    elif domain.kind == "prefix":
        regex = text + (".+" if not ignore_port else "[^:]+")
    else:
        regex = text
    return header_predicate(AUTHORITY, "safe_regex", regex + (_PORT if ignore_port else ""), ignore_case=True)


def host_predicate(test: HostTest) -> Predicate | None:
    """The requests Envoy gives one virtual host: one of its domains matches and no domain of
    another host outranking it does; None when the host takes every request."""
    if test.everything:
        return None
    choices = []
    for mine, rivals in test.choices:
        tests = [domain_predicate(mine, test.ignore_port)]
        if rivals:
            tests.append(negate(any_of([domain_predicate(rival, test.ignore_port) for rival in rivals])))
        choices.append(all_of(tests))
    return any_of(choices)


def header_present(name: str) -> Predicate:
    """True when header ``name`` is present (any value, empty included)."""
    return header_predicate(name, "safe_regex", ".*")


def all_of(predicates: Sequence[Predicate]) -> Predicate:
    """The conjunction, nested conjunctions flattened; one predicate as itself (an ``and_matcher``
    needs two or more)."""
    flat = [part for predicate in predicates for part in _and_parts(predicate)]
    if len(flat) == 1:
        return flat[0]
    return Predicate(and_matcher=MatcherMatcherListPredicatePredicateList(predicate=flat))


def _and_parts(predicate: Predicate) -> list[Predicate]:
    inner = predicate.and_matcher
    return list(inner.predicate) if inner is not None else [predicate]


def any_of(predicates: Sequence[Predicate]) -> Predicate:
    """The disjunction; one predicate as itself."""
    if len(predicates) == 1:
        return predicates[0]
    return Predicate(or_matcher=MatcherMatcherListPredicatePredicateList(predicate=list(predicates)))


def negate(predicate: Predicate) -> Predicate:
    return Predicate(not_matcher=predicate)


# ---------------------------------------------------------------- buckets and the filter


@dataclass(frozen=True, slots=True)
class BucketValue:
    """One bucket id value: a constant, a request header's or query parameter's value, or the
    client address."""

    constant: str | None = None
    header: str | None = None
    source_ip: bool = False
    query: str | None = None

    def builder(self) -> RateLimitQuotaBucketSettingsBucketIdBuilderValueBuilder:
        if self.constant is not None:
            return RateLimitQuotaBucketSettingsBucketIdBuilderValueBuilder(string_value=self.constant)
        if self.header is not None:
            return custom_value("request-header", header_value_input(self.header))
        if self.query is not None:
            return custom_value("query-param", query_value_input(self.query))
        return custom_value("source-ip", SourceIpInput())


def custom_value(name: str, message: betterproto2.Message) -> RateLimitQuotaBucketSettingsBucketIdBuilderValueBuilder:
    """A bucket id value read from the request by an ``envoy.matching.http.input`` extension."""
    config = EnvoyTypedConfig(name=name, typed_config=AnyMessage.pack(message))
    return RateLimitQuotaBucketSettingsBucketIdBuilderValueBuilder(custom_value=config)


def strategy(fallback: Fallback) -> RateLimitStrategy:
    """A blanket rule, never a token bucket: Envoy 1.40 crashes on the second request of a
    bucket whose ``no_assignment_behavior`` is a token bucket (see :func:`token_bucket_fallbacks`)."""
    return RateLimitStrategy(blanket_rule=_BLANKET[fallback])


def bucket_settings(
    domain: str, entries: Sequence[tuple[str, BucketValue]], fallback: Fallback
) -> RateLimitQuotaBucketSettings:
    """The action of one matcher: the bucket id of the descriptor, and what to do without the sidecar."""
    fields = {DOMAIN_KEY: BucketValue(constant=domain).builder()}
    for index, (key, value) in enumerate(entries):
        fields[entry_field(index, key)] = value.builder()
    return RateLimitQuotaBucketSettings(
        bucket_id_builder=RateLimitQuotaBucketSettingsBucketIdBuilder(bucket_id_builder=fields),
        reporting_interval=datetime.timedelta(seconds=REPORTING_SECONDS),
        deny_response_settings=RateLimitQuotaBucketSettingsDenyResponseSettings(
            http_status=HttpStatus(code=StatusCode.TooManyRequests)
        ),
        no_assignment_behavior=RateLimitQuotaBucketSettingsNoAssignmentBehavior(fallback_rate_limit=strategy(fallback)),
        expired_assignment_behavior=RateLimitQuotaBucketSettingsExpiredAssignmentBehavior(
            expired_assignment_behavior_timeout=datetime.timedelta(seconds=EXPIRED_FALLBACK_SECONDS),
            fallback_rate_limit=strategy(fallback),
        ),
    )


def field_matcher(predicate: Predicate, settings: RateLimitQuotaBucketSettings) -> MatcherMatcherListFieldMatcher:
    action = TypedExtensionConfig(name="bucket", typed_config=AnyMessage.pack(settings))
    return MatcherMatcherListFieldMatcher(predicate=predicate, on_match=MatcherOnMatch(action=action))


def matcher_list(matchers: Sequence[MatcherMatcherListFieldMatcher]) -> Matcher:
    """First matching entry wins; a request matching none has no bucket and passes."""
    return Matcher(matcher_list=MatcherMatcherList(matchers=list(matchers)))


def conditional_matcher(conditions: Sequence[Predicate], settings: RateLimitQuotaBucketSettings) -> Matcher:
    """Every request in the bucket when ``conditions`` hold (all of them): with none, the
    bucket is the matcher's ``on_no_match`` and nothing is tested per request."""
    if conditions:
        return matcher_list([field_matcher(all_of(conditions), settings)])
    action = TypedExtensionConfig(name="bucket", typed_config=AnyMessage.pack(settings))
    return Matcher(on_no_match=MatcherOnMatch(action=action))


def quota_filter(name: str, domain: str, cluster: str, matcher: Matcher) -> HttpFilter:
    """One ``rate_limit_quota`` filter: its buckets (``matcher``) and the stream to the sidecar
    through ``cluster``."""
    config = RateLimitQuotaFilterConfig(
        rlqs_server=GrpcService(envoy_grpc=GrpcServiceEnvoyGrpc(cluster_name=cluster)),
        domain=domain,
        bucket_matchers=matcher,
    )
    return HttpFilter(name=name, typed_config=AnyMessage.pack(config))


def as_yaml_dict(message: betterproto2.Message) -> dict[str, Any]:
    """The message as Envoy's YAML reads it: proto field names, durations as ``"5s"``, ``"@type"``."""
    return message.to_dict(casing=betterproto2.Casing.SNAKE)


# ---------------------------------------------------------------- the crash check

_TOKEN_BUCKET = re.compile(r"tokenBucket|token_bucket")


def token_bucket_fallbacks(value: Any, path: str = "") -> list[str]:
    """Where, inside one filter's ``typed_config`` (plain YAML data), a bucket's
    ``no_assignment_behavior`` is a token bucket: Envoy 1.40 segfaults on the second request
    of such a bucket, so a config holding one is refused."""
    found: list[str] = []
    if isinstance(value, Mapping):
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            if key in ("no_assignment_behavior", "noAssignmentBehavior") and _has_token_bucket(item):
                found.append(where)
            else:
                found.extend(token_bucket_fallbacks(item, where))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found.extend(token_bucket_fallbacks(item, f"{path}[{index}]"))
    return found


def _has_token_bucket(behavior: Any) -> bool:
    if not isinstance(behavior, Mapping):
        return False
    strategy_config = behavior.get("fallback_rate_limit") or behavior.get("fallbackRateLimit") or {}
    return isinstance(strategy_config, Mapping) and any(_TOKEN_BUCKET.fullmatch(str(key)) for key in strategy_config)
