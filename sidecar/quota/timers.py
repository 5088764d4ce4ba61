"""When each shared bucket next needs a look: a timer wheel with O(1) set, move and drop.

The lease sync has tens of thousands of buckets and a tick every quarter second. Scanning
every bucket each tick for the few that are due is work proportional to the bucket count
on the event loop, every tick. Here each bucket sits in the slot of its next time; a tick
takes only the slots that came due, so a bucket costs nothing until then.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class Timers(Generic[K]):
    """At most one time per key, in slots of ``resolution`` seconds."""

    def __init__(self, resolution: float, now: float) -> None:
        self.resolution = resolution
        self.slots: dict[int, set[K]] = {}
        self.slot_of: dict[K, int] = {}
        self.cursor = math.floor(now / resolution)
        """The first slot not taken yet: a time before it lands in it (it is due now)."""

    def put(self, key: K, when: float) -> None:
        """``key`` is due strictly after ``when`` (at the next slot boundary past it)."""
        if math.isinf(when):
            self.drop(key)
            return
        slot = max(math.floor(when / self.resolution) + 1, self.cursor)
        old = self.slot_of.get(key)
        if old == slot:
            return
        if old is not None:
            self._remove(key, old)
        self.slots.setdefault(slot, set()).add(key)
        self.slot_of[key] = slot

    def drop(self, key: K) -> None:
        old = self.slot_of.pop(key, None)
        if old is not None:
            self._remove(key, old, forget=False)

    def due(self, now: float) -> list[K]:
        """Every key whose time has come, removed. Touches only the slots that came due."""
        current = math.floor(now / self.resolution)
        if current < self.cursor:
            return []
        if current - self.cursor > len(self.slots):  # a long gap: look at the slots there are
            slots = sorted(slot for slot in self.slots if slot <= current)
        else:
            slots = [slot for slot in range(self.cursor, current + 1) if slot in self.slots]
        self.cursor = current + 1
        keys: list[K] = []
        for slot in slots:
            for key in self.slots.pop(slot):
                del self.slot_of[key]
                keys.append(key)
        return keys

    def __len__(self) -> int:
        return len(self.slot_of)

    def _remove(self, key: K, slot: int, forget: bool = True) -> None:
        keys = self.slots.get(slot)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self.slots[slot]
        if forget:
            self.slot_of.pop(key, None)
