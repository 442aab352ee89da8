"""The token ids of an OpenAI request, as the engine behind the router will compute them.

Routing on the prompt's blocks works only if the router's tokens equal the engine's: the same
tokenizer (the model folder's), a text prompt encoded as ``cachetier.engine.server`` encodes it
(special tokens added), a chat rendered by the model's chat template with the generation prompt
and then encoded without adding any. ``tests/cachetier/router`` checks the keys against a real
engine server's. A request the router cannot tokenize is still routed, on load alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

MAX_PROMPT_CHARS = 4 << 20
"""Longer text is not tokenized here (the replica refuses or truncates it as it would)."""


class PromptTokens:
    """Tokenizes request bodies with a model folder's tokenizer.

    Args:
        model: the model folder (its ``tokenizer.json`` / ``tokenizer_config.json``); ``None``
            routes text prompts on load alone (token-id prompts still route on their blocks).
    """

    def __init__(self, model: str | Path | None) -> None:
        self._tokenizer: Any = None
        if model is not None:
            from transformers import AutoTokenizer  # noqa: PLC0415 (heavy: only when routing text)

            self._tokenizer = AutoTokenizer.from_pretrained(str(model))

    def of(self, path: str, body: dict[str, Any]) -> list[int] | None:
        """The prompt's token ids, or ``None`` when they cannot be told (no tokenizer, an
        unknown shape: the replica answers such a request itself)."""
        if path.endswith("/chat/completions"):
            return self._chat(body.get("messages"))
        prompt = body.get("prompt")
        if isinstance(prompt, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            return list(prompt)
        if isinstance(prompt, str) and self._tokenizer is not None:
            if len(prompt) > MAX_PROMPT_CHARS:
                return None
            return list(self._tokenizer.encode(prompt))
        return None

    def _chat(self, messages: object) -> list[int] | None:
        if self._tokenizer is None or not isinstance(messages, list):
            return None
        if sum(len(str(m)) for m in messages) > MAX_PROMPT_CHARS:
            return None
        try:
            text = self._tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
        except Exception:  # noqa: BLE001 (jinja's errors are its own): the replica reports it
            return None
        return list(self._tokenizer.encode(text, add_special_tokens=False))
