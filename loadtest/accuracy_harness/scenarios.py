"""Traffic shapes: what each scenario sends, to which replica, and when.

All times are offsets from the run's start, which the harness puts on a window
boundary (per-second scenarios) so every window of the run is complete. Schedules
are deterministic for a seed: the same command line sends the same pattern.
"""

from __future__ import annotations

import itertools
import math
import random
from array import array
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

DOMAIN = "accuracy"
SECOND_KEY = "client"
MINUTE_KEY = "client_minute"
HOUR_KEY = "client_hour"
ENVOY_TIMEOUT = 0.025
"""Envoy's rate-limit filter ``timeout`` in ``envoy/sidecar.yaml``: the deadline of its calls."""
WARMUP_VALUE = "warmup"
"""Warm-up calls use this value with ``hits_addend`` 0: they take the whole decision path
(Redis included) but create no counter."""
BURST_DELAY = 0.001
"""Bursts go out this long after the window boundary, so no replica's clock puts them before it."""
UNIT_SECONDS = {"second": 1, "minute": 60, "hour": 3600}
FIXED_WINDOW, SLIDING_WINDOW, TOKEN_BUCKET = "fixed_window", "sliding_window", "token_bucket"
ALL_MODES = ("local", "sync", "strict")
UNSUPPORTED = {
    (TOKEN_BUCKET, "sync"): "not measured: sync mode refuses algorithm token_bucket at config load",
}
"""(algorithm, mode) pairs the sidecar does not offer, with the note the report prints."""


@dataclass(frozen=True)
class Phase:
    """Part of a ``phases`` cycle: from ``start`` to ``end`` (seconds into the cycle), ``demand``
    x the limit per second (per value; a token bucket's limit is its refill rate), evenly spaced."""

    start: float
    end: float
    demand: float


@dataclass(frozen=True)
class Scenario:
    """One traffic pattern; every rate is derived from these fields."""

    name: str
    description: str
    pattern: str
    """``steady`` (open loop, evenly spaced), ``burst`` (all at the window start), ``phases``
    (a cycle of :class:`Phase` repeated over ``duration``) or ``closed``."""
    unit: str
    limit: int
    """Requests per unit, per descriptor value (key-only rule: each value has its own counter)."""
    keys: int
    """Distinct descriptor values."""
    demand: float
    """Offered hits per value and window as a multiple of the limit (steady, burst)."""
    shares: str
    """``balanced`` (1/R each) or ``skewed`` (replica 0 gets 90 %)."""
    duration: float
    """Seconds of traffic (steady, closed) or windows x unit (burst)."""
    key_choice: str = "cycle"
    """``cycle`` (each replica rotates over the values) or ``zipf`` (random, weight 1/rank^s)."""
    zipf_s: float = 1.0
    total_rate: float = 0.0
    """If set, requests/s over all values and replicas instead of ``demand x limit x keys``."""
    lanes: int = 64
    """Calls in flight per replica at most."""
    align: str = "window"
    """``window``: start on a window boundary; ``minute-fit``: start now if the run fits in the
    current minute, else at the next minute (quick long-window run); ``minute``: at the next minute."""
    algorithm: str = FIXED_WINDOW
    """``algorithm:`` of the rule under test (the scenario's own per-second or per-minute rule)."""
    burst: int = 0
    """``burst:`` of a token bucket (its size); ``limit`` is then the refill rate per unit."""
    phases: tuple[Phase, ...] = ()
    cycle: float = 0.0
    """Seconds of one repetition of ``phases``."""
    replicas: int = 0
    """Sidecars of this scenario whatever ``--replicas`` says (0: ``--replicas``)."""
    call_timeout: float = 0.0
    """The gRPC deadline of each call unless ``--timeout`` is given (0: 2 s); Envoy's filter
    sends its ``timeout`` (25 ms in ``envoy/sidecar.yaml``) as the deadline."""
    sidecar_cpus: tuple[int, ...] = ()
    """Pin the sidecars to these cpus (redis-server and the load generators stay off them)."""
    hogs: int = 0
    """CPU-bound busy-loop processes pinned to ``sidecar_cpus`` during the traffic."""
    overload: str = ""
    """``overload:`` of the rule under test (``suppress``; empty: not set, the plain window)."""

    @property
    def modes(self) -> tuple[str, ...]:
        """The modes that offer this scenario's algorithm."""
        return tuple(mode for mode in ALL_MODES if (self.algorithm, mode) not in UNSUPPORTED)

    def unsupported(self, mode: str) -> str | None:
        """Why ``mode`` cannot run this scenario (None when it can)."""
        return UNSUPPORTED.get((self.algorithm, mode))

    @property
    def unit_seconds(self) -> int:
        return UNIT_SECONDS[self.unit]

    @property
    def descriptor_key(self) -> str:
        return {"second": SECOND_KEY, "minute": MINUTE_KEY}.get(self.unit, HOUR_KEY)

    @property
    def span(self) -> float:
        """Seconds over which ``demand`` is spread for one window (a minute rule in a short run:
        the run's length, so the limit is still crossed when demand > 1)."""
        return min(float(self.unit_seconds), self.duration)

    @property
    def rate(self) -> float:
        """Offered requests/s, all replicas together (0 for closed loop: as fast as answered)."""
        if self.pattern == "closed":
            return 0.0
        if self.pattern == "phases":
            offered = sum((phase.end - phase.start) * phase.demand for phase in self.phases)
            return offered * self.limit * self.keys / self.unit_seconds / self.cycle
        if self.total_rate:
            return self.total_rate
        return self.demand * self.limit * self.keys / self.span

    def replica_shares(self, replicas: int) -> list[float]:
        if self.shares == "skewed" and replicas > 1:
            return [0.9] + [0.1 / (replicas - 1)] * (replicas - 1)
        return [1.0 / replicas] * replicas

    def describe(self, replicas: int) -> dict[str, Any]:
        facts = asdict(self)
        facts["rate_total_per_s"] = round(self.rate, 1)
        facts["rate_per_replica_per_s"] = [round(self.rate * share, 1) for share in self.replica_shares(replicas)]
        if self.pattern == "closed":
            facts["planned_calls"] = None
        else:
            facts["planned_calls"] = sum(len(offsets) for offsets, _ in self.schedules(replicas, seed=0))
        return facts

    def values(self, salt: str) -> list[str]:
        """The descriptor values of this run; ``salt`` keeps runs and modes apart."""
        return [f"{self.name}.{salt}.{index}" for index in range(self.keys)]

    def schedules(self, replicas: int, seed: int) -> list[tuple[array[float], array[int]]]:
        """Per replica: send offsets (seconds from the start) and descriptor value indices."""
        rng = random.Random(f"{self.name}:{seed}")
        shares = self.replica_shares(replicas)
        result = []
        for replica, share in enumerate(shares):
            if self.pattern == "burst":
                offsets = self._burst_offsets(share)
            elif self.pattern == "steady":
                offsets = self._steady_offsets(self.rate * share, rng)
            elif self.pattern == "phases":
                offsets = self._phase_offsets(share, rng)
            else:
                offsets = array("d")
            result.append((offsets, self._values_for(len(offsets), replica, rng)))
        return result

    def _steady_offsets(self, rate: float, rng: random.Random) -> array[float]:
        if rate <= 0:
            return array("d")
        interval = 1.0 / rate
        phase = rng.random() * interval
        count = max(0, math.ceil((self.duration - phase) / interval))
        return array("d", (phase + k * interval for k in range(count)))

    def _phase_offsets(self, share: float, rng: random.Random) -> array[float]:
        """Every cycle's phases, each evenly spaced at its rate with a random phase."""
        offsets: list[float] = []
        cycles = max(1, round(self.duration / self.cycle))
        for number in range(cycles):
            base = number * self.cycle
            for phase in self.phases:
                rate = phase.demand * self.limit * self.keys / self.unit_seconds * share
                if rate <= 0:
                    continue
                interval = 1.0 / rate
                first = base + phase.start + rng.random() * interval
                count = max(0, math.ceil((base + phase.end - first) / interval))
                offsets += [first + k * interval for k in range(count)]
        return array("d", sorted(offsets))

    def _burst_offsets(self, share: float) -> array[float]:
        windows = max(1, round(self.duration / self.unit_seconds))
        per_window = round(self.demand * self.limit * self.keys * share)
        return array(
            "d",
            itertools.chain.from_iterable([w * self.unit_seconds + BURST_DELAY] * per_window for w in range(windows)),
        )

    def _values_for(self, count: int, replica: int, rng: random.Random) -> array[int]:
        if self.key_choice == "zipf":
            weights = list(itertools.accumulate(1.0 / (rank + 1) ** self.zipf_s for rank in range(self.keys)))
            return array("i", rng.choices(range(self.keys), cum_weights=weights, k=count))
        return array("i", ((k + replica) % self.keys for k in range(count)))


def catalogue(quick: bool, limit: int | None = None, windows: int | None = None) -> dict[str, Scenario]:
    """Every scenario with its quick or full parameters; ``limit``/``windows`` override the
    main per-second limit (balanced, skewed, burst) and the number of 1 s windows."""
    main_limit = limit or (100 if quick else 400)
    n = windows or (3 if quick else 15)
    seconds = float(n)
    scenarios = [
        Scenario(
            "balanced_0.5x",
            "steady, evenly over the replicas, half the limit: nothing may be refused",
            "steady",
            "second",
            main_limit,
            1,
            0.5,
            "balanced",
            seconds,
        ),
        Scenario(
            "balanced_5x",
            "steady, evenly over the replicas, 5x the limit",
            "steady",
            "second",
            main_limit,
            1,
            5.0,
            "balanced",
            seconds,
        ),
        Scenario(
            "skewed_5x",
            "steady, 5x the limit, replica 0 gets 90 % of the traffic",
            "steady",
            "second",
            main_limit,
            1,
            5.0,
            "skewed",
            seconds,
        ),
        Scenario(
            "burst",
            "3x the limit fired by every replica at once, 1 ms after each window boundary",
            "burst",
            "second",
            main_limit,
            1,
            3.0,
            "balanced",
            seconds,
        ),
        Scenario(
            "many_keys",
            "10,000 values of the key-only rule at 5/s each, Zipf(1.0) popularity (a few hot values over "
            "the limit, a long tail far under it), spread over the replicas",
            "steady",
            "second",
            5,
            10_000,
            0.0,
            "balanced",
            seconds,
            key_choice="zipf",
            total_rate=500.0 if quick else 1000.0,
        ),
        Scenario(
            "low_limit",
            f"5 per second per value, {20 if quick else 40} values, 5x the limit, evenly over the replicas",
            "steady",
            "second",
            5,
            20 if quick else 40,
            5.0,
            "balanced",
            seconds,
        ),
        Scenario(
            "long_window",
            (
                "per-minute rule, 2x the limit over the run: the limit is crossed half-way through "
                + ("a 6 s run inside one minute window (demand scaled to the run)" if quick else "one full minute")
            ),
            "steady",
            "minute",
            120 if quick else 600,
            4,
            2.0,
            "balanced",
            6.0 if quick else 60.0,
            align="minute-fit" if quick else "minute",
        ),
        Scenario(
            "throughput",
            "closed loop, every replica as fast as it answers, 1,000 values far under a 10,000/s limit",
            "closed",
            "second",
            10_000,
            1_000,
            0.0,
            "balanced",
            3.0 if quick else 10.0,
            lanes=32,
        ),
        *algorithm_scenarios(quick, limit, windows),
        *pressure_scenarios(quick, limit, windows),
    ]
    return {scenario.name: scenario for scenario in scenarios}


SLIDING_BOUNDARY_PHASES = (
    Phase(1.8, 2.0, 7.5),
    Phase(2.0, 2.2, 7.5),
    Phase(2.2, 3.0, 2.0),
)
"""A quiet second, 1.5x the limit in the last 200 ms of the next one and 1.5x in the first 200 ms
after the boundary (where fixed windows admit 2x the limit within 400 ms), then 2x steady to the
end of that window (after a burst at the end of a window the estimate, which assumes the previous
window's hits were spread evenly, lets the flood in early: the case HAProxy's estimate shares)."""
TOKEN_BUCKET_BURST = 40
TOKEN_BUCKET_PHASES = (Phase(0.0, 0.1, 8.0), Phase(0.1, 1.0, 2.0))
"""Per 2 s cycle: twice the bucket in 100 ms on a full bucket, then 2x the refill rate for 0.9 s,
then a quiet second in which the bucket fills up again."""


def algorithm_scenarios(quick: bool, limit: int | None = None, windows: int | None = None) -> list[Scenario]:
    """The scenarios of ``algorithm: sliding_window`` and ``token_bucket`` (limit 100/s quick, 400/s full;
    ``limit``/``windows`` override it and the length of the steady run)."""
    main_limit = limit or (100 if quick else 400)
    n = windows or (3 if quick else 15)
    cycles = 1 if quick else 5
    return [
        Scenario(
            "sliding_steady",
            "sliding_window, steady, evenly over the replicas, 3x the limit",
            "steady",
            "second",
            main_limit,
            1,
            3.0,
            "balanced",
            float(n),
            algorithm=SLIDING_WINDOW,
        ),
        Scenario(
            "sliding_boundary",
            "sliding_window, per 3 s: quiet, 1.5x the limit in the 200 ms before a window boundary and 1.5x in "
            "the 200 ms after it, then 2x to the end of that window; evenly over the replicas",
            "phases",
            "second",
            main_limit,
            1,
            0.0,
            "balanced",
            3.0 * cycles,
            algorithm=SLIDING_WINDOW,
            phases=SLIDING_BOUNDARY_PHASES,
            cycle=3.0,
        ),
        Scenario(
            "token_bucket",
            f"token_bucket (refill {main_limit}/s, burst {TOKEN_BUCKET_BURST * main_limit // 100}), per 2 s: twice "
            "the bucket in 100 ms, 2x the refill rate for 0.9 s, a quiet second; evenly over the replicas",
            "phases",
            "second",
            main_limit,
            1,
            0.0,
            "balanced",
            2.0 * (2 if quick else 6),
            algorithm=TOKEN_BUCKET,
            burst=TOKEN_BUCKET_BURST * main_limit // 100,
            phases=TOKEN_BUCKET_PHASES,
            cycle=2.0,
        ),
    ]


def pressure_scenarios(quick: bool, limit: int | None = None, windows: int | None = None) -> list[Scenario]:
    """Issue 17, at default settings: a burst on a low hourly limit (the issue's table) and
    steady load while a CPU-bound process shares the sidecars' core (Redis healthy)."""
    main_limit = limit or (100 if quick else 400)
    n = windows or (3 if quick else 15)
    return [
        Scenario(
            "burst_hour",
            "issue 17's burst: limit 20/hour, 3 replicas, 300 requests at once with 96 in flight across the "
            f"replicas, each call with Envoy's {ENVOY_TIMEOUT * 1000:g} ms deadline",
            "burst",
            "hour",
            20,
            1,
            15.0,
            "balanced",
            2.0,
            lanes=32,
            align="fit",
            replicas=3,
            call_timeout=ENVOY_TIMEOUT,
        ),
        Scenario(
            "cpu_pressure",
            "steady, evenly over 3 replicas, 5x the limit, the sidecars pinned to cpu 0 with a CPU-bound busy "
            "loop; redis-server and the load generator on cpu 1",
            "steady",
            "second",
            main_limit,
            1,
            5.0,
            "balanced",
            float(n),
            replicas=3,
            sidecar_cpus=(0,),
            hogs=1,
        ),
    ]


def config_yaml(scenario: Scenario) -> str:
    """The descriptor config of one run: a key-only rule per second, one per minute, one per hour."""
    second_limit = scenario.limit if scenario.unit == "second" else 1_000
    minute_limit = scenario.limit if scenario.unit == "minute" else 600
    hour_limit = scenario.limit if scenario.unit == "hour" else 10_000
    extra = ""
    if scenario.algorithm != FIXED_WINDOW:
        extra = f", algorithm: {scenario.algorithm}"
    if scenario.algorithm == TOKEN_BUCKET:
        extra += f", burst: {scenario.burst}"
    if scenario.overload:
        extra += f", overload: {scenario.overload}"
    second_extra = extra if scenario.unit == "second" else ""
    minute_extra = extra if scenario.unit == "minute" else ""
    return (
        f"# generated by loadtest/accuracy.py for scenario {scenario.name}\n"
        f"domain: {DOMAIN}\n"
        "descriptors:\n"
        f"  - key: {SECOND_KEY}\n"
        f"    rate_limit: {{unit: second, requests_per_unit: {second_limit}{second_extra}}}\n"
        f"  - key: {MINUTE_KEY}\n"
        f"    rate_limit: {{unit: minute, requests_per_unit: {minute_limit}{minute_extra}}}\n"
        f"  - key: {HOUR_KEY}\n"
        f"    rate_limit: {{unit: hour, requests_per_unit: {hour_limit}}}\n"
    )


def payloads(key: str, values: Sequence[str], check_only: bool = False) -> tuple[bytes, ...]:
    """Serialized ``RateLimitRequest`` per value: one descriptor ``[(key, value)]``.

    ``check_only`` sets the descriptor's ``hits_addend`` to 0: the request goes through
    the rule and the backend (a Redis round trip in strict mode) but spends no hit.
    """
    from google.protobuf import wrappers_pb2

    from sidecar.protos.envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
    from sidecar.protos.envoy.service.ratelimit.v3 import rls_pb2

    entry = ratelimit_pb2.RateLimitDescriptor.Entry
    extra = {"hits_addend": wrappers_pb2.UInt64Value(value=0)} if check_only else {}
    return tuple(
        rls_pb2.RateLimitRequest(
            domain=DOMAIN,
            descriptors=[ratelimit_pb2.RateLimitDescriptor(entries=[entry(key=key, value=value)], **extra)],
        ).SerializeToString()
        for value in values
    )
