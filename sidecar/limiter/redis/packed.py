"""One pipeline of script calls on plain Redis, packed and read without redis-py's ``Pipeline``.

:meth:`~sidecar.limiter.redis.store.RedisStore.run_scripts` with ``packed=True`` sends its
pipelines through :func:`run_packed`. The loop reads a pipeline's replies in one turn, and
a share call's round trip through redis-py's ``Pipeline`` cost the loop 80-90 us, packed here
22-37 us (``python -m loadtest.quota_share_cost``, 20,000 buckets): each command queued with its
options, packed argument by argument in Python, and each reply read under its own
``async with timeout`` and its command's callback lookup. Here every command is packed by
hiredis (C) into one buffer and the replies are read straight from the connection's parser,
under one socket timeout for the whole read.

What the caller sees is what ``pipe.execute(raise_on_error=False)`` returns on plain Redis
for ``EVAL``/``EVALSHA`` calls (which have no response callback): each reply, an error reply
as its exception value (``NoScriptError``, ``ResponseError``...), and the same exceptions
when the round trip fails, so :mod:`~sidecar.limiter.redis.faults` classifies them alike:

* a socket timeout: ``redis.exceptions.TimeoutError`` (SILENCE), the connection closed;
* a lost connection: ``redis.exceptions.ConnectionError`` (LOST), the connection closed;
* anything else, cancellation included: raised as it is, the connection closed (its unread
  replies would answer the next caller's calls);

redis-py retries nothing here either (the sidecar's clients have ``Retry(NoBackoff(), 0)``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import hiredis
from redis.asyncio import Redis
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

try:  # redis-py's parser internals, as in redis-py 5 to 8
    from redis._parsers.hiredis import NOT_ENOUGH_DATA, _AsyncHiredisParser
    from redis._parsers.socket import SERVER_CLOSED_CONNECTION_ERROR

    PARSER_KNOWN = hasattr(_AsyncHiredisParser, "read_from_socket")
except ImportError:  # another layout: every client keeps redis-py's Pipeline
    PARSER_KNOWN = False


def packable(client: object) -> bool:
    """Whether ``client`` takes :func:`run_packed`: a plain ``redis.asyncio.Redis`` speaking
    RESP2 (the protocol whose replies the parser gives as ``Pipeline`` would) through a
    redis-py whose parser internals are the ones read here (``PARSER_KNOWN``), whose
    connections read replies as redis-py's own do. Sentinel's connections do not: a
    ``READONLY`` reply from a demoted master becomes a lost connection there (so Redis is
    marked down and found again through Sentinel), and reading from the parser would skip
    that; they keep the ``Pipeline``."""
    if not PARSER_KNOWN or not isinstance(client, Redis):
        return False
    pool = client.connection_pool
    reads_as_redis_py = getattr(pool.connection_class, "read_response", None) is AbstractConnection.read_response
    return reads_as_redis_py and pool.connection_kwargs.get("protocol") in (None, 2, "2")


def pack(commands: Sequence[tuple[Any, ...]]) -> bytes:
    """Every command in RESP, one buffer (hiredis packs ``str``, ``int`` and ``bytes``)."""
    return b"".join([hiredis.pack_command(command) for command in commands])


async def run_packed(client: Redis, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
    """``commands`` in one round trip on one pooled connection; each reply, errors as values."""
    data = pack(commands)
    pool: Any = client.connection_pool
    connection: Any = await pool.get_connection()
    try:
        await connection.send_packed_command(data)
        return await _read(connection, len(commands))
    finally:
        await pool.release(connection)


async def _read(connection: Any, count: int) -> list[Any]:
    """``count`` replies from ``connection``'s parser; on any failure the connection is closed
    and the error raised as ``Connection.read_response`` raises it."""
    parser = connection._parser
    replies: list[Any] = []
    try:
        async with asyncio.timeout(connection.socket_timeout):
            if isinstance(parser, _AsyncHiredisParser):
                await _fill(parser, replies, count)
            else:  # no hiredis: the pure-Python parser's coroutine per reply
                for _ in range(count):
                    replies.append(await parser.read_response(disable_decoding=False))
    except TimeoutError:
        await connection.disconnect(nowait=True)
        raise RedisTimeoutError(f"Timeout reading from {connection._host_error()}") from None
    except OSError as error:
        await connection.disconnect(nowait=True)
        message = f"Error while reading from {connection._host_error()} : {error.args}"
        raise RedisConnectionError(message) from None
    except BaseException:
        await connection.disconnect(nowait=True)
        raise
    if connection.health_check_interval:  # as Connection.read_response keeps it
        connection.next_health_check = asyncio.get_running_loop().time() + connection.health_check_interval
    return replies


async def _fill(parser: Any, replies: list[Any], count: int) -> None:
    """Append ``count`` replies: each taken from hiredis's buffer as it is (no coroutine per
    reply), the socket read only when the buffer holds no whole reply. The same checks as
    the parser's ``read_response``: a closed parser reads nothing more, a connection error
    in a reply is raised. A push notification (RESP3 only) cannot come: :func:`packable`."""
    reader = parser._reader
    while len(replies) < count:
        if not parser._connected:
            raise RedisConnectionError(SERVER_CLOSED_CONNECTION_ERROR)
        reply = reader.gets()
        if reply is NOT_ENOUGH_DATA:
            await parser.read_from_socket()
            continue
        if isinstance(reply, RedisConnectionError) or (
            type(reply) is list and reply and isinstance(reply[0], RedisConnectionError)
        ):
            raise reply if isinstance(reply, RedisConnectionError) else reply[0]
        replies.append(reply)
