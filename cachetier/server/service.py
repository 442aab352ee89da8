"""What the server does with blocks, without HTTP: check uploads, store, fetch, count per tenant.

Every method takes a ``Scope`` (the caller's tenant and storage namespace) and is blocking:
routes run them in a worker thread.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cachetier.errors import CorruptBlockError
from cachetier.kvevents import KVEventPublisher
from cachetier.pins.store import PinResult
from cachetier.primitives.keys import BlockHash
from cachetier.protocol.transfer_frames import TransferAddress
from cachetier.record import Buffer, KVBlock, decode_record, encode_parts, peek_inflated_nbytes
from cachetier.server.auth import Scope, TokenIndex
from cachetier.server.budget import ByteBudget
from cachetier.server.config import OPEN_TENANT, ServerConfig
from cachetier.server.scheduling import FairScheduler
from cachetier.store.tiered import TieredStore
from cachetier.tiers.prefix import PrefixHit
from cachetier.tiers.stats import TierStats

# Keys read per step of a get with a byte budget: the budget is checked between steps, so it
# may be overshot by at most this many blocks.
_READ_STEP = 8


@dataclass(frozen=True, slots=True)
class StoredBlocks:
    """What a put did.

    Args:
        tiers: tier name -> blocks of the put it holds now (stored, or held already).
        already_present: per block of the put, in order, whether the first tier held its key
            already (its record was kept, this one dropped).
    """

    tiers: dict[str, int]
    already_present: list[bool]


class BlockService:
    """The server's store, its tenants' counters and its token index.

    Args:
        config: the server's settings.
        store: the tiers to serve; the service owns the store and closes it.
    """

    def __init__(self, config: ServerConfig, store: TieredStore) -> None:
        self.config = config
        self.store = store
        self.tokens = TokenIndex(config)
        names = [*config.tenants, *([OPEN_TENANT] if config.open_mode else [])]
        # Fixed at start: a tenant exists only if the config names it.
        self._tenant_stats = {name: TierStats() for name in names}
        # Blocks each tenant's lookups missed, by (cause, tier): a few series per tenant, as
        # causes are a fixed list and tiers a handful.
        self._misses: dict[str, dict[tuple[str, str], int]] = {name: {} for name in names}
        self._misses_lock = threading.Lock()
        self._closed = threading.Event()
        # Where the block transfer protocol listens, once it does (for ``/v1/limits``).
        self.transfer: TransferAddress | None = None
        # Who works next, HTTP and the transfer port alike: each tenant's fair share of it.
        slots = config.max_concurrent_requests or max(2, os.cpu_count() or 1)
        self.scheduler = FairScheduler(self.tokens.shares.weights, slots)
        # Upload bytes held right now, over HTTP and the transfer port together.
        self.inflight = ByteBudget(config.max_inflight_bytes)
        # The KV events of what the store holds (``server.events``), where configured.
        self.publisher: KVEventPublisher | None = None

    def store_upload(
        self, scope: Scope, records: Sequence[Buffer | None], keys: Sequence[BlockHash] | None
    ) -> StoredBlocks:
        """Check uploaded records and store them, holding what decompressing them takes.

        Args:
            scope: the caller's scope.
            records: the uploaded records (``None`` for an empty one).
            keys: the key each record must carry, when the request names them separately.

        Returns:
            As ``put_reporting``.

        Raises:
            CorruptBlockError: as ``check_records``; nothing is stored.
            OverloadedError: the decompressed payloads do not fit in ``inflight`` now.
        """
        # What the records claim, capped at what check_records lets them have: a lying claim
        # reserves no more than the limit it is then refused by.
        claims = (peek_inflated_nbytes(r) for r in records if r is not None)
        limit = self.config.max_batch_bytes
        extra = min(sum(min(c, self.config.max_block_bytes) for c in claims), limit)
        self.inflight.take(extra, "decompressing the upload")
        try:
            return self.put_reporting(scope, self.check_records(scope, records, keys))
        finally:
            self.inflight.give(extra)

    def max_raw_bytes(self, raw_so_far: int) -> int:
        """Largest payload the next record of an upload may have (``decode_record``'s
        ``max_raw_bytes``), given the payload bytes its records before it had.

        Args:
            raw_so_far: payload bytes of the request's records checked so far.

        Returns:
            ``max_block_bytes``, or less when the request's payloads together would pass
            ``max_batch_bytes`` (the most one request may make the server hold).
        """
        left = self.config.max_batch_bytes - raw_so_far
        return max(0, min(self.config.max_block_bytes, left))

    def check_records(
        self, scope: Scope, records: Sequence[Buffer | None], keys: Sequence[BlockHash] | None
    ) -> list[KVBlock]:
        """Decode and check uploaded records before anything is stored.

        Args:
            scope: the caller's scope (its fingerprint, if any, must be in every record).
            records: the uploaded records (``None`` for an empty one).
            keys: the key each record must carry, when the request names them separately.

        Returns:
            The blocks.

        Raises:
            CorruptBlockError: naming the first bad record and what is wrong with it (a
                payload over ``max_raw_bytes`` included: checked before it is decompressed);
                nothing of the request may be stored then.
        """
        blocks: list[KVBlock] = []
        raw_so_far = 0
        for i, record in enumerate(records):
            try:
                if record is None:
                    raise CorruptBlockError("it is empty (a put has no misses)")
                key = None if keys is None else keys[i]
                block = decode_record(
                    record,
                    key=key,
                    fingerprint=scope.fingerprint,
                    max_raw_bytes=self.max_raw_bytes(raw_so_far),
                )
                raw_so_far += memoryview(block.data).nbytes
                blocks.append(block)
            except CorruptBlockError as exc:
                self.refuse(scope, len(records))  # the whole request is refused
                raise CorruptBlockError(f"record {i}: {exc}") from None
        return blocks

    def refuse(self, scope: Scope, num_records: int) -> None:
        """Count uploaded records refused (a request with a bad record stores none of its)."""
        self._tenant(scope).add(rejected=num_records)

    def put(self, scope: Scope, blocks: Sequence[KVBlock]) -> dict[str, int]:
        """Store checked blocks.

        Args:
            scope: the caller's scope.
            blocks: blocks that passed ``check_records``.

        Returns:
            tier name -> blocks it holds of those given, stored now or held already (all tiers
            with ``sync_puts``, else the first).
        """
        return self.put_reporting(scope, blocks).tiers

    def put_reporting(self, scope: Scope, blocks: Sequence[KVBlock]) -> StoredBlocks:
        """Store checked blocks, and say which of them the first tier held already.

        Records are immutable: a key names its KV (content-addressed), so a put of a key the
        first tier holds keeps the record it has, and this says so rather than "stored".

        Args:
            scope: the caller's scope.
            blocks: blocks that passed ``check_records``.

        Returns:
            Per tier what it holds of ``blocks`` (as ``put``), and per block whether the first
            tier held its key before this put (as seen when the put began: two puts of one new
            key at once may both be told it was stored, and one of them wins).
        """
        first = self.store.tiers[0]
        present = [first.contains_prefix(scope.storage, [b.key]) == 1 for b in blocks]
        return StoredBlocks(self._put(scope, blocks), present)

    def _put(self, scope: Scope, blocks: Sequence[KVBlock]) -> dict[str, int]:
        start = time.perf_counter()
        if self.config.sync_puts:
            # Each tier in turn, before the answer: an acknowledged block is in every tier.
            stored = {t.name: t.put_many(scope.storage, blocks) for t in self.store.tiers}
            keys = [b.key for b in blocks]
            for name in stored:  # the store's own puts tell its listeners; these bypass it
                self.store.block_events.tell("stored", name, scope.storage, keys)
            if blocks and self.store.live_curve is not None:  # likewise its live curve
                self.store.live_curve.stored(keys, blocks[0].nbytes)
        else:
            stored = {self.store.tiers[0].name: self.store.put_many(scope.storage, blocks)}
        nbytes = sum(b.nbytes for b in blocks)
        self._tenant(scope).add(puts=max(stored.values(), default=0), bytes_in=nbytes)
        self._tenant(scope).observe(time.perf_counter() - start)
        return stored

    def get_records(
        self, scope: Scope, keys: Sequence[BlockHash], max_bytes: int | None = None
    ) -> list[list[Buffer] | None]:
        """Fetch blocks as records to send.

        Args:
            scope: the caller's scope.
            keys: the keys asked for.
            max_bytes: stop once the records fetched reach this many bytes (at least one
                key is always answered); ``None`` for no limit.

        Returns:
            Per answered key, in order, the record's parts (``encode_parts``) or ``None`` on a
            miss; fewer entries than keys when ``max_bytes`` cut the answer short.
        """
        start = time.perf_counter()
        out: list[list[Buffer] | None] = []
        hits = nbytes = 0
        step = len(keys) if max_bytes is None else _READ_STEP
        for first in range(0, len(keys), step):
            if max_bytes is not None and out and nbytes >= max_bytes:
                break
            for block in self.store.get_many(scope.storage, keys[first : first + step]):
                if block is not None and scope.fingerprint not in (None, block.fingerprint):
                    # Uploads here were checked against the fingerprint; a record that came
                    # another way (a copied file) may be of another model: never serve it.
                    block = None
                out.append(None if block is None else encode_parts(block))
                if block is not None:
                    hits += 1
                    nbytes += block.nbytes
        stats = self._tenant(scope)
        stats.add(hits=hits, misses=len(out) - hits, bytes_out=nbytes)
        stats.observe(time.perf_counter() - start)
        return out

    def present(self, scope: Scope, keys: Sequence[BlockHash]) -> list[bool]:
        """Whether each key is stored in any tier, without reading blocks.

        Args:
            scope: the caller's scope.
            keys: the keys asked about.

        Returns:
            One flag per key.
        """
        return [self.store.contains_prefix(scope.storage, [key]) == 1 for key in keys]

    def lookup(self, scope: Scope, keys: Sequence[BlockHash]) -> PrefixHit:
        """The leading run of ``keys`` that is stored, and which tier holds which part.

        Args:
            scope: the caller's scope.
            keys: block keys in sequence order.

        Returns:
            The store's ``PrefixHit``.
        """
        hit = self.store.lookup(scope.storage, keys)
        missed = len(keys) - hit.num_blocks
        if missed and hit.miss_cause:
            cause = (hit.miss_cause, hit.miss_tier or "")
            with self._misses_lock:
                counts = self._misses[scope.tenant]
                counts[cause] = counts.get(cause, 0) + missed
        return hit

    def misses_by_cause(self) -> dict[str, dict[tuple[str, str], int]]:
        """Per tenant, the blocks its lookups missed by (cause, tier) (``cachetier.misses``)."""
        with self._misses_lock:
            return {tenant: dict(counts) for tenant, counts in self._misses.items()}

    def delete(self, scope: Scope, keys: Sequence[BlockHash]) -> int:
        """Remove blocks from every tier.

        Args:
            scope: the caller's scope.
            keys: the keys to remove.

        Returns:
            How many were present.
        """
        return self.store.delete(scope.storage, keys)

    def clear(self, scope: Scope) -> int:
        """Remove every block of the scope's namespace (the caller's tenant only).

        Args:
            scope: the caller's scope.

        Returns:
            How many were removed.
        """
        return self.store.clear(scope.storage)

    def pin(self, scope: Scope, keys: Sequence[BlockHash]) -> PinResult:
        """Keep blocks of the scope's namespace from eviction in every tier that can pin.

        Args:
            scope: the scope whose blocks are pinned (a tenant's own, or any for an admin).
            keys: the keys, e.g. a prefix's chain.

        Returns:
            The store's ``PinResult``.

        Raises:
            PinLimitError: a tier's bound on pinned bytes refused them; nothing was pinned.
        """
        return self.store.pin_keys(scope.storage, keys)

    def unpin(self, scope: Scope, keys: Sequence[BlockHash]) -> int:
        """Let pinned blocks of the scope's namespace be evicted again.

        Returns:
            How many of ``keys`` were pinned.
        """
        return self.store.unpin_keys(scope.storage, keys)

    def pins_of(self, tenant: str | None) -> list[tuple[str, str, list[BlockHash]]]:
        """Pinned keys of one tenant (``None``: every tenant).

        Returns:
            ``(tenant, namespace as its client names it, keys)`` per pinned namespace.
        """
        out = []
        for storage, keys in self.store.pinned("t." if tenant is None else f"t.{tenant}.").items():
            _, owner, namespace = storage.split(".", 2)  # tenant names have no "."
            out.append((owner, namespace, keys))
        return out

    def tenant_stats(self, tenant: str) -> dict[str, Any]:
        """Counters of one tenant.

        Args:
            tenant: a configured tenant.

        Returns:
            ``TierStats.snapshot`` without the counters only a tier keeps (errors, evictions),
            plus ``pinned_keys``: the keys the tenant has pinned.
        """
        out = self._tenant_stats[tenant].snapshot()
        for name in ("errors", "evictions"):
            out.pop(name, None)
        out["pinned_keys"] = sum(len(keys) for keys in self.store.pinned(f"t.{tenant}.").values())
        return out

    @property
    def tenant_names(self) -> list[str]:
        """Every tenant the config names (and ``open`` in open mode)."""
        return list(self._tenant_stats)

    def _tenant(self, scope: Scope) -> TierStats:
        return self._tenant_stats[scope.tenant]

    def close(self) -> None:
        """Flush queued writes to the lower tiers and close them."""
        if not self._closed.is_set():
            self._closed.set()
            if self.publisher is not None:
                self.publisher.close()
            self.store.close()
