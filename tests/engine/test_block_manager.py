from __future__ import annotations

import pytest

from cachetier.engine.block_manager import Block, BlockManager
from cachetier.primitives.keys import BlockHash


def key(i: int) -> BlockHash:
    return BlockHash(bytes([i]) * 32)


def test_allocate_takes_lowest_free_ids_first_and_refuses_when_short() -> None:
    bm = BlockManager(4)
    assert bm.allocate(3) == [0, 1, 2]
    assert bm.allocate(2) is None
    assert bm.num_free_blocks == 1
    assert [b.ref_count for b in bm.blocks] == [1, 1, 1, 0]


def test_release_frees_the_tail_first_and_cached_blocks_outlive_keyless_ones() -> None:
    bm = BlockManager(6)
    a = bm.allocate(3)  # [0, 1, 2]
    bm.register(0, key(0))
    bm.register(1, key(1))
    rest = bm.allocate(3)  # [3, 4, 5]
    bm.release(a)  # 2 is keyless: reused first; then cached 1 before 0 (tail first)
    bm.release(rest)  # all keyless: to the front, in the order 3, 4, 5
    assert bm.allocate(4) == [3, 4, 5, 2]
    assert bm.match_prefix([key(0), key(1)]) == [0, 1]
    assert bm.allocate(1) == [1]  # evicts key(1)
    assert bm.match_prefix([key(0), key(1)]) == [0]
    assert bm.num_evicted == 1


def test_eviction_order_is_lru_among_cached_blocks_and_hook_sees_them_before_reuse() -> None:
    seen: list[list[tuple[int, BlockHash | None, int]]] = []

    def hook(blocks: list[Block]) -> None:
        # Called before the blocks are reset: key and id are still the evicted content's.
        seen.append([(b.block_id, b.key, b.ref_count) for b in blocks])

    bm = BlockManager(3, on_evict=hook)
    ids = bm.allocate(3)
    for i in ids:
        bm.register(i, key(i))
    bm.release([0])
    bm.release([2])
    bm.release([1])
    bm.acquire([2])  # a prefix hit: 2 leaves the free list
    bm.release([2])  # and goes back as the most recently used
    assert bm.allocate(2) == [0, 1]
    assert seen == [[(0, key(0), 0), (1, key(1), 0)]]
    assert bm.match_prefix([key(2)]) == [2]


def test_reference_counts_for_shared_prefix_blocks() -> None:
    bm = BlockManager(4)
    ids = bm.allocate(2)
    bm.register(ids[0], key(7))
    hits = bm.match_prefix([key(7), key(8)])
    assert hits == [0]
    bm.acquire(hits)
    assert bm.blocks[0].ref_count == 2
    bm.release(ids)
    assert bm.blocks[0].ref_count == 1 and bm.num_free_blocks == 3
    assert bm.num_free_among([0, 1]) == 1
    bm.release(hits)
    assert bm.blocks[0].ref_count == 0 and bm.num_free_blocks == 4


def test_duplicate_content_keeps_the_first_block_indexed() -> None:
    bm = BlockManager(3)
    a, b = bm.allocate(2)
    bm.register(a, key(1))
    bm.register(b, key(1))
    assert bm.match_prefix([key(1)]) == [a]
    bm.release([b])
    bm.allocate(2)  # reuses b (and the free third block): a stays indexed
    assert bm.match_prefix([key(1)]) == [a]


def test_double_release_is_an_invariant_violation() -> None:
    bm = BlockManager(2)
    ids = bm.allocate(1)
    bm.release(ids)
    with pytest.raises(AssertionError, match="released more often"):
        bm.release(ids)


def test_bad_size() -> None:
    with pytest.raises(ValueError):
        BlockManager(0)
