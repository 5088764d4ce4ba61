"""Read the sidecars' Redis counters before they expire, and map them back to descriptors.

A window key lives until ``window end + 5 s`` (``sidecar.limiter.redis.keys``), so reading
only after the sidecars stop would miss the early windows of a run. The harness
polls every ``POLL_INTERVAL`` seconds (SCAN + MGET of ``<prefix>:*`` keys) while the
traffic runs, once more after the sidecars have exited, and keeps the largest value
seen per key: counters only grow, so that is the final count.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

POLL_INTERVAL = 2.0
COUNTER_KEY = re.compile(r"^(?P<prefix>[^:]+):\{(?P<digest>[^}]*)\}:(?P<start>\d+)$")
OWN_COMMANDS = ("scan", "mget", "info", "flushall", "config|resetstat", "ping")
"""Commands the harness itself sends; left out of the commandstats fallback."""


@dataclass
class CounterWatch:
    """Largest value seen per counter key of one run."""

    client: Any
    prefix: str = "rls"
    values: dict[str, int] = field(default_factory=dict)
    polls: int = 0
    poll_seconds: float = 0.0
    last_poll: float = 0.0

    def poll(self) -> None:
        started = time.monotonic()
        batch: list[str] = []
        for key in self.client.scan_iter(match=f"{self.prefix}:*", count=5000):
            if COUNTER_KEY.match(key):
                batch.append(key)
            if len(batch) >= 2000:
                self._read(batch)
                batch = []
        if batch:
            self._read(batch)
        self.polls += 1
        self.last_poll = time.monotonic()
        self.poll_seconds += self.last_poll - started

    def poll_if_due(self) -> None:
        if time.monotonic() - self.last_poll >= POLL_INTERVAL:
            self.poll()

    def _read(self, keys: Sequence[str]) -> None:
        for key, raw in zip(keys, self.client.mget(keys), strict=True):
            if raw is None:
                continue
            try:
                value = int(raw)
            except ValueError:
                continue
            if value > self.values.get(key, -1):
                self.values[key] = value


def command_calls(client: Any) -> dict[str, int]:
    """Calls per command from ``INFO commandstats`` (``cmdstat_evalsha`` -> ``evalsha``)."""
    stats = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(entry["calls"]) for name, entry in stats.items()}


def digest_map(config_dir: Path, key: str, values: Sequence[str]) -> dict[str, int]:
    """Counter digest -> value index, computed with the sidecar's own matcher and key code.

    Returns an empty map if the sidecar's internals cannot be imported.
    """
    try:
        from sidecar.config import load_config
        from sidecar.config.match import match_descriptor
        from sidecar.limiter.redis.keys import counter_digest
        from sidecar.protos.envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
    except ImportError:
        return {}
    config = load_config(str(config_dir))
    domain = next(iter(config.domains.values()))
    mapping: dict[str, int] = {}
    for index, value in enumerate(values):
        entry = ratelimit_pb2.RateLimitDescriptor.Entry(key=key, value=value)
        match = match_descriptor(domain, [entry])
        if match is None:
            continue
        mapping[counter_digest(tuple(match.key))] = index
    return mapping


def parse_key(key: str) -> tuple[str, int] | None:
    """``(digest, window_start)`` of a counter key, or None for other keys."""
    found = COUNTER_KEY.match(key)
    if found is None:
        return None
    return found["digest"], int(found["start"])
