"""Redis faults: a private redis-server is stopped, restarted and paused (SIGSTOP) while an
engine and the sidecar serve. Serving goes on with misses and counted errors, no request
fails or hangs past the configured timeouts, and the tier reconnects by itself when Redis
returns.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from cachetier.engine.llm import LLM
from cachetier.engine.sampling import SamplingParams
from cachetier.primitives.keys import Namespace
from cachetier.store.config import StoreConfig, build_store
from cachetier.tiers.remote import RemoteTier, RemoteTierConfig
from tests.server.live import TOKENS, ThreadServer, test_config
from tests.support import SMALL_LAYOUT, PrivateRedis, make_blocks

GREEDY = SamplingParams(temperature=0, max_tokens=6)
PROMPTS = [[(i * 13 + j) % 250 for i in range(100)] for j in range(4)]  # 6 full blocks each
# RedisTierConfig's default socket and connect timeouts are 0.5 s, and its breaker opens after
# 3 failures: a request may wait on a hung Redis for a few timeouts, never indefinitely.
HANG_BOUND_S = 5.0


def _wait_until(check: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return False


def test_the_engine_serves_through_redis_outages(
    tiny_model_dir: Path, tmp_path: Path, fault_figures
) -> None:
    redis_server = PrivateRedis(tmp_path)
    redis_server.start()
    reference = LLM(tiny_model_dir, enable_prefix_caching=False, kv_cache_bytes=4 << 20)
    expected = [o.token_ids for o in reference.generate(PROMPTS, GREEDY)]
    store = build_store(StoreConfig(cpu_bytes=0, redis_url=redis_server.url))
    # Always load: this test asks whether the tier comes back, not whether Redis beats the tiny
    # model's recompute (which a busy host can make it not: that choice is tested elsewhere).
    llm = LLM(tiny_model_dir, store=store, kv_cache_bytes=4 << 20, kv_load_policy="always")
    failed = 0
    latencies: dict[str, float] = {}

    def serve(phase: str) -> list[dict[str, int]]:
        # Each prompt twice, the pool emptied before each: the second run can only hit Redis.
        nonlocal failed
        sources = []
        worst = 0.0
        for prompt, want in zip(PROMPTS, expected):
            for _ in range(2):
                llm.engine.blocks.clear_cache()
                start = time.perf_counter()
                try:
                    out = llm.generate([prompt], GREEDY)[0]
                except Exception:  # noqa: BLE001 - any exception is the failure counted here
                    failed += 1
                    continue
                worst = max(worst, time.perf_counter() - start)
                failed += out.token_ids != want
                sources.append(out.cached_tokens_by_source)
                if phase in ("up", "restarted", "resumed"):
                    store.flush(timeout=10)
        latencies[phase] = worst
        return sources

    try:
        assert any("redis" in s for s in serve("up"))
        redis_server.stop()
        assert not any(serve("stopped")), "nothing can come from a Redis that is down"
        redis_server.start()  # empty: it keeps nothing
        assert _wait_until(lambda: any("redis" in s for s in serve("restarted")), 20), (
            "the tier did not reconnect by itself"
        )
        redis_server.pause()
        serve("paused")
        redis_server.resume()
        assert _wait_until(lambda: any("redis" in s for s in serve("resumed")), 20)
    finally:
        redis_server.resume() if redis_server.proc else None
        llm.close()
        store.close()
        redis_server.stop()
    fault_figures.add("redis_outage_requests_failed", failed)
    fault_figures.set("redis_outage_worst_request_s", round(max(latencies.values()), 3))
    assert failed == 0
    assert max(latencies.values()) < HANG_BOUND_S, latencies
    assert store.stats()["tiers"]["redis"]["errors"] > 0, "the outages must be counted"


def test_the_sidecar_serves_through_redis_outages(tmp_path: Path, fault_figures) -> None:
    redis_server = PrivateRedis(tmp_path)
    redis_server.start()
    namespace = Namespace("redis-outage-model", SMALL_LAYOUT)
    # Only Redis behind the server: every answer depends on it.
    config = test_config(tmp_path / "server", cpu_bytes=0, disk_bytes=0, redis_url=redis_server.url)
    server = ThreadServer(config).start()
    client = RemoteTier(RemoteTierConfig(url=server.url, token=TOKENS["alice"]))
    failed = wrong = 0
    seed = iter(range(1000))

    def round_trip() -> tuple[int, float]:
        """Put new blocks and read them back; (blocks found, seconds)."""
        nonlocal failed, wrong
        blocks = make_blocks(namespace, 4, seed=next(seed))
        start = time.perf_counter()
        try:
            client.put_many(namespace.id, blocks)
            got = client.get_many(namespace.id, [b.key for b in blocks])
        except Exception:  # noqa: BLE001 - the client must turn every failure into a miss
            failed += 1
            return 0, time.perf_counter() - start
        wrong += sum(
            1 for g, b in zip(got, blocks) if g is not None and bytes(g.data) != bytes(b.data)
        )
        return sum(g is not None for g in got), time.perf_counter() - start

    try:
        assert round_trip()[0] == 4
        redis_server.stop()
        found, seconds = round_trip()
        assert found == 0 and seconds < HANG_BOUND_S
        redis_server.start()
        assert _wait_until(lambda: round_trip()[0] == 4, 20), "the server's tier did not reconnect"
        redis_server.pause()
        found, seconds = round_trip()
        assert found == 0 and seconds < HANG_BOUND_S
        redis_server.resume()
        assert _wait_until(lambda: round_trip()[0] == 4, 20)
        # Every request got an answer from the server: misses, not transport errors or 5xx.
        assert client.stats()["errors"] == 0
    finally:
        client.close()
        server.stop()
        redis_server.stop()
    fault_figures.add("redis_outage_requests_failed", failed)
    fault_figures.add("corrupt_served", wrong)
    assert (failed, wrong) == (0, 0)
