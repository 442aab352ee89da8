"""Continuous batching with chunked prefill, prefix reuse and preemption by recompute.

Each step: running sequences first (decodes and unfinished prefill chunks, in arrival order),
then waiting ones while the token budget and ``max_num_seqs`` allow. A waiting sequence first
takes its longest cached prefix: blocks still in the pool, then blocks the tiers restore
(``tier_loads``). When blocks run out, the most recently admitted running sequence is
preempted: its blocks are freed (their cached keys stay findable) and it goes back to the front
of the queue.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED as FIRST
from concurrent.futures import wait
from dataclasses import dataclass

from cachetier.engine.block_manager import BlockManager
from cachetier.engine.cached_tokens import account_cached_tokens, lookup_event
from cachetier.engine.config import EngineConfig
from cachetier.engine.sequence import Sequence, SequenceStatus
from cachetier.engine.tier_bridge import TierBridge
from cachetier.engine.tier_loads import PrefixLookup, TierLoads, at_jump
from cachetier.primitives.keys import BlockHash, Namespace, block_keys, records_per_block
from cachetier.report.events import EventLog
from cachetier.store.costmodel import CostModel, LoadPlan


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
        self.loads = TierLoads(config, blocks, bridge, self.records_per_block)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_recomputed_hit_tokens = 0  # tier hits the cost model chose to recompute
        # Plans of requests whose prefix the tiers held, by ``LoadPlan.choice``.
        self.num_plans_by_choice = {"load_all": 0, "partial": 0, "recompute_all": 0}

    @property
    def background_tiers(self) -> frozenset[str]:
        """Tiers whose reads of a loaded tail run beside the head's recompute (``TierLoads``)."""
        return self.loads.background_tiers

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

    def _blocks_needed(self, seq: Sequence, num_new: int) -> int:
        total = -(-(seq.num_computed_tokens + num_new) // self.block_size)
        return max(0, total - len(seq.block_table))

    def schedule(self) -> list[ScheduledSeq]:
        self.loads.free_read_blocks()
        scheduled = self._schedule_once()
        while not scheduled and (reads := self.loads.reads_awaited(self.running)):
            # Nothing else can run: wait for a tail read rather than spin.
            wait(reads, return_when=FIRST)
            scheduled = self._schedule_once()
        return scheduled

    def _schedule_once(self) -> list[ScheduledSeq]:
        scheduled: list[ScheduledSeq] = []
        budget = self._schedule_running(self.config.max_num_batched_tokens, scheduled)
        self._schedule_waiting(budget, scheduled)
        return scheduled

    def _schedule_running(self, budget: int, scheduled: list[ScheduledSeq]) -> int:
        """Give running sequences their next tokens, in arrival order, preempting the latest
        admitted where blocks run out; returns the budget left."""
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
        return budget

    def _schedule_waiting(self, budget: int, scheduled: list[ScheduledSeq]) -> None:
        """Admit waiting sequences, first come first served, while the budget, the pool and
        ``max_num_seqs`` take them."""
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
        found = self._look_up(seq)
        num_pool = len(found.pool_ids)
        # Hit blocks [load_start, load_end) come from the tiers; those before load_start are
        # recomputed first (the plan found that cheaper), then the sequence skips over the
        # loaded ones.
        load_start, load_end = found.load_start, found.load_end
        first_new = num_pool * bs if load_start else (num_pool + load_end) * bs
        num_new = min(seq.num_tokens - first_new, budget)
        if load_start:
            num_new = min(num_new, load_start * bs)
        need = max(load_end, -(-(first_new + num_new) // bs) - num_pool)
        if need > self.blocks.num_free_blocks - self.blocks.num_free_among(found.pool_ids):
            return None
        self.blocks.acquire(found.pool_ids)
        new_ids = self.blocks.allocate(need)
        assert new_ids is not None, "allocation failed after the free-block check"
        seq.block_table = found.pool_ids + new_ids
        seq.skip = None
        if first:
            seq.add_time("lookup_s", time.perf_counter() - start)
        read = self.loads.load(seq, found, new_ids, first)
        if not load_start and len(read.sources) < load_end:
            # Fewer blocks arrived than the lookup promised: compute the rest, within the
            # blocks already taken.
            cached = seq.num_computed_tokens
            num_new = min(seq.num_tokens - cached, budget, len(seq.block_table) * bs - cached)
        if first:
            self._note_plan(seq, found.plan)
            if not read.pending:
                self._account_hit(seq, found.keys, num_pool, read.sources, read.restore_s)
        return num_new

    def _look_up(self, seq: Sequence) -> PrefixLookup:
        """The sequence's full-block keys, the pool's blocks of its leading ones, the tiers'
        hit after them and the plan of what to load of it."""
        if not self.config.enable_prefix_caching:
            return PrefixLookup([], [])
        # At least one token must be computed to get logits, so a prompt that is all full
        # blocks leaves its last block to be recomputed.
        keys = seq.block_keys[: (seq.num_tokens - 1) // self.block_size]
        pool_ids = self.blocks.match_prefix(keys)
        return self.loads.look_up(seq, keys, pool_ids, self.cost)

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

    def _account_hit(
        self,
        seq: Sequence,
        keys: list[BlockHash],
        num_pool_blocks: int,
        sources: list[str],
        restore_s: float,
    ) -> None:
        """Record where a request's cached tokens came from, once its restore is in."""
        caching = self.config.enable_prefix_caching
        num_keys = len(keys) if caching else None  # no lookup, no miss to explain
        account_cached_tokens(seq, num_pool_blocks, sources, self.block_size, num_keys)
        # Logged once per request: a preempted sequence re-admitted later looks its prefix up
        # again, but that is the engine's doing, not a new request's.
        if self.events is not None and self.config.enable_prefix_caching:
            self.events.record(
                lookup_event(seq, keys, restore_s, self.block_size, self.config.tenant)
            )

    def _jump(self, seq: Sequence) -> bool:
        """Step over the loaded blocks once the head before them is computed and their read
        is in; ``False`` while that read is still running (the sequence waits, nothing else
        does)."""
        if not at_jump(seq):
            return True
        pending = seq.pending_restore
        if pending is not None:
            restored = self.loads.finish(seq)
            if restored is None:
                return False
            if pending.first:
                restore_s = restored.read_s + restored.copy_s
                sources, num_pool = restored.sources, pending.num_pool_blocks
                self._account_hit(seq, pending.lookup_keys, num_pool, sources, restore_s)
        assert seq.skip is not None, "a jump without a skip"
        seq.num_computed_tokens = seq.skip[1]
        seq.skip = None
        return True

    def close(self) -> None:
        """Wait for every tail read still running (the engine's or dropped sequences'), so
        none writes into the pool after this; free what dropped ones held."""
        self.loads.close(self.running)

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

    def _preempt(self, seq: Sequence) -> None:
        # Recompute later: the blocks go back to the pool, and their cached keys let the
        # re-admitted sequence find most of its KV there again.
        self.loads.release(seq)
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
                    record_keys=self.loads.block_records(seq, index),
                    parent=seq.block_keys[index - 1] if index else None,
                    token_ids=seq.block_token_ids(index, bs),
                )

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a running sequence: save its full blocks to the tiers and free them."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.running.remove(seq)
        if self.bridge is not None and self.config.enable_prefix_caching:
            blocks = [self.blocks.blocks[b] for b in seq.block_table]
            self.bridge.save(blocks, seq.num_prompt_tokens, seq.token_ids)
        self.loads.release(seq)
        seq.block_table = []
