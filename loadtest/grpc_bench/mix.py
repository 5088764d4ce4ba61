"""The request mix: Envoy-like requests for the ``demo`` domain of ``examples/config/demo.yaml``."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sidecar.protos.envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from sidecar.protos.envoy.service.ratelimit.v3 import rls_pb2

REPO = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = REPO / "examples" / "config"
DOMAIN = "demo"
PATTERNS = ("under", "over", "mixed")


# ---------------------------------------------------------------------------------
# Request mix: Envoy-like requests for the "demo" domain of examples/config/demo.yaml
# ---------------------------------------------------------------------------------

Descriptor = list[tuple[str, str]]
Kind = Callable[[random.Random, str], list[Descriptor]]


def _ip(rng: random.Random) -> str:
    """One of ~16M client addresses: each is seen rarely, so it stays under 20/s."""
    return f"10.{rng.randrange(256)}.{rng.randrange(256)}.{rng.randrange(1, 255)}"


def _key(rng: random.Random, salt: str) -> str:
    """An API key unique to this run (``salt``), so earlier runs' counters do not leak in."""
    return f"k{salt}-{rng.randrange(1_000_000_000)}"


def page(rng: random.Random, salt: str) -> list[Descriptor]:
    """Any route: the client address (20/s per address)."""
    return [[("remote_address", _ip(rng))]]


def hot_page(rng: random.Random, salt: str) -> list[Descriptor]:
    """A handful of noisy addresses: over 20/s each at any real load."""
    return [[("remote_address", f"192.0.2.{rng.randrange(1, 5)}")]]


def api(rng: random.Random, salt: str) -> list[Descriptor]:
    """/api with an ordinary key: address, route-wide cap (50/s shared), key (10/min)."""
    return [
        [("remote_address", _ip(rng))],
        [("generic_key", "api")],
        [("generic_key", "api"), ("api_key", _key(rng, salt))],
    ]


def api_premium(rng: random.Random, salt: str) -> list[Descriptor]:
    """/api with a premium key (100/min), which replaces the route-wide cap."""
    return [
        [("remote_address", _ip(rng))],
        [("generic_key", "api")],
        [("generic_key", "api"), ("api_key", "premium-" + _key(rng, salt))],
    ]


def api_monitoring(rng: random.Random, salt: str) -> list[Descriptor]:
    """/api with the unlimited monitoring key; the route-wide cap still applies."""
    return [
        [("generic_key", "api")],
        [("generic_key", "api"), ("api_key", "internal-monitoring")],
    ]


def write(rng: random.Random, salt: str) -> list[Descriptor]:
    """A write: address plus the global write cap (5/s)."""
    return [[("remote_address", _ip(rng))], [("header_match", "write")]]


def login(rng: random.Random, salt: str) -> list[Descriptor]:
    """A login attempt: address, and the shadow-mode login limit (counted, never refused)."""
    address = _ip(rng)
    return [[("remote_address", address)], [("generic_key", "login"), ("remote_address", address)]]


def api_few_keys(rng: random.Random, salt: str) -> list[Descriptor]:
    """/api from four keys only: over 10/min per key and 50/s per route within a second."""
    return [
        [("remote_address", f"192.0.2.{rng.randrange(1, 5)}")],
        [("generic_key", "api")],
        [("generic_key", "api"), ("api_key", f"k{salt}-hot-{rng.randrange(4)}")],
    ]


MIXES: dict[str, list[tuple[Kind, int]]] = {
    # Every counter stays far below its limit: all OK.
    "under": [(page, 50), (api_premium, 35), (login, 15)],
    # Few distinct values: after the first hits of each window nearly all OVER_LIMIT.
    "over": [(hot_page, 30), (api_few_keys, 40), (write, 30)],
    # Realistic: most traffic under its limits, a few noisy sources and capped routes over.
    "mixed": [
        (page, 55),
        (hot_page, 3),
        (api_premium, 15),
        (api, 8),
        (login, 13),
        (write, 3),
        (api_monitoring, 3),
    ],
}


def build_request(descriptors: Sequence[Descriptor]) -> Any:
    """A ``RateLimitRequest`` for the demo domain, as Envoy's filter sends it."""
    entry = ratelimit_pb2.RateLimitDescriptor.Entry
    return rls_pb2.RateLimitRequest(
        domain=DOMAIN,
        descriptors=[
            ratelimit_pb2.RateLimitDescriptor(entries=[entry(key=k, value=v) for k, v in d]) for d in descriptors
        ],
    )


def request_pool(pattern: str, size: int, seed: int, salt: str) -> list[Any]:
    """``size`` requests of ``pattern``, in a random order fixed by ``seed``."""
    rng = random.Random(seed)
    kinds = [kind for kind, _ in MIXES[pattern]]
    weights = [weight for _, weight in MIXES[pattern]]
    return [build_request(kind(rng, salt)) for kind in rng.choices(kinds, weights=weights, k=size)]
