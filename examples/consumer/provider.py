"""A stand-in for a rate-limited partner API: answers every HTTP request 200 and counts them per second.

    python examples/consumer/provider.py --port 9000

``GET /stats`` answers ``{"per_second": {"<unix second>": calls, ...}}``: what the provider saw
in each wall-clock second (the windows the sidecar cuts). Plain asyncio, no dependency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from collections import Counter

counts: Counter[int] = Counter()


async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            line = head.split(b"\r\n", 1)[0].decode("latin-1")
            if line.startswith("GET /stats"):
                body = json.dumps({"per_second": {str(second): n for second, n in sorted(counts.items())}}).encode()
            else:
                counts[math.floor(time.time())] += 1
                body = b'{"charged": true}'
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body))
            writer.write(body)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def main(port: int) -> None:
    server = await asyncio.start_server(serve, "127.0.0.1", port)
    print(f"provider listening on 127.0.0.1:{port}", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=9000)
    asyncio.run(main(parser.parse_args().port))
