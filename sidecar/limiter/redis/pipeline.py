"""What :meth:`~sidecar.limiter.redis.store.RedisStore.run_scripts` sends and how it reads errors.

Every script call of the Redis backends and of quota shares goes out as one of these
calls in one pipeline; the rules for a resend after ``NOSCRIPT`` and for an error reply
that speaks for Redis as a whole (not for one call) are written once, here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from redis.exceptions import BusyLoadingError, ClusterError, OutOfMemoryError, ReadOnlyError, ResponseError

from sidecar.limiter.redis.scripts import Script


class ScriptCall(NamedTuple):
    """One script call: ``EVALSHA script.sha len(keys) *keys *args``."""

    script: Script
    keys: Sequence[str]
    args: Sequence[int | str]


Command = tuple[Any, ...]
"""A plain command sent in the same pipeline as the scripts, as it is: ``("GET", key)``."""


def queue_calls(pipe: Any, calls: Sequence[ScriptCall | Command], *, with_body: bool, cluster: bool) -> None:
    """Queue ``calls`` on a pipeline: scripts by SHA, or, ``with_body`` (the resend of calls
    that met ``NOSCRIPT``), the first call of each script with its body.

    ``execute_command``, not ``pipe.evalsha``: redis-py blocks that method on Cluster
    pipelines, though Cluster routes ``EVALSHA`` by its keys like any command. On plain
    Redis the calls of a pipeline run in order on one connection, so the ``EVAL`` of the
    first call caches the script for the ``EVALSHA`` of the calls behind it; in Cluster
    they go to several nodes, so every resent call carries the body.
    """
    for command in commands_of(calls, with_body=with_body, cluster=cluster):
        pipe.execute_command(*command)


def commands_of(calls: Sequence[ScriptCall | Command], *, with_body: bool, cluster: bool) -> list[Command]:
    """The commands :func:`queue_calls` queues, as tuples (for a pipeline packed by hand)."""
    commands: list[Command] = []
    sent: set[str] = set()
    for call in calls:
        if not isinstance(call, ScriptCall):
            commands.append(call)
            continue
        script, keys, args = call
        if with_body and (cluster or script.sha not in sent):
            commands.append(("EVAL", script.source, len(keys), *keys, *args))
        else:
            commands.append(("EVALSHA", script.sha, len(keys), *keys, *args))
        sent.add(script.sha)
    return commands


def redis_away(reply: object) -> bool:
    """Whether an error reply says Redis as a whole cannot run calls now (loading, busy
    with another script, out of memory, a read-only replica, a moved slot), not that this
    call failed. Any other error reply is about the call (its script refused it).

    Callers that retry every call later raise on these (``away_raises``); none of them
    marks Redis down, since the node answered (:mod:`~sidecar.limiter.redis.faults`)."""
    if not isinstance(reply, BaseException):
        return False
    if isinstance(reply, BusyLoadingError | OutOfMemoryError | ReadOnlyError | ClusterError):
        return True
    if not isinstance(reply, ResponseError):
        return True
    return str(reply).startswith(("BUSY", "MASTERDOWN", "TRYAGAIN", "CLUSTERDOWN", "MOVED", "ASK", "NOSCRIPT"))
