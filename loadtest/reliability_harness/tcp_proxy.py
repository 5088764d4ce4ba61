"""A TCP proxy that can delay or refuse: network faults between the sidecars and Redis.

Runs as its own process (``python tcp_proxy.py --listen-port P --upstream-port U``), so
its forwarding is not delayed by the load generator's event loop, and takes one
command per line on stdin, answering ``ok <command>`` on stdout once it is in effect:

``delay <seconds>``
    Forward every chunk that many seconds after it arrived, both ways, order kept
    (0: at once). Delays do not add up: a chunk waits for its own deadline only.
``refuse``
    Close the listening socket (new connections are refused) and reset every open
    connection: what a sidecar sees when the network path to Redis goes away.
``accept``
    Listen again on the same port.
``quit``
    Stop.

When the upstream (redis-server) closes a connection or refuses a new one, the client
side is closed too, so a killed Redis looks the same through the proxy as without it.
Only the standard library; :class:`ProxyProcess` drives it from the harness.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys

CHUNK = 65536


class Proxy:
    def __init__(self, listen_port: int, upstream_port: int) -> None:
        self.listen_port = listen_port
        self.upstream_port = upstream_port
        self.delay = 0.0
        self.server: asyncio.Server | None = None
        self.transports: set[asyncio.WriteTransport] = set()

    async def listen(self) -> None:
        if self.server is None:
            self.server = await asyncio.start_server(
                self.handle, "127.0.0.1", self.listen_port, reuse_address=True, backlog=512
            )

    def refuse(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        for transport in list(self.transports):
            transport.abort()
        self.transports.clear()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            writer.transport.abort()
            return
        pair = (writer.transport, upstream_writer.transport)
        self.transports.update(pair)
        try:
            await asyncio.gather(self.pump(reader, upstream_writer), self.pump(upstream_reader, writer))
        finally:
            for transport in pair:
                self.transports.discard(transport)
                transport.abort()

    async def pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Copy ``reader`` to ``writer``, each chunk ``self.delay`` after it arrived; close both at the end."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def send() -> None:
            while True:
                due, data = await queue.get()
                if not data:
                    return
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()

        sender = asyncio.create_task(send())
        try:
            while True:
                data = await reader.read(CHUNK)
                queue.put_nowait((loop.time() + self.delay, data))
                if not data:
                    break
            await sender
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            sender.cancel()
            with contextlib.suppress(BaseException):
                await sender
            writer.transport.abort()


async def serve(listen_port: int, upstream_port: int) -> None:
    proxy = Proxy(listen_port, upstream_port)
    await proxy.listen()
    loop = asyncio.get_running_loop()
    commands = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(commands), sys.stdin)
    print(f"ready {listen_port}", flush=True)
    while line := (await commands.readline()).decode().strip():
        word, _, argument = line.partition(" ")
        if word == "delay":
            proxy.delay = float(argument)
        elif word == "refuse":
            proxy.refuse()
        elif word == "accept":
            await proxy.listen()
        elif word == "quit":
            break
        else:
            print(f"error unknown command {line!r}", flush=True)
            continue
        print(f"ok {line}", flush=True)
    proxy.refuse()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen-port", type=int, required=True)
    parser.add_argument("--upstream-port", type=int, required=True)
    arguments = parser.parse_args()
    asyncio.run(serve(arguments.listen_port, arguments.upstream_port))


if __name__ == "__main__":
    main()
