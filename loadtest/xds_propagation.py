"""How long a limit change pushed by an xDS control plane takes to be applied by every replica.

Starts the project's control plane (``stack/xds_server.py``) on a directory of one limits
file and ``--replicas`` real sidecars with ``--config-source xds``, then changes the limit
``--rounds`` times. A sidecar ACKs a push only once the new config is swapped in, so for
each round it takes, from the control plane's own clock (its JSON lines carry a time):

* push to applied: from the push leaving the control plane to the last replica's ACK;
* edit to applied: from the file being replaced to the last ACK (adds the control
  plane's ``--poll`` look at the directory, which a real control plane does not have).

    python -m loadtest.xds_propagation                     # 3 replicas, 10 changes
    python -m loadtest.xds_propagation --replicas 5 --rules 2000

Bounded: at most ``--rounds`` changes, each given up after 30 s.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from stack.processes import process_group
from stack.sidecar import SidecarProcess
from stack.xds_server import XdsServerProcess, read_directory

ROUND_TIMEOUT = 30.0


def limits(per_hour: int, rules: int) -> str:
    """One domain: ``tenant`` allows ``per_hour``, plus ``rules - 1`` other keys (a larger config)."""
    lines = ["domain: bench", "descriptors:"]
    lines.append(f"  - key: tenant\n    rate_limit: {{unit: hour, requests_per_unit: {per_hour}}}")
    lines += [f"  - key: k{n}\n    rate_limit: {{unit: minute, requests_per_unit: {n + 1}}}" for n in range(rules - 1)]
    return "\n".join(lines) + "\n"


def publish(file: Path, text: str) -> float:
    """Replace the file at once; the wall-clock time it was replaced."""
    scratch = file.with_suffix(".tmp")
    scratch.write_text(text)
    os.replace(scratch, file)
    return time.time()


def applied(plane: XdsServerProcess, version: str, nodes: set[str]) -> tuple[float, float] | None:
    """(first push of ``version``, last ACK of it by ``nodes``), once every node ACKed it."""
    events = [event for event in plane.events() if event.get("version") == version]
    acks = {event["node"]: event["t"] for event in events if event["event"] == "ack"}
    sent = [event["t"] for event in events if event["event"] == "sent"]
    if not sent or set(acks) < nodes:
        return None
    return min(sent), max(acks[node] for node in nodes)


def wait_applied(plane: XdsServerProcess, version: str, nodes: set[str]) -> tuple[float, float]:
    deadline = time.monotonic() + ROUND_TIMEOUT
    while (found := applied(plane, version, nodes)) is None:
        if time.monotonic() > deadline:
            raise SystemExit(f"version {version} not ACKed by every replica within {ROUND_TIMEOUT} s")
        time.sleep(0.01)
    return found


def replica(node: str, server: str, base: Path) -> SidecarProcess:
    return SidecarProcess(node, ["--config-source", "xds", "--xds-server", server, "--xds-node-id", node], base)


def run(replicas: int, rounds: int, rules: int, poll: float) -> None:
    with tempfile.TemporaryDirectory() as scratch, process_group() as group:
        base = Path(scratch)
        directory = base / "limits"
        directory.mkdir()
        file = directory / "bench.yaml"
        publish(file, limits(1, rules))
        plane = group.start_ready(lambda: XdsServerProcess(directory, base, poll))
        nodes = {f"replica-{n}" for n in range(replicas)}
        group.start_all_ready([functools.partial(replica, node, plane.address, base) for node in sorted(nodes)])
        wait_applied(plane, read_directory(directory)[0], nodes)
        pushes, edits = [], []
        for round_ in range(rounds):
            edited = publish(file, limits(round_ + 2, rules))
            sent, last_ack = wait_applied(plane, read_directory(directory)[0], nodes)
            pushes.append(last_ack - sent)
            edits.append(last_ack - edited)
        report(replicas, rules, poll, pushes, edits)


def report(replicas: int, rules: int, poll: float, pushes: list[float], edits: list[float]) -> None:
    def ms(values: list[float]) -> str:
        return f"median {statistics.median(values) * 1000:.1f} ms, max {max(values) * 1000:.1f} ms"

    print(f"{len(pushes)} changes, {replicas} replicas, {rules} rules, control plane polling every {poll} s")
    print(f"push to applied by every replica: {ms(pushes)}")
    print(f"file edit to applied by every replica: {ms(edits)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--rules", type=int, default=50, help="rules in the pushed config")
    parser.add_argument("--poll", type=float, default=0.05, help="the control plane's look at its directory, s")
    args = parser.parse_args(argv)
    run(args.replicas, args.rounds, args.rules, args.poll)
    return 0


if __name__ == "__main__":
    sys.exit(main())
