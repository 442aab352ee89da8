"""``POST /v1/pins`` on the engine server and ``LLM.pin_prefix``: a prompt's chain is pinned
in the engine's tiers and stays through a flood of other prompts."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from cachetier.engine.llm import LLM
from cachetier.primitives.keys import block_keys
from cachetier.store.config import StoreConfig
from tests.engine.server.live import EngineServer
from tests.server.live import call_json
from tests.support import PrivateRedis

BLOCK_BYTES = 8192  # float32, 2 layers, K and V, 16 tokens, 2 KV heads of 16
SYSTEM = "You are a helpful assistant of the cachetier project. " * 3


def test_a_prompt_pinned_over_http_stays_through_a_flood(
    make_server: Callable[..., EngineServer],
) -> None:
    # Blocks of the tiny model are 8 KiB. A CPU tier of 24 may pin 12; a pool of 16 forgets
    # the system prompt during the flood, so its blocks must come back from the tier.
    store = StoreConfig(cpu_bytes=24 * BLOCK_BYTES, fsync=False)
    server = make_server(
        store=store, engine_args={"kv_cache_bytes": 16 * BLOCK_BYTES, "guard": False}
    )
    status, answer = call_json(server.url, "POST", "/v1/pins", {"prompt": SYSTEM})
    assert status == 200, answer
    num_blocks = answer["num_prompt_tokens"] // 16
    assert len(answer["keys"]) == num_blocks == 10
    assert answer["protected"] == {"cpu": num_blocks}  # warmed: stored and protected now
    for i in range(16):  # other prompts: 96 blocks, four times what the tier holds
        body = {"prompt": f"flood prompt number {i:02d} " * 4, "max_tokens": 1}
        assert call_json(server.url, "POST", "/v1/completions", body)[0] == 200
    body = {"prompt": SYSTEM, "max_tokens": 1}
    status, again = call_json(server.url, "POST", "/v1/completions", body)
    assert status == 200
    assert again["cachetier"]["cached_tokens_by_source"] == {"cpu": 16 * num_blocks}


def test_pins_of_chat_messages_and_bad_requests(make_server: Callable[..., EngineServer]) -> None:
    server = make_server(store=StoreConfig(cpu_bytes=1 << 20, fsync=False))
    messages = [{"role": "system", "content": SYSTEM}]
    status, answer = call_json(
        server.url, "POST", "/v1/pins", {"messages": messages, "warm": False}
    )
    assert status == 200 and answer["protected"] == {"cpu": 0}  # pinned on arrival
    for bad in [
        {},
        {"prompt": SYSTEM, "messages": messages},
        {"prompt": "hi"},
        {"prompt": SYSTEM, "x": 1},
    ]:
        status, answer = call_json(server.url, "POST", "/v1/pins", bad)
        assert status in (400, 422), (bad, answer)
        assert answer["error"]["message"]
    plain = make_server()  # no tiers
    status, answer = call_json(plain.url, "POST", "/v1/pins", {"prompt": SYSTEM})
    assert status == 400 and "no tiers" in answer["error"]["message"]


def test_llm_pin_prefix_pins_the_prompt_chain(chat_model_dir: Path) -> None:
    with LLM(
        chat_model_dir, store=StoreConfig(cpu_bytes=1 << 20, fsync=False), kv_cache_bytes=4 << 20
    ) as llm:
        result = llm.pin_prefix(SYSTEM)
        ids = llm.encode(SYSTEM)
        assert list(result.keys) == block_keys(llm.engine.namespace, ids)
        assert result.protected == {"cpu": len(ids) // 16} and result.num_new == len(ids) // 16
        assert llm.store.pinned() == {llm.engine.namespace.id: list(result.keys)}


def test_a_pin_while_redis_is_down_is_a_503_and_pins_nothing(
    make_server: Callable[..., EngineServer], tmp_path: Path
) -> None:
    redis_server = PrivateRedis(tmp_path)
    redis_server.start()
    try:
        store = StoreConfig(
            cpu_bytes=1 << 20, redis_url=redis_server.url, redis_bytes=1 << 20, fsync=False
        )
        server = make_server(store=store)
        redis_server.stop()
        body = {"prompt": SYSTEM, "warm": False}
        status, answer = call_json(server.url, "POST", "/v1/pins", body)
        assert status == 503, answer
        assert answer["error"]["code"] == "tier_unavailable"
        redis_server.start()
        status, answer = call_json(server.url, "POST", "/v1/pins", body)
        assert status == 200 and set(answer["protected"]) == {"cpu", "redis"}, answer
    finally:
        redis_server.stop()
