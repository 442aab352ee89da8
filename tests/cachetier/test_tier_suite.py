"""One suite, every tier: put, get, miss, a put of a held key, eviction order, capacity,
corrupt data, restart, namespaces, bad input."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from cachetier.primitives.keys import KVLayout, Namespace
from cachetier.record import KVBlock
from cachetier.store.tiered import TieredStore
from cachetier.tiers.base import Tier
from cachetier.util.landing import Runs
from tests.cachetier.tier_harness import TierHarness, build, kinds
from tests.support import make_blocks

BIG = 1 << 30


def _harness(request: pytest.FixtureRequest, kind: str, tmp_path: Path) -> Iterator[TierHarness]:
    h = build(kind, tmp_path, request.getfixturevalue)
    yield h
    h.close_all()


@pytest.fixture(params=kinds())
def harness(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TierHarness]:
    yield from _harness(request, request.param, tmp_path)


# Capacity and eviction order are a tier's own; a stack of tiers inherits them from its parts.
@pytest.fixture(params=kinds(exact_lru=True))
def lru_harness(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TierHarness]:
    yield from _harness(request, request.param, tmp_path)


# The CPU tier's blocks never leave this process's memory, so nothing can corrupt them.
@pytest.fixture(params=kinds(corruptible=True))
def corruptible_harness(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TierHarness]:
    yield from _harness(request, request.param, tmp_path)


# An in-process tier starts empty by design.
@pytest.fixture(params=kinds(persistent=True))
def persistent_harness(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TierHarness]:
    yield from _harness(request, request.param, tmp_path)


def _settle(tier: Tier) -> None:
    if isinstance(tier, TieredStore):
        tier.flush()


def _same(a: KVBlock | None, b: KVBlock) -> bool:
    return a is not None and a.key == b.key and bytes(a.data) == bytes(b.data)


def test_put_then_get(harness: TierHarness, namespace: Namespace) -> None:
    tier = harness.open(BIG)
    blocks = make_blocks(namespace, 5)
    assert tier.put_many(namespace.id, blocks) == 5
    got = tier.get_many(namespace.id, [b.key for b in blocks])
    assert all(_same(g, b) for g, b in zip(got, blocks))
    assert got[0] is not None and got[0].fingerprint == namespace.fingerprint
    assert got[0].shape == blocks[0].shape and got[0].dtype == "float16"


def test_get_into_lands_payloads_in_caller_buffers(
    harness: TierHarness, namespace: Namespace
) -> None:
    tier = harness.open(BIG)
    stored, absent = make_blocks(namespace, 2)
    tier.put_many(namespace.id, [stored])
    _settle(tier)
    dests = [memoryview(bytearray(len(stored.data))) for _ in range(2)]
    got = tier.get_into(namespace.id, [stored.key, absent.key], dests)
    assert got[1] is None and _same(got[0], stored)
    assert bytes(dests[0]) == bytes(stored.data)
    with pytest.raises(ValueError, match="destinations"):
        tier.get_into(namespace.id, [stored.key], dests)


def test_get_into_scatters_runs_to_their_offsets(
    harness: TierHarness, namespace: Namespace
) -> None:
    # An engine whose memory orders a block's runs otherwise (LMCache's [K/V, layers, ...]).
    tier = harness.open(BIG)
    stored = make_blocks(namespace, 1)[0]
    payload = bytes(stored.data)
    run = len(payload) // 4
    offsets = (2 * run, 0, 3 * run, run)  # run i of the payload goes to offsets[i]
    dest = Runs(memoryview(bytearray(len(payload))), run, offsets)
    tier.put_many(namespace.id, [stored])
    _settle(tier)
    got = tier.get_into(namespace.id, [stored.key], [dest])[0]
    assert got is not None and got.data is dest.buffer
    for i, offset in enumerate(offsets):
        assert bytes(dest.buffer[offset : offset + run]) == payload[i * run : (i + 1) * run]


def test_miss_is_none_and_counted(harness: TierHarness, namespace: Namespace) -> None:
    tier = harness.open(BIG)
    stored, absent = make_blocks(namespace, 2)
    tier.put_many(namespace.id, [stored])
    assert tier.get_many(namespace.id, [absent.key, stored.key])[0] is None
    stats = tier.stats()
    assert (stats["misses"], stats["hits"]) == (1, 1)


def test_contains_prefix_counts_the_leading_run(harness: TierHarness, namespace: Namespace) -> None:
    tier = harness.open(BIG)
    blocks = make_blocks(namespace, 6)
    tier.put_many(namespace.id, blocks[:3] + blocks[4:])
    _settle(tier)
    keys = [b.key for b in blocks]
    assert tier.contains_prefix(namespace.id, keys) == 3
    assert tier.contains_prefix(namespace.id, keys[4:]) == 2
    assert tier.contains_prefix(namespace.id, []) == 0


def test_a_put_of_a_present_key_does_not_rewrite_it(
    harness: TierHarness, namespace: Namespace
) -> None:
    # A record under a key is the same KV whoever computed it (the key chains the tokens under
    # a namespace of model, layout and tenant); a recompute differs only in rounding. So a put
    # of a held key is a use, counted, and the record stays as it was.
    tier = harness.open(BIG)
    first = make_blocks(namespace, 1, seed=1)[0]
    second = make_blocks(namespace, 1, seed=2)[0]
    again = KVBlock(first.key, first.fingerprint, first.dtype, first.shape, 16, second.data)
    assert tier.put_many(namespace.id, [first]) == 1
    _settle(tier)
    assert harness.count_skipped(tier) == 0
    assert tier.put_many(namespace.id, [again]) == 1  # held: what a put promises
    _settle(tier)
    assert _same(tier.get_many(namespace.id, [first.key])[0], first)
    assert harness.count_skipped(tier) >= 1
    # A key that left the tier is written again.
    assert tier.delete(namespace.id, [first.key]) == 1
    tier.put_many(namespace.id, [again])
    _settle(tier)
    assert _same(tier.get_many(namespace.id, [first.key])[0], again)


def test_delete_and_clear(harness: TierHarness, namespace: Namespace) -> None:
    tier = harness.open(BIG)
    blocks = make_blocks(namespace, 4)
    other = Namespace("another-model", namespace.layout)
    other_blocks = make_blocks(other, 2)
    tier.put_many(namespace.id, blocks)
    tier.put_many(other.id, other_blocks)
    _settle(tier)
    assert tier.delete(namespace.id, [blocks[0].key]) == 1
    assert tier.get_many(namespace.id, [blocks[0].key]) == [None]
    assert tier.clear(namespace.id) == 3
    assert tier.get_many(namespace.id, [b.key for b in blocks]) == [None] * 4
    assert all(tier.get_many(other.id, [b.key for b in other_blocks]))


def test_namespaces_are_separate(harness: TierHarness, namespace: Namespace) -> None:
    tier = harness.open(BIG)
    block = make_blocks(namespace, 1)[0]
    tier.put_many(namespace.id, [block])
    _settle(tier)
    assert tier.get_many("tenant-b", [block.key]) == [None]
    assert tier.contains_prefix("tenant-b", [block.key]) == 0


def test_eviction_is_least_recently_used_first(
    lru_harness: TierHarness, namespace: Namespace
) -> None:
    blocks = make_blocks(namespace, 5)
    per_block = blocks[0].nbytes + lru_harness.overhead_bytes
    tier = lru_harness.open(3 * per_block)
    tier.put_many(namespace.id, blocks[:3])
    tier.get_many(namespace.id, [blocks[0].key])  # 0 is now the most recent
    tier.put_many(namespace.id, [blocks[3]])  # evicts 1
    tier.put_many(namespace.id, [blocks[4]])  # evicts 2
    present = [g is not None for g in tier.get_many(namespace.id, [b.key for b in blocks])]
    assert present == [True, False, False, True, True]
    assert tier.stats()["evictions"] == 2
    assert tier.used_bytes <= 3 * per_block


def test_capacity_is_in_bytes(lru_harness: TierHarness, namespace: Namespace) -> None:
    blocks = make_blocks(namespace, 10)
    per_block = blocks[0].nbytes + lru_harness.overhead_bytes
    tier = lru_harness.open(4 * per_block + per_block // 2)
    tier.put_many(namespace.id, blocks)
    assert tier.used_bytes <= 4 * per_block + per_block // 2
    present = [g is not None for g in tier.get_many(namespace.id, [b.key for b in blocks])]
    assert present == [False] * 6 + [True] * 4


def test_a_block_larger_than_the_tier_is_rejected(
    lru_harness: TierHarness, namespace: Namespace
) -> None:
    tier = lru_harness.open(100)
    block = make_blocks(namespace, 1)[0]
    assert tier.put_many(namespace.id, [block]) == 0
    assert tier.get_many(namespace.id, [block.key]) == [None]
    assert tier.stats()["rejected"] == 1


def test_corrupt_data_is_a_miss_and_deleted(
    corruptible_harness: TierHarness, namespace: Namespace
) -> None:
    tier = corruptible_harness.open(BIG)
    blocks = make_blocks(namespace, 2)
    tier.put_many(namespace.id, blocks)
    _settle(tier)
    assert corruptible_harness.corrupt is not None
    corruptible_harness.corrupt(tier, namespace.id, blocks[0].key)
    got = tier.get_many(namespace.id, [b.key for b in blocks])
    assert got[0] is None and _same(got[1], blocks[1])
    assert tier.contains_prefix(namespace.id, [blocks[0].key]) == 0  # deleted, not kept
    assert corruptible_harness.count_corrupt(tier) == 1


def test_a_put_over_a_corrupt_record_writes_it_again(
    corruptible_harness: TierHarness, namespace: Namespace
) -> None:
    tier = corruptible_harness.open(BIG)
    block = make_blocks(namespace, 1)[0]
    tier.put_many(namespace.id, [block])
    _settle(tier)
    assert corruptible_harness.corrupt is not None
    corruptible_harness.corrupt(tier, namespace.id, block.key)
    assert tier.get_many(namespace.id, [block.key]) == [None]  # found corrupt: removed
    tier.put_many(namespace.id, [block])
    _settle(tier)
    assert _same(tier.get_many(namespace.id, [block.key])[0], block)


def test_restart_finds_every_block(persistent_harness: TierHarness, namespace: Namespace) -> None:
    first = persistent_harness.open(BIG)
    blocks = make_blocks(namespace, 20)
    first.put_many(namespace.id, blocks)
    first.close()
    second = persistent_harness.open(BIG)
    keys = [b.key for b in blocks]
    assert second.contains_prefix(namespace.id, keys) == 20
    assert all(_same(g, b) for g, b in zip(second.get_many(namespace.id, keys), blocks))


def test_blocks_of_every_layout_round_trip(harness: TierHarness) -> None:
    tier = harness.open(BIG)
    layout = KVLayout("float32", block_size=8, num_layers=3, num_kv_heads=1, head_dim=4)
    ns = Namespace("m", layout)
    blocks = make_blocks(ns, 2, layout=layout)
    tier.put_many(ns.id, blocks)
    _settle(tier)
    got = tier.get_many(ns.id, [b.key for b in blocks])
    assert all(_same(g, b) for g, b in zip(got, blocks))
    assert got[0] is not None and got[0].dtype == "float32" and got[0].shape == (3, 2, 8, 1, 4)


@pytest.mark.parametrize("bad", ["", "../etc", "a/b", ".hidden", "x" * 200, "sp ace", "ns\n"])
def test_bad_namespace_is_a_value_error(
    harness: TierHarness, bad: str, namespace: Namespace
) -> None:
    tier = harness.open(BIG)
    with pytest.raises(ValueError, match="namespace"):
        tier.get_many(bad, [make_blocks(namespace, 1)[0].key])
