"""Availability per Redis Cluster master: one dead shard fails its own slots, not all.

One :class:`~sidecar.limiter.redis.availability.Availability` per master (named
``host:port``, as redis-py names it), with the same rules as a single Redis: a lost
connection marks the master down at once, a timeout does under the silence rule,
a reply refusing a call never does (:mod:`~sidecar.limiter.redis.faults`). Script
calls are grouped by the master that owns their first key's slot
(:meth:`ClusterNodes.run`), one pipeline per master, each with its own timeout and
its own failure, so a request whose keys all live on healthy masters is decided by
Redis while another master is down, and a request touching a down master gets the
failure mode at once (its calls are not sent; each fails as :class:`ShardUnavailable`).

Each down master is probed back (PING and the script loads on that node), after
refreshing redis-py's slot map: when the Cluster promotes a replica, the map names
the new master for those slots (fresh, so up), the old one has left it and is
forgotten, and its slots decide from Redis again.

What listeners hear (limiters reconcile, the failure policy logs): the Cluster as a
whole, which goes down only when every master is, as a single Redis does. One master
down is told per request (its requests' failure mode, ``redis_down``), in a log line
naming the node, in the per-node gauge, and to shard listeners
(:meth:`ClusterNodes.add_shard_listener`) with its slots, as is their return: a limiter
holds those slots' keys to its share until the outage is settled, as after a whole outage.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import structlog
from redis.exceptions import AskError, RedisError, ResponseError, TryAgainError

from sidecar.limiter.budget import Reason
from sidecar.limiter.redis.availability import FAILURES, Availability, RedisUnavailable, describe
from sidecar.limiter.redis.faults import Fault, classify
from sidecar.limiter.redis.pipeline import Command, ScriptCall
from sidecar.limiter.redis.scripts import SCRIPTS

if TYPE_CHECKING:
    from redis.asyncio.cluster import RedisCluster

    from sidecar.limiter.redis.store import RedisStore

log = structlog.get_logger(__name__)

NODE_MAX_BACKOFF = 0.25
"""Seconds between probes of a down master, at most: each probe also refreshes the slot
map, so a promoted replica takes over its slots within this much of its promotion."""
MAX_NODES = 64
"""Masters tracked at most (the per-node gauge's label set stays bounded)."""
REDIRECTS = (TryAgainError, AskError)
"""Replies saying the call did not run here (``MOVED`` is an ``AskError``): resent once, alone."""

Send = Callable[[Sequence[ScriptCall | Command]], Awaitable[list[Any]]]
"""Sends calls as one pipeline (and ``NOSCRIPT`` resends) to whichever node redis-py routes them."""
ShardListener = Callable[[bool, frozenset[int]], None]
"""Told ``(up, slots)`` when a master goes down (its slots then) and when those slots are
served again (it came back, or it left the slot map for a promoted replica)."""


class ShardUnavailable(RedisUnavailable):
    """The master owning this call's slot is down: the failure mode decides the request
    (the other masters' requests go on)."""


def unavailable_reason(error: BaseException, store: RedisStore, keys: Sequence[str]) -> Reason:
    """Why a request whose Redis call failed with ``error`` (a ``RedisUnavailable``) is
    the failure mode's: ``redis_down`` when Redis, or in Cluster the master owning one of
    its ``keys``, is known down (:class:`ShardUnavailable`: the call was not even sent; or
    the call's failure just marked that master down), as for a whole outage, since the
    request could not be decided by Redis whatever it asked; else ``redis_refused``, a
    call Redis answered with an error."""
    if isinstance(error, ShardUnavailable) or not store.available:
        return "redis_down"
    nodes = getattr(store, "nodes", None)  # a simulated store has none
    return "redis_down" if nodes is not None and nodes.down_for(keys) is not None else "redis_refused"


def first_key(call: ScriptCall | Command) -> str:
    """The key a call is routed by (every call of ours names its keys first)."""
    if isinstance(call, ScriptCall):
        return call.keys[0]
    return str(call[1])


class ClusterNodes:
    """Up/down state per Cluster master, its probes, and calls run per master."""

    def __init__(
        self,
        client: RedisCluster,
        whole: Availability,
        redis_timeout: float,
        background_timeout: float,
        secrets: tuple[str, ...] = (),
    ) -> None:
        self.client = client
        self.whole = whole
        """The Cluster as a whole: down when every master is (listeners hear of it)."""
        self.redis_timeout = redis_timeout
        self.background_timeout = background_timeout
        self._secrets = secrets
        self.nodes: dict[str, Availability] = {}
        self._shard_listeners: list[ShardListener] = []
        self._down_slots: dict[str, frozenset[int]] = {}
        """The slots each master known down owned when it went down."""

    # -- state -------------------------------------------------------------------------

    def node(self, name: str) -> Availability:
        """The state of master ``name`` (up when first seen: nothing has failed there yet)."""
        state = self.nodes.get(name)
        if state is None:
            state = Availability(
                lambda: self._probe(name),
                self.redis_timeout,
                self._secrets,
                lag=self.whole.lag,
                what=f"redis node {name}",
                max_backoff=NODE_MAX_BACKOFF,
            )
            state.add_listener(lambda up, reason: self._changed(name, up, reason))
            state.mark_up()
            if len(self.nodes) < MAX_NODES:
                self.nodes[name] = state
        return state

    def states(self) -> dict[str, bool]:
        """``{host:port: up}`` of every master tracked (the per-node gauge)."""
        return {name: state.available for name, state in self.nodes.items()}

    def down(self) -> list[str]:
        """The masters known down."""
        return [name for name, state in self.nodes.items() if not state.available]

    def call_only(self, error: BaseException) -> BaseException:
        """``error`` if it fails one call only, else a :class:`RedisUnavailable` saying so: a
        failure :meth:`run` left in a reply never marks the whole Cluster down."""
        if isinstance(error, RedisUnavailable) or classify(error) is Fault.CALL:
            return error
        return RedisUnavailable(f"redis cluster call failed: {describe(error)}")

    def note_timeout(self) -> None:
        """A caller stopped waiting (its budget ran out): every master whose oldest call has
        waited beyond the silence rule is marked down, and only those."""
        for state in list(self.nodes.values()):
            if state.available and state.silent_too_long():
                state.failed(TimeoutError("no answer within the request budget"), request_path=True)

    async def close(self) -> None:
        """Stop every probe."""
        for state in list(self.nodes.values()):
            await state.close()

    def add_shard_listener(self, listener: ShardListener) -> None:
        """Be told of each master's outage and its slots' return (the limiters hold those
        slots' keys to their share until the outage is settled: docs/redis.md)."""
        self._shard_listeners.append(listener)

    def _tell(self, up: bool, slots: frozenset[int]) -> None:
        if slots:
            for listener in self._shard_listeners:
                listener(up, slots)

    def _slots_of(self, name: str) -> frozenset[int]:
        """The slots ``name`` serves in redis-py's slot map (one pass over the map's 16384
        slots, once per master's outage)."""
        cache = self.client.nodes_manager.slots_cache
        return frozenset(slot for slot, nodes in cache.items() if nodes and nodes[0].name == name)

    def _changed(self, name: str, up: bool, reason: str) -> None:
        """A master went down or came back: a log line naming it; the whole follows."""
        if up:
            log.info("redis_node_recovered", node=name, down_nodes=self.down())
            self._tell(True, self._down_slots.pop(name, frozenset()))
            if not self.whole.available:
                self.whole.mark_up()
            return
        log.warning("redis_node_unavailable", node=name, reason=reason, down_nodes=self.down())
        self._down_slots[name] = self._slots_of(name)
        self._tell(False, self._down_slots[name])
        # Tried last when redis-py re-reads the slot map, and never its default node: a
        # re-read after any lost connection asks the default node for its COMMAND table,
        # and failing there would fail every call of every master.
        self.client.nodes_manager.move_node_to_end_of_cached_nodes(name)
        masters = self._masters()
        if masters and all(name in self.nodes and not self.nodes[name].available for name in masters):
            self.whole.mark_down(f"every Cluster master is down (last: {name}: {reason})")

    # -- calls -------------------------------------------------------------------------

    def owner(self, call: ScriptCall | Command) -> str:
        """The master that owns ``call``'s slot in redis-py's slot map (raises
        ``SlotNotCoveredError`` if none does)."""
        return self.owner_of(first_key(call))

    def owner_of(self, key: str) -> str:
        """The master that owns ``key``'s slot in redis-py's slot map."""
        return str(self.client.nodes_manager.get_node_from_slot(self.client.keyslot(key)).name)

    def down_for(self, keys: Sequence[str]) -> str | None:
        """Why a call on ``keys`` would fail at once (a master of theirs is known down), or None."""
        for key in keys:
            try:
                name = self.owner_of(key)
            except FAILURES:
                continue  # no slot map yet, or the slot not covered: the call itself will tell
            state = self.nodes.get(name)
            if state is not None and not state.available:
                return f"redis node {name} unavailable: {state.last_error}"
        return None

    async def run(self, calls: Sequence[ScriptCall | Command], send: Send, timeout: float, budget: bool) -> list[Any]:
        """Each master's calls in its own pipeline, concurrently; replies index-aligned.

        A master known down answers its calls with :class:`ShardUnavailable` at once;
        one that fails this round trip answers them with the failure its
        :class:`Availability` makes of it (down if the connection was lost). ``budget``:
        the timeout is the request budget (for the message).
        """
        try:
            await self.client.initialize()  # a no-op unless redis-py wants its slot map re-read
        except FAILURES as error:
            raise self.whole.failed(error, budget) from error  # no node gave a slot map
        replies: list[Any] = [None] * len(calls)
        groups: dict[str, list[int]] = {}
        for index, call in enumerate(calls):
            try:
                groups.setdefault(self.owner(call), []).append(index)
            except FAILURES as error:
                replies[index] = self.whole.failed(error, budget)  # no master for the slot: this call
        parts = list(groups.items())
        answers = await asyncio.gather(
            *(self._run_on(name, [calls[index] for index in indices], send, timeout, budget) for name, indices in parts)
        )
        for (_, indices), answered in zip(parts, answers, strict=True):
            for index, reply in zip(indices, answered, strict=True):
                replies[index] = reply
        return replies

    async def _run_on(
        self, name: str, calls: Sequence[ScriptCall | Command], send: Send, timeout: float, budget: bool
    ) -> list[Any]:
        """One master's calls: at once :class:`ShardUnavailable` if it is known down, else
        one round trip, then the calls it redirected, each alone (see :meth:`_resend`)."""
        state = self.node(name)
        if not state.available:
            return [ShardUnavailable(f"redis node {name} unavailable: {state.last_error}")] * len(calls)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        state.sent()
        try:
            async with asyncio.timeout(timeout):
                replies = await send(calls)
        except FAILURES as error:
            return [state.failed(error, budget)] * len(calls)
        lost = next(
            (reply for reply in replies if isinstance(reply, BaseException) and classify(reply) is not Fault.CALL), None
        )
        if lost is not None:  # the connection broke while the replies were read: the node failed
            failure = state.failed(lost, budget)
            return [
                failure if isinstance(reply, BaseException) and classify(reply) is not Fault.CALL else reply
                for reply in replies
            ]
        state.answered()
        redirected = [index for index, reply in enumerate(replies) if isinstance(reply, REDIRECTS)]
        if redirected:
            again = await asyncio.gather(
                *(self._resend(calls[index], replies[index], deadline - loop.time()) for index in redirected)
            )
            for index, reply in zip(redirected, again, strict=True):
                replies[index] = reply
        return replies

    async def _resend(self, call: ScriptCall | Command, first: BaseException, left: float) -> Any:
        """A call answered ``TRYAGAIN``/``ASK``/``MOVED`` did not run: send it again, alone,
        through redis-py's redirection handling, within the time left. The node answered,
        so however this ends, it fails this call only."""
        if isinstance(call, ScriptCall):  # with its body: the node it lands on may not cache it
            args: tuple[Any, ...] = ("EVAL", call.script.source, len(call.keys), *call.keys, *call.args)
        else:
            args = call
        try:
            async with asyncio.timeout(max(left, 0.0)):
                return await self.client.execute_command(*args)
        except TimeoutError:
            return RedisUnavailable(f"redis answered {type(first).__name__}; the resend did not end in time")
        except FAILURES as error:
            # A reply stays as it is (a corrupt key is noted from it); anything else,
            # even a lost connection to the node redirected to, fails this call only.
            if isinstance(error, ResponseError):
                return error
            return RedisUnavailable(f"redis answered {type(first).__name__}; the resend failed: {describe(error)}")

    # -- probes ------------------------------------------------------------------------

    def _masters(self) -> set[str]:
        return {str(node.name) for node in self.client.get_primaries()}

    async def refresh(self) -> None:
        """Ask the Cluster for its slot map again (redis-py tries every node it knows, the
        ones found down last), then let redis-py finish a re-read it asked for."""
        await self.client.nodes_manager.initialize()
        await self.client.initialize()

    async def probe_all(self) -> None:
        """The whole Cluster's probe: the slot map, then each master (PING, script loads),
        then redis-py's own re-read if it wants one, through a master that answered;
        raises if no master answers. A master that fails is marked down (and probed)."""
        async with asyncio.timeout(self.background_timeout):
            await self.client.nodes_manager.initialize()
        answered = 0
        for name in sorted(self._masters()):
            state = self.node(name)
            try:
                async with asyncio.timeout(self.background_timeout):
                    await self._ping_and_load(name)
            except FAILURES as error:
                if state.available:
                    state.mark_down(state.describe(error))
                continue
            state.mark_up()
            answered += 1
        if not answered:
            raise RedisError(f"no Cluster master answered (down: {', '.join(self.down()) or 'none known'})")
        async with asyncio.timeout(self.background_timeout):
            await self.client.initialize()

    async def _probe(self, name: str) -> None:
        """One master's probe: refresh the slot map; a master that left it (a replica took
        over) is forgotten, else PING and the script loads on it."""
        async with asyncio.timeout(self.background_timeout):
            await self.refresh()
            if name not in self._masters():
                state = self.nodes.pop(name, None)
                if state is not None:
                    state.retire()
                log.info("redis_node_left", node=name, reason="no longer a master in the slot map")
                self._tell(True, self._down_slots.pop(name, frozenset()))  # served by another master now
                raise RedisError(f"{name} left the slot map")
            await self._ping_and_load(name)

    async def _ping_and_load(self, name: str) -> None:
        node = self.client.get_node(node_name=name)
        if node is None:
            raise RedisError(f"{name} is not in the slot map")
        await node.execute_command("PING")
        for script in SCRIPTS:
            sha = await node.execute_command("SCRIPT", "LOAD", script.source)
            text = sha.decode() if isinstance(sha, bytes) else str(sha)
            if text != script.sha:
                raise RedisError(f"SCRIPT LOAD of {script.name} on {name} returned {text}, expected {script.sha}")
