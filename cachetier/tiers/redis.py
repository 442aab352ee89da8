"""Redis tier: block records in a Redis shared by many processes and machines.

A block lives at ``{key_prefix}:{namespace}:{key hex}`` as one checksummed record (see
``cachetier.record``); a get checks the record against the key it was asked for.

Transfers. On a single node (``redis://``, ``rediss://`` or ``unix://``), block gets and puts
go through ``resp``: pipelined GETs read straight into the caller's buffers and SETs sent from a
record's parts, a large batch spread over ``bulk_streams`` connections (on the SmolLM2 shape
about twice as fast as redis-py's pipeline, ``benchmarks/bench_peers.py``). Scripts, scans,
deletes and Redis Cluster use redis-py.

TLS. ``rediss://`` (``rediss+cluster://``) makes every connection, redis-py's and the bulk
path's, speak TLS, checking Redis's chain (against ``ssl_ca_certs``, else the system's CAs) and
that its certificate names the url's host; ``ssl_certfile`` / ``ssl_keyfile`` present a client
certificate (Redis asks for one unless ``tls-auth-clients no``). Query flags such as ``?ssl=``
are refused: they would leave one of the two paths in plaintext.

Credentials. A url's password never appears in a repr, an error message or a log line
(``cachetier.redact``). A Redis that refuses them (``NOAUTH``, ``WRONGPASS``, a failed
``AUTH``) fails every call: each is counted (``auth_failures`` and ``errors`` in stats) and a
warning is logged at most once per ``AUTH_LOG_INTERVAL_S``.

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

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import redis
from redis.exceptions import AuthenticationError as RedisAuthenticationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

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
from cachetier.redact import redact, redact_url
from cachetier.throttle import LogThrottle
from cachetier.tiers.base import Tier, check_namespace, first_miss, land_in
from cachetier.tiers.redis_cluster import ClusterRouter
from cachetier.tiers.redis_config import RedisTierConfig, make_client
from cachetier.tiers.redis_scripts import FORGET_SCRIPT, LEADING_SCRIPT, PUT_SCRIPT, TOUCH_SCRIPT
from cachetier.tiers.resp import (
    CORRUPT,
    Endpoint,
    ErrorReply,
    GetResult,
    Hit,
    RespAuthError,
    RespPool,
)
from cachetier.tls import client_context

__all__ = ["AUTH_LOG_INTERVAL_S", "RedisTier", "RedisTierConfig", "make_client"]
logger = logging.getLogger(__name__)
_T = TypeVar("_T")
_SCAN_COUNT = 1000  # keys per SCAN step
_DELETE_BATCH = 512  # keys per UNLINK / forget script in clear()
AUTH_LOG_INTERVAL_S = 60.0  # least time between two warnings that Redis refuses our password


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
        self._auth_log = LogThrottle(AUTH_LOG_INTERVAL_S, clock)
        self._client: redis.Redis | None = None
        self._cluster: ClusterRouter | None = None
        # The block gets and puts of a single node, without redis-py's copies.
        self._bulk: RespPool | None = None
        if config.cluster:  # connects on first use: building the client reads the slot map
            self._cluster = ClusterRouter(
                connect=lambda: make_client(config),
                breaker=self._breaker,
                make_breaker=lambda: CircuitBreaker(config.failure_threshold, backoff, clock),
                count_error=lambda n: self._stats.add(errors=n),
                count_skipped=self._count_skipped,
                on_auth_refused=self._auth_refused,
            )
        else:
            # Reads the CA and client certificate files now: a bad path fails here, clearly,
            # rather than as a connection error on every call.
            tls = (
                client_context(
                    config.ssl_ca_certs, cert_file=config.ssl_certfile, key_file=config.ssl_keyfile
                )
                if config.tls
                else None
            )
            client = make_client(config)
            assert isinstance(client, redis.Redis), "a single-node url makes a single-node client"
            self._client = client
            endpoint = Endpoint.from_url(
                config.url, config.connect_timeout_s, config.socket_timeout_s, tls
            )
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
        assert bulk is not None, "single-node calls only"
        return self._guarded(lambda: op(bulk))

    def _guarded(self, run: Callable[[], _T]) -> _T | None:
        """The breaker around one call of either client: socket failures, timeouts and
        garbage (``RespProtocolError``) count against Redis; an error reply does not."""
        if not self._breaker.allow():
            self._count_skipped()
            return None
        try:
            result = run()
        except (RedisAuthenticationError, RespAuthError) as exc:
            # Before the connection errors (redis-py's is one): it is one, and also a wrong
            # password, which someone has to fix.
            self._breaker.record_failure()
            self._stats.add(errors=1)
            self._auth_refused(exc)
            return None
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

    def _auth_refused(self, exc: BaseException) -> None:
        """Count a refusal of our credentials; warn once per ``AUTH_LOG_INTERVAL_S``."""
        count = self._auth_log.note()
        if count is not None:
            logger.warning(
                "Redis at %s refuses the tier's credentials (%s): %d call(s) failed so since the "
                "last warning; check the user and password of the url",
                redact_url(self._config.url),
                redact(str(exc)),
                count,
            )

    def stats(self) -> dict[str, Any]:
        """``Tier.stats`` plus ``skipped`` (calls not made because a breaker was open),
        ``auth_failures`` (calls Redis refused for our credentials; also in ``errors``),
        ``breaker`` (``CircuitBreaker.snapshot``; of the slot map on a cluster) and, on a
        cluster, ``node_breakers`` (each master's, by ``host:port``)."""
        out = super().stats()
        with self._lock:
            out["skipped"] = self._num_skipped
        out["auth_failures"] = self._auth_log.total
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
