"""The load generator: grpc.aio on uvloop, in its own process (``spawn``).

One channel per replica. Open loop: each replica has a schedule of send times
(offsets from a start time the harness picks, for example a window boundary) and
``lanes`` coroutines take the next scheduled call in order, sleep until its time
and send it, so at most ``lanes`` calls are in flight per replica; a call that
finds every lane busy goes out late and the report counts it. Closed loop (the
throughput scenario): every lane sends back to back until the end.

For every call it records the send and receive wall-clock time (``time.time()``,
the clock the sidecar uses for windows), the overall code, and the gRPC status
name when the call failed.

The process starts with the sidecars (its imports overlap theirs) and opens its channels
when the harness says ``connect`` (the sidecars serve), then warms up and says ``ready``.
"""

from __future__ import annotations

import asyncio
import multiprocessing.connection
import os
import time
from array import array
from dataclasses import dataclass, field
from typing import Any

import grpc

from loadtest.common import METHOD, overall_code, run_worker

CODE_ERROR = -1
"""Recorded as the code of a call that failed (its status name goes to ``errors``)."""
CODE_NOT_SENT = -2
"""Recorded for a scheduled call that was never sent (the run hit its deadline)."""
WARMUP_CALLS = 20
RUN_GRACE = 30.0
"""Seconds after the last scheduled send before in-flight calls are abandoned."""


@dataclass(frozen=True)
class WorkerSpec:
    """What one load-generator process drives; picklable."""

    replicas: tuple[int, ...]
    """Global replica indices, aligned with ``addresses`` and ``schedules``."""
    addresses: tuple[str, ...]
    payloads: tuple[bytes, ...]
    """Serialized ``RateLimitRequest`` per descriptor value index."""
    warmup_payload: bytes
    """A check-only request (``hits_addend`` 0): warms channel and backend, spends no hit."""
    schedules: tuple[tuple[bytes, bytes], ...] | None
    """Per replica ``(offsets array('d'), value indices array('i'))`` as bytes; None: closed loop."""
    closed_seconds: float
    lanes: int
    timeout: float
    cpus: tuple[int, ...] | None = None
    """Pin this load generator to these cpus (``--client-cpus``)."""


@dataclass
class ReplicaRecord:
    """Calls to one replica, index-aligned arrays."""

    values: array[int]
    send: array[float]
    recv: array[float]
    codes: array[int]
    errors: dict[int, str] = field(default_factory=dict)

    def to_message(self) -> dict[str, Any]:
        return {
            "values": self.values.tobytes(),
            "send": self.send.tobytes(),
            "recv": self.recv.tobytes(),
            "codes": self.codes.tobytes(),
            "errors": self.errors,
        }

    @classmethod
    def from_message(cls, message: dict[str, Any]) -> ReplicaRecord:
        values, send, recv, codes = array("i"), array("d"), array("d"), array("b")
        values.frombytes(message["values"])
        send.frombytes(message["send"])
        recv.frombytes(message["recv"])
        codes.frombytes(message["codes"])
        return cls(values, send, recv, codes, dict(message["errors"]))


class OpenLoop:
    """Schedule state of one replica: lanes take the next index in order."""

    def __init__(self, offsets: array[float], values: array[int], start: float) -> None:
        self.offsets = offsets
        self.values = values
        self.start = start
        self.next = 0
        count = len(offsets)
        self.record = ReplicaRecord(
            values,
            array("d", bytes(8 * count)),
            array("d", bytes(8 * count)),
            array("b", [CODE_NOT_SENT]) * count,
        )


async def _open_lane(call: Any, state: OpenLoop, payloads: tuple[bytes, ...], timeout: float, stop: float) -> None:
    now = time.time
    sleep = asyncio.sleep
    record = state.record
    count = len(state.offsets)
    while state.next < count:
        index = state.next
        state.next += 1
        delay = state.start + state.offsets[index] - now()
        if delay > 0:
            await sleep(delay)
        sent = now()
        if sent > stop:
            return
        record.send[index] = sent
        try:
            response = await call(payloads[state.values[index]], timeout=timeout)
        except grpc.aio.AioRpcError as error:
            record.recv[index] = now()
            record.codes[index] = CODE_ERROR
            record.errors[index] = error.code().name
            continue
        record.recv[index] = now()
        record.codes[index] = overall_code(response)


async def _closed_lane(
    call: Any,
    record: ReplicaRecord,
    payloads: tuple[bytes, ...],
    *,
    first: int,
    timeout: float,
    end: float,
) -> None:
    now = time.time
    count = len(payloads)
    value = first % count
    while True:
        sent = now()
        if sent >= end:
            return
        try:
            response = await call(payloads[value], timeout=timeout)
            code = overall_code(response)
        except grpc.aio.AioRpcError as error:
            code = CODE_ERROR
            record.errors[len(record.codes)] = error.code().name
        record.values.append(value)
        record.send.append(sent)
        record.recv.append(now())
        record.codes.append(code)
        value = value + 1 if value + 1 < count else 0


async def _drive(spec: WorkerSpec, conn: multiprocessing.connection.Connection) -> None:
    if not await asyncio.to_thread(conn.poll, 120) or conn.recv()[0] != "connect":
        return  # the sidecars did not come up: nothing to drive
    channels = [
        grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
        for address in spec.addresses
    ]
    try:
        calls = [channel.unary_unary(METHOD) for channel in channels]
        for channel, call in zip(channels, calls, strict=True):
            await asyncio.wait_for(channel.channel_ready(), timeout=10)
            for _ in range(WARMUP_CALLS):
                await call(spec.warmup_payload, timeout=5)
        conn.send(("ready", os.getpid()))
        if not await asyncio.to_thread(conn.poll, 120):
            return
        message = conn.recv()
        if message[0] != "go":
            return
        start = float(message[1])
        lanes = []
        records: list[ReplicaRecord] = []
        if spec.schedules is None:
            end = start + spec.closed_seconds
            await asyncio.sleep(max(0.0, start - time.time()))
            for position, call in enumerate(calls):
                record = ReplicaRecord(array("i"), array("d"), array("d"), array("b"))
                records.append(record)
                step = max(1, len(spec.payloads) // spec.lanes)
                lanes += [
                    _closed_lane(
                        call,
                        record,
                        spec.payloads,
                        first=position * 7919 + lane * step,
                        timeout=spec.timeout,
                        end=end,
                    )
                    for lane in range(spec.lanes)
                ]
        else:
            states = []
            for offsets_bytes, values_bytes in spec.schedules:
                offsets, values = array("d"), array("i")
                offsets.frombytes(offsets_bytes)
                values.frombytes(values_bytes)
                states.append(OpenLoop(offsets, values, start))
            stop = start + max((state.offsets[-1] for state in states if state.offsets), default=0.0) + RUN_GRACE
            for call, state in zip(calls, states, strict=True):
                records.append(state.record)
                lanes += [_open_lane(call, state, spec.payloads, spec.timeout, stop) for _ in range(spec.lanes)]
        await asyncio.gather(*lanes)
        conn.send(("result", [record.to_message() for record in records]))
    finally:
        for channel in channels:
            await channel.close()


def worker_main(spec: WorkerSpec, conn: multiprocessing.connection.Connection) -> None:
    """Entry point of a load-generator process."""
    run_worker(_drive, spec, conn)
