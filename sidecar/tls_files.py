"""TLS certificates and keys read from files that are rotated while the sidecar serves.

cert-manager, Vault agents and the kubelet replace certificate files in place: a Secret
update swaps the mount's ``..data`` symlink to a new timestamped directory, other tools
rename a new file over the old one. A certificate kept in memory from startup would
expire, or stop verifying once the old CA is withdrawn, until someone restarts the pod.

Two consumers:

* the gRPC server (:class:`RotatingServerCredentials`): gRPC's core asks a fetcher for
  the certificate configuration on every new handshake, from one of its own threads.
  The fetcher only hands back an object made beforehand (never reads a file, never
  blocks); :meth:`RotatingServerCredentials.reload` (run in a worker thread when a
  watched file changed) reads, validates and swaps it. Connections already open keep
  the session they negotiated, so calls in flight are never cut.
* the Redis client (:class:`RedisTlsFiles`, used by sidecar/limiter/redis/connect.py):
  a connection checks, when it (re)connects, whether its files changed since it built
  its context, and builds a new one if so.

Either way a new set is used only once it loads as a whole: a key that does not match
its certificate, a half-written (truncated) PEM or a missing file keeps the set in use,
and says why in a ``tls_reload_refused`` log line. Each outcome is counted in
``ratelimit_sidecar_tls_reloads{side, result}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import ssl
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import structlog
from prometheus_client.core import CounterMetricFamily, Metric

log = structlog.get_logger(__name__)

SETTLE_SECONDS = 0.5
"""After a file event, wait until no other event came for this long before reloading:
tools that rename the certificate and then the key would otherwise be caught between."""


class TlsFileError(Exception):
    """A certificate, key or CA file that cannot be used; the message names the flag and file."""


@dataclass(frozen=True, slots=True)
class ServerTlsFiles:
    """The gRPC server's files, and the flag each came from (for messages)."""

    cert: str
    key: str
    client_ca: str | None = None

    def paths(self) -> tuple[str, ...]:
        """The distinct files to watch (a combined PEM may be both the cert and the key)."""
        return tuple(dict.fromkeys(path for path in (self.cert, self.key, self.client_ca) if path))


@dataclass(frozen=True, slots=True)
class ServerTls:
    """One loaded, validated set: the PEM bytes gRPC takes, and a digest to tell sets apart."""

    chain: bytes
    key: bytes
    client_ca: bytes | None
    digest: str

    @property
    def fingerprint(self) -> str:
        """SHA-256 of the leaf certificate, as ``openssl x509 -noout -fingerprint -sha256``
        prints it (without the colons): what an operator compares with the issued one."""
        text = self.chain.decode("ascii", "replace")
        end = text.find("-----END CERTIFICATE-----")
        start = text.rfind("-----BEGIN CERTIFICATE-----", 0, end)
        if start < 0 or end < 0:
            return "unknown"
        return hashlib.sha256(ssl.PEM_cert_to_DER_cert(text[start : end + 25])).hexdigest().upper()

    def configuration(self) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration([(self.key, self.chain)], root_certificates=self.client_ca)


def read_pem(path: str, what: str) -> bytes:
    """A PEM file's bytes; :class:`TlsFileError` naming the flag and the file otherwise."""
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise TlsFileError(f"{what} {path}: {error.strerror or error}") from None
    if b"-----BEGIN " not in data:
        raise TlsFileError(f"{what} {path}: not a PEM file")
    return data


def load_server_tls(files: ServerTlsFiles) -> ServerTls:
    """Read and validate the server's files; :class:`TlsFileError` says what is wrong.

    gRPC itself would accept a key that does not match the certificate and then fail
    every handshake, so the pair is loaded into an :class:`ssl.SSLContext` first (which
    checks that the key matches and that each PEM parses whole).
    """
    key = read_pem(files.key, "--tls-key")
    chain = read_pem(files.cert, "--tls-cert")
    client_ca = read_pem(files.client_ca, "--tls-client-ca") if files.client_ca else None
    check_pair(chain, key, f"--tls-cert {files.cert} / --tls-key {files.key}")
    if client_ca is not None:
        try:
            ssl.create_default_context().load_verify_locations(cadata=client_ca.decode("ascii", "replace"))
        except (ssl.SSLError, ValueError) as error:
            raise TlsFileError(f"--tls-client-ca {files.client_ca}: {error}") from None
    digest = hashlib.sha256(b"\0".join((chain, key, client_ca or b""))).hexdigest()
    return ServerTls(chain, key, client_ca, digest)


def check_pair(chain: bytes, key: bytes, what: str) -> None:
    """Raise :class:`TlsFileError` unless ``key`` is the private key of ``chain``'s first
    certificate and both parse whole. :mod:`ssl` loads only from paths, so the bytes
    already read (exactly those then served) are handed to it as in-memory files."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    with _memory_file(chain) as cert_path, _memory_file(key) as key_path:
        try:
            context.load_cert_chain(cert_path, key_path)
        except ssl.SSLError as error:
            raise TlsFileError(f"{what}: {_ssl_reason(error)}") from None


@contextlib.contextmanager
def _memory_file(data: bytes) -> Iterator[str]:
    """A path that reads ``data``: an anonymous in-memory file (Linux ``memfd``), so no key
    touches a disk and a read-only root filesystem (the shipped manifests) is no obstacle;
    elsewhere a file in a private temporary directory."""
    if not hasattr(os, "memfd_create") or not os.path.isdir("/proc/self/fd"):
        with tempfile.TemporaryDirectory(prefix="tls-check-") as directory:  # mode 0700
            path = Path(directory, "pem")
            path.write_bytes(data)
            yield str(path)
        return
    descriptor = os.memfd_create("tls-check", os.MFD_CLOEXEC)
    try:
        with os.fdopen(descriptor, "wb", closefd=False) as handle:
            handle.write(data)
        yield f"/proc/self/fd/{descriptor}"
    finally:
        os.close(descriptor)


def _ssl_reason(error: ssl.SSLError) -> str:
    if error.reason == "KEY_VALUES_MISMATCH":
        return "the key does not belong to the certificate"
    return f"cannot load ({error.reason or error})"


class ReloadCounts:
    """``ratelimit_sidecar_tls_reloads{side, result}``: counted from any thread, read by scrapes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str], int] = {}

    def add(self, side: str, result: str) -> None:
        with self._lock:
            self._counts[side, result] = self._counts.get((side, result), 0) + 1

    def get(self, side: str, result: str) -> int:
        with self._lock:
            return self._counts.get((side, result), 0)

    def frozen(self) -> FrozenReloadCounts:
        with self._lock:
            return FrozenReloadCounts(dict(self._counts))


@dataclass(frozen=True, slots=True)
class FrozenReloadCounts:
    """One scrape's copy of :class:`ReloadCounts`."""

    counts: dict[tuple[str, str], int]

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "ratelimit_sidecar_tls_reloads",
            "Certificate files seen to change: ok (now served or used), refused (kept the previous set)",
            labels=("side", "result"),
        )
        for (side, result), count in sorted(self.counts.items()):
            family.add_metric((side, result), count)
        yield family


TLS_RELOADS = ReloadCounts()
"""The process's counts (the server and the Redis client share the family)."""


class RotatingServerCredentials:
    """gRPC server credentials whose certificate set follows its files.

    Usage: ``creds = RotatingServerCredentials(files)`` (raises :class:`TlsFileError`),
    ``server.add_secure_port(address, creds.credentials())``, then ``creds.reload()``
    (blocking: from a worker thread) whenever a file may have changed.
    """

    def __init__(self, files: ServerTlsFiles, counts: ReloadCounts = TLS_RELOADS) -> None:
        self.files = files
        self.counts = counts
        self.active = load_server_tls(files)
        self._offered: tuple[int, grpc.ServerCertificateConfiguration] = (0, self.active.configuration())
        self._handed = 0
        """Generation gRPC last received from the fetcher (written by gRPC's threads only)."""

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self._offered[1], self._fetch, require_client_authentication=self.files.client_ca is not None
        )

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """Called by gRPC's core before each handshake: the new set once, else None (keep)."""
        generation, configuration = self._offered  # one read of one tuple: never half a swap
        if generation == self._handed:
            return None
        self._handed = generation
        return configuration

    def reload(self) -> bool | None:
        """Load the files again: True when a new set is now offered, None when nothing
        changed, False when the files are unusable (the active set stays; logged)."""
        try:
            loaded = load_server_tls(self.files)
        except TlsFileError as error:
            self.counts.add("server", "refused")
            kept = self.active.fingerprint
            log.warning("tls_reload_refused", side="server", reason=str(error), kept_fingerprint=kept)
            return False
        if loaded.digest == self.active.digest:
            return None
        previous, self.active = self.active, loaded
        self._offered = (self._offered[0] + 1, loaded.configuration())
        self.counts.add("server", "ok")
        log.info(
            "tls_reloaded",
            side="server",
            cert=self.files.cert,
            fingerprint=loaded.fingerprint,
            previous_fingerprint=previous.fingerprint,
            hint="new handshakes use it; open connections keep theirs",
        )
        return True


class SettledReload:
    """Run ``reload`` (blocking, in a worker thread) once file events stop for ``settle`` seconds.

    :meth:`kick` is the watchers' callback; kicks during the wait or the reload give
    one more reload afterwards, never two at once.
    """

    def __init__(self, reload: Callable[[], object], settle: float = SETTLE_SECONDS) -> None:
        self.reload = reload
        self.settle = settle
        self._kicked = asyncio.Event()

    async def kick(self) -> None:
        self._kicked.set()

    async def run(self) -> None:
        """Until cancelled."""
        while True:
            await self._kicked.wait()
            while self._kicked.is_set():
                self._kicked.clear()
                await asyncio.sleep(self.settle)
            try:
                await asyncio.to_thread(self.reload)
            except Exception:  # a reload that crashed must not end the rotation for good
                log.exception("tls_reload_failed")


def file_identity(path: str | None) -> tuple[int, int, int, int] | None:
    """What tells a rotated file apart (symlinks followed): device, inode, size, mtime."""
    if not path:
        return None
    with contextlib.suppress(OSError):
        info = os.stat(path)
        return info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns
    return None


class RedisTlsFiles:
    """The Redis client's side: the version of each set of TLS files last built into a
    context, so a rotation is logged and counted once however many connections notice it."""

    def __init__(self, counts: ReloadCounts = TLS_RELOADS) -> None:
        self.counts = counts
        self._lock = threading.Lock()
        self._built: dict[tuple[str | None, ...], object] = {}
        self._refused: dict[tuple[str | None, ...], object] = {}

    def built(self, paths: tuple[str | None, ...], identity: object) -> None:
        """A connection built a context from ``paths`` as they are at ``identity``."""
        with self._lock:
            previous = self._built.get(paths)
            self._built[paths] = identity
        if previous is None or previous == identity:
            return  # the first build, or a version another connection already announced
        self.counts.add("redis", "ok")
        log.info("tls_reloaded", side="redis", files=[p for p in paths if p], hint="new Redis connections use them")

    def refused(self, paths: tuple[str | None, ...], identity: object, reason: str) -> None:
        """A connection could not load ``paths`` at ``identity`` and kept its context."""
        with self._lock:
            if self._refused.get(paths) == identity:
                return
            self._refused[paths] = identity
        self.counts.add("redis", "refused")
        log.warning("tls_reload_refused", side="redis", files=[p for p in paths if p], reason=reason, kept="previous")


REDIS_TLS = RedisTlsFiles()
