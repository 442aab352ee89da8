"""How the Redis tier reaches Redis: one transport, picked when the tier is made.

- ``RespTransport`` (one node, no capacity): block gets and puts over the protocol client of
  ``resp`` (records read straight into the caller's buffers, SETs sent from a record's parts);
  scripts, scans and deletes over redis-py.
- ``ExactLruTransport`` (one node with ``capacity_bytes``): the same gets followed by the touch
  script; a put is one MULTI of its SETs and the accounting script (``scripts``), over redis-py.
  It also holds the tier's pins (``pins``), which live next to its LRU.
- ``ClusterTransport`` (``redis+cluster://``): each command sent to the master owning its key
  (``ClusterRouter``), every master behind a breaker of its own.

All three answer in the same terms (a ``GetResult`` per key, a ``PutOutcome``), so the tier
counts one way whichever it holds. A call Redis does not answer is ``None`` (a miss); the
breaker and the error counts are the guard's (``cachetier.util.backoff.Guard``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import redis

from cachetier.errors import CorruptBlockError, TierUnavailableError
from cachetier.primitives.keys import BlockHash
from cachetier.record import (
    Buffer,
    Compression,
    KVBlock,
    decode_record,
    encode_parts,
    encode_record,
)
from cachetier.tiers.base import first_miss
from cachetier.tiers.redis.cluster import ClusterRouter
from cachetier.tiers.redis.config import RedisTierConfig, make_client
from cachetier.tiers.redis.pins import RedisPins
from cachetier.tiers.redis.resp import CORRUPT, Endpoint, GetResult, Hit, RespClient
from cachetier.tiers.redis.scripts import (
    FORGET_SCRIPT,
    LEADING_SCRIPT,
    PUT_SCRIPT,
    TOUCH_SCRIPT,
    meta_keys,
)
from cachetier.util.backoff import Guard
from cachetier.util.landing import Destination
from cachetier.util.redact import redact_url
from cachetier.util.tls import client_context

_T = TypeVar("_T")
_SCAN_COUNT = 1000  # keys per SCAN step
_DELETE_BATCH = 512  # keys per UNLINK / forget script in clear()


@dataclass(frozen=True, slots=True)
class PutOutcome:
    """What one put stored.

    Args:
        num_stored: records Redis stored.
        num_bytes: their bytes.
        num_rejected: records refused (larger than the capacity, or by Redis: ``maxmemory``).
        num_evicted: records the exact LRU evicted to make room.
        num_present: records Redis already held under their key, left as they were.
    """

    num_stored: int = 0
    num_bytes: int = 0
    num_rejected: int = 0
    num_evicted: int = 0
    num_present: int = 0


class Transport(ABC):
    """The commands of the Redis tier over one way of reaching Redis.

    Args:
        config: the tier's settings (compression and expiry of the records it stores).
    """

    def __init__(self, config: RedisTierConfig) -> None:
        self._compression = Compression.LZ4 if config.compression == "lz4" else Compression.NONE
        self._ttl_ms = None if config.ttl_s is None else max(1, round(config.ttl_s * 1000))

    @property
    def is_down(self) -> bool:
        """Whether a call would be skipped now (a peek: it never takes a breaker's trial)."""
        return False

    @abstractmethod
    def get(
        self, skeys: list[str], keys: Sequence[BlockHash], dests: list[Destination] | None
    ) -> list[GetResult] | None:
        """Read records.

        Args:
            skeys: the Redis keys.
            keys: the block key each record must carry.
            dests: per key, where its payload may be read to (``None``: fresh buffers).

        Returns:
            One ``GetResult`` per key, or ``None`` when Redis was not reached.
        """

    @abstractmethod
    def put(self, skeys: list[str], blocks: Sequence[KVBlock]) -> PutOutcome:
        """Store blocks as records under ``skeys`` (one per block)."""

    @abstractmethod
    def leading(self, skeys: list[str]) -> int:
        """How many leading ``skeys`` exist (0 when Redis was not reached)."""

    def present(self, skeys: list[str]) -> list[bool] | None:
        """Per key, whether a record exists, asked before a put; ``None`` when Redis was not
        reached. This default asks nothing (all ``False``): a transport whose ``put`` skips
        held keys itself (``PutOutcome.num_present``) needs no round trip for it."""
        return [False] * len(skeys)

    @abstractmethod
    def remove(self, skeys: Sequence[str | bytes]) -> int:
        """Remove records (and their accounting); how many existed."""

    @abstractmethod
    def clear(self, pattern: str) -> int:
        """Remove every record whose key matches a SCAN ``pattern``; how many."""

    def used_bytes(self) -> int | None:
        """Record bytes accounted for; ``None`` if not kept or not read."""
        return None

    def breakers(self) -> dict[str, dict[str, Any]] | None:
        """Each node's breaker snapshot, where nodes have their own (a cluster)."""
        return None

    @abstractmethod
    def close(self) -> None:
        """Close every connection."""


class RespTransport(Transport):
    """One Redis node: gets and puts over ``RespClient``, the rest over redis-py.

    Args:
        config: the tier's settings (a single-node url).
        guard: the breaker every call goes through.
    """

    def __init__(self, config: RedisTierConfig, guard: Guard) -> None:
        super().__init__(config)
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
        self.resp = RespClient(endpoint, config.max_connections, config.bulk_streams)
        self._guard = guard

    @property
    def is_down(self) -> bool:
        return self._guard.breaker.is_open

    def get(
        self, skeys: list[str], keys: Sequence[BlockHash], dests: list[Destination] | None
    ) -> list[GetResult] | None:
        names = [skey.encode() for skey in skeys]
        return self._guard.call(lambda: self.resp.get_records(names, keys, dests), None)

    def put(self, skeys: list[str], blocks: Sequence[KVBlock]) -> PutOutcome:
        sizes = [0] * len(blocks)

        def record_of(i: int) -> list[Buffer]:  # on the sending stream's thread
            parts = encode_parts(blocks[i], self._compression)
            sizes[i] = sum(memoryview(p).nbytes for p in parts)
            return parts

        names = [skey.encode() for skey in skeys]
        replies = self._guard.call(
            lambda: self.resp.set_records(names, record_of, self._ttl_ms), None
        )
        stored = nbytes = rejected = 0
        for size, reply in zip(sizes, replies or (), strict=False):
            if reply is True:
                stored += 1
                nbytes += size
            else:  # refused by Redis (e.g. over maxmemory with noeviction)
                rejected += 1
        return PutOutcome(stored, nbytes, rejected)

    def leading(self, skeys: list[str]) -> int:
        found = self._redis(lambda client: client.eval(LEADING_SCRIPT, len(skeys), *skeys))
        return 0 if found is None else int(found)

    def present(self, skeys: list[str]) -> list[bool] | None:
        def exists(client: redis.Redis) -> list[bool]:
            pipe = client.pipeline(transaction=False)
            for skey in skeys:
                pipe.exists(skey)
            return [reply == 1 for reply in pipe.execute()]

        return self._redis(exists)

    def remove(self, skeys: Sequence[str | bytes]) -> int:
        return self._redis(lambda client: self._forget(client, skeys)) or 0

    def clear(self, pattern: str) -> int:
        def clear(client: redis.Redis) -> int:
            found = sorted(self._find(client, pattern))
            return sum(self._forget(client, batch) for batch in _batches(found, _DELETE_BATCH))

        return self._redis(clear) or 0

    def _find(self, client: redis.Redis, pattern: str) -> set[bytes]:
        return set(client.scan_iter(match=pattern, count=_SCAN_COUNT))

    def _forget(self, client: redis.Redis, skeys: Sequence[str | bytes]) -> int:
        return int(client.unlink(*skeys))

    def _redis(self, op: Callable[[redis.Redis], _T]) -> _T | None:
        """Run ``op`` on redis-py through the guard; ``None`` if skipped or failed."""
        client = self._client
        return self._guard.call(lambda: op(client), None)

    def close(self) -> None:
        self.resp.close()
        self._client.close()
        self._client.connection_pool.disconnect()


class ExactLruTransport(RespTransport):
    """One Redis node holding at most ``capacity_bytes`` of records, in an exact shared LRU.

    Args:
        config: the tier's settings (a single-node url and a capacity).
        guard: the breaker every call goes through.
    """

    def __init__(self, config: RedisTierConfig, guard: Guard) -> None:
        super().__init__(config, guard)
        assert config.capacity_bytes is not None, "the exact LRU needs a capacity"
        self._capacity = config.capacity_bytes
        self._meta = meta_keys(config.key_prefix)
        self.pins = RedisPins(
            self._redis,
            config.key_prefix,
            int(config.capacity_bytes * config.max_pinned_fraction),
            redact_url(config.url),
        )

    def get(
        self, skeys: list[str], keys: Sequence[BlockHash], dests: list[Destination] | None
    ) -> list[GetResult] | None:
        results = super().get(skeys, keys, dests)
        if results is not None:
            # Right after the reads, not atomically with them: a record evicted in between is
            # only a stale LRU entry the script drops. Also forgets the accounting of records
            # that expired, which only a get notices.
            meta = self._meta
            self._redis(
                lambda client: client.eval(TOUCH_SCRIPT, len(meta) + len(skeys), *meta, *skeys)
            )
        return results

    def put(self, skeys: list[str], blocks: Sequence[KVBlock]) -> PutOutcome:
        kept: list[str] = []
        records: list[bytes] = []
        for skey, block in zip(skeys, blocks, strict=True):
            record = encode_record(block, self._compression)
            if len(record) <= self._capacity:  # a larger one could never fit
                kept.append(skey)
                records.append(record)
        rejected = len(skeys) - len(kept)
        evicted = (
            self._redis(lambda client: self._set_counted(client, kept, records)) if kept else None
        )
        if evicted is None:
            return PutOutcome(num_rejected=rejected)
        return PutOutcome(len(kept), sum(map(len, records)), rejected, evicted)

    def _set_counted(self, client: redis.Redis, skeys: list[str], records: list[bytes]) -> int:
        """The SETs and the accounting script in one MULTI; how many records were evicted."""
        pipe = client.pipeline(transaction=True)
        for skey, record in zip(skeys, records, strict=True):
            pipe.set(skey, record, px=self._ttl_ms)
        meta = self._meta
        sizes = [len(record) for record in records]
        pipe.eval(
            PUT_SCRIPT,
            len(meta) + len(skeys),
            *meta,
            *skeys,
            self._capacity,
            self.pins.max_bytes,
            *sizes,
        )
        return int(pipe.execute()[-1])

    def _find(self, client: redis.Redis, pattern: str) -> set[bytes]:
        found = super()._find(client, pattern)
        # Also records that expired but are still accounted for.
        accounted = client.hscan_iter(self._meta[1], match=pattern, count=_SCAN_COUNT)
        found.update(skey for skey, _size in accounted)
        return found

    def _forget(self, client: redis.Redis, skeys: Sequence[str | bytes]) -> int:
        meta = self._meta
        return int(client.eval(FORGET_SCRIPT, len(meta) + len(skeys), *meta, *skeys))

    def used_bytes(self) -> int | None:
        used = self._redis(lambda client: int(client.get(self._meta[2]) or 0))  # _used
        return None if used is None else max(0, used)


class ClusterTransport(Transport):
    """Redis Cluster: one pipelined batch per master per call, over redis-py's connections.

    Args:
        config: the tier's settings (a cluster url, no capacity).
        router: sends each command to its key's master, behind that master's breaker.
    """

    def __init__(self, config: RedisTierConfig, router: ClusterRouter) -> None:
        super().__init__(config)
        self._router = router

    def get(
        self, skeys: list[str], keys: Sequence[BlockHash], dests: list[Destination] | None
    ) -> list[GetResult] | None:
        replies = self._router.run(_each("GET", skeys))
        return [_decoded(reply, key) for reply, key in zip(replies, keys, strict=True)]

    def put(self, skeys: list[str], blocks: Sequence[KVBlock]) -> PutOutcome:
        records = [encode_record(block, self._compression) for block in blocks]
        ttl = () if self._ttl_ms is None else ("PX", self._ttl_ms)
        # NX: a key a master holds keeps its record. In the same call, not an EXISTS before
        # it: every call is a pipelined batch per master, behind that master's breaker.
        replies = self._router.run([("SET", k, r, "NX", *ttl) for k, r in zip(skeys, records)])
        stored = nbytes = rejected = present = 0
        for record, reply in zip(records, replies, strict=True):
            if reply is True:
                stored += 1
                nbytes += len(record)
            elif reply is None:  # NX: held already
                present += 1
            elif not isinstance(reply, TierUnavailableError):  # a master was not asked
                rejected += 1  # refused by Redis (e.g. over maxmemory with noeviction)
        return PutOutcome(stored, nbytes, rejected, num_present=present)

    def leading(self, skeys: list[str]) -> int:
        # One EXISTS per key: a script cannot span slots.
        return first_miss([r == 1 or None for r in self._router.run(_each("EXISTS", skeys))])

    def remove(self, skeys: Sequence[str | bytes]) -> int:
        return sum(r for r in self._router.run(_each("UNLINK", skeys)) if isinstance(r, int))

    def clear(self, pattern: str) -> int:
        found = self._router.scan(pattern, count=_SCAN_COUNT)
        return sum(self.remove(batch) for batch in _batches(found, _DELETE_BATCH))

    def breakers(self) -> dict[str, dict[str, Any]]:
        return self._router.breakers()

    def close(self) -> None:
        self._router.close()


def _decoded(reply: Any, key: BlockHash) -> GetResult:
    """A cluster GET reply as a ``GetResult``; an error reply is a miss (the router counted
    it)."""
    if not isinstance(reply, bytes):
        return None
    try:
        return Hit(decode_record(reply, key=key), len(reply))
    except CorruptBlockError:
        return CORRUPT


def _each(command: str, skeys: Sequence[str | bytes]) -> list[tuple[str, str | bytes]]:
    return [(command, skey) for skey in skeys]


def _batches(items: Sequence[_T], size: int) -> Iterator[Sequence[_T]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]
