"""The engine's lookup event log: one ``LookupEvent`` per admitted request, with the hit tokens
by source, the alignment loss and the restore time; none for a preempted sequence re-admitted."""

from __future__ import annotations

from pathlib import Path

import pytest

from cachetier.engine.config import EngineConfig
from cachetier.engine.llm import LLM
from cachetier.engine.sampling import SamplingParams
from cachetier.report.events import read_events
from cachetier.store.config import StoreConfig

GREEDY = SamplingParams(temperature=0, max_tokens=4)
PROMPT = [(i * 7 + 3) % 250 for i in range(150)]  # 9 full blocks of 16 and a tail of 6
TINY_BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # layers x K/V x tokens x KV heads x head_dim x fp32


def test_events_say_where_hits_came_from(tiny_model_dir: Path, tmp_path: Path) -> None:
    log = tmp_path / "events" / "lookups.jsonl"
    store = StoreConfig(cpu_bytes=64 << 20, disk_path=str(tmp_path / "disk"), fsync=False)
    with LLM(
        tiny_model_dir, store=store, kv_cache_bytes=4 << 20, event_log=str(log), tenant="acme"
    ) as llm:
        llm.generate([PROMPT], GREEDY)
        llm.generate([PROMPT], GREEDY)  # every full block from the pool
        llm.generate([PROMPT[:100] + [9] * 20], GREEDY)  # 6 blocks, then a miss
        llm.engine.close()
    with LLM(
        tiny_model_dir,
        store=store,
        kv_cache_bytes=4 << 20,
        event_log=str(log),
        tenant="acme",
        guard=False,  # the restore, not its verification (tests/engine/test_guard_engine.py)
    ) as llm:
        llm.generate([PROMPT[:144]], GREEDY)  # whole blocks: the last one is recomputed
        llm.engine.close()

    events = list(read_events(log, strict=True))
    assert [dict(e.hit_tokens) for e in events] == [{}, {"pool": 144}, {"pool": 96}, {"disk": 128}]
    assert [e.num_tokens for e in events] == [150, 150, 120, 144]
    assert [e.num_alignment_lost_tokens for e in events] == [0, 6, 0, 0]
    assert all(e.tenant == "acme" and e.block_size == 16 and e.origin == "engine" for e in events)
    assert events[1].restore_s == 0.0 and events[3].restore_s > 0.0


def test_a_preempted_sequence_logs_one_event(tiny_model_dir: Path, tmp_path: Path) -> None:
    log = tmp_path / "lookups.jsonl"
    prompts = [[(i * k + k) % 250 for i in range(60 + 13 * k)] for k in range(1, 7)]
    # 14 blocks for six sequences that need up to 10 each: preemption must happen.
    llm = LLM(
        tiny_model_dir,
        kv_cache_bytes=14 * TINY_BLOCK_BYTES,
        max_num_batched_tokens=40,
        event_log=str(log),
    )
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12))
    llm.engine.close()
    assert llm.engine.scheduler.num_preemptions > 0
    events = list(read_events(log, strict=True))
    assert sorted(e.num_tokens for e in events) == sorted(len(p) for p in prompts)


def test_no_log_without_prefix_caching(tiny_model_dir: Path, tmp_path: Path) -> None:
    log = tmp_path / "lookups.jsonl"
    llm = LLM(
        tiny_model_dir, kv_cache_bytes=4 << 20, enable_prefix_caching=False, event_log=str(log)
    )
    llm.generate([PROMPT], GREEDY)
    llm.engine.close()
    assert log.read_text() == ""


def test_an_empty_event_log_path_is_refused() -> None:
    with pytest.raises(ValueError, match="event_log"):
        EngineConfig(model="m", event_log=" ")


def test_a_tier_that_is_down_is_the_cause_of_its_misses(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A Redis that refuses connections: the lookup fails, the request computes, and the event
    and the output say the misses were the tier's being down, not a prefix never seen."""
    log = tmp_path / "lookups.jsonl"
    # Port 1 on the loopback: nothing listens, every connection is refused at once.
    store = StoreConfig(cpu_bytes=0, redis_url="redis://127.0.0.1:1/0", redis_timeout_s=0.2)
    with LLM(tiny_model_dir, store=store, kv_cache_bytes=4 << 20, event_log=str(log)) as llm:
        out = llm.generate([PROMPT], GREEDY)[0]
        llm.engine.close()
    assert out.miss_tokens_by_cause == {"tier_down": 144, "partial_block": 6}
    assert out.miss_tier == "redis"
    (event,) = read_events(log, strict=True)
    assert dict(event.miss_tokens) == {"tier_down": 144, "partial_block": 6}


def test_a_prompt_no_tier_ever_held_was_never_stored(tiny_model_dir: Path, tmp_path: Path) -> None:
    store = StoreConfig(cpu_bytes=64 << 20, disk_path=str(tmp_path / "disk"), fsync=False)
    with LLM(tiny_model_dir, store=store, kv_cache_bytes=4 << 20) as llm:
        out = llm.generate([PROMPT], GREEDY)[0]
    assert out.miss_tokens_by_cause == {"never_stored": 144, "partial_block": 6}
    assert out.miss_tier == ""
