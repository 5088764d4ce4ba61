"""The clock windows are cut from: this host's wall clock, optionally corrected toward Redis's.

Windows are aligned to the Unix clock so replicas agree on boundaries without talking,
which holds only as well as their clocks agree. With Redis, every replica can measure its
offset to the one clock they all reach, Redis ``TIME``, and cut windows on that clock
instead: skew between hosts then stops mattering. Each sample is taken around one round
trip (offset = server time - midpoint of send and receive, good to half the round trip);
the correction is the median of the last few samples, so one slow round trip does not move it.
"""

from __future__ import annotations

import statistics
import time
from collections import deque

from sidecar.limiter.windows import Clock

SAMPLES = 5
MAX_SAMPLE_ROUND_TRIP = 0.05
"""Samples from slower round trips are dropped: their midpoint could be off by 25 ms."""


class SharedClock:
    """Callable like ``time.time``: local time + ``offset`` (a test skew) + the measured correction."""

    def __init__(self, offset: float = 0.0, base: Clock = time.time) -> None:
        self.offset = offset
        """Deliberate skew (``--clock-offset``), to test what skew does."""
        self.base = base
        self.correction = 0.0
        """Measured: what to add to the local clock to read Redis's."""
        self._samples: deque[float] = deque(maxlen=SAMPLES)

    def __call__(self) -> float:
        return self.base() + self.offset + self.correction

    def local(self) -> float:
        """This host's clock (with the deliberate skew), before correction."""
        return self.base() + self.offset

    def observe(self, reference: float, sent: float, received: float) -> None:
        """One sample: the reference clock read between local times ``sent`` and ``received``."""
        if received - sent > MAX_SAMPLE_ROUND_TRIP:
            return
        self._samples.append(reference - (sent + received) / 2)
        self.correction = statistics.median(self._samples)
