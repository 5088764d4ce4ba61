"""redis-server, the one launcher: a plain server, TLS and ACL flags, Cluster nodes joined by
``redis-cli --cluster create``, and Sentinel.

Every redis-server the stack, the load tools and the test harnesses start gets its command
line from :func:`server_argv` (or :func:`sentinel_argv`) and its process from
:func:`stack.processes.spawn`: loopback only, no persistence unless asked for.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from stack.processes import Child, free_port, free_port_in, port_free, spawn

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
REDIS_CLI = shutil.which("redis-cli") or "/usr/bin/redis-cli"


def available() -> bool:
    """True when redis-server is installed."""
    return Path(REDIS_SERVER).exists() or shutil.which("redis-server") is not None


def server_argv(port: int, directory: Path | None = None, *, tls: bool = False, extra: Sequence[str] = ()) -> list[str]:
    """redis-server on 127.0.0.1:``port`` (TLS only with ``tls``: plain port off), persistence
    off, its files in ``directory``; ``extra`` flags last (they win over the defaults)."""
    ports = ["--port", "0", "--tls-port", str(port)] if tls else ["--port", str(port)]
    files = ["--dir", str(directory)] if directory is not None else []
    return [REDIS_SERVER, *ports, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", *files, *extra]


def tls_flags(cert: Path, key: Path, ca: Path) -> list[str]:
    """The flags of a TLS-only server whose clients need no certificate of their own."""
    return [
        *("--tls-cert-file", str(cert), "--tls-key-file", str(key), "--tls-ca-cert-file", str(ca)),
        *("--tls-auth-clients", "no"),
    ]


def acl_flags(user: str, password: str) -> list[str]:
    """Only ``user`` with ``password`` gets in; the default user is off."""
    return ["--user", user, "on", f">{password}", "~*", "&*", "+@all", "--user", "default", "off"]


CLUSTER_FLAGS = (
    "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000",
    "--repl-diskless-sync-delay", "0",
)  # fmt: skip
"""The flags of a Cluster node (see :func:`create_cluster`). Redis 7 waits 5 s before a full
sync, for more replicas to join it: with one replica per master that is idle time after the
Cluster's creation and after every rejoin of a killed node."""


def create_cluster(addresses: Sequence[str], timeout: float, replicas: int = 0) -> subprocess.CompletedProcess[str]:
    """``redis-cli --cluster create`` over running Cluster nodes: masters only by default,
    else ``replicas`` replicas per master (``addresses`` then holds masters x (1 + replicas))."""
    return subprocess.run(
        [REDIS_CLI, "--cluster", "create", *addresses, "--cluster-replicas", str(replicas), "--cluster-yes"],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def sentinel_argv(conf: Path) -> list[str]:
    """redis-server as a Sentinel reading ``conf`` (which it rewrites)."""
    return [REDIS_SERVER, str(conf), "--sentinel"]


def start(argv: Sequence[str], log: IO[bytes]) -> subprocess.Popen[bytes]:
    """A redis-server (or Sentinel) with its output to ``log``, as the test harnesses run it:
    in the caller's session and directory, killed by the caller."""
    return spawn(argv, stdout=log, stdin=None, cwd=Path.cwd(), own_session=False, die_with_parent=False)


class RedisProcess(Child):
    """redis-server on loopback without persistence, its files in ``directory``."""

    ready_sign = "PONG"

    def __init__(self, directory: Path, port: int = 0, extra: Sequence[str] = ()) -> None:
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}"
        argv = server_argv(self.port, directory, extra=["--daemonize", "no", "--loglevel", "warning", *extra])
        super().__init__("redis", argv, directory / "redis.log")

    def ready(self) -> bool:
        """One PING over a raw socket (no client library needed)."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as connection:
                connection.sendall(b"PING\r\n")
                return connection.recv(16).startswith(b"+PONG")
        except OSError:
            return False


# ---------------------------------------------------------------------------------
# Cluster with replicas, Sentinel with a quorum, slot migration: the store-faults area
# ---------------------------------------------------------------------------------


HARNESS_CLUSTER_PORTS = (23_000, 25_000)
"""Where the reliability harness's Cluster nodes listen (the test suite's own nodes use
20,000-22,000, so a harness run beside the tests never takes their ports)."""


def cluster_port(ports: tuple[int, int] = HARNESS_CLUSTER_PORTS) -> int:
    """A free port in ``ports`` whose Cluster bus port (+10000) is free too: below Linux's
    ephemeral range (a node's port must be at most 55535)."""
    port = free_port_in(range(*ports), also_free=lambda port: port_free(port + 10_000), tries=200)
    if port is None:
        raise RuntimeError("no free pair of ports for a Cluster node")
    return port


def cluster_node(directory: Path) -> RedisProcess:
    """A Cluster node (:data:`CLUSTER_FLAGS`) keeping ``nodes.conf`` in ``directory``: started
    again (:meth:`RedisProcess.start`) after a kill, it rejoins on its port with its identity."""
    return RedisProcess(directory, cluster_port(), extra=CLUSTER_FLAGS)


def admin(port: int, timeout: float = 5.0) -> Any:
    """A plain redis-py client of one server (Cluster node, replica or Sentinel), for set-up and faults."""
    import redis  # noqa: PLC0415 - the launchers above need no client library

    return redis.Redis(host="127.0.0.1", port=port, socket_timeout=timeout, decode_responses=True)


def cluster_ok(ports: Sequence[int]) -> bool:
    """Every node says ``cluster_state:ok`` and knows every other node as connected."""
    for port in ports:
        with admin(port, 2.0) as client:
            if "cluster_state:ok" not in client.execute_command("CLUSTER", "INFO"):
                return False
            nodes = [line.split() for line in str(client.execute_command("CLUSTER", "NODES")).splitlines() if line]
            healthy = [
                node for node in nodes if node[7] == "connected" and not {"fail", "fail?"} & set(node[2].split(","))
            ]
            if len(healthy) < len(ports):
                return False
    return True


def replica_synced(port: int) -> bool:
    """``port`` is a replica whose link to its master is up."""
    with admin(port, 2.0) as client:
        info = client.info("replication")
    return bool(info.get("role") == "slave" and info.get("master_link_status") == "up")


def role(port: int) -> str:
    """``master`` or ``slave`` (``ROLE``'s first word)."""
    with admin(port, 1.0) as client:
        return str(client.execute_command("ROLE")[0])


def slot_owners(port: int) -> dict[int, int]:
    """Slot -> port of the master serving it, as node ``port`` sees the Cluster."""
    with admin(port, 2.0) as client:
        ranges = client.execute_command("CLUSTER", "SLOTS")
    owners: dict[int, int] = {}
    for first, last, master, *_ in ranges:
        owners.update(dict.fromkeys(range(int(first), int(last) + 1), int(master[1])))
    return owners


def replica_of(ports: Sequence[int], master_port: int) -> int:
    """The port of a replica whose master is ``master_port``."""
    for port in ports:
        with admin(port, 2.0) as client:
            info = client.info("replication")
        if info.get("role") == "slave" and int(info.get("master_port", 0)) == master_port:
            return port
    raise LookupError(f"no replica of 127.0.0.1:{master_port} among {list(ports)}")


def begin_slot_migration(source: int, target: int, slot: int) -> None:
    """``slot`` IMPORTING on ``target`` and MIGRATING on ``source`` (in that order, as
    ``redis-cli --cluster reshard`` does): keys still on the source are served there,
    others are redirected with ASK, and a script over keys on both sides gets TRYAGAIN."""
    with admin(source) as origin, admin(target) as destination:
        destination.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", origin.execute_command("CLUSTER", "MYID"))
        origin.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", destination.execute_command("CLUSTER", "MYID"))


def migrate_slot_keys(source: int, target: int, slot: int, limit: int = 1000) -> int:
    """MIGRATE up to ``limit`` keys of ``slot`` from ``source`` to ``target``; how many moved."""
    with admin(source, 10.0) as origin:
        keys = origin.execute_command("CLUSTER", "GETKEYSINSLOT", slot, limit)
        if keys:
            origin.execute_command("MIGRATE", "127.0.0.1", target, "", 0, 5000, "REPLACE", "KEYS", *keys)
    return len(keys)


def finish_slot_migration(source: int, target: int, slot: int, masters: Sequence[int]) -> int:
    """Move the slot's remaining keys, then give ``slot`` to ``target`` on the target, the
    source and every other master; returns the keys moved at the end."""
    moved = 0
    while count := migrate_slot_keys(source, target, slot):
        moved += count
    with admin(target) as destination:
        owner = destination.execute_command("CLUSTER", "MYID")
        destination.execute_command("CLUSTER", "SETSLOT", slot, "NODE", owner)
    for port in [source, *(port for port in masters if port not in {source, target})]:
        with admin(port) as client:
            client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", owner)
    return moved


def sentinel_conf(
    directory: Path, port: int, service: str, master_port: int, *, quorum: int, down_after_ms: int = 2000
) -> Path:
    """``sentinel.conf`` of a Sentinel on ``port`` watching ``service`` at ``master_port``."""
    directory.mkdir(parents=True, exist_ok=True)
    conf = directory / "sentinel.conf"
    conf.write_text(
        f"port {port}\nbind 127.0.0.1\ndir {directory}\n"
        f"sentinel monitor {service} 127.0.0.1 {master_port} {quorum}\n"
        f"sentinel down-after-milliseconds {service} {down_after_ms}\n"
        f"sentinel failover-timeout {service} 10000\n"
    )
    return conf


class SentinelProcess(RedisProcess):
    """A Sentinel on loopback (its config in ``directory``), ready when it answers PING."""

    def __init__(self, directory: Path, service: str, master_port: int, quorum: int, down_after_ms: int = 2000) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}"
        self.service = service
        conf = sentinel_conf(directory, self.port, service, master_port, quorum=quorum, down_after_ms=down_after_ms)
        Child.__init__(self, "sentinel", sentinel_argv(conf), directory / "sentinel.log")

    def master_port(self) -> int:
        """The port of the master this Sentinel names now."""
        with admin(self.port, 1.0) as client:
            _, port = client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service)
        return int(port)
