"""``LLM``: the offline API (vLLM's ``LLM(...).generate(...)`` shape) over ``LLMEngine``."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cachetier.engine.config import EngineConfig
from cachetier.engine.llm_engine import LLMEngine, RequestOutput
from cachetier.engine.sampling import SamplingParams
from cachetier.pins.store import PinResult
from cachetier.store.config import StoreConfig, build_store
from cachetier.store.tiered import TieredStore


class LLM:
    """Generate text or token ids with prefix caching backed by cachetier's tiers.

    Args:
        model: a local Hugging Face model folder.
        store: a ``StoreConfig`` to build tiers from (owned and closed by this object), a
            ready ``TieredStore`` (owned by the caller), or ``None`` for no tiers.
        engine_args: any other ``EngineConfig`` field (``block_size``, ``kv_cache_bytes``...).
    """

    def __init__(
        self,
        model: str | Path,
        *,
        store: StoreConfig | TieredStore | None = None,
        **engine_args: Any,
    ) -> None:
        self._owns_store = isinstance(store, StoreConfig)
        self.store = build_store(store) if isinstance(store, StoreConfig) else store
        self.engine = LLMEngine(EngineConfig(model=str(model), **engine_args), self.store)
        self.tokenizer = maybe_tokenizer(Path(model))

    def encode(self, prompt: str, *, chat: bool = False) -> list[int]:
        """Token ids of ``prompt`` (through the chat template if ``chat``)."""
        if self.tokenizer is None:
            raise ValueError("this model folder has no tokenizer: pass token ids instead of text")
        if chat:
            # Render the template to text, then tokenize once: the tokenized form's return
            # type changed across transformers versions (list, dict, BatchEncoding).
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
            )
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        return list(self.tokenizer.encode(prompt))

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt to completion with continuous batching.

        Args:
            prompts: strings (needs a tokenizer) or lists of token ids.
            sampling_params: one for all prompts or one per prompt (default: greedy-free
                vLLM defaults, 16 tokens).
            use_tqdm: show a progress line on stderr.

        Returns:
            One finished ``RequestOutput`` per prompt, in prompt order.
        """
        if isinstance(prompts, str):
            raise TypeError("prompts must be a list of prompts, not one string")
        params = (
            list(sampling_params)
            if isinstance(sampling_params, Sequence)
            else [sampling_params or SamplingParams()] * len(prompts)
        )
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        order: list[str] = []
        for prompt, p in zip(prompts, params):
            ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
            order.append(self.engine.add_request(ids, p))
        done: dict[str, RequestOutput] = {}
        start = time.perf_counter()
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
            if use_tqdm:
                rate = len(done) / max(time.perf_counter() - start, 1e-9)
                print(
                    f"\r{len(done)}/{len(order)} requests ({rate:.2f}/s)", end="", file=sys.stderr
                )
        if use_tqdm:
            print(file=sys.stderr)
        outputs = [done[rid] for rid in order]
        if self.tokenizer is not None:
            for out in outputs:
                out.text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        return outputs

    def pin_prefix(
        self, prompt: str | Sequence[int], *, chat: bool = False, warm: bool = True
    ) -> PinResult:
        """Pin a prompt's full blocks (a system prompt every request starts with) in the tiers:
        no tier that can pin evicts them.

        Args:
            prompt: text (needs a tokenizer) or token ids.
            chat: render text through the chat template first, as ``encode`` does.
            warm: run the prompt once (one output token) so its blocks are computed and
                stored now; otherwise they are pinned on arrival, by the first request that
                computes them.

        Returns:
            The store's ``PinResult`` (the chain's keys, and how many each tier holds now).
        """
        if self.store is None:
            raise ValueError("this LLM has no tiers (store=None): there is nothing to pin in")
        ids = self.encode(prompt, chat=chat) if isinstance(prompt, str) else list(prompt)
        if warm:
            self.generate([ids], SamplingParams(max_tokens=1))
        return self.store.pin_prefix(self.engine.namespace, ids)  # flushes the writes first

    def flush(self) -> None:
        """Wait until every block handed to the tiers has been written to all of them."""
        if self.store is not None:
            self.store.flush()

    def close(self) -> None:
        """Close the engine (its tier reads still running end first), flush and, if this
        object built the store, close it."""
        self.engine.close()
        if self.store is not None:
            self.store.flush()
            if self._owns_store:
                self.store.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def maybe_tokenizer(folder: Path) -> Any:
    """The folder's Hugging Face tokenizer, or ``None`` when it has none (token-id models)."""
    if (
        not (folder / "tokenizer.json").is_file()
        and not (folder / "tokenizer_config.json").is_file()
    ):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, local_files_only=True)
