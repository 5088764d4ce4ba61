"""Certificate rotation without a restart (issue 26, cause 5), with real TLS handshakes:
the gRPC server follows its certificate, key and client-CA files (renamed over, or the
kubelet's ``..data`` symlink swap), keeps open connections, refuses a mismatched or
half-written set; the Redis client's new connections use new TLS files."""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from redis.asyncio import Redis
from redis.exceptions import RedisError

from sidecar.limiter.redis.connect import connect
from sidecar.protos.envoy.service.ratelimit.v3 import rls_pb2_grpc
from sidecar.tls_files import TLS_RELOADS
from stack import redis as launcher
from stack.tls import OPENSSL, Certificates, make_certificates
from tests.support.redis_servers import RedisServer, running
from tests.support.sidecars import OK, Sidecar, SidecarFactory, log_events, metric, request

pytestmark = [pytest.mark.slow]

BUDGET = 10.0
"""How long a rotation may take to show (issue 26: "within 10 s"); tests poll, never wait it out."""
CHANNEL_OPTIONS = [("grpc.use_local_subchannel_pool", 1)]
"""Each channel its own connection: gRPC would otherwise share one between equal channels."""


@pytest.fixture(scope="module")
def sets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Certificates, Certificates]:
    """Two unrelated sets (each its own CA, server and client certificates)."""
    if OPENSSL is None:
        pytest.skip("openssl is not installed: cannot make certificates")
    base = tmp_path_factory.mktemp("rotation")
    return make_certificates(base / "a"), make_certificates(base / "b")


def credentials(certs: Certificates, mutual: bool) -> grpc.ChannelCredentials:
    client = (certs.client_key.read_bytes(), certs.client_cert.read_bytes()) if mutual else (None, None)
    return grpc.ssl_channel_credentials(certs.ca.read_bytes(), *client)


def channel(address: str, certs: Certificates, mutual: bool) -> grpc.Channel:
    return grpc.secure_channel(address, credentials(certs, mutual), options=CHANNEL_OPTIONS)


def answers(address: str, certs: Certificates, mutual: bool) -> bool:
    """One call on a new connection trusting ``certs``' CA: True if it was answered, False
    if the handshake failed (UNAVAILABLE)."""
    with channel(address, certs, mutual) as fresh:
        try:
            reply = rls_pb2_grpc.RateLimitServiceStub(fresh).ShouldRateLimit(request("it", [("r", "x")]), timeout=2)
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.UNAVAILABLE, error
            return False
        return bool(int(reply.overall_code) == OK)


def client_answers(address: str, sets: tuple[Certificates, Certificates], client: Certificates) -> bool:
    """One call presenting ``client``'s certificate, trusting both sets' CAs (so only the
    server's verdict on the client certificate decides)."""
    roots = b"".join(certs.ca.read_bytes() for certs in sets)
    both = grpc.ssl_channel_credentials(roots, client.client_key.read_bytes(), client.client_cert.read_bytes())
    with grpc.secure_channel(address, both, options=CHANNEL_OPTIONS) as fresh:
        try:
            rls_pb2_grpc.RateLimitServiceStub(fresh).ShouldRateLimit(request("it", [("r", "x")]), timeout=2)
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.UNAVAILABLE, error
            return False
        return True


def poll(condition: Callable[[], bool], what: str, budget: float = BUDGET) -> None:
    deadline = time.monotonic() + budget
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {budget} s: {what}")
        time.sleep(0.1)


def install(certs: Certificates, directory: Path, mutual: bool) -> None:
    """Write ``certs``' server files into ``directory`` as a rotation tool does: each to a
    temporary name, then renamed over the served name."""
    files = {"cert.pem": certs.server_cert, "key.pem": certs.server_key}
    if mutual:
        files["ca.pem"] = certs.ca
    for name, source in files.items():
        shutil.copyfile(source, directory / f".{name}.tmp")
        os.replace(directory / f".{name}.tmp", directory / name)


def flags(directory: Path, mutual: bool) -> list[str]:
    served = ["--tls-cert", str(directory / "cert.pem"), "--tls-key", str(directory / "key.pem")]
    mutual_flags = ["--tls-client-ca", str(directory / "ca.pem")] if mutual else []
    return [*served, *mutual_flags]


def reloads(metrics_port: int, result: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    return metric(text, "ratelimit_sidecar_tls_reloads_total", side="server", result=result) or 0.0


def start(
    start_sidecar: SidecarFactory, config: Path, directory: Path, first: Certificates, mutual: bool
) -> tuple[Sidecar, int]:
    """A sidecar serving ``directory``'s files, and its metrics port."""
    probe_client = (first.client_cert, first.client_key) if mutual else None
    sidecar = start_sidecar(
        *flags(directory, mutual), config=config, probe_tls=first.ca, probe_client=probe_client, metrics=True
    )
    return sidecar, sidecar.metrics_port


class Caller:
    """Calls without pause on one connection opened before the rotation, in a thread."""

    def __init__(self, address: str, certs: Certificates, mutual: bool) -> None:
        self.channel = channel(address, certs, mutual)
        self.stub = rls_pb2_grpc.RateLimitServiceStub(self.channel)
        self.codes: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.stub.ShouldRateLimit(request("it", [("r", "old")]), timeout=5)
                self.codes.append("OK")
            except grpc.RpcError as error:
                self.codes.append(error.code().name)

    def __enter__(self) -> Caller:
        self.stub.ShouldRateLimit(request("it", [("r", "old")]), timeout=5)  # connected before the swap
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.channel.close()


@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mtls"])
def test_files_renamed_over_are_served_and_open_connections_keep_calling(
    start_sidecar: SidecarFactory,
    config_dir: Path,
    sets: tuple[Certificates, Certificates],
    tmp_path: Path,
    mutual: bool,
) -> None:
    old, new = sets
    served = tmp_path / "served"
    served.mkdir()
    install(old, served, mutual)
    sidecar, metrics_port = start(start_sidecar, config_dir, served, old, mutual)
    assert answers(sidecar.address, old, mutual)
    assert not answers(sidecar.address, new, mutual)
    with Caller(sidecar.address, old, mutual) as caller:
        install(new, served, mutual)
        poll(lambda: answers(sidecar.address, new, mutual), "a client of the new CA is answered")
        calls_after_swap = len(caller.codes)
        poll(lambda: len(caller.codes) > calls_after_swap + 20, "calls go on on the connection opened before")
    assert not answers(sidecar.address, old, mutual), "the old CA no longer verifies a new connection"
    if mutual:  # the client CA rotated too: a client trusting both servers, with the old client certificate
        assert not client_answers(sidecar.address, sets, old), "a client certificate of the old CA is refused"
        assert client_answers(sidecar.address, sets, new)
    assert set(caller.codes) == {"OK"}, f"calls on the connection opened before the swap: {set(caller.codes)}"
    assert reloads(metrics_port, "ok") >= 1
    reloaded = [event for event in log_events(sidecar.stderr()) if event["event"] == "tls_reloaded"]
    assert reloaded and reloaded[-1]["side"] == "server"


def kubelet_write(mount: Path, certs: Certificates, stamp: str) -> None:
    """What the kubelet's atomic writer does on a Secret update: the files in a new
    timestamped directory, ``..data_tmp`` pointing at it renamed over ``..data``, the old
    directory removed. The visible names are symlinks through ``..data`` and never change."""
    version = mount / f"..{stamp}"
    version.mkdir()
    shutil.copyfile(certs.server_cert, version / "tls.crt")
    shutil.copyfile(certs.server_key, version / "tls.key")
    previous = os.readlink(mount / "..data") if (mount / "..data").is_symlink() else None
    os.symlink(version.name, mount / "..data_tmp")
    os.replace(mount / "..data_tmp", mount / "..data")
    for name in ("tls.crt", "tls.key"):
        if not (mount / name).is_symlink():
            os.symlink(f"..data/{name}", mount / name)
    if previous is not None:
        shutil.rmtree(mount / previous)


def test_kubelet_secret_update_is_served(
    start_sidecar: SidecarFactory, config_dir: Path, sets: tuple[Certificates, Certificates], tmp_path: Path
) -> None:
    old, new = sets
    mount = tmp_path / "secret"
    mount.mkdir()
    kubelet_write(mount, old, "2026_11_28_00_00_00.1")
    tls = ["--tls-cert", str(mount / "tls.crt"), "--tls-key", str(mount / "tls.key")]
    sidecar = start_sidecar(*tls, config=config_dir, probe_tls=old.ca, metrics=True)
    metrics_port = sidecar.metrics_port
    kubelet_write(mount, new, "2026_11_28_00_05_00.2")
    poll(lambda: answers(sidecar.address, new, False), "the certificate of the new Secret is served")
    assert not answers(sidecar.address, old, False)
    assert reloads(metrics_port, "refused") == 0


def test_a_mismatched_or_half_written_set_keeps_the_served_one(
    start_sidecar: SidecarFactory, config_dir: Path, sets: tuple[Certificates, Certificates], tmp_path: Path
) -> None:
    old, new = sets
    served = tmp_path / "served"
    served.mkdir()
    install(old, served, False)
    sidecar, port = start(start_sidecar, config_dir, served, old, False)

    shutil.copyfile(new.server_cert, served / "cert.pem")  # the new certificate, the old key
    poll(lambda: reloads(port, "refused") >= 1, "the mismatched pair is refused")
    refused = [event for event in log_events(sidecar.stderr()) if event["event"] == "tls_reload_refused"]
    assert "does not belong to the certificate" in refused[-1]["reason"], refused
    assert answers(sidecar.address, old, False), "the served pair is kept"

    key = new.server_key.read_bytes()
    (served / "key.pem").write_bytes(key[: len(key) // 2])  # cut short mid-write
    poll(lambda: reloads(port, "refused") >= 2, "the half-written key is refused")
    assert answers(sidecar.address, old, False), "the served pair is still kept"
    assert not answers(sidecar.address, new, False)

    (served / "key.pem").write_bytes(key)  # the write completes
    poll(lambda: answers(sidecar.address, new, False), "the completed pair is served")
    assert reloads(port, "ok") == 1


# -- the Redis client ----------------------------------------------------------------


def redis_flags(certs: Certificates) -> list[str]:
    """A TLS-only server whose certificate ``certs``' CA signed, verifying client
    certificates against that CA when a client sends one (the sidecar does)."""
    return [*launcher.tls_flags(certs.server_cert, certs.server_key, certs.ca), "--tls-auth-clients", "optional"]


def client_files(certs: Certificates, directory: Path) -> None:
    for name, source in (("ca.pem", certs.ca), ("client.pem", certs.client_cert), ("client.key", certs.client_key)):
        shutil.copyfile(source, directory / f".{name}.tmp")
        os.replace(directory / f".{name}.tmp", directory / name)


async def ping_until(client: object, budget: float = BUDGET) -> None:
    """PING until answered (the first attempts may meet a connection the restart cut)."""
    deadline = time.monotonic() + budget
    while True:
        try:
            assert await client.ping()  # type: ignore[attr-defined]
            return
        except (RedisError, OSError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


@pytest.mark.redis
async def test_redis_connections_use_rotated_tls_files(sets: tuple[Certificates, Certificates], tmp_path: Path) -> None:
    old, new = sets
    files = tmp_path / "client"
    files.mkdir()
    client_files(old, files)
    server = RedisServer(tmp_path / "redis", redis_flags(old), tls=True)
    (tmp_path / "redis").mkdir()
    shutil.copyfile(old.ca, tmp_path / "redis" / "cert.pem")  # what the fixture's own client trusts
    query = f"ssl_ca_certs={files / 'ca.pem'}&ssl_certfile={files / 'client.pem'}&ssl_keyfile={files / 'client.key'}"
    with running(server):
        client = connect(f"{server.url}/0?{query}", False, 1.0)
        assert isinstance(client, Redis)
        try:
            await ping_until(client)
            ok_before, refused_before = TLS_RELOADS.get("redis", "ok"), TLS_RELOADS.get("redis", "refused")

            # A half-rotated set (new certificate, old key) is not used: the connection keeps its files.
            shutil.copyfile(new.client_cert, files / "client.pem")
            await client.connection_pool.disconnect()
            await ping_until(client)
            assert TLS_RELOADS.get("redis", "refused") == refused_before + 1

            # The server moves to the new CA and so do the client's files: reconnects use them.
            client_files(new, files)
            server.extra = redis_flags(new)
            shutil.copyfile(new.ca, tmp_path / "redis" / "cert.pem")
            server.restart()
            await ping_until(client)
            assert TLS_RELOADS.get("redis", "ok") == ok_before + 1
        finally:
            await client.aclose()
