"""A small xDS control plane: serves a directory of YAML limit files over ADS (State of the World).

    python -m stack.xds_server --dir examples/config --port 18000

Each ``*.yaml``/``*.yml`` file becomes one ``RateLimitConfig`` resource named after the
file (``tenants.yaml`` is ``tenants``), with the type URL envoyproxy/ratelimit's xDS client
and ``ratelimit-sidecar serve --config-source xds`` subscribe to. The directory is polled;
when its bytes change, every open stream is sent the whole set again, versioned by a digest
of the files (so a restarted server announces the same version for the same files). A file
that does not parse as YAML keeps the last good set serving; a file that parses but breaks
a rule (a unit left out) is served as it is, so the client's NACK can be seen: every ACK
and NACK is printed as one JSON line (``{"event": "nack", "error_detail": ...}``).

It is for trying the xDS source and for the tests; a production control plane (Envoy
Gateway, a go-control-plane server) serves the same resource type from its own state.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import sys
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import yaml
from google.protobuf import any_pb2

from sidecar.config.xds_source import TYPE_URL
from sidecar.protos.envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from sidecar.protos.ratelimit.config.ratelimit.v3 import rls_conf_pb2
from stack.processes import Child, free_port, tcp_answers

SUFFIXES = (".yaml", ".yml")


@dataclass(frozen=True)
class Snapshot:
    """The resources served now, and their version."""

    version: str
    resources: tuple[Any, ...]


def descriptor_message(document: dict[str, Any]) -> Any:
    """One YAML descriptor as a ``RateLimitDescriptor`` (fields the proto lacks are dropped)."""
    descriptor = rls_conf_pb2.RateLimitDescriptor(
        key=str(document.get("key", "")),
        value=str(document.get("value", "")),
        shadow_mode=bool(document.get("shadow_mode", False)),
        descriptors=[descriptor_message(child) for child in document.get("descriptors") or []],
    )
    limit = document.get("rate_limit")
    if isinstance(limit, dict):
        descriptor.rate_limit.CopyFrom(policy_message(limit))
    return descriptor


def policy_message(limit: dict[str, Any]) -> Any:
    """A ``rate_limit`` mapping as a ``RateLimitPolicy``; a unit the proto lacks is UNKNOWN (0)."""
    unit = str(limit.get("unit", "unknown")).upper()
    replaces = [rls_conf_pb2.RateLimitReplace(name=str(item.get("name", ""))) for item in limit.get("replaces") or []]
    return rls_conf_pb2.RateLimitPolicy(
        unit=rls_conf_pb2.RateLimitUnit.Value(unit) if unit in rls_conf_pb2.RateLimitUnit.keys() else 0,  # noqa: SIM118
        requests_per_unit=int(limit.get("requests_per_unit", 0)),
        unlimited=bool(limit.get("unlimited", False)),
        name=str(limit.get("name", "")),
        replaces=replaces,
    )


def resource(name: str, document: dict[str, Any]) -> Any:
    """A limits file's document as a packed ``RateLimitConfig`` resource."""
    config = rls_conf_pb2.RateLimitConfig(
        name=name,
        domain=str(document.get("domain", "")),
        descriptors=[descriptor_message(item) for item in document.get("descriptors") or []],
    )
    packed = any_pb2.Any()
    packed.Pack(config)
    return packed


def read_directory(directory: Path) -> tuple[str, list[tuple[str, bytes]]]:
    """The digest of the directory's limit files and ``(name, bytes)`` of each, sorted."""
    files = sorted(p for p in directory.iterdir() if p.suffix in SUFFIXES and not p.name.startswith("."))
    digest = hashlib.sha256()
    contents = []
    for file in files:
        raw = file.read_bytes()
        digest.update(file.name.encode() + b"\0" + raw + b"\0")
        contents.append((file.stem, raw))
    return digest.hexdigest()[:16], contents


def snapshot_of(directory: Path) -> Snapshot:
    """The resources of the directory now; ``ValueError`` naming the file that is not YAML."""
    version, contents = read_directory(directory)
    resources = []
    for name, raw in contents:
        try:
            document = yaml.safe_load(raw) or {}
        except yaml.YAMLError as error:
            raise ValueError(f"{name}: not YAML: {error}") from None
        if not isinstance(document, dict):
            raise ValueError(f"{name}: expected a mapping with domain and descriptors")
        resources.append(resource(name, document))
    return Snapshot(version, tuple(resources))


def emit(event: str, **fields: Any) -> None:
    """One JSON line on stdout, with the wall-clock time: what the tests, the benchmark
    (``loadtest.xds_propagation``) and a person trying it read."""
    print(json.dumps({"event": event, "t": time.time(), **fields}), flush=True)


class DirectoryAds(ads_pb2_grpc.AggregatedDiscoveryServiceServicer):  # type: ignore[misc]
    """ADS over one directory's snapshot: each stream gets the snapshot on subscribing and
    again whenever it changes."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.snapshot = snapshot_of(directory)
        self.changed = asyncio.Event()

    async def watch(self, poll: float) -> None:
        """Poll the directory; publish a new snapshot when its files' bytes change."""
        while True:
            await asyncio.sleep(poll)
            try:
                version, _ = await asyncio.to_thread(read_directory, self.directory)
                if version == self.snapshot.version:
                    continue
                self.snapshot = await asyncio.to_thread(snapshot_of, self.directory)
            except (OSError, ValueError) as error:
                emit("directory_refused", error=str(error), serving=self.snapshot.version)
                continue
            emit("snapshot", version=self.snapshot.version, resources=len(self.snapshot.resources))
            self.changed.set()
            self.changed = asyncio.Event()

    async def StreamAggregatedResources(self, requests: Any, context: Any) -> AsyncIterator[Any]:  # noqa: N802
        subscribed = asyncio.Event()
        reader = asyncio.ensure_future(self._read(requests, subscribed))
        sent = None
        try:
            while not reader.done():
                changed = self.changed
                if subscribed.is_set() and self.snapshot.version != sent:
                    snapshot = self.snapshot
                    nonce = uuid.uuid4().hex[:12]
                    yield discovery_pb2.DiscoveryResponse(
                        version_info=snapshot.version, resources=snapshot.resources, type_url=TYPE_URL, nonce=nonce
                    )
                    emit("sent", version=snapshot.version, nonce=nonce, peer=context.peer())
                    sent = snapshot.version
                    continue
                waits = [reader, asyncio.ensure_future(changed.wait()), asyncio.ensure_future(subscribed.wait())]
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                for waiting in waits[1:]:
                    waiting.cancel()
        finally:
            reader.cancel()

    async def _read(self, requests: Any, subscribed: asyncio.Event) -> None:
        async for request in requests:
            if request.type_url != TYPE_URL:
                continue
            fields = {"node": request.node.id, "version": request.version_info, "nonce": request.response_nonce}
            if request.HasField("error_detail"):
                emit("nack", **fields, error_detail=request.error_detail.message, code=request.error_detail.code)
            elif request.response_nonce:
                emit("ack", **fields)
            else:
                emit("subscribe", **fields)
            subscribed.set()


def server_credentials(cert: Path, key: Path, client_ca: Path | None) -> grpc.ServerCredentials:
    """TLS for the ADS port; with ``client_ca``, clients must present a certificate it signed."""
    return grpc.ssl_server_credentials(
        [(key.read_bytes(), cert.read_bytes())],
        root_certificates=client_ca.read_bytes() if client_ca else None,
        require_client_auth=client_ca is not None,
    )


async def serve(
    directory: Path, host: str, port: int, poll: float, credentials: grpc.ServerCredentials | None = None
) -> None:
    ads = DirectoryAds(directory)
    server = grpc.aio.server()
    ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(ads, server)
    address = f"{host}:{port}"
    bound = server.add_insecure_port(address) if credentials is None else server.add_secure_port(address, credentials)
    await server.start()
    emit("listening", address=f"{host}:{bound}", version=ads.snapshot.version, resources=len(ads.snapshot.resources))
    watcher = asyncio.create_task(ads.watch(poll))
    try:
        await server.wait_for_termination()
    finally:
        watcher.cancel()


class XdsServerProcess(Child):
    """``python -m stack.xds_server`` as a child of the stack (for the load tools)."""

    def __init__(self, directory: Path, logs: Path, poll: float = 0.2, tls: Sequence[str] = ()) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "stack.xds_server", "--dir", str(directory), "--port", str(self.port)]
        super().__init__("xds-server", [*argv, "--poll", str(poll), *tls], logs / "xds-server.log")

    def ready(self) -> bool:
        return tcp_answers(self.port)

    def events(self) -> list[dict[str, Any]]:
        """Every JSON line it printed so far."""
        return [json.loads(line) for line in self.log_text().splitlines() if line.startswith("{")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, type=Path, help="directory of *.yaml limit files")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=18000)
    parser.add_argument("--poll", type=float, default=0.2, help="seconds between looks at the directory")
    parser.add_argument("--tls-cert", type=Path, help="serve TLS with this certificate (PEM), with --tls-key")
    parser.add_argument("--tls-key", type=Path)
    parser.add_argument("--tls-client-ca", type=Path, help="require client certificates signed by this CA")
    args = parser.parse_args(argv)
    try:
        credentials = server_credentials(args.tls_cert, args.tls_key, args.tls_client_ca) if args.tls_cert else None
        asyncio.run(serve(args.dir, args.host, args.port, args.poll, credentials))
    except (OSError, ValueError) as error:
        print(f"xds_server: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
