"""The engine weighs every tier hit: loaded where the tier is fast, recomputed where it is not,
with the same tokens either way; the choice reaches the output, stats and the event log."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachetier.engine.llm import LLM
from cachetier.engine.llm_engine import RequestOutput
from cachetier.engine.model_spec import ModelSpec
from cachetier.engine.sampling import SamplingParams
from cachetier.report.events import read_events
from cachetier.store.config import StoreConfig, build_store
from cachetier.store.costmodel import LoadPlan
from cachetier.store.tiered import TieredStore
from cachetier.tiers.prefix import PrefixHit
from cachetier.tiers.redis import RedisTier, RedisTierConfig
from tests.support import own_redis_prefix
from tests.throttled_link import SlowLink

GREEDY = SamplingParams(temperature=0, max_tokens=8)
PROMPT = [(i * 11 + 5) % 250 for i in range(300)]  # 18 full blocks of 16 and a partial one


def reference(model: Path) -> list[int]:
    llm = LLM(model, enable_prefix_caching=False, kv_cache_bytes=4 << 20)
    return llm.generate([PROMPT], GREEDY)[0].token_ids


def warm_engine(model: Path, tmp_path: Path, **kw: object) -> LLM:
    """An engine whose CPU tier holds PROMPT's blocks and whose pool does not."""
    store = build_store(StoreConfig(cpu_bytes=64 << 20))
    llm = LLM(
        model,
        store=store,
        kv_cache_bytes=4 << 20,
        event_log=str(tmp_path / "ev.jsonl"),
        **kw,
        guard=False,
    )
    llm.generate([PROMPT], GREEDY)
    llm.engine.blocks.clear_cache()
    return llm


def slow_down(llm: LLM, gbps: float) -> None:
    """Teach the store's rates that the CPU tier reads at ``gbps`` (a measurement, as real gets
    leave; the real slow links are in tests/test_cost_model_links.py)."""
    assert llm.store is not None
    for _ in range(20):
        llm.store.rates.observe_read("cpu", 10**8, 10**8 / (gbps * 1e9))


def test_a_slow_tier_is_recomputed_with_the_same_tokens(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    llm = warm_engine(tiny_model_dir, tmp_path)
    slow_down(llm, 1e-6)  # 1 kB/s: no load can beat the tiny model's prefill
    out = llm.generate([PROMPT], GREEDY)[0]
    assert out.cached_tokens_by_source == {}
    assert out.num_recomputed_hit_tokens == 288
    assert out.miss_tokens_by_cause["too_slow"] == 288  # every held block: the link's fault
    assert out.token_ids == reference(tiny_model_dir)
    llm.engine.close()
    # What the tier holds is not written to it again: 19 full blocks (18 of prompt, one of
    # prompt and output) the first time, then only the one the lookup could not know of.
    assert llm.engine.stats()["saved_blocks"] == 19 + 1
    events = list(read_events(tmp_path / "ev.jsonl"))
    assert events[-1].recomputed_tokens == 288 and events[-1].num_hit_tokens == 0
    assert events[-1].est_saved_s == 0.0


def test_always_load_ignores_the_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    llm = warm_engine(tiny_model_dir, tmp_path, kv_load_policy="always")
    slow_down(llm, 1e-6)
    out = llm.generate([PROMPT], GREEDY)[0]
    assert out.cached_tokens_by_source == {"cpu": 288}
    assert out.num_recomputed_hit_tokens == 0
    assert llm.engine.stats()["cost_model"]["enabled"] is False


class Split:
    """A planner that always recomputes the first 5 hit blocks and loads the rest."""

    def plan(self, spans: list[tuple[str, int]], **kw: object) -> LoadPlan:
        total = sum(n for _, n in spans)
        return LoadPlan(total, 5 if total > 5 else 0, total, "model")


def test_early_blocks_recomputed_late_blocks_loaded(tiny_model_dir: Path, tmp_path: Path) -> None:
    # A plan that recomputes the first blocks and loads the rest: the sequence computes its
    # head while the tail is read, steps over the loaded blocks, computes its suffix, and its
    # tokens do not change.
    llm = warm_engine(tiny_model_dir, tmp_path, max_num_batched_tokens=64)
    llm.engine.scheduler.cost = Split()  # type: ignore[assignment]
    out = llm.generate([PROMPT], GREEDY)[0]
    assert out.cached_tokens_by_source == {"cpu": 13 * 16}
    assert out.num_recomputed_hit_tokens == 5 * 16
    assert out.token_ids == reference(tiny_model_dir)
    # The recomputed head was registered in the pool like any computed block.
    again = llm.generate([PROMPT], GREEDY)[0]
    assert again.cached_tokens_by_source == {"pool": 288}


@pytest.fixture
def linked_engine(
    tiny_model_dir: Path, tmp_path: Path, redis_url: str
) -> Iterator[tuple[LLM, SlowLink]]:
    """An engine whose only tier is the real Redis behind a real throttled TCP link (open to
    start with; a network tier, so a loaded tail is read on the bridge's thread while the head
    is recomputed), holding PROMPT's blocks; the Split planner; 32 tokens a step, so the
    5-block head takes three steps."""
    host, port = redis_url.split("//")[1].split("/")[0].split(":")
    with (
        own_redis_prefix(redis_url, "cachetier-tail") as prefix,
        SlowLink((host, int(port))) as link,
    ):
        # A socket timeout above the slow reads' seconds: a read cut by it would be a miss.
        tier = RedisTier(
            RedisTierConfig(url=link.url("redis"), key_prefix=prefix, socket_timeout_s=60)
        )
        store = TieredStore([tier])
        llm = LLM(
            tiny_model_dir,
            store=store,
            kv_cache_bytes=4 << 20,
            max_num_batched_tokens=32,
            guard=False,
        )
        try:
            llm.generate([PROMPT], GREEDY)
            llm.flush()
            llm.engine.blocks.clear_cache()
            llm.engine.scheduler.cost = Split()  # type: ignore[assignment]
            yield llm, link
        finally:
            link.set(bandwidth_bytes_per_s=None, latency_s=0.0)
            llm.close()
            store.close()


@pytest.fixture
def redis_engine(linked_engine: tuple[LLM, SlowLink]) -> LLM:
    return linked_engine[0]


def test_a_network_tail_is_read_while_the_head_computes(
    redis_engine: LLM, tiny_model_dir: Path
) -> None:
    engine = redis_engine.engine
    assert engine.scheduler.background_tiers == {"redis"}
    engine.add_request(PROMPT, GREEDY)
    engine.step()  # the first 32 of the head's 80 tokens, the tail's read submitted
    (seq,) = engine.scheduler.running
    assert seq.pending_restore is not None and seq.skip == (80, 288)
    assert seq.cached_tokens_by_source == {}  # known once the read is in
    while engine.has_unfinished_requests():
        engine.step()
    assert seq.pending_restore is None
    assert seq.cached_tokens_by_source == {"redis": 13 * 16}
    assert seq.output_token_ids == reference(tiny_model_dir)


def test_a_tail_that_arrives_short_is_computed(redis_engine: LLM, tiny_model_dir: Path) -> None:
    # The tail's blocks 15-17 are gone by the time the background read gets to them (another
    # engine evicted them after the lookup): the sequence steps over what arrived and computes
    # the rest, with the same tokens.
    bridge, store = redis_engine.engine.bridge, redis_engine.store
    assert bridge is not None and store is not None
    lookup = bridge.lookup

    def lookup_then_evict(keys: list[bytes], **kw: bool) -> PrefixHit:
        hit = lookup(keys, **kw)
        store.delete(bridge.namespace.id, list(keys[15 : hit.num_blocks]))
        return hit

    bridge.lookup = lookup_then_evict  # type: ignore[method-assign]
    out = redis_engine.generate([PROMPT], GREEDY)[0]
    assert out.cached_tokens_by_source == {"redis": (15 - 5) * 16}
    assert out.token_ids == reference(tiny_model_dir)


def test_a_request_aborted_while_its_tail_is_read_frees_its_blocks(
    redis_engine: LLM, tiny_model_dir: Path
) -> None:
    engine = redis_engine.engine
    free = engine.blocks.num_free_blocks
    request = engine.add_request(PROMPT, GREEDY)
    engine.step()
    (seq,) = engine.scheduler.running
    assert seq.pending_restore is not None
    read = seq.pending_restore.future
    engine.abort_request(request)  # does not wait for the read
    assert seq.pending_restore is None
    assert not engine.has_unfinished_requests()
    read.result()
    assert engine.step() == []  # nothing to run; the blocks the read held are freed
    assert engine.blocks.num_free_blocks == free
    # The engine goes on: the same prompt again gives the reference tokens.
    assert redis_engine.generate([PROMPT], GREEDY)[0].token_ids == reference(tiny_model_dir)


# 13 tail blocks of 8 KiB over 50 kB/s: the read takes about 2 s, the tiny model's steps ms.
SLOW = 50e3


def test_an_abort_does_not_wait_for_the_read(
    linked_engine: tuple[LLM, SlowLink], tiny_model_dir: Path
) -> None:
    llm, link = linked_engine
    engine = llm.engine
    free = engine.blocks.num_free_blocks
    link.set(bandwidth_bytes_per_s=SLOW, latency_s=0.0)
    request = engine.add_request(PROMPT, GREEDY)
    engine.step()
    (seq,) = engine.scheduler.running
    assert seq.pending_restore is not None
    read = seq.pending_restore.future
    engine.abort_request(request)
    assert not read.done()  # the engine did not wait; the read still holds its blocks
    assert engine.blocks.num_free_blocks < free
    read.result()
    assert engine.step() == []
    assert engine.blocks.num_free_blocks == free


def test_other_requests_run_while_a_tail_is_read(
    linked_engine: tuple[LLM, SlowLink], tiny_model_dir: Path
) -> None:
    llm, link = linked_engine
    engine = llm.engine
    link.set(bandwidth_bytes_per_s=SLOW, latency_s=0.0)
    engine.add_request(PROMPT, GREEDY, request_id="tail")
    # No block in any tier, and too short to fill one (a full block would be saved at its
    # end, over the same slow link).
    other = [(i * 7 + 1) % 250 + 3 for i in range(6)]
    engine.add_request(other, GREEDY, request_id="other")
    seqs = {seq.request_id: seq for seq in engine.scheduler.waiting}
    while not seqs["other"].is_finished:
        engine.step()
    # The other request ran to its end while the first waited for its tail, head computed.
    tail = seqs["tail"]
    assert tail.pending_restore is not None and not tail.pending_restore.future.done()
    assert tail.num_computed_tokens == 80 and tail.output_token_ids == []
    while engine.has_unfinished_requests():
        engine.step()
    assert tail.cached_tokens_by_source == {"redis": 13 * 16}
    assert tail.output_token_ids == reference(tiny_model_dir)
    # Its TTFT paid for the read from the head's end to the read's (about 2 s), and its
    # breakdown says so.
    assert tail.ttft_breakdown()["restore_read_s"] > 0.5


def test_a_tail_on_a_local_tier_is_read_before_the_head(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    # A CPU-tier read beside a CPU forward only takes the forward's cores: no background.
    llm = warm_engine(tiny_model_dir, tmp_path, max_num_batched_tokens=32)
    llm.engine.scheduler.cost = Split()  # type: ignore[assignment]
    assert llm.engine.scheduler.background_tiers == frozenset()
    llm.engine.add_request(PROMPT, GREEDY)
    llm.engine.step()
    (seq,) = llm.engine.scheduler.running
    assert seq.pending_restore is None and seq.cached_tokens_by_source == {"cpu": 13 * 16}


def test_breakdown_adds_up_to_the_ttft(tiny_model_dir: Path, tmp_path: Path) -> None:
    llm = warm_engine(tiny_model_dir, tmp_path)
    out = llm.generate([PROMPT], GREEDY)[0]
    parts = out.ttft_breakdown
    assert out.ttft_s is not None
    assert set(parts) == {
        "queue_s",
        "lookup_s",
        "restore_read_s",
        "restore_copy_s",
        "prefill_s",
        "sample_s",
        "other_s",
    }
    assert sum(parts.values()) >= out.ttft_s * 0.999
    assert parts["restore_read_s"] > 0 and parts["prefill_s"] > 0
    stats = llm.engine.stats()["cost_model"]
    assert stats["tiers"]["cpu"]["reads"] >= 1 and stats["prefill"]["samples"] >= 2


def test_a_pool_that_copies_restores_times_the_copy_for_the_model(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A GPU pool cannot be read into in place: every restore copies. Here a CPU pool that
    # declines in-place reads takes that path (KVPool.write_blocks) on this machine.
    import cachetier.engine.llm_engine
    from cachetier.engine.kv_cache import KVPool

    class CopyingPool(KVPool):
        def block_views(self, block_ids: object) -> None:
            return None

    in_place = KVPool(ModelSpec.from_folder(tiny_model_dir), 16, 1 << 20, "float32")
    assert in_place.time_restore_copy() is None
    monkeypatch.setattr(cachetier.engine.llm_engine, "KVPool", CopyingPool)
    store = StoreConfig(cpu_bytes=0, disk_path=str(tmp_path / "disk"))
    with LLM(tiny_model_dir, store=store, kv_cache_bytes=4 << 20, guard=False) as llm:
        # Timed once at start, before any request.
        assert llm.engine.stats()["cost_model"]["copy"]["copies"] == 1
        llm.generate([PROMPT], GREEDY)
    with LLM(
        tiny_model_dir, store=store, kv_cache_bytes=4 << 20, kv_load_policy="always", guard=False
    ) as llm:
        out = llm.generate([PROMPT], GREEDY)[0]
        copy = llm.engine.stats()["cost_model"]["copy"]
    assert out.cached_tokens_by_source == {"disk": 288}
    assert out.token_ids == reference(tiny_model_dir)
    assert copy["copies"] == 2 and copy["copy_gbps"] > 0


def test_a_restarted_engine_weighs_its_first_hit_with_the_kept_disk_speed(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    # The first restart finds the disk unmeasured (its first hit is loaded without a plan);
    # it measures the disk as it reads, and the next restart starts with that measure.
    store = StoreConfig(cpu_bytes=0, disk_path=str(tmp_path / "disk"))
    measured_at_start: list[bool] = []
    for run in range(3):
        with LLM(tiny_model_dir, store=store, kv_cache_bytes=4 << 20, guard=False) as llm:
            assert llm.store is not None
            measured_at_start.append(llm.store.rates.get("disk") is not None)
            cost = llm.engine.cost_model
            assert cost is not None
            first_plan = cost.plan(
                [("disk", 18)],
                block_bytes=llm.engine.pool.block_bytes,
                block_size=16,
                cached_tokens=0,
                num_tokens=len(PROMPT),
                chunk_tokens=2048,
            )
            out = llm.generate([PROMPT], GREEDY)[0]
            recomputed = llm.engine.scheduler.num_recomputed_hit_tokens
        assert out.token_ids == reference(tiny_model_dir)
        if run < 2:  # nothing stored yet, then an unmeasured disk: the whole hit is loaded
            assert out.cached_tokens_by_source == ({} if run == 0 else {"disk": 288})
        else:
            # Measured: the plan decides, from speeds this machine's load moves (a busy run
            # loaded 80 of the 288 tokens). Whatever it did not load it recomputed by choice.
            assert set(out.cached_tokens_by_source) <= {"disk"}
            assert out.cached_tokens_by_source.get("disk", 0) + recomputed == 288
        assert (first_plan.reason == "unmeasured") == (run < 2)
    assert measured_at_start == [False, False, True]


def test_the_warm_up_measures_a_realistic_prompt_length(tiny_model_dir: Path) -> None:
    # The cost model refuses no load whose recompute is longer than a step it measured: the
    # warm-up's calibration forward is what lets a restarted engine, whose first requests
    # are hits, judge a prompt of a few hundred tokens.
    store = build_store(StoreConfig(cpu_bytes=1 << 20))
    llm = LLM(tiny_model_dir, store=store, guard=False)
    prefill = llm.engine.prefill_model
    assert prefill.measured_range[0] == 512
    assert prefill.covers(0, 347, llm.engine.config.max_num_batched_tokens)
    assert not prefill.covers(0, 513, llm.engine.config.max_num_batched_tokens)
    llm.close()
    # Never longer than a step may be.
    small = LLM(tiny_model_dir, store=store, max_num_batched_tokens=384, guard=False)
    assert small.engine.prefill_model.measured_range[0] == 384
    small.close()
    store.close()


def test_a_refusal_is_logged_and_its_prefill_time_fed_back(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    llm = warm_engine(tiny_model_dir, tmp_path)
    slow_down(llm, 1e-6)
    error = llm.engine.prefill_model.error
    before = error.num_outcomes
    with caplog.at_level(logging.INFO, logger="cachetier.store.costmodel"):
        out: RequestOutput | None = None
        llm.engine.add_request(PROMPT, GREEDY, request_id="slow-1")
        while llm.engine.has_unfinished_requests():
            for step in llm.engine.step():
                out = step
    assert out is not None and out.num_recomputed_hit_tokens == 288
    assert error.num_outcomes == before + 1
    lines = [r.getMessage() for r in caplog.records]
    refusal, outcome = [line for line in lines if "slow-1" in line]
    assert "recomputes 18 of 18 hit blocks" in refusal and "to load them all" in refusal
    # The real time logged is the prompt's forward steps, as the TTFT breakdown has them.
    assert f"{out.ttft_breakdown['prefill_s']:.4f} s against" in outcome
    assert llm.store is not None
    llm.close()
    llm.store.close()
