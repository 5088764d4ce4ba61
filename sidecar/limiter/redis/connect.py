"""A Redis client for any URL we accept: plain, TLS, Cluster and Sentinel.

``redis://`` and ``rediss://`` (TLS) are redis-py's own; ``redis+cluster://`` and
``rediss+cluster://`` name a Cluster seed node (as does ``--redis-cluster``);
Sentinel URLs name the sentinels to ask for a master:

``redis+sentinel://[user:password@]host[:port][,host[:port]...]/service[/db][?sentinel_password=...]``,
or ``rediss+sentinel://`` for TLS to the sentinels and the master alike.

The sentinels are asked for the current master of ``service`` when a connection is
made, and again after a connection fails, so a failover moves the sidecar to the new
master on its next reconnect. The credentials in the URL are the master's (ACL user
and password); ``sentinel_password`` (and ``sentinel_username``) in the query
authenticate to the sentinels themselves when they require it. With TLS the query
may also name ``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile`` (paths) and
``ssl_cert_reqs`` (``none``, ``optional``, ``required``), as for ``rediss://``.

TLS files are re-read when they change (a certificate rotation, sidecar/tls_files.py): each
connection, when it (re)connects, compares its files with those its SSL context was built
from and builds a new context if they changed; a set that does not load keeps the old one.
redis-py alone would read them once per connection object and reuse them on every reconnect.
Plain, Cluster (every node's connections) and Sentinel (the master's and the sentinels')
clients alike.

Settings validate URLs at startup with this module without importing redis-py, so
redis-py is imported only inside :func:`connect`, once a Redis backend is chosen.
"""

from __future__ import annotations

import re
import ssl
import urllib.parse
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sidecar.tls_files import REDIS_TLS, file_identity

if TYPE_CHECKING:
    from redis.asyncio import Redis
    from redis.asyncio.cluster import RedisCluster

SENTINEL_SCHEMES = {"redis+sentinel": False, "rediss+sentinel": True}
"""Scheme and whether it means TLS."""
DEFAULT_SENTINEL_PORT = 26379
CREDENTIAL_KEYS = frozenset({"sentinel_password", "sentinel_username"})
TLS_KEYS = frozenset({"ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs"})
CERT_REQS = frozenset({"none", "optional", "required"})
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
MIN_BACKGROUND_TIMEOUT = 1.0
"""Background calls (flush, heartbeat, probe) may wait this long: they hold no request."""


ENCODE_HINT = "percent-encode '@', ':', '/', '?' and '#' in the user name and password (%40, %3A, %2F, %3F, %23)"
SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*")


class RedisUrlError(ValueError):
    """A Redis URL we cannot use; the message names the part at fault and never quotes
    the URL's credentials (nor anything that may be a piece of them)."""


class SentinelUrlError(RedisUrlError):
    """The URL cannot be a Sentinel URL; the message names the part at fault."""


def check_url(url: str) -> None:
    """Refuse a URL that redis-py would misread, before anything connects.

    A password with an unencoded ``#``, ``/`` or ``?`` makes ``urllib`` end the host
    part early: redis-py then reads a piece of the password as the port (a traceback
    quoting it) or as the host (connection errors naming it). So an ``@`` after the
    host part, or any ``#``, is refused here with a hint, and so is a port or database
    that is not a number. The scheme is checked by the caller. Sentinel URLs go
    through :func:`parse_sentinel_url`.
    """
    if is_sentinel_url(url):
        parse_sentinel_url(url)
        return
    scheme, _, rest = url.partition("://")
    if "#" in rest:
        raise RedisUrlError(f"holds a '#', which would cut the URL short: {ENCODE_HINT}")
    try:
        parts = urllib.parse.urlsplit(client_url(url, False)[0])
    except ValueError:
        raise RedisUrlError(f"the host part cannot be read (an unclosed '['?); {ENCODE_HINT}") from None
    if "@" in parts.path or "@" in parts.query:
        raise RedisUrlError(f"has an '@' after the host part: {ENCODE_HINT}")
    if scheme == "unix":
        return
    try:
        parts.port  # noqa: B018 - urllib checks the port when it is read
    except ValueError:
        raise RedisUrlError(f"the port must be a number from 0 to 65535 (in a password, {ENCODE_HINT})") from None
    database = urllib.parse.unquote(parts.path).strip("/")
    if database and not database.isdigit():
        raise RedisUrlError("the database after the host must be a number, as in redis://host:6379/0")


def redact(url: str) -> str:
    """``url`` fit to be shown: everything before the last ``@`` (the user name and
    password, however mistyped) and the values of ``*password*`` query parameters
    become ``***``."""
    scheme, sep, rest = url.partition("://")
    if not sep or not SCHEME.fullmatch(scheme):
        return "***"
    _, at, rest = rest.rpartition("@")
    location, question, query = rest.partition("?")
    if question:
        hidden = []
        for parameter in query.split("&"):
            name, equals, _ = parameter.partition("=")
            hidden.append(f"{name}=***" if equals and "password" in name.lower() else parameter)
        query = "&".join(hidden)
    return f"{scheme}://{'***@' if at else ''}{location}{question}{query}"


def secrets_of(url: str) -> tuple[str, ...]:
    """The credentials in ``url`` (as written and decoded), longest first: what must
    never appear in a message or log line about this Redis."""
    _, _, rest = url.partition("://")
    location = re.split(r"[/?]", rest, maxsplit=1)[0]
    userinfo = location.rpartition("@")[0]
    found = {userinfo, *userinfo.split(":", 1)}
    for name, value in urllib.parse.parse_qsl(rest.partition("?")[2], keep_blank_values=True):
        if "password" in name.lower():
            found.add(value)
    found |= {urllib.parse.unquote(secret) for secret in found}
    return tuple(sorted((secret for secret in found if secret), key=len, reverse=True))


def scrub(text: str, secrets: tuple[str, ...]) -> str:
    """``text`` with every one of ``secrets`` replaced by ``***``."""
    for secret in secrets:
        text = text.replace(secret, "***")
    return text


@dataclass(frozen=True, slots=True)
class SentinelTarget:
    """Where the sentinels are and what to ask them for."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_username: str | None = None
    sentinel_password: str | None = None
    tls: bool = False
    tls_options: tuple[tuple[str, str], ...] = ()
    """redis-py ``ssl_*`` connection options from the query (TLS only)."""


def is_sentinel_url(url: str) -> bool:
    """Whether ``url`` uses a Sentinel scheme."""
    return url.partition("://")[0] in SENTINEL_SCHEMES


def parse_sentinel_url(url: str) -> SentinelTarget:
    """The :class:`SentinelTarget` of a ``redis+sentinel://`` URL; :class:`SentinelUrlError` otherwise."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in SENTINEL_SCHEMES:
        raise SentinelUrlError(f"must start with {' or '.join(f'{name}://' for name in SENTINEL_SCHEMES)}")
    rest, _, query = rest.partition("?")
    location, _, path = rest.partition("/")
    if "@" in path or "@" in query:
        raise SentinelUrlError(f"has an '@' after the hosts: {ENCODE_HINT}")
    userinfo, at, hosts = location.rpartition("@")
    username, password = _credentials(userinfo) if at else (None, None)
    service, db = _service_and_db(path)
    values = _query(query, SENTINEL_SCHEMES[scheme])
    return SentinelTarget(
        sentinels=tuple(_host_port(part) for part in _non_empty(hosts.split(","), "sentinel host")),
        service=service,
        db=db,
        username=username,
        password=password,
        sentinel_username=values.pop("sentinel_username", None),
        sentinel_password=values.pop("sentinel_password", None),
        tls=SENTINEL_SCHEMES[scheme],
        tls_options=tuple(sorted(values.items())),
    )


def _credentials(userinfo: str) -> tuple[str | None, str | None]:
    user, colon, password = userinfo.partition(":")
    if not colon:  # redis://password@host is how redis-py reads a lone credential too
        return None, urllib.parse.unquote(user) or None
    return urllib.parse.unquote(user) or None, urllib.parse.unquote(password) or None


def _service_and_db(path: str) -> tuple[str, int]:
    service, _, db = path.partition("/")
    service = urllib.parse.unquote(service)
    if not service:
        raise SentinelUrlError("needs the master's service name after the hosts: redis+sentinel://host:26379/mymaster")
    if not db:
        return service, 0
    if not db.isdigit():
        raise SentinelUrlError(f"database {db!r} after the service name must be a number")
    return service, int(db)


def _query(query: str, tls: bool) -> dict[str, str]:
    """The query's parameters (the last of repeated ones), empty ones left out."""
    known = CREDENTIAL_KEYS | TLS_KEYS if tls else CREDENTIAL_KEYS
    values = {key: found[-1] for key, found in urllib.parse.parse_qs(query, keep_blank_values=True).items()}
    unknown = sorted(set(values) - known)
    if unknown:
        hint = "" if tls else " (ssl_* options need rediss+sentinel://)"
        listed = ", ".join(sorted(known))
        # A password holding an unencoded '&' splits into a parameter named by its second
        # half: the names are not repeated when the query carries a password.
        named = "" if "sentinel_password" in values else f" {', '.join(unknown)}"
        raise SentinelUrlError(f"unknown query parameter(s){named}; known: {listed}{hint}")
    reqs = values.get("ssl_cert_reqs")
    if reqs is not None and reqs not in CERT_REQS:
        raise SentinelUrlError(f"ssl_cert_reqs {reqs!r} must be one of {', '.join(sorted(CERT_REQS))}")
    return {key: value for key, value in values.items() if value}


def _host_port(part: str) -> tuple[str, int]:
    if part.startswith("["):  # [IPv6]:port
        host, _, tail = part[1:].partition("]")
        port_text = tail[1:] if tail.startswith(":") else ""
    else:
        host, _, port_text = part.partition(":")
    if not host:
        raise SentinelUrlError(f"sentinel {part!r} has no host")
    if not port_text:
        return host, DEFAULT_SENTINEL_PORT
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise SentinelUrlError(f"sentinel {part!r}: port must be a number from 1 to 65535")
    return host, int(port_text)


def _non_empty(parts: list[str], what: str) -> list[str]:
    if not all(parts):
        raise SentinelUrlError(f"empty {what} in the list (two commas, or a comma at an end?)")
    return parts


def background_timeout(redis_timeout: float) -> float:
    """Socket timeout of every connection and budget of background calls."""
    return max(MIN_BACKGROUND_TIMEOUT, 2 * redis_timeout)


def client_url(url: str, cluster: bool) -> tuple[str, bool]:
    """The URL redis-py understands and whether it names a Cluster.

    ``redis+cluster://`` and ``rediss+cluster://`` are our spelling for "this is a
    Cluster seed node"; redis-py only knows ``redis://`` and ``rediss://``.
    """
    scheme, sep, rest = url.partition("://")
    if sep and scheme in CLUSTER_SCHEMES:
        return f"{CLUSTER_SCHEMES[scheme]}://{rest}", True
    return url, cluster


def connect(url: str, cluster: bool, redis_timeout: float) -> Redis | RedisCluster:
    """A lazily connecting client for ``url`` (``cluster``: ``--redis-cluster``)."""
    from redis.asyncio import Redis  # noqa: PLC0415 - see the module docstring
    from redis.asyncio.cluster import RedisCluster  # noqa: PLC0415
    from redis.asyncio.retry import Retry  # noqa: PLC0415
    from redis.backoff import NoBackoff  # noqa: PLC0415

    url, cluster = client_url(url, cluster)
    timeout = background_timeout(redis_timeout)
    options: dict[str, Any] = {
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        # We decide what a failure means; redis-py's retries would eat the budget.
        "retry": Retry(NoBackoff(), 0),
        # No CLIENT SETINFO on connect: one round trip less per new connection.
        "driver_info": None,
    }
    if is_sentinel_url(url):
        return sentinel_client(parse_sentinel_url(url), options)
    if cluster:
        return rotating_cluster(RedisCluster.from_url(url, **options))
    client = Redis.from_url(url, **options)
    pool = client.connection_pool
    pool.connection_class = rotating_tls(pool.connection_class)
    return client


def rotating_cluster(client: RedisCluster) -> RedisCluster:
    """``client`` with :func:`rotating_tls` connections to every node: the nodes it starts
    from, and those it discovers later (made from the client's shared ``connection_kwargs``);
    and a :func:`steady_commands` table."""
    steady_commands(client)
    kwargs = client.connection_kwargs
    if "connection_class" in kwargs:
        kwargs["connection_class"] = rotating_tls(kwargs["connection_class"])
    for node in client.nodes_manager.startup_nodes.values():
        node.connection_class = rotating_tls(node.connection_class)
    return client


def steady_commands(client: RedisCluster) -> None:
    """Let ``client`` re-read the Cluster while one master is dead.

    redis-py re-reads its slot map after a lost connection, ``CLUSTERDOWN`` or a run of
    ``MOVED``, and then asks its default node (the first master in its list) for the
    ``COMMAND`` table; if that master is the dead one, the re-read fails and redis-py
    drops every connection, failing the calls in flight on the healthy masters too and
    the next ones (issue 31). Here the table is asked of the other masters in turn, and
    one that answers becomes the default node; the dead one goes last.
    """
    from redis.exceptions import ConnectionError as RedisConnectionError  # noqa: PLC0415 - see the module docstring
    from redis.exceptions import TimeoutError as RedisTimeoutError  # noqa: PLC0415

    lost = (RedisConnectionError, RedisTimeoutError, OSError)
    nodes = client.nodes_manager

    class SteadyCommands(type(client.commands_parser)):  # type: ignore[misc]
        async def initialize(self, node: Any = None) -> None:
            try:
                await super().initialize(node)
                return
            except lost:
                if node is None:
                    raise
                failed = node
            for other in client.get_primaries():
                if other.name == failed.name:
                    continue
                try:
                    await super().initialize(other)
                except lost:
                    continue
                nodes.move_node_to_end_of_cached_nodes(failed.name)
                nodes.default_node = other
                return
            await super().initialize(failed)  # none answered: fail as redis-py would

    client.commands_parser = SteadyCommands()


def rotating_tls(base: type[Any]) -> type[Any]:
    """``base`` if it is not a redis-py TLS connection class; else a subclass whose
    connections re-read their TLS files when they changed (see the module docstring)."""
    from redis.asyncio.connection import SSLConnection  # noqa: PLC0415 - see the module docstring

    if not issubclass(base, SSLConnection):
        return base

    class RotatingTLS(base):  # type: ignore[misc]
        _tls_identity: object = None

        def _connection_arguments(self) -> Any:
            refresh_tls(self)
            return super()._connection_arguments()

    RotatingTLS.__name__ = RotatingTLS.__qualname__ = f"Rotating{base.__name__}"
    return RotatingTLS


def refresh_tls(connection: Any) -> None:
    """Before ``connection`` (a redis-py SSLConnection) connects: if its certificate, key or
    CA file changed since its SSL context was built, build it again; if the new files do
    not load (a half-written file, a key that does not match), keep the old context."""
    holder = connection.ssl_context  # redis-py's RedisSSLContext: builds once, caches .context
    paths = (holder.certfile, holder.keyfile, holder.ca_certs)
    identity = tuple(file_identity(path) for path in paths)
    if identity == connection._tls_identity and holder.context is not None:
        return
    previous, holder.context = holder.context, None
    try:
        holder.get()
    except (ssl.SSLError, OSError, ValueError) as error:
        if previous is None:
            raise  # nothing to keep: the first connect fails as redis-py's would
        holder.context = previous
        REDIS_TLS.refused(paths, identity, f"{type(error).__name__}: {error}")
        return
    connection._tls_identity = identity
    REDIS_TLS.built(paths, identity)


def sentinel_client(target: SentinelTarget, options: dict[str, Any]) -> Redis:
    """A client of ``target.service``'s current master, found through the sentinels.

    redis-py asks the sentinels on every new connection and drops its connections
    when one fails or finds the old master turned replica, so after a failover the
    store's reconnection lands on the new master.
    """
    from redis.asyncio.sentinel import Sentinel, SentinelManagedSSLConnection  # noqa: PLC0415 - see the module docstring

    tls: dict[str, Any] = {"ssl": True, **dict(target.tls_options)} if target.tls else {}
    sentinel_options = {key: options[key] for key in ("socket_timeout", "socket_connect_timeout")} | tls
    if target.tls:  # the master's connections: "ssl" would pick redis-py's own class
        options = options | dict(target.tls_options) | {"connection_class": rotating_tls(SentinelManagedSSLConnection)}
    if target.sentinel_password:
        sentinel_options |= {"username": target.sentinel_username, "password": target.sentinel_password}
    sentinel = Sentinel(list(target.sentinels), sentinel_kwargs=sentinel_options)  # type: ignore[no-untyped-call]
    for asked in sentinel.sentinels:  # the clients that ask for the master: their files rotate too
        asked.connection_pool.connection_class = rotating_tls(asked.connection_pool.connection_class)
    return sentinel.master_for(  # type: ignore[no-any-return]
        target.service, db=target.db, username=target.username, password=target.password, **options
    )
