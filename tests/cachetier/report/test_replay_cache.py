"""``ReplayCache`` holds what a ``CPUTier`` holds: the same hits, writes and held keys after
every request, under every eviction policy, with 1-byte blocks and with a sample's weighted
ones."""

from __future__ import annotations

import pytest

from cachetier.report.replay import ReplayTrace, replay_tier
from cachetier.report.replay_cache import ReplayCache, replay_hits
from cachetier.report.sampled import sample_trace
from cachetier.tiers.cpu import CPUTier, CPUTierConfig
from cachetier.tiers.eviction import POLICIES
from tests.cachetier.report.chat import chat_trace


@pytest.fixture(scope="module")
def chat() -> ReplayTrace:
    return chat_trace(1_500)


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("rate", [1.0, 0.25])
def test_it_holds_what_a_cpu_tier_holds(chat: ReplayTrace, policy: str, rate: float) -> None:
    trace = sample_trace(chat, rate).trace  # at 0.25 cold blocks weigh 4 bytes, hot ones 1
    ns = trace.namespace.id
    for capacity in (7, 150, 1_200):
        tier = CPUTier(CPUTierConfig(capacity, policy=policy))
        cache = ReplayCache(capacity, policy)
        for number, (keys, blocks) in enumerate(zip(trace.keys, trace.blocks)):
            assert cache.contains_prefix(ns, keys) == tier.contains_prefix(ns, keys), number
            assert cache.put_many(ns, blocks) == tier.put_many(ns, blocks)
            if number % 97 == 0:  # the held keys themselves, now and then
                assert {key for _, key in tier.held_keys()} == set(cache._held)
        assert cache.bytes_in == tier.stats()["bytes_in"]
        assert len(cache) == len(tier.held_keys())


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_its_replay_is_the_cpu_tier_s(chat: ReplayTrace, policy: str) -> None:
    for capacity in (40, 900):
        hits, _ = replay_hits(chat.keys, chat.blocks, policy, capacity)
        want = replay_tier(chat, policy, capacity)
        assert hits == [r.num_hit_blocks for r in want.records]
        assert 0 < sum(hits) < want.num_blocks  # the capacity binds, and something hits


def test_a_block_larger_than_the_cache_is_not_stored(chat: ReplayTrace) -> None:
    cache = ReplayCache(3)
    heavy = sample_trace(chat, 0.25).trace.blocks
    big = next(b for blocks in heavy for b in blocks if b.nbytes == 4)
    assert cache.put_many("ns", [big]) == 0
    assert big.key not in cache and cache.bytes_in == 0
    with pytest.raises(ValueError, match="capacity_bytes"):
        ReplayCache(0)
    with pytest.raises(ValueError, match="eviction policy"):
        ReplayCache(10, "fifo")
