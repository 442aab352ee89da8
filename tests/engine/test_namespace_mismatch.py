"""An engine restarted with another dtype or tenant on the disk folder another filled: its
misses say ``namespace_mismatch`` and what differs, in the output and the event log, not
``never_stored``; the same engine restarted as it was still hits."""

from __future__ import annotations

from pathlib import Path

from cachetier.engine.llm import LLM
from cachetier.engine.llm_engine import RequestOutput
from cachetier.engine.sampling import SamplingParams
from cachetier.report.events import read_events
from cachetier.store.config import StoreConfig

GREEDY = SamplingParams(temperature=0, max_tokens=2)
PROMPT = [(i * 11 + 5) % 250 for i in range(150)]  # 9 full blocks of 16 and a tail of 6


def _run(model: Path, store: StoreConfig, **engine: object) -> RequestOutput:
    with LLM(model, store=store, kv_cache_bytes=4 << 20, guard=False, **engine) as llm:
        (out,) = llm.generate([PROMPT], GREEDY)
        llm.engine.close()
    return out


def test_a_restart_with_another_dtype_misses_as_a_mismatch(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    store = StoreConfig(cpu_bytes=64 << 20, disk_path=str(tmp_path / "disk"), fsync=False)
    _run(tiny_model_dir, store, dtype="float32")
    log = tmp_path / "lookups.jsonl"
    out = _run(tiny_model_dir, store, dtype="bfloat16", event_log=str(log))
    assert out.miss_tokens_by_cause == {"namespace_mismatch": 144, "partial_block": 6}
    assert "dtype 'bfloat16' asked, 'float32' held" in out.miss_detail
    (event,) = read_events(log, strict=True)
    assert dict(event.miss_tokens) == {"namespace_mismatch": 144, "partial_block": 6}
    again = _run(tiny_model_dir, store, dtype="float32")
    assert again.num_cached_tokens == 144


def test_a_restart_under_another_tenant_names_the_tenant(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    store = StoreConfig(cpu_bytes=64 << 20, disk_path=str(tmp_path / "disk"), fsync=False)
    _run(tiny_model_dir, store, tenant="blue")
    out = _run(tiny_model_dir, store, tenant="green")
    assert out.miss_tokens_by_cause == {"namespace_mismatch": 144, "partial_block": 6}
    assert out.miss_detail == "tenant 'green' asked, 'blue' held"
