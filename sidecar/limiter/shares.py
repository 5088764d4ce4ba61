"""A replica's share of a limit: the rule every backend that splits a limit reads.

The memory backend with ``--instances`` enforces it, the ``local`` failure mode of the
Redis backends holds each replica to it while Redis is away
(:func:`~sidecar.limiter.failure.failure_limits`), and quota mode sizes its leases by it.
"""

from __future__ import annotations

import math


def share_of_limit(limit: int, instances: int) -> int:
    """This replica's part of a limit shared by ``instances`` replicas, rounded up.

    Rounding up keeps the sum of the shares at or above the limit, so balanced
    traffic below the limit is never refused; the price is at most
    ``instances - 1`` hits of overshoot per window.
    """
    return math.ceil(limit / instances) if instances > 1 else limit
