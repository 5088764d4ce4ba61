"""A herd of consumer callers starting together: does each get its answer within ``max_wait``?

Starts one real sidecar (memory backend, ``python -m sidecar serve`` through
:mod:`stack.sidecar`) with one limit of ``--limit`` per second, then starts ``--callers``
callers of one :class:`~sidecar.consumer.Consumer` on the same request at the same moment,
each with ``max_wait`` ``--max-wait``, and times each one's answer (a slot, or
:class:`~sidecar.consumer.RateLimitExceeded`). Reported: admitted, refused, sidecar errors,
the longest wait, how many callers were answered after ``max_wait`` (late) and after
``max_wait`` plus :data:`~sidecar.consumer.ANSWER_SLACK` (late past the slack). Bounded: ``--rounds`` rounds of one herd
each, then the sidecar is stopped.

    python -m loadtest.consumer_herd --callers 600 --max-wait 1 --limit 20 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from sidecar.consumer import ANSWER_SLACK, Consumer, ConsumerError, RateLimitExceeded, SidecarError
from stack.processes import process_group
from stack.sidecar import SidecarProcess

MAX_CALLERS = 5_000
"""More callers than this in one herd is not a test of the client any more."""


def herd_config(directory: Path, limit: int) -> Path:
    config = directory / "config"
    config.mkdir()
    (config / "herd.yaml").write_text(
        f"domain: herd\ndescriptors:\n  - key: provider\n    rate_limit:\n      unit: second\n"
        f"      requests_per_unit: {limit}\n"
    )
    return config


async def one_herd(address: str, callers: int, max_wait: float, provider: str) -> dict[str, float]:
    """``callers`` callers of one fresh :class:`Consumer`, released together; their outcomes and waits."""
    waits: list[float] = []
    outcomes = {"admitted": 0, "refused": 0, "errors": 0}
    async with Consumer(address) as consumer:
        await consumer.acquire("herd", {"provider": "warm-up"}, max_wait=max_wait)  # the channel is open
        start = asyncio.Event()

        async def caller() -> None:
            await start.wait()
            began = time.monotonic()
            try:
                await consumer.acquire("herd", {"provider": provider}, max_wait=max_wait)
                outcomes["admitted"] += 1
            except RateLimitExceeded:
                outcomes["refused"] += 1
            except (SidecarError, ConsumerError):
                outcomes["errors"] += 1
            waits.append(time.monotonic() - began)

        tasks = [asyncio.ensure_future(caller()) for _ in range(callers)]
        await asyncio.sleep(0.05)  # every caller is waiting for the start
        start.set()
        await asyncio.gather(*tasks)
        stats = consumer.stats
    return {
        **outcomes,
        "max_wait_s": max(waits),
        "late": sum(1 for wait in waits if wait > max_wait),
        "late_past_slack": sum(1 for wait in waits if wait > max_wait + ANSWER_SLACK),
        "asks": stats.asks,
        "out_of_turn": stats.out_of_turn,
        "unanswered": stats.unanswered,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--callers", type=int, default=600)
    parser.add_argument("--max-wait", type=float, default=1.0)
    parser.add_argument("--limit", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    options = parser.parse_args(argv)
    if not 1 <= options.callers <= MAX_CALLERS:
        parser.error(f"--callers: 1 to {MAX_CALLERS}")
    if not 1 <= options.rounds <= 10:
        parser.error("--rounds: 1 to 10")
    with tempfile.TemporaryDirectory(prefix="consumer-herd-") as temporary, process_group() as group:
        directory = Path(temporary)
        config = herd_config(directory, options.limit)
        sidecar = group.start_ready(lambda: SidecarProcess("sidecar", ["--config", str(config)], directory))
        print(f"{options.callers} callers, max_wait {options.max_wait:g} s, limit {options.limit}/s")
        for round_number in range(options.rounds):
            result = asyncio.run(
                one_herd(sidecar.address, options.callers, options.max_wait, f"round-{round_number}-{time.time()}")
            )
            print("  ".join(f"{key}={value:.3f}" if isinstance(value, float) else f"{key}={value}"
                            for key, value in result.items()))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
