"""Clock skew between replicas: what it does to a limit, and the Redis-clock correction.

Two real sidecars in sync mode share one redis-server; the second one's clock is pushed
ahead by ``--clock-offset`` (100 ms, then 1 s). A client sends twice the limit of a
per-second rule (20/s), alternating between the replicas, for a few seconds, and the
harness counts what was admitted in each true second (this host's clock, which is also
Redis's: both run here). With ``--clock-source local`` the skewed replica cuts its windows
early, so some true seconds admit more than the limit (and its heartbeats, stamped in
the future, make the other replica drop it from the live count, which widens the blind
cap); with the default ``--clock-source redis`` both cut windows on Redis's clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from loadtest.reliability_harness.support import (
    CHANNEL_OPTIONS,
    METHOD,
    Child,
    Context,
    ProcessGroup,
    RedisProcess,
    Row,
    SidecarProcess,
    failed_row,
    process_group,
)
from sidecar.client import build_request

LIMIT = 20
"""``remote_address`` in examples/config: 20 per second."""
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "config"
SKEWS = (0.1, 1.0)
MARGIN = 0.05
"""Seconds kept free of calls after and before each true second boundary. A call is counted in
the second it was sent but judged in the window its sidecar's clock reads when it decides: the
Redis-clock correction is good to 25 ms (half of the slowest round trip sampled) and a busy core
adds latency, so a call sent 25 ms before a boundary (evenly spread, as before) could be judged
in the next window and show as a hit beyond the limit that no window admitted."""


def drive(addresses: list[str], seconds: float, rate: float) -> list[tuple[float, bool]]:
    """Send ``rate`` calls in each of ``seconds`` true seconds, evenly within it but ``MARGIN`` from
    its ends, alternating replicas; ``(sent at, admitted)`` each."""
    channels = [grpc.insecure_channel(address, options=CHANNEL_OPTIONS) for address in addresses]
    stubs = [channel.unary_unary(METHOD) for channel in channels]
    payload = build_request("demo", ["remote_address=198.51.100.200"]).SerializeToString()
    outcomes = []
    start = int(time.time()) + 1.0  # a true second boundary
    per_second = int(rate)
    spacing = (1.0 - 2 * MARGIN) / per_second
    try:
        for index in range(int(seconds) * per_second):
            second, slot = divmod(index, per_second)
            moment = start + second + MARGIN + slot * spacing
            time.sleep(max(0.0, moment - time.time()))
            sent = time.time()
            reply = stubs[index % len(stubs)](payload, timeout=2.0)
            outcomes.append((sent, reply[:2] == b"\x08\x01"))
    finally:
        for channel in channels:
            channel.close()
    return outcomes


def overshoot(outcomes: list[tuple[float, bool]]) -> tuple[int, int, int]:
    """``(admitted, hits beyond the limit summed over true seconds, worst second)``."""
    per_second: dict[int, int] = {}
    for sent, admitted in outcomes:
        if admitted:
            per_second[int(sent)] = per_second.get(int(sent), 0) + 1
    beyond = sum(max(0, count - LIMIT) for count in per_second.values())
    return sum(per_second.values()), beyond, max(per_second.values(), default=0)


@dataclass
class Replicas:
    """One run's two sidecars (the second skewed) on its own redis-server."""

    skew: float
    source: str
    addresses: list[str]
    children: list[Child]
    """Its redis-server, then its sidecars: stopped once it is driven, before the next run's drive."""


def builds(group: ProcessGroup, context: Context, skew: float, source: str) -> list[Callable[[], SidecarProcess]]:
    """Start one run's redis-server; its two sidecars' builds, to start with every other run's."""
    directory = context.directory / f"skew-{skew:g}-{source}"
    directory.mkdir(parents=True, exist_ok=True)
    redis = group.start_ready(lambda: RedisProcess(directory))
    flags = ["--config", str(EXAMPLES), "--backend", "redis", "--redis-url", redis.url, "--clock-source", source]
    flags += ["--heartbeat-interval", "0.2"]
    return [
        lambda: SidecarProcess("sidecar-1", flags, directory),
        lambda: SidecarProcess("sidecar-2", [*flags, "--clock-offset", str(skew)], directory),
    ]


def start_runs(group: ProcessGroup, context: Context, pairs: list[tuple[float, str]]) -> list[Replicas]:
    """Every run's processes, started together: one wait for all of them, not one per process."""
    sidecar_builds = []
    servers = []
    for skew, source in pairs:
        sidecar_builds += builds(group, context, skew, source)
        servers.append(group.children[-1])  # the run's redis-server, just started
    sidecars = group.start_all_ready(sidecar_builds)
    replicas = []
    for index, (skew, source) in enumerate(pairs):
        pair = sidecars[2 * index : 2 * index + 2]
        replicas.append(Replicas(skew, source, [child.address for child in pair], [servers[index], *pair]))
    return replicas


def one_run(context: Context, replicas: Replicas) -> Row:
    """Drive one run's replicas (already counting each other) and judge its true seconds."""
    skew, source = replicas.skew, replicas.source
    seconds = {"smoke": 3.0, "quick": 4.0, "full": 20.0}[context.size]
    outcomes = drive(replicas.addresses, seconds, 2 * LIMIT)
    admitted, beyond, worst = overshoot(outcomes)
    ideal = LIMIT * int(seconds)
    return Row(
        area="clock",
        scenario=f"replica clock +{skew * 1000:g} ms, windows on the {source} clock",
        load=f"{2 * LIMIT} req/s for {seconds:g} s, limit {LIMIT}/s",
        ok=beyond == 0 if source == "redis" else True,
        notes=f"admitted {admitted} (ideal {ideal}), {beyond} beyond the limit over true seconds, worst second {worst}",
        figures={"skew_seconds": skew, "admitted": admitted, "ideal": ideal, "beyond": beyond, "worst_second": worst},
    )


def runs(context: Context) -> list[tuple[float, str]]:
    """Every skew on both clocks; the smoke size leaves out the small skew on local clocks, whose
    overshoot the report shows but nothing checks (only the 1 s skew's must show)."""
    pairs = [(skew, source) for skew in SKEWS for source in ("local", "redis")]
    return [pair for pair in pairs if not (context.smoke and pair == (SKEWS[0], "local"))]


def run(context: Context) -> list[Row]:
    """The runs are driven one after another, each run's processes stopped after its drive;
    the runs not yet driven idle meanwhile (a heartbeat each 0.2 s, to their own redis-server)."""
    pairs = runs(context)
    rows = []
    with process_group() as group:
        try:
            ready = start_runs(group, context, pairs)
        except Exception as error:  # a failed scenario is a row, never a missing area
            return [failed_row("clock", scenario(skew, source), error) for skew, source in pairs]
        time.sleep(0.5)  # a few heartbeats: both count each other (or, skewed, fail to)
        for replicas in ready:
            try:
                rows.append(one_run(context, replicas))
            except Exception as error:
                rows.append(failed_row("clock", scenario(replicas.skew, replicas.source), error))
            # The next run's drive has only its own processes busy. The sidecars stop before their
            # redis-server: stopped together, one could spend seconds flushing to a server gone.
            group.stop(replicas.children[1:])
            group.stop(replicas.children[:1])
    return rows


def scenario(skew: float, source: str) -> str:
    return f"replica clock +{skew * 1000:g} ms ({source})"
