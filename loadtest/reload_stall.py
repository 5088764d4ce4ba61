"""What a hot reload of a large valid config costs the request path (issue 21, defect 7).

Starts a real sidecar on a generated config of ``--rules`` rules, sends ShouldRateLimit
one call at a time (every ``--gap`` seconds) and reloads a changed copy of the config
with SIGHUP ``--reloads`` times, each once the previous one is logged. It prints the
p50/p99/max of the calls made while no reload ran and of those made during reloads,
and how long the reloads took, for each variant:

* ``before``: the sidecar with the reload GC handling turned off (how it was),
* ``after``: the sidecar as shipped,

and, with ``--explore``, the options measured on the way to the fix (``freeze``: only
``gc.freeze()`` after each load; ``pause``: only full collections paused during the
load; ``gc``: both; ``after`` adds the shorter GIL switch interval during the load;
``cyaml``: PyYAML's C parser, where libyaml is present, on top of ``after``).

    python -m loadtest.reload_stall                      # 14,000 rules, 3 reloads, before and after
    python -m loadtest.reload_stall --rules 3000 --variants after
    python -m loadtest.reload_stall --explore

Bounded: a variant runs at most ``--reloads`` reloads of at most 60 s each.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from loadtest.common import floor_percentile, positive_int
from sidecar.protos.envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from sidecar.protos.envoy.service.ratelimit.v3 import rls_pb2
from stack.processes import free_port, spawn
from stack.sidecar import serve_argv

VARIANT_ENV = "RELOAD_STALL_VARIANT"
VARIANTS = ("before", "after")
EXPLORE = ("before", "freeze", "pause", "gc", "after", "cyaml")
RELOAD_TIMEOUT = 60.0


def config_text(rules: int, limit: int) -> str:
    """One domain of ``rules`` key-only rules (~50 bytes each)."""
    lines = ["domain: stall", "descriptors:"]
    for index in range(rules):
        lines.append(f"  - key: k{index}")
        lines.append(f"    rate_limit: {{unit: minute, requests_per_unit: {limit}}}")
    return "\n".join(lines) + "\n"


def child() -> None:
    """The sidecar, with the variant named in ``RELOAD_STALL_VARIANT`` applied first."""
    variant = os.environ.get(VARIANT_ENV, "after")
    from sidecar.config import reload

    if variant in ("before", "pause", "freeze", "gc"):
        reload.LOAD_SWITCH_INTERVAL = 0
    if variant in ("before", "pause"):
        reload.FREEZE_AFTER_LOAD = False
    if variant in ("before", "freeze"):
        reload.PAUSE_GC_DURING_LOAD = False
    if variant == "cyaml":
        import yaml

        from sidecar.config import yaml_source

        if hasattr(yaml, "CSafeLoader"):
            # The C parser and composer under the same constructor (marks are kept).
            # (Composing happens in C: the compose-time node count is lost, which is one
            # reason the sidecar does not ship this.)
            class CMarked(yaml.CSafeLoader):  # type: ignore[misc,name-defined]
                nodes_built = 0

                def construct_object(self, node: Any, deep: bool = False) -> Any:
                    self.nodes_built += 1
                    if self.nodes_built > yaml_source.MAX_NODES:
                        raise yaml_source.YamlError("too many nodes", node.start_mark.line + 1)
                    return super().construct_object(node, deep=deep)

            CMarked.add_constructor(
                yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
                yaml_source._construct_mapping,  # type: ignore[arg-type]
            )
            yaml_source._MarkedLoader = CMarked  # type: ignore[misc,assignment]
    gc.collect()
    from sidecar.__main__ import main

    sys.argv = ["ratelimit-sidecar", *sys.argv[1:]]
    sys.exit(main())


def request(index: int) -> Any:
    return rls_pb2.RateLimitRequest(
        domain="stall",
        descriptors=[
            ratelimit_pb2.RateLimitDescriptor(
                entries=[ratelimit_pb2.RateLimitDescriptor.Entry(key=f"k{index}", value="v")]
            )
        ],
    )


def quantiles(latencies: Sequence[float]) -> dict[str, float]:
    def at(fraction: float) -> float:
        return round(floor_percentile(latencies, fraction) * 1000, 1)

    return {"calls": len(latencies), "p50_ms": at(0.5), "p99_ms": at(0.99), "max_ms": at(1.0)}


def events(stderr: Path, name: str) -> list[dict[str, Any]]:
    found = []
    for line in stderr.read_text(errors="replace").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("event") == name:
            found.append(event)
    return found


def run_variant(variant: str, rules: int, reloads: int, gap: float, workdir: Path) -> dict[str, Any]:
    """Start the sidecar under ``variant``, reload ``reloads`` times under steady calls."""
    config = workdir / "stall.yaml"
    config.write_text(config_text(rules, 100))
    port = free_port()
    stderr = workdir / f"{variant}.stderr"
    env = {name: value for name, value in os.environ.items() if not name.startswith("RLS_")}
    env.update({VARIANT_ENV: variant, "RLS_METRICS_ADDRESS": "", "RLS_WATCH_CONFIG": "false"})
    command = serve_argv(
        ["--config", str(config), "--log-format", "json"],
        grpc_address=f"127.0.0.1:{port}",
        program=[sys.executable, "-c", "from loadtest.reload_stall import child; child()"],
    )
    with stderr.open("wb") as err:
        process = spawn(command, stdout=subprocess.DEVNULL, stderr=err, env=env)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        grpc.channel_ready_future(channel).result(timeout=120)
        requests = [request(index).SerializeToString() for index in range(0, rules, max(1, rules // 500))]
        call = channel.unary_unary("/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit")
        samples: list[tuple[float, float]] = []
        stop = threading.Event()

        def drive() -> None:
            index = 0
            while not stop.is_set():
                started = time.monotonic()
                call(requests[index % len(requests)], timeout=30)
                samples.append((started, time.monotonic() - started))
                index += 1
                time.sleep(gap)

        driver = threading.Thread(target=drive, daemon=True)
        driver.start()
        time.sleep(2.0)
        windows: list[tuple[float, float]] = []
        for number in range(1, reloads + 1):
            config.write_text(config_text(rules, 100 + number))
            started = time.monotonic()
            process.send_signal(signal.SIGHUP)
            deadline = started + RELOAD_TIMEOUT
            while len(events(stderr, "config_reloaded")) < number and time.monotonic() < deadline:
                time.sleep(0.02)
            windows.append((started, time.monotonic()))
            time.sleep(1.0)
        stop.set()
        driver.join(30)
    finally:
        channel.close()
        process.kill()
        process.wait(10)
    during = [lat for at, lat in samples if any(start <= at <= end for start, end in windows)]
    quiet = [lat for at, lat in samples if not any(start - 0.5 <= at <= end + 0.5 for start, end in windows)]
    return {
        "variant": variant,
        "rules": rules,
        "config_bytes": config.stat().st_size,
        "reloads": len(events(stderr, "config_reloaded")),
        "reload_seconds": [round(end - start, 2) for start, end in windows],
        "quiet": quantiles(quiet),
        "during": quantiles(during),
    }


def line(result: dict[str, Any]) -> str:
    quiet, during = result["quiet"], result["during"]
    return (
        f"{result['variant']:>7}  {result['rules']:,} rules ({result['config_bytes'] / 1e6:.2f} MB), "
        f"{result['reloads']} reloads in {', '.join(f'{s:.1f}' for s in result['reload_seconds'])} s | "
        f"quiet p50/p99/max {quiet['p50_ms']}/{quiet['p99_ms']}/{quiet['max_ms']} ms | "
        f"during reloads p50/p99/max {during['p50_ms']}/{during['p99_ms']}/{during['max_ms']} ms "
        f"({during['calls']} calls)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.reload_stall", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rules", type=positive_int, default=14_000)
    parser.add_argument("--reloads", type=positive_int, default=3)
    parser.add_argument("--gap", type=float, default=0.002, help="seconds between two calls")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(EXPLORE)}")
    parser.add_argument("--explore", action="store_true", help="every option measured for the fix")
    parser.add_argument("--json", action="store_true", help="one JSON line per variant")
    args = parser.parse_args(argv)
    variants = EXPLORE if args.explore else tuple(args.variants.split(","))
    with tempfile.TemporaryDirectory(prefix="reload-stall-") as directory:
        for variant in variants:
            result = run_variant(variant, args.rules, args.reloads, args.gap, Path(directory))
            print(json.dumps(result) if args.json else line(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
