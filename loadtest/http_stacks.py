"""What an HTTP/1.1 library costs the sidecar: resident memory to import it, CPU per request to serve.

    python -m loadtest.http_stacks                 # h11 (the listeners' library) and a bare baseline
    python -m loadtest.http_stacks --requests 5000 # aiohttp too, when it is installed

Each stack serves a trivial handler (a fixed 120-byte JSON answer to a ``POST /json`` of
100 bytes) on uvloop in this process; one keep-alive client in the same process sends
``--requests`` requests one after another. The figure is the process's CPU time per
request (client included, the same client for every stack), best of ``--rounds``; the
bare stack (asyncio streams, fixed bytes, no parsing at all) is the floor. Memory is the
VmRSS growth of importing the library, each in a fresh interpreter after the sidecar's
request path (``sidecar.service.servicer``, which does not import the listeners).
Bounded: ``--requests`` x ``--rounds`` per stack.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

BODY = b'{"domain": "demo", "descriptors": [{"entries": [{"key": "remote_address", "value": "198.51.100.7"}]}]}'
REQUEST = (
    b"POST /json HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(BODY) + BODY
)
ANSWER = b'{"overallCode":"OK","statuses":[{"code":"OK","currentLimit":{"requestsPerUnit":20,"unit":"SECOND"}}]}'
IMPORT_COST = """
import uvloop, sidecar.service.servicer, sidecar.metrics, sidecar.config  # the request path, not the listeners
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
before = rss()
import {module}
print(rss() - before)
"""


async def client(port: int, requests: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    for _ in range(requests):
        writer.write(REQUEST)
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        await reader.readexactly(length)
    writer.close()


async def timed(port: int, requests: int) -> float:
    await client(port, 100)  # warm up
    started = time.process_time()
    await client(port, requests)
    return (time.process_time() - started) / requests * 1e6


async def bare(requests: int) -> float:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(ANSWER)
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                await reader.readexactly(len(BODY))
                writer.write(head + ANSWER)
        except asyncio.IncompleteReadError:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        return await timed(int(server.sockets[0].getsockname()[1]), requests)
    finally:
        server.close()


async def with_h11(requests: int) -> float:
    from sidecar.http_server import Answer, Bounds, HttpServer, Request

    async def handle(request: Request) -> Answer:
        return Answer(200, ANSWER)

    bounds = Bounds(max_connections=16, read_timeout=5, idle_timeout=5, write_timeout=5, max_body=65536)
    server = HttpServer("bench", handle, bounds, lambda status, reason: Answer(status, b""), Answer(503, b""))
    await server.start("127.0.0.1:0")
    try:
        return await timed(server.port, requests)
    finally:
        await server.close()


async def with_aiohttp(requests: int) -> float:
    from aiohttp import web

    async def handle(request: Any) -> Any:
        await request.read()
        return web.Response(body=ANSWER, content_type="application/json")

    runner = web.ServerRunner(web.Server(handle, access_log=None))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        return await timed(int(runner.addresses[0][1]), requests)
    finally:
        await runner.cleanup()


def import_mib(module: str) -> float:
    code = IMPORT_COST.format(module=module)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return float(result.stdout.strip())


def main(argv: Sequence[str] | None = None) -> int:
    import uvloop

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    arguments = parser.parse_args(argv)
    stacks: list[tuple[str, str | None, Callable[[int], Coroutine[Any, Any, float]]]] = [
        ("bare asyncio streams (no parsing)", None, bare),
        ("h11 (sidecar/http_server.py)", "h11", with_h11),
    ]
    if importlib.util.find_spec("aiohttp") is not None:
        stacks.append(("aiohttp low-level server", "aiohttp.web", with_aiohttp))
    print(f"python -m loadtest.http_stacks --requests {arguments.requests} --rounds {arguments.rounds}")
    for name, module, run in stacks:
        cpu = min(uvloop.run(run(arguments.requests)) for _ in range(arguments.rounds))
        memory = f"{import_mib(module):.1f} MiB" if module else "-"
        print(f"{name:36s} CPU {cpu:6.0f} us/request (client included)   import: +{memory}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
