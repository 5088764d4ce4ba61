"""A stand-in for a rate-limited partner API: answers every HTTP request 200 and counts them per second.

    python examples/consumer/provider.py --port 9000

``GET /stats`` answers ``{"per_second": {"<unix second>": calls, ...}, "per_grant_second": {...}}``:
``per_second`` counts each call in the wall-clock second it arrived; ``per_grant_second`` in
the second its slot was granted, from the ``x-granted-at`` header (Unix time) the consumer
sends. The sidecar's windows are its wall-clock seconds at the grant: a call admitted late
in one window can arrive in the next second (the caller's own delay between the grant and
the call), so the grant second is what a window's budget is checked against. Plain
asyncio, no dependency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from collections import Counter

counts: Counter[int] = Counter()
granted: Counter[int] = Counter()
GRANTED_AT = b"\r\nx-granted-at:"


def grant_second(head: bytes) -> int | None:
    """The wall-clock second of the ``x-granted-at`` header, None without one."""
    start = head.lower().find(GRANTED_AT)
    if start < 0:
        return None
    value = head[start + len(GRANTED_AT) :].split(b"\r\n", 1)[0]
    return math.floor(float(value))


async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            line = head.split(b"\r\n", 1)[0].decode("latin-1")
            if line.startswith("GET /stats"):
                body = json.dumps({"per_second": by_second(counts), "per_grant_second": by_second(granted)}).encode()
            else:
                counts[math.floor(time.time())] += 1
                second = grant_second(head)
                if second is not None:
                    granted[second] += 1
                body = b'{"charged": true}'
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body))
            writer.write(body)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


def by_second(counter: Counter[int]) -> dict[str, int]:
    return {str(second): n for second, n in sorted(counter.items())}


async def main(port: int) -> None:
    server = await asyncio.start_server(serve, "127.0.0.1", port)
    print(f"provider listening on 127.0.0.1:{port}", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=9000)
    asyncio.run(main(parser.parse_args().port))
