"""sidecar/tls_files.py and the Redis connection classes, without a server: what a set of
files must be to be used, what the gRPC fetcher hands out, when a Redis connection
builds a new context. The handshakes themselves are in test_tls_rotation.py."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from sidecar.limiter.redis.connect import connect, refresh_tls, rotating_tls
from sidecar.tls_files import (
    RedisTlsFiles,
    ReloadCounts,
    RotatingServerCredentials,
    ServerTlsFiles,
    TlsFileError,
    load_server_tls,
)
from stack.tls import OPENSSL, Certificates, make_certificates


@pytest.fixture(scope="module")
def sets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Certificates, Certificates]:
    if OPENSSL is None:
        pytest.skip("openssl is not installed: cannot make certificates")
    base = tmp_path_factory.mktemp("tls-files")
    return make_certificates(base / "a"), make_certificates(base / "b")


def served(directory: Path, certs: Certificates, ca: bool = False) -> ServerTlsFiles:
    shutil.copyfile(certs.server_cert, directory / "cert.pem")
    shutil.copyfile(certs.server_key, directory / "key.pem")
    if ca:
        shutil.copyfile(certs.ca, directory / "ca.pem")
    return ServerTlsFiles(
        str(directory / "cert.pem"), str(directory / "key.pem"), str(directory / "ca.pem") if ca else None
    )


def test_a_key_of_another_certificate_is_refused_by_name(
    sets: tuple[Certificates, Certificates], tmp_path: Path
) -> None:
    old, new = sets
    files = served(tmp_path, old)
    shutil.copyfile(new.server_key, tmp_path / "key.pem")
    with pytest.raises(TlsFileError, match=r"--tls-cert .*cert.pem / --tls-key .*key.pem: the key does not belong"):
        load_server_tls(files)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: (d / "key.pem").write_bytes((d / "key.pem").read_bytes()[:300]), "cannot load"),
        (lambda d: (d / "cert.pem").write_bytes((d / "cert.pem").read_bytes()[:300]), "cannot load"),
        (lambda d: (d / "key.pem").unlink(), "--tls-key .*key.pem: No such file"),
        (lambda d: (d / "ca.pem").write_bytes(b"-----BEGIN CERTIFICATE-----\nnot base64\n"), "--tls-client-ca"),
    ],
    ids=["half-written key", "half-written cert", "missing key", "bad client CA"],
)
def test_an_unusable_set_says_which_file(
    sets: tuple[Certificates, Certificates], tmp_path: Path, damage: object, message: str
) -> None:
    files = served(tmp_path, sets[0], ca=True)
    damage(tmp_path)  # type: ignore[operator]
    with pytest.raises(TlsFileError, match=message):
        load_server_tls(files)


def test_the_fetcher_hands_a_new_set_once_and_never_a_refused_one(
    sets: tuple[Certificates, Certificates], tmp_path: Path
) -> None:
    old, new = sets
    counts = ReloadCounts()
    rotating = RotatingServerCredentials(served(tmp_path, old, ca=True), counts)
    assert rotating.credentials() is not None
    fetch = rotating._fetch
    assert fetch() is None, "the initial set is gRPC's already"
    assert rotating.reload() is None and fetch() is None, "unchanged files: nothing to hand"

    shutil.copyfile(new.server_cert, tmp_path / "cert.pem")  # half a rotation
    assert rotating.reload() is False
    assert fetch() is None
    assert counts.get("server", "refused") == 1

    served(tmp_path, new, ca=True)
    assert rotating.reload() is True
    assert rotating.active.chain == new.server_cert.read_bytes()
    assert fetch() is not None
    assert fetch() is None, "handed once; later handshakes keep it"
    assert (counts.get("server", "ok"), counts.get("server", "refused")) == (1, 1)
    assert rotating.reload() is None


def test_tls_clients_get_the_rotating_connection_class(tmp_path: Path) -> None:
    plain = connect("redis://127.0.0.1:1/0", False, 1.0)
    tls = connect("rediss://127.0.0.1:1/0", False, 1.0)
    sentinel = connect("rediss+sentinel://127.0.0.1:1/mymaster", False, 1.0)
    assert plain.connection_pool.connection_class.__name__ == "Connection"  # type: ignore[union-attr]
    assert tls.connection_pool.connection_class.__name__ == "RotatingSSLConnection"  # type: ignore[union-attr]
    master_class = sentinel.connection_pool.connection_class  # type: ignore[union-attr]
    assert master_class.__name__ == "RotatingSentinelManagedSSLConnection"
    asking = sentinel.connection_pool.sentinel_manager.sentinels  # type: ignore[union-attr]
    assert [client.connection_pool.connection_class.__name__ for client in asking] == ["RotatingSSLConnection"]
    cluster = connect("rediss+cluster://127.0.0.1:1", False, 1.0)
    nodes = cluster.nodes_manager.startup_nodes.values()  # type: ignore[union-attr]
    assert [node.connection_class.__name__ for node in nodes] == ["RotatingSSLConnection"]
    assert cluster.connection_kwargs["connection_class"].__name__ == "RotatingSSLConnection"  # type: ignore[union-attr]
    plain_cluster = connect("redis+cluster://127.0.0.1:1", False, 1.0)
    assert plain_cluster.connection_kwargs["connection_class"].__name__ == "Connection"  # type: ignore[union-attr]


def test_a_redis_connection_builds_a_context_only_when_its_files_changed(
    sets: tuple[Certificates, Certificates], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from redis.asyncio.connection import SSLConnection

    old, new = sets
    notes = RedisTlsFiles(ReloadCounts())
    monkeypatch.setattr("sidecar.limiter.redis.connect.REDIS_TLS", notes)
    for name, source in (("ca.pem", old.ca), ("client.pem", old.client_cert), ("client.key", old.client_key)):
        shutil.copyfile(source, tmp_path / name)
    paths = {"ssl_ca_certs": tmp_path / "ca.pem", "ssl_certfile": tmp_path / "client.pem"}
    options = {key: str(value) for key, value in paths.items()} | {"ssl_keyfile": str(tmp_path / "client.key")}
    first, second = (rotating_tls(SSLConnection)(host="127.0.0.1", port=1, **options) for _ in range(2))

    refresh_tls(first)
    built = first.ssl_context.context
    refresh_tls(first)
    assert first.ssl_context.context is built, "unchanged files: the context is kept"

    shutil.copyfile(new.client_cert, tmp_path / "client.pem.tmp")  # certificate without its key
    (tmp_path / "client.pem.tmp").replace(tmp_path / "client.pem")
    refresh_tls(first)
    assert first.ssl_context.context is built, "a mismatched pair keeps the context"
    assert notes.counts.get("redis", "refused") == 1

    shutil.copyfile(new.client_key, tmp_path / "client.key")
    refresh_tls(first)
    assert first.ssl_context.context is not built
    refresh_tls(second)  # a second connection to the same files: no second announcement
    assert (notes.counts.get("redis", "ok"), notes.counts.get("redis", "refused")) == (1, 1)


def test_checking_a_pair_writes_no_file(
    sets: tuple[Certificates, Certificates], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shipped manifests mount the root filesystem read-only: no temporary file."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "nowhere"))
    assert load_server_tls(served(tmp_path, sets[0])).key == sets[0].server_key.read_bytes()


def test_a_combined_pem_is_watched_once() -> None:
    assert ServerTlsFiles("/s/both.pem", "/s/both.pem", "/s/ca.pem").paths() == ("/s/both.pem", "/s/ca.pem")


def test_the_logged_fingerprint_is_openssls(sets: tuple[Certificates, Certificates], tmp_path: Path) -> None:
    assert OPENSSL is not None
    printed = subprocess.run(
        [OPENSSL, "x509", "-noout", "-fingerprint", "-sha256", "-in", str(sets[0].server_cert)],
        capture_output=True, text=True, check=True, timeout=30,
    ).stdout  # fmt: skip
    assert load_server_tls(served(tmp_path, sets[0])).fingerprint == printed.split("=", 1)[1].strip().replace(":", "")
