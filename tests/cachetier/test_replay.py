"""Trace replay: parsing errors, deterministic keys, exact hit accounting on a hand-made trace,
Belady against a brute-force twin, and the conversation-trace figures against an independent
LRU simulation."""

from __future__ import annotations

import dataclasses
import functools
import gzip
import json
import random
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from cachetier.primitives.keys import block_keys
from cachetier.report.replay import (
    ReplayResult,
    ReplayTrace,
    RequestRecord,
    TraceRequest,
    parse_trace,
    read_trace,
    replay_belady,
    replay_infinite,
    replay_tier,
    synthetic_tokens,
)
from cachetier.store.config import StoreConfig
from cachetier.tiers.eviction import POLICIES, make_policy
from tests.support import CONVERSATION_TRACE as CONVERSATION


def _line(ts: int, length: int, ids: list[int]) -> str:
    return json.dumps(
        {"timestamp": ts, "input_length": length, "output_length": 7, "hash_ids": ids}
    )


# Five requests over blocks 1..6 (512 tokens each; the last block of a request may be partial).
TINY = [
    _line(0, 1100, [1, 2, 3]),  # 3 blocks, the last of 76 tokens
    _line(5, 1100, [1, 2, 3]),  # all three hit; a whole-block cache reuses 1024 of 1100
    _line(9, 1600, [1, 2, 4, 5]),
    _line(12, 512, [6]),
    _line(20, 1024, [1, 2]),
]


@pytest.mark.parametrize(
    "line,error",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "a request is a JSON object"),
        ('{"timestamp": 0, "input_length": 5, "hash_ids": [1]}', "missing field"),
        (_line(-1, 5, [1]), "timestamp must be an int >= 0"),
        (_line(0, 5, [1]).replace('"output_length": 7', '"output_length": true'), "output_length"),
        (_line(0, 5, [1, "x"]), "hash_ids must be a list of ints"),
        (_line(0, 1100, [1, 2]), "needs 3 hash_ids of 512 tokens, got 2"),
    ],
)
def test_a_bad_line_is_named_by_number(line: str, error: str) -> None:
    lines = [TINY[0], "", line]
    with pytest.raises(ValueError, match=f"^t.jsonl:3: .*{error}"):
        parse_trace(lines, source="t.jsonl")


def test_read_trace_parses_every_field_and_skips_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(TINY[:2]) + "\n\n")
    assert read_trace(path) == [
        TraceRequest(0, 1100, 7, (1, 2, 3)),
        TraceRequest(5, 1100, 7, (1, 2, 3)),
    ]


def test_read_trace_decompresses_a_gz_trace(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write("\n".join(TINY[:2]) + "\n")
    assert read_trace(path) == [
        TraceRequest(0, 1100, 7, (1, 2, 3)),
        TraceRequest(5, 1100, 7, (1, 2, 3)),
    ]


def test_the_shipped_conversation_trace_is_the_whole_hour() -> None:
    requests = read_trace(CONVERSATION)
    assert len(requests) == 12_031
    assert sum(len(r.hash_ids) for r in requests) == 288_500


def test_ids_that_are_not_chained_are_refused() -> None:
    requests = parse_trace([_line(0, 1024, [1, 2]), _line(1, 1024, [3, 2])])
    with pytest.raises(ValueError, match="request 1: hash id 2 follows id 3 here but id 1 earlier"):
        ReplayTrace.from_requests(requests)


def test_synthetic_tokens_are_a_function_of_id_and_seed() -> None:
    a = synthetic_tokens([7, 8, 7])
    assert a.shape == (3, 512) and a.dtype == np.uint32 and int(a.max()) < 32_000
    assert np.array_equal(a[0], a[2]) and not np.array_equal(a[0], a[1])
    assert np.array_equal(synthetic_tokens([7])[0], a[0])
    assert not np.array_equal(synthetic_tokens([7], seed=1)[0], a[0])


def test_keys_are_the_engines_chained_keys_of_the_synthetic_tokens() -> None:
    trace = ReplayTrace.from_requests(parse_trace(TINY))
    again = ReplayTrace.from_requests(parse_trace(TINY))
    assert trace.keys == again.keys
    for request, keys in zip(trace.requests, trace.keys):
        tokens = synthetic_tokens(request.hash_ids).reshape(-1)
        assert list(keys) == block_keys(trace.namespace, tokens)
    assert trace.keys[0][:2] == trace.keys[2][:2] == trace.keys[4]  # same ids, same keys
    assert trace.keys[2][2] != trace.keys[0][2]
    reseeded = ReplayTrace.from_requests(parse_trace(TINY), seed=3)
    assert set(reseeded.keys[0]).isdisjoint(trace.keys[0])
    assert all(b.key == k for bs, ks in zip(trace.blocks, trace.keys) for b, k in zip(bs, ks))


def test_lru_hit_accounting_on_a_hand_made_trace() -> None:
    trace = ReplayTrace.from_requests(parse_trace(TINY))
    result = replay_tier(trace, "lru", capacity_blocks=4)
    # r2 stores 4 and 5 (evicting 3); r3 stores 6 (evicting 1), so r4 misses its first block.
    assert result.records == (
        RequestRecord(0, 3, 0, 1100, 0, 0),
        RequestRecord(5, 3, 3, 1100, 1024, 76),
        RequestRecord(9, 4, 2, 1600, 1024, 0),
        RequestRecord(12, 1, 0, 512, 0, 0),
        RequestRecord(20, 2, 0, 1024, 0, 0),
    )
    assert (result.num_blocks, result.num_hit_blocks) == (13, 5)
    assert result.block_hit_ratio == pytest.approx(5 / 13)
    assert result.token_hit_ratio == pytest.approx(2048 / 5336)
    assert result.num_alignment_lost_tokens == 76
    assert result.summary()["policy"] == "lru" and result.summary()["capacity_blocks"] == 4


def test_belady_and_the_ceiling_on_a_hand_made_trace() -> None:
    trace = ReplayTrace.from_requests(parse_trace(TINY))
    # Belady drops 3, 4, 5 (never used again) and keeps 1 and 2 for r4: as good as no limit.
    for result in (replay_belady(trace, 4), replay_infinite(trace)):
        assert [r.num_hit_blocks for r in result.records] == [0, 3, 2, 0, 2]
        # r4's 1,024 tokens fill its two blocks: the second holds its last token, which an
        # engine computes, so only the first is reused.
        assert result.num_hit_tokens == 1024 + 1024 + 512
        assert result.num_alignment_lost_tokens == 76 + 512
    # With room for one block Belady always keeps block 1, the one every request starts with.
    assert [r.num_hit_blocks for r in replay_belady(trace, 1).records] == [0, 1, 1, 0, 1]
    assert replay_infinite(trace).capacity_blocks is None


@pytest.mark.parametrize("capacity", [0, -3, 2.5])
def test_capacity_must_be_a_positive_int(capacity: object) -> None:
    trace = ReplayTrace.from_requests(parse_trace(TINY))
    with pytest.raises(ValueError, match="capacity_blocks"):
        replay_tier(trace, "lru", capacity)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="capacity_blocks"):
        replay_belady(trace, capacity)  # type: ignore[arg-type]


def _random_chained_trace(seed: int, num_requests: int) -> list[TraceRequest]:
    """Conversations that extend, and sometimes branch from, earlier prompts."""
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    next_id = 0
    requests = []
    for ts in range(num_requests):
        base = rng.choice(prompts)[: rng.randint(0, 6)] if prompts and rng.random() < 0.7 else []
        ids = base + list(range(next_id, next_id + rng.randint(1, 4)))
        next_id += len(ids) - len(base)
        prompts.append(ids)
        requests.append(TraceRequest(ts, 512 * len(ids) - rng.randint(0, 511), 1, tuple(ids)))
    return requests


def _belady_brute_force(requests: list[TraceRequest], capacity: int) -> list[int]:
    refs = [h for r in requests for h in r.hash_ids]
    cached: set[int] = set()
    hits, position = [], 0
    for request in requests:
        run = 0
        while run < len(request.hash_ids) and request.hash_ids[run] in cached:
            run += 1
        hits.append(run)
        for hash_id in request.hash_ids:
            position += 1
            cached.add(hash_id)
            if len(cached) > capacity:
                later = refs[position:]
                cached.remove(
                    max(cached, key=lambda h: later.index(h) if h in later else len(refs))
                )
    return hits


@pytest.mark.parametrize("seed", range(5))
def test_belady_matches_a_brute_force_twin(seed: int) -> None:
    requests = _random_chained_trace(seed, 120)
    trace = ReplayTrace.from_requests(requests)
    for capacity in (3, 8, 20):
        got = [r.num_hit_blocks for r in replay_belady(trace, capacity).records]
        assert got == _belady_brute_force(requests, capacity)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_the_tier_replay_is_the_policy_driven_directly(name: str) -> None:
    requests = _random_chained_trace(7, 400)
    trace = ReplayTrace.from_requests(requests)
    capacity = 25
    policy, held, expected = make_policy(name), set(), []
    for request in requests:
        run = 0
        while run < len(request.hash_ids) and request.hash_ids[run] in held:
            run += 1
        expected.append(run)
        for hash_id in request.hash_ids:
            if hash_id in held:
                policy.touch(hash_id)
                continue
            policy.insert(hash_id)
            held.add(hash_id)
            while len(held) > capacity:
                held.remove(policy.pop_victim())
    assert [r.num_hit_blocks for r in replay_tier(trace, name, capacity).records] == expected


def _simple_lru_hits(requests: list[TraceRequest], capacity: int) -> int:
    """The independent simulation the issue quotes its figures from."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for request in requests:
        for hash_id in request.hash_ids:
            if hash_id not in cache:
                break
            hits += 1
        for hash_id in request.hash_ids:
            cache[hash_id] = None
            cache.move_to_end(hash_id)
            if len(cache) > capacity:
                cache.popitem(last=False)
    return hits


@pytest.fixture(scope="module")
def conversation() -> ReplayTrace:
    return ReplayTrace.load(CONVERSATION)


@pytest.fixture(scope="module")
def lru_on_conversation(conversation: ReplayTrace) -> Callable[[int], ReplayResult]:
    """LRU replays of the conversation trace, each capacity replayed once per module."""
    return functools.cache(lambda capacity: replay_tier(conversation, "lru", capacity))


@pytest.mark.slow(reason="replays the whole conversation trace under LRU and a simple simulation")
@pytest.mark.parametrize("capacity,ratio", [(10_000, 0.211), (50_000, 0.355)])
def test_conversation_lru_reproduces_the_simple_simulation(
    conversation: ReplayTrace,
    lru_on_conversation: Callable[[int], ReplayResult],
    capacity: int,
    ratio: float,
) -> None:
    result = lru_on_conversation(capacity)
    assert result.num_blocks == 288_500 and len(result.records) == 12_031
    assert result.num_hit_blocks == _simple_lru_hits(list(conversation.requests), capacity)
    assert round(result.block_hit_ratio, 3) == ratio


@pytest.mark.slow(
    reason="replays the whole conversation trace unbounded, under Belady and under LRU"
)
def test_conversation_ceiling_and_belady_bound_lru(
    conversation: ReplayTrace, lru_on_conversation: Callable[[int], ReplayResult]
) -> None:
    ceiling = replay_infinite(conversation)
    assert round(ceiling.block_hit_ratio, 3) == 0.366
    for capacity in (2_000, 10_000):
        belady = replay_belady(conversation, capacity)
        lru = lru_on_conversation(capacity)
        assert lru.num_hit_blocks <= belady.num_hit_blocks <= ceiling.num_hit_blocks


@pytest.mark.slow(reason="replays the whole conversation trace under LRU and the default policy")
def test_conversation_default_policy_is_no_worse_than_lru(
    conversation: ReplayTrace, lru_on_conversation: Callable[[int], ReplayResult]
) -> None:
    default = str(next(f.default for f in dataclasses.fields(StoreConfig) if f.name == "policy"))
    for capacity in (10_000, 50_000):
        lru = lru_on_conversation(capacity)
        ours = lru if default == "lru" else replay_tier(conversation, default, capacity)
        assert ours.num_hit_blocks >= lru.num_hit_blocks
