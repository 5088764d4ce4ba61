"""The event loop's cost per bucket of a quota share pipeline: ``python -m loadtest.quota_share_cost``.

With ``--backend redis`` every shared bucket costs one ``share.lua`` call per report period,
:data:`sidecar.quota.leases.CHUNK` calls per pipeline and per loop turn, and that turn delays
every ``ShouldRateLimit`` answered by the same loop (docs/operations.md, "loop-stalls"). This
drives the real :class:`~sidecar.quota.leases.QuotaLeases` over the real
:class:`~sidecar.quota.redis_shares.RedisShares` and a redis-server started here, with
``--buckets`` buckets adopted on one stream, and prints, per bucket, the event loop's time
(wall clock; the wait for Redis's replies taken off, :class:`Waits`) split in

* **build**: the calls of a chunk built (``QuotaLeases._call`` up to the backend),
* **execute**: the backend's run, from the pipeline packed to the replies read and turned
  into :class:`~sidecar.quota.shares.Reply` values,
* **apply**: the replies applied (grants, timers, pushes of what changed),

medians over ``--repeats`` passes over every bucket, for two passes: **report** (every bucket
reported usage that moves its share, so every assignment changes and is pushed) and **renew**
(no report since: a poll, the same grant, nothing pushed). ``--profile`` prints cProfile's
top functions of one report pass. Bounded: ``--buckets`` x ``--repeats`` x 2 calls.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from redis._parsers.hiredis import _AsyncHiredisParser

from sidecar.limiter.redis.store import RedisStore
from sidecar.quota import leases as leases_module
from sidecar.quota.assignments import Assignment, assign
from sidecar.quota.buckets import BucketKey, bucket_key, bucket_of, parse_bucket
from sidecar.quota.leases import QuotaLeases
from sidecar.quota.redis_shares import RedisShares
from sidecar.quota.stream import LiveBucket, Stream
from stack.processes import process_group
from stack.redis import RedisProcess

RULES = """\
domain: cost
descriptors:
  - key: user
    rate_limit: {unit: second, requests_per_unit: 1000000}
"""


@dataclass
class Phases:
    """The loop's wall seconds per phase, summed over one pass."""

    build: float = 0.0
    execute: float = 0.0
    apply: float = 0.0
    calls: int = 0
    longest: float = 0.0
    """The longest build or apply of a chunk (each runs in one loop turn)."""


class Waits:
    """Wall seconds spent awaiting the socket for replies (redis-py's hiredis parser reads
    there in both the ``Pipeline`` path and the packed one): taken off the execute phase, so
    it counts the loop's work, not Redis running the scripts. (The CPU clocks cannot split
    them on this machine: ``time.thread_time`` grows about 150 us across an idle 3 ms sleep.)"""

    seconds = 0.0

    @classmethod
    def install(cls) -> Callable[[], None]:
        """Time every socket read from now on; returns what puts the parser back."""
        original = _AsyncHiredisParser.read_from_socket

        async def timed(parser: _AsyncHiredisParser) -> bool:
            began = time.perf_counter()
            try:
                return bool(await original(parser))
            finally:
                cls.seconds += time.perf_counter() - began

        _AsyncHiredisParser.read_from_socket = timed  # type: ignore[method-assign]

        def uninstall() -> None:
            _AsyncHiredisParser.read_from_socket = original  # type: ignore[method-assign]

        return uninstall


class TimedBackend:
    """The real backend, with the moments ``run`` was entered and left noted."""

    def __init__(self, inner: RedisShares) -> None:
        self.inner = inner
        self.entered = 0.0
        self.left = 0.0

    async def start(self) -> None:
        await self.inner.start()

    async def close(self) -> None:
        await self.inner.close()

    async def run(self, calls: Sequence[Any]) -> Sequence[Any]:
        self.entered = time.perf_counter()
        replies = await self.inner.run(calls)
        self.left = time.perf_counter()
        return replies


async def one_pass(leases: QuotaLeases, backend: TimedBackend, keys: list[BucketKey]) -> Phases:
    """Every bucket called once, a chunk at a time, as ``QuotaLeases._call_ready`` does."""
    phases = Phases()
    chunk = leases_module.CHUNK
    for start in range(0, len(keys), chunk):
        part = keys[start : start + chunk]
        began, waited = time.perf_counter(), Waits.seconds
        if not await leases._call(part):
            raise SystemExit("redis-server did not answer")
        ended = time.perf_counter()
        phases.build += backend.entered - began
        phases.execute += backend.left - backend.entered - (Waits.seconds - waited)
        phases.apply += ended - backend.left
        phases.longest = max(phases.longest, backend.entered - began, ended - backend.left)
        phases.calls += len(part)
    return phases


def report(leases: QuotaLeases, keys: list[BucketKey], rate: int) -> None:
    """Every bucket reports usage, so its next call publishes a new demand (a new share)."""
    for key in keys:
        leases.usage(key, rate, 0)
        leases.buckets[key].counted_since = leases.clock() - 1.0  # a rate of ``rate`` per second


def base_assignment(directory: Path) -> Assignment:
    from sidecar.config import load_config

    (directory / "rules.yaml").write_text(RULES, encoding="utf-8")
    config = load_config(str(directory))
    parsed = parse_bucket(bucket_of("cost", [("user", "x")]))
    assert not isinstance(parsed, str), parsed
    return assign(config, parsed)


def adopt(leases: QuotaLeases, base: Assignment, count: int) -> list[BucketKey]:
    stream = Stream(1, "cost", leases.clock())
    keys: list[BucketKey] = []
    for index in range(count):
        bucket_id = bucket_of("cost", [("user", f"u{index}")])
        key = bucket_key(bucket_id)
        live = LiveBucket(dict(bucket_id), base, leases.clock(), leases.clock())
        stream.buckets[key] = live
        live.assignment = leases.adopt(stream, key, live, base)
        keys.append(key)
    leases.ready.clear()
    return keys


def per_bucket(values: list[float], calls: int) -> float:
    return statistics.median(values) / calls * 1e6


async def measure(url: str, directory: Path, arguments: argparse.Namespace) -> None:
    store = RedisStore.for_url(url)
    backend = TimedBackend(RedisShares(store))
    leases = QuotaLeases(backend, "cost-replica", 300)  # type: ignore[arg-type]  # a ShareBackend
    await backend.start()
    await store.wait_available()
    try:
        keys = adopt(leases, base_assignment(directory), arguments.buckets)
        await one_pass(leases, backend, keys)  # the records exist in Redis, the scripts are cached
        kinds: dict[str, list[Phases]] = {"report": [], "renew": []}
        for repeat in range(arguments.repeats):
            report(leases, keys, 10 + repeat % 7 * 50)
            kinds["report"].append(await one_pass(leases, backend, keys))
            kinds["renew"].append(await one_pass(leases, backend, keys))
        chunk = leases_module.CHUNK
        print(f"{arguments.buckets:,} shared buckets, CHUNK {chunk}, {arguments.repeats} repeats (medians)")
        print("pass    build us  execute us  apply us  total us/bucket  longest build or apply of a chunk, ms")
        for kind, runs in kinds.items():
            calls = runs[0].calls
            build = per_bucket([run.build for run in runs], calls)
            execute = per_bucket([run.execute for run in runs], calls)
            apply = per_bucket([run.apply for run in runs], calls)
            longest = statistics.median([run.longest for run in runs]) * 1e3
            print(
                f"{kind:7} {build:8.1f}  {execute:10.1f}  {apply:8.1f}  {build + execute + apply:15.1f}  {longest:6.2f}"
            )
        if arguments.profile:
            report(leases, keys, 999)
            profiler = cProfile.Profile()
            profiler.enable()
            await one_pass(leases, backend, keys)
            profiler.disable()
            out = io.StringIO()
            pstats.Stats(profiler, stream=out).sort_stats(arguments.sort).print_stats(arguments.profile)
            print(out.getvalue())
    finally:
        await leases.backend.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--buckets", type=int, default=10_000, help="shared buckets (default 10,000)")
    parser.add_argument("--repeats", type=int, default=5, help="passes of each kind (default 5)")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="print cProfile's top N functions")
    parser.add_argument("--sort", default="tottime", help="cProfile's order (tottime, cumulative)")
    arguments = parser.parse_args(argv)
    if not 1 <= arguments.buckets <= 200_000 or not 1 <= arguments.repeats <= 100:
        parser.error("--buckets must be 1..200,000 and --repeats 1..100")
    with tempfile.TemporaryDirectory() as temporary, process_group() as group:
        directory = Path(temporary)
        redis = group.start_ready(lambda: RedisProcess(directory))
        import uvloop

        uninstall = Waits.install()
        try:
            uvloop.run(measure(redis.url, directory, arguments))
        finally:
            uninstall()
    return 0


if __name__ == "__main__":
    sys.exit(main())
