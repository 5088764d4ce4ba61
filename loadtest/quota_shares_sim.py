"""Quota shares across replicas, simulated: Redis cost, convergence and the bound at 3 and 1,000 replicas.

Why: issue 16 asks that a replica's cost per report not grow with the number of replicas R,
and to show what breaks first as R grows. This runs the real :class:`QuotaLeases` (the
sync task's logic: due buckets, polls, pushes, leases, the fallback) of every replica on a
simulated clock, against a simulated Redis that runs ``share.lua``'s Python reference
(:func:`sidecar.quota.shares.step`, shown equal to the Lua by a test) and counts:

* ``script calls`` and ``round trips`` (one pipeline per replica sync);
* ``entry reads``: records a computation reads (O(R) each), the work that grows with R.

Each replica's Envoy is modelled per bucket: a token bucket with the pushed assignment
(refilled continuously, 1 s steps; a new assignment keeps the fill ratio, as Envoy 1.40
does), fed a constant demand, reporting allowed + denied every 5 s at its own phase.

Buckets are independent in Redis (their own keys, one slot each), so ``--buckets`` of them
are simulated and the per-second figures are also given scaled to ``--scale-buckets``
(10,000): costs add up linearly over buckets; nothing is shared between them.

Scenario per R: skewed demand (a tenth of the replicas, or one of 3, carry 80% of a load
of 1.5x the limit), then at ``--shift`` seconds the demand moves to other replicas.
Reported: Redis ops per second in steady state and after the shift, the time until the
shares are within 5% of the limit of the max-min targets of the new demand (convergence),
total admitted per second vs the limit after convergence, and the worst second against
the bound (limit + the sum of the replicas' bucket sizes).

    python -m loadtest.quota_shares_sim                      # R = 3 and 1,000, 10 buckets, 70 s simulated
    python -m loadtest.quota_shares_sim --replicas 3 100 1000 --buckets 4
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from loadtest.common import md_table
from sidecar.config.load import parse_text
from sidecar.config.match import match_descriptor
from sidecar.config.model import RateLimitRule
from sidecar.quota.assignments import Assignment, Kind
from sidecar.quota.buckets import BucketKey, DescriptorEntry, bucket_key, bucket_of
from sidecar.quota.leases import QuotaLeases
from sidecar.quota.redis_shares import SHARE, share_arguments, share_keys
from sidecar.quota.shape import HEADROOM
from sidecar.quota.shares import Bucket, Call, Reply, fair_shares, step
from sidecar.quota.stream import LiveBucket, Stream

REPORT = 5


class SimClock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class FakeRedis:
    """The buckets' state and what the calls cost."""

    clock: SimClock
    buckets: dict[str, Bucket] = field(default_factory=dict)
    calls: int = 0
    round_trips: int = 0
    entry_reads: int = 0
    computations: int = 0

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def run(self, calls: Sequence[tuple[list[str], Call]]) -> list[Reply]:
        self.round_trips += 1
        replies = []
        for keys, call in calls:
            bucket = self.buckets.setdefault(keys[0], Bucket())
            size = len(bucket.entries)
            reply = step(bucket, call, int(self.clock.now * 1000))
            self.calls += 1
            if reply.computed:
                self.computations += 1
                self.entry_reads += size + 1
            replies.append(reply)
        return replies

    def counts(self) -> tuple[int, int, int, int]:
        return self.calls, self.round_trips, self.entry_reads, self.computations


@dataclass
class EnvoyBucket:
    live: LiveBucket
    demand: float
    tokens: float = 0.0
    shape: tuple[int, int, int] = (0, 0, 1)
    allowed: int = 0
    denied: int = 0

    def second(self) -> int:
        """One second of this bucket in Envoy: apply a changed assignment, refill, admit."""
        assignment = self.live.assignment
        if assignment.kind is Kind.DENY_ALL:
            shape = (0, 0, 1)
        else:
            shape = (assignment.max_tokens, assignment.tokens_per_fill, assignment.fill_seconds)
        if shape != self.shape:
            ratio = self.tokens / self.shape[0] if self.shape[0] else 1.0
            self.tokens, self.shape = ratio * shape[0], shape
        size, fill, seconds = self.shape
        self.tokens = min(size, self.tokens + fill / seconds)
        admitted = min(int(self.demand), int(self.tokens))
        self.tokens -= admitted
        self.allowed += admitted
        self.denied += int(self.demand) - admitted
        return admitted


@dataclass
class Replica:
    leases: QuotaLeases
    stream: Stream
    phase: int
    envoys: dict[BucketKey, EnvoyBucket] = field(default_factory=dict)


def rule(limit: int) -> RateLimitRule:
    """A per-second limit of ``limit``, parsed as any config would be."""
    text = f"domain: sim\ndescriptors:\n  - key: user\n    rate_limit: {{unit: second, requests_per_unit: {limit}}}\n"
    domain, issues = parse_text(text, "sim.yaml")
    assert domain is not None, issues
    match = match_descriptor(domain, [DescriptorEntry("user", "x")])
    assert match is not None
    return match.rule


def skewed(replicas: int, total: float, heavy: Sequence[int]) -> list[float]:
    """80% of ``total`` on the ``heavy`` replicas, 20% spread over the others."""
    light = [index for index in range(replicas) if index not in set(heavy)]
    demand = [0.0] * replicas
    for index in heavy:
        demand[index] = 0.8 * total / len(heavy)
    for index in light:
        demand[index] = 0.2 * total / len(light)
    return demand


@dataclass
class Result:
    replicas: int
    buckets: int
    steady: tuple[float, float, float]
    shifted: tuple[float, float, float]
    converge: float | None
    admitted_ratio: float
    worst_over: float
    bound_over: float
    wall: float


def build(redis: FakeRedis, clock: SimClock, keys: list[BucketKey], limit: int, demand: list[float]) -> list[Replica]:
    """Every replica's :class:`QuotaLeases` (``--instances R`` as the floor of the live count)
    holding every bucket, each with its modelled Envoy."""
    base = Assignment(Kind.TOKEN_BUCKET, "fixed_window", rule(limit), limit, limit, 1)
    replicas: list[Replica] = []
    count = len(demand)
    for index in range(count):
        name = f"r{index:04d}"
        leases = QuotaLeases(redis, name, ttl=15, clock=clock, wall=clock, instances=count)
        stream = Stream(index, name, clock.now)
        replica = Replica(leases, stream, zlib.crc32(name.encode()) % REPORT)
        for key in keys:
            live = LiveBucket(dict(key), base, sent_at=clock.now, used_at=clock.now)
            live.assignment = leases.adopt(stream, key, live, base)
            replica.envoys[key] = EnvoyBucket(live, demand[index])
        replicas.append(replica)
    return replicas


async def one_second(replicas: list[Replica], watched: BucketKey, second: int, now: float) -> tuple[int, int]:
    """Every Envoy's second, the reports due, the syncs due; the watched bucket's
    ``(admitted, sum of bucket sizes)``."""
    admitted = sizes = 0
    for replica in replicas:
        for key, envoy in replica.envoys.items():
            got = envoy.second()
            if key == watched:
                admitted += got
                sizes += envoy.shape[0]
        if second % REPORT == replica.phase:
            for key, envoy in replica.envoys.items():
                replica.leases.usage(key, envoy.allowed, envoy.denied)
                envoy.allowed = envoy.denied = 0
        await replica.leases.sync()  # a tick: only the buckets ready or whose timer came due
    return admitted, sizes


def distance(replicas: list[Replica], watched: BucketKey, demand: list[float], limit: int) -> int:
    """How far the watched bucket's shares are from the max-min targets of ``demand``."""
    wanted = {f"r{i:04d}": max(1, math.ceil(d * (1 + HEADROOM))) for i, d in enumerate(demand)}
    targets = fair_shares(wanted, limit)
    return sum(
        abs(replica.envoys[watched].live.assignment.max_tokens - targets[f"r{i:04d}"])
        for i, replica in enumerate(replicas)
    )


async def simulate(replica_count: int, bucket_count: int, limit: int, seconds: int, shift: int) -> Result:
    started = time.perf_counter()
    clock = SimClock()
    redis = FakeRedis(clock)
    heavy = max(1, replica_count // 10)
    before = skewed(replica_count, 1.5 * limit, list(range(heavy)))
    after = skewed(replica_count, 1.5 * limit, list(range(replica_count - heavy, replica_count)))
    keys = [bucket_key(bucket_of("sim", [("user", f"b{index}")])) for index in range(bucket_count)]
    replicas = build(redis, clock, keys, limit, before)
    marks: dict[str, tuple[int, int, int, int]] = {}
    converge: float | None = None
    totals: list[tuple[int, int, int]] = []  # (second, admitted of bucket 0, sum of bucket sizes)
    for second in range(seconds):
        clock.now += 1
        if second == shift - 10:
            marks["steady"] = redis.counts()
        if second == shift:
            marks["shift"] = redis.counts()
            for replica, demand in zip(replicas, after, strict=True):
                for envoy in replica.envoys.values():
                    envoy.demand = demand
        admitted, sizes = await one_second(replicas, keys[0], second, clock.now)
        totals.append((second, admitted, sizes))
        if second >= shift and converge is None and distance(replicas, keys[0], after, limit) <= 0.05 * limit:
            converge = second - shift
    end = redis.counts()

    def rates(start: tuple[int, int, int, int], stop: tuple[int, int, int, int], span: float) -> tuple[float, ...]:
        return tuple((b - a) / span for a, b in zip(start, stop, strict=True))

    steady = rates(marks["steady"], marks["shift"], 10.0)
    shifted = rates(marks["shift"], end, float(seconds - shift))
    settled = [admitted for second, admitted, _ in totals if converge is not None and second >= shift + converge + 1]
    return Result(
        replica_count,
        bucket_count,
        (steady[0], steady[1], steady[2]),
        (shifted[0], shifted[1], shifted[2]),
        converge,
        sum(settled) / (len(settled) * limit) if settled else 0.0,
        max(admitted - limit for _, admitted, _ in totals),
        max(admitted - limit - sizes for _, admitted, sizes in totals),
        time.perf_counter() - started,
    )


def table(results: Sequence[Result], scale: int) -> str:
    header = ["R", "calls/s per bucket", "entry reads/s per bucket", "calls/s at scale", "entry reads/s at scale"]
    header += ["round trips/s per replica", "after shift: entry reads/s per bucket", "converged after shift"]
    header += ["admitted / limit after", "worst second above limit", "above limit + bucket sizes"]
    cells = []
    for r in results:
        per_bucket, reads, trips = r.steady[0] / r.buckets, r.steady[2] / r.buckets, r.steady[1] / r.replicas
        converge = f"{r.converge} s" if r.converge is not None else "no"
        steady = [f"{r.replicas:,}", f"{per_bucket:,.1f}", f"{reads:,.1f}", f"{per_bucket * scale:,.0f}"]
        steady += [f"{reads * scale:,.0f}", f"{trips:.2f}"]
        shifted = [f"{r.shifted[2] / r.buckets:,.1f}", converge, f"{r.admitted_ratio:.3f}"]
        cells.append([*steady, *shifted, f"{r.worst_over:+.0f}", f"{r.bound_over:+.0f}"])
    scope = f"per bucket, and x{scale:,} buckets (Redis is per-bucket work; buckets are independent)"
    return scope + "\n" + md_table(header, cells)


def lua_cost(url: str, replicas: int, repeat: int = 20) -> tuple[float, float]:
    """Microseconds of Redis time for one ``share.lua`` call that computes the shares of
    ``replicas`` (the master's, every 5 s per bucket), and for one that does not (a report)."""
    import redis

    client = redis.Redis.from_url(url)
    client.script_load(SHARE.source)
    keys = share_keys("sim-cost", bucket_key({"run": str(time.time())}), -1)
    now = 1_000_000

    def run(replica: str, demand: int, at: int, gap: int = 1000) -> None:
        call = Call(replica, demand, 100 * replicas, 60_000, 60_000, 60_000, min_gap_ms=gap, master_gap_ms=gap)
        client.evalsha(SHARE.sha, len(keys), *keys, *share_arguments(call, at))

    for index in range(replicas):
        run(f"replica-{index:05d}", 50 + index % 200, now)
    client.config_resetstat()
    for turn in range(repeat):
        run("replica-00000", 50 + turn, now + 10_000 * (turn + 1), gap=0)  # computes every time
    computing = float(client.info("commandstats")["cmdstat_evalsha"]["usec_per_call"])
    client.config_resetstat()
    for turn in range(repeat):
        run(f"replica-{1 + turn:05d}", 50 + turn % 200, now + 10_000 * (repeat + 1), gap=10**9)
    plain = float(client.info("commandstats")["cmdstat_evalsha"]["usec_per_call"])
    client.delete(*keys)
    return computing, plain


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.quota_shares_sim", description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[3, 1000])
    parser.add_argument("--buckets", type=int, default=10, help="buckets simulated (costs scale linearly)")
    parser.add_argument("--scale-buckets", type=int, default=10_000)
    parser.add_argument("--limit", type=int, default=0, help="per-second limit per bucket (default: 100 x R)")
    parser.add_argument("--seconds", type=int, default=70)
    parser.add_argument("--shift", type=int, default=35)
    parser.add_argument("--redis-url", help="also time share.lua in this Redis (INFO commandstats)")
    arguments = parser.parse_args(argv)
    results = []
    for count in arguments.replicas:
        limit = arguments.limit or 100 * count
        result = asyncio.run(simulate(count, arguments.buckets, limit, arguments.seconds, arguments.shift))
        print(f"R={count}: simulated {arguments.seconds} s in {result.wall:.1f} s", file=sys.stderr)
        results.append(result)
    print(table(results, arguments.scale_buckets))
    if arguments.redis_url:
        print("\n| R | share.lua computing (us, Redis CPU) | share.lua publish + pick up (us) |\n|---|---|---|")
        for count in arguments.replicas:
            computing, plain = lua_cost(arguments.redis_url, count)
            print(f"| {count:,} | {computing:,.0f} | {plain:,.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
