"""What is queued for one stream's writer: one action per bucket, bounded in bytes.

A client that never reads its responses must not make this process hold more and more
for it. So the queue keeps only the **latest** action per bucket id (a refresh, a
reload's new assignment or an abandon replaces the action still queued for that id, and
a stateless answer for an id asked again is not queued twice), and it counts what it
holds in bytes. Past :attr:`Outbox.max_bytes` it is *full*: the stream's reader stops
reading reports (it awaits :attr:`Outbox.room`) until the writer has drained it below
the bound, and the writer ends a stream whose client does not take a message within the
write timeout (:mod:`sidecar.quota.service`).

Actions that do not come from a report (TTL refreshes, reloads, shares) are queued even
when the queue is full: they replace the action of a live bucket, so they are bounded
by the live buckets of the stream, which are capped.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterator, Mapping

from sidecar.quota.assignments import Action
from sidecar.quota.buckets import BucketKey

MAX_QUEUED_BYTES = 1024 * 1024
"""Default bound of one stream's queue: 20,000 ids of ~50 bytes (a reload of a full stream)."""
ACTION_OVERHEAD = 40
"""Bytes of a serialized ``BucketAction`` besides its id: the assignment, its TTL and tags."""
FIELD_OVERHEAD = 6
"""Bytes of one id field besides its name and value: the map entry's tags and lengths."""


def utf8_length(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def id_bytes(bucket: Mapping[str, str]) -> int:
    """Serialized bytes of a bucket id's fields (what a client makes large)."""
    size = FIELD_OVERHEAD * len(bucket)
    for name, value in bucket.items():
        size += utf8_length(name) + utf8_length(value)
    return size


def action_bytes(action: Action) -> int:
    """What an action costs in the queue: about its serialized size."""
    return ACTION_OVERHEAD + id_bytes(action.bucket_id)


class Outbox:
    """A stream's queued actions, oldest first, at most one per bucket key."""

    def __init__(self, max_bytes: int = MAX_QUEUED_BYTES) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self.room = asyncio.Event()
        """Set while the queue is within its bound; the reader awaits it before reading on."""
        self.room.set()
        self._actions: dict[BucketKey, tuple[Action, int]] = {}
        self._order: deque[BucketKey] = deque()
        """Each key of ``_actions`` once, in the order it was first queued (a replaced
        action keeps its place, so a bucket refreshed often is not pushed back forever)."""

    def push(self, key: BucketKey, action: Action) -> None:
        size = action_bytes(action)
        old = self._actions.get(key)
        if old is None:
            self._order.append(key)
        else:
            self.bytes -= old[1]
        self._actions[key] = (action, size)
        self.bytes += size
        if self.bytes > self.max_bytes:
            self.room.clear()

    @property
    def full(self) -> bool:
        return self.bytes > self.max_bytes

    def take(self, count: int) -> list[Action]:
        """Up to ``count`` actions, oldest first, removed from the queue."""
        taken: list[Action] = []
        while self._order and len(taken) < count:
            action, size = self._actions.pop(self._order.popleft())
            self.bytes -= size
            taken.append(action)
        if self.bytes <= self.max_bytes:
            self.room.set()
        return taken

    def clear(self) -> None:
        self._actions.clear()
        self._order.clear()
        self.bytes = 0
        self.room.set()

    def __iter__(self) -> Iterator[Action]:
        return (action for action, _ in self._actions.values())

    def __len__(self) -> int:
        return len(self._actions)

    def __bool__(self) -> bool:
        return bool(self._actions)
