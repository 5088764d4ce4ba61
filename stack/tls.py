"""Throwaway certificates for TLS tests and the reliability report, made with the openssl
command line: a CA, a server certificate for 127.0.0.1 signed by it, a client certificate
signed by it, and a rogue client certificate signed by nobody the server trusts."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

OPENSSL = shutil.which("openssl")


@dataclass(frozen=True)
class Certificates:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    rogue_cert: Path
    rogue_key: Path


def _openssl(*args: str) -> None:
    assert OPENSSL is not None
    subprocess.run([OPENSSL, *args], capture_output=True, check=True, timeout=60)


def _signed(directory: Path, name: str, subject: str, ca: tuple[Path, Path], extensions: str) -> tuple[Path, Path]:
    key, request, cert, ext = (directory / f"{name}{suffix}" for suffix in (".key", ".csr", ".pem", ".ext"))
    ext.write_text(extensions)
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", subject, "-keyout", str(key), "-out", str(request))
    _openssl(
        "x509", "-req", "-in", str(request), "-CA", str(ca[0]), "-CAkey", str(ca[1]), "-CAcreateserial",
        "-days", "1", "-extfile", str(ext), "-out", str(cert),
    )  # fmt: skip
    return cert, key


def _authority(directory: Path, name: str) -> tuple[Path, Path]:
    key, cert = directory / f"{name}.key", directory / f"{name}.pem"
    _openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", f"/CN={name}",
        "-keyout", str(key), "-out", str(cert),
    )  # fmt: skip
    return cert, key


def make_certificates(directory: Path) -> Certificates:
    if OPENSSL is None:
        raise FileNotFoundError("openssl is not installed: cannot make certificates")
    directory.mkdir(parents=True, exist_ok=True)
    ca = _authority(directory, "test-ca")
    rogue_ca = _authority(directory, "rogue-ca")
    server = _signed(
        directory,
        "server",
        "/CN=127.0.0.1",
        ca,
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n",
    )
    client = _signed(directory, "client", "/CN=envoy", ca, "extendedKeyUsage=clientAuth\n")
    rogue = _signed(directory, "rogue", "/CN=intruder", rogue_ca, "extendedKeyUsage=clientAuth\n")
    return Certificates(ca[0], *server, *client, *rogue)
