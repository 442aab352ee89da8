"""Trace replay for reports: the two-tier store's hits on the hand-made trace, agreement with
``cachetier.report.replay``, synthetic tenants, and the conversation trace against an independent
LRU
simulation."""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path

import pytest

from cachetier.report.build import build_report
from cachetier.report.config import ReportConfig
from cachetier.report.hierarchy_replay import replay_for_report, replay_hierarchy, tenant_of
from cachetier.report.replay import ReplayTrace, TraceRequest, read_trace, replay_tier
from tests.cachetier.report import tiny
from tests.support import CONVERSATION_TRACE as CONVERSATION


@pytest.fixture
def tiny_trace(tmp_path: Path) -> ReplayTrace:
    return ReplayTrace.load(tiny.write_tiny_trace(tmp_path / "tiny.jsonl"))


def _config(**overrides: object) -> ReportConfig:
    values: dict[str, object] = dict(
        trace="tiny.jsonl", cpu_blocks=tiny.CPU_BLOCKS, disk_blocks=tiny.DISK_BLOCKS, quiet=True
    )
    values.update(overrides)
    return ReportConfig(**values)  # type: ignore[arg-type]


def test_two_tier_hits_are_the_hand_worked_ones(tiny_trace: ReplayTrace) -> None:
    tenants = ["t"] * len(tiny.REQUESTS)
    events, hit_blocks = replay_hierarchy(tiny_trace, _config(), tenants)
    assert hit_blocks == tiny.HIT_BLOCKS
    assert [{k: v for k, v in e.hit_tokens.items() if v} for e in events] == tiny.HIT_TOKENS
    assert [e.num_alignment_lost_tokens for e in events] == tiny.LOST_TOKENS
    assert [e.time_s for e in events] == [t / 1000 for t, _, _ in tiny.REQUESTS]
    assert [e.num_tokens for e in events] == [n for _, n, _ in tiny.REQUESTS]
    assert {e.block_size for e in events} == {512}


def test_an_inclusive_lru_store_hits_what_its_lower_tier_alone_hits(tmp_path: Path) -> None:
    # LRU's stack property: the small upper tier holds a subset of the large lower one, so the
    # store's hits are those of one LRU of the lower tier's size, token for token.
    lines = []
    for i in range(400):
        conv = i % 37
        turn = i // 37
        ids = [0, 1000 + conv, *(10_000 + conv * 100 + t for t in range(turn))]
        lines.append(
            json.dumps(
                {
                    "timestamp": i * 10,
                    "input_length": 512 * len(ids) - (i % 300),
                    "output_length": 1,
                    "hash_ids": ids,
                }
            )
        )
    path = tmp_path / "conv.jsonl"
    path.write_text("\n".join(lines))
    trace = ReplayTrace.load(path)
    config = _config(cpu_blocks=20, disk_blocks=90)
    events, hit_blocks = replay_hierarchy(trace, config, ["t"] * len(lines))
    alone = replay_tier(trace, "lru", 90)
    assert hit_blocks == [r.num_hit_blocks for r in alone.records]
    assert [e.num_hit_tokens for e in events] == [r.num_hit_tokens for r in alone.records]
    assert [e.num_alignment_lost_tokens for e in events] == [
        r.num_alignment_lost_tokens for r in alone.records
    ]
    by_tier = {name: sum(e.hit_tokens[name] for e in events) for name in ("cpu", "disk")}
    assert by_tier["cpu"] > 0 and by_tier["disk"] > 0


def test_tenants_follow_the_conversation_and_stay_in_range() -> None:
    first = TraceRequest(0, 1024, 1, (0, 7))
    later_turn = TraceRequest(5, 2048, 1, (0, 7, 8, 9))
    assert tenant_of(first, 5) == tenant_of(later_turn, 5)
    names = {tenant_of(TraceRequest(0, 1024, 1, (0, i)), 3) for i in range(100)}
    assert names == {"tenant-0", "tenant-1", "tenant-2"}
    assert tenant_of(first, 1) == "tenant-0"


def test_every_curve_replay_is_run_once_per_capacity(tiny_trace: ReplayTrace) -> None:
    replays = replay_for_report(tiny_trace, _config(capacities=(1, 2, 5)))
    caps = (1, 2, 3, 5, 100)  # the two tier sizes join the curve
    assert set(replays.curve) == {"lru", "s3fifo", "arc", "belady"}
    for results in replays.curve.values():
        assert tuple(r.capacity_blocks for r in results) == caps
    assert replays.curve["lru"][-1].num_hit_blocks == sum(tiny.HIT_BLOCKS)
    assert replays.ceiling.num_hit_blocks == sum(tiny.HIT_BLOCKS)
    for lru, belady in zip(replays.curve["lru"], replays.curve["belady"]):
        assert lru.num_hit_blocks <= belady.num_hit_blocks <= replays.ceiling.num_hit_blocks


def independent_lru(requests: list[TraceRequest], capacity: int) -> float:
    """Block hit ratio of a plain LRU over hash ids (an OrderedDict; no cachetier code)."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = refs = 0
    for request in requests:
        for hash_id in request.hash_ids:
            if hash_id not in cache:
                break
            hits += 1
        refs += len(request.hash_ids)
        for hash_id in request.hash_ids:
            if hash_id in cache:
                cache.move_to_end(hash_id)
            else:
                cache[hash_id] = None
                if len(cache) > capacity:
                    cache.popitem(last=False)
    return hits / refs


def independent_ceiling(requests: list[TraceRequest]) -> float:
    seen: set[int] = set()
    hits = refs = 0
    for request in requests:
        for hash_id in request.hash_ids:
            if hash_id not in seen:
                break
            hits += 1
        refs += len(request.hash_ids)
        seen.update(request.hash_ids)
    return hits / refs


@pytest.mark.slow(
    reason="builds the whole conversation trace's report and an independent LRU of it"
)
def test_the_report_reproduces_an_independent_lru_on_the_conversation_trace() -> None:
    config = ReportConfig(
        trace=str(CONVERSATION), capacities=(10_000, 50_000), quiet=True, exact=True
    )
    doc = json.loads(json.dumps(build_report(config)))  # as the JSON output holds it
    requests = read_trace(CONVERSATION)
    at = doc["headline"]["at_capacity"]
    for capacity, published in ((10_000, 0.2112), (50_000, 0.3546)):
        reported = at[str(capacity)]["lru"]
        assert reported == pytest.approx(independent_lru(requests, capacity), abs=1e-12)
        assert reported == pytest.approx(published, abs=0.001)
        assert at[str(capacity)][doc["headline"]["default_policy"]] >= reported
    ceiling = independent_ceiling(requests)
    assert doc["headline"]["ceiling"] == pytest.approx(ceiling, abs=1e-12)
    assert ceiling == pytest.approx(0.3664, abs=0.0001)
    # The two-tier store (10k over 50k, LRU) hits what one 50k LRU hits.
    assert doc["headline"]["block_hit_ratio"] == pytest.approx(at["50000"]["lru"], abs=1e-12)
    assert doc["figures"]["capacity_curve"]["default_ge_lru_at_every_capacity"] is True


def test_the_guard_computes_the_first_hit_of_each_tier(tiny_trace: ReplayTrace) -> None:
    events, hit_blocks = replay_hierarchy(
        tiny_trace, _config(guard_first_hits=1), ["t"] * len(tiny.REQUESTS)
    )
    assert hit_blocks == tiny.HIT_BLOCKS  # what the tiers hold is unchanged
    # Request 1 is the CPU tier's first hit and request 4 the disk tier's: computed.
    assert [e.verified_tokens for e in events] == [0, 1024, 0, 0, 512, 0]
    assert [{k: v for k, v in e.hit_tokens.items() if v} for e in events] == [
        {},
        {},
        {"cpu": 1024},
        {},
        {},
        {"cpu": 1024, "disk": 512},
    ]


def test_a_pool_above_the_tiers_takes_the_hits_it_holds(tiny_trace: ReplayTrace) -> None:
    tenants = ["t"] * len(tiny.REQUESTS)
    alone, _ = replay_hierarchy(tiny_trace, _config(), tenants)
    pooled, _ = replay_hierarchy(tiny_trace, _config(pool_blocks=100), tenants)
    assert [sum(e.hit_tokens.values()) for e in pooled] == [
        sum(e.hit_tokens.values()) for e in alone
    ]
    assert all(set(k for k, v in e.hit_tokens.items() if v) <= {"pool"} for e in pooled)
    # The guard never draws from the pool: it is the engine's own memory, not a tier.
    guarded, _ = replay_hierarchy(tiny_trace, _config(pool_blocks=100, guard_first_hits=1), tenants)
    assert [e.hit_tokens for e in guarded] == [e.hit_tokens for e in pooled]
    assert all(e.verified_tokens == 0 for e in guarded)


def test_the_report_cli_models_the_pool_and_the_guard(tmp_path: Path) -> None:
    trace = tiny.write_tiny_trace(tmp_path / "tiny.jsonl")
    config = _config(trace=str(trace), pool_blocks=2, guard_first_hits=1)
    doc = build_report(config)
    head = doc["headline"]
    assert doc["settings"]["pool_blocks"] == 2 and doc["settings"]["guard_first_hits"] == 1
    assert head["verified_by_guard_tokens"] > 0
    assert head["hit_tokens"] + head["verified_by_guard_tokens"] == 4096


def _trace(tmp_path: Path, requests: list[tuple[list[int], int, int]]) -> ReplayTrace:
    path = tmp_path / "hand.jsonl"
    lines = [
        json.dumps({"timestamp": i, "input_length": n, "output_length": out, "hash_ids": ids})
        for i, (ids, n, out) in enumerate(requests)
    ]
    path.write_text("\n".join(lines) + "\n")
    return ReplayTrace.load(path)


def _pool_and_cpu(trace: ReplayTrace, **config: object) -> list[tuple[int, int]]:
    events, _ = replay_hierarchy(
        trace, _config(cpu_blocks=100, disk_blocks=100, **config), ["t"] * len(trace.requests)
    )
    return [(e.hit_tokens.get("pool", 0), e.hit_tokens.get("cpu", 0)) for e in events]


def test_the_pool_evicts_a_freed_prompt_tail_first(tmp_path: Path) -> None:
    # Engines free a finished request's blocks tail first, so a full pool gives up block 3
    # of [1, 2, 3] and keeps the head a later prompt starts with; 3 then comes from the CPU tier.
    trace = _trace(tmp_path, [([1, 2, 3], 1536, 1), ([4], 512, 1), ([1, 2, 3, 9], 2048, 1)])
    assert _pool_and_cpu(trace, pool_blocks=3)[2] == (1024, 512)


def test_running_requests_hold_their_blocks_and_finish_in_their_own_order(
    tmp_path: Path,
) -> None:
    # r0 decodes long; r1 finishes first, so with two in flight r2 evicts r1's blocks, not the
    # blocks r0 still holds, and r3 finds r0's prompt in the pool. One at a time, r0 was freed
    # before r1 and its blocks went first: r3 then loads them from the CPU tier.
    requests = [
        ([1, 2], 1024, 2000),
        ([3, 4], 1024, 1),
        ([5, 6], 1024, 1),
        ([1, 2, 7], 1536, 1),
    ]
    trace = _trace(tmp_path, requests)
    assert _pool_and_cpu(trace, pool_blocks=4, in_flight=2)[3] == (1024, 0)
    assert _pool_and_cpu(trace, pool_blocks=4, in_flight=1)[3] == (0, 1024)
    with pytest.raises(ValueError, match="in-flight"):
        _config(in_flight=0)
