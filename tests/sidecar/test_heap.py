"""The collector policy (sidecar.heap): its decisions on a fake collector, the pause gauge on a fake clock."""

from __future__ import annotations

from dataclasses import dataclass, field

from sidecar.heap import GROWTH, HeapSettler, PauseRecorder


@dataclass
class FakeCollector:
    """Objects alive and frozen, as the ``gc`` calls of a settle move them; every call logged."""

    young: int = 0
    """Alive, not frozen."""
    frozen: int = 0
    garbage_in_frozen: int = 0
    """Frozen objects that a full pass would free (cycles frozen while alive)."""
    calls: list[str] = field(default_factory=list)
    counted: int = 0
    """Calls of ``get_freeze_count``: each walks the whole frozen heap (~7 ms for 240,000)."""

    def collect(self, generation: int = 2) -> int:
        self.calls.append(f"collect({generation})")
        if generation < 2:
            return 0
        freed, self.garbage_in_frozen = self.garbage_in_frozen, 0
        self.young -= freed
        return freed

    def freeze(self) -> None:
        self.calls.append("freeze")
        self.frozen += self.young
        self.young = 0

    def unfreeze(self) -> None:
        self.calls.append("unfreeze")
        self.young += self.frozen
        self.frozen = 0

    def get_freeze_count(self) -> int:
        self.counted += 1
        return self.frozen

    def get_objects(self, generation: int | None = None) -> list[object]:
        assert generation == 2  # after a young collection, every unfrozen object is there
        return [None] * self.young


def test_a_settle_under_the_floor_collects_the_young_and_freezes() -> None:
    collector = FakeCollector(young=45_000)
    settler = HeapSettler(collector, floor=100_000)
    assert settler.settle() is False
    assert collector.calls == ["collect(1)", "freeze"]
    assert collector.frozen == 45_000


def test_past_the_floor_one_full_pass_frees_frozen_garbage_then_the_bar_doubles() -> None:
    collector = FakeCollector(young=90_000, garbage_in_frozen=30_000)
    settler = HeapSettler(collector, floor=100_000)
    assert settler.settle() is False
    collector.young = 20_000  # 110,000 frozen after the next freeze: past the floor
    assert settler.settle() is True
    assert collector.calls[-5:] == ["collect(1)", "freeze", "unfreeze", "collect(2)", "freeze"]
    assert collector.frozen == 80_000  # the 30,000 frozen garbage objects are gone
    assert settler.baseline == 80_000
    assert settler.threshold == GROWTH * 80_000
    collector.young = 70_000  # 150,000: under twice the baseline
    assert settler.settle() is False
    assert settler.full_passes == 1


def test_buckets_coming_and_going_at_a_steady_count_never_cost_a_full_pass() -> None:
    collector = FakeCollector(young=45_000)
    settler = HeapSettler(collector, floor=200_000)
    settler.settle()
    for _ in range(50):  # a reconnect: 20,000 buckets of one tracked object adopted, then released
        collector.young += 20_000
        settler.settle()
        collector.frozen -= 20_000  # freed by reference counting, they leave the frozen heap
    assert settler.full_passes == 0
    assert collector.calls.count("unfreeze") == 0
    # The frozen heap (65,000) is walked to count it only once 135,000 more could have been frozen.
    assert collector.counted == 50 * 20_000 // 140_000


def test_the_frozen_heap_is_counted_only_when_what_was_frozen_could_pass_the_bar() -> None:
    collector = FakeCollector(young=45_000)
    settler = HeapSettler(collector, floor=200_000)
    for _ in range(70):  # 2,048 buckets x 2 objects per settle: 286,720 frozen in all
        settler.settle()
        collector.young += 4096
    assert collector.counted == 2  # once past 200,000 frozen at most, once after the full pass
    assert settler.full_passes == 1


def test_the_worst_pause_is_kept_per_generation() -> None:
    now = [0.0]
    recorder = PauseRecorder(clock=lambda: now[0])
    for generation, seconds in [(0, 0.25), (2, 4.0), (0, 0.5), (2, 2.0), (1, 1.0)]:  # exact in binary
        recorder("start", {"generation": generation})
        now[0] += seconds
        recorder("stop", {"generation": generation, "collected": 0, "uncollectable": 0})
    assert recorder.collections == [2, 1, 2]
    [family] = recorder.frozen().collect()
    assert family.name == "ratelimit_sidecar_gc_pause_max_seconds"
    shown = {sample.labels["generation"]: sample.value for sample in family.samples}
    assert shown == {"0": 0.5, "1": 1.0, "2": 4.0}
