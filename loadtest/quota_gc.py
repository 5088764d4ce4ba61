"""The collector's pauses with many live quota buckets: ``python -m loadtest.quota_gc``.

Runs the whole :class:`sidecar.server.Sidecar` in this process, on uvloop (memory backend,
or ``--backend redis`` with shares, against a redis-server started here), and an RLQS
client in threads (raw bytes in and out, nothing parsed while measuring). Steps:

1. adopt ``--buckets`` buckets over one stream (what an Envoy reports after a reconnect);
2. count the GC-tracked objects per live bucket (all generations, the frozen one too),
   and the types that grew;
3. steady state: the same report every 5 s (Envoy's period) for ``--steady`` seconds;
4. ``--cycles`` times: close the stream (its buckets released), open one, adopt them all
   again; the RSS after each cycle.

Every collection's duration is recorded by generation (``gc.callbacks``), and the event
loop's lateness by a 1 ms probe. Bounded: one stream, a fixed count of reports.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import resource
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import uvloop

from loadtest.common import floor_percentile
from loadtest.reliability_harness.quota_streams import QuotaStream, bucket_reports
from sidecar.config import load_config
from sidecar.config.reload import settle_after_load
from sidecar.limiter.memory import MemoryLimiter
from sidecar.limiter.redis.clock import SharedClock
from sidecar.server import Sidecar, build_quota_leases
from sidecar.settings import Settings

RULES = """\
domain: gcq
descriptors:
  - key: user
    rate_limit: {unit: second, requests_per_unit: 100}
"""
REPORT_SECONDS = 5.0


@dataclass
class Pauses:
    """Each collection's (generation, seconds), from ``gc.callbacks``."""

    started: float = 0.0
    seen: list[tuple[int, float]] = field(default_factory=list)

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self.started = time.perf_counter()
        else:
            self.seen.append((info["generation"], time.perf_counter() - self.started))

    def take(self) -> list[tuple[int, float]]:
        seen, self.seen = self.seen, []
        return seen


@dataclass
class LoopProbe:
    """The event loop's lateness: a 1 ms sleep, how much later than asked it woke."""

    worst: float = 0.0
    lags: list[float] = field(default_factory=list)

    async def run(self) -> None:
        while True:
            asked = time.perf_counter()
            await asyncio.sleep(0.001)
            lag = time.perf_counter() - asked - 0.001
            self.lags.append(lag)

    def take(self) -> list[float]:
        lags, self.lags = self.lags, []
        return lags


def tracked() -> int:
    """GC-tracked objects of the process, the frozen (permanent) generation included."""
    return len(gc.get_objects()) + gc.get_freeze_count()


def tracked_types() -> Counter[str]:
    """Tracked objects by type, outside the frozen generation (``gc`` cannot list it without
    unfreezing, and refreezing would change what is measured: the per-type figures of
    frozen buckets are in ``tests/sidecar/quota/test_gc_footprint.py``)."""
    return Counter(type(item).__name__ for item in gc.get_objects())


def rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def summary(label: str, pauses: list[tuple[int, float]], lags: list[float]) -> str:
    parts = [f"{label:<12}"]
    for generation in (0, 1, 2):
        times = [seconds for gen, seconds in pauses if gen == generation]
        if times:
            worst, p99 = max(times) * 1e3, floor_percentile(times, 0.99) * 1e3
            parts.append(f"gen{generation}: n={len(times)} max={worst:.1f}ms p99={p99:.1f}ms")
        else:
            parts.append(f"gen{generation}: n=0")
    parts.append(f"loop lag max={max(lags, default=0) * 1e3:.1f}ms p99={floor_percentile(lags, 0.99) * 1e3:.1f}ms")
    return "  ".join(parts)


class Bench:
    def __init__(self, options: argparse.Namespace, directory: Path) -> None:
        self.options = options
        self.directory = directory
        self.pauses = Pauses()
        self.probe = LoopProbe()
        self.reports = bucket_reports("gcq", "user", options.buckets)

    async def adopt(self, stream: QuotaStream) -> None:
        since = time.perf_counter()
        for data in self.reports:
            stream.send(data)
        await asyncio.to_thread(stream.wait_quiet, since, 1.0, 60.0)

    def phase(self, label: str) -> None:
        print(summary(label, self.pauses.take(), self.probe.take()), flush=True)

    async def run(self) -> None:
        sidecar = await self.start_sidecar()
        registry = sidecar.quota.registry
        if self.options.no_settle:
            registry.settle = lambda: None  # as before sidecar.heap: compare
        address = f"127.0.0.1:{sidecar.port}"
        probe = asyncio.get_running_loop().create_task(self.probe.run())
        await asyncio.sleep(0.5)
        gc.collect()
        before, types_before = tracked(), tracked_types()
        self.pauses.take()
        self.probe.take()
        stream = QuotaStream(address)
        await self.adopt(stream)
        self.phase("adopt")
        live = registry.live
        gc.collect()
        after, types_after = tracked(), tracked_types()
        self.pauses.take()
        each = (after - before) / max(1, live)
        print(f"live buckets {live}; tracked objects {before} -> {after}: {each:.2f} per bucket")
        grown = (types_after - types_before).most_common(12)
        print("  grew, not frozen: " + ", ".join(f"{name} {count / max(1, live):.2f}" for name, count in grown))
        print(f"  frozen {gc.get_freeze_count()}  gc counts {gc.get_count()}  RSS {rss_mib():.1f} MiB", flush=True)
        await self.steady(stream)
        rss: list[float] = []
        for _ in range(self.options.cycles):
            self.close(stream)
            await asyncio.sleep(1.0)
            await registry.settled()
            stream = QuotaStream(address)
            await self.adopt(stream)
            self.phase(f"reconnect{len(rss) + 1}")
            rss.append(rss_mib())
        print("RSS after each cycle (MiB): " + " ".join(f"{value:.1f}" for value in rss))
        self.close(stream)
        await asyncio.sleep(1.0)
        await registry.settled()
        self.phase("abandoned")
        print(f"after the last close: live {registry.live}, tracked {tracked()}, RSS {rss_mib():.1f} MiB")
        print(f"max RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.1f} MiB", flush=True)
        self.frozen_garbage()
        probe.cancel()
        await sidecar.server.stop(0)
        if sidecar.leases is not None:
            await sidecar.leases.close()

    @staticmethod
    def close(stream: QuotaStream) -> None:
        """End the client's call and drop its replies: the client shares this process, and its
        channel and threads make reference cycles that a frozen collector would keep, replies
        and all (the sidecar's own objects make none: see :meth:`frozen_garbage`)."""
        stream.close()
        with stream._lock:
            stream.replies.arrivals.clear()

    @staticmethod
    def frozen_garbage() -> None:
        """What a full pass over everything frees now: cyclic garbage that was frozen alive."""
        gc.unfreeze()
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        gc.set_debug(0)
        garbage = Counter(type(item).__name__ for item in gc.garbage)
        held = sum(len(item) for item in gc.garbage if isinstance(item, (bytes, bytearray)))
        print(f"cyclic garbage found by a full pass: {len(gc.garbage)} objects, {held / 2**20:.1f} MiB of bytes")
        print("  " + ", ".join(f"{name} {count}" for name, count in garbage.most_common(15)))
        frames = Counter(
            f"{Path(item.f_code.co_filename).name}:{item.f_code.co_name}"
            for item in gc.garbage
            if isinstance(item, FrameType)
        )
        print("  frames: " + ", ".join(f"{name} {count}" for name, count in frames.most_common(8)))
        gc.garbage.clear()
        gc.collect()
        print(f"after it: RSS {rss_mib():.1f} MiB", flush=True)

    async def steady(self, stream: QuotaStream) -> None:
        deadline = time.perf_counter() + self.options.steady
        while time.perf_counter() < deadline:
            for data in self.reports:
                stream.send(data)
            await asyncio.sleep(REPORT_SECONDS)
        self.phase("steady")

    async def start_sidecar(self) -> Sidecar:
        (self.directory / "gcq.yaml").write_text(RULES)
        extra = {"backend": "redis", "redis_url": self.options.redis_url} if self.options.redis_url else {}
        settings = Settings(
            config=str(self.directory),
            grpc_address="127.0.0.1:0",
            metrics_address="",
            watch_config=False,
            quota_max_buckets=max(100_000, self.options.buckets),
            quota_max_buckets_per_stream=self.options.buckets,
            **extra,
        )
        config = load_config(str(self.directory))
        settle_after_load()  # as serve() does after the startup load
        leases = build_quota_leases(settings, SharedClock(0.0)) if self.options.redis_url else None
        sidecar = Sidecar(settings, config, MemoryLimiter(), leases=leases)
        await sidecar.start()  # starts the leases' sync too
        return sidecar


@contextmanager
def redis_if(wanted: bool, directory: Path) -> Iterator[str]:
    if not wanted:
        yield ""
        return
    from stack.redis import RedisProcess

    redis = RedisProcess(directory)
    redis.start()
    try:
        redis.wait_ready()
        yield redis.url
    finally:
        redis.stop()


def parse_arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("memory", "redis"), default="memory")
    parser.add_argument("--buckets", type=int, default=20_000)
    parser.add_argument("--cycles", type=int, default=5, help="close and adopt again this many times")
    parser.add_argument("--steady", type=float, default=20.0, help="seconds of steady reports")
    parser.add_argument("--no-settle", action="store_true", help="no freeze after adoptions (to compare)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    options = parse_arguments(argv)
    with (
        tempfile.TemporaryDirectory(prefix="quota-gc-") as name,
        redis_if(options.backend == "redis", Path(name)) as url,
    ):
        options.redis_url = url
        bench = Bench(options, Path(name))
        gc.callbacks.append(bench.pauses)
        try:
            uvloop.run(bench.run())
        finally:
            gc.callbacks.remove(bench.pauses)
    return 0


if __name__ == "__main__":
    sys.exit(main())
