"""The engine server's ``/metrics`` carries its tiers' live capacity curve: the engine's own
lookups (past its pool) replayed through ghosts of 0.5 to 4 times its CPU tier."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client.parser import text_string_to_metric_families

from cachetier.store.config import StoreConfig
from tests.engine.server.live import EngineServer, get
from tests.server.live import call_json

BLOCK_BYTES = 8192  # float32, 2 layers, K and V, 16 tokens, 2 KV heads of 16
PROMPTS = [f"Prompt {name} about tiered caches of attention keys. " * 5 for name in "ABC"]


def curve_of(server: EngineServer) -> dict[tuple[str, str], float]:
    status, body = get(server.url, "/metrics")
    assert status == 200
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    return {
        (s.labels["tier"], s.labels["capacity_factor"]): s.value
        for s in families["cachetier_tier_hit_ratio_at_capacity"].samples
    }


def test_the_engine_exports_its_tiers_curve(make_server: Callable[..., EngineServer]) -> None:
    # A pool of 20 blocks holds one prompt (15 blocks) at a time, so each prompt's return is
    # looked up in the tiers; a CPU tier of 16 holds about one prompt, 4x it all three.
    store = StoreConfig(cpu_bytes=16 * BLOCK_BYTES, fsync=False)  # the curve is on by default
    server = make_server(
        store=store, engine_args={"kv_cache_bytes": 20 * BLOCK_BYTES, "guard": False}
    )
    for _ in range(3):
        for prompt in PROMPTS:
            body = {"prompt": prompt, "max_tokens": 1}
            assert call_json(server.url, "POST", "/v1/completions", body)[0] == 200
    curve = curve_of(server)
    assert set(curve) == {("cpu", f) for f in ("0.5", "1", "2", "4")}, curve
    line = [curve[("cpu", f)] for f in ("0.5", "1", "2", "4")]
    assert line == sorted(line) and all(0 <= v <= 1 for v in line), line
    # Three prompts of 15 blocks cycle: a tier of 64 holds them all, one of 8 none whole.
    assert line[-1] > 0.5 and line[0] < line[-1], line


def test_with_the_curve_off_there_is_no_series(
    make_server: Callable[..., EngineServer],
) -> None:
    off = StoreConfig(cpu_bytes=16 * BLOCK_BYTES, fsync=False, live_curve=False)
    server = make_server(store=off, engine_args={"kv_cache_bytes": 20 * BLOCK_BYTES})
    body = {"prompt": PROMPTS[0], "max_tokens": 1}
    assert call_json(server.url, "POST", "/v1/completions", body)[0] == 200
    assert curve_of(server) == {}
