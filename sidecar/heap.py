"""The cyclic garbage collector's policy: full collections walk only the young heap.

CPython's full (oldest generation) collection walks every GC-tracked object of the
process while holding the GIL, and one event loop answers every ``ShouldRateLimit``:
with 20,000 live quota buckets a full collection took 30-400 ms (``python -m
loadtest.quota_gc``), past Envoy's 20 ms timeout. Most of that heap is long-lived (the
config, live buckets, their shares) and holds no reference cycles: it is freed by
reference counting when a reload, an abandon or a closed stream lets it go. So:

* **settle** (:meth:`HeapSettler.settle`) collects the young generations (cheap: they
  hold what was made since the last collection) and then moves everything alive to the
  permanent generation (``gc.freeze``), which later collections skip. It runs after
  every config load and after every :data:`SETTLE_EVERY` buckets adopted
  (``sidecar.quota.registry``), so what a full collection walks stays a few thousand
  buckets' worth whatever the bucket count.
* **bounded**: an object frozen while in a reference cycle that later becomes garbage is
  never freed by a frozen collector. So when the frozen heap has grown past
  :data:`GROWTH` times its size after the last full pass, and past :data:`FLOOR`, one
  settle unfreezes everything and runs a full collection first. Frozen garbage is then
  at most about the live heap; the full pass is paid only when the frozen heap doubles
  (``log2`` times while a process grows), not for buckets that come and go at a steady
  count (each freed by reference counting, it leaves the frozen heap as it goes).
  Counting the frozen heap (``gc.get_freeze_count``) walks all of it, 7 ms for 240,000
  objects, so it is counted only when what was frozen since the last count could have
  taken it past the bar; a settle otherwise costs ~0.2-0.3 ms.
* **seen**: :class:`PauseRecorder` (``gc.callbacks``) keeps the longest collection per
  generation for the ``ratelimit_sidecar_gc_pause_max_seconds`` gauge.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator
from typing import Protocol

from prometheus_client.core import GaugeMetricFamily, Metric

__all__ = [
    "FLOOR",
    "GROWTH",
    "PAUSES",
    "SETTLER",
    "SETTLE_EVERY",
    "Collector",
    "HeapSettler",
    "PauseRecorder",
    "settle",
]

SETTLE_EVERY = 2048
"""Buckets adopted between two settles: the young heap a full collection may meet then
is ~2,000 buckets' objects (a few ms), and a young collection plus a freeze cost ~1-3 ms."""
GROWTH = 2.0
"""The frozen heap may grow to this multiple of its size after the last full pass."""
FLOOR = 200_000
"""Frozen objects below which no full pass is made: a started sidecar freezes ~45,000 and
20,000 shared buckets add ~60,000, so such a process never pays one; frozen garbage stays
under ~200,000 objects (tens of MB at most) or the live heap, whichever is larger."""


class Collector(Protocol):
    """The part of the ``gc`` module a settle uses (a fake in tests)."""

    def collect(self, generation: int = 2) -> int: ...

    def freeze(self) -> None: ...

    def unfreeze(self) -> None: ...

    def get_freeze_count(self) -> int: ...

    def get_objects(self, generation: int | None = None) -> list[object]: ...


class HeapSettler:
    """Decides, at each settle, between a young collection and a full pass, then freezes."""

    def __init__(self, collector: Collector = gc, growth: float = GROWTH, floor: int = FLOOR) -> None:
        self.collector = collector
        self.growth = growth
        self.floor = floor
        self.baseline = 0
        """Frozen objects right after the last full pass (0 before the first)."""
        self.known = 0
        """The frozen heap when last counted: ``gc.get_freeze_count`` walks all of it (7 ms
        for 240,000 objects), so it is counted only when it may have passed the bar."""
        self.unchecked = 0
        """Objects frozen since (an upper bound of the growth: some may be freed already)."""
        self.settles = 0
        self.full_passes = 0

    @property
    def threshold(self) -> float:
        """Frozen objects past which a settle makes a full pass."""
        return max(self.growth * self.baseline, self.floor)

    def settle(self) -> bool:
        """Freeze what is alive; True when the frozen heap had grown enough that a full
        collection of everything ran first (see the module docstring)."""
        self.settles += 1
        collector = self.collector
        collector.collect(1)  # young garbage first: frozen cycles would never be freed
        self.unchecked += len(collector.get_objects(2))  # all that is unfrozen, after a young collection
        collector.freeze()
        if self.known + self.unchecked <= self.threshold:
            return False  # even if nothing frozen since the last count was freed
        self.known, self.unchecked = collector.get_freeze_count(), 0
        if self.known <= self.threshold:
            return False
        collector.unfreeze()
        collector.collect(2)
        collector.freeze()
        self.baseline = self.known = collector.get_freeze_count()
        self.full_passes += 1
        return True


SETTLER = HeapSettler()
"""The process's one settler: config loads and quota adoptions share its baseline."""


def settle() -> None:
    """:meth:`HeapSettler.settle` of the process's settler."""
    SETTLER.settle()


class PauseRecorder:
    """The longest collection seen per generation, from ``gc.callbacks``.

    Two calls per collection: +3 us a collection (``gc.collect(0)`` in a loop). An
    in-process ``ShouldRateLimit`` starts no collection on average (its objects are freed
    as fast as they are made), so the request path pays nothing measurable."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.worst = [0.0, 0.0, 0.0]
        self.collections = [0, 0, 0]
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = self.clock()
            return
        generation = info["generation"]
        pause = self.clock() - self._started
        self.collections[generation] += 1
        self.worst[generation] = max(self.worst[generation], pause)

    def frozen(self) -> FrozenPauses:
        """This scrape's numbers, copied on the event loop (the text is made in a thread)."""
        return FrozenPauses(tuple(self.worst), tuple(self.collections))

    def install(self) -> None:
        if self not in gc.callbacks:
            gc.callbacks.append(self)

    def remove(self) -> None:
        if self in gc.callbacks:
            gc.callbacks.remove(self)


class FrozenPauses:
    """The worst pause and the collection count per generation, for one scrape."""

    def __init__(self, worst: tuple[float, ...], collections: tuple[int, ...]) -> None:
        self.worst = worst
        self.collections = collections

    def collect(self) -> Iterator[Metric]:
        worst = GaugeMetricFamily(
            "ratelimit_sidecar_gc_pause_max_seconds",
            "Longest garbage collection since start, by generation (it holds the event loop)",
            labels=("generation",),
        )
        for generation, seconds in enumerate(self.worst):
            worst.add_metric((str(generation),), seconds)
        yield worst


PAUSES = PauseRecorder()
"""The process's recorder, installed by ``serve`` (the metrics read it)."""
