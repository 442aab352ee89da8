"""Moves blocks between the pool and the cachetier store: save on eviction and on finish,
restore on a prefix hit."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from cachetier.costmodel import CopyRate
from cachetier.keys import BlockHash, Namespace
from cachetier.record import KVBlock
from cachetier.store import PrefixHit, RestoredPrefix, TieredStore
from engine.block_manager import Block
from engine.kv_cache import KVPool

log = logging.getLogger(__name__)


@dataclass(slots=True)
class BridgeStats:
    saved_blocks: int = 0
    save_s: float = 0.0
    restored_blocks: int = 0
    restore_s: float = 0.0
    restored_bytes: int = 0
    rejected_blocks: int = 0  # restored blocks whose layout did not match the pool
    restored_by_tier: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Restored:
    """One restore: the source tier of each block put in place (a prefix of the keys asked
    for), and where its time went: reading from the tiers (straight into the pool where a tier
    can) and copying what could not be read in place."""

    sources: list[str]
    read_s: float
    copy_s: float


class TierBridge:
    """The engine's side of the store.

    Args:
        store: the tiers (owned by the caller).
        namespace: model fingerprint, pool layout and tenant; keys and checks use it.
        pool: the KV pool blocks are copied from and into.
        copy_rate: where restores' copies into the pool are timed, for the cost model (copies
            happen where a tier cannot read into the pool in place: a GPU pool).
    """

    def __init__(
        self,
        store: TieredStore,
        namespace: Namespace,
        pool: KVPool,
        copy_rate: CopyRate | None = None,
    ) -> None:
        if namespace.layout != pool.layout:
            raise ValueError(f"namespace layout {namespace.layout} is not the pool's {pool.layout}")
        self.store = store
        self.namespace = namespace
        self.pool = pool
        self.copy_rate = copy_rate
        self.stats = BridgeStats()
        # A restore may run on the background thread (``restore_in_background``) while the
        # engine's thread restores another: the pool's staging buffers and the stats are
        # shared, so the part after the read holds this lock.
        self._lock = threading.Lock()
        self._background: ThreadPoolExecutor | None = None

    def save(self, blocks: Sequence[Block]) -> None:
        """Hand full, computed blocks not yet stored to the store (lower tiers write later)."""
        todo = [b for b in blocks if b.key is not None and not b.stored]
        if not todo:
            return
        start = time.perf_counter()
        block_ids = [b.block_id for b in todo]
        buffers = self.pool.read_blocks(block_ids)
        auxes = self.pool.read_aux(block_ids)  # an fp8 block's scales, b"" otherwise
        layout = self.namespace.layout
        records = [
            KVBlock(
                b.key,
                self.namespace.fingerprint,
                layout.dtype,
                self.pool.block_shape,
                layout.block_size,
                buf,
                aux,
            )
            for b, buf, aux in zip(todo, buffers, auxes)
            if b.key is not None
        ]
        self.store.put_many(self.namespace.id, records)
        for b in todo:
            b.stored = True
        self.stats.saved_blocks += len(records)
        self.stats.save_s += time.perf_counter() - start

    def lookup(self, keys: Sequence[BlockHash]) -> PrefixHit:
        """Which leading ``keys`` the store holds, and in which tier (no data is read)."""
        return self.store.lookup(self.namespace.id, keys)

    def restore(
        self,
        keys: Sequence[BlockHash],
        block_ids: Sequence[int],
        hit: PrefixHit | None = None,
    ) -> Restored:
        """Read the blocks of ``keys`` and copy them into ``block_ids`` of the pool.

        Every block is checked before use: its key and namespace fingerprint (by the store),
        its dtype, shape, size, scale count and token count (here). The first block that fails
        ends the run.

        Args:
            keys: the blocks to restore, in sequence order.
            block_ids: pool blocks to put them in, one per key.
            hit: the ``lookup`` just made for (at least) these keys, so it is not made twice.

        Returns:
            The source tier of each restored block (a prefix of ``keys``) and the time taken.
        """
        start = time.perf_counter()
        restored = self.store.restore_prefix(
            self.namespace.id,
            keys,
            fingerprint=self.namespace.fingerprint,
            dests=self.pool.block_views(block_ids[: len(keys)]),
            hit=hit,
        )
        with self._lock:
            return self._put_in_place(restored, block_ids, start)

    def restore_in_background(
        self,
        keys: Sequence[BlockHash],
        block_ids: Sequence[int],
        hit: PrefixHit | None = None,
    ) -> Future[Restored]:
        """``restore`` on the bridge's own thread, for blocks the engine will not read until
        the future is done (a tail read while the head before it is recomputed). Restores
        submitted here run one at a time, in order.

        The caller must wait for the future before it frees or reuses ``block_ids``.
        """
        if self._background is None:
            self._background = ThreadPoolExecutor(1, thread_name_prefix="cachetier-restore")
        return self._background.submit(
            self._restore_on_pool_device, list(keys), list(block_ids), hit
        )

    def _restore_on_pool_device(
        self, keys: list[BlockHash], block_ids: list[int], hit: PrefixHit | None
    ) -> Restored:
        # A new thread's current CUDA device is device 0: the pool's copies and the events
        # that free its staging buffers must go to the pool's own device.
        device = self.pool.cache.device
        if device.type != "cuda":
            return self.restore(keys, block_ids, hit)
        with torch.cuda.device(device):
            return self.restore(keys, block_ids, hit)

    def close(self) -> None:
        """Wait for background restores still running and stop their thread; idempotent (a
        later ``restore_in_background`` starts a new one)."""
        background, self._background = self._background, None
        if background is not None:
            background.shutdown(wait=True)

    def _put_in_place(
        self, restored: RestoredPrefix, block_ids: Sequence[int], start: float
    ) -> Restored:
        """Check the blocks a restore read and copy those not read in place into the pool."""
        good: list[KVBlock] = []
        for block in restored.blocks:
            nbytes = memoryview(block.data).nbytes
            if block.num_tokens != self.namespace.block_size or not self.pool.payload_matches(
                block.dtype, block.shape, nbytes, len(block.aux)
            ):
                self.stats.rejected_blocks += 1
                log.warning(
                    "restored block %s does not match the pool layout", block.key.hex()[:12]
                )
                break
            good.append(block)
        # Tiers that could read straight into the pool did; copy only what they could not.
        read_end = time.perf_counter()
        copies = [
            (bid, b.data) for bid, b in zip(block_ids, good) if not self.pool.holds(bid, b.data)
        ]
        if copies:
            self.pool.write_blocks([bid for bid, _ in copies], [data for _, data in copies])
            # Timed to the end of the copy (a device copy runs on after write_blocks returns;
            # the forward would wait for it anyway), so the cost model weighs what it costs.
            self.pool.synchronize()
            if self.copy_rate is not None:
                self.copy_rate.observe(
                    len(copies) * self.pool.block_bytes, time.perf_counter() - read_end
                )
        self.pool.write_aux(block_ids[: len(good)], [b.aux for b in good])
        sources = list(restored.sources[: len(good)])
        self.stats.restored_blocks += len(good)
        self.stats.restored_bytes += len(good) * (self.pool.block_bytes + self.pool.aux_bytes)
        for name in sources:
            self.stats.restored_by_tier[name] = self.stats.restored_by_tier.get(name, 0) + 1
        end = time.perf_counter()
        self.stats.restore_s += end - start
        return Restored(sources, read_end - start, end - read_end)
