"""The token ids of an OpenAI request, as the engine behind the router will compute them.

Routing on the prompt's blocks works only if the router's tokens equal the engine's: the same
tokenizer (the model folder's), a text prompt encoded as ``cachetier.engine.server`` encodes it
(special tokens added), a chat rendered by the model's chat template with the generation prompt
and then encoded without adding any. ``tests/cachetier/router`` checks the keys against a real
engine server's. A request the router cannot tokenize is still routed, on load alone.

Everything here is CPU work the router runs on its ``PrepareQueue`` threads, never on its
event loop. A body that is not a JSON object, nests deeper than ``MAX_JSON_DEPTH`` or gives
token ids no tokenizer has is refused (``BadPromptError``: the router answers 400).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

MAX_PROMPT_CHARS = 1 << 20
"""Longer text is not tokenized here (no body the router takes holds more)."""
MAX_JSON_DEPTH = 64
"""The deepest nesting of arrays and objects taken (an OpenAI body nests fewer than 20)."""
MAX_TOKEN_ID = (1 << 32) - 1
"""Token ids are 32-bit: block keys hash them as such, and no vocabulary is larger."""


class BadPromptError(ValueError):
    """A request body the router refuses (400); the message says what to change."""


def parse_body(body: bytes) -> dict[str, Any]:
    """The body as a JSON object no deeper than ``MAX_JSON_DEPTH``.

    Raises:
        BadPromptError: it is not JSON, not an object, or nests too deeply.
    """
    try:
        parsed = json.loads(body)
    except RecursionError:
        raise BadPromptError(f"the body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError:
        raise BadPromptError("the body is not JSON") from None
    if not isinstance(parsed, dict):
        raise BadPromptError("the body is not a JSON object")
    if _too_deep(parsed, MAX_JSON_DEPTH):
        raise BadPromptError(f"the body nests deeper than {MAX_JSON_DEPTH} levels")
    return parsed


def _too_deep(value: object, limit: int) -> bool:
    """Whether ``value`` nests past ``limit``; iterative, so that depth costs no stack.

    Raises:
        BadPromptError: a string in it is not Unicode text (a lone surrogate, which no
            tokenizer encodes).
    """
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = [*item.keys(), *item.values()]
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            return True
        for child in children:
            if isinstance(child, dict | list):
                stack.append((child, depth + 1))
            elif isinstance(child, str):
                _check_text(child)
    return False


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise BadPromptError(
            "a string in the body holds a lone UTF-16 surrogate (\\ud800-\\udfff): send "
            "Unicode text"
        ) from None


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
        unknown shape: the replica answers such a request itself).

        Raises:
            BadPromptError: the prompt is a list of integers one of which is no token id.
        """
        if path.endswith("/chat/completions"):
            return self._chat(body.get("messages"))
        prompt = body.get("prompt")
        if isinstance(prompt, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            if any(not 0 <= t <= MAX_TOKEN_ID for t in prompt):
                raise BadPromptError(
                    f"'prompt' holds a token id outside [0, {MAX_TOKEN_ID}]: send the ids the "
                    "model's tokenizer gives"
                )
            return list(prompt)
        if isinstance(prompt, str) and self._tokenizer is not None:
            if len(prompt) > MAX_PROMPT_CHARS:
                return None
            return self._encode(prompt, add_special_tokens=True)
        return None

    def _chat(self, messages: object) -> list[int] | None:
        if self._tokenizer is None or not isinstance(messages, list):
            return None
        if len(json.dumps(messages)) > MAX_PROMPT_CHARS:
            return None
        try:
            text = self._tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
        except Exception:  # noqa: BLE001 (jinja's errors are its own): the replica reports it
            return None
        return self._encode(text, add_special_tokens=False)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int] | None:
        try:
            return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))
        # What it cannot encode the replica judges; RuntimeError is the Rust tokenizer's
        # "Already borrowed", should two threads ever race on its settings.
        except (TypeError, ValueError, UnicodeError, RuntimeError):
            return None
