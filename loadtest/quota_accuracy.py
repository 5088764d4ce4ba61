"""Quota mode across replicas, end to end: 3 real Envoys, 3 sidecars, one redis-server.

Why: issue 16's goals are about what Envoy admits when its shares come through Redis:
total admitted per second vs the limit, time to converge after a demand shift, false
rejections, and no double allocation after a replica dies. Each replica is a real Envoy 1.40
(the quota filter of ``stack/quota_envoy.py``, ``--concurrency 1``) calling its
own sidecar (``python -m sidecar serve --backend redis``); all sidecars share one
redis-server; the sample app answers. A Python client paces requests to each Envoy at
the scenario's rates and counts, per second and per replica, 200s and 429s.

Scenarios (each on a fresh bucket; limit ``--limit`` per second, demand 1.5x the limit):
``balanced`` (1/3 each), ``skewed`` (80/10/10), ``shift`` (80/10/10, then 10/10/80),
``paused`` (skewed; Redis under ``CLIENT PAUSE`` for 12 s mid-run), ``killed`` (balanced;
replica 3's sidecar and Envoy are killed mid-run, the other two then ask for everything).
``cluster_failover`` (balanced, on a stack of its own: the sidecars on a 6-node Redis Cluster,
3 masters with a replica each, node timeout 2 s, full coverage off; the master holding the
bucket's share keys is SIGKILLed mid-run and its replica promoted; ``loadtest/quota_failover.py``)
is run only when named.

Reported per scenario: total admitted / limit after the first 12 s (two reports), the worst
second against the limit and against limit + the replicas' bucket sizes (the bound, 2x the
limit for a per-second rule), false rejections (429s in seconds whose global total was
below 95% of the limit), convergence (shift: seconds until the total is within 5% of the
limit and replica 3 has at least 90% of its fair share; killed: seconds until the two
survivors admit 95% of the limit, which must not come before the dead lease ends;
cluster_failover: seconds from the kill until every later second is within 5% of the limit).

    python -m loadtest.quota_accuracy                      # all scenarios, ~4 minutes; per second on stderr
    python -m loadtest.quota_accuracy --scenarios shift killed --limit 300
    python -m loadtest.quota_accuracy --scenarios cluster_failover   # ~1 minute

Only 127.0.0.1; every child is stopped at the end, also on Ctrl-C, SIGTERM or error.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from loadtest.common import run_cli
from loadtest.quota_failover import CLUSTER_SCENARIOS, kill_share_master, outage_seen, recovery, start_cluster
from loadtest.reliability_harness.store_topology import ClusterStore
from stack.processes import ProcessGroup
from stack.quota_envoy import QuotaEnvoy, quota_sidecar
from stack.redis import RedisProcess
from stack.sidecar import SidecarProcess
from stack.upstream import UpstreamProcess

TTL = 6
"""``--quota-ttl``: the lease is TTL + two reports = 16 s."""
LEASE = TTL + 10
WARMUP = 12
SCENARIOS = ("balanced", "skewed", "shift", "paused", "killed")
ALL_SCENARIOS = SCENARIOS + CLUSTER_SCENARIOS


def config_text(limit: int) -> str:
    return (
        "domain: quota\ndescriptors:\n  - key: tier\n    value: shared\n    descriptors:\n"
        f"      - key: client\n        rate_limit: {{unit: second, requests_per_unit: {limit}}}\n"
    )


@dataclass
class Tally:
    """Per second since the scenario started: [admitted, denied] per replica."""

    seconds: dict[int, list[list[int]]] = field(default_factory=dict)

    def add(self, second: int, replica: int, ok: bool) -> None:
        row = self.seconds.setdefault(second, [[0, 0], [0, 0], [0, 0]])
        row[replica][0 if ok else 1] += 1


async def pace(
    url_port: int, bucket: str, rate: list[float], replica: int, tally: Tally, *, stop: float, t0: float
) -> None:
    """Send to one Envoy at ``rate[replica]`` per second (read live: scenarios change it) on one
    keep-alive connection, counting 200 / 429 per second."""
    reader, writer = await asyncio.open_connection("127.0.0.1", url_port)
    request = (f"GET / HTTP/1.1\r\nHost: app\r\nx-tier: shared\r\nx-client: {bucket}\r\n\r\n").encode()
    due = time.monotonic()
    try:
        while time.monotonic() < stop:
            if rate[replica] <= 0:
                await asyncio.sleep(0.05)
                due = time.monotonic()
                continue
            due += 1.0 / rate[replica]
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            sent = time.monotonic()
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head.split(b" ", 2)[1])
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            if length:
                await reader.readexactly(length)
            tally.add(int(sent - t0), replica, status == 200)
    except (ConnectionError, asyncio.IncompleteReadError):
        pass  # the Envoy was killed
    finally:
        writer.close()


def pause_redis(redis: RedisProcess, milliseconds: int) -> None:
    """``CLIENT PAUSE`` every client of ``redis`` for ``milliseconds`` (a raw RESP call: no client library)."""
    with socket.create_connection(("127.0.0.1", redis.port), timeout=2) as connection:
        connection.sendall(f"CLIENT PAUSE {milliseconds} ALL\r\n".encode())
        answer = connection.recv(64)
    if not answer.startswith(b"+OK"):
        raise RuntimeError(f"CLIENT PAUSE refused: {answer!r}")


@dataclass
class Stack:
    group: ProcessGroup
    redis: RedisProcess | None
    envoys: list[QuotaEnvoy]
    sidecars: list[SidecarProcess]
    cluster: ClusterStore | None = None


def start_stack(directory: Path, limit: int, *, cluster: bool = False) -> Stack:
    """Three Envoys, each with its sidecar, on one redis-server or (``cluster``) a Redis Cluster."""
    group = ProcessGroup()
    try:
        return _start_stack(group, directory, limit, cluster)
    except BaseException:
        group.close()
        raise


def _start_stack(group: ProcessGroup, directory: Path, limit: int, cluster: bool) -> Stack:
    store = start_cluster(group, directory) if cluster else None
    redis = None if store else group.start_ready(lambda: RedisProcess(directory / "redis"))
    url = store.url if store else redis.url if redis else ""
    config = directory / "config"
    config.mkdir(parents=True, exist_ok=True)
    (config / "quota.yaml").write_text(config_text(limit))
    app = group.start_ready(lambda: UpstreamProcess("app", directory))
    flags = ("--backend", "redis", "--redis-url", url, "--quota-ttl", str(TTL), "--quota-idle-abandon", "60")
    sidecars = [
        group.start_ready(functools.partial(quota_sidecar, directory / f"s{index}", config, *flags))
        for index in range(3)
    ]
    envoys = [
        group.start_ready(functools.partial(QuotaEnvoy, directory / f"e{index}", app.port, sidecars[index].port))
        for index in range(3)
    ]
    return Stack(group, redis, envoys, sidecars, store)


@dataclass
class Outcome:
    name: str
    ratio: float
    worst: int
    bound: int
    false_rejections: int
    denied: int
    converge: str
    note: str = ""


def shares(total: float, split: Sequence[float]) -> list[float]:
    return [total * part for part in split]


async def scenario(name: str, stack: Stack, limit: int, seconds: int) -> Outcome:
    bucket = f"{name}-{time.time_ns()}"
    demand = 1.5 * limit
    even = (1 / 3, 1 / 3, 1 / 3)
    split = {"balanced": even, "killed": even, "cluster_failover": even}.get(name, (0.8, 0.1, 0.1))
    rate = shares(demand, split)
    tally = Tally()
    t0 = time.monotonic()
    stop = t0 + seconds
    connections = 4
    per = [value / connections for value in rate]
    tasks = [
        asyncio.create_task(pace(stack.envoys[replica].listen, bucket, per, replica, tally, stop=stop, t0=t0))
        for replica in range(3)
        if stack.envoys[replica].alive()
        for _ in range(connections)
    ]
    event_at = seconds // 2
    note = ""
    failover = None
    await asyncio.sleep(event_at)
    if name == "shift":
        per[:] = [value / connections for value in shares(demand, (0.1, 0.1, 0.8))]
    elif name == "paused" and stack.redis is not None:
        pause_redis(stack.redis, 12_000)
        note = "Redis paused 12 s"
    elif name == "killed":
        stack.envoys[2].kill()
        stack.sidecars[2].kill()
        per[:] = [demand / 2 / connections, demand / 2 / connections, 0.0]
    elif name == "cluster_failover" and stack.cluster is not None:
        failover = await kill_share_master(stack.cluster, bucket)
    await asyncio.gather(*tasks, return_exceptions=True)
    if failover is not None:
        note = f"{failover.note()}; {outage_seen(stack.sidecars, failover.victim)}"
    print(per_second(name, tally, limit), file=sys.stderr)
    return summarize(name, tally, limit, event_at, note)


def per_second(name: str, tally: Tally, limit: int) -> str:
    """Every second of a scenario: admitted/denied per replica, the total against the limit."""
    lines = [f"{name}: second | r1 admitted/denied | r2 | r3 | total admitted (limit {limit})"]
    for second, row in sorted(tally.seconds.items())[:-1]:
        cells = " | ".join(f"{admitted}/{denied}" for admitted, denied in row)
        lines.append(f"{name}: {second:3d} | {cells} | {sum(r[0] for r in row)}")
    return "\n".join(lines)


def summarize(name: str, tally: Tally, limit: int, event_at: int, note: str) -> Outcome:
    rows = sorted(tally.seconds.items())[:-1]  # the last second is partial
    totals = {second: sum(r[0] for r in row) for second, row in rows}
    after = [total for second, total in totals.items() if second >= WARMUP]
    false = sum(sum(r[1] for r in row) for second, row in rows if totals[second] < 0.95 * limit)
    denied = sum(sum(r[1] for r in row) for _, row in rows)
    converge = "-"
    if name == "shift":
        fair = limit - 2 * 0.1 * 1.5 * limit * 1.1
        for second, row in rows:
            if second >= event_at and totals[second] >= 0.95 * limit and row[2][0] >= 0.9 * fair:
                converge = f"{second - event_at} s"
                break
        else:
            converge = "no"
    if name == "killed":
        early = [totals[s] for s, _ in rows if event_at + 1 <= s < event_at + LEASE - 1]
        for second, _ in rows:
            if second > event_at and totals[second] >= 0.95 * limit:
                converge = f"{second - event_at} s (lease {LEASE} s)"
                break
        else:
            converge = "no"
        note = f"survivors before the lease ended: max {max(early, default=0)}/s"
    if name == "cluster_failover":
        after_kill = recovery(totals, limit, event_at)
        over = sum(total > 2 * limit for total in totals.values())
        converge = after_kill.back
        note = f"{note}; from the kill {after_kill.lowest}-{after_kill.highest}/s; seconds over the bound: {over}"
    if name in {"shift", "killed"}:
        after = [total for second, total in totals.items() if second >= event_at + 12]
    ratio = sum(after) / (len(after) * limit) if after else 0.0
    worst = max(totals.values(), default=0)
    return Outcome(name, ratio, worst - limit, worst - 2 * limit, false, denied, converge, note)


def table(outcomes: Sequence[Outcome], limit: int) -> str:
    lines = [
        f"limit {limit}/s, demand 1.5x; quota TTL {TTL} s, lease {LEASE} s",
        "| scenario | admitted / limit (settled) | worst second - limit | worst - (limit + bucket sizes)"
        " | false rejections (of all 429s) | convergence | note |",
        "|---|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        lines.append(
            f"| {o.name} | {o.ratio:.3f} | {o.worst:+d} | {o.bound:+d} | {o.false_rejections} ({o.denied})"
            f" | {o.converge} | {o.note} |"
        )
    return "\n".join(lines)


async def run_all(stack: Stack, names: Sequence[str], limit: int, seconds: int) -> list[Outcome]:
    outcomes = []
    for name in names:
        length = seconds + {"shift": 15, "killed": 15, "cluster_failover": 10}.get(name, 0)
        outcome = await scenario(name, stack, limit, length)
        print(table([outcome], limit).splitlines()[-1], file=sys.stderr)
        outcomes.append(outcome)
        await asyncio.sleep(1)
    return outcomes


def run_stack(names: Sequence[str], limit: int, seconds: int, *, cluster: bool) -> list[Outcome]:
    with tempfile.TemporaryDirectory(prefix="quota-accuracy-") as directory:
        stack = start_stack(Path(directory), limit, cluster=cluster)
        try:
            return asyncio.run(run_all(stack, names, limit, seconds))
        finally:
            stack.group.close()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m loadtest.quota_accuracy", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--scenarios", nargs="+", choices=ALL_SCENARIOS, default=list(SCENARIOS), help="cluster_failover: only if named"
    )
    parser.add_argument("--limit", type=int, default=200)
    parser.add_argument("--seconds", type=int, default=30)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    arguments = build_parser().parse_args(argv)
    names = [name for name in ALL_SCENARIOS if name in arguments.scenarios]  # killed last, then the Cluster's

    def run() -> int:
        outcomes: list[Outcome] = []
        for cluster in (False, True):  # the Cluster's scenarios on a stack of their own
            chosen = [name for name in names if (name in CLUSTER_SCENARIOS) == cluster]
            if chosen:
                outcomes += run_stack(chosen, arguments.limit, arguments.seconds, cluster=cluster)
        print(table(outcomes, arguments.limit))
        return 0

    return run_cli("python -m loadtest.quota_accuracy", run, (signal.SIGTERM,))


if __name__ == "__main__":
    sys.exit(main())
