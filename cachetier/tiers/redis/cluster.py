"""Redis Cluster for the Redis tier: the cluster URL, and commands routed to each key's master.

A ``redis+cluster://host:port[,host:port...]`` URL (``rediss+cluster://`` for TLS) makes the
Redis tier use Redis Cluster. Block keys carry no hash tag (key prefixes and namespaces cannot
contain ``{``), so the blocks of one request hash to slots all over the cluster and are spread
across its masters.

Routing. redis-py's ``RedisCluster`` reads the slot map (CLUSTER SLOTS) and keeps a connection
pool per master; ``ClusterRouter`` sends the commands itself: every command names one key (MGET,
UNLINK or EVAL over keys of several slots is refused by a cluster), the commands of a call are
grouped by the master owning their slot, each master gets its group as one pipelined write, and
every master is written to before any is read, so they all work at once (redis-py's cluster
pipeline and its ``mget_nonatomic`` ask the masters one after another).

Failures. Each master has its own ``CircuitBreaker``: a master that is down or silent turns only
its own keys into misses and counted errors, and once its breaker is open it is skipped while
the other masters keep serving. One breaker for the whole cluster would open when any master
died and take the healthy ones down with it. The tier's own breaker guards the slot map instead:
reaching the cluster on first use, and re-reading the map after a MOVED / ASK / CLUSTERDOWN reply
or a master's breaker opening (a replica may have taken over its slots).

Redis must serve the other slots when a master is lost: run the nodes with
``cluster-require-full-coverage no``. With the default ``yes``, every node answers CLUSTERDOWN
once the lost master is flagged as failed, and every key becomes a miss.

Pins. A tier on a cluster cannot pin (``RedisTier.supports_pins`` is false, and a store pins
only in its other tiers): it keeps no LRU of its own to keep pinned records out of (each
master's ``maxmemory-policy`` evicts, and knows nothing of pins), and the pin scripts of the
single-node tier touch keys in many slots, which a cluster refuses.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any
from urllib.parse import urlsplit

from redis.cluster import ClusterNode, RedisCluster
from redis.connection import Connection, ConnectionPool
from redis.crc import key_slot
from redis.exceptions import (
    AskError,
    AuthenticationError,
    ClusterDownError,
    RedisClusterException,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from cachetier.errors import TierUnavailableError
from cachetier.util.backoff import CircuitBreaker, Fault, Guard
from cachetier.util.redact import redact_url, redacted_repr

CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
DEFAULT_PORT = 6379
_UNREACHABLE = (RedisConnectionError, RedisTimeoutError, OSError)
# Replies after which the slot map is re-read: a slot moved, or the cluster is reconfiguring.
_ROUTING_ERRORS = (AskError, ClusterDownError, TryAgainError)  # AskError covers MovedError


@dataclass(frozen=True, slots=True)
class ClusterAddress:
    """Where a cluster URL points.

    Args:
        nodes: ``(host, port)`` of each startup node, in URL order.
        node_url: ``redis[s]://[user:password@]host:port`` of the first node; redis-py takes
            TLS and credentials for every node from it (redacted in the repr).
    """

    nodes: tuple[tuple[str, int], ...]
    node_url: str

    def __repr__(self) -> str:
        return redacted_repr(self)


def parse_cluster_url(url: str) -> ClusterAddress:
    """Split a cluster URL into its startup nodes (no I/O).

    Args:
        url: ``redis+cluster://[user:password@]host:port[,host:port...][/0]``, or
            ``rediss+cluster://...`` for TLS; a port left out is 6379.

    Returns:
        The startup nodes and the URL redis-py reads the first one from.
    """
    scheme, sep, rest = url.partition("://")
    shown = redact_url(url)  # what error messages show: never the password
    if scheme not in CLUSTER_SCHEMES or not sep:
        raise ValueError(f"url {shown!r} must start with one of {CLUSTER_SCHEMES}://")
    if "?" in rest or "#" in rest:
        raise ValueError(
            f"url {shown!r}: a cluster URL takes no query or fragment (for TLS use "
            "rediss+cluster:// and the tier's ssl_* settings)"
        )
    netloc, _, db = rest.partition("/")
    if db not in ("", "0"):
        raise ValueError(f"url {shown!r}: Redis Cluster has only database 0")
    userinfo, at, hosts = netloc.rpartition("@")
    nodes = []
    for entry in hosts.split(","):
        parts = urlsplit(f"//{entry}")
        if not entry or not parts.hostname or "@" in entry:
            raise ValueError(
                f"url {shown!r} must list host:port of one or more nodes, e.g. "
                "redis+cluster://10.0.0.1:7000,10.0.0.2:7000"
            )
        try:
            port = parts.port or DEFAULT_PORT
        except ValueError:
            raise ValueError(f"url {shown!r} has a bad port in {entry!r}") from None
        nodes.append((parts.hostname, port))
    host, port = nodes[0]
    host = f"[{host}]" if ":" in host else host  # an IPv6 address
    login = f"{userinfo}@" if at else ""
    return ClusterAddress(tuple(nodes), f"{scheme.removesuffix('+cluster')}://{login}{host}:{port}")


@dataclass(slots=True)
class _Batch:
    """The commands of one call that go to one master, and the connection they went on."""

    node: ClusterNode
    breaker: CircuitBreaker
    indexes: list[int] = field(default_factory=list)
    pool: ConnectionPool | None = None
    conn: Connection | None = None
    reported: bool = False  # the outcome went to the breaker


class ClusterRouter:
    """Runs one-key commands on the masters owning the keys; one breaker per master.

    Thread-safe. A master that cannot be asked (down, silent, breaker open) answers each of its
    commands with a ``TierUnavailableError`` in place; the other masters are not affected.

    Args:
        connect: makes the cluster client (``make_client``); it reads the slot map, so it does
            I/O and may fail.
        breaker: guards reaching the cluster and re-reading its slot map.
        make_breaker: makes the breaker of a master, on the first command sent to it.
        count_error: adds this many failed calls to the tier's errors.
        count_skipped: counts one call not made because a breaker was open.
        on_auth_refused: told of each failure that is a node refusing our credentials
            (``NOAUTH``, ``WRONGPASS``); it is counted in errors as well.
    """

    def __init__(
        self,
        connect: Callable[[], RedisCluster],
        breaker: CircuitBreaker,
        make_breaker: Callable[[], CircuitBreaker],
        count_error: Callable[[int], None],
        count_skipped: Callable[[], None],
        on_auth_refused: Callable[[BaseException], None] = lambda exc: None,
        on_down: Callable[[BaseException], None] = lambda exc: None,
    ) -> None:
        self._connect = connect
        self._on_down = on_down
        self._map_guard = Guard(
            breaker, _map_fault, on_failure=self._map_failed, on_skipped=self._map_skipped
        )
        self._make_breaker = make_breaker
        self._count_error = count_error
        self._count_skipped = count_skipped
        self._on_auth_refused = on_auth_refused
        self._lock = threading.Lock()  # guards the three fields below
        self._client: RedisCluster | None = None
        self._stale = False  # the slot map is to be re-read before the next call
        self._guards: dict[str, Guard] = {}  # master "host:port" -> the guard of its breaker
        self._map_lock = threading.Lock()  # one thread at a time reads the slot map

    def run(self, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Run each command on the master owning its key: one pipelined batch per master.

        Args:
            commands: ``(name, key, *args)`` each, ``key`` a ``str`` or ``bytes``.

        Returns:
            One entry per command, in order: its reply, its error reply as a ``ResponseError``
            (not raised), or a ``TierUnavailableError`` where its master could not be asked.
        """
        out: list[Any] = [None] * len(commands)
        client = self._current_client()
        if client is None:
            return [TierUnavailableError("Redis Cluster cannot be reached") for _ in commands]
        # slot -> [master, *replicas], read straight from redis-py's map (replaced whole on a
        # refresh): get_node_from_slot() per key costs several times more.
        slots = client.nodes_manager.slots_cache
        batches: dict[str, _Batch] = {}
        uncovered = False
        for i, command in enumerate(commands):
            key = command[1]
            owners = slots.get(key_slot(key if isinstance(key, bytes) else key.encode()))
            if not owners or owners[0].redis_connection is None:
                out[i] = TierUnavailableError(f"no master serves the slot of {key!r}")
                uncovered = True
                continue
            batch = batches.get(owners[0].name)
            if batch is None:
                breaker = self._guard_of(owners[0]).breaker
                batch = batches[owners[0].name] = _Batch(owners[0], breaker)
            batch.indexes.append(i)
        if uncovered:  # a slot left unassigned, or a map older than the cluster
            self._count_error(1)
            self._mark_stale()
        asked: list[_Batch] = []
        try:
            # A call holds a connection to each of its masters at once; taking them in one
            # global order means callers waiting for a free connection can never wait in a ring.
            for _name, batch in sorted(batches.items()):
                if not batch.breaker.allow():
                    self._count_skipped()
                    _unavailable(out, batch, "skipped: its breaker is open")
                    continue
                asked.append(batch)  # from here on the finally below reports and releases it
                self._send(batch, commands, out)
            for batch in asked:
                if not batch.reported:
                    self._receive(batch, commands, out)
        finally:
            for batch in asked:
                self._release(batch)
        return out

    def scan(self, pattern: str, *, count: int) -> list[bytes]:
        """Keys matching ``pattern`` on every master (SCAN on each).

        Args:
            pattern: a SCAN ``MATCH`` pattern.
            count: keys per SCAN step.

        Returns:
            The keys found on the masters that could be asked.
        """
        client = self._current_client()
        if client is None:
            return []
        found: list[bytes] = []
        for node in client.get_primaries():
            scan = node.redis_connection.scan_iter
            found += self._guard_of(node).call(partial(_listed, scan, pattern, count), [])
        return found

    def breakers(self) -> dict[str, dict[str, Any]]:
        """``CircuitBreaker.snapshot`` of each master called so far, by ``host:port``."""
        with self._lock:
            guards = dict(self._guards)
        return {name: guard.breaker.snapshot() for name, guard in sorted(guards.items())}

    def close(self) -> None:
        """Close the connections to every node."""
        with self._lock:
            client, self._client = self._client, None
        if client is None:
            return
        for node in client.get_nodes():
            if node.redis_connection is not None:
                node.redis_connection.connection_pool.disconnect()
        client.close()

    def _current_client(self) -> RedisCluster | None:
        """The client with a fresh slot map; an older map if it cannot be re-read now."""
        with self._lock:
            client, stale = self._client, self._stale
        if client is not None and not stale:
            return client
        with self._map_lock:
            with self._lock:  # another thread may have read the map while we waited
                client, stale = self._client, self._stale
            if client is not None and not stale:
                return client
            fresh = self._map_guard.call(partial(self._read_map, client), None)
            return client if fresh is None else fresh

    def _read_map(self, client: RedisCluster | None) -> RedisCluster:
        """Reach the cluster (``client`` is ``None``) or re-read its slot map."""
        if client is None:
            client = self._connect()
        else:
            client.nodes_manager.initialize()
        with self._lock:
            self._client, self._stale = client, False
        return client

    def _map_skipped(self) -> None:
        """A skipped re-read costs no call while an older map still serves."""
        with self._lock:
            has_map = self._client is not None
        if not has_map:
            self._count_skipped()

    def _map_failed(self, exc: BaseException, fault: Fault) -> None:
        self._count_error(1)
        if not self._maybe_auth_refused(exc) and fault is not Fault.ANSWERED:
            self._on_down(exc)

    def _maybe_auth_refused(self, exc: BaseException) -> bool:
        """Tell ``on_auth_refused`` if ``exc`` is (or was caused by) a refusal of our
        credentials: redis-py wraps one met while reading the slot map in its own exception.
        Whether it was."""
        seen: BaseException | None = exc
        for _ in range(8):  # a cause chain is short; never loop on a cycle
            if seen is None:
                return False
            if isinstance(seen, AuthenticationError):
                self._on_auth_refused(seen)
                return True
            seen = seen.__cause__ or seen.__context__
        return False

    def _mark_stale(self) -> None:
        with self._lock:
            self._stale = True

    def _guard_of(self, node: ClusterNode) -> Guard:
        """The guard of ``node``'s own breaker, made on the first command sent to it."""
        with self._lock:
            guard = self._guards.get(node.name)
            if guard is None:
                breaker = self._make_breaker()
                guard = self._guards[node.name] = Guard(
                    breaker,
                    _node_fault,
                    on_failure=lambda exc, fault: self._node_failed(breaker, exc, fault),
                    on_skipped=self._count_skipped,
                )
            return guard

    def _node_failed(self, breaker: CircuitBreaker, exc: BaseException, fault: Fault) -> None:
        """Count a failed call to a master whose breaker has been told of it."""
        self._count_error(1)
        if fault is Fault.ANSWERED:
            return
        if not self._maybe_auth_refused(exc):
            self._on_down(exc)
        if breaker.is_open:
            self._mark_stale()  # a replica may have taken over the master's slots

    def _batch_failed(self, batch: _Batch, out: list[Any], what: str, exc: BaseException) -> None:
        if batch.conn is not None:
            batch.conn.disconnect()  # unread replies may be left on it
        batch.reported = True
        _unavailable(out, batch, what)
        batch.breaker.record_failure()
        self._node_failed(batch.breaker, exc, Fault.DOWN)

    def _send(self, batch: _Batch, commands: Sequence[tuple[Any, ...]], out: list[Any]) -> None:
        """Write the batch's commands to its master as one pipelined write."""
        pool = batch.node.redis_connection.connection_pool
        try:
            batch.conn = pool.get_connection()  # waits for a free one, connects if need be
            batch.pool = pool
            packed = batch.conn.pack_commands([commands[i] for i in batch.indexes])
            batch.conn.send_packed_command(packed)
        except _UNREACHABLE as exc:
            self._batch_failed(batch, out, "unreachable", exc)

    def _receive(self, batch: _Batch, commands: Sequence[tuple[Any, ...]], out: list[Any]) -> None:
        assert batch.conn is not None, "receive follows a successful send"
        parse = batch.node.redis_connection.parse_response
        error_replies = routing_errors = 0
        try:
            for i in batch.indexes:
                try:
                    out[i] = parse(batch.conn, commands[i][0])
                except ResponseError as exc:  # one error reply; the next replies follow as usual
                    out[i] = exc
                    error_replies += 1
                    routing_errors += isinstance(exc, _ROUTING_ERRORS)
        except (RedisError, OSError) as exc:  # no answer, or one that broke the stream
            self._batch_failed(batch, out, "did not answer", exc)
            return
        batch.reported = True
        batch.breaker.record_success()  # it answered, if only with errors
        if error_replies:
            self._count_error(1)
        if routing_errors:
            self._mark_stale()

    def _release(self, batch: _Batch) -> None:
        if not batch.reported:  # interrupted (an exception not ours): replies may be pending
            batch.breaker.record_failure()
            if batch.conn is not None:
                batch.conn.disconnect()
        if batch.pool is not None and batch.conn is not None:
            batch.pool.release(batch.conn)


def _node_fault(exc: BaseException) -> Fault | None:
    if isinstance(exc, _UNREACHABLE):
        return Fault.DOWN
    if isinstance(exc, RedisError):
        return Fault.ANSWERED  # it answered, with an error
    return None


def _map_fault(exc: BaseException) -> Fault | None:
    # Any error, reply or not, while reading the map counts against reaching the cluster.
    if isinstance(exc, (RedisError, RedisClusterException, OSError)):
        return Fault.DOWN
    return None


def _listed(scan: Callable[..., Iterator[bytes]], pattern: str, count: int) -> list[bytes]:
    return list(scan(match=pattern, count=count))


def _unavailable(out: list[Any], batch: _Batch, what: str) -> None:
    error = TierUnavailableError(f"Redis Cluster master {batch.node.name} {what}")
    for i in batch.indexes:
        out[i] = error
