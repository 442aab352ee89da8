"""The official OpenAI Python client talks to the server: completions and chat, streamed or
not, with ``usage.prompt_tokens_details.cached_tokens``."""

from __future__ import annotations

import openai
import pytest

from tests.engine.server.live import EngineServer

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"}]


def test_the_openai_client_works(shared_server: EngineServer) -> None:
    client = openai.OpenAI(base_url=f"{shared_server.url}/v1", api_key="unused")
    assert [m.id for m in client.models.list()] == ["tiny"]
    first = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=5, temperature=0
    )
    again = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=5, temperature=0
    )
    assert again.choices[0].message.content == first.choices[0].message.content
    # The template makes a 45-token prompt: its 2 full blocks come from the pool.
    assert again.usage.prompt_tokens_details.cached_tokens == 32
    assert again.model_extra["cachetier"]["cached_tokens_by_source"] == {"pool": 32}
    assert again.model_extra["cachetier"]["miss_tokens_by_cause"] == {"partial_block": 13}

    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == first.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 5

    completion = client.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=3)
    assert completion.usage.completion_tokens <= 3 and completion.choices[0].finish_reason
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x", max_tokens=3)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", max_tokens=0)
