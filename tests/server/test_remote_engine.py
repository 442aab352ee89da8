"""The engine with the server as a tier: a new engine (after a server restart, too) restores the
prefix from it with the same output; another tenant with the same prompt gets nothing."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from cachetier.engine.llm import LLM
from cachetier.engine.sampling import SamplingParams
from cachetier.store.config import StoreConfig
from tests.server.live import TOKENS, ThreadServer

GREEDY = SamplingParams(temperature=0, max_tokens=12)
PROMPT = [(i * 7 + 3) % 250 for i in range(150)]  # 9 full blocks of 16 and a partial one


def _store(server: ThreadServer, tenant: str) -> StoreConfig:
    return StoreConfig(cpu_bytes=16 << 20, remote_url=server.url, remote_token=TOKENS[tenant])


@pytest.mark.slow(reason="starts three tiny-model engines in turn and restarts the server once")
def test_a_new_engine_restores_from_the_server(
    tiny_model_dir: Path, make_server: Callable[..., ThreadServer]
) -> None:
    server = make_server()
    with LLM(
        tiny_model_dir, store=_store(server, "alice"), kv_cache_bytes=4 << 20, guard=False
    ) as llm:
        first = llm.generate([PROMPT], GREEDY)[0]
    assert first.num_cached_tokens == 0
    server.restart()  # what the server holds is on its disk
    with LLM(
        tiny_model_dir, store=_store(server, "alice"), kv_cache_bytes=4 << 20, guard=False
    ) as llm:
        again = llm.generate([PROMPT], GREEDY)[0]
    assert again.cached_tokens_by_source == {"remote": 144}
    assert again.token_ids == first.token_ids
    with LLM(
        tiny_model_dir, store=_store(server, "bob"), kv_cache_bytes=4 << 20, guard=False
    ) as llm:
        other_tenant = llm.generate([PROMPT], GREEDY)[0]
    assert other_tenant.num_cached_tokens == 0
    assert other_tenant.token_ids == first.token_ids
