"""The servers, faults and watchers of the ``store-faults`` area (``store_faults.py``).

Two stores, each started once per report and reused by every row on it:

* :class:`ClusterStore`: six Cluster nodes (3 masters with 1 replica each,
  ``--cluster-node-timeout 2000``); a killed node is started again on its port and
  directory after its row, rejoins as a replica, and the next row begins once every node
  is connected and every replica in sync;
* :class:`SentinelStore`: a master, a replica and three Sentinels (quorum 2,
  ``down-after-milliseconds 2000``); the killed master, started again, is turned into a
  replica of the promoted one by the Sentinels.

A :class:`Fault` acts on the master holding the row's hot key (or its slot):
:meth:`Fault.begin` starts it, :meth:`Fault.wait` blocks until the store serves the key
again (promotion, or the slot migration finished) and :meth:`Fault.restore` brings the
store back to full health afterwards, on the caller's thread (a child started from a
worker thread would get SIGTERM when that thread ends). :class:`WriteProbe` measures
what asynchronous replication itself loses: acknowledged INCRs of one key the store no
longer holds after the fault.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from redis.crc import key_slot

from loadtest.reliability_harness.support import CounterNames, ProcessGroup, RedisProcess, wait_for
from stack import redis as stack_redis
from stack.redis import SentinelProcess

SERVICE = "mymaster"
QUORUM = 2
DOWN_AFTER_MS = 2000
"""Sentinel's ``down-after-milliseconds``, as the Cluster's node timeout."""
HEALTHY_TIMEOUT = 60.0
"""Seconds a store may take to be whole again after a fault (a rejoin, a resync)."""
PROMOTION_TIMEOUT = 20.0
PROBE_INTERVAL = 0.01
"""The write probe's pace: about 100 INCRs a second."""
PROBE_SOCKET_TIMEOUT = 0.25


def cluster_client(ports: list[int]) -> Any:
    """A synchronous redis-py Cluster client over every node that answers."""
    import redis.cluster

    nodes = [redis.cluster.ClusterNode("127.0.0.1", port) for port in ports]
    return redis.cluster.RedisCluster(
        startup_nodes=nodes,
        socket_timeout=PROBE_SOCKET_TIMEOUT,
        socket_connect_timeout=PROBE_SOCKET_TIMEOUT,
        decode_responses=True,
    )


@dataclass
class ClusterStore:
    nodes: list[RedisProcess]

    @classmethod
    def start(cls, group: ProcessGroup, directory: Path) -> ClusterStore:
        """Six nodes joined as three masters with a replica each, healthy."""
        nodes = [group.start(stack_redis.cluster_node(directory / f"node-{index}")) for index in range(6)]
        for node in nodes:
            node.wait_ready()
        created = stack_redis.create_cluster([f"127.0.0.1:{node.port}" for node in nodes], 60, replicas=1)
        if created.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {created.stdout[-500:]} {created.stderr[-500:]}")
        store = cls(nodes)
        store.wait_healthy()
        return store

    @property
    def ports(self) -> list[int]:
        return [node.port for node in self.nodes]

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def node(self, port: int) -> RedisProcess:
        return next(node for node in self.nodes if node.port == port)

    def alive_port(self) -> int:
        return next(node.port for node in self.nodes if node.alive())

    def owners(self) -> dict[int, int]:
        """Slot -> port of its master now."""
        return stack_redis.slot_owners(self.alive_port())

    def masters(self) -> list[int]:
        return sorted(set(self.owners().values()))

    def healthy(self) -> bool:
        if not all(node.alive() for node in self.nodes) or not stack_redis.cluster_ok(self.ports):
            return False
        masters = self.masters()
        return len(masters) == 3 and all(stack_redis.replica_synced(p) for p in self.ports if p not in masters)

    def wait_healthy(self) -> None:
        if not wait_for(self.healthy, HEALTHY_TIMEOUT, step=0.2):
            raise RuntimeError(f"the Cluster was not whole again within {HEALTHY_TIMEOUT:.0f} s")

    def client(self) -> Any:
        return cluster_client([node.port for node in self.nodes if node.alive()])


@dataclass
class SentinelStore:
    servers: list[RedisProcess]
    sentinels: list[SentinelProcess]

    @classmethod
    def start(cls, group: ProcessGroup, directory: Path) -> SentinelStore:
        master = group.start_ready(lambda: RedisProcess(directory / "server-0"))
        replica = RedisProcess(directory / "server-1", extra=["--replicaof", "127.0.0.1", str(master.port)])
        group.start_ready(lambda: replica)
        sentinels = [
            group.start_ready(
                lambda index=index: SentinelProcess(  # type: ignore[misc]
                    directory / f"sentinel-{index}", SERVICE, master.port, QUORUM, DOWN_AFTER_MS
                )
            )
            for index in range(3)
        ]
        store = cls([master, replica], sentinels)
        store.wait_healthy()
        return store

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{sentinel.port}" for sentinel in self.sentinels)
        return f"redis+sentinel://{hosts}/{SERVICE}"

    def master_port(self) -> int:
        return self.sentinels[0].master_port()

    def node(self, port: int) -> RedisProcess:
        return next(server for server in self.servers if server.port == port)

    def healthy(self) -> bool:
        if not all(child.alive() for child in [*self.servers, *self.sentinels]):
            return False
        masters = {sentinel.master_port() for sentinel in self.sentinels}
        if len(masters) != 1:
            return False
        (master,) = masters
        if stack_redis.role(master) != "master":
            return False
        replicas = [server.port for server in self.servers if server.port != master]
        if not all(stack_redis.replica_synced(port) for port in replicas):
            return False
        for sentinel in self.sentinels:
            with stack_redis.admin(sentinel.port, 1.0) as client:
                known = client.sentinel_slaves(SERVICE)
                others = client.sentinel_sentinels(SERVICE)
            if not any(entry.get("is_slave") and not entry.get("is_sdown") for entry in known) or len(others) < 2:
                return False
        return True

    def wait_healthy(self) -> None:
        if not wait_for(self.healthy, HEALTHY_TIMEOUT, step=0.2):
            raise RuntimeError(f"the Sentinel set was not whole again within {HEALTHY_TIMEOUT:.0f} s")

    def client(self) -> Any:
        import redis.sentinel

        sentinel = redis.sentinel.Sentinel(
            [("127.0.0.1", sentinel.port) for sentinel in self.sentinels],
            socket_timeout=PROBE_SOCKET_TIMEOUT,
            socket_connect_timeout=PROBE_SOCKET_TIMEOUT,
        )
        return sentinel.master_for(
            SERVICE,
            socket_timeout=PROBE_SOCKET_TIMEOUT,
            socket_connect_timeout=PROBE_SOCKET_TIMEOUT,
            decode_responses=True,
        )


Store = ClusterStore | SentinelStore


# ---------------------------------------------------------------------------------
# Faults
# ---------------------------------------------------------------------------------


def poll(condition: Callable[[], bool], timeout: float, step: float = 0.05) -> float | None:
    """``perf_counter`` when ``condition`` first held (errors count as not yet), None on timeout."""
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        with contextlib.suppress(Exception):
            if condition():
                return time.perf_counter()
        time.sleep(step)
    return None


@dataclass
class Fault:
    """One fault on the master that serves ``slot`` (the hot key's)."""

    name: str
    store: Store
    slot: int
    hold: float = 3.0
    """``slot_migration``: seconds the slot stays half-migrated under load."""
    victim: int = 0
    """Port of the master the fault hits (the migration's source)."""
    heir: int = 0
    """Port of the node expected to serve the slot afterwards."""
    moved_keys: list[int] = field(default_factory=list)
    """``slot_migration``: keys MIGRATEd while the slot was held, then at its end."""

    def __post_init__(self) -> None:
        if isinstance(self.store, SentinelStore):
            self.victim = self.store.master_port()
            self.heir = next(server.port for server in self.store.servers if server.port != self.victim)
            return
        self.victim = self.store.owners()[self.slot]
        if self.name == "slot_migration":
            self.heir = next(port for port in self.store.masters() if port != self.victim)
        else:
            self.heir = stack_redis.replica_of(self.store.ports, self.victim)

    def begin(self) -> None:
        """Start the fault (quick, except a migration's first keys)."""
        if self.name in {"cluster_kill", "sentinel_kill"}:
            self.store.node(self.victim).kill()
        elif self.name == "cluster_failover":
            with stack_redis.admin(self.heir) as client:
                client.execute_command("CLUSTER", "FAILOVER")
        elif self.name == "slot_migration":
            stack_redis.begin_slot_migration(self.victim, self.heir, self.slot)
            self.moved_keys.append(stack_redis.migrate_slot_keys(self.victim, self.heir, self.slot, limit=1))
        else:
            raise ValueError(self.name)

    def wait(self) -> float | None:
        """Block until the heir serves the slot (promoted, or the migration finished);
        returns that moment (``perf_counter``), None if it did not happen in time."""
        if self.name == "slot_migration":
            time.sleep(self.hold)
            masters = self.store.masters() if isinstance(self.store, ClusterStore) else []
            self.moved_keys.append(stack_redis.finish_slot_migration(self.victim, self.heir, self.slot, masters))
            return time.perf_counter()
        if isinstance(self.store, SentinelStore):
            store = self.store
            return poll(
                lambda: store.master_port() == self.heir and stack_redis.role(self.heir) == "master", PROMOTION_TIMEOUT
            )
        return poll(lambda: stack_redis.role(self.heir) == "master", PROMOTION_TIMEOUT)

    def restore(self) -> None:
        """Start a killed server again and wait until the store is whole."""
        if self.name in {"cluster_kill", "sentinel_kill"}:
            victim = self.store.node(self.victim)
            if not victim.alive():
                victim.start()
                victim.wait_ready()
        self.store.wait_healthy()


# ---------------------------------------------------------------------------------
# Replication loss: a steady writer of one key on the faulted shard
# ---------------------------------------------------------------------------------


@dataclass
class WriteProbe:
    """INCRs ``key`` about 100 times a second from its own thread and counts the
    acknowledged ones; after the fault the store should hold as many. What it lacks is
    what asynchronous replication lost (the promoted replica never got it)."""

    connect: Callable[[], Any]
    key: str
    acknowledged: int = 0
    failed: int = 0
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    def start(self) -> WriteProbe:
        self.thread = threading.Thread(target=self._run, name="write-probe", daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        client: Any = None
        while not self.stop.is_set():
            try:
                if client is None:
                    client = self.connect()
                client.incr(self.key)
                self.acknowledged += 1
            except Exception:  # any failure: count it, reconnect (the topology may have changed)
                self.failed += 1
                with contextlib.suppress(Exception):
                    if client is not None:
                        client.close()
                client = None
                self.stop.wait(0.05)
            self.stop.wait(PROBE_INTERVAL)

    def finish(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout=10)

    def held(self) -> int:
        """What the store holds now (read through a fresh client)."""
        client = self.connect()
        try:
            return int(client.get(self.key) or 0)
        finally:
            client.close()


# ---------------------------------------------------------------------------------
# Where keys live, and what the sidecars said of the store
# ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Keys:
    """The hot key and the spread keys that share its slot, fixed for the run."""

    names: CounterNames
    hot: str
    slot: int
    slot_values: tuple[str, ...]

    @classmethod
    def choose(cls, names: CounterNames, slot_keys: int, seed: int) -> Keys:
        """Candidate spread values grouped by slot: the fullest slot (several keys in it);
        then a hot value in that slot. ~60,000 digests, a second or two."""
        by_slot: dict[int, list[str]] = {}
        for index in range(max(20_000, slot_keys * 6_000)):
            value = f"m{seed}-{index}"
            by_slot.setdefault(slot_of(names, [("spread", value)]), []).append(value)
        slot, values = max(by_slot.items(), key=lambda item: len(item[1]))
        hot = next(
            f"h{seed}-{index}" for index in range(10**6) if slot_of(names, [("hot", f"h{seed}-{index}")]) == slot
        )
        return cls(names, hot, slot, tuple(values[:slot_keys]))


def slot_of(names: CounterNames, entries: list[tuple[str, str]]) -> int:
    return int(key_slot(names.digest(entries).encode()))


def store_events(logs: Sequence[Path], offsets: Sequence[int], fault: Fault) -> dict[str, float]:
    """What the sidecars logged since ``offsets`` (their logs' sizes when the row began):
    the store as a whole marked down (``redis_unavailable``; in a Cluster, since issue 31,
    only when every master is), and a master that the fault did not touch marked down
    (``redis_node_unavailable`` naming another node; in a slot migration, any node)."""
    whole = healthy = 0
    touched = "" if fault.name == "slot_migration" else f"127.0.0.1:{fault.victim}"
    for path, offset in zip(logs, offsets, strict=True):
        with path.open("rb") as log:
            log.seek(offset)
            lines = log.read().decode(errors="replace").splitlines()
        for line in lines:
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if event.get("event") == "redis_unavailable":
                    whole += 1
                elif event.get("event") == "redis_node_unavailable" and event.get("node") != touched:
                    healthy += 1
    return {"store_marked_down": whole, "healthy_masters_marked_down": healthy}
