"""The scheduler on its own (vLLM's tests/v1/core/test_scheduler.py and test_prefix_caching.py
are the model): a real block manager of a few 4-token blocks, sequences fed in, and after each
``schedule`` the exact tokens per sequence, block ids and queues.

Block ids follow from the block manager's free list: lowest ids first, a released keyless block
goes to the front, a released cached block to the back (``test_block_manager``).
"""

from __future__ import annotations

from pathlib import Path

from cachetier.report.events import LookupEvent, read_events
from tests.engine.conftest import OUTPUT_TOKEN, MakeRun


def prompt(num_tokens: int, first: int = 0) -> list[int]:
    return list(range(first, first + num_tokens))


def summary(event: LookupEvent) -> tuple[int, dict[str, int], int, int, float]:
    """What an engine lookup event says besides its time: prompt tokens, hit tokens by source,
    tokens lost to block alignment, hit tokens recomputed by choice, restore seconds."""
    return (
        event.num_tokens,
        dict(event.hit_tokens),
        event.num_alignment_lost_tokens,
        event.recomputed_tokens,
        event.restore_s,
    )


def test_waiting_sequences_are_admitted_in_order_until_the_token_budget_is_spent(
    make_run: MakeRun,
) -> None:
    run = make_run(max_num_batched_tokens=10)
    a, b, c = (run.add(name, prompt(4, 10 * i)) for i, name in enumerate("abc"))
    # The third prompt gets what is left of the budget: its first chunk.
    assert run.step() == [("a", 4), ("b", 4), ("c", 2)]
    assert (a.block_table, b.block_table, c.block_table) == ([0], [1], [2])
    assert run.running() == ["a", "b", "c"] and run.waiting() == []
    # Running sequences come first: two decodes (each needing a second block), then the rest
    # of the third prompt, which fits its block.
    assert run.step() == [("a", 1), ("b", 1), ("c", 2)]
    assert (a.block_table, b.block_table, c.block_table) == ([0, 3], [1, 4], [2])
    assert c.output_token_ids == [OUTPUT_TOKEN]


def test_max_num_seqs_keeps_the_rest_waiting_until_a_sequence_finishes(make_run: MakeRun) -> None:
    run = make_run(max_num_seqs=2)
    for i, name in enumerate("abc"):
        run.add(name, prompt(4, 10 * i), max_tokens=2)
    assert run.step() == [("a", 4), ("b", 4)]
    assert run.waiting() == ["c"]
    assert run.step() == [("a", 1), ("b", 1)]  # both finish here
    assert run.running() == [] and run.waiting() == ["c"]
    # a and b freed [2, 0] and [3, 1]: their partial blocks 2 and 3 went to the front of the
    # free list, their cached blocks 0 and 1 to the back.
    assert run.step() == [("c", 4)]
    assert run.seqs["c"].block_table == [3]


def test_a_prompt_the_pool_cannot_hold_waits_and_so_do_those_behind_it(make_run: MakeRun) -> None:
    run = make_run(num_blocks=4)
    a = run.add("a", prompt(9), max_tokens=2)
    assert run.step() == [("a", 9)]
    assert a.block_table == [0, 1, 2]
    b = run.add("b", prompt(8, 50))  # needs 2 blocks, 1 is free
    c = run.add("c", prompt(2, 80))  # would fit, but arrived after b
    scheduled = run.scheduler.schedule()
    assert run.waiting() == ["b", "c"] and run.blocks.num_free_blocks == 1
    assert run.compute(scheduled) == [("a", 1)]
    # a finished and freed [2, 1, 0] (2 keyless, to the front): b takes 2 and the free 3, c
    # takes the least recently used cached block, a's block 1, and evicts it.
    assert run.step() == [("b", 8), ("c", 2)]
    assert (b.block_table, c.block_table) == ([2, 3], [1])
    assert run.blocks.num_evicted == 1
    assert run.blocks.match_prefix(a.block_keys) == [0]


def test_a_long_prompt_is_prefilled_in_chunks_beside_a_decode(make_run: MakeRun) -> None:
    run = make_run(max_num_batched_tokens=6)
    a = run.add("a", prompt(3, 100), max_tokens=5)
    b = run.add("b", prompt(15), max_tokens=1)
    assert run.step() == [("a", 3), ("b", 3)]
    assert (a.block_table, b.block_table) == ([0], [1])
    assert run.step() == [("a", 1), ("b", 5)]
    assert (a.block_table, b.block_table) == ([0], [1, 2])
    assert run.step() == [("a", 1), ("b", 5)]
    assert (a.block_table, b.block_table) == ([0, 3], [1, 2, 4, 5])
    assert b.num_computed_tokens == 13 and b.output_token_ids == []
    assert run.step() == [("a", 1), ("b", 2)]  # b's prompt is done: its first token
    assert b.output_token_ids == [OUTPUT_TOKEN] and b.is_finished
    assert run.step() == [("a", 1)]
    assert a.is_finished and run.running() == [] and run.blocks.num_free_blocks == 8


def test_a_shared_prefix_reuses_the_pool_blocks_of_its_full_blocks_only(
    make_run: MakeRun,
) -> None:
    run = make_run()
    a = run.add("a", prompt(10))
    assert run.step() == [("a", 10)]
    assert a.block_table == [0, 1, 2]
    # b shares all ten of a's tokens, but a's block 2 holds only two of them: not shared.
    b = run.add("b", [*prompt(10), 200, 201, 202])
    assert run.step() == [("a", 1), ("b", 5)]
    assert b.block_table == [0, 1, 3, 4]
    assert [run.blocks.blocks[i].ref_count for i in range(5)] == [2, 2, 1, 1, 1]
    assert b.num_cached_tokens == 8 and b.cached_tokens_by_source == {"pool": 8}
    assert run.blocks.match_prefix(b.block_keys) == [0, 1, 3]  # b's third block is full now


def test_a_prompt_of_whole_blocks_recomputes_its_last_block(make_run: MakeRun) -> None:
    run = make_run()
    run.add("a", prompt(8), max_tokens=1)
    assert run.step() == [("a", 8)]  # a finishes and frees [1, 0], both cached
    b = run.add("b", prompt(8))
    # One token must be computed for logits: the last block is recomputed, not looked up.
    assert run.step() == [("b", 4)]
    assert b.block_table == [0, 2]
    assert b.cached_tokens_by_source == {"pool": 4}


def test_prefix_caching_off_shares_nothing_and_logs_nothing(
    make_run: MakeRun, tmp_path: Path
) -> None:
    run = make_run(enable_prefix_caching=False, events=True)
    run.add("a", prompt(8), max_tokens=1)
    assert run.step() == [("a", 8)]
    b = run.add("b", prompt(8))
    assert run.step() == [("b", 8)]
    assert b.block_table == [0, 1]  # a's blocks, never indexed: freed keyless, reused first
    assert b.cached_tokens_by_source == {} and run.blocks.num_cached_blocks == 0
    assert list(read_events(tmp_path / "events.jsonl")) == []


def test_out_of_blocks_the_latest_admitted_is_preempted_and_recomputes_later(
    make_run: MakeRun, tmp_path: Path
) -> None:
    run = make_run(num_blocks=4, events=True)
    a = run.add("a", prompt(7), max_tokens=3)
    b = run.add("b", prompt(7, 50), max_tokens=4)
    assert run.step() == [("a", 7), ("b", 7)]
    assert run.step() == [("a", 1), ("b", 1)]
    assert (a.block_table, b.block_table) == ([0, 1], [2, 3])
    # a's ninth token needs a third block: b, admitted last, gives back [3, 2] (both cached),
    # a takes 3, and b, whose first block is still cached, cannot get the two more it needs.
    scheduled = run.scheduler.schedule()
    assert a.block_table == [0, 1, 3] and run.blocks.num_evicted == 1
    assert run.running() == ["a"] and run.waiting() == ["b"]
    assert b.status.value == "waiting" and b.block_table == [] and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and run.scheduler.num_preemptions == 1
    assert run.blocks.match_prefix(b.block_keys) == [2]
    assert run.compute(scheduled) == [("a", 1)]  # a finishes
    # a freed [3, 1, 0] (3 keyless, to the front): b takes its cached block 2, then 3 and 1,
    # and recomputes its tokens 4-8, outputs included.
    assert run.step() == [("b", 5)]
    assert b.block_table == [2, 3, 1]
    assert run.tokens_in(3) == [54, 55, 56, OUTPUT_TOKEN]
    assert b.output_token_ids == [OUTPUT_TOKEN] * 3  # its two before and one after
    # What a request had cached is its first admission's, and it logs one lookup event: the
    # second admission, and the block it found, are the engine's doing.
    assert b.cached_tokens_by_source == {} and b.num_cached_tokens == 0
    events = [summary(e) for e in read_events(tmp_path / "events.jsonl")]
    assert events == [(7, {}, 0, 0, 0.0), (7, {}, 0, 0, 0.0)]


def test_each_admission_logs_its_lookup_with_the_tokens_block_alignment_lost(
    make_run: MakeRun, tmp_path: Path
) -> None:
    run = make_run(events=True)
    run.add("a", prompt(10), max_tokens=1)
    run.step()
    run.add("b", prompt(10), max_tokens=1)  # both full blocks hit, 2 tokens after them
    run.step()
    c = run.add("c", prompt(13), max_tokens=1)  # 2 of its 3 full blocks hit
    run.step()
    events = list(read_events(tmp_path / "events.jsonl"))
    assert [summary(e) for e in events] == [
        (10, {}, 0, 0, 0.0),
        (10, {"pool": 8}, 2, 0, 0.0),
        (13, {"pool": 8}, 0, 0, 0.0),
    ]
    assert {(e.origin, e.tenant, e.block_size) for e in events} == {("engine", "", 4)}
    assert c.num_cached_tokens == 8
    # The queue and the lookup are timed at admission (no tiers: nothing restored).
    assert set(c.timings) == {"queue_s", "lookup_s"}
