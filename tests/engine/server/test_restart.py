"""A restarted engine server finds the blocks its last run left on disk, reports them as disk
hits, and logs every lookup to the event log."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from cachetier.report.events import read_events
from cachetier.store.config import StoreConfig
from tests.engine.server.live import EngineServer, get, post

PROMPT = [(i * 13 + 7) % 250 for i in range(50)]  # 3 full blocks of 16 and 2 tokens


def test_cached_tokens_come_from_disk_after_a_restart(
    make_server: Callable[..., EngineServer], tmp_path: Path
) -> None:
    store = StoreConfig(cpu_bytes=64 << 20, disk_path=str(tmp_path / "disk"), fsync=False)
    log = tmp_path / "lookups.jsonl"
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    # The guard off: this is the restore; tests/engine/test_guard_engine.py has the guard's.
    server = make_server(
        store=store, engine_args={"event_log": str(log), "tenant": "t1", "guard": False}
    )
    _, cold = post(server.url, "/v1/completions", body)
    server.stop()  # flushes the store: the blocks are on disk when it returns

    server.start()  # a new engine, an empty pool and an empty CPU tier; the same disk
    _, warm = post(server.url, "/v1/completions", body)
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
    assert warm["cachetier"]["cached_tokens_by_source"] == {"disk": 48}
    assert warm["choices"][0]["token_ids"] == cold["choices"][0]["token_ids"]
    # The cost model's inputs, measured on that restore, and its choices so far.
    text = get(server.url, "/metrics")[1].decode()
    for name in (
        'cachetier_tier_read_bytes_per_second{tier="disk"}',
        'cachetier_tier_latency_seconds{tier="disk"}',
        'cachetier_recomputed_by_choice_tokens_total{model_name="tiny"} 0.0',
    ):
        assert name in text, name
    server.stop()

    events = list(read_events(log, strict=True))
    assert [(e.num_tokens, dict(e.hit_tokens), e.tenant) for e in events] == [
        (50, {}, "t1"),
        (50, {"disk": 48}, "t1"),
    ]
    assert events[1].num_alignment_lost_tokens == 2 and events[1].restore_s > 0
