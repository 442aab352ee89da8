"""The tier bridge of a model with sliding-window layers: each layer set in records of its own,
and a window's layers stored and restored as far as a hit needs them
(``cachetier.primitives.layer_sets``).

A hit ends only where every set holds what it needs: a full-attention set every block, a
window's set the blocks from the window before the hit's end. A restored block before that
window holds its full-attention layers only (zeros in the window's, which no query reads); it
is not indexed in the pool's prefix cache, so no shorter prefix is ever served from it.

Taken where a pool block is one record and holds no scales (not fp8); otherwise the engine
stores whole blocks with ``TierBridge``.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence

import torch

from cachetier.engine.block_manager import Block
from cachetier.engine.kv_cache import KVPool
from cachetier.engine.shadow import ShadowVerifier
from cachetier.engine.tier_bridge import Restored, TierBridge
from cachetier.guard import GuardSampler
from cachetier.guard.record_check import RecordCheck
from cachetier.kernels.staging import payload_tensor, payload_view
from cachetier.primitives.keys import BlockHash, Namespace, block_keys, torch_dtype
from cachetier.primitives.layer_sets import LayerSet, restorable_end, window_needs
from cachetier.record import KVBlock
from cachetier.store.costmodel import CopyRate
from cachetier.store.tiered import TieredStore
from cachetier.tiers.prefix import PrefixHit, RestoredPrefix

MAX_KNOWN_KEYS = 1 << 16  # block key -> its layer sets' keys, for blocks saved on eviction


def windowed_supported(pool: KVPool, records_per_block: int) -> bool:
    """Whether ``WindowedTierBridge`` can store this pool's blocks (module docstring)."""
    return records_per_block == 1 and pool.scales is None


class WindowedTierBridge(TierBridge):
    """``TierBridge`` for layer sets with a window (module docstring).

    Args:
        store, namespace, pool, copy_rate, guard, record_check: as ``TierBridge``'s;
            ``namespace`` is that of a record of every layer, whose keys the engine computes.
        sets: the model's layer sets, at least one with a window (``layer_sets``).
        window_block_tokens: the block size a window's saved records start on
            (``EngineConfig.window_block_tokens``); ``None``: the pool's.
    """

    def __init__(
        self,
        store: TieredStore,
        namespace: Namespace,
        pool: KVPool,
        sets: Sequence[LayerSet],
        copy_rate: CopyRate | None = None,
        guard: GuardSampler | None = None,
        record_check: RecordCheck | None = None,
        window_block_tokens: int | None = None,
    ) -> None:
        super().__init__(store, namespace, pool, copy_rate, guard, record_check)
        self.window_block_tokens = window_block_tokens
        if not windowed_supported(pool, self.records_per_block):
            raise ValueError("windowed records need blocks of one record without scales")
        if not any(s.window is not None for s in sets):
            raise ValueError("no layer set has a window: TierBridge stores these blocks")
        self.sets = tuple(sets)
        sampler = self.shadow.sampler if self.shadow is not None else None
        self.shadows = [
            ShadowVerifier(store, s.namespace.id, sampler, s.namespace.describe())
            if sampler is not None
            else None
            for s in self.sets
        ]
        self.shadow = self.shadows[0]  # the engine's guard figures: the first set's
        self._layer_index = [torch.as_tensor(s.layers, dtype=torch.int64) for s in self.sets]
        self._known: OrderedDict[BlockHash, tuple[BlockHash, ...]] = OrderedDict()

    # Keys -----------------------------------------------------------------------------------

    def _set_keys(
        self,
        tokens: Sequence[int] | None,
        num_blocks: int,
        base: Sequence[BlockHash] | None = None,
    ) -> list[list[BlockHash]] | None:
        """Each set's keys of the first ``num_blocks`` blocks of ``tokens`` (the sequence's);
        ``None`` without tokens. ``base``: the sequence's keys under ``namespace``, where the
        caller has them. Keys made once are kept by block key (a waiting sequence is looked
        up at every step; saves on eviction have no tokens), so only new blocks are hashed."""
        if tokens is None:
            return None
        bs = self.pool.layout.block_size
        num_blocks = min(num_blocks, len(tokens) // bs)  # full blocks only have keys
        if base is None or len(base) < num_blocks:
            base = block_keys(self.namespace, list(tokens[: num_blocks * bs]))
        base = list(base[:num_blocks])
        known = 0
        while known < num_blocks and base[known] in self._known:
            known += 1
        rest = list(tokens[known * bs : num_blocks * bs])
        out = []
        for index, layer_set in enumerate(self.sets):
            if layer_set.namespace == self.namespace:
                out.append(base)
                continue
            keys = [self._known[key][index] for key in base[:known]]
            keys += block_keys(layer_set.namespace, rest, parent=keys[-1] if keys else None)
            out.append(keys)
        for i in range(known, num_blocks):
            self._known[base[i]] = tuple(keys[i] for keys in out)
        while len(self._known) > MAX_KNOWN_KEYS:
            self._known.popitem(last=False)
        return out

    # Save -----------------------------------------------------------------------------------

    def save(
        self,
        blocks: Sequence[Block],
        num_prompt_tokens: int | None = None,
        token_ids: Sequence[int] | None = None,
    ) -> None:
        """``TierBridge.save``, each set in records of its own: a window's set from the first
        block the prompt's hit needs on, and not at all for blocks of no one sequence (their
        place in a prompt is unknown)."""
        bs = self.pool.layout.block_size
        if token_ids is not None:
            keyed = next((i for i, b in enumerate(blocks) if b.key is None), len(blocks))
            self.store.namespaces.stored(self.descriptor, token_ids[: keyed * bs])
        todo = [(i, b) for i, b in enumerate(blocks) if b.key is not None and not b.stored]
        if not todo:
            return
        start = time.perf_counter()
        set_keys = self._set_keys(token_ids, len(blocks))
        payloads = self._payloads([b.block_id for _, b in todo])
        for s_index, layer_set in enumerate(self.sets):
            if num_prompt_tokens is None or set_keys is None:
                if layer_set.window is not None:
                    continue
                first, prompt = 0, None
            else:
                prompt = num_prompt_tokens
                first = layer_set.first_saved_block(prompt, bs, self.window_block_tokens)
            records, generated = [], []
            for (index, block), payload in zip(todo, payloads, strict=True):
                key = self._key_of(s_index, index, block, set_keys)
                if index < first or key is None:
                    continue
                records.append(self._record(s_index, key, payload))
                generated.append(prompt is not None and (index + 1) * bs > prompt)
            if not records:
                continue
            shadow = self.shadows[s_index]
            if shadow is not None:
                shadow.check(records)
            self.store.put_many(layer_set.namespace.id, records, generated=generated)
        for _, block in todo:
            block.stored = True
        self.stats.saved_blocks += len(todo)
        self.stats.save_s += time.perf_counter() - start

    def _key_of(
        self, s_index: int, index: int, block: Block, set_keys: list[list[BlockHash]] | None
    ) -> BlockHash | None:
        if set_keys is not None and index < len(set_keys[s_index]):
            return set_keys[s_index][index]
        assert block.key is not None, "only keyed blocks are saved"
        known = self._known.get(block.key)
        return known[s_index] if known is not None else None

    def _payloads(self, block_ids: list[int]) -> list[torch.Tensor]:
        dtype = torch_dtype(self.namespace.layout.dtype)
        return [
            payload_tensor(buf, dtype, self.pool.block_shape)
            for buf in self.pool.read_blocks(block_ids)
        ]

    def _record(self, s_index: int, key: BlockHash, payload: torch.Tensor) -> KVBlock:
        layer_set = self.sets[s_index]
        layout = layer_set.namespace.layout
        if layer_set.namespace.layers:
            payload = payload.index_select(0, self._layer_index[s_index]).contiguous()
        return KVBlock(
            key,
            layer_set.namespace.fingerprint,
            layout.dtype,
            layout.payload_shape,
            layout.block_size,
            payload_view(payload),
            b"",
        )

    # Lookup ---------------------------------------------------------------------------------

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
        """``TierBridge.lookup``, where every set holds what a hit needs (module docstring);
        ``sequence_tokens`` (the sequence's, from its start) make the sets' keys: without
        them there is no hit."""
        first, last = first_record, first_record + len(keys)
        set_keys = self._set_keys(sequence_tokens, last, sequence_keys)
        names = tuple(t.name for t in self.store.tiers)
        if set_keys is None or not keys:
            return PrefixHit(0, (), names)
        full_hit: PrefixHit | None = None
        full_end = last
        for s_index, layer_set in enumerate(self.sets):
            if layer_set.window is None:
                found = self.store.lookup(layer_set.namespace.id, set_keys[s_index][first:last])
                full_hit = found if full_hit is None else full_hit
                full_end = min(full_end, first + found.num_blocks)
        end, window_hit = self._window_end(set_keys, first, full_end)
        cause = full_hit if full_hit is not None and end == full_end else window_hit
        hit = PrefixHit(
            end - first,
            _spans(full_hit if full_hit is not None else window_hit, end - first),
            names,
            miss_cause=cause.miss_cause if cause is not None and end < last else "",
            miss_tier=cause.miss_tier if cause is not None and end < last else "",
        )
        if token_ids is not None:
            mismatch = self.store.namespaces.explain(
                self.descriptor, token_ids, end, last - end, hit.miss_cause
            )
            if mismatch is not None:
                hit = PrefixHit(
                    hit.num_blocks, hit.spans, names, miss_cause=mismatch.cause,
                    miss_detail=mismatch.detail,
                )
        if hit.num_blocks and may_verify and self._draw(hit, set_keys, first, end):
            return PrefixHit(0, (), names, verified_blocks=hit.num_blocks)
        return hit

    def _window_end(
        self, set_keys: list[list[BlockHash]], first: int, full_end: int
    ) -> tuple[int, PrefixHit | None]:
        """Where a hit after ``first`` can end, at most ``full_end``, every window's set
        holding what it needs (``layer_sets.restorable_end``); also the last window lookup."""
        bs = self.pool.layout.block_size
        found: list[PrefixHit] = []

        def holds(index: int, start: int, end: int) -> bool:
            namespace = self.sets[index].namespace
            found.append(self.store.lookup(namespace.id, set_keys[index][start:end]))
            return found[-1].num_blocks >= end - start

        end = restorable_end(window_needs(self.sets, bs), first, full_end, holds)
        return end, found[-1] if found else None

    def _draw(
        self, hit: PrefixHit, set_keys: list[list[BlockHash]], first: int, end: int
    ) -> bool:
        """Whether the guard draws the hit: then every set's records of it are compared with
        the computed ones as they are saved."""
        shadow = self.shadows[0]
        if shadow is None or not shadow.take(hit, set_keys[0][first:end]):
            return False
        bs = self.pool.layout.block_size
        tier = hit.tier_names[hit.spans[-1][0]]
        for s_index, layer_set in enumerate(self.sets[1:], start=1):
            other = self.shadows[s_index]
            start = max(first, layer_set.first_needed_block(end * bs, bs))
            if other is not None:
                other.expect(set_keys[s_index][start:end], [tier] * (end - start))
        return True


    # Restore --------------------------------------------------------------------------------

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
        """``TierBridge.restore`` of every set's records of the blocks of ``keys``, joined
        into pool blocks; ``partial_blocks`` of the result are those before a window's
        blocks (module docstring). Without ``sequence_tokens`` nothing is restored."""
        start_s = time.perf_counter()
        bs = self.pool.layout.block_size
        first, last = first_position // bs, first_position // bs + len(keys)
        set_keys = self._set_keys(sequence_tokens, last, sequence_keys)
        if set_keys is None or not keys:
            return Restored([], 0.0, 0.0)
        got = [
            self._read_set(s_index, set_keys[s_index], first, last, token_ids)
            for s_index in range(len(self.sets))
        ]
        end = self._restorable_end(first, last, got)
        blocks, sources = self._joined_blocks(keys, first, end, got)
        window_start = max(s_start for s_start, _, _ in got)
        with self._lock:
            done = self._put_in_place(RestoredPrefix(blocks, sources), block_ids, start_s)
        cut = next((c for _, r, c in got if c is not None), None) if end < last else None
        partial = min(max(0, window_start - first), len(done.sources))
        return Restored(done.sources, done.read_s, done.copy_s, cut, partial)

    def _read_set(
        self,
        s_index: int,
        keys: list[BlockHash],
        first: int,
        last: int,
        token_ids: Sequence[int] | None,
    ) -> tuple[int, RestoredPrefix, str | None]:
        """One set's records of blocks ``[first, last)`` (a window's from the first block the
        hit's end needs), as far as the record guard and the layout let them through: their
        first block, the records, and why they stop short if they do."""
        layer_set = self.sets[s_index]
        bs = self.pool.layout.block_size
        start = max(first, layer_set.first_needed_block(last * bs, bs))
        ns = layer_set.namespace
        read = self.store.restore_prefix(ns.id, keys[start:last], fingerprint=ns.fingerprint)
        # The per-record check recomputes the model's first layer: the set that holds it.
        tokens = None
        if token_ids is not None and layer_set.layers[0] == 0:
            tokens = token_ids[(start - first) * bs : (last - first) * bs]
        admitted = self.record_guard.admit(ns.id, read.blocks, read.sources, tokens, start * bs)
        count = admitted.count
        shadow = self.shadows[s_index]
        if admitted.verify and shadow is not None:
            shadow.expect(keys[start + count : start + len(read.blocks)], read.sources[count:])
        layout = ns.layout
        for i, record in enumerate(read.blocks[:count]):
            if (
                record.num_tokens != bs
                or record.dtype != layout.dtype
                or tuple(record.shape) != layout.payload_shape
                or memoryview(record.data).nbytes != layout.block_bytes
                or len(record.aux)
            ):
                self.stats.rejected_blocks += 1
                count = i
                break
        kept = RestoredPrefix(read.blocks[:count], read.sources[:count])
        return start, kept, admitted.cause

    def _restorable_end(
        self, first: int, last: int, got: list[tuple[int, RestoredPrefix, str | None]]
    ) -> int:
        """The last block (exclusive) every set's records reach, each from where the end
        needs it; ``first`` where none does."""
        bs = self.pool.layout.block_size
        for end in range(last, first, -1):
            if all(
                start <= max(first, layer_set.first_needed_block(end * bs, bs))
                and start + len(read.blocks) >= end
                for layer_set, (start, read, _) in zip(self.sets, got, strict=True)
            ):
                return end
        return first

    def _joined_blocks(
        self,
        keys: Sequence[BlockHash],
        first: int,
        end: int,
        got: list[tuple[int, RestoredPrefix, str | None]],
    ) -> tuple[tuple[KVBlock, ...], tuple[str, ...]]:
        """Pool blocks ``[first, end)`` joined from the sets' records; zeros where a window's
        set has none (before its window)."""
        layout = self.namespace.layout
        dtype = torch_dtype(layout.dtype)
        blocks, sources = [], []
        # A block before every window's records is counted as read from the window's tier.
        window_source = next((r.sources[0] for _, r, _ in got if r.sources), "")
        for b in range(first, end):
            payload = torch.zeros(self.pool.block_shape, dtype=dtype)
            source = ""
            for s_index, (start, read, _) in enumerate(got):
                if b < start:
                    continue
                record = read.blocks[b - start]
                shape = self.sets[s_index].namespace.layout.payload_shape
                data = payload_tensor(record.data, dtype, shape)
                payload.index_copy_(0, self._layer_index[s_index], data)
                source = source or read.sources[b - start]
            blocks.append(
                KVBlock(
                    keys[b - first],
                    self.namespace.fingerprint,
                    layout.dtype,
                    self.pool.block_shape,
                    layout.block_size,
                    payload_view(payload),
                    b"",
                )
            )
            sources.append(source or window_source)
        return tuple(blocks), tuple(sources)


def _spans(hit: PrefixHit | None, num_blocks: int) -> tuple[tuple[int, int, int], ...]:
    """``hit``'s spans cut to ``num_blocks``; a window set's hit (which starts inside the
    range) stands for all of it, in the tier of its last block."""
    if hit is None or num_blocks == 0 or not hit.spans:
        return ()
    if hit.num_blocks < num_blocks:
        return ((hit.spans[-1][0], 0, num_blocks),)
    out = []
    for tier, start, end in hit.spans:
        if start >= num_blocks:
            break
        out.append((tier, start, min(end, num_blocks)))
    return tuple(out)
