"""Continuous batching with chunked prefill, prefix reuse and preemption by recompute.

Each step: running sequences first (decodes and unfinished prefill chunks, in arrival order),
then waiting ones while the token budget and ``max_num_seqs`` allow. A waiting sequence first
takes its longest cached prefix: blocks still in the pool, then blocks the tiers restore. When
blocks run out, the most recently admitted running sequence is preempted: its blocks are freed
(their cached keys stay findable) and it goes back to the front of the queue.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED as FIRST
from concurrent.futures import Future, wait
from dataclasses import dataclass

from cachetier.engine.block_manager import BlockManager
from cachetier.engine.config import EngineConfig
from cachetier.engine.sequence import PendingRestore, Sequence, SequenceStatus
from cachetier.engine.tier_bridge import Restored, TierBridge

from cachetier.primitives.keys import BlockHash, Namespace, block_keys, records_per_block
from cachetier.report.events import EventLog, LookupEvent
from cachetier.store.costmodel import CostModel, LoadPlan
from cachetier.tiers.prefix import PrefixHit


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new: int


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        namespace: Namespace,
        blocks: BlockManager,
        bridge: TierBridge | None,
        events: EventLog | None = None,
        cost: CostModel | None = None,
    ) -> None:
        self.config = config
        self.cost = cost
        self.namespace = namespace
        self.block_size = config.block_size
        # Records per pool block: keys are per record (``namespace.block_size`` tokens), and a
        # pool block's key is its last record's.
        self.records_per_block = records_per_block(config.block_size, namespace.block_size)
        self.blocks = blocks
        self.bridge = bridge
        self.events = events
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_recomputed_hit_tokens = 0  # tier hits the cost model chose to recompute
        # Plans of requests whose prefix the tiers held, by ``LoadPlan.choice``.
        self.num_plans_by_choice = {"load_all": 0, "partial": 0, "recompute_all": 0}
        # Blocks of dropped sequences that a tail read still writes into: freed once it ends.
        self._held_for_reads: list[tuple[Future[Restored], list[int]]] = []
        # Tiers whose reads of a loaded tail ``_admit`` runs beside the head's recompute: on a
        # CPU only those that wait on a network (a read from memory or the page cache takes
        # the same cores as the forward: both at once took longer than one after the other in
        # benchmarks/bench_overlap.py), on a GPU every tier (the reads are the host's work, the
        # forward the device's). The plan counts such a read as hidden behind the head only
        # where it is slower than computing the same tokens (``CostModel.plan``). A small
        # model's GPU forward is host work too (launches from Python), so it gains less.
        on_cpu = bridge is None or bridge.pool.cache.device.type == "cpu"
        tiers = bridge.store.tiers if bridge is not None else ()
        self.background_tiers = frozenset(t.name for t in tiers if t.over_network or not on_cpu)

    def add(self, seq: Sequence) -> None:
        self.extend_keys(seq)
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def extend_keys(self, seq: Sequence) -> None:
        """Compute keys for blocks that became full since the last call (one hash a record)."""
        num_full = seq.num_tokens // self.block_size
        have = len(seq.block_keys)
        if num_full > have:
            n = self.records_per_block
            tokens = seq.token_ids[have * self.block_size : num_full * self.block_size]
            parent = seq.record_keys[-1] if seq.record_keys else None
            seq.record_keys.extend(block_keys(self.namespace, tokens, parent=parent))
            seq.block_keys.extend(seq.record_keys[(have + 1) * n - 1 :: n])

    def _records(self, seq: Sequence, start: int, end: int) -> list[BlockHash]:
        """The record keys of pool blocks ``[start, end)`` of the sequence."""
        n = self.records_per_block
        return seq.record_keys[start * n : end * n]

    def _block_records(self, seq: Sequence, index: int) -> tuple[BlockHash, ...]:
        """What ``BlockManager.register`` keeps of block ``index``'s records: nothing where
        the block is one record (its key names it)."""
        if self.records_per_block == 1:
            return ()
        return tuple(self._records(seq, index, index + 1))

    def _blocks_needed(self, seq: Sequence, num_new: int) -> int:
        total = -(-(seq.num_computed_tokens + num_new) // self.block_size)
        return max(0, total - len(seq.block_table))

    def schedule(self) -> list[ScheduledSeq]:
        self._free_read_blocks()
        scheduled = self._schedule_once()
        while not scheduled and (reads := self._reads_awaited()):
            # Nothing else can run: wait for a tail read rather than spin.
            wait(reads, return_when=FIRST)
            scheduled = self._schedule_once()
        return scheduled

    def _reads_awaited(self) -> list[Future[Restored]]:
        """The tail reads of running sequences whose head is computed, not in yet."""
        return [
            pending.future
            for seq in self.running
            if (pending := seq.pending_restore) is not None
            and _at_jump(seq)
            and not pending.future.done()
        ]

    def _schedule_once(self) -> list[ScheduledSeq]:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if not self._jump(seq):
                i += 1  # its tail is still being read: the others go on meanwhile
                continue
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if seq.skip is not None:
                num_new = min(num_new, seq.skip[0] - seq.num_computed_tokens)
            need = self._blocks_needed(seq, num_new)
            while need > self.blocks.num_free_blocks and len(self.running) - 1 > i:
                self._preempt(self.running.pop())
            if need > self.blocks.num_free_blocks:
                self._preempt(self.running.pop(i))
                continue
            new_ids = self.blocks.allocate(need)
            assert new_ids is not None, "allocation failed after the free-block check"
            seq.block_table.extend(new_ids)
            scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            num_new = self._admit(seq, budget)
            if num_new is None:
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        return scheduled

    def _admit(self, seq: Sequence, budget: int) -> int | None:
        """Give a waiting sequence its cached prefix and the blocks of its first chunk.

        Returns:
            Tokens to compute this step, or ``None`` if the pool cannot take it now.
        """
        bs = self.block_size
        start = time.perf_counter()
        first = seq.num_preemptions == 0
        if first:
            seq.add_time("queue_s", start - seq.arrival_s)
        keys, pool_ids, hit, plan = self._look_up(seq)
        # Hit blocks [load_start, load_end) come from the tiers; those before load_start are
        # recomputed first (the plan found that cheaper), then the sequence skips over the
        # loaded ones.
        load_start = plan.load_start if plan is not None and plan.num_load_blocks else 0
        load_end = plan.load_end if plan is not None and plan.num_load_blocks else 0
        first_new = len(pool_ids) * bs if load_start else (len(pool_ids) + load_end) * bs
        num_new = min(seq.num_tokens - first_new, budget)
        if load_start:
            num_new = min(num_new, load_start * bs)
        need = max(load_end, -(-(first_new + num_new) // bs) - len(pool_ids))
        if need > self.blocks.num_free_blocks - self.blocks.num_free_among(pool_ids):
            return None
        self.blocks.acquire(pool_ids)
        new_ids = self.blocks.allocate(need)
        assert new_ids is not None, "allocation failed after the free-block check"
        seq.block_table = pool_ids + new_ids
        seq.skip = None
        sources: list[str] = []
        restore_s = 0.0
        if first:
            seq.add_time("lookup_s", time.perf_counter() - start)
        pending = False
        if load_end > load_start and self.bridge is not None:
            base = len(pool_ids)
            tier_keys = keys[base + load_start : base + load_end]
            tier_records = self._records(seq, base + load_start, base + load_end)
            tier_ids = new_ids[load_start:load_end]
            if load_start and self._reads_in_background(hit, load_start):
                # The head is recomputed first: the tail is read meanwhile, on the bridge's
                # thread, into blocks nothing reads before the head is done (``skip``).
                seq.pending_restore = PendingRestore(
                    self.bridge.restore_in_background(tier_records, tier_ids, hit),
                    list(tier_keys),
                    list(tier_ids),
                    list(keys),
                    len(pool_ids),
                    first,
                    first_block_index=base + load_start,
                )
                pending = True
            else:
                sources, restore_s = self._restore_now(
                    seq, tier_keys, tier_ids, hit, base + load_start, first
                )
        if load_start:
            seq.num_computed_tokens = len(pool_ids) * bs
            # While a read is pending the whole tail is expected; ``_finish_restore`` cuts the
            # jump short if fewer blocks arrive.
            arrived = load_end - load_start if pending else len(sources)
            if arrived:
                begin = (len(pool_ids) + load_start) * bs
                seq.skip = (begin, begin + arrived * bs)
        else:
            seq.num_computed_tokens = (len(pool_ids) + len(sources)) * bs
            if len(sources) < load_end:
                # Fewer blocks arrived than the lookup promised: compute the rest, within the
                # blocks already taken.
                cached = seq.num_computed_tokens
                num_new = min(seq.num_tokens - cached, budget, len(seq.block_table) * bs - cached)
        if first:
            self._note_plan(seq, plan)
            if not pending:
                self._account_hit(seq, keys, len(pool_ids), sources, restore_s)
        return num_new

    def _look_up(
        self, seq: Sequence
    ) -> tuple[list[BlockHash], list[int], PrefixHit | None, LoadPlan | None]:
        """The sequence's full-block keys, the pool's blocks of its leading ones, the tiers'
        hit after them and the plan of what to load of it."""
        if not self.config.enable_prefix_caching:
            return [], [], None, None
        # At least one token must be computed to get logits, so a prompt that is all full
        # blocks leaves its last block to be recomputed.
        keys = seq.block_keys[: (seq.num_tokens - 1) // self.block_size]
        pool_ids = self.blocks.match_prefix(keys)
        if self.bridge is None:
            return keys, pool_ids, None, None
        hit = self.bridge.lookup(self._records(seq, len(pool_ids), len(keys)))
        plan = self._plan(seq, hit, len(pool_ids) * self.block_size)
        seq.num_stored_blocks = len(pool_ids) + hit.num_blocks
        return keys, pool_ids, hit, plan

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
        records = self._records(seq, first_index, first_index + len(keys))
        # Every key asked for is inside the hit just looked up: not looked up again.
        restored = self.bridge.restore(records, block_ids, hit)
        sources = restored.sources
        if first:
            seq.add_time("restore_read_s", restored.read_s)
            seq.add_time("restore_copy_s", restored.copy_s)
        for i, (key, block_id) in enumerate(zip(keys, block_ids[: len(sources)])):
            record_keys = self._block_records(seq, first_index + i)
            self.blocks.register(block_id, key, stored=True, record_keys=record_keys)
        return sources, restored.read_s + restored.copy_s

    def _note_plan(self, seq: Sequence, plan: LoadPlan | None) -> None:
        """Count a request's load plan, at its first admission."""
        if plan is None:
            return
        if plan.num_hit_blocks:
            self.num_plans_by_choice[plan.choice] += 1
        seq.num_recomputed_hit_tokens = plan.num_recompute_blocks * self.block_size
        self.num_recomputed_hit_tokens += seq.num_recomputed_hit_tokens
        seq.est_saved_s = plan.est_saved_s
        seq.load_plan = plan

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

    def _account_hit(
        self,
        seq: Sequence,
        keys: list[BlockHash],
        num_pool_blocks: int,
        sources: list[str],
        restore_s: float,
    ) -> None:
        """Record where a request's cached tokens came from, once its restore is in."""
        bs = self.block_size
        seq.num_cached_tokens = (num_pool_blocks + len(sources)) * bs
        by_source: dict[str, int] = {}
        if num_pool_blocks:
            by_source["pool"] = num_pool_blocks * bs
        for name in sources:
            by_source[name] = by_source.get(name, 0) + bs
        seq.cached_tokens_by_source = by_source
        # Logged once per request: a preempted sequence re-admitted later looks its prefix up
        # again, but that is the engine's doing, not a new request's.
        if self.events is not None and self.config.enable_prefix_caching:
            self._log_lookup(seq, keys, by_source, restore_s)

    def _finish_restore(self, seq: Sequence) -> None:
        """Wait for the sequence's background read (its head is computed) and put what
        arrived in the prefix cache; the jump over the loaded blocks ends where they end."""
        pending, seq.pending_restore = seq.pending_restore, None
        assert pending is not None and seq.skip is not None, "no restore to finish"
        restored = pending.future.result()  # a failure raises here as a synchronous one would
        since = pending.waiting_since_s
        waited = 0.0 if since is None else time.perf_counter() - since
        arrived = len(restored.sources)
        for i, (key, block_id) in enumerate(zip(pending.keys, pending.block_ids[:arrived])):
            records = self._block_records(seq, pending.first_block_index + i)
            self.blocks.register(block_id, key, stored=True, record_keys=records)
        seq.skip = (seq.skip[0], seq.skip[0] + arrived * self.block_size)
        if pending.first:
            # What the TTFT paid for the restore is the wait from the head's end, not the read
            # the head hid: the copy ran last, so the wait's end is the copy's.
            copy_waited = min(waited, restored.copy_s)
            seq.add_time("restore_read_s", waited - copy_waited)
            seq.add_time("restore_copy_s", copy_waited)
            self._account_hit(
                seq,
                pending.lookup_keys,
                pending.num_pool_blocks,
                restored.sources,
                restored.read_s + restored.copy_s,
            )

    def _jump(self, seq: Sequence) -> bool:
        """Step over the loaded blocks once the head before them is computed and their read
        is in; ``False`` while that read is still running (the sequence waits, nothing else
        does)."""
        if not _at_jump(seq):
            return True
        pending = seq.pending_restore
        if pending is not None:
            if not pending.future.done():
                if pending.waiting_since_s is None:
                    pending.waiting_since_s = time.perf_counter()
                return False
            self._finish_restore(seq)
        seq.num_computed_tokens = seq.skip[1]
        seq.skip = None
        return True

    def _release(self, seq: Sequence) -> None:
        """Free a preempted or finished sequence's blocks: at once, or, while a read still
        writes into some of them, once it is over (``_free_read_blocks``); what it read is
        dropped. Nothing waits for the read here."""
        pending, seq.pending_restore = seq.pending_restore, None
        if pending is not None and not pending.future.done():
            self._held_for_reads.append((pending.future, list(seq.block_table)))
        else:
            self.blocks.release(seq.block_table)

    def _free_read_blocks(self, *, block: bool = False) -> None:
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

    def close(self) -> None:
        """Wait for every tail read still running (the engine's or dropped sequences'), so
        none writes into the pool after this; free what dropped ones held."""
        wait([p.future for seq in self.running if (p := seq.pending_restore) is not None])
        self._free_read_blocks(block=True)

    def _plan(self, seq: Sequence, hit: PrefixHit, pool_tokens: int) -> LoadPlan:
        """Load or recompute the tier hit: without a cost model, load all of it."""
        if self.cost is None or self.bridge is None:
            return LoadPlan.load_all(hit.num_blocks, "disabled")
        spans = [(hit.tier_names[tier], end - begin) for tier, begin, end in hit.spans]
        pool = self.bridge.pool
        return self.cost.plan(
            spans,
            block_bytes=pool.block_bytes + pool.aux_bytes,
            block_size=self.block_size,
            cached_tokens=pool_tokens,
            num_tokens=seq.num_tokens,
            chunk_tokens=self.config.max_num_batched_tokens,
            overlap_tiers=self.background_tiers,
            request_id=seq.request_id,
        )

    def observe_outcome(self, seq: Sequence) -> None:
        """Once a sequence's first token is out, tell the cost model what the prompt of a
        refused load really took to compute.

        The figure is ``prefill_s``: the forward steps that computed the prompt, which is what
        ``LoadPlan.est_compute_s`` estimates (TTFT would add queueing and reads the estimate
        does not cover). A step shared with other requests counts whole, which overstates the
        cost and can only make later refusals rarer. A preempted sequence computed parts of
        its prompt twice and says nothing about the estimate: left out.
        """
        plan = seq.load_plan
        if self.cost is None or plan is None or not plan.refused or plan.est_compute_s is None:
            return
        if seq.num_preemptions:
            return
        self.cost.observe_outcome(
            plan, seq.timings.get("prefill_s", 0.0), request_id=seq.request_id
        )

    def _log_lookup(
        self, seq: Sequence, keys: list[BlockHash], by_source: dict[str, int], restore_s: float
    ) -> None:
        assert self.events is not None, "_log_lookup without an event log"
        bs = self.block_size
        num_hit_blocks = sum(by_source.values()) // bs
        # Every full block the lookup could use hit: the partial tail is what block alignment
        # cost (a prompt of whole blocks has none, its last block is recomputed for logits).
        lost = seq.num_prompt_tokens % bs if keys and num_hit_blocks == len(keys) else 0
        self.events.record(
            LookupEvent(
                time_s=time.time(),
                tenant=self.config.tenant,
                num_tokens=seq.num_prompt_tokens,
                hit_tokens=by_source,
                block_size=bs,
                num_alignment_lost_tokens=lost,
                restore_s=restore_s,
                origin="engine",
                recomputed_tokens=seq.num_recomputed_hit_tokens,
                est_saved_s=seq.est_saved_s,
            )
        )

    def _preempt(self, seq: Sequence) -> None:
        # Recompute later: the blocks go back to the pool, and their cached keys let the
        # re-admitted sequence find most of its KV there again.
        self._release(seq)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.skip = None
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def register_computed(self, seq: Sequence, before: int) -> None:
        """Index blocks that became full and computed this step in the prefix cache, and step
        over blocks loaded from the tiers once the recomputed ones before them are done."""
        self._jump(seq)
        if not self.config.enable_prefix_caching:
            return
        bs = self.block_size
        for index in range(before // bs, seq.num_computed_tokens // bs):
            block_id = seq.block_table[index]
            if self.blocks.blocks[block_id].key is None:
                self.blocks.register(
                    block_id,
                    seq.block_keys[index],
                    stored=index < seq.num_stored_blocks,
                    record_keys=self._block_records(seq, index),
                )

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a running sequence: save its full blocks to the tiers and free them."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.running.remove(seq)
        if self.bridge is not None and self.config.enable_prefix_caching:
            self.bridge.save([self.blocks.blocks[b] for b in seq.block_table])
        self._release(seq)
        seq.block_table = []


def _at_jump(seq: Sequence) -> bool:
    """Whether the sequence has computed everything before its loaded blocks."""
    return seq.skip is not None and seq.num_computed_tokens == seq.skip[0]
