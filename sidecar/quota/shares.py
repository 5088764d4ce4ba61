"""Shares of one global limit among replicas: max-min fair share and leases (pure).

Doorman's algorithm, in integers, on a clock the caller passes in. Nothing here talks
to Redis: ``lua/share.lua`` runs :func:`step` inside Redis, atomically per bucket, and
this module is its reference (a test runs both on the same inputs and compares).

* **Max-min fair share** (:func:`fair_shares`): replicas asking less than an equal share
  get what they ask; what is left is split evenly among the others; when everybody is
  satisfied, the rest is split evenly too (slack for growth), keeping back one equal
  share for a replica that has not asked yet. The sum never exceeds the capacity.
* **Leases** (:func:`grants`): a replica holds (``held``) what it last picked up, until
  ``held_until``. Capacity is handed to a growing replica only out of what no live lease
  holds: a shrinking replica's old lease stays reserved until it picks up its smaller
  grant or its lease expires. So at any moment ``sum(max(held, grant)) <= capacity``:
  whatever subset of replicas picks up, the leases in force never add up to more than
  the limit (no double allocation), including across a dead replica's lease running out.
* **Hold** (:attr:`Call.hold_ms`): a replica that stops calling may be dead or cut off
  from Redis, and nobody can tell which. Its last lease stays reserved ``hold_ms`` past
  its end, while the replica itself, if it is alive without Redis, enforces no more
  than that lease until then, and nothing after (``sidecar/quota/leases.py``). So the
  sum holds in every partition (docs/quota.md, "Across replicas").
* **Safe capacity** (:func:`safe_capacity`): a bucket that never heard from Redis
  starts at ``ceil(limit / live replicas)`` (the failure mode ``local`` rule).
* **Clamps** (:func:`clamped`): every number of a call is cut to what is physically
  possible before any arithmetic (demand and admitted at most the limit, the limit at
  most :data:`MAX_UNITS`), here and in the Lua alike: a client's report of 2^64-1 must
  not overflow a counter, nor ask for more than the whole limit.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from sidecar.limiter.shares import share_of_limit

LEAVE = -2
"""``demand`` of a call that gives the lease back (the bucket was abandoned)."""
POLL = -1
"""``demand`` of a call that only picks up (no new report since the last call)."""
MAX_UNITS = 2**48
"""The largest limit a call carries: far above any rule, exact in Lua's doubles (2^53)."""
MAX_MS = 2**45
"""The largest time or duration in milliseconds a call carries (about 1,100 years)."""


def fair_shares(demands: Mapping[str, int], capacity: int) -> dict[str, int]:
    """Integer max-min fair shares of ``capacity`` for ``demands`` (replica -> units wanted).

    Deterministic: ties and the indivisible remainder go in the order (demand, replica id).
    """
    order = sorted(demands, key=lambda replica: (demands[replica], replica))
    shares: dict[str, int] = {}
    left = max(0, capacity)
    for index, replica in enumerate(order):
        rest = len(order) - index
        equal = left // rest
        wanted = max(0, demands[replica])
        if wanted > equal:  # this one and every later one (they ask at least as much) share what is left
            extra = left - equal * rest
            for position, other in enumerate(order[index:]):
                shares[other] = equal + (1 if position < extra else 0)
            return shares
        shares[replica] = wanted
        left -= wanted
    if order and left > 0:
        # Everybody has what they asked: spread the slack, but keep one equal share back for
        # a replica that has not asked yet (it then gets capacity at once, not after a shrink).
        spread = left * len(order) // (len(order) + 1)
        each, extra = divmod(spread, len(order))
        for position, replica in enumerate(order):
            shares[replica] += each + (1 if position < extra else 0)
    return shares


def grants(targets: Mapping[str, int], reserved: Mapping[str, int], capacity: int) -> dict[str, int]:
    """What each replica may pick up now, given what live leases still hold (``reserved``).

    A replica whose target is at most what it holds is offered its target (the capacity it
    gives back becomes free once it picks up, or its lease expires). Growing replicas
    share what no lease holds, in proportion to what they miss. Invariant (when the
    leases fit in ``capacity``): ``sum(max(reserved, grant)) <= capacity``.
    """
    held = {replica: max(0, reserved.get(replica, 0)) for replica in targets}
    free = capacity - sum(max(0, amount) for amount in reserved.values())
    result: dict[str, int] = {}
    missing: dict[str, int] = {}
    for replica in sorted(targets):
        target = targets[replica]
        if target <= held[replica]:
            result[replica] = target
        else:
            missing[replica] = target - held[replica]
    wanted = sum(missing.values())
    if wanted <= free:
        for replica in missing:
            result[replica] = targets[replica]
        return result
    room = max(0, free)
    for replica, need in missing.items():
        result[replica] = held[replica] + need * room // wanted
    return result


def safe_capacity(limit: int, live: int) -> int:
    """What one replica enforces without Redis once its lease expired: ``ceil(limit / live)``."""
    return share_of_limit(limit, max(1, live))


@dataclass(slots=True)
class Entry:
    """One replica's record in a bucket: what it asks, holds and is offered (``share.lua``)."""

    demand: int = 0
    held: int = 0
    held_until: int = 0
    """Milliseconds (the script's clock) at which the lease ends."""
    grant: int = 0
    """The replica's offer from the last computation: it holds it once it picks it up."""
    seen: int = 0
    """Milliseconds at which its demand was last published."""

    def encode(self) -> str:
        return f"{self.demand} {self.held} {self.held_until} {self.grant} {self.seen}"

    @classmethod
    def decode(cls, text: str) -> Entry:
        demand, held, held_until, grant, seen = (int(part) for part in text.split())
        return cls(demand, held, held_until, grant, seen)


@dataclass(slots=True)
class Bucket:
    """A bucket's state in Redis: the replicas hash, the meta hash and the window counters."""

    entries: dict[str, Entry] = field(default_factory=dict)
    master: str = ""
    master_until: int = 0
    unsettled: bool = False
    computed_at: int = -(2**52)
    slack: int = 0
    """Capacity no lease and no grant holds after the last computation: a new replica's first share."""
    used: dict[int, int] = field(default_factory=dict)
    """Window start -> admitted so far in that window (windowed buckets only)."""
    silent: int = 0
    """Units the last computation kept reserved for silent replicas (no demand for a while,
    lease and hold not over: dead or cut off). Reported to every caller: the metric an SRE
    alerts on while a replica is held."""


@dataclass(frozen=True, slots=True)
class Call:
    """The arguments of one ``share.lua`` call (one bucket, one replica)."""

    replica: str
    demand: int
    """Units wanted per window (:data:`POLL`: no new report; :data:`LEAVE`: give back)."""
    limit: int
    lease_ms: int
    stale_ms: int
    master_ms: int
    threshold_pct: int = 10
    """A demand change above this percentage makes the caller recompute the shares at once."""
    min_gap_ms: int = 1000
    """Event-driven computations (new, moved, moving) happen at most this often per bucket:
    each costs O(R)."""
    master_gap_ms: int = 5000
    """The master recomputes on its own at most this often (one report period): that is
    what hands a dead replica's expired lease on, and follows small drifts of demand."""
    window: int = -1
    """Window start (windowed buckets: shares of what is left in the window), or -1."""
    used_add: int = 0
    """Requests this replica's Envoy admitted since its last call (windowed buckets)."""
    hold_ms: int = 0
    """How long past its end a lease stays reserved once its replica stopped calling."""


def clamped(call: Call) -> Call:
    """``call`` with every number cut to what is physically possible (``share.lua`` does the
    same): the limit to [0, :data:`MAX_UNITS`], a demand to at most the limit (asking more
    than all of it gets the same share), admitted requests to [0, limit] (more than the
    limit spends the window all the same), durations to [0, :data:`MAX_MS`]."""
    if (  # the usual case, tested first with no tuple nor generator built: nothing to cut, no copy
        0 <= call.limit <= MAX_UNITS
        and (LEAVE <= call.demand <= call.limit)
        and 0 <= call.used_add <= call.limit
        and 0 <= call.lease_ms <= MAX_MS
        and 0 <= call.stale_ms <= MAX_MS
        and 0 <= call.master_ms <= MAX_MS
        and 0 <= call.min_gap_ms <= MAX_MS
        and 0 <= call.master_gap_ms <= MAX_MS
        and 0 <= call.hold_ms <= MAX_MS
        and 0 <= call.threshold_pct <= 1000
        and -1 <= call.window <= MAX_MS
    ):
        return call
    limit = min(max(0, call.limit), MAX_UNITS)
    demand = call.demand if call.demand in (POLL, LEAVE) else min(max(0, call.demand), limit)

    def ms(value: int) -> int:
        return min(max(0, value), MAX_MS)

    return replace(
        call,
        limit=limit,
        demand=demand,
        used_add=min(max(0, call.used_add), limit),
        lease_ms=ms(call.lease_ms),
        stale_ms=ms(call.stale_ms),
        master_ms=ms(call.master_ms),
        min_gap_ms=ms(call.min_gap_ms),
        master_gap_ms=ms(call.master_gap_ms),
        hold_ms=ms(call.hold_ms),
        threshold_pct=min(max(0, call.threshold_pct), 1000),
        window=min(max(-1, call.window), MAX_MS),
    )


@dataclass(frozen=True, slots=True)
class Reply:
    grant: int
    replicas: int
    """Replicas with a record in the bucket (the live count for safe capacity)."""
    unsettled: bool
    """Some grant is below its target or some lease above its grant: shares are still moving."""
    master: bool
    computed: bool
    capacity: int
    others: int = 0
    """An upper bound of what the other replicas' leases and grants hold (``capacity - slack -
    held``): while Redis is away, a replica's safe capacity leaves it to them until their
    leases have ended."""
    silent: int = 0
    """Units the bucket keeps reserved for silent replicas (:attr:`Bucket.silent`)."""


def _recompute(bucket: Bucket, capacity: int, now: int, stale_ms: int, hold_ms: int) -> None:
    demands: dict[str, int] = {}
    reserved: dict[str, int] = {}
    silent = 0
    for replica, entry in list(bucket.entries.items()):
        fresh = entry.seen > now - stale_ms
        live = entry.held_until + hold_ms > now  # dead or cut off: held for the hold too
        if not fresh and not live:
            del bucket.entries[replica]  # no demand for a while, its lease and hold have run out
            continue
        # A silent replica (no demand for a while) asks for what it holds until its hold ends:
        # nobody else may have it meanwhile, and it picks it up again if it comes back.
        demands[replica] = entry.demand if fresh else (entry.held if live else 0)
        reserved[replica] = entry.held if live else 0
        silent += 0 if fresh else reserved[replica]
    targets = fair_shares(demands, capacity)
    offers = grants(targets, reserved, capacity)
    unsettled = False
    taken = 0
    for replica, entry in bucket.entries.items():
        entry.grant = offers[replica]
        taken += max(reserved[replica], offers[replica])
        if offers[replica] != targets[replica] or reserved[replica] > offers[replica]:
            unsettled = True
    bucket.unsettled = unsettled
    bucket.computed_at = now
    bucket.slack = max(0, capacity - taken)
    bucket.silent = silent


def step(bucket: Bucket, call: Call, now: int) -> Reply:
    """One ``share.lua`` call on ``bucket`` at ``now`` (ms): publish, compute, pick up.

    1. The caller's demand is recorded (and, windowed, its admitted requests are added to
       the window's counter and taken off what its lease holds).
    2. Every grant is recomputed (O(replicas)) by the bucket's master (a lease of
       ``master_ms`` in the meta hash, taken when free) once the last computation is
       ``master_gap_ms`` old, and by any caller that is new, whose demand moved by more
       than ``threshold_pct``, or while shares are still moving, once it is ``min_gap_ms``
       old; otherwise a new caller takes its first grant from the slack the last
       computation left (O(1)), and a moved one flags the bucket.
    3. The caller picks up its grant: it holds it until ``now + lease_ms``. If that gave
       capacity back while others wait for it, the grants are computed again (at once if this
       call computed already, else as the gap allows).

    A lease stays reserved ``hold_ms`` past its end (a replica that stopped calling may be
    cut off, not dead). Every number is :func:`clamped` first.
    """
    call = clamped(call)
    if call.demand == LEAVE:
        if bucket.entries.pop(call.replica, None) is not None:
            bucket.unsettled = True
        return Reply(0, len(bucket.entries), bucket.unsettled, False, False, 0, 0, bucket.silent)
    entry = bucket.entries.get(call.replica)
    new = entry is None
    if entry is None:
        entry = bucket.entries[call.replica] = Entry()
    moved = False
    if call.demand >= 0:
        moved = abs(call.demand - entry.demand) * 100 > call.threshold_pct * max(entry.demand, 1)
        entry.demand = call.demand
        entry.seen = now
    capacity = call.limit
    if call.window >= 0:
        used = min(call.limit, bucket.used.get(call.window, 0) + call.used_add)
        bucket.used = {call.window: used}  # older windows expire
        capacity = max(0, call.limit - used)
        entry.held = max(0, entry.held - call.used_add)
    master = bucket.master == call.replica or bucket.master_until <= now
    if master:
        bucket.master, bucket.master_until = call.replica, now + call.master_ms
    age = now - bucket.computed_at
    computed = (master and age >= call.master_gap_ms) or (age >= call.min_gap_ms and (new or moved or bucket.unsettled))
    if computed:
        _recompute(bucket, capacity, now, call.stale_ms, call.hold_ms)
        if call.replica not in bucket.entries:  # a poll from a record gone stale and unleased
            entry.grant = 0
            bucket.entries[call.replica] = entry
    elif new:
        entry.grant = min(max(0, entry.demand), bucket.slack, capacity // len(bucket.entries))
        bucket.slack -= entry.grant
        bucket.unsettled = True
    elif moved:
        bucket.unsettled = True
    held = entry.held if entry.held_until + call.hold_ms > now else 0
    entry.held, entry.held_until = entry.grant, now + call.lease_ms
    if entry.grant < held and bucket.unsettled and (computed or now - bucket.computed_at >= call.min_gap_ms):
        _recompute(bucket, capacity, now, call.stale_ms, call.hold_ms)  # what it gave back goes to those waiting
        computed = True
    others = max(0, capacity - bucket.slack - entry.held)
    return Reply(entry.held, len(bucket.entries), bucket.unsettled, master, computed, capacity, others, bucket.silent)
