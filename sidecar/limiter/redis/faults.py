"""What a failed Redis call says about Redis: one classification, for every call.

Issue 31 measured the cost of getting this wrong: during a Cluster slot migration,
multi-key scripts on the migrating slot are answered ``TRYAGAIN``; redis-py retries
them, then raises ``ClusterError: TTL exhausted.``, and when that marked all of Redis
down, every request of every slot went to the failure mode (15 to 37 down/up flips
per replica in three seconds). A reply is proof that the node is there. So:

* :attr:`Fault.CALL`: the node answered, refusing *this* call (or redis-py gave up
  retrying it). The call fails alone and its request gets the failure mode; Redis
  (or, in Cluster, the node) stays available. Redis-py raises, for these:

  - ``ResponseError`` and its kin: a script refusing a key (``WRONGTYPE``, a corrupt
    counter), ``BUSY`` (another script runs), ``OOM``, ``NOSCRIPT`` left after the
    resend, ``NOPERM``;
  - ``TryAgainError`` (``TRYAGAIN``: a multi-key call on a slot in migration whose keys
    are split between the two nodes; the script did not run), ``AskError`` /
    ``MovedError`` (``ASK``/``MOVED``: the slot is elsewhere; the call did not run;
    redis-py follows them itself, and a storm ends as ``TTL exhausted``);
  - ``ClusterError`` (``TTL exhausted.``: redis-py's redirection retries ran out),
    ``ClusterDownError`` / ``MasterDownError`` (``CLUSTERDOWN``: the slot, or the whole
    Cluster during a failover, is not served right now), ``SlotNotCoveredError`` (the
    client's slot map has no node for the slot), ``ClusterCrossSlotError``;
  - ``BusyLoadingError`` (``LOADING``: the node is loading its data set; a
    ``ConnectionError`` subclass in redis-py, but the node answered) and
    ``ReadOnlyError`` (``READONLY``: the call reached a replica, e.g. a demoted master
    before the client's slot map caught up);
  - ``MaxConnectionsError``: our own connection pool is full, not Redis's fault;
  - anything else that is no timeout and no ``ConnectionError``/``OSError``, including
    our own ``RedisUnavailable`` (a failure already accounted for where it was raised).

* :attr:`Fault.LOST`: the connection failed (refused, reset, closed, authentication
  refused): Redis (the node, in Cluster) is marked down at once and probed back.

* :attr:`Fault.SILENCE`: no answer within the call's time (``TimeoutError``, ours or
  redis-py's socket timeout). It marks Redis (the node) down only under the silence rule
  of :mod:`~sidecar.limiter.redis.availability`: silent well beyond any request budget
  while our own event loop was free to read the answer.

A call that did not run (``TRYAGAIN``, ``ASK``, ``MOVED``, ``NOSCRIPT``) may be sent
again safely: redis-py resends the redirections within the call's time, and
:meth:`~sidecar.limiter.redis.store.RedisStore.run_scripts` resends after ``NOSCRIPT``.
A call that may have run is never resent on the request path (its hits would count
twice); flushes are idempotent (``flush_once.lua``) and retried by their caller.
"""

from __future__ import annotations

import enum

from redis import exceptions


class Fault(enum.Enum):
    """What a failed call tells about the Redis (node) it was sent to."""

    CALL = "call"
    """The node answered: this call fails alone, the node stays available."""
    LOST = "lost"
    """The connection failed: the node is marked down and probed back."""
    SILENCE = "silence"
    """No answer in time: down only under the silence rule."""


CALL_ONLY: tuple[type[BaseException], ...] = (exceptions.BusyLoadingError, exceptions.MaxConnectionsError)
"""Checked first: ``ConnectionError`` subclasses that are a reply (``LOADING``) or our own
pool's limit, not a lost connection."""
SILENT: tuple[type[BaseException], ...] = (TimeoutError, exceptions.TimeoutError)
"""Ours (``asyncio.timeout``) and redis-py's socket timeout (not an ``OSError``)."""
LOST: tuple[type[BaseException], ...] = (exceptions.ConnectionError, OSError)
"""Checked after :data:`SILENT` (a ``TimeoutError`` is an ``OSError``)."""


def classify(error: BaseException) -> Fault:
    """The :class:`Fault` of ``error`` (see the module docstring for why each is what it is).

    Any other Redis error (a ``ResponseError`` and its kin, ``ClusterError``,
    ``RedisClusterException``) is a reply about the call, so :attr:`Fault.CALL`.
    """
    if isinstance(error, CALL_ONLY):
        return Fault.CALL
    if isinstance(error, SILENT):
        return Fault.SILENCE
    if isinstance(error, LOST):
        return Fault.LOST
    return Fault.CALL
