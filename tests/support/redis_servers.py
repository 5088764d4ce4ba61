"""Real ``redis-server`` processes for the Redis tests: standalone, ACL, TLS and Cluster.

Each server runs on a free loopback port with persistence off, in its own temporary
directory, and is killed in teardown whatever the test did. The command lines and the
processes come from the one launcher, ``stack/redis.py``; these classes add waiting,
clients for assertions and the pytest fixtures. Test modules import the
fixtures they use (``from redis_fixtures import redis_server``), so no conftest
outside this file needs to know about Redis.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import redis
import redis.cluster

from sidecar.settings import Settings
from stack import redis as launcher
from tests.support.sidecars import free_port

REDIS_SERVER = launcher.REDIS_SERVER
REDIS_CLI = launcher.REDIS_CLI
OPENSSL = shutil.which("openssl")
READY_DEADLINE = 10.0
CLUSTER_DEADLINE = 20.0

ACL_USER = "limiter"
ACL_PASSWORD = "s3cr:et@/pw"
"""A password with URL-special characters, so the URL encoding is exercised too."""


SUITE_CLUSTER_PORTS = (20_000, 22_000)
"""The test suite's Cluster nodes (the reliability harness uses its own range)."""


class RedisServer:
    """One ``redis-server`` process; restartable on the same port with the same flags."""

    def __init__(self, directory: Path, extra: Sequence[str] = (), *, tls: bool = False, port: int = 0) -> None:
        self.directory = directory
        self.extra = list(extra)
        self.tls = tls
        self.port = port or free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.password: str | None = None
        self.username: str | None = None

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT`` (with credentials when ACL users are configured)."""
        scheme = "rediss" if self.tls else "redis"
        return f"{scheme}://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        extra = ["--enable-debug-command", "yes", *self.extra]
        return launcher.server_argv(self.port, self.directory, tls=self.tls, extra=extra)

    def start(self) -> RedisServer:
        """Start the process and wait until it answers PING."""
        self.directory.mkdir(parents=True, exist_ok=True)
        with (self.directory / "redis.log").open("ab") as log:
            self.process = launcher.start(self.command(), log)
        deadline = time.monotonic() + READY_DEADLINE
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"redis-server exited with {self.process.returncode}:\n{self.log()}")
            with contextlib.suppress(redis.RedisError, OSError):
                if self.client(timeout=0.5).ping():
                    return self
            time.sleep(0.02)
        self.kill()
        pytest.fail(f"redis-server not ready within {READY_DEADLINE}s:\n{self.log()}")

    def client(self, timeout: float = 5.0) -> redis.Redis:
        """A synchronous client for assertions (not the code under test)."""
        options: dict[str, object] = {"socket_timeout": timeout, "socket_connect_timeout": timeout}
        if self.tls:
            options |= {"ssl": True, "ssl_ca_certs": str(self.directory / "cert.pem")}
        return redis.Redis(
            host="127.0.0.1",
            port=self.port,
            username=self.username,
            password=self.password,
            decode_responses=True,
            **options,  # type: ignore[arg-type]
        )

    def kill(self) -> None:
        """SIGKILL and reap; safe to call twice."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)

    def restart(self, down_for: float = 0.0) -> None:
        """Kill (data is lost: persistence is off), stay down ``down_for`` seconds, start again."""
        self.kill()
        time.sleep(down_for)
        self.start()

    def pause(self, milliseconds: int, mode: str = "ALL") -> None:
        """``CLIENT PAUSE``: clients' commands (``WRITE``: writes and scripts only) wait that long."""
        self.client().execute_command("CLIENT", "PAUSE", milliseconds, mode)

    def debug_sleep(self, seconds: float) -> threading.Thread:
        """``DEBUG SLEEP`` in a thread: the whole server blocks, as under a long command."""
        client = self.client(timeout=seconds + 5)
        thread = threading.Thread(target=client.execute_command, args=("DEBUG", "SLEEP", seconds), daemon=True)
        thread.start()
        time.sleep(0.05)
        return thread

    def flushall(self) -> None:
        self.client().flushall()

    def log(self) -> str:
        path = self.directory / "redis.log"
        return path.read_text(errors="replace") if path.exists() else ""


class RedisCluster:
    """Three masters with ``--cluster-enabled yes``, joined by ``redis-cli --cluster create``;
    with ``replicas``, that many replicas per master (the fault tests kill masters).

    ``extra`` flags go to every node: the fault tests pass
    ``--cluster-require-full-coverage no``, so the masters still serving go on answering
    while a dead master's slots wait for its replica (with the default ``yes`` every node
    answers CLUSTERDOWN meanwhile; see docs/redis.md).
    """

    def __init__(self, directory: Path, masters: int = 3, *, replicas: int = 0, extra: Sequence[str] = ()) -> None:
        self.replicas = replicas
        self.nodes = [
            RedisServer(
                directory / f"node-{index}",
                [*launcher.CLUSTER_FLAGS, *extra],
                port=launcher.cluster_port(SUITE_CLUSTER_PORTS),
            )
            for index in range(masters * (1 + replicas))
        ]

    @property
    def url(self) -> str:
        """A seed node in our Cluster spelling."""
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def start(self) -> RedisCluster:
        for node in self.nodes:
            node.start()
        addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
        created = launcher.create_cluster(addresses, CLUSTER_DEADLINE, replicas=self.replicas)
        if created.returncode != 0:
            pytest.fail(f"redis-cli --cluster create failed:\n{created.stdout}\n{created.stderr}")
        self.wait_ok()
        if self.replicas:
            self.wait_until("every replica in sync", self._replicas_in_sync)
        return self

    def alive(self) -> list[RedisServer]:
        return [node for node in self.nodes if node.process is not None and node.process.poll() is None]

    def wait_ok(self) -> None:
        """Until every live node says ``cluster_state:ok`` (slots assigned and agreed)."""

        def ok() -> bool:
            states = [node.client().execute_command("CLUSTER", "INFO") for node in self.alive()]
            return all("cluster_state:ok" in str(state) for state in states)

        self.wait_until("cluster_state:ok", ok)

    def wait_until(self, what: str, condition: Callable[[], object]) -> None:
        deadline = time.monotonic() + CLUSTER_DEADLINE
        while time.monotonic() < deadline:
            with contextlib.suppress(redis.RedisError, OSError):
                if condition():
                    return
            time.sleep(0.05)
        pytest.fail(f"Redis Cluster: timed out waiting for {what}")

    def client(self) -> redis.cluster.RedisCluster:
        """A synchronous Cluster client for assertions (routes each key to its node)."""
        seed = self.alive()[0]
        return redis.cluster.RedisCluster(host="127.0.0.1", port=seed.port, decode_responses=True)

    def node_id(self, node: RedisServer) -> str:
        return str(node.client().execute_command("CLUSTER", "MYID"))

    def owner(self, slot: int) -> RedisServer:
        """The live master that serves ``slot`` now (as that master itself says)."""
        for node in self.alive():
            info = node.client().info("replication")
            if info.get("role") != "master":
                continue
            if slot in self.slots_of(node):
                return node
        raise AssertionError(f"no live master serves slot {slot}")

    def slots_of(self, node: RedisServer) -> set[int]:
        """The slots ``node`` serves according to itself."""
        me = self.node_id(node)
        served: set[int] = set()
        for start, end, master, *_ in node.client().execute_command("CLUSTER", "SLOTS"):
            if master[2] == me:
                served.update(range(int(start), int(end) + 1))
        return served

    def replica_of(self, master: RedisServer) -> RedisServer:
        """``master``'s live replica, waited for (a replica's link to its master may be
        re-established at that moment); the failure shows the Cluster's own view."""
        found: list[RedisServer] = []

        def linked() -> bool:
            found[:] = [
                node
                for node in self.alive()
                if node is not master and node.client().info("replication").get("master_port") == master.port
            ]
            return bool(found)

        deadline = time.monotonic() + CLUSTER_DEADLINE
        while not linked() and time.monotonic() < deadline:
            time.sleep(0.05)
        if not found:
            nodes = master.client().execute_command("CLUSTER", "NODES")
            raise AssertionError(f"master on port {master.port} has no live replica; CLUSTER NODES:\n{nodes}")
        return found[0]

    def start_migration(self, slot: int, moved_keys: Sequence[str]) -> tuple[RedisServer, RedisServer]:
        """Put ``slot`` in migration from its master to another one (``CLUSTER SETSLOT
        IMPORTING``/``MIGRATING``) and ``MIGRATE`` ``moved_keys`` across: a call naming
        keys on both sides is answered ``TRYAGAIN`` until :meth:`finish_migration`."""
        source = self.owner(slot)
        target = next(node for node in self.alive() if node is not source and self.slots_of(node))
        target.client().execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", self.node_id(source))
        source.client().execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", self.node_id(target))
        if moved_keys:
            source.client().execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *moved_keys)
        return source, target

    def finish_migration(self, slot: int, source: RedisServer, target: RedisServer) -> None:
        """Move the slot's other keys and hand the slot to ``target`` on every master."""
        while keys := source.client().execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100):
            source.client().execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *keys)
        target_id = self.node_id(target)
        for node in (target, source, *self.alive()):
            if node.client().info("replication").get("role") == "master":
                node.client().execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)
        self.wait_ok()

    def kill_master(self, master: RedisServer) -> RedisServer:
        """SIGKILL ``master``; returns its replica (the Cluster promotes it after the node
        timeout, 2 s here)."""
        replica = self.replica_of(master)
        master.kill()
        return replica

    def wait_promoted(self, replica: RedisServer) -> None:
        """Until ``replica`` is a master serving slots and every live node agrees the Cluster is ok."""
        self.wait_until("the replica's promotion", lambda: replica.client().info("replication")["role"] == "master")
        self.wait_ok()

    def _replicas_in_sync(self) -> bool:
        replicas = [node.client().info("replication") for node in self.nodes]
        linked = [info for info in replicas if info.get("role") == "slave"]
        return len(linked) == self.replicas * len(self.nodes) // (1 + self.replicas) and all(
            info.get("master_link_status") == "up" for info in linked
        )

    def kill(self) -> None:
        for node in self.nodes:
            node.kill()


class RedisSentinel:
    """A master, one replica and one sentinel watching them as ``mymaster`` (quorum 1).

    The sentinel declares the master down after 1 s without answers, so killing the
    master promotes the replica within a few seconds: enough to test a failover.
    With ``tls``, all three listen on TLS only and replicate and watch over TLS.
    """

    SERVICE = "mymaster"

    def __init__(self, directory: Path, *, tls: bool = False) -> None:
        self.directory = directory
        self.tls = tls
        self.master = RedisServer(directory / "master", self._tls_flags(), tls=tls)
        self.replica = RedisServer(directory / "replica", self._tls_flags(), tls=tls)
        self.replica.extra += ["--replicaof", "127.0.0.1", str(self.master.port)]
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        if not self.tls:
            return f"redis+sentinel://127.0.0.1:{self.port}/{self.SERVICE}"
        ca = urllib.parse.quote(str(self.directory / "cert.pem"))
        return f"rediss+sentinel://127.0.0.1:{self.port}/{self.SERVICE}?ssl_ca_certs={ca}"

    def _tls_flags(self) -> list[str]:
        if not self.tls:
            return []
        cert, key = self.directory / "cert.pem", self.directory / "key.pem"
        return [*launcher.tls_flags(cert, key, cert), "--tls-replication", "yes"]

    def start(self) -> RedisSentinel:
        if self.tls:
            make_tls_files(self.directory)
            for server in (self.master, self.replica):
                server.directory.mkdir(parents=True, exist_ok=True)
                shutil.copy(self.directory / "cert.pem", server.directory / "cert.pem")
        self.master.start()
        self.replica.start()
        conf = self.directory / "sentinel.conf"
        listen = f"port 0\ntls-port {self.port}\n" if self.tls else f"port {self.port}\n"
        flags = self._tls_flags()  # the servers' --name value pairs, as sentinel.conf lines
        tls_lines = "".join(f"{flags[i][2:]} {flags[i + 1]}\n" for i in range(0, len(flags), 2))
        conf.write_text(
            f"{listen}{tls_lines}bind 127.0.0.1\ndir {self.directory}\n"
            f"sentinel monitor {self.SERVICE} 127.0.0.1 {self.master.port} 1\n"
            f"sentinel down-after-milliseconds {self.SERVICE} 1000\n"
            f"sentinel failover-timeout {self.SERVICE} 5000\n"
        )
        with (self.directory / "sentinel.log").open("ab") as log:
            self.process = launcher.start(launcher.sentinel_argv(conf), log)
        self._wait("the replica in sync and known to the sentinel", self._ready)
        return self

    def client(self) -> redis.Redis:
        """A client of the sentinel itself."""
        tls: dict[str, object] = {"ssl": True, "ssl_ca_certs": str(self.directory / "cert.pem")} if self.tls else {}
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5, decode_responses=True, **tls)  # type: ignore[arg-type]

    def master_port(self) -> int:
        """The port of the master the sentinel names now."""
        _, port = self.client().execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.SERVICE)
        return int(port)

    def fail_over(self) -> RedisServer:
        """Kill the master and wait until the sentinel has promoted the replica; returns it."""
        self.master.kill()
        self._wait("the sentinel to promote the replica", lambda: self.master_port() == self.replica.port)
        self._wait("the promoted replica to accept writes", lambda: self.replica.client().set("probe", 1))
        return self.replica

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        self.replica.kill()
        self.master.kill()

    def _ready(self) -> bool:
        replication = self.replica.client().info("replication")
        replicas = self.client().execute_command("SENTINEL", "REPLICAS", self.SERVICE)
        return replication.get("master_link_status") == "up" and len(replicas) == 1

    def _wait(self, what: str, condition: Callable[[], object]) -> None:
        deadline = time.monotonic() + CLUSTER_DEADLINE
        while time.monotonic() < deadline:
            with contextlib.suppress(redis.RedisError, OSError):
                if condition():
                    return
            time.sleep(0.1)
        pytest.fail(f"timed out waiting for {what}:\n{(self.directory / 'sentinel.log').read_text()[-3000:]}")


def make_tls_files(directory: Path) -> None:
    """A self-signed certificate for 127.0.0.1 (``cert.pem``, ``key.pem``) made with openssl."""
    if OPENSSL is None:
        pytest.skip("openssl is not installed: cannot make a certificate for the TLS test")
    directory.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            OPENSSL,
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
            "-keyout",
            str(directory / "key.pem"),
            "-out",
            str(directory / "cert.pem"),
        ],
        capture_output=True,
        check=True,
        timeout=30,
    )


@contextlib.contextmanager
def running(server: RedisServer | RedisCluster | RedisSentinel) -> Iterator[None]:
    """Start ``server`` and kill it when the block ends, whatever happened."""
    try:
        server.start()
        yield
    finally:
        server.kill()


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A standalone server shared by one test module; tests use their own key prefixes."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    with running(server):
        yield server


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A server for one test alone: tests that stop, pause or restart it use this one."""
    server = RedisServer(tmp_path / "redis")
    with running(server):
        yield server


@pytest.fixture(scope="module")
def acl_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A server whose default user is off: only ``ACL_USER`` with ``ACL_PASSWORD`` gets in."""
    server = RedisServer(tmp_path_factory.mktemp("redis-acl"), launcher.acl_flags(ACL_USER, ACL_PASSWORD))
    server.username, server.password = ACL_USER, ACL_PASSWORD
    with running(server):
        yield server


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A server reachable only over TLS, with a self-signed certificate in its directory."""
    directory = tmp_path_factory.mktemp("redis-tls")
    make_tls_files(directory)
    flags = launcher.tls_flags(directory / "cert.pem", directory / "key.pem", directory / "cert.pem")
    server = RedisServer(directory, flags, tls=True)
    with running(server):
        yield server


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    """A three-master Redis Cluster shared by one test module."""
    cluster = RedisCluster(tmp_path_factory.mktemp("redis-cluster"))
    with running(cluster):
        yield cluster


FAULT_FLAGS = ("--cluster-require-full-coverage", "no")
"""Cluster fault tests: healthy masters keep serving while a dead one's slots wait."""


@pytest.fixture
def own_cluster(tmp_path: Path) -> Iterator[RedisCluster]:
    """Three masters for one test alone: fault tests migrate slots or stop nodes."""
    cluster = RedisCluster(tmp_path / "redis-cluster", extra=FAULT_FLAGS)
    with running(cluster):
        yield cluster


@pytest.fixture
def replicated_cluster(tmp_path: Path) -> Iterator[RedisCluster]:
    """Three masters with one replica each (node timeout 2 s), for one test: failover tests kill a master."""
    cluster = RedisCluster(tmp_path / "redis-cluster", replicas=1, extra=FAULT_FLAGS)
    with running(cluster):
        yield cluster


@pytest.fixture(scope="module")
def redis_sentinel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisSentinel]:
    """A master, a replica and a sentinel shared by one test module (tests use their own prefixes)."""
    setup = RedisSentinel(tmp_path_factory.mktemp("sentinel"))
    with running(setup):
        yield setup


@pytest.fixture
def tls_sentinel(tmp_path: Path) -> Iterator[RedisSentinel]:
    """A master, a replica and a sentinel reachable over TLS only."""
    setup = RedisSentinel(tmp_path / "sentinel-tls", tls=True)
    with running(setup):
        yield setup


@pytest.fixture
def own_sentinel(tmp_path: Path) -> Iterator[RedisSentinel]:
    """A master, a replica and a sentinel for one test: failover tests kill the master."""
    setup = RedisSentinel(tmp_path / "sentinel")
    with running(setup):
        yield setup


def fresh_prefix(letter: str = "t") -> str:
    """A key prefix no other test uses, so tests can share one Redis server."""
    return f"{letter}{uuid.uuid4().hex[:10]}"


def redis_settings(url: str, mode: str, budget: float, **overrides: object) -> Settings:
    """Settings of a Redis-backed sidecar as ``serve`` would build them, for in-process limiters."""
    values: dict[str, object] = {
        "config": "unused",
        "backend": "redis",
        "mode": mode,
        "redis_url": url,
        "redis_timeout": budget,
    }
    values.update(overrides)
    return Settings(**values)  # type: ignore[arg-type]
