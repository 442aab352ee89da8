"""Redis tier: block records in a Redis shared by many processes and machines.

A block lives at ``{key_prefix}:{namespace}:{key hex}`` as one checksummed record (see
``cachetier.record``); a get checks the record against the key it was asked for.

Transfers. On a single node over ``redis://`` or ``unix://``, block gets and puts go through
``resp``: pipelined GETs read straight into the caller's buffers and SETs sent from a record's
parts, a large batch spread over ``bulk_streams`` connections (on the SmolLM2 shape about twice
as fast as redis-py's pipeline, ``benchmarks/bench_peers.py``). Scripts, scans, deletes, TLS and
Redis Cluster use redis-py.

Capacity. With ``capacity_bytes=None`` Redis's own ``maxmemory`` policy bounds the tier and
nothing else is kept (the fast path: a put is pipelined SETs, a get pipelined GETs). With a
capacity, the tier keeps an exact LRU shared by every process using the same ``key_prefix``,
in four keys no namespace can collide with (namespaces never start with ``_``)::

    {key_prefix}:_lru    sorted set: storage key -> last-use tick
    {key_prefix}:_size   hash: storage key -> record bytes
    {key_prefix}:_used   bytes of every record in _size
    {key_prefix}:_tick   counter the ticks are drawn from (INCRBY: exact order across processes)

Lua scripts (``redis_scripts``) keep them consistent with the records: a put runs its SETs and
the accounting script in one MULTI; the script evicts least recently used records until the
total fits. This needs a single Redis node (the scripts touch keys in many slots).

Redis Cluster. A ``redis+cluster://host:port[,host:port...]`` URL spreads the blocks over the
cluster's masters, one pipelined batch per master per call (see ``redis_cluster``). A capacity
is refused there: bound each node with its own ``maxmemory`` and ``maxmemory-policy``.

Failures. Every call goes through a ``CircuitBreaker``: a Redis that is down or slower than the
socket timeout turns into misses and counted errors, and after ``failure_threshold`` failures
in a row the tier stops calling it (``skipped`` in stats) until a backoff has passed. On a
cluster each master has its own breaker, so one lost master costs only its own keys.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from cachetier.backoff import CircuitBreaker, Clock, ExponentialBackoff
from cachetier.errors import CorruptBlockError, TierUnavailableError
from cachetier.keys import HASH_BYTES, BlockHash
from cachetier.record import (
    Buffer,
    Compression,
    KVBlock,
    byte_view,
    decode_record,
    encode_parts,
    encode_record,
)
from cachetier.tiers.base import Tier, check_namespace, first_miss, land_in
from cachetier.tiers.redis_cluster import CLUSTER_SCHEMES, ClusterRouter, parse_cluster_url
from cachetier.tiers.redis_scripts import FORGET_SCRIPT, LEADING_SCRIPT, PUT_SCRIPT, TOUCH_SCRIPT
from cachetier.tiers.resp import CORRUPT, Endpoint, ErrorReply, GetResult, Hit, RespPool

_T = TypeVar("_T")
_PREFIX_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_URL_SCHEMES = ("redis", "rediss", "unix")
# The pure-Python RESP parser reads a socket in chunks of this size; 256 KiB instead of
# redis-py's 32 KiB halved the time to fetch one 360 KB record here.
_SOCKET_READ_BYTES = 256 * 1024
_SCAN_COUNT = 1000  # keys per SCAN step
_DELETE_BATCH = 512  # keys per UNLINK / forget script in clear()


@dataclass(frozen=True, slots=True)
class RedisTierConfig:
    """Args:
    url: ``redis://[user:password@]host:port/db``, ``rediss://...`` (TLS),
        ``unix:///path.sock?db=0``, or a Redis Cluster:
        ``redis+cluster://[user:password@]host:port[,host:port...]`` (``rediss+cluster://``
        for TLS), listing one or more of its nodes; the others are found from them.
    key_prefix: first part of every key (letters, digits, ``._-``); tiers with the same
        prefix share blocks and, with a capacity, one LRU.
    ttl_s: records expire this long after they were put (gets do not extend it); ``None``
        keeps them until evicted.
    capacity_bytes: most record bytes kept under ``key_prefix`` (exact LRU, single-node Redis
        only); ``None`` leaves the bound to Redis's ``maxmemory`` policy (each node's, on a
        cluster).
    compression: ``"none"`` or ``"lz4"`` for stored payloads.
    socket_timeout_s: longest wait for Redis to answer one read or write, in seconds.
    connect_timeout_s: longest wait for a TCP connection, in seconds.
    max_connections: connections in the pool (one pool per node on a cluster); a call waits
        up to ``socket_timeout_s`` for one.
    failure_threshold: failures in a row that open the circuit breaker (of each master, on a
        cluster).
    backoff_base_s: wait before the first trial call once the breaker is open, in seconds.
    backoff_cap_s: longest wait between trial calls, in seconds.
    bulk_streams: most connections one get or put of many blocks is spread over, one thread
        each (single node, ``redis://`` and ``unix://``; see ``cachetier.tiers.resp``).
    """

    url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "cachetier"
    ttl_s: float | None = None
    capacity_bytes: int | None = None
    compression: str = "none"
    socket_timeout_s: float = 0.5
    connect_timeout_s: float = 0.5
    max_connections: int = 32
    failure_threshold: int = 3
    backoff_base_s: float = 0.008
    backoff_cap_s: float = 0.512
    bulk_streams: int = 4

    def __post_init__(self) -> None:
        _check_url(self.url)
        if not isinstance(self.key_prefix, str) or not _PREFIX_RE.match(self.key_prefix):
            raise ValueError(
                f"key_prefix {self.key_prefix!r} must be 1-64 characters of [A-Za-z0-9._-] "
                "starting with a letter or digit"
            )
        if self.ttl_s is not None and not self.ttl_s >= 0.001:
            raise ValueError(f"ttl_s must be None or at least 0.001 (1 ms), got {self.ttl_s!r}")
        if self.capacity_bytes is not None:
            _check_positive_int("capacity_bytes", self.capacity_bytes)
            if self.cluster:
                raise ValueError(
                    "capacity_bytes must be None with a redis+cluster:// url: the exact LRU runs "
                    "Lua over keys in many slots, which a cluster refuses; bound each node with "
                    "maxmemory and maxmemory-policy allkeys-lru instead"
                )
        if self.compression not in ("none", "lz4"):
            raise ValueError(f"compression must be 'none' or 'lz4', got {self.compression!r}")
        for name in ("socket_timeout_s", "connect_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        _check_positive_int("max_connections", self.max_connections)
        _check_positive_int("failure_threshold", self.failure_threshold)
        _check_positive_int("bulk_streams", self.bulk_streams)
        ExponentialBackoff(self.backoff_base_s, self.backoff_cap_s)  # raises if invalid

    @property
    def cluster(self) -> bool:
        """Whether ``url`` names a Redis Cluster."""
        return self.url.partition("://")[0] in CLUSTER_SCHEMES


def _check_url(url: str) -> None:
    if not isinstance(url, str):
        raise TypeError(f"url must be a str, got {type(url).__name__}")
    if url.partition("://")[0] in CLUSTER_SCHEMES:
        parse_cluster_url(url)  # raises ValueError on a bad one
        return
    parts = urlsplit(url)
    if parts.scheme not in _URL_SCHEMES:
        raise ValueError(f"url {url!r} must start with one of {_URL_SCHEMES + CLUSTER_SCHEMES}://")
    if parts.scheme == "unix":
        if not parts.path:
            raise ValueError(f"url {url!r} must name a socket path, e.g. unix:///run/redis.sock")
        return
    if not parts.hostname:
        raise ValueError(f"url {url!r} must name a host, e.g. redis://127.0.0.1:6379/0")
    try:
        parts.port  # noqa: B018 -- raises ValueError on a bad port
    except ValueError:
        raise ValueError(f"url {url!r} has a bad port") from None
    db = parts.path.lstrip("/")
    if db and not db.isdigit():
        raise ValueError(f"url {url!r} must end with a database number, e.g. /0")


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def make_client(config: RedisTierConfig) -> redis.Redis | RedisCluster:
    """The one place a Redis client is made.

    Args:
        config: the tier's settings.

    Returns:
        For a single node, a client over a blocking pool of ``max_connections`` connections;
        no I/O: connections are opened on first use and reopened after a failure. For a
        cluster, a ``RedisCluster``: it reads the slot map from the first startup node that
        answers (I/O; raises ``RedisClusterException`` when none does) and keeps such a pool
        per node. redis-py's own retries are off: the tier's circuit breakers are the one retry
        policy. So a call to a node that is down or silent fails after at most a wait for a
        free connection (``socket_timeout_s``), a connect (``connect_timeout_s``) and one
        unanswered read or write (``socket_timeout_s``).
    """
    options: dict[str, Any] = dict(
        max_connections=config.max_connections,
        timeout=config.socket_timeout_s,  # wait for a free connection
        socket_timeout=config.socket_timeout_s,
        socket_connect_timeout=config.connect_timeout_s,
        socket_keepalive=True,
        socket_read_size=_SOCKET_READ_BYTES,
        driver_info=None,  # no CLIENT SETINFO round trips on each new connection
    )
    if config.cluster:
        address = parse_cluster_url(config.url)
        return RedisCluster(
            url=address.node_url,
            startup_nodes=[ClusterNode(host, port) for host, port in address.nodes[1:]],
            # A slot map with the slots of a lost master still counts: only they fail.
            require_full_coverage=False,
            # No retry (and no slot-map re-read per failed command): ``ClusterRouter`` decides.
            retry=Retry(NoBackoff(), 0),
            connection_pool_class=redis.BlockingConnectionPool,  # used for a url's nodes
            **options,
        )
    pool = redis.BlockingConnectionPool.from_url(
        config.url, retry=Retry(NoBackoff(), 0), health_check_interval=0, **options
    )
    return redis.Redis(connection_pool=pool)


class RedisTier(Tier):
    """Blocks as records in Redis; a failing Redis is a miss, never an exception.

    Args:
        config: connection, capacity and breaker settings.
        clock: time source of the circuit breaker (tests inject one instead of sleeping).
    """

    name = "redis"

    def __init__(self, config: RedisTierConfig, *, clock: Clock = time.monotonic) -> None:
        super().__init__()
        self._config = config
        self._compression = Compression.LZ4 if config.compression == "lz4" else Compression.NONE
        self._ttl_ms = None if config.ttl_s is None else max(1, round(config.ttl_s * 1000))
        prefix = config.key_prefix
        self._meta_keys = [f"{prefix}:_lru", f"{prefix}:_size", f"{prefix}:_used"]
        self._tick_key = f"{prefix}:_tick"
        backoff = ExponentialBackoff(config.backoff_base_s, config.backoff_cap_s)
        # Single node: guards every call. Cluster: guards reading the slot map; each master
        # gets a breaker of its own, so one lost master does not stop the others.
        self._breaker = CircuitBreaker(config.failure_threshold, backoff, clock)
        self._lock = threading.Lock()
        self._num_skipped = 0
        self._last_used_bytes = 0
        self._client: redis.Redis | None = None
        self._cluster: ClusterRouter | None = None
        # The block gets and puts of a single node, without redis-py's copies (TLS: None).
        self._bulk: RespPool | None = None
        if config.cluster:  # connects on first use: building the client reads the slot map
            self._cluster = ClusterRouter(
                connect=lambda: make_client(config),
                breaker=self._breaker,
                make_breaker=lambda: CircuitBreaker(config.failure_threshold, backoff, clock),
                count_error=lambda n: self._stats.add(errors=n),
                count_skipped=self._count_skipped,
            )
        else:
            client = make_client(config)
            assert isinstance(client, redis.Redis), "a single-node url makes a single-node client"
            self._client = client
            endpoint = Endpoint.from_url(
                config.url, config.connect_timeout_s, config.socket_timeout_s
            )
            if endpoint is not None:
                self._bulk = RespPool(endpoint, config.max_connections, config.bulk_streams)

    @property
    def config(self) -> RedisTierConfig:
        return self._config

    @property
    def capacity_bytes(self) -> int | None:
        return self._config.capacity_bytes

    @property
    def used_bytes(self) -> int:
        """Record bytes under ``key_prefix`` (all processes); 0 without a capacity.

        When Redis cannot be reached this is the last value read.
        """
        if self._config.capacity_bytes is None:
            return 0
        used = self._call(lambda client: int(client.get(self._meta_keys[2]) or 0))
        if used is not None:
            self._last_used_bytes = max(0, used)
        return self._last_used_bytes

    def storage_key(self, namespace: str, key: BlockHash) -> str:
        """The Redis key a block is stored under.

        Args:
            namespace: storage namespace (see ``check_namespace``).
            key: the block's 32-byte key.

        Returns:
            ``"{key_prefix}:{namespace}:{key hex}"``.
        """
        return self._storage_keys(check_namespace(namespace), [key])[0]

    def _storage_keys(self, namespace: str, keys: Sequence[BlockHash]) -> list[str]:
        head = f"{self._config.key_prefix}:{namespace}:"
        out = []
        for key in keys:
            if not isinstance(key, (bytes, bytearray)) or len(key) != HASH_BYTES:
                raise ValueError(f"a key is {HASH_BYTES} bytes, got {key!r:.80}")
            out.append(head + key.hex())
        return out

    def put_many(self, namespace: str, blocks: Sequence[KVBlock]) -> int:
        check_namespace(namespace)
        for block in blocks:
            if not isinstance(block, KVBlock):
                raise TypeError(f"blocks must be KVBlock, got {type(block).__name__}")
        skeys_all = self._storage_keys(namespace, [b.key for b in blocks])
        if not blocks:
            return 0
        if self._cluster is None and self._breaker.is_open:  # skipped: do not encode for nothing
            self._count_skipped()
            return 0
        start = time.perf_counter()
        capacity = self._config.capacity_bytes
        if capacity is None and self._bulk is not None:
            stored, nbytes, rejected = self._put_bulk(skeys_all, blocks)
            self._stats.add(puts=stored, bytes_in=nbytes, rejected=rejected)
            self._stats.observe(time.perf_counter() - start)
            return stored
        skeys: list[str] = []
        records: list[bytes] = []
        rejected = 0
        for skey, block in zip(skeys_all, blocks, strict=True):
            record = encode_record(block, self._compression)
            if capacity is not None and len(record) > capacity:
                rejected += 1
                continue
            skeys.append(skey)
            records.append(record)
        stored = nbytes = evicted = 0
        if skeys and capacity is None:
            for record, result in zip(records, self._set_all(skeys, records) or (), strict=False):
                if result is True:
                    stored += 1
                    nbytes += len(record)
                elif not isinstance(result, TierUnavailableError):  # a master was not asked
                    rejected += 1  # refused by Redis (e.g. over maxmemory with noeviction)
        elif skeys:
            results = self._call(
                lambda client: self._set_all_counted(client, skeys, records, capacity)
            )
            if results is not None:
                stored, nbytes, evicted = len(skeys), sum(map(len, records)), int(results[-1])
        self._stats.add(puts=stored, bytes_in=nbytes, rejected=rejected, evictions=evicted)
        self._stats.observe(time.perf_counter() - start)
        return stored

    def _put_bulk(self, skeys: list[str], blocks: Sequence[KVBlock]) -> tuple[int, int, int]:
        """Pipelined SETs of records sent as parts; (stored, record bytes stored, refused)."""
        assert self._bulk is not None
        sizes = [0] * len(blocks)

        def record_of(i: int) -> list[Buffer]:  # on the sending stream's thread
            parts = encode_parts(blocks[i], self._compression)
            sizes[i] = sum(memoryview(p).nbytes for p in parts)
            return parts

        names = [skey.encode() for skey in skeys]
        replies = self._call_bulk(lambda pool: pool.set_records(names, record_of, self._ttl_ms))
        stored = nbytes = rejected = 0
        for size, reply in zip(sizes, replies or (), strict=False):
            if reply is True:
                stored += 1
                nbytes += size
            else:  # refused by Redis (e.g. over maxmemory with noeviction)
                rejected += 1
        return stored, nbytes, rejected

    def _set_all(self, skeys: list[str], records: list[bytes]) -> list | None:
        """One reply per SET (``True`` when stored), or ``None`` if Redis was not reached."""
        if self._cluster is not None:
            ttl = () if self._ttl_ms is None else ("PX", self._ttl_ms)
            return self._cluster.run([("SET", k, r, *ttl) for k, r in zip(skeys, records)])

        def set_all(client: redis.Redis) -> list:
            pipe = client.pipeline(transaction=False)
            for skey, record in zip(skeys, records, strict=True):
                pipe.set(skey, record, px=self._ttl_ms)
            return pipe.execute(raise_on_error=False)

        return self._call(set_all)

    def _set_all_counted(
        self, client: redis.Redis, skeys: list[str], records: list[bytes], capacity: int
    ) -> list:
        pipe = client.pipeline(transaction=True)
        for skey, record in zip(skeys, records, strict=True):
            pipe.set(skey, record, px=self._ttl_ms)
        meta = [*self._meta_keys, self._tick_key]
        sizes = [len(record) for record in records]
        pipe.eval(PUT_SCRIPT, len(meta) + len(skeys), *meta, *skeys, capacity, *sizes)
        return pipe.execute()

    def get_many(self, namespace: str, keys: Sequence[BlockHash]) -> list[KVBlock | None]:
        check_namespace(namespace)
        skeys = self._storage_keys(namespace, keys)
        if not keys:
            return []
        if self._bulk is not None:
            return self._get_bulk(skeys, keys, None)
        start = time.perf_counter()
        if self._cluster is not None:
            replies = self._cluster.run(_each("GET", skeys))
            raws = [r if isinstance(r, bytes) else None for r in replies]
        else:
            raws = self._call(lambda client: self._get_all(client, skeys))
        out: list[KVBlock | None] = [None] * len(keys)
        hits = nbytes = 0
        corrupt: list[str] = []
        for i, raw in enumerate(raws or ()):
            if raw is None:
                continue
            try:
                out[i] = decode_record(raw, key=keys[i])
            except CorruptBlockError:
                corrupt.append(skeys[i])
                continue
            hits += 1
            nbytes += len(raw)
        if corrupt:
            # A good record put by another process between our read and this delete is lost
            # with it: rare, and it only costs a later miss.
            self._remove(corrupt)
        self._stats.add(hits=hits, misses=len(keys) - hits, bytes_out=nbytes, corrupt=len(corrupt))
        self._stats.observe(time.perf_counter() - start)
        return out

    def get_into(
        self, namespace: str, keys: Sequence[BlockHash], dests: Sequence[memoryview]
    ) -> list[KVBlock | None]:
        if self._bulk is None:
            return super().get_into(namespace, keys, dests)
        check_namespace(namespace)
        if len(dests) != len(keys):
            raise ValueError(f"{len(dests)} destinations for {len(keys)} keys")
        skeys = self._storage_keys(namespace, keys)
        if not keys:
            return []
        targets = [byte_view(d) for d in dests]
        # A compressed record is decompressed elsewhere; land_in copies it where it belongs.
        return land_in(self._get_bulk(skeys, keys, targets), targets)

    def _get_bulk(
        self, skeys: list[str], keys: Sequence[BlockHash], dests: list[memoryview] | None
    ) -> list[KVBlock | None]:
        """Gets over the bulk path: records read straight into ``dests`` or fresh buffers."""
        start = time.perf_counter()
        names = [skey.encode() for skey in skeys]
        results: list[GetResult] | None = self._call_bulk(
            lambda pool: pool.get_records(names, keys, dests)
        )
        out: list[KVBlock | None] = [None] * len(keys)
        hits = nbytes = errors = 0
        corrupt: list[str] = []
        for i, result in enumerate(results or ()):
            if isinstance(result, Hit):
                out[i] = result.block
                hits += 1
                nbytes += result.nbytes
            elif result is CORRUPT:
                corrupt.append(skeys[i])
            elif isinstance(result, ErrorReply):  # e.g. WRONGTYPE: another program's key
                errors += 1
        if corrupt:
            self._remove(corrupt)  # as in get_many: a rare lost race costs a later miss
        if results is not None and self._config.capacity_bytes is not None:
            # Right after the reads, not atomically with them: a record evicted in between is
            # only a stale LRU entry the script drops. Also forgets the accounting of records
            # that expired, which only a get notices.
            meta = [*self._meta_keys, self._tick_key]
            self._call(
                lambda client: client.eval(TOUCH_SCRIPT, len(meta) + len(skeys), *meta, *skeys)
            )
        self._stats.add(
            hits=hits,
            misses=len(keys) - hits,
            bytes_out=nbytes,
            corrupt=len(corrupt),
            errors=errors,
        )
        self._stats.observe(time.perf_counter() - start)
        return out

    def _get_all(self, client: redis.Redis, skeys: list[str]) -> list[bytes | None]:
        # One MGET: a few percent faster than pipelined GETs for 360 KB records, a tie for 6 MB.
        if self._config.capacity_bytes is None:
            return client.mget(skeys)
        pipe = client.pipeline(transaction=False)
        pipe.mget(skeys)
        meta = [*self._meta_keys, self._tick_key]
        pipe.eval(TOUCH_SCRIPT, len(meta) + len(skeys), *meta, *skeys)
        return pipe.execute()[0]

    def contains_prefix(self, namespace: str, keys: Sequence[BlockHash]) -> int:
        check_namespace(namespace)
        skeys = self._storage_keys(namespace, keys)
        if not skeys:
            return 0
        if self._cluster is not None:  # one EXISTS per key: a script cannot span slots
            return first_miss([r == 1 or None for r in self._cluster.run(_each("EXISTS", skeys))])
        found = self._call(lambda client: client.eval(LEADING_SCRIPT, len(skeys), *skeys))
        return 0 if found is None else int(found)

    def delete(self, namespace: str, keys: Sequence[BlockHash]) -> int:
        check_namespace(namespace)
        skeys = self._storage_keys(namespace, keys)
        if not skeys:
            return 0
        return self._remove(skeys)

    def clear(self, namespace: str) -> int:
        check_namespace(namespace)
        pattern = f"{self._config.key_prefix}:{namespace}:*"
        if self._cluster is not None:
            found = self._cluster.scan(pattern, count=_SCAN_COUNT)
            return sum(self._remove(batch) for batch in _batches(found, _DELETE_BATCH))
        removed = self._call(lambda client: self._clear(client, pattern))
        return removed or 0

    def _clear(self, client: redis.Redis, pattern: str) -> int:
        found = set(client.scan_iter(match=pattern, count=_SCAN_COUNT))
        if self._config.capacity_bytes is not None:
            # Also records that expired but are still accounted for.
            accounted = client.hscan_iter(self._meta_keys[1], match=pattern, count=_SCAN_COUNT)
            found.update(skey for skey, _size in accounted)
        removed = 0
        for batch in _batches(sorted(found), _DELETE_BATCH):
            removed += self._forget(client, batch)
        return removed

    def _remove(self, skeys: Sequence[str | bytes]) -> int:
        """Remove records (and their accounting); how many existed."""
        if self._cluster is not None:
            return sum(r for r in self._cluster.run(_each("UNLINK", skeys)) if isinstance(r, int))
        return self._call(lambda client: self._forget(client, skeys)) or 0

    def _forget(self, client: redis.Redis, skeys: Sequence[str | bytes]) -> int:
        if self._config.capacity_bytes is None:
            return int(client.unlink(*skeys))
        meta = self._meta_keys
        return int(client.eval(FORGET_SCRIPT, len(meta) + len(skeys), *meta, *skeys))

    def _call(self, op: Callable[[redis.Redis], _T]) -> _T | None:
        """Run ``op`` on redis-py unless the breaker is open; ``None`` if skipped or failed."""
        client = self._client
        assert client is not None, "single-node calls only"
        return self._guarded(lambda: op(client))

    def _call_bulk(self, op: Callable[[RespPool], _T]) -> _T | None:
        """``_call`` for the bulk path (``resp``)."""
        bulk = self._bulk
        assert bulk is not None, "single-node, non-TLS calls only"
        return self._guarded(lambda: op(bulk))

    def _guarded(self, run: Callable[[], _T]) -> _T | None:
        """The breaker around one call of either client: socket failures, timeouts and
        garbage (``RespProtocolError``) count against Redis; an error reply does not."""
        if not self._breaker.allow():
            self._count_skipped()
            return None
        try:
            result = run()
        except (RedisConnectionError, RedisTimeoutError, OSError, TierUnavailableError):
            self._breaker.record_failure()
            self._stats.add(errors=1)
            return None
        except RedisError:
            # Redis answered, with an error (out of memory, read-only replica): it is up.
            self._breaker.record_success()
            self._stats.add(errors=1)
            return None
        except BaseException:
            self._breaker.record_failure()
            raise
        self._breaker.record_success()
        return result

    def _count_skipped(self) -> None:
        with self._lock:
            self._num_skipped += 1

    def stats(self) -> dict[str, Any]:
        """``Tier.stats`` plus ``skipped`` (calls not made because a breaker was open),
        ``breaker`` (``CircuitBreaker.snapshot``; of the slot map on a cluster) and, on a
        cluster, ``node_breakers`` (each master's, by ``host:port``)."""
        out = super().stats()
        with self._lock:
            out["skipped"] = self._num_skipped
        out["breaker"] = self._breaker.snapshot()
        if self._cluster is not None:
            out["node_breakers"] = self._cluster.breakers()
        return out

    def close(self) -> None:
        if self._cluster is not None:
            self._cluster.close()
        if self._bulk is not None:
            self._bulk.close()
        if self._client is not None:
            self._client.close()
            self._client.connection_pool.disconnect()


def _each(command: str, skeys: Sequence[str | bytes]) -> list[tuple[str, str | bytes]]:
    return [(command, skey) for skey in skeys]


def _batches(items: Sequence[_T], size: int) -> Iterator[Sequence[_T]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]
