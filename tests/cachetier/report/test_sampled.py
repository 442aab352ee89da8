"""The sampled capacity curve: exact at rate 1, close to the exact replay on a prefix trace
with a prompt shared by every request, hot keys always kept, the rate chosen for the error
bound, and the replays' lookup equal to ``TieredStore.lookup``."""

from __future__ import annotations

from pathlib import Path

import pytest

from cachetier.report.lookup import leading_spans
from cachetier.report.replay import ReplayTrace, replay_belady, replay_tier
from cachetier.report.sampled import HOT_REFS, sample_rate, sample_trace
from cachetier.report.workers import run_job
from cachetier.store.tiered import TieredStore
from cachetier.tiers.cpu import CPUTier, CPUTierConfig
from tests.cachetier.report import tiny
from tests.cachetier.report.chat import chat_trace


@pytest.fixture(scope="module")
def chat() -> ReplayTrace:
    return chat_trace()


def test_rate_one_is_the_exact_replay(tmp_path: Path) -> None:
    trace = ReplayTrace.load(tiny.write_tiny_trace(tmp_path / "tiny.jsonl"))
    whole = sample_trace(trace, 1.0)
    for policy, capacity in (("lru", 3), ("arc", 2), ("lru", 100)):
        exact = replay_tier(trace, policy, capacity)
        point = run_job(whole, (policy, capacity))
        assert point.num_hit_blocks == exact.num_hit_blocks
        assert point.num_hit_tokens == exact.num_hit_tokens
    belady = replay_belady(trace, 2)
    assert run_job(whole, ("belady", 2)).num_hit_blocks == belady.num_hit_blocks


def test_the_sample_keeps_hot_keys_and_is_close_to_the_exact_curve(chat: ReplayTrace) -> None:
    sampled = sample_trace(chat, 0.25)
    assert sampled.weight == 4
    system = chat.keys[0][:4]
    assert all(keys[:4] == system for keys in sampled.trace.keys)  # in every request: hot
    assert sampled.num_kept_refs < 0.6 * sampled.num_refs
    for policy in ("lru", "s3fifo", "belady"):
        for capacity in (200, 1_000, 4_000):
            exact = run_job(sample_trace(chat, 1.0), (policy, capacity)).block_hit_ratio
            estimate = run_job(sampled, (policy, capacity)).block_hit_ratio
            # A loose bound for a small trace: the benchmark measures the real one.
            assert estimate == pytest.approx(exact, abs=0.03), (policy, capacity)


def test_the_rate_follows_the_error_bound() -> None:
    assert sample_rate(1_000, 0.005) == 1.0  # few keys: replayed whole
    assert sample_rate(240_000, 0.005) == pytest.approx(1 / 10)
    assert sample_rate(240_000, 0.01) == pytest.approx(1 / 40)
    for bad in (0, 1, -0.1):
        with pytest.raises(ValueError, match="max_error"):
            sample_rate(1_000, bad)
    assert HOT_REFS >= 2


def test_the_replays_lookup_is_the_store_s(chat: ReplayTrace) -> None:
    ns = chat.namespace.id
    mine = [CPUTier(CPUTierConfig(c)) for c in (50, 300)]
    theirs = [CPUTier(CPUTierConfig(c)) for c in (50, 300)]
    with TieredStore(theirs) as store:
        for keys, blocks in list(zip(chat.keys, chat.blocks))[:800]:
            hit = store.lookup(ns, keys)
            assert leading_spans(mine, ns, keys) == (hit.num_blocks, hit.spans)
            for tiers in (mine, theirs):
                tiers[0].put_many(ns, blocks)
                tiers[1].put_many(ns, blocks[::2])  # the lower tier holds gaps
