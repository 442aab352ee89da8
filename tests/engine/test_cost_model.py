"""The engine weighs every tier hit: loaded where the tier is fast, recomputed where it is not,
with the same tokens either way; the choice reaches the output, stats and the event log."""

from __future__ import annotations

from pathlib import Path

import pytest

from cachetier.config import StoreConfig, build_store
from cachetier.events import read_events
from engine.llm import LLM
from engine.model_spec import ModelSpec
from engine.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8)
PROMPT = [(i * 11 + 5) % 250 for i in range(300)]  # 18 full blocks of 16 and a partial one


def reference(model: Path) -> list[int]:
    llm = LLM(model, enable_prefix_caching=False, kv_cache_bytes=4 << 20)
    return llm.generate([PROMPT], GREEDY)[0].token_ids


def warm_engine(model: Path, tmp_path: Path, **kw: object) -> LLM:
    """An engine whose CPU tier holds PROMPT's blocks and whose pool does not."""
    store = build_store(StoreConfig(cpu_bytes=64 << 20))
    llm = LLM(
        model, store=store, kv_cache_bytes=4 << 20, event_log=str(tmp_path / "ev.jsonl"), **kw
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


def test_early_blocks_recomputed_late_blocks_loaded(tiny_model_dir: Path, tmp_path: Path) -> None:
    # A plan that recomputes the first blocks and loads the rest: the sequence computes its
    # head, steps over the loaded blocks, computes its suffix, and its tokens do not change.
    llm = warm_engine(tiny_model_dir, tmp_path, max_num_batched_tokens=64)
    cost = llm.engine.cost_model
    assert cost is not None

    class Split:
        def plan(self, spans: list[tuple[str, int]], **kw: object) -> object:
            from cachetier.costmodel import LoadPlan

            total = sum(n for _, n in spans)
            return LoadPlan(total, 5, total, "model")

    llm.engine.scheduler.cost = Split()  # type: ignore[assignment]
    out = llm.generate([PROMPT], GREEDY)[0]
    assert out.cached_tokens_by_source == {"cpu": 13 * 16}
    assert out.num_recomputed_hit_tokens == 5 * 16
    assert out.token_ids == reference(tiny_model_dir)
    # The recomputed head was registered in the pool like any computed block.
    again = llm.generate([PROMPT], GREEDY)[0]
    assert again.cached_tokens_by_source == {"pool": 288}


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
    import engine.llm_engine
    from engine.kv_cache import KVPool

    class CopyingPool(KVPool):
        def block_views(self, block_ids: object) -> None:
            return None

    in_place = KVPool(ModelSpec.from_folder(tiny_model_dir), 16, 1 << 20, "float32")
    assert in_place.time_restore_copy() is None
    monkeypatch.setattr(engine.llm_engine, "KVPool", CopyingPool)
    store = StoreConfig(cpu_bytes=0, disk_path=str(tmp_path / "disk"))
    with LLM(tiny_model_dir, store=store, kv_cache_bytes=4 << 20) as llm:
        # Timed once at start, before any request.
        assert llm.engine.stats()["cost_model"]["copy"]["copies"] == 1
        llm.generate([PROMPT], GREEDY)
    with LLM(tiny_model_dir, store=store, kv_cache_bytes=4 << 20, kv_load_policy="always") as llm:
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
        with LLM(tiny_model_dir, store=store, kv_cache_bytes=4 << 20) as llm:
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
        assert out.token_ids == reference(tiny_model_dir)
        assert out.cached_tokens_by_source == ({} if run == 0 else {"disk": 288})
        assert (first_plan.reason == "unmeasured") == (run < 2)
    assert measured_at_start == [False, False, True]
