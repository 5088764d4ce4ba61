"""How evenly waiting consumers spend a window's budget: sidecar.consumer against plain retry-on-429.

Starts its own redis-server and two sync-mode sidecar replicas on free 127.0.0.1 ports
(``--clock-source local``, so this host's clock cuts the same windows), with one limit of
``--limit`` per second, then runs ``--waiters`` callers for ``--seconds`` per strategy,
each calling again once served and done with its provider call (``--work``, 10 ms):

- ``retry-after``: refused, sleep the reported reset (whole seconds, as a client honouring
  ``Retry-After`` does) and ask again;
- ``boundary``: :class:`~sidecar.consumer.Consumer` with ``spread=False``: retry exactly at
  the window boundary, fresh asks at once;
- ``jitter``: :class:`~sidecar.consumer.Consumer` with ``pace=False``: retry at the boundary
  plus a uniform jitter over the window, fresh asks at once (what shipped first);
- ``consumer``: :class:`~sidecar.consumer.Consumer` as shipped: the jitter, and every ask
  paced at ``hits * T / (remaining + hits)`` after the previous one (time left in the
  window, hits left, from the sidecar's last answer).

For each, over the full windows of the run: admissions per window, the share of a window's
admissions in its busiest 100 ms and in its first 100 ms, and the coefficient of variation of
admissions over the window's ten 100 ms slices (0 for a perfectly even rate; 3 when all of
them land in one slice). Bounded: four runs of ``--seconds``, then everything is stopped.

    python -m loadtest.consumer_spread --waiters 40 --limit 20 --seconds 4
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sidecar.consumer import Consumer, RateLimitExceeded, refusal, request_payload

STRATEGIES = ("retry-after", "boundary", "jitter", "consumer")
SLICES = 10


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def wait_for_port(port: int, process: subprocess.Popen[bytes], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode}")
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on {port} within {timeout:.0f} s")


@contextmanager
def replicas(limit: int, directory: Path) -> Iterator[list[str]]:
    """redis-server and two sync-mode sidecars; yields their gRPC addresses; stops them all."""
    redis_binary = shutil.which("redis-server")
    if redis_binary is None:
        raise SystemExit("redis-server is not on PATH")
    config = directory / "config"
    config.mkdir()
    (config / "spread.yaml").write_text(
        f"domain: spread\ndescriptors:\n  - key: provider\n    rate_limit:\n      unit: second\n"
        f"      requests_per_unit: {limit}\n"
    )
    processes: list[subprocess.Popen[bytes]] = []
    try:
        redis_port = free_port()
        argv = [redis_binary, "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        processes.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=directory))
        wait_for_port(redis_port, processes[-1], "redis-server")
        addresses = []
        env = {name: value for name, value in os.environ.items() if not name.startswith("RLS_")}
        env["RLS_METRICS_ADDRESS"] = ""
        for _ in range(2):
            port = free_port()
            argv = [
                sys.executable, "-m", "sidecar", "serve", "--config", str(config), "--grpc-address",
                f"127.0.0.1:{port}", "--backend", "redis", "--mode", "sync", "--redis-url",
                f"redis://127.0.0.1:{redis_port}", "--clock-source", "local", "--heartbeat-interval", "0.2",
                "--log-level", "warning",
            ]  # fmt: skip
            processes.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env))
            wait_for_port(port, processes[-1], "sidecar")
            addresses.append(f"127.0.0.1:{port}")
        time.sleep(1.0)  # heartbeats: each replica counts the other
        yield addresses
    finally:
        for process in reversed(processes):
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()


async def run_strategy(strategy: str, addresses: list[str], waiters: int, seconds: float, work: float) -> list[float]:
    """Admission times (this host's Unix clock) of ``waiters`` callers for ``seconds``."""
    consumers = [
        Consumer(address, spread=strategy in ("jitter", "consumer"), pace=strategy == "consumer")
        for address in addresses
    ]
    admitted: list[float] = []
    stop_at = time.monotonic() + seconds
    payload = request_payload("spread", {"provider": "acme"}, 1)

    async def retry_after(consumer: Consumer) -> None:
        while time.monotonic() < stop_at:
            response = await consumer._ask(payload, timeout=consumer.rpc_timeout)
            if response.overall_code == 1:  # OK
                admitted.append(time.time())
                await asyncio.sleep(work)
            else:
                await asyncio.sleep(refusal(response).reset)

    async def waiting(consumer: Consumer) -> None:
        while time.monotonic() < stop_at:
            try:
                await consumer.acquire("spread", {"provider": "acme"}, max_wait=max(0.0, stop_at - time.monotonic()))
            except RateLimitExceeded:
                continue
            admitted.append(time.time())
            await asyncio.sleep(work)

    body: Callable[[Consumer], Any] = retry_after if strategy == "retry-after" else waiting
    await asyncio.gather(*(body(consumers[index % len(consumers)]) for index in range(waiters)))
    for consumer in consumers:
        await consumer.close()
    return admitted


def spread(admitted: list[float]) -> dict[str, float]:
    """The figures of one strategy, over the full windows (the first and last are partial)."""
    by_window: dict[int, list[float]] = {}
    for moment in admitted:
        by_window.setdefault(math.floor(moment), []).append(moment - math.floor(moment))
    full = sorted(by_window)[1:-1]
    counts, busiest, first, variation = [], [], [], []
    for start in full:
        offsets = by_window[start]
        slices = [0] * SLICES
        for offset in offsets:
            slices[min(SLICES - 1, int(offset * SLICES))] += 1
        counts.append(len(offsets))
        busiest.append(max(slices) / len(offsets))
        first.append(slices[0] / len(offsets))
        mean = statistics.fmean(slices)
        variation.append(statistics.pstdev(slices) / mean if mean else 0.0)
    return {
        "windows": float(len(full)),
        "per_window": statistics.fmean(counts) if counts else 0.0,
        "busiest_100ms": statistics.fmean(busiest) if busiest else 0.0,
        "first_100ms": statistics.fmean(first) if first else 0.0,
        "cv": statistics.fmean(variation) if variation else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--waiters", type=int, default=40)
    parser.add_argument("--limit", type=int, default=20)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--work", type=float, default=0.01, help="seconds a served caller works before calling again")
    arguments = parser.parse_args(argv)
    with (
        tempfile.TemporaryDirectory(prefix="consumer-spread-") as temporary,
        replicas(arguments.limit, Path(temporary)) as addresses,
    ):
        print(
            f"{arguments.waiters} waiters on 2 sync-mode replicas, limit {arguments.limit}/s, "
            f"{arguments.seconds:g} s per strategy, {arguments.work:g} s of work per call"
        )
        print(
            "| strategy | full windows | admitted per window | busiest 100 ms | first 100 ms | CV over 100 ms slices |"
        )
        print("|---|---|---|---|---|---|")
        for strategy in STRATEGIES:
            figures = spread(
                asyncio.run(run_strategy(strategy, addresses, arguments.waiters, arguments.seconds, arguments.work))
            )
            print(
                f"| {strategy} | {figures['windows']:.0f} | {figures['per_window']:.1f} | "
                f"{figures['busiest_100ms']:.0%} | {figures['first_100ms']:.0%} | {figures['cv']:.2f} |"
            )
            time.sleep(1.0)  # the next strategy starts in a fresh window
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
