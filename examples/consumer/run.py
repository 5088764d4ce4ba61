"""Run the example end to end: redis-server, two sync-mode sidecars, the provider, the consumer service.

    .venv/bin/python -m examples.consumer.run                 # 4 replicas x 10 callers, 5 s
    .venv/bin/python -m examples.consumer.run --replicas 6 --workers 20 --max-wait 2

Run from the repository root, as a module: the stack's launchers (``stack/``, not installed)
come from the checkout, the sidecar from the installed package, as a user's code gets it.
Everything is started with the stack's launchers (``stack.redis.RedisProcess``,
``stack.sidecar.SidecarProcess``, one ``stack.processes.ProcessGroup``) on free 127.0.0.1
ports and stopped at the end. While the consumer service runs, Redis's window keys are read
every 250 ms (each lives 5 s past its window). Prints one JSON document: what the provider
saw per second (by the second each call's slot was granted, and by arrival), Redis's count
per window, and the consumer's own figures; exit status 1 when the provider saw more than
the limit plus sync mode's bound granted in one second, a caller
waited past ``--max-wait`` plus the client's answer slack (``ANSWER_SLACK``), or Redis's
count differs from the hits the sidecars admitted (beyond asks cut by their gRPC deadline).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import redis

from sidecar.consumer import ANSWER_SLACK
from stack.processes import Child, free_port, process_group, tcp_answers
from stack.redis import RedisProcess
from stack.sidecar import SidecarProcess

HERE = Path(__file__).resolve().parent

LIMIT = 20
BOUND = 1
"""Sync mode's overshoot bound with 2 replicas at 20/s: (R - 1) * floor(0.05 * 20 / (R - 1)) = 1 (docs/redis.md)."""
SCHEDULING = 0.1
"""Slack for timers on a loaded machine: they fire late, never early."""
PREFIX = "consumer-example"


class ProviderProcess(Child):
    ready_sign = "a listening socket"

    def __init__(self, directory: Path) -> None:
        self.port = free_port()
        super().__init__("provider", [sys.executable, str(HERE / "provider.py"), "--port", str(self.port)],
                         directory / "provider.log")  # fmt: skip

    def ready(self) -> bool:
        return tcp_answers(self.port)


def sidecar_args(redis_url: str) -> list[str]:
    return [
        *("--config", str(HERE / "config"), "--backend", "redis", "--mode", "sync", "--redis-url", redis_url),
        *("--redis-prefix", PREFIX, "--heartbeat-interval", "0.2", "--log-level", "warning"),
    ]


def sample_windows(client: Any, seen: dict[str, int], stop: threading.Event) -> None:
    """The largest value seen of every window key: ``PREFIX:{digest}:<window start>``."""
    pattern = re.compile(re.escape(PREFIX) + r":\{[0-9a-f]+\}:(\d+)$")
    while True:
        for key in client.scan_iter(f"{PREFIX}:*", count=1000):
            if pattern.match(key):
                value = client.get(key)
                if value is not None:
                    seen[key] = max(seen.get(key, 0), int(value))
        if stop.wait(0.25):
            return


def run(arguments: argparse.Namespace, directory: Path) -> dict[str, Any]:
    with process_group() as group:
        redis_server = group.start_ready(lambda: RedisProcess(directory))
        sidecars = group.start_all_ready(
            [lambda n=n: SidecarProcess(f"sidecar-{n}", sidecar_args(redis_server.url), directory) for n in range(2)]
        )
        provider = group.start_ready(lambda: ProviderProcess(directory))
        client = redis.Redis.from_url(redis_server.url, decode_responses=True)
        deadline = time.monotonic() + 10
        while client.zcard(f"{PREFIX}:replicas") < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # a heartbeat or two: each sidecar counts the other
        seen: dict[str, int] = {}
        stop = threading.Event()
        sampler = threading.Thread(target=sample_windows, args=(client, seen, stop))
        sampler.start()
        try:
            done = subprocess.run(
                [
                    sys.executable, str(HERE / "consumer.py"), "--sidecars", ",".join(s.address for s in sidecars),
                    "--provider", f"127.0.0.1:{provider.port}", "--replicas", str(arguments.replicas),
                    "--workers", str(arguments.workers), "--seconds", str(arguments.seconds),
                    "--max-wait", str(arguments.max_wait),
                ],
                capture_output=True, text=True, check=True, timeout=arguments.seconds + 120,
            )  # fmt: skip
            time.sleep(0.5)  # the sidecars' last flushes to Redis (every 50 ms)
        finally:
            stop.set()
            sampler.join()
        sample_windows(client, seen, _set())  # one last read
        with urllib.request.urlopen(f"http://127.0.0.1:{provider.port}/stats", timeout=5) as reply:
            stats = json.load(reply)
        per_second = {int(k): v for k, v in stats["per_second"].items()}
        per_grant_second = {int(k): v for k, v in stats["per_grant_second"].items()}
    consumer = json.loads(done.stdout.strip().splitlines()[-1])
    windows: dict[int, int] = {}
    for key, value in seen.items():
        start = int(key.rsplit(":", 1)[1])
        windows[start] = windows.get(start, 0) + value
    full = sorted(per_second)[1:-1]  # the first and last seconds of the run are partial
    problems = []
    # A window's budget is checked against the calls granted in it: the time between a grant
    # and the call's arrival is the caller's, and can carry a call into the provider's next second.
    if any(calls > LIMIT + BOUND for calls in per_grant_second.values()):
        problems.append(f"the provider saw more than {LIMIT} + {BOUND} calls granted in one second")
    answered_by = arguments.max_wait + ANSWER_SLACK + SCHEDULING
    if consumer["longest_wait"] > answered_by:
        problems.append(f"a caller waited {consumer['longest_wait']:.3f} s")
    if consumer["longest_failure"] > answered_by:
        problems.append(f"a caller failed after {consumer['longest_failure']:.3f} s")
    # An ask cut by its gRPC deadline (unanswered) may or may not have been admitted.
    if not consumer["granted"] <= sum(windows.values()) <= consumer["granted"] + consumer["unanswered"]:
        problems.append(f"Redis holds {sum(windows.values())} hits for {consumer['granted']} admitted")
    return {
        "limit": LIMIT,
        "bound": BOUND,
        "max_wait": arguments.max_wait,
        "provider_per_grant_second": [per_grant_second[second] for second in sorted(per_grant_second)],
        "provider_per_second": [per_second[second] for second in sorted(per_second)],
        "provider_full_seconds": [per_second[second] for second in full],
        "redis_per_window": [windows[start] for start in sorted(windows)],
        "redis_hits": sum(windows.values()),
        "consumer": consumer,
        "problems": problems,
    }


def _set() -> threading.Event:
    event = threading.Event()
    event.set()
    return event


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=4, help="consumer service processes")
    parser.add_argument("--workers", type=int, default=10, help="concurrent callers per replica")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--max-wait", type=float, default=1.0)
    arguments = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="consumer-example-") as directory:
        result = run(arguments, Path(directory))
    print(json.dumps(result, indent=2))
    return 1 if result["problems"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
