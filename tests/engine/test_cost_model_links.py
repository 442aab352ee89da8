"""SmolLM2 with its only tier, Redis, behind a real throttled TCP link: over a thin link the
engine recomputes the hit it could load, over a fast one it loads all of it, and the tokens are
the same either way. Decisions only: the TTFTs are the benchmark's (benchmarks/cost_model.py)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from cachetier.engine.llm import LLM
from cachetier.engine.sampling import SamplingParams
from cachetier.store.tiered import TieredStore
from cachetier.tiers.redis import RedisTier, RedisTierConfig
from tests.throttled_link import SlowLink

pytestmark = [
    pytest.mark.model,
    pytest.mark.slow(reason="runs SmolLM2 prefills through a throttled TCP link to Redis"),
]

GREEDY = SamplingParams(temperature=0, max_tokens=4)
LONG = [(i * 37 + 11) % 40000 + 100 for i in range(1000)]  # 62 full blocks of 16
SHORT = [(i * 53 + 3) % 40000 + 100 for i in range(50)]  # 3 full blocks: a cheap probe read


@pytest.fixture
def linked(smollm2_dir: Path, redis_url: str) -> Iterator[tuple[LLM, SlowLink]]:
    host, port = redis_url.split("//")[1].split("/")[0].split(":")
    prefix = f"cost-link-{uuid.uuid4().hex[:8]}"
    with SlowLink((host, int(port))) as link:
        tier = RedisTier(
            RedisTierConfig(url=link.url("redis"), key_prefix=prefix, socket_timeout_s=60)
        )
        store = TieredStore([tier])
        llm = LLM(
            smollm2_dir,
            store=store,
            kv_cache_bytes=1 << 30,
            max_num_batched_tokens=1024,
            guard=False,
        )
        try:
            yield llm, link
        finally:
            llm.close()
            store.close()
            client = redis.Redis.from_url(redis_url)
            names = list(client.scan_iter(match=f"{prefix}*", count=1000))
            if names:
                client.delete(*names)
            client.close()


def _run(llm: LLM, prompt: list[int], *, learn: bool = False) -> object:
    """One request with the pool's copy forgotten; ``learn`` loads it whatever the model says
    (a real read through the link, which is how the model measures the link)."""
    llm.engine.blocks.clear_cache()
    assert llm.engine.cost_model is not None
    llm.engine.cost_model.enabled = not learn
    try:
        return llm.generate([prompt], GREEDY)[0]
    finally:
        llm.engine.cost_model.enabled = True


def test_thin_link_recomputes_fast_link_loads(linked: tuple[LLM, SlowLink]) -> None:
    llm, link = linked
    cold = llm.generate([LONG, SHORT], GREEDY)  # computed, and saved over the open link
    assert cold[0].num_cached_tokens == 0

    link.set(bandwidth_bytes_per_s=2e6, latency_s=0.002)  # loading LONG would take ~23 s
    _run(llm, SHORT, learn=True)
    thin = _run(llm, LONG)
    # Most of the hit is recomputed; at most the last few blocks, which the link brings in
    # while the head before them computes, are loaded.
    loaded = thin.cached_tokens_by_source.get("redis", 0)  # type: ignore[attr-defined]
    assert set(thin.cached_tokens_by_source) <= {"redis"}  # type: ignore[attr-defined]
    assert loaded <= 992 // 4
    assert thin.num_recomputed_hit_tokens == 992 - loaded  # type: ignore[attr-defined]
    assert thin.token_ids == cold[0].token_ids  # type: ignore[attr-defined]

    link.set(bandwidth_bytes_per_s=None, latency_s=0.0)
    for _ in range(3):  # enough reads for the moving average to forget the thin link
        _run(llm, LONG, learn=True)
    fast = _run(llm, LONG)
    assert fast.cached_tokens_by_source == {"redis": 992}  # type: ignore[attr-defined]
    assert fast.num_recomputed_hit_tokens == 0  # type: ignore[attr-defined]
    assert fast.token_ids == cold[0].token_ids  # type: ignore[attr-defined]
    rates = llm.engine.stats()["cost_model"]["tiers"]["redis"]
    assert rates["reads"] >= 4 and rates["read_gbps"] > 0
