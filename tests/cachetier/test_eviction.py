"""Eviction policies: exact victim order on hand-made sequences, S3-FIFO's scan resistance,
and the protocol every policy in ``POLICIES`` keeps (checked against a model with hypothesis)."""

from __future__ import annotations

from collections.abc import Hashable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachetier.primitives.keys import KVLayout, Namespace
from cachetier.tiers.cpu import CPUTier, CPUTierConfig
from cachetier.tiers.eviction import (
    POLICIES,
    ARCPolicy,
    EvictionPolicy,
    LRUPolicy,
    S3FIFOPolicy,
    make_policy,
)
from tests.support import make_blocks


def _drain(policy: EvictionPolicy) -> list[Hashable | None]:
    out: list[Hashable | None] = []
    while True:
        out.append(policy.pop_victim())
        if out[-1] is None:
            return out


def test_lru_evicts_the_least_recently_used() -> None:
    policy = LRUPolicy()
    for key in "abc":
        policy.insert(key)
    policy.touch("a")
    assert _drain(policy) == ["b", "c", "a", None]


def test_s3fifo_filters_untouched_keys_and_promotes_touched_ones() -> None:
    policy = S3FIFOPolicy()
    for key in "abcd":
        policy.insert(key)  # small queue: a b c d
    policy.touch("b")
    assert policy.pop_victim() == "a"  # untouched: out, remembered in the ghost queue
    assert policy.pop_victim() == "c"  # b was touched: promoted to main, c goes instead
    policy.insert("a")  # remembered: straight into main (b a); small holds d
    assert policy.pop_victim() == "d"  # small holds 1 of 3 keys (>= 10%): it gives one up
    policy.touch("b")
    # Small is empty: main evicts; b's touch buys it one pass (reinserted behind a).
    assert _drain(policy) == ["a", "b", None]


def test_s3fifo_ghost_is_bounded_by_the_main_queue_share() -> None:
    policy = S3FIFOPolicy()
    for key in range(100):
        policy.insert(key)
    evicted = [policy.pop_victim() for _ in range(90)]
    assert evicted == list(range(90))  # nothing was touched: first in, first out
    # 11 keys were held at the last eviction, so the ghost kept the last 9 (90% of 11).
    for key in [*range(81, 90), *range(81)]:
        policy.insert(key)  # 81..89 are remembered: main; 0..80 are not: small
    assert _drain(policy) == [*range(90, 100), *range(81), *range(81, 90), None]


def test_s3fifo_keeps_a_hot_set_through_a_scan_that_flushes_lru() -> None:
    capacity, hot = 10, [f"hot{i}" for i in range(5)]
    scan = [f"scan{i}" for i in range(200)]  # each read once, never again

    def survivors(policy: EvictionPolicy) -> set[str]:
        held: set[Hashable] = set()
        for key in [*hot, *hot, *scan]:  # the hot keys are read twice before the scan
            _access(policy, held, key, capacity)
        return {k for k in hot if k in held}

    assert survivors(S3FIFOPolicy()) == set(hot)
    assert survivors(LRUPolicy()) == set()


def test_arc_moves_its_target_with_ghost_hits() -> None:
    policy = ARCPolicy()
    for key in "abc":
        policy.insert(key)  # t1: a b c
    policy.touch("a")  # seen twice: t2
    assert policy.pop_victim() == "b"  # t1 (b c) is over its target 0: b goes, remembered in b1
    policy.insert("b")  # a b1 hit: recency wanted room, target of t1 -> 1; b joins t2 (a b)
    assert policy.pop_victim() == "a"  # t1 (c) is at its target: t2's least recent goes
    policy.insert("a")  # a b2 hit: frequency wanted room, target of t1 -> 0; t2: b a
    assert _drain(policy) == ["c", "b", "a", None]


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_keeps_the_protocol(name: str) -> None:
    policy = make_policy(name)
    assert len(policy) == 0 and policy.pop_victim() is None
    policy.touch("absent")  # a touch or remove of an unknown key does nothing
    policy.remove("absent")
    for key in "abcd":
        policy.insert(key)
    policy.insert("a")  # inserting a held key again does not hold it twice
    assert len(policy) == 4
    policy.remove("b")
    assert len(policy) == 3
    victims = _drain(policy)
    assert sorted(victims[:-1]) == ["a", "c", "d"] and victims[-1] is None


def test_unknown_policy_name_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="not one of"):
        make_policy("mru")
    with pytest.raises(ValueError, match="small_ratio"):
        S3FIFOPolicy(small_ratio=1.5)


_OPS = st.lists(st.tuples(st.sampled_from(["access", "remove", "pop"]), st.integers(0, 40)))


@pytest.mark.parametrize("name", sorted(POLICIES))
@settings(max_examples=150, deadline=None)
@given(ops=_OPS)
def test_every_policy_agrees_with_a_model_of_what_is_held(
    name: str, ops: list[tuple[str, int]]
) -> None:
    policy = make_policy(name)
    held: set[Hashable] = set()
    for op, key in ops:
        if op == "access":
            _access(policy, held, key, capacity=8)
        elif op == "remove":
            policy.remove(key)
            held.discard(key)
        else:
            victim = policy.pop_victim()
            assert (victim is None) == (not held), "a victim iff something is held"
            held.discard(victim)
        assert len(policy) == len(held)
    assert set(_drain(policy)[:-1]) == held, "draining gives back exactly the held keys"


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_tier_evicts_in_its_policy_order(name: str) -> None:
    namespace = Namespace("model-a", KVLayout("float16", 16, 1, 1, 8))
    blocks = make_blocks(namespace, 12)
    tier = CPUTier(CPUTierConfig(4 * blocks[0].nbytes, policy=name))
    shadow = make_policy(name)
    held: set[Hashable] = set()
    for i in [0, 1, 2, 3, 0, 1, 4, 5, 0, 6, 7, 8, 1, 9, 10, 0, 11]:
        _access(shadow, held, blocks[i].key, capacity=4)
        if tier.get_many(namespace.id, [blocks[i].key])[0] is None:
            tier.put_many(namespace.id, [blocks[i]])
    found = tier.get_many(namespace.id, [b.key for b in blocks])
    assert {b.key for b, g in zip(blocks, found) if g is not None} == held


def _access(policy: EvictionPolicy, held: set[Hashable], key: Hashable, capacity: int) -> None:
    """What a tier does on a read or write of ``key`` with room for ``capacity`` keys."""
    if key in held:
        policy.touch(key)
        return
    policy.insert(key)
    held.add(key)
    while len(held) > capacity:
        victim = policy.pop_victim()
        assert victim in held, f"victim {victim!r} is not held"
        held.discard(victim)
