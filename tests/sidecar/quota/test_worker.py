"""The quota worker (``--quota-process worker``): its life, its door and what it shows.

The relay itself is covered by every test of test_grpc.py, which runs each RLQS test
through it too. Here: the worker starts on the first stream and not before, its token
keeps other callers out, a death ends its streams ``UNAVAILABLE`` and the next stream
starts another (a worker that keeps dying young waits before the next start), a drain
stops it cleanly, a killed ``serve`` leaves no worker behind, ``/metrics`` and
``/config`` show its numbers with the Envoy's own address, and a client that does not
read is dropped by the relay after its write timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

from sidecar.config import load_config
from sidecar.limiter.memory import MemoryLimiter
from sidecar.quota.buckets import bucket_of
from sidecar.quota.relay import CONTROL_SERVICE, STATS, TOKEN_KEY, QuotaWorker, WorkerUnavailableError
from sidecar.quota.service import METHOD, SERVICE_NAME
from sidecar.quota_worker import NICE
from sidecar.server import Sidecar
from sidecar.settings import Settings
from stack.sidecar import SidecarProcess
from tests.sidecar.quota.test_grpc import RULES, Client, report
from tests.support.sidecars import SidecarFactory

pytestmark = pytest.mark.slow

BUCKET = bucket_of("q", [("user", "a")])


@pytest.fixture
async def running(tmp_path: Path) -> AsyncIterator[SimpleNamespace]:
    (tmp_path / "q.yaml").write_text(RULES)
    settings = Settings(
        config=str(tmp_path), grpc_address="[::1]:0", metrics_address="127.0.0.1:0", watch_config=False, quota_ttl=6
    )
    sidecar = Sidecar(settings, load_config(str(tmp_path)), MemoryLimiter())
    await sidecar.start()
    channel = grpc.aio.insecure_channel(f"[::1]:{sidecar.port}")
    try:
        yield SimpleNamespace(sidecar=sidecar, worker=sidecar.worker, channel=channel)
    finally:
        await channel.close()
        await sidecar.drain()


async def assigned(client: Client) -> int:
    """Send a report of :data:`BUCKET` and return the max_tokens assigned."""
    await client.send(report(BUCKET))
    reply = await client.receive(timeout=30)
    return int(reply.bucket_action[0].quota_assignment_action.rate_limit_strategy.token_bucket.max_tokens)


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as reply:
        body: bytes = reply.read()
    return body


async def test_the_worker_starts_on_the_first_stream_and_shows_in_metrics_and_config(running: SimpleNamespace) -> None:
    worker: QuotaWorker = running.worker
    assert worker.running is None  # a sidecar serving no quota filter runs no worker
    admin = f"http://127.0.0.1:{running.sidecar.admin.port}"
    idle = await asyncio.to_thread(get, admin + "/metrics")
    assert b"ratelimit_sidecar_quota_buckets 0.0" in idle
    client = Client(running.channel)
    assert await assigned(client) == 5
    assert worker.running is not None and worker.stats.starts == 1
    pid = worker.running.process.pid
    assert os.getpriority(os.PRIO_PROCESS, pid) == min(19, os.getpriority(os.PRIO_PROCESS, 0) + NICE)  # decisions first
    metrics = (await asyncio.to_thread(get, admin + "/metrics")).decode()
    assert "ratelimit_sidecar_quota_buckets 1.0" in metrics and "ratelimit_sidecar_quota_streams 1.0" in metrics
    shown = json.loads(await asyncio.to_thread(get, admin + "/config"))["quota"]
    assert (
        shown["live_buckets"] == 1
        and shown["worker"]["running"]
        and shown["worker"]["pid"] == worker.running.process.pid
    )
    [stream] = shown["streams"]
    assert stream["peer"].startswith("ipv6:")  # the Envoy's address (::1), not the relay's (IPv4)
    await client.close()


async def test_a_reload_reaches_the_worker(running: SimpleNamespace, tmp_path: Path) -> None:
    client = Client(running.channel)
    assert await assigned(client) == 5
    (tmp_path / "q.yaml").write_text(RULES.replace("requests_per_unit: 5", "requests_per_unit: 9"))
    assert await running.sidecar.reloader.reload("test")
    for _ in range(10):  # a TTL refresh may come first
        reply = await client.receive(timeout=5)
        if reply.bucket_action[0].quota_assignment_action.rate_limit_strategy.token_bucket.max_tokens == 9:
            break
    else:
        pytest.fail("the reloaded limit never reached the stream")
    await client.close()


async def test_only_the_token_holder_reaches_the_worker(running: SimpleNamespace) -> None:
    client = Client(running.channel)
    await assigned(client)
    port = running.worker.running.port
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as direct:
        stats = direct.unary_unary(f"/{CONTROL_SERVICE}/{STATS}")
        for metadata in ((), ((TOKEN_KEY, "0" * 32),)):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stats(b"", metadata=metadata, timeout=5)
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        stream = Client(direct)  # refused at open: a message sent meanwhile could race the status
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stream.receive()
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    await client.close()


async def test_a_dead_worker_ends_its_streams_and_the_next_stream_starts_another(running: SimpleNamespace) -> None:
    worker: QuotaWorker = running.worker
    client = Client(running.channel)
    await assigned(client)
    first = worker.running.process.pid
    os.kill(first, signal.SIGKILL)
    with pytest.raises(grpc.aio.AioRpcError) as ended:
        while True:
            await client.receive(timeout=10)
    assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
    for _ in range(100):  # bounded: at most 5 s for the exit to be seen
        if worker.running is None:
            break
        await asyncio.sleep(0.05)
    assert worker.stats.deaths == 1 and worker.stats.last_exit == -signal.SIGKILL
    await asyncio.sleep(worker._not_before - time.monotonic())  # it died young: one pause first
    again = Client(running.channel)
    assert await assigned(again) == 5
    assert worker.stats.starts == 2 and worker.running.process.pid != first
    await again.close()


async def test_a_worker_that_cannot_start_is_refused_unavailable_then_waited_for(tmp_path: Path) -> None:
    worker = unstarted(tmp_path, (sys.executable, "-c", "raise SystemExit(3)"))
    # 255: asyncio's child watcher (this test's loop; serve runs uvloop) now and then finds the
    # child reaped already and says 255 instead of its code.
    with pytest.raises(WorkerUnavailableError, match=r"did not start \(exit (3|255)\)"):
        await worker.ensure()
    with pytest.raises(WorkerUnavailableError, match="died young 1 times; next start in 1 s"):
        await worker.ensure()
    assert (worker.stats.starts, worker.stats.deaths) == (0, 1)


async def test_a_worker_that_cannot_be_spawned_is_refused_unavailable(tmp_path: Path) -> None:
    worker = unstarted(tmp_path, (str(tmp_path / "no-such-python"), "-m", "sidecar.quota_worker"))
    with pytest.raises(WorkerUnavailableError, match=r"could not be started: .*no-such-python"):
        await worker.ensure()
    assert worker.stats.deaths == 1 and worker.running is None


def unstarted(directory: Path, command: tuple[str, ...]) -> QuotaWorker:
    """A worker handle outside any sidecar, starting ``command`` instead of the worker."""
    config = load_config(str(write_rules(directory)))
    return QuotaWorker(lambda config, token: b"", lambda: config, write_timeout=1.0, command=command)


def write_rules(directory: Path) -> Path:
    (directory / "q.yaml").write_text(RULES)
    return directory


async def test_a_drain_stops_the_worker_cleanly(running: SimpleNamespace) -> None:
    client = Client(running.channel)
    await assigned(client)
    process = running.worker.running.process
    await running.sidecar.drain()
    assert process.returncode == 0 and running.worker.running is None
    assert running.worker.stats.deaths == 0  # asked to stop: no death counted


async def test_a_client_that_does_not_read_is_dropped_by_the_relay(running: SimpleNamespace) -> None:
    """Stateless answers (bad ids) to a client that never reads: the relay holds one message,
    waits its write timeout, and ends the stream RESOURCE_EXHAUSTED."""
    client = Client(running.channel)
    await assigned(client)
    running.worker.write_timeout = 1.0
    for number in range(40):  # 40 x 0.9 MB of answers: more than gRPC buffers for a client that does not read
        await client.send(report(*({"entry.0.user": f"{number:03}{index:0990}"} for index in range(900))))
    for _ in range(600):  # bounded: at most 30 s
        if running.worker.stats.relayed:
            break
        await asyncio.sleep(0.05)
    assert running.worker.stats.relayed == {"resource_exhausted": 1}
    await client.close()


def test_a_killed_sidecar_leaves_no_worker_behind(start_sidecar: SidecarFactory, tmp_path: Path) -> None:
    sidecar = start_sidecar(config=write_rules(tmp_path), metrics=True)
    channel = grpc.insecure_channel(sidecar.address)
    call = channel.stream_stream(f"/{SERVICE_NAME}/{METHOD}")(iter([report(BUCKET)]))
    next(call)  # one answer: the worker serves
    admin = f"http://127.0.0.1:{sidecar.metrics_port}/config"
    pid = json.loads(get(admin))["quota"]["worker"]["pid"]
    sidecar.kill()  # SIGKILL: no drain, no signal to the worker
    for _ in range(200):  # bounded: at most 10 s
        if not alive(pid):
            break
        time.sleep(0.05)
    assert not alive(pid)
    channel.close()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_ctrl_c_to_the_process_group_stops_the_worker_through_the_drain(tmp_path: Path) -> None:
    """SIGINT reaches the worker too (one process group, as in a terminal): it waits for the
    serving process's drain, which stops it cleanly, not counted as a death."""
    serve = SidecarProcess("serve", ["--config", str(write_rules(tmp_path)), "--log-format", "json"], tmp_path)
    serve.start()  # in a session of its own: its process group is the sidecar and the worker
    try:
        serve.wait_ready()
        with grpc.insecure_channel(serve.address) as channel:
            next(channel.stream_stream(f"/{SERVICE_NAME}/{METHOD}")(iter([report(BUCKET)])))
        pid = json.loads(get(f"{serve.metrics_url}/config"))["quota"]["worker"]["pid"]
        os.killpg(serve.pid, signal.SIGINT)
        assert serve.process is not None and serve.process.wait(30) == 0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(serve.pid, signal.SIGKILL)
    assert not alive(pid)
    log = serve.log_text()
    assert "sidecar_stopped" in log and "quota_worker_exited" not in log and "quota_worker_killed" not in log
