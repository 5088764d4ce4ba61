"""Scripted tour of the sidecar: start it, send requests, show where limits bite.

Run through ``scripts/demo``. Every process it starts is stopped on exit or Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from sidecar.client import build_request, describe, health_status, query

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "examples" / "config"


def free_port(preferred: int) -> int:
    """``preferred`` if it can be bound on loopback, else any free port."""
    for port in (preferred, 0):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(probe.getsockname()[1])
    raise RuntimeError("no free port on 127.0.0.1")


def start_sidecar(address: str) -> subprocess.Popen[bytes]:
    """Start ``ratelimit-sidecar serve`` and wait until it reports SERVING."""
    command = [sys.executable, "-m", "sidecar", "serve", "--config", str(CONFIG)]
    env = {**os.environ, "RLS_GRPC_ADDRESS": address, "RLS_LOG_FORMAT": "console"}
    process = subprocess.Popen(command, env=env)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"sidecar exited with {process.returncode}")
        try:
            if health_status(address, timeout=0.5) == "SERVING":
                return process
        except Exception:
            time.sleep(0.1)
    process.kill()
    raise SystemExit("sidecar did not become SERVING within 15 s")


def burst(address: str, title: str, descriptors: list[str], count: int, show_last: bool = False) -> None:
    """Send ``count`` identical requests and print how many were admitted."""
    admitted = 0
    first_rejection = None
    response = None
    for index in range(count):
        response = query(address, build_request("demo", descriptors))
        if response.overall_code == 1:
            admitted += 1
        elif first_rejection is None:
            first_rejection = index + 1
    note = f", first 429 at request {first_rejection}" if first_rejection else ""
    print(f"\n{title}\n  {count} requests -> {admitted} admitted, {count - admitted} rejected{note}")
    if show_last and response is not None:
        print("  last response:")
        print("\n".join("    " + line for line in describe(response)))


def tour(address: str) -> None:
    """Send the scripted traffic; each step names the rule it exercises."""
    burst(
        address,
        "Per client address, 20/second (key-only rule: one counter per address)",
        ["remote_address=10.0.0.1"],
        25,
    )
    burst(address, "Another address has its own counter", ["remote_address=10.0.0.2"], 5)
    burst(
        address,
        "API key 'alice', 10/minute, plus the /api route cap of 50/second",
        ["generic_key=api", "generic_key=api,api_key=alice"],
        12,
        show_last=True,
    )
    burst(
        address,
        "Premium key: 100/minute, and 'replaces' lifts the route cap for it",
        ["generic_key=api", "generic_key=api,api_key=premium-bob"],
        5,
        show_last=True,
    )
    burst(
        address, "The monitoring key is unlimited", ["generic_key=api,api_key=internal-monitoring"], 5, show_last=True
    )
    burst(
        address,
        "Login attempts, 3/minute in shadow mode: reported OK, still counted",
        ["generic_key=login,remote_address=10.0.0.3"],
        5,
        show_last=True,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--once", action="store_true", help="run the tour and stop")
    parser.add_argument("--port", type=int, default=8081, help="preferred gRPC port (default 8081)")
    arguments = parser.parse_args()
    address = f"127.0.0.1:{free_port(arguments.port)}"
    print(f"Starting the sidecar on {address} with {CONFIG.relative_to(ROOT)} (in-memory backend)")
    process = start_sidecar(address)
    try:
        tour(address)
        if not arguments.once:
            print(
                f"\nThe sidecar keeps running on {address}. Try:\n"
                f"  .venv/bin/ratelimit-sidecar query --address {address} --domain demo remote_address=10.9.9.9\n"
                "Ctrl-C stops it."
            )
            signal.sigwait({signal.SIGINT, signal.SIGTERM})
    except KeyboardInterrupt:
        pass
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
    print("\nDemo stopped.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
