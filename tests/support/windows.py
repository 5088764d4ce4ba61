"""Tests that must run inside one wall-clock window.

A counter's key is named by its window, so a test whose hits or checks straddle a
boundary splits them over two keys and reads the wrong one. Such a test first waits
for the next window when too little of this one is left.
"""

from __future__ import annotations

import asyncio
import time

MARGIN = 0.1
"""Seconds past the boundary a wait ends: the new window has surely begun on every clock read."""


def wait_for_room(unit: float, needed: float) -> float:
    """Seconds to sleep into the next ``unit`` window when fewer than ``needed`` are left in this one; else 0."""
    left = unit - time.time() % unit
    return left + MARGIN if left < needed else 0.0


def ensure_left(unit: float, needed: float) -> None:
    """Sleep into the next ``unit`` window if fewer than ``needed`` seconds are left in this one."""
    time.sleep(wait_for_room(unit, needed))


async def ensure_left_async(unit: float, needed: float) -> None:
    """:func:`ensure_left` for a test on an event loop."""
    await asyncio.sleep(wait_for_room(unit, needed))
