"""The tiers' part of a sequence's cached prefix: the hit after the pool's blocks, the plan of
what to load of it, and the reads that load it.

A read runs at admission, or, for a tail behind hit blocks the plan recomputes, on the bridge's
thread while that head is computed. The loaded blocks sit at ``Sequence.skip``: once the head
is computed the sequence jumps over them. Blocks a dropped sequence's read still writes into
are freed once that read ends.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, wait
from dataclasses import dataclass, field

from cachetier.engine.block_manager import BlockManager
from cachetier.engine.config import EngineConfig
from cachetier.engine.sequence import PendingRestore, Sequence
from cachetier.engine.tier_bridge import Restored, TierBridge
from cachetier.primitives.keys import BlockHash
from cachetier.store.costmodel import CostModel, LoadPlan
from cachetier.tiers.prefix import PrefixHit


@dataclass(frozen=True, slots=True)
class PrefixLookup:
    """A waiting sequence's cached prefix, as its admission found it.

    Args:
        keys: the keys of its full blocks a lookup may use.
        pool_ids: the pool's blocks of the leading ``keys``.
        hit: the tiers' hit on the blocks after them; ``None`` without tiers.
        plan: what to load of ``hit``; ``None`` without tiers.
    """

    keys: list[BlockHash]
    pool_ids: list[int]
    hit: PrefixHit | None = None
    plan: LoadPlan | None = None

    @property
    def load_start(self) -> int:
        """The first hit block loaded (those before it are recomputed); 0 if none is."""
        plan = self.plan
        return plan.load_start if plan is not None and plan.num_load_blocks else 0

    @property
    def load_end(self) -> int:
        """The end of the loaded hit blocks; 0 if none is."""
        plan = self.plan
        return plan.load_end if plan is not None and plan.num_load_blocks else 0


@dataclass(frozen=True, slots=True)
class TierRead:
    """What admission did of a load: the source tier of each block read now, the seconds the
    read took, and whether a read still runs in the background instead."""

    sources: list[str] = field(default_factory=list)
    restore_s: float = 0.0
    pending: bool = False


class TierLoads:
    """Looks a sequence's prefix up in the tiers and loads the planned blocks into the pool.

    Args:
        config: the engine's (block size, step budget).
        blocks: the pool's blocks; loaded ones are indexed in its prefix cache.
        bridge: the tiers; ``None`` for an engine without them (nothing is looked up or read).
        records_per_block: records of ``Sequence.record_keys`` per pool block.
    """

    def __init__(
        self,
        config: EngineConfig,
        blocks: BlockManager,
        bridge: TierBridge | None,
        records_per_block: int,
    ) -> None:
        self.config = config
        self.block_size = config.block_size
        self.blocks = blocks
        self.bridge = bridge
        self.records_per_block = records_per_block
        # Blocks of dropped sequences that a tail read still writes into: freed once it ends.
        self._held_for_reads: list[tuple[Future[Restored], list[int]]] = []
        # Tiers whose reads of a loaded tail run beside the head's recompute: on a CPU only
        # those that wait on a network (a read from memory or the page cache takes the same
        # cores as the forward: both at once took longer than one after the other in
        # benchmarks/overlap.py), on a GPU every tier (the reads are the host's work, the
        # forward the device's). The plan counts such a read as hidden behind the head only
        # where it is slower than computing the same tokens (``CostModel.plan``). A small
        # model's GPU forward is host work too (launches from Python), so it gains less.
        on_cpu = bridge is None or bridge.pool.cache.device.type == "cpu"
        tiers = bridge.store.tiers if bridge is not None else ()
        self.background_tiers = frozenset(t.name for t in tiers if t.over_network or not on_cpu)

    def records(self, seq: Sequence, start: int, end: int) -> list[BlockHash]:
        """The record keys of pool blocks ``[start, end)`` of the sequence."""
        n = self.records_per_block
        return seq.record_keys[start * n : end * n]

    def _register(self, seq: Sequence, index: int, block_id: int, key: BlockHash) -> None:
        """Index a restored block in the prefix cache, with what its KV events tell."""
        bs = self.block_size
        self.blocks.register(
            block_id,
            key,
            stored=True,
            record_keys=self.block_records(seq, index),
            parent=seq.block_keys[index - 1] if index else None,
            token_ids=seq.block_token_ids(index, bs),
        )

    def block_records(self, seq: Sequence, index: int) -> tuple[BlockHash, ...]:
        """What ``BlockManager.register`` keeps of block ``index``'s records: nothing where
        the block is one record (its key names it)."""
        if self.records_per_block == 1:
            return ()
        return tuple(self.records(seq, index, index + 1))

    def look_up(
        self, seq: Sequence, keys: list[BlockHash], pool_ids: list[int], cost: CostModel | None
    ) -> PrefixLookup:
        """The tiers' hit on ``keys`` after the pool's ``pool_ids`` and the plan of what to
        load of it (by ``cost``; all of it without one)."""
        if self.bridge is None:
            return PrefixLookup(keys, pool_ids)
        # A waiting sequence is looked up again at each step: its miss is told (and counted by
        # the mismatch alarm) once, at its first lookup.
        first = not seq.looked_up
        seq.looked_up = True
        hit = self.bridge.lookup(
            self.records(seq, len(pool_ids), len(keys)),
            may_verify=seq.guard_draw is None,
            token_ids=seq.token_ids if first else None,
            first_record=len(pool_ids) * self.records_per_block,
            sequence_tokens=seq.token_ids,
            sequence_keys=seq.record_keys,
        )
        if seq.guard_draw is None and (hit.num_blocks or hit.verified_blocks):
            seq.guard_draw = bool(hit.verified_blocks)  # decided once, at its first hit
        elif seq.guard_draw and hit.num_blocks:  # drawn: computed however often it is asked
            hit = PrefixHit(0, (), hit.tier_names, verified_blocks=hit.num_blocks)
        plan = self._plan(seq, hit, len(pool_ids) * self.block_size, cost)
        seq.num_stored_blocks = len(pool_ids) + hit.num_blocks
        seq.num_verified_tokens = hit.verified_blocks * self.block_size
        seq.num_quarantined_tokens = hit.quarantined_blocks * self.block_size
        told = seq.miss_cause == "namespace_mismatch" and hit.miss_cause == "never_stored"
        if not told:  # a mismatch told at the first lookup stands for the same tokens
            seq.miss_cause, seq.miss_tier, seq.miss_detail = (
                hit.miss_cause,
                hit.miss_tier,
                hit.miss_detail,
            )
        return PrefixLookup(keys, pool_ids, hit, plan)

    def _plan(
        self, seq: Sequence, hit: PrefixHit, pool_tokens: int, cost: CostModel | None
    ) -> LoadPlan:
        """Load or recompute the tier hit: without a cost model, load all of it."""
        if cost is None or self.bridge is None:
            return LoadPlan.load_all(hit.num_blocks, "disabled")
        spans = [(hit.tier_names[tier], end - begin) for tier, begin, end in hit.spans]
        pool = self.bridge.pool
        return cost.plan(
            spans,
            block_bytes=pool.block_bytes + pool.aux_bytes,
            block_size=self.block_size,
            cached_tokens=pool_tokens,
            num_tokens=seq.num_tokens,
            chunk_tokens=self.config.max_num_batched_tokens,
            overlap_tiers=self.background_tiers,
            request_id=seq.request_id,
        )

    def load(self, seq: Sequence, found: PrefixLookup, new_ids: list[int], first: bool) -> TierRead:
        """Load the planned hit blocks into ``new_ids`` (the blocks after ``found.pool_ids``)
        and set what the sequence has computed: the pool's blocks, and the loaded ones where
        nothing before them is recomputed; else they are its ``skip``.

        Args:
            first: whether this is the request's first admission (its timings count).
        """
        read = self._read(seq, found, new_ids, first)
        bs, num_pool = self.block_size, len(found.pool_ids)
        if found.load_start:
            seq.num_computed_tokens = num_pool * bs
            # While a read is pending the whole tail is expected; ``finish`` cuts the jump
            # short if fewer blocks arrive.
            arrived = found.load_end - found.load_start if read.pending else len(read.sources)
            if arrived:
                begin = (num_pool + found.load_start) * bs
                seq.skip = (begin, begin + arrived * bs)
        else:
            seq.num_computed_tokens = (num_pool + len(read.sources)) * bs
        return read

    def _read(
        self, seq: Sequence, found: PrefixLookup, new_ids: list[int], first: bool
    ) -> TierRead:
        """Read the loaded hit blocks now, or start a background read of them where hit blocks
        before them are recomputed first and every tier they are in is a background one."""
        load_start, load_end = found.load_start, found.load_end
        if load_end <= load_start or self.bridge is None:
            return TierRead()
        begin, end = len(found.pool_ids) + load_start, len(found.pool_ids) + load_end
        tier_keys = found.keys[begin:end]
        tier_ids = new_ids[load_start:load_end]
        if not load_start or not self._reads_in_background(found.hit, load_start):
            sources, restore_s = self._restore_now(
                seq, tier_keys, tier_ids, found.hit, begin, first
            )
            return TierRead(sources, restore_s)
        # The head is recomputed first: the tail is read meanwhile, on the bridge's thread,
        # into blocks nothing reads before the head is done (``skip``).
        records = self.records(seq, begin, end)
        bs = self.block_size
        tokens = seq.token_ids[begin * bs : end * bs]
        seq.pending_restore = PendingRestore(
            self.bridge.restore_in_background(records, tier_ids, found.hit, tokens, begin * bs),
            list(tier_keys),
            list(tier_ids),
            list(found.keys),
            len(found.pool_ids),
            first,
            first_block_index=begin,
        )
        return TierRead(pending=True)

    def _reads_in_background(self, hit: PrefixHit | None, first: int) -> bool:
        """Whether every tier holding the hit's blocks from ``first`` on (an index into the
        hit) is one of ``background_tiers``."""
        if hit is None:
            return False
        return all(
            hit.tier_names[tier] in self.background_tiers
            for tier, _, end in hit.spans
            if end > first
        )

    def _restore_now(
        self,
        seq: Sequence,
        keys: list[BlockHash],
        block_ids: list[int],
        hit: PrefixHit | None,
        first_index: int,
        first: bool,
    ) -> tuple[list[str], float]:
        """Read hit blocks into ``block_ids`` now and index the ones that arrived; their
        source tiers and the seconds it took."""
        assert self.bridge is not None, "a restore without tiers"
        records = self.records(seq, first_index, first_index + len(keys))
        # Every key asked for is inside the hit just looked up: not looked up again.
        begin, bs = first_index * self.block_size, self.block_size
        tokens = seq.token_ids[begin : begin + len(keys) * bs]
        restored = self.bridge.restore(
            records,
            block_ids,
            hit,
            tokens,
            begin,
            sequence_tokens=seq.token_ids,
            sequence_keys=seq.record_keys,
        )
        sources = restored.sources
        note_guard_cut(seq, restored, len(keys), self.block_size)
        if first:
            seq.add_time("restore_read_s", restored.read_s)
            seq.add_time("restore_copy_s", restored.copy_s)
        for i, (key, block_id) in enumerate(zip(keys, block_ids[: len(sources)])):
            if i >= restored.partial_blocks:  # some layers only: this sequence's alone
                self._register(seq, first_index + i, block_id, key)
        return sources, restored.read_s + restored.copy_s

    def finish(self, seq: Sequence) -> Restored | None:
        """Take in the sequence's background read, its head being computed: index what arrived
        in the prefix cache and end the jump over the loaded blocks where they end.

        Returns:
            The read, or ``None`` while it still runs (the sequence has waited for it since).
        """
        pending = seq.pending_restore
        assert pending is not None and seq.skip is not None, "no restore to finish"
        if not pending.future.done():
            if pending.waiting_since_s is None:
                pending.waiting_since_s = time.perf_counter()
            return None
        seq.pending_restore = None
        restored = pending.future.result()  # a failure raises here as a synchronous one would
        since = pending.waiting_since_s
        waited = 0.0 if since is None else time.perf_counter() - since
        arrived = len(restored.sources)
        note_guard_cut(seq, restored, len(pending.keys), self.block_size)
        for i, (key, block_id) in enumerate(zip(pending.keys, pending.block_ids[:arrived])):
            if i >= restored.partial_blocks:
                self._register(seq, pending.first_block_index + i, block_id, key)
        seq.skip = (seq.skip[0], seq.skip[0] + arrived * self.block_size)
        if pending.first:
            # What the TTFT paid for the restore is the wait from the head's end, not the read
            # the head hid: the copy ran last, so the wait's end is the copy's.
            copy_waited = min(waited, restored.copy_s)
            seq.add_time("restore_read_s", waited - copy_waited)
            seq.add_time("restore_copy_s", copy_waited)
        return restored

    def reads_awaited(self, running: list[Sequence]) -> list[Future[Restored]]:
        """The tail reads of running sequences whose head is computed, not in yet."""
        return [
            pending.future
            for seq in running
            if (pending := seq.pending_restore) is not None
            and at_jump(seq)
            and not pending.future.done()
        ]

    def release(self, seq: Sequence) -> None:
        """Free a preempted or finished sequence's blocks: at once, or, while a read still
        writes into some of them, once it is over (``free_read_blocks``); what it read is
        dropped. Nothing waits for the read here."""
        pending, seq.pending_restore = seq.pending_restore, None
        if pending is not None and not pending.future.done():
            self._held_for_reads.append((pending.future, list(seq.block_table)))
        else:
            self.blocks.release(seq.block_table)

    def free_read_blocks(self, *, block: bool = False) -> None:
        """Free the blocks of dropped reads that are over (all of them, waiting, if
        ``block``)."""
        still: list[tuple[Future[Restored], list[int]]] = []
        for future, block_ids in self._held_for_reads:
            if block:
                wait([future])
            if future.done():
                self.blocks.release(block_ids)
            else:
                still.append((future, block_ids))
        self._held_for_reads = still

    def close(self, running: list[Sequence]) -> None:
        """Wait for every tail read still running (``running``'s or dropped sequences'), so
        none writes into the pool after this; free what dropped ones held."""
        wait([p.future for seq in running if (p := seq.pending_restore) is not None])
        self.free_read_blocks(block=True)


def note_guard_cut(seq: Sequence, restored: Restored, asked: int, block_size: int) -> None:
    """What the record guard's early end of a restore of ``asked`` blocks cost the sequence:
    blocks left to verify count as verified tokens, refused ones as ``quarantined`` misses."""
    missing = asked - len(restored.sources)
    if restored.guard_cut is None or missing <= 0:
        return
    if restored.guard_cut == "new_writer":
        seq.num_verified_tokens += missing * block_size
    else:
        seq.miss_cause, seq.miss_detail = "quarantined", f"record guard: {restored.guard_cut}"


def at_jump(seq: Sequence) -> bool:
    """Whether the sequence has computed everything before its loaded blocks."""
    return seq.skip is not None and seq.num_computed_tokens == seq.skip[0]
