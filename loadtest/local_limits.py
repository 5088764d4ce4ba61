"""The two in-process baselines of ``python -m loadtest.quota_paths``: Envoy's own
``local_ratelimit`` filter, with no sidecar, on the bench's config.

``local``             (b): one token bucket for every request. Envoy builds no descriptor
                      and consumes one shared bucket: less work than quota mode does, which
                      builds a bucket id from the client address on every request.
``local-per-client``  (b'): the same limit as quota mode's, a bucket per client address.
                      The filter's own ``rate_limits`` (a ``remote_address`` action) build the
                      descriptor ``remote_address=<client>`` on every request; the configured
                      descriptor ``remote_address`` with an empty value is a wildcard, so Envoy
                      (1.40) keeps one token bucket per distinct value, created on
                      the first request of a client and held in an LRU of
                      ``max_dynamic_descriptors``. Only that bucket is consumed
                      (``always_consume_default_token_bucket: false``), as quota mode consumes
                      only the client's bucket. This is the like-for-like baseline for (c).

Both admit everything at the bench's load (``LIMIT`` tokens a second); a smaller ``limit``
is for tests that watch the buckets refuse.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stack.envoy import ingress_manager

LIMIT = 1_000_000_000
"""Tokens a second of every bucket: far above any load the bench can send."""
MAX_CLIENTS = 10_000
"""``max_dynamic_descriptors``: client buckets Envoy keeps (least recently used evicted). The
bench has one client address; Envoy's default (20) would serve it too, but a real per-client
limit needs room for every client, so the baseline says so."""
LOCAL_RATELIMIT = "envoy.filters.http.local_ratelimit"
_TYPE = "type.googleapis.com/envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit"
_ALWAYS = {"default_value": {"numerator": 100, "denominator": "HUNDRED"}}


def token_bucket(limit: int, fill_interval: str = "1s") -> dict[str, Any]:
    """A bucket of ``limit`` tokens, refilled to ``limit`` every ``fill_interval``."""
    return {"max_tokens": limit, "tokens_per_fill": limit, "fill_interval": fill_interval}


def local_ratelimit(config: dict[str, Any], template: Path, limit: int = LIMIT) -> dict[str, Any]:
    """(b): ``config`` with ``local_ratelimit`` before the router, one bucket of ``limit`` tokens a second."""
    return _insert(config, template, {"stat_prefix": "bench", "token_bucket": token_bucket(limit)})


def local_per_client(
    config: dict[str, Any], template: Path, limit: int = LIMIT, fill_interval: str = "1s"
) -> dict[str, Any]:
    """(b'): ``config`` with ``local_ratelimit`` before the router, a bucket of ``limit`` tokens
    per ``fill_interval`` per client address (see the module's docstring)."""
    typed = {
        "stat_prefix": "bench",
        # Consumed only by a request whose descriptor matches nothing (none here: every
        # request has a client address); kept at the limit so it never refuses.
        "token_bucket": token_bucket(limit, fill_interval),
        "rate_limits": [{"actions": [{"remote_address": {}}]}],
        "descriptors": [{"entries": [{"key": "remote_address"}], "token_bucket": token_bucket(limit, fill_interval)}],
        "max_dynamic_descriptors": MAX_CLIENTS,
        "always_consume_default_token_bucket": False,
    }
    return _insert(config, template, typed)


def _insert(config: dict[str, Any], template: Path, typed: dict[str, Any]) -> dict[str, Any]:
    """``config`` with a ``local_ratelimit`` filter of ``typed`` (enabled and enforced for every
    request) just before the router."""
    limiter = {
        "name": LOCAL_RATELIMIT,
        "typed_config": {"@type": _TYPE, **typed, "filter_enabled": _ALWAYS, "filter_enforced": _ALWAYS},
    }
    chain = ingress_manager(config, template)["http_filters"]
    chain.insert(len(chain) - 1, limiter)
    return config
