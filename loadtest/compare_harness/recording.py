"""The recorded traffic pattern: a deterministic schedule of (send time, client, path, headers).

Generated from a seed, saved into the results JSON and replayed identically on every path.
Offsets count from the recording's second 0, which the replay puts on a wall-clock second
boundary, so the windows of the recording are the clock seconds every limiter uses.

Every client (an address in ``X-Forwarded-For``; ``GET /compare/...`` takes the catch-all
route, whose only descriptor is the client address, limited to ``limit`` per second):

* ``steady``: ``steady_factor`` x the limit, evenly spaced with a random phase and jitter,
  over ``[0, boundary - 1)`` and ``[boundary + burst_span, duration)``; the first request at most
  :data:`FIRST_OFFSET` after second 0 (so HAProxy's sliding periods start on a clock second);
* quiet over ``[boundary - 1, boundary - burst_span)``, so the burst finds that window empty;
* ``burst``: ``burst_factor`` x the limit in the last ``burst_span`` seconds before the
  boundary and as many again in the first ``burst_span`` seconds after it. An exact fixed
  window admits ``limit`` on each side: twice the limit within ``2 x burst_span`` seconds.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

STEADY = "steady"
BURST = "burst"
MIN_DURATION = 3.0
"""One steady second, the quiet second with the burst's first half, and one second after the boundary."""
FIRST_OFFSET = 0.0002
"""Each client's first request goes out at most this long after second 0 (and never before it:
``client.PRECISE_UNTIL``). HAProxy starts a counter's sliding periods at its first hit, in whole
milliseconds with the low bit cleared (``freq_ctr.h``), so a first hit read in [0, 2) ms puts its
periods on the clock seconds the sidecar's windows use, and the two sliding estimates can be compared."""


def client_address(index: int) -> str:
    """Client ``index``'s address (documentation range 203.0.113.0/24)."""
    return f"203.0.113.{10 + index}"


@dataclass(frozen=True, slots=True)
class Planned:
    """One request of the recording."""

    offset: float
    """Seconds after the recording's second 0."""
    client: int
    path: str
    headers: tuple[tuple[str, str], ...]

    @property
    def phase(self) -> str:
        return self.path.rsplit("/", 1)[-1]

    def head(self, host: str) -> bytes:
        """The HTTP/1.1 request head, as sent."""
        lines = [f"GET {self.path} HTTP/1.1", f"Host: {host}"]
        lines += [f"{name}: {value}" for name, value in self.headers]
        return ("\r\n".join(lines) + "\r\n\r\n").encode()


@dataclass(frozen=True)
class Recording:
    """The schedule and the parameters it was generated from."""

    seed: int
    clients: int
    limit: int
    duration: float
    boundary: int
    """The second whose start the burst straddles."""
    steady_factor: float
    burst_factor: float
    burst_span: float
    requests: tuple[Planned, ...]

    @property
    def addresses(self) -> list[str]:
        return [client_address(index) for index in range(self.clients)]

    @property
    def seconds(self) -> int:
        """Windows (clock seconds) the recording covers."""
        return int(-(-self.duration // 1))

    def describe(self) -> str:
        per_client = len(self.requests) / max(1, self.clients)
        return (
            f"{self.clients} clients ({', '.join(self.addresses)}), limit {self.limit}/s each; "
            f"{self.steady_factor:g}x the limit steady over [0, {self.boundary - 1}) and "
            f"[{self.boundary + self.burst_span:g}, {self.duration:g}) s, quiet then a burst of "
            f"{self.burst_factor:g}x the limit in each {self.burst_span * 1000:.0f} ms on both sides of second "
            f"{self.boundary}; each client's first request {FIRST_OFFSET * 1000:g} ms after second 0; "
            f"{len(self.requests)} requests ({per_client:.0f} per client), seed {self.seed}"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "clients": self.clients,
            "addresses": self.addresses,
            "limit": self.limit,
            "duration": self.duration,
            "boundary": self.boundary,
            "steady_factor": self.steady_factor,
            "burst_factor": self.burst_factor,
            "burst_span": self.burst_span,
            "fields": ["offset_s", "client", "path", "headers"],
            "requests": [[round(item.offset, 6), item.client, item.path, dict(item.headers)] for item in self.requests],
        }

    @classmethod
    def from_json(cls, document: dict[str, Any]) -> Recording:
        requests = tuple(
            Planned(float(offset), int(client), str(path), tuple(headers.items()))
            for offset, client, path, headers in document["requests"]
        )
        return cls(
            seed=document["seed"],
            clients=document["clients"],
            limit=document["limit"],
            duration=document["duration"],
            boundary=document["boundary"],
            steady_factor=document["steady_factor"],
            burst_factor=document["burst_factor"],
            burst_span=document["burst_span"],
            requests=requests,
        )


def _spaced(rng: random.Random, start: float, end: float, count: int) -> list[float]:
    """``count`` times evenly spaced over ``[start, end)`` with a random phase and +-20 % jitter."""
    if count <= 0 or end <= start:
        return []
    interval = (end - start) / count
    phase = rng.uniform(0, interval)
    times = []
    for index in range(count):
        jitter = rng.uniform(-0.2, 0.2) * interval
        times.append(min(end - 1e-4, max(start, start + phase + index * interval + jitter)))
    return times


def record(
    seed: int,
    *,
    clients: int = 4,
    limit: int = 20,
    duration: float = 10.0,
    steady_factor: float = 2.0,
    burst_factor: float = 1.5,
    burst_span: float = 0.2,
) -> Recording:
    """The schedule for ``seed`` (the same arguments always give the same requests)."""
    if duration < MIN_DURATION:
        raise ValueError(f"duration must be at least {MIN_DURATION:g} s")
    if not 0 < burst_span <= 0.5:
        raise ValueError("burst_span must be in (0, 0.5]")
    rng = random.Random(seed)
    boundary = max(2, int(duration // 2))
    steady_rate = steady_factor * limit
    burst_count = round(burst_factor * limit)
    planned: list[Planned] = []
    for client in range(clients):
        headers = (("X-Forwarded-For", client_address(client)),)
        spans = [(0.0, boundary - 1.0), (boundary + burst_span, duration)]
        for start, end in spans:
            times = _spaced(rng, start, end, round((end - start) * steady_rate))
            if start == 0.0 and times:
                times[0] = min(times[0], FIRST_OFFSET)
            for offset in times:
                planned.append(Planned(offset, client, f"/compare/{STEADY}", headers))
        for start, end in ((boundary - burst_span, float(boundary)), (float(boundary), boundary + burst_span)):
            for offset in _spaced(rng, start, end, burst_count):
                planned.append(Planned(offset, client, f"/compare/{BURST}", headers))
    planned.sort(key=lambda item: (item.offset, item.client))
    return Recording(
        seed=seed,
        clients=clients,
        limit=limit,
        duration=duration,
        boundary=boundary,
        steady_factor=steady_factor,
        burst_factor=burst_factor,
        burst_span=burst_span,
        requests=tuple(planned),
    )
