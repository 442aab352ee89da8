"""The real SmolLM2 behind the server: chat with its own template, the same answer streamed
and not, and the repeated conversation served from the pool."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.engine.server.live import EngineServer, post, stream

CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.mark.model
def test_smollm2_chat_streamed_and_cached(
    make_server: Callable[..., EngineServer], smollm2_dir: Path
) -> None:
    server = make_server(
        smollm2_dir, served_model_name="smol", engine_args={"kv_cache_bytes": 64 << 20}
    )
    body = {"model": "smol", "messages": CHAT, "max_tokens": 24, "temperature": 0}
    status, first = post(server.url, "/v1/chat/completions", body)
    assert status == 200, first
    _, second = post(server.url, "/v1/chat/completions", body)
    text = first["choices"][0]["message"]["content"]
    assert "Paris" in text
    assert second["choices"][0]["message"]["content"] == text
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    # Every full block but a last one that ends the prompt (recomputed for its logits).
    assert cached == (first["usage"]["prompt_tokens"] - 1) // 16 * 16 > 0
    assert second["cachetier"]["cached_tokens_by_source"] == {"pool": cached}
    events = stream(server.url, "/v1/chat/completions", body)
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]) == text
