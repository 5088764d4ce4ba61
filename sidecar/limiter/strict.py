"""``strict`` mode: every request is decided by Redis in one atomic round trip.

This is the envoyproxy/ratelimit design, made all-or-nothing: ``decide.lua`` reads
every counter of the request, applies :func:`protocol.decide` and adds the hits only
if the request is admitted, so the Redis counters equal the admitted hits and no
replica can overshoot a limit while Redis answers within the budget
(``--redis-timeout``). When it does not, the request is decided by the failure
policy and the hits it admits are reconciled to Redis once Redis is back.

Reconciliation is exact per counter: hits owed for a counter are sent inside the next
request's script for that counter (so the decision sees them), or by a background
flush; while a flush for a counter is on the wire, requests on that counter stay
with the failure policy rather than ask Redis a question it cannot answer yet.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

import structlog

from sidecar.limiter.failure import FailurePolicy
from sidecar.limiter.keys import counter_digest, expire_at, window_key
from sidecar.limiter.protocol import Check, Decision, Role
from sidecar.limiter.redis_store import RedisStore, RedisUnavailable, stop_task
from sidecar.limiter.replicas import Replicas
from sidecar.limiter.windows import window_start
from sidecar.settings import Settings

log = structlog.get_logger(__name__)

RECONCILE_RETRY = 0.1
"""Seconds between two failed reconciliations while Redis still counts as available."""
KNOWN_CAP = 100_000
"""Counters whose last Redis count is remembered (about 15 MB at most)."""


class StrictLimiter:
    """Limiter backend for ``--backend redis --mode strict``."""

    def __init__(
        self,
        store: RedisStore,
        replicas: Replicas,
        policy: FailurePolicy,
        *,
        prefix: str = "rls",
        admit_all: bool = False,
    ) -> None:
        self.store = store
        self.replicas = replicas
        self.policy = policy
        self.prefix = prefix
        self.admit_all = admit_all
        self.redis_decisions = 0
        self._reconciler: asyncio.Task[None] | None = None
        self._known: dict[str, int] = {}
        """Last count Redis reported per window key, so ``local`` failure mode shares what is left."""
        store.add_listener(policy.on_redis_state)

    @classmethod
    def from_settings(cls, settings: Settings) -> StrictLimiter:
        """Store, heartbeats and failure policy as the settings say."""
        store = RedisStore.from_settings(settings)
        replicas = Replicas(store, settings.heartbeat_interval)
        policy = FailurePolicy(
            settings.redis_failure_mode,
            lambda: replicas.live,
            admit_all=settings.shadow_mode,
            max_counters=settings.max_counters,
        )
        return cls(store, replicas, policy, prefix=settings.redis_prefix, admit_all=settings.shadow_mode)

    async def start(self) -> None:
        """Connect (or start probing), join the replica set, start reconciling."""
        await self.store.start()
        await self.replicas.start()
        self._reconciler = asyncio.get_running_loop().create_task(self._reconcile_forever(), name="strict-reconcile")

    async def check(self, checks: Sequence[Check], now: float) -> Decision:
        """One EVALSHA within the budget; the failure policy when Redis cannot answer."""
        keys = [
            window_key(self.prefix, counter_digest(check.key), window_start(now, check.unit_seconds))
            for check in checks
        ]
        expire_ats = [expire_at(window_start(now, check.unit_seconds), check.unit_seconds) for check in checks]
        policy = self.policy
        if self.store.available and not policy.busy(keys):
            owed = policy.take(keys)
            try:
                admitted, counts, _ = await self.store.decide(keys, checks, expire_ats, self.admit_all, owed)
            except RedisUnavailable:
                # A timed-out script may have run: re-sending its owed hits can count them
                # twice, which errs towards rejecting, never towards overshooting.
                policy.restore(owed)
            else:
                policy.settle(owed)
                self.redis_decisions += 1
                self._remember(keys, checks, counts, admitted)
                return Decision(
                    admitted,
                    tuple(count > check.limit for count, check in zip(counts, checks, strict=True)),
                    tuple(counts),
                    tuple(check.limit for check in checks),
                )
        return policy.check(checks, keys, expire_ats, now, known=self._known)

    def _remember(self, keys: Sequence[str], checks: Sequence[Check], counts: Sequence[int], admitted: bool) -> None:
        """Keep each counter's count after this request, as Redis reported it.

        Bounded by :data:`KNOWN_CAP`: past it everything is forgotten at once, which only
        makes a later outage share out whole limits again for the counters forgotten.
        """
        known = self._known
        if len(known) >= KNOWN_CAP:
            known.clear()
        admit_all = self.admit_all
        for key, check, count in zip(keys, checks, counts, strict=True):
            spent = admitted and (admit_all or count <= check.limit or check.role is Role.SHADOW)
            known[key] = count if spent else count - check.hits

    async def reconcile(self) -> bool:
        """Send every owed hit to Redis in one round trip; False if Redis failed (hits kept)."""
        owed = self.policy.drain_admitted()
        if not owed:
            return True
        try:
            totals = await self.store.flush(owed)
        except RedisUnavailable:
            self.policy.restore(owed)
            return False
        self.policy.settle(owed)
        refused = [key for key in owed if key not in totals]
        if refused:
            log.error("owed_hits_refused", keys=len(refused), hits=sum(owed[key][0] for key in refused))
        return True

    async def close(self) -> None:
        """Leave the replica set, send what is still owed (waiting a little for Redis), close."""
        if self._reconciler is not None:
            await stop_task(self._reconciler)
        await self.replicas.close()
        if self.policy.owes():
            if not await self.store.probe():
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.store.background_timeout):
                        await self.store.wait_available()
            await self.reconcile()
        (log.warning if self.policy.owed_hits else log.info)(
            "strict_closed",
            redis_decisions=self.redis_decisions,
            failure_decisions=self.policy.decisions,
            unreconciled_hits=self.policy.owed_hits,
            dropped_hits=self.policy.dropped_hits,
            redis_round_trips_request_path=self.store.round_trips_request_path,
            redis_round_trips_background=self.store.round_trips_background,
        )
        await self.store.close()

    async def _reconcile_forever(self) -> None:
        """Whenever hits are owed and Redis is available, flush them."""
        while True:
            await self.policy.wait_owed()
            await self.store.wait_available()
            if not await self.reconcile():
                # Usually the failed flush marked Redis unavailable and the next wait blocks;
                # the pause keeps a failure that does not do so from spinning this loop.
                await asyncio.sleep(RECONCILE_RETRY)
