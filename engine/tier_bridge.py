"""Moves blocks between the pool and the cachetier store: save on eviction and on finish,
restore on a prefix hit.

A pool block of ``n`` records (``block_size = n * record_tokens``) is saved as ``n`` records cut
from it and restored by joining them (``cachetier.kernels.records``); with one record per block,
tiers read straight into the pool where they can.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from cachetier.engine.block_manager import Block
from cachetier.engine.kv_cache import KVPool
from cachetier.engine.shadow import ShadowVerifier
from cachetier.guard import GuardSampler
from cachetier.guard.record_check import Layer0, RecordCheck
from cachetier.kernels.records import join_records, split_block
from cachetier.kernels.staging import payload_tensor, payload_view
from cachetier.misses import NamespaceDescriptor
from cachetier.primitives.keys import (
    BlockHash,
    Namespace,
    record_layout,
    records_per_block,
    torch_dtype,
)
from cachetier.record import KVBlock
from cachetier.store.costmodel import CopyRate
from cachetier.store.record_guard import RecordGuard
from cachetier.store.tiered import TieredStore
from cachetier.tiers.prefix import PrefixHit, RestoredPrefix

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
    # Why the record guard ended the run early (``record_guard.CAUSES``), ``None`` if it did not.
    guard_cut: str | None = None
    # Leading blocks holding only some layers (``WindowedTierBridge``): not to be shared.
    partial_blocks: int = 0


class TierBridge:
    """The engine's side of the store.

    Args:
        store: the tiers (owned by the caller).
        namespace: model fingerprint, record layout (the pool's, at ``record_tokens``) and
            tenant; keys and checks use it.
        pool: the KV pool blocks are copied from and into.
        copy_rate: where restores' copies into the pool are timed, for the cost model (copies
            happen where a tier cannot read into the pool in place: a GPU pool).
        guard: which hits to verify by recomputing them (``engine.shadow``); none if ``None``.
        record_check: the check of every restored record against its tokens
            (``cachetier.store.record_guard``); ``None`` for none.
    """

    def __init__(
        self,
        store: TieredStore,
        namespace: Namespace,
        pool: KVPool,
        copy_rate: CopyRate | None = None,
        guard: GuardSampler | None = None,
        record_check: RecordCheck | None = None,
    ) -> None:
        if record_layout(pool.layout, namespace.block_size) != namespace.layout:
            raise ValueError(f"namespace layout {namespace.layout} is not the pool's {pool.layout}")
        self.records_per_block = records_per_block(pool.layout.block_size, namespace.block_size)
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
        self.shadow = (
            ShadowVerifier(store, namespace.id, guard, namespace.describe())
            if guard is not None and guard.config.enabled
            else None
        )
        # Every restored record passes this before it is used: by writer, and by its tokens.
        self.record_guard = RecordGuard(
            store, record_check, self.shadow.sampler if self.shadow else None, namespace.describe()
        )
        # The namespace's parts, for telling a miss of tokens held under another namespace.
        self.descriptor = NamespaceDescriptor.from_namespace(namespace)

    def save(
        self,
        blocks: Sequence[Block],
        num_prompt_tokens: int | None = None,
        token_ids: Sequence[int] | None = None,
    ) -> None:
        """Hand full, computed blocks not yet stored to the store (lower tiers write later).

        Args:
            blocks: the blocks, a sequence's in its order where ``num_prompt_tokens`` is given.
            num_prompt_tokens: the sequence's prompt length: blocks past it hold generated
                tokens, which admission may treat apart; ``None`` (evicted blocks of no one
                sequence): all prompt.
            token_ids: the sequence's tokens, where ``blocks`` are a sequence's from its start:
                noted by token so that another namespace's miss of them is told
                (``NamespaceWatch``).
        """
        if token_ids is not None:
            keyed = next((i for i, b in enumerate(blocks) if b.key is None), len(blocks))
            full = keyed * self.pool.layout.block_size
            self.store.namespaces.stored(self.descriptor, token_ids[:full])
        size = self.pool.layout.block_size
        todo, generated = [], []
        for index, b in enumerate(blocks):
            if b.key is not None and not b.stored:
                todo.append(b)
                past = num_prompt_tokens is not None and (index + 1) * size > num_prompt_tokens
                generated += [past] * self.records_per_block
        if not todo:
            return
        start = time.perf_counter()
        block_ids = [b.block_id for b in todo]
        buffers = self.pool.read_blocks(block_ids)
        auxes = self.pool.read_aux(block_ids)  # an fp8 block's scales, b"" otherwise
        records = [
            record
            for b, buf, aux in zip(todo, buffers, auxes)
            for record in self._records_of(b, buf, aux)
        ]
        if self.shadow is not None:
            self.shadow.check(records)
        self.store.put_many(self.namespace.id, records, generated=generated)
        for b in todo:
            b.stored = True
        self.stats.saved_blocks += len(todo)
        self.stats.save_s += time.perf_counter() - start

    def _records_of(self, block: Block, buf: memoryview, aux: bytes) -> list[KVBlock]:
        """The records one pool block is stored as: itself, or ``n`` records cut from it."""
        layout = self.namespace.layout
        assert block.key is not None, "only full, keyed blocks are saved"
        n = self.records_per_block
        if n == 1:
            pieces: list[object] = [buf]
            keys: tuple[BlockHash, ...] = (block.key,)
        else:
            assert len(block.record_keys) == n, f"block {block.block_id} has no record keys"
            dtype = torch_dtype(layout.dtype)
            payload = payload_tensor(buf, dtype, self.pool.block_shape)
            pieces = [payload_view(p) for p in split_block(payload, n)]
            keys = block.record_keys
        return [
            KVBlock(
                key,
                self.namespace.fingerprint,
                layout.dtype,
                layout.payload_shape,
                layout.block_size,
                piece,
                aux,
            )
            for key, piece in zip(keys, pieces, strict=True)
        ]

    def lookup(
        self,
        keys: Sequence[BlockHash],
        *,
        may_verify: bool = True,
        token_ids: Sequence[int] | None = None,
        first_record: int = 0,
        sequence_tokens: Sequence[int] | None = None,
        sequence_keys: Sequence[BlockHash] | None = None,
    ) -> PrefixHit:
        """Which leading pool blocks the store holds, and in which tier (no data is read).

        Args:
            keys: the record keys of those blocks, ``records_per_block`` per block.
            may_verify: whether the guard may draw this hit (a request is drawn once, at its
                first hit: a queued request is looked up again at each step it waits).
            token_ids: the sequence's tokens: with them a miss of tokens held under another
                namespace says ``namespace_mismatch`` and what differs.
            first_record: the index in the sequence of ``keys[0]``'s record.
            sequence_tokens, sequence_keys: the sequence's tokens and record keys
                (``WindowedTierBridge`` keys its layer sets by them).

        Returns:
            The hit in whole pool blocks (a block counts where every record of it is held),
            each block in the tier of its first record; no hit when the guard drew it for
            verification (the request computes it, and its saves are compared).
        """
        hit = self.store.lookup(self.namespace.id, keys)
        if token_ids is not None:
            mismatch = self.store.namespaces.explain(
                self.descriptor,
                token_ids,
                first_record + hit.num_blocks,
                len(keys) - hit.num_blocks,
                hit.miss_cause,
            )
            if mismatch is not None:
                hit = replace(hit, miss_cause=mismatch.cause, miss_detail=mismatch.detail)
        shadow = self.shadow if may_verify else None
        if hit.num_blocks and shadow is not None and shadow.take(hit, keys):
            verified = hit.num_blocks // self.records_per_block
            return PrefixHit(0, (), hit.tier_names, verified_blocks=verified)
        return _in_blocks(hit, self.records_per_block)

    def restore(
        self,
        keys: Sequence[BlockHash],
        block_ids: Sequence[int],
        hit: PrefixHit | None = None,
        token_ids: Sequence[int] | None = None,
        first_position: int = 0,
        sequence_tokens: Sequence[int] | None = None,
        sequence_keys: Sequence[BlockHash] | None = None,
    ) -> Restored:
        """Read the blocks of ``keys`` and copy them into ``block_ids`` of the pool.

        Every block is checked before use: its key and namespace fingerprint (by the store),
        its writer and its first layer against ``token_ids`` (``record_guard``), its dtype,
        shape, size, scale count and token count (here). The first block that fails ends the
        run.

        Args:
            keys: the record keys of the blocks to restore, in sequence order,
                ``records_per_block`` per block.
            block_ids: pool blocks to put them in.
            hit: the ``lookup`` just made for (at least) these keys, so it is not made twice
                (blocks of one record only: a lookup in blocks no longer says where each
                record lies).
            token_ids: the tokens of these blocks, in order (``None``: no record check).
            first_position: the position in the sequence of their first token.
            sequence_tokens, sequence_keys: as ``lookup``'s.

        Returns:
            The source tier of each restored block (a prefix of ``keys``) and the time taken.
        """
        start = time.perf_counter()
        if self.records_per_block == 1:
            dests = self.pool.block_views(block_ids[: len(keys)])
            restored = self.store.restore_prefix(
                self.namespace.id,
                keys,
                fingerprint=self.namespace.fingerprint,
                dests=dests,
                hit=hit,
            )
            # Read in place (each payload the very view it was asked into): the check reads
            # the records' first layer from the pool in one gather.
            in_place = dests is not None and all(
                b.data is d for b, d in zip(restored.blocks, dests, strict=False)
            )
            layer0 = self._pool_layer0(block_ids) if in_place else None
            restored, cut = self._admitted(keys, restored, token_ids, first_position, layer0)
        else:
            restored = self.store.restore_prefix(
                self.namespace.id, keys, fingerprint=self.namespace.fingerprint
            )
            restored, cut = self._admitted(keys, restored, token_ids, first_position)
            restored = self._joined(restored)
        with self._lock:
            return replace(self._put_in_place(restored, block_ids, start), guard_cut=cut)

    def _admitted(
        self,
        keys: Sequence[BlockHash],
        restored: RestoredPrefix,
        token_ids: Sequence[int] | None,
        first_position: int,
        layer0: Layer0 | None = None,
    ) -> tuple[RestoredPrefix, str | None]:
        """The leading records of ``restored`` the record guard lets through, and why it
        stopped if it did; where it stops at a writer to verify, the records from there wait
        for their computed blocks."""
        if not restored.blocks:
            return restored, None
        admitted = self.record_guard.admit(
            self.namespace.id, restored.blocks, restored.sources, token_ids, first_position, layer0
        )
        count = admitted.count
        if count == len(restored.blocks):
            return restored, None
        if admitted.verify and self.shadow is not None:
            end = len(restored.blocks)
            self.shadow.expect(keys[count:end], restored.sources[count:end])
        cut = RestoredPrefix(restored.blocks[:count], restored.sources[:count])
        return cut, admitted.cause

    def _pool_layer0(self, block_ids: Sequence[int]) -> Layer0 | None:
        """The first layer of restored records already in pool blocks ``block_ids``, gathered
        in one index (a float pool on the CPU; ``None`` elsewhere)."""
        cache = self.pool.cache
        if cache.device.type != "cpu" or self.pool.scales is not None:
            return None

        layers, block_tokens = cache.shape[1], cache.shape[3]
        rows = cache.view(-1, cache.shape[-2] * cache.shape[-1])  # a row per layer, plane, token

        def gather(offsets: np.ndarray, count: int) -> np.ndarray:
            # One index_select of the rows wanted: layer 0's K and V at ``offsets`` of each
            # block, in [plane, block, offset] order (advanced indexing costs several times it).
            planes = torch.arange(2, dtype=torch.int64)[:, None, None] * block_tokens
            blocks = torch.as_tensor(list(block_ids[:count]), dtype=torch.int64)
            first = (blocks * (layers * 2 * block_tokens))[None, :, None]
            index = first + planes + torch.as_tensor(offsets, dtype=torch.int64)[None, None, :]
            got = rows.index_select(0, index.view(-1))
            return got.view(2, count * len(offsets), -1).float().numpy()

        return gather

    def restore_in_background(
        self,
        keys: Sequence[BlockHash],
        block_ids: Sequence[int],
        hit: PrefixHit | None = None,
        token_ids: Sequence[int] | None = None,
        first_position: int = 0,
    ) -> Future[Restored]:
        """``restore`` on the bridge's own thread, for blocks the engine will not read until
        the future is done (a tail read while the head before it is recomputed). Restores
        submitted here run one at a time, in order.

        The caller must wait for the future before it frees or reuses ``block_ids``.
        """
        if self._background is None:
            self._background = ThreadPoolExecutor(1, thread_name_prefix="cachetier-restore")
        tokens = None if token_ids is None else list(token_ids)
        return self._background.submit(
            self._restore_on_pool_device, list(keys), list(block_ids), hit, tokens, first_position
        )

    def _restore_on_pool_device(
        self,
        keys: list[BlockHash],
        block_ids: list[int],
        hit: PrefixHit | None,
        token_ids: list[int] | None,
        first_position: int,
    ) -> Restored:
        # A new thread's current CUDA device is device 0: the pool's copies and the events
        # that free its staging buffers must go to the pool's own device.
        device = self.pool.cache.device
        if device.type != "cuda":
            return self.restore(keys, block_ids, hit, token_ids, first_position)
        with torch.cuda.device(device):
            return self.restore(keys, block_ids, hit, token_ids, first_position)

    def close(self) -> None:
        """Wait for background restores still running and stop their thread; idempotent (a
        later ``restore_in_background`` starts a new one)."""
        background, self._background = self._background, None
        if background is not None:
            background.shutdown(wait=True)

    def _joined(self, restored: RestoredPrefix) -> RestoredPrefix:
        """Whole pool blocks joined from restored records, up to the first block with a
        record that is not of this namespace's layout or whose side data differs from its
        block's other records (an fp8 block has one set of scales)."""
        layout, n = self.namespace.layout, self.records_per_block
        dtype = torch_dtype(layout.dtype)
        blocks: list[KVBlock] = []
        sources: list[str] = []
        for b in range(len(restored.blocks) // n):
            group = restored.blocks[b * n : (b + 1) * n]
            if any(
                r.num_tokens != layout.block_size
                or r.dtype != layout.dtype
                or tuple(r.shape) != layout.payload_shape
                or memoryview(r.data).nbytes != layout.block_bytes
                or bytes(r.aux) != bytes(group[0].aux)
                for r in group
            ):
                self.stats.rejected_blocks += 1
                log.warning("restored records of block %s do not match", group[-1].key.hex()[:12])
                break
            payload = join_records(
                [payload_tensor(r.data, dtype, layout.payload_shape) for r in group]
            )
            blocks.append(
                KVBlock(
                    group[-1].key,
                    self.namespace.fingerprint,
                    layout.dtype,
                    self.pool.block_shape,
                    self.pool.layout.block_size,
                    payload_view(payload),
                    group[0].aux,
                )
            )
            sources.append(restored.sources[b * n])
        return RestoredPrefix(tuple(blocks), tuple(sources))

    def _put_in_place(
        self, restored: RestoredPrefix, block_ids: Sequence[int], start: float
    ) -> Restored:
        """Check the blocks a restore read and copy those not read in place into the pool."""
        good: list[KVBlock] = []
        for block in restored.blocks:
            nbytes = memoryview(block.data).nbytes
            if block.num_tokens != self.pool.layout.block_size or not self.pool.payload_matches(
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


def _in_blocks(hit: PrefixHit, per_block: int) -> PrefixHit:
    """A lookup in records as one in blocks of ``per_block`` records: whole blocks only, each
    in the tier of its first record."""
    if per_block == 1:
        return hit
    num_blocks = hit.num_blocks // per_block
    lost = hit.quarantined_blocks // per_block
    tiers = [0] * hit.num_blocks
    for tier, start, end in hit.spans:
        tiers[start:end] = [tier] * (end - start)
    spans: list[tuple[int, int, int]] = []
    for b in range(num_blocks):
        tier = tiers[b * per_block]
        if spans and spans[-1][0] == tier:
            spans[-1] = (tier, spans[-1][1], b + 1)
        else:
            spans.append((tier, b, b + 1))
    return replace(hit, num_blocks=num_blocks, spans=tuple(spans), quarantined_blocks=lost)
