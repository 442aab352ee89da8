"""The scheduler over real tiers: what it plans when a tier holds a prompt's blocks (restored
block ids, the ``skip`` over loaded blocks behind recomputed ones, a read on the bridge's thread)
and what it counts and logs of it.

A warm-up request computes a prompt and saves its full blocks to the tiers as it finishes; the
pool then forgets them, so the next request with that prompt finds them in the tiers only. Each
block's K/V holds its tokens' ids (``SchedulerRun``), so a restored block shows what it holds.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from cachetier.engine.tier_bridge import TierBridge
from cachetier.primitives.keys import BlockHash
from cachetier.report.events import read_events
from cachetier.store.config import StoreConfig, build_store
from cachetier.store.costmodel import LoadPlan
from cachetier.store.tiered import TieredStore
from cachetier.tiers.prefix import PrefixHit
from tests.engine.conftest import OUTPUT_TOKEN, MakeRun, SchedulerRun

PROMPT = list(range(18))  # 4 full blocks of 4 tokens and 2 tokens


class RecomputeHead:
    """A plan that recomputes the first ``num_blocks`` hit blocks and loads the rest: fixed,
    so what is tested is what the scheduler does with such a plan, not when one is made
    (``tests/cachetier`` test the cost model that makes them)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks

    def plan(self, spans: list[tuple[str, int]], **kw: object) -> LoadPlan:
        total = sum(n for _, n in spans)
        return LoadPlan(total, min(self.num_blocks, total), total, "model")


@pytest.fixture
def cpu_store() -> Iterator[TieredStore]:
    store = build_store(StoreConfig(cpu_bytes=1 << 20))
    yield store
    store.close()


@pytest.fixture
def redis_store(redis_url: str, redis_prefix: str) -> Iterator[TieredStore]:
    """The real Redis as the only tier: a network tier, so a loaded tail is read on the
    bridge's thread while the head before it is computed."""
    store = build_store(
        StoreConfig(cpu_bytes=0, redis_url=redis_url, redis_key_prefix=redis_prefix)
    )
    yield store
    store.close()


def bridge_of(run: SchedulerRun) -> TierBridge:
    bridge = run.scheduler.bridge
    assert bridge is not None, "a run without tiers"
    return bridge


def warm(run: SchedulerRun, tokens: list[int]) -> None:
    """Compute ``tokens`` as a request of one output token (which saves its full blocks as it
    finishes), then empty the pool's prefix cache."""
    seq = run.add("warm", tokens, max_tokens=1)
    while not seq.is_finished:
        run.step()
    bridge_of(run).store.flush()
    assert run.blocks.clear_cache() == len(tokens) // run.scheduler.block_size


def test_a_tier_hit_is_restored_into_new_blocks_and_counted_by_source(
    make_run: MakeRun, cpu_store: TieredStore, tmp_path: Path
) -> None:
    run = make_run(store=cpu_store, events=True)
    warm(run, PROMPT[:10])  # blocks [0, 1, 2]; 0 and 1 full, saved; freed to [2, ..., 1, 0]
    assert bridge_of(run).stats.saved_blocks == 2
    b = run.add("b", PROMPT[:10], max_tokens=2)
    assert run.step() == [("b", 2)]
    assert b.block_table == [2, 3, 4]
    assert (run.tokens_in(2), run.tokens_in(3)) == ([0, 1, 2, 3], [4, 5, 6, 7])
    assert b.cached_tokens_by_source == {"cpu": 8} and b.num_cached_tokens == 8
    assert b.num_stored_blocks == 2
    assert b.load_plan == LoadPlan(2, 0, 2, "disabled")  # no cost model: load it all
    assert run.scheduler.num_plans_by_choice == {"load_all": 1, "partial": 0, "recompute_all": 0}
    assert run.blocks.match_prefix(b.block_keys) == [2, 3]
    assert {"restore_read_s", "restore_copy_s"} <= set(b.timings)
    # The restored blocks are the tier's already: b's finish writes nothing back.
    assert run.step() == [("b", 1)]
    assert b.is_finished and bridge_of(run).stats.saved_blocks == 2
    events = list(read_events(tmp_path / "events.jsonl"))
    assert [(dict(e.hit_tokens), e.num_alignment_lost_tokens) for e in events] == [
        ({}, 0),
        ({"cpu": 8}, 2),
    ]


def test_a_recomputed_head_is_followed_by_a_skip_over_the_loaded_tail(
    make_run: MakeRun, cpu_store: TieredStore, tmp_path: Path
) -> None:
    run = make_run(store=cpu_store, cost=RecomputeHead(1), max_num_batched_tokens=16, events=True)
    warm(run, PROMPT)  # blocks [0..4], 0-3 saved; freed to [4, 5, 6, 7, 3, 2, 1, 0]
    b = run.add("b", PROMPT, max_tokens=1)
    scheduled = run.scheduler.schedule()
    # Block 0 of the hit is recomputed first (4 tokens into block 4); blocks 1-3 are read
    # into 5, 6 and 7 now (a CPU tier beside a CPU forward: not in the background), and
    # tokens [4, 16) are skipped once the head is done.
    assert b.block_table == [4, 5, 6, 7]
    assert b.skip == (4, 16) and b.num_computed_tokens == 0 and b.pending_restore is None
    assert [run.tokens_in(i) for i in (5, 6, 7)] == [PROMPT[4:8], PROMPT[8:12], PROMPT[12:16]]
    assert b.cached_tokens_by_source == {"cpu": 12}
    assert b.num_recomputed_hit_tokens == 4 and run.scheduler.num_recomputed_hit_tokens == 4
    assert run.scheduler.num_plans_by_choice == {"load_all": 0, "partial": 1, "recompute_all": 0}
    assert run.compute(scheduled) == [("b", 4)]
    assert b.skip is None and b.num_computed_tokens == 16
    assert run.tokens_in(4) == PROMPT[:4]
    assert run.blocks.match_prefix(b.block_keys) == [4, 5, 6, 7]
    assert run.step() == [("b", 2)]  # the suffix, into a fifth block
    assert b.output_token_ids == [OUTPUT_TOKEN]
    # The recomputed head is a block the tiers hold: not written again.
    assert bridge_of(run).stats.saved_blocks == 4
    (_, event) = read_events(tmp_path / "events.jsonl")
    assert (dict(event.hit_tokens), event.recomputed_tokens) == ({"cpu": 12}, 4)


def test_fewer_blocks_than_looked_up_arrive_and_the_rest_is_computed(
    make_run: MakeRun, cpu_store: TieredStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = make_run(store=cpu_store)
    warm(run, PROMPT)  # 4 blocks saved
    bridge = bridge_of(run)
    lookup = bridge.lookup

    def lookup_then_delete(keys: list[BlockHash], **kw: bool) -> PrefixHit:
        # Another engine's eviction between the lookup and the read: blocks 2 and 3 go.
        hit = lookup(keys, **kw)
        cpu_store.delete(bridge.namespace.id, list(keys[2:]))
        return hit

    monkeypatch.setattr(bridge, "lookup", lookup_then_delete)
    b = run.add("b", PROMPT)
    # All 4 hit blocks were planned into [4, 5, 6, 7] with the suffix in 3; 2 arrived, so the
    # step computes tokens [8, 18) within the blocks already taken.
    assert run.step() == [("b", 10)]
    assert b.block_table == [4, 5, 6, 7, 3]
    assert (run.tokens_in(4), run.tokens_in(5)) == (PROMPT[:4], PROMPT[4:8])
    assert b.cached_tokens_by_source == {"cpu": 8} and b.num_computed_tokens == 18


def test_a_pool_block_of_several_records_is_restored_from_them(
    make_run: MakeRun, cpu_store: TieredStore
) -> None:
    run = make_run(store=cpu_store, block_size=8, record_tokens=4)
    warm(run, PROMPT)  # 2 full blocks of 8, saved as 4 records of 4
    assert bridge_of(run).stats.saved_blocks == 2
    b = run.add("b", PROMPT)
    assert run.step() == [("b", 2)]
    assert b.block_table == [2, 3, 4]
    assert (run.tokens_in(2), run.tokens_in(3)) == (PROMPT[:8], PROMPT[8:16])
    assert b.cached_tokens_by_source == {"cpu": 16}
    # Each restored block keeps its records' keys, for when it is saved again.
    assert [run.blocks.blocks[i].record_keys for i in (2, 3)] == [
        tuple(b.record_keys[0:2]),
        tuple(b.record_keys[2:4]),
    ]


def test_a_network_tail_is_read_in_the_background_and_jumped_over_once_in(
    make_run: MakeRun, redis_store: TieredStore, tmp_path: Path
) -> None:
    run = make_run(store=redis_store, cost=RecomputeHead(1), max_num_batched_tokens=16, events=True)
    assert run.scheduler.background_tiers == {"redis"}
    warm(run, PROMPT)
    b = run.add("b", PROMPT, max_tokens=1)
    scheduled = run.scheduler.schedule()
    pending = b.pending_restore
    assert pending is not None
    assert (pending.keys, pending.block_ids) == (b.block_keys[1:4], [5, 6, 7])
    # The whole tail is expected meanwhile; what it brought is known once it is in, and so is
    # the request's lookup event.
    assert b.skip == (4, 16) and b.num_computed_tokens == 0
    assert b.cached_tokens_by_source == {}
    assert len(list(read_events(tmp_path / "events.jsonl"))) == 1
    assert run.compute(scheduled) == [("b", 4)]
    # The next step waits for the read if it is not in yet: then b jumps to its suffix.
    assert run.step() == [("b", 2)]
    assert b.pending_restore is None and b.is_finished
    assert b.cached_tokens_by_source == {"redis": 12}
    assert [run.tokens_in(i) for i in (5, 6, 7)] == [PROMPT[4:8], PROMPT[8:12], PROMPT[12:16]]
    (_, event) = read_events(tmp_path / "events.jsonl")
    assert (dict(event.hit_tokens), event.recomputed_tokens) == ({"redis": 12}, 4)


def test_a_hit_loaded_from_its_first_block_is_read_at_admission_even_over_a_network(
    make_run: MakeRun, redis_store: TieredStore
) -> None:
    # Nothing is computed before the loaded blocks, so there is nothing to read beside.
    run = make_run(store=redis_store)
    warm(run, PROMPT)
    b = run.add("b", PROMPT)
    scheduled = run.scheduler.schedule()
    assert b.pending_restore is None and b.skip is None and b.num_computed_tokens == 16
    assert b.cached_tokens_by_source == {"redis": 16}
    assert b.block_table == [4, 5, 6, 7, 3]
    assert run.compute(scheduled) == [("b", 2)]
    assert [run.tokens_in(i) for i in (4, 5, 6, 7)] == [
        PROMPT[0:4],
        PROMPT[4:8],
        PROMPT[8:12],
        PROMPT[12:16],
    ]


def test_the_blocks_of_a_request_dropped_during_its_read_are_freed_when_the_read_ends(
    make_run: MakeRun, redis_store: TieredStore
) -> None:
    run = make_run(store=redis_store, cost=RecomputeHead(1), max_num_batched_tokens=16)
    warm(run, PROMPT)
    b = run.add("b", PROMPT)
    run.scheduler.schedule()
    pending = b.pending_restore
    assert pending is not None
    run.scheduler.finish(b, "abort")  # does not wait for the read
    assert b.pending_restore is None and run.running() == []
    pending.future.result()
    assert run.scheduler.schedule() == []  # nothing to run; what the read held is freed
    assert run.blocks.num_free_blocks == 8
    assert [run.blocks.blocks[i].ref_count for i in range(8)] == [0] * 8
