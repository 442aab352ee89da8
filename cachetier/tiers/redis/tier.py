"""Redis tier: block records in a Redis shared by many processes and machines.

A block lives at ``{key_prefix}:{namespace}:{key hex}`` as one checksummed record (see
``cachetier.record``); a get checks the record against the key it was asked for.

Transports. The tier picks one when it is made (``transports``): on a single node
(``redis://``, ``rediss://`` or ``unix://``) block gets and puts go through the protocol client
of ``resp`` (pipelined GETs read straight into the caller's buffers, SETs sent from a record's
parts, a large batch spread over ``bulk_streams`` connections); scripts, scans and deletes use
redis-py. A ``redis+cluster://host:port[,host:port...]`` URL spreads the blocks over the
cluster's masters, one pipelined batch per master per call (see ``cluster``). A capacity is
refused there: bound each node with its own ``maxmemory`` and ``maxmemory-policy``.

TLS. ``rediss://`` (``rediss+cluster://``) makes every connection, redis-py's and the protocol
client's, speak TLS, checking Redis's chain (against ``ssl_ca_certs``, else the system's CAs)
and that its certificate names the url's host; ``ssl_certfile`` / ``ssl_keyfile`` present a
client certificate (Redis asks for one unless ``tls-auth-clients no``). Query flags such as
``?ssl=`` are refused: they would leave one of the two clients in plaintext.

Credentials. A url's password never appears in a repr, an error message or a log line
(``cachetier.util.redact``). A Redis that refuses them (``NOAUTH``, ``WRONGPASS``, a failed
``AUTH``) fails every call: each is counted (``auth_failures`` and ``errors`` in stats) and a
warning is logged at most once per ``AUTH_LOG_INTERVAL_S``.

Capacity. With ``capacity_bytes=None`` Redis's own ``maxmemory`` policy bounds the tier and
nothing else is kept (a put is pipelined SETs, a get pipelined GETs). With a capacity, the tier
keeps an exact LRU shared by every process using the same ``key_prefix``, in four keys no
namespace can collide with (namespaces never start with ``_``)::

    {key_prefix}:_lru    sorted set: storage key -> last-use tick
    {key_prefix}:_size   hash: storage key -> record bytes
    {key_prefix}:_used   bytes of every record in _size
    {key_prefix}:_tick   counter the ticks are drawn from (INCRBY: exact order across processes)

Lua scripts (``scripts``) keep them consistent with the records: a put runs its SETs and the
accounting script in one MULTI; the script evicts least recently used records until the total
fits. This needs a single Redis node (the scripts touch keys in many slots).

Pins. With a capacity on a single node (``rediss://`` too) the tier can pin (``pin``): pinned
records are kept out of ``_lru``, so the LRU never evicts them, up to ``max_pinned_fraction``
of the capacity. The pins live in Redis next to the LRU (``pins``), shared by every process
using the same ``key_prefix``. Without a capacity, or on a cluster, Redis's own ``maxmemory``
policy evicts and knows nothing of pins: ``supports_pins`` is false there.

Failures. Every call goes through a ``Guard`` (``cachetier.util.backoff``): a Redis that is down or
slower than the socket timeout turns into misses and counted errors, and after
``failure_threshold`` failures in a row the tier stops calling it (``skipped`` in stats) until
a backoff has passed. On a cluster each master has its own breaker, so one lost master costs
only its own keys.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from redis.exceptions import AuthenticationError as RedisAuthenticationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from cachetier.errors import PinsUnsupportedError, TierUnavailableError
from cachetier.pins.pinset import NO_PINS
from cachetier.primitives.keys import HASH_BYTES, BlockHash
from cachetier.record import KVBlock
from cachetier.tiers.base import Tier, check_namespace, land_in
from cachetier.tiers.redis.cluster import ClusterRouter
from cachetier.tiers.redis.config import RedisTierConfig, make_client
from cachetier.tiers.redis.pins import RedisPins
from cachetier.tiers.redis.resp import CORRUPT, ErrorReply, Hit, RespAuthError
from cachetier.tiers.redis.transports import (
    ClusterTransport,
    ExactLruTransport,
    PutOutcome,
    RespTransport,
    Transport,
)
from cachetier.util.backoff import CircuitBreaker, Clock, ExponentialBackoff, Fault, Guard
from cachetier.util.landing import Destination, normalize
from cachetier.util.redact import redact, redact_url
from cachetier.util.throttle import DownLog, LogThrottle

__all__ = ["AUTH_LOG_INTERVAL_S", "RedisTier"]
logger = logging.getLogger(__name__)
AUTH_LOG_INTERVAL_S = 60.0  # least time between two warnings that Redis refuses our password


class RedisTier(Tier):
    """Blocks as records in Redis; a failing Redis is a miss, never an exception.

    Args:
        config: connection, capacity and breaker settings.
        clock: time source of the circuit breaker (tests inject one instead of sleeping).
    """

    name = "redis"
    over_network = True

    def __init__(self, config: RedisTierConfig, *, clock: Clock = time.monotonic) -> None:
        super().__init__(clock=clock)
        self._config = config
        backoff = ExponentialBackoff(config.backoff_base_s, config.backoff_cap_s)
        # Single node: guards every call. Cluster: guards reading the slot map; each master
        # gets a breaker of its own, so one lost master does not stop the others.
        self._breaker = CircuitBreaker(config.failure_threshold, backoff, clock)
        self._lock = threading.Lock()
        self._num_skipped = 0
        self._last_used_bytes = 0
        self._auth_log = LogThrottle(AUTH_LOG_INTERVAL_S, clock)
        self._down_log = DownLog(logger, "Redis", redact_url(config.url), clock=clock)
        self._transport: Transport
        self._pins: RedisPins | None = None
        if config.cluster:  # connects on first use: building the client reads the slot map
            router = ClusterRouter(
                connect=lambda: make_client(config),
                breaker=self._breaker,
                make_breaker=lambda: CircuitBreaker(config.failure_threshold, backoff, clock),
                count_error=lambda n: self._stats.add(errors=n),
                count_skipped=self._count_skipped,
                on_auth_refused=self._auth_refused,
                on_down=lambda exc: self._down_log.failed(redact(f"{type(exc).__name__}: {exc}")),
            )
            self._transport = ClusterTransport(config, router)
        else:
            guard = Guard(
                self._breaker,
                _fault,
                on_failure=self._call_failed,
                on_skipped=self._count_skipped,
            )
            if config.capacity_bytes is None:
                self._transport = RespTransport(config, guard)
            else:
                lru = ExactLruTransport(config, guard)
                self._transport, self._pins = lru, lru.pins
        # Only the exact LRU can keep a record from eviction: Redis's maxmemory policy (no
        # capacity, or a cluster) evicts what it likes.
        self.supports_pins = self._pins is not None

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
        used = self._transport.used_bytes()
        if used is not None:
            self._last_used_bytes = used
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
        skeys = self._storage_keys(namespace, [b.key for b in blocks])
        if not blocks:
            return 0
        if self._transport.is_down:  # the call would be skipped: do not encode for nothing
            self._count_skipped()
            return 0
        start = time.perf_counter()
        # A record under a key is the same KV whoever computed it: keys Redis holds are not
        # written again. On one node they are not even encoded or sent (one pipelined EXISTS
        # each first); a cluster's SET NX leaves them in the same call.
        present = self._transport.present(skeys)
        if present is None:  # Redis not reached (counted): the put would not be either
            return 0
        todo = [i for i, held in enumerate(present) if not held]
        put = PutOutcome()
        if todo:
            put = self._transport.put([skeys[i] for i in todo], [blocks[i] for i in todo])
        skipped = len(skeys) - len(todo) + put.num_present
        self._stats.add(
            puts=put.num_stored,
            bytes_in=put.num_bytes,
            rejected=put.num_rejected,
            evictions=put.num_evicted,
            skipped_present=skipped,
        )
        self._stats.observe(time.perf_counter() - start)
        return put.num_stored + skipped

    def get_many(self, namespace: str, keys: Sequence[BlockHash]) -> list[KVBlock | None]:
        check_namespace(namespace)
        skeys = self._storage_keys(namespace, keys)
        return self._get(skeys, keys, None) if keys else []

    def get_into(
        self, namespace: str, keys: Sequence[BlockHash], dests: Sequence[Destination]
    ) -> list[KVBlock | None]:
        check_namespace(namespace)
        if len(dests) != len(keys):
            raise ValueError(f"{len(dests)} destinations for {len(keys)} keys")
        skeys = self._storage_keys(namespace, keys)
        if not keys:
            return []
        targets = [normalize(d) for d in dests]
        # A compressed record is decompressed elsewhere; land_in copies it where it belongs.
        return land_in(self._get(skeys, keys, targets), targets)

    def _get(
        self, skeys: list[str], keys: Sequence[BlockHash], dests: list[Destination] | None
    ) -> list[KVBlock | None]:
        """Read and count: records read into ``dests`` where the transport can, else fresh."""
        start = time.perf_counter()
        results = self._transport.get(skeys, keys, dests)
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
                self._log_corrupt(keys[i], "failed its checks")
            elif isinstance(result, ErrorReply):  # e.g. WRONGTYPE: another program's key
                errors += 1
        if corrupt:
            # A good record put by another process between our read and this delete is lost
            # with it: rare, and it only costs a later miss.
            self._transport.remove(corrupt)
        self._stats.add(
            hits=hits,
            misses=len(keys) - hits,
            bytes_out=nbytes,
            corrupt=len(corrupt),
            errors=errors,
        )
        self._stats.observe(time.perf_counter() - start)
        return out

    def contains_prefix(self, namespace: str, keys: Sequence[BlockHash]) -> int:
        check_namespace(namespace)
        skeys = self._storage_keys(namespace, keys)
        return self._transport.leading(skeys) if skeys else 0

    def delete(self, namespace: str, keys: Sequence[BlockHash]) -> int:
        check_namespace(namespace)
        skeys = self._storage_keys(namespace, keys)
        return self._transport.remove(skeys) if skeys else 0

    def clear(self, namespace: str) -> int:
        check_namespace(namespace)
        return self._transport.clear(f"{self._config.key_prefix}:{namespace}:*")

    def pin(self, namespace: str, keys: Sequence[BlockHash]) -> int:
        """``Tier.pin``, in Redis: the pins are shared by every process using this
        ``key_prefix`` (see ``cachetier.tiers.redis.pins``).

        Raises:
            PinLimitError: the stored ones would pass ``max_pinned_fraction`` of the capacity;
                nothing was pinned.
            TierUnavailableError: Redis did not answer (or the breaker is open); nothing was
                pinned.
            PinsUnsupportedError: the tier has no capacity, or is on a cluster.
        """
        check_namespace(namespace)
        skeys = self._storage_keys(namespace, keys)
        return self._pin_set().pin(skeys) if skeys else 0

    def unpin(self, namespace: str, keys: Sequence[BlockHash]) -> int:
        """``Tier.unpin``, in Redis (for every process using this ``key_prefix``).

        Raises:
            TierUnavailableError: Redis did not answer (or the breaker is open); nothing was
                unpinned.
        """
        check_namespace(namespace)
        skeys = self._storage_keys(namespace, keys)
        return self._pin_set().unpin(skeys) if skeys else 0

    def pin_stats(self) -> dict[str, Any]:
        """``Tier.pin_stats`` read from Redis (all processes); the last values read while
        Redis cannot be reached (with the breaker open, not even tried: ``stats`` already
        counts one skipped read for ``used_bytes``)."""
        if self._pins is None:
            return dict(NO_PINS)
        return self._pins.snapshot(read=not self._transport.is_down)

    def _pin_set(self) -> RedisPins:
        if self._pins is None:
            raise PinsUnsupportedError(
                "the redis tier pins only with capacity_bytes on a single node: otherwise "
                "Redis's own maxmemory policy evicts, and it knows nothing of pins"
            )
        return self._pins

    def probe(self) -> None:
        """One EXISTS through the tier's breaker (a cluster reads its slot map for it)."""
        self._transport.leading([f"{self._config.key_prefix}:_probe"])

    def _call_failed(self, exc: BaseException, fault: Fault) -> None:
        """Count a call that failed (the guard told the breaker)."""
        self._stats.add(errors=1)
        if isinstance(exc, (RedisAuthenticationError, RespAuthError)):
            self._auth_refused(exc)
        elif fault is not Fault.ANSWERED:
            self._down_log.failed(redact(f"{type(exc).__name__}: {exc}"))

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
        node_breakers = self._transport.breakers()
        if node_breakers is not None:
            out["node_breakers"] = node_breakers
        return out

    def close(self) -> None:
        self._transport.close()


def _fault(exc: BaseException) -> Fault | None:
    """What a failed call to one node says: socket failures, timeouts and garbage
    (``RespProtocolError``) count against Redis; an error reply does not."""
    # A refused password is a connection error too (redis-py's AuthenticationError is one).
    if isinstance(exc, (RedisConnectionError, RedisTimeoutError, OSError, TierUnavailableError)):
        return Fault.DOWN
    if isinstance(exc, RedisError):
        return Fault.ANSWERED  # out of memory, a read-only replica: it is up
    return None
