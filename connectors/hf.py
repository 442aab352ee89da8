"""``HFCacheConnector``: cachetier's tiers as a prefix cache for Hugging Face ``model.generate``.

Before ``generate`` the longest stored prefix of the prompt (whole blocks only, and never the
last prompt token) is read from the store into a transformers ``DynamicCache``, so ``generate``
prefills only the rest. After it, the full blocks the cache now holds are written back.

A block's payload is ``[num_layers, 2, block_size, num_kv_heads, head_dim]`` (arrangement
``"layer,kv,token,head,dim"``, ``KVLayout``'s default) with keys after RoPE, exactly what our
engine's pool stores. HF keeps no pages, so a block here is one record of the deployment's
``record_tokens``: for the same model folder and dtype, our engine, vLLM (at any multiple of
that size) and this connector read each other's records.

Only batch-1 prompts without padding are supported, and models whose every layer is full or
sliding-window attention (Llama, SmolLM2, Mistral, Qwen2 with or without its window). Models
with recurrent layers (Qwen3-Next, Jamba, Bamba, ...) are refused when the connector is made:
a record holds no recurrent state (``cachetier.connectors.hf_layers``). While ``generate`` runs,
a sliding-window layer keeps every token, as a full-attention one does, so that the blocks
past its window can be saved; it is trimmed back to its window afterwards.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from cachetier.connectors.hf_layers import (
    check_layer_types,
    held_from,
    keep_whole_history,
    trim_history,
)
from cachetier.connectors.hf_windows import WindowedRecords
from cachetier.guard.first_layer import FirstLayer
from cachetier.guard.record_check import RecordCheck
from cachetier.kernels.paged_layouts import PagedBlocks, axes_view
from cachetier.kernels.staging import HostStaging, payload_view
from cachetier.primitives.fingerprint import model_fingerprint
from cachetier.primitives.keys import (
    BlockHash,
    KVLayout,
    Namespace,
    block_keys,
    dtype_name,
    torch_dtype,
)
from cachetier.primitives.kv_format import DEFAULT_RECORD_TOKENS
from cachetier.primitives.layer_sets import layer_sets
from cachetier.record import KVBlock
from cachetier.store.record_guard import RecordGuard
from cachetier.store.tiered import TieredStore

if TYPE_CHECKING:
    from transformers import DynamicCache, PreTrainedModel

log = logging.getLogger(__name__)

# generate kwargs the connector sets itself, or that would bypass the cache it restores.
_RESERVED_KWARGS = ("past_key_values", "inputs_embeds", "input_ids", "inputs")


@dataclass(frozen=True, slots=True)
class HFGenerateInfo:
    """What one ``HFCacheConnector.generate`` call reused, computed and stored.

    Args:
        num_prompt_tokens: tokens in the prompt.
        num_cached_tokens: leading prompt tokens whose KV came from the store.
        num_computed_prompt_tokens: prompt tokens the model prefilled (the rest).
        cached_tokens_by_source: cached tokens per tier name (``"cpu"``, ``"disk"``, ...).
        num_saved_blocks: blocks handed to the store after generation.
    """

    num_prompt_tokens: int
    num_cached_tokens: int
    num_computed_prompt_tokens: int
    cached_tokens_by_source: dict[str, int]
    num_saved_blocks: int


@dataclass(slots=True)
class HFConnectorStats:
    """Running totals of one connector (blocks, not tokens)."""

    restored_blocks: int = 0
    rejected_blocks: int = 0  # restored blocks whose dtype, shape or token count was wrong
    saved_blocks: int = 0
    store_errors: int = 0  # store calls that raised; each was treated as a miss / a lost save
    restored_by_tier: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class _Restored:
    cache: DynamicCache | None
    num_cached_tokens: int
    sources: tuple[str, ...]


class HFCacheConnector:
    """Restore and save a transformers model's prompt KV through a ``TieredStore``.

    Args:
        model: a causal LM whose layers are all full or sliding-window attention (e.g.
            ``LlamaForCausalLM``, ``MistralForCausalLM``).
        store: the tiers (owned by the caller, who closes it).
        model_folder: the folder the weights were loaded from; its ``model_fingerprint`` names
            the model in every key. Give this or ``fingerprint``.
        fingerprint: a ready model fingerprint instead of ``model_folder``.
        record_tokens: tokens per record, the same in every engine that shares the cache
            (``cachetier.primitives.kv_format.DEFAULT_RECORD_TOKENS``).
        tenant: tenant name or cache salt; different tenants never share blocks.
        save_generated_tokens: also store the full blocks of generated tokens (their KV was
            computed one token at a time, so it may differ from a prefill in the last bits).
        record_check: check every restored record against its tokens before its KV is used
            (``cachetier.store.record_guard``: the first layer's K and V of a few tokens,
            recomputed from the model's own weights; a record that fails is a miss, deleted,
            and its writer quarantined).

    Raises:
        ValueError: a model with recurrent layers (Qwen3-Next, Jamba, Bamba, ...) or another
            layer kind than full and sliding-window attention, named with the model's layer
            types (``hf_layers.check_layer_types``); a bad argument.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        store: TieredStore,
        *,
        model_folder: str | Path | None = None,
        fingerprint: str | None = None,
        record_tokens: int = DEFAULT_RECORD_TOKENS,
        tenant: str = "",
        save_generated_tokens: bool = False,
        record_check: bool = True,
    ) -> None:
        if (model_folder is None) == (fingerprint is None):
            raise ValueError("pass exactly one of model_folder and fingerprint")
        if fingerprint is None:
            fingerprint = model_fingerprint(model_folder)  # type: ignore[arg-type]
        config = model.config.get_text_config(decoder=True)
        # First: a hybrid model may lack what the layout and the record check read below.
        check_layer_types(model.config, config.num_hidden_layers)
        if not model.dtype.is_floating_point:
            raise ValueError(f"model dtype {model.dtype} is not a float dtype")
        dtype = dtype_name(model.dtype)  # raises for a float dtype no layout has (float64)
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        layout = KVLayout(dtype, record_tokens, config.num_hidden_layers, num_kv_heads, head_dim)
        self.model = model
        self.store = store
        self.namespace = Namespace(fingerprint, layout, tenant)
        self.block_shape = layout.payload_shape
        self.save_generated_tokens = save_generated_tokens
        self.stats = HFConnectorStats()
        check = None
        if record_check:
            params = dict(model.named_parameters())
            layer = FirstLayer.from_tensors(config.to_dict(), params.get)
            check = RecordCheck(layer)
        self.record_guard = RecordGuard(store, check, None, self.namespace.describe())
        # Sliding-window layers: each layer set in records of its own, a window's as far as a
        # hit needs it, as our engine and vLLM store them (``hf_windows``).
        windows = [
            layer.sliding_window if getattr(layer, "is_sliding", False) else None
            for layer in self._new_cache().layers
        ]
        sets = layer_sets(windows, self.namespace) if len(windows) == layout.num_layers else []
        self.windowed = (
            WindowedRecords(store, sets, self.record_guard, model.device)
            if any(s.window is not None for s in sets)
            else None
        )

    @property
    def block_size(self) -> int:
        return self.namespace.block_size

    def _new_cache(self) -> DynamicCache:
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def restore(self, input_ids: Any) -> tuple[DynamicCache | None, int]:
        """Read the longest stored prefix of a prompt into a fresh ``DynamicCache``.

        Only whole blocks within ``len(prompt) - 1`` tokens are restored, so at least one
        prompt token is left for the model to compute. A store error counts as a miss.

        Args:
            input_ids: the prompt, a 1-D or ``[1, T]`` tensor or a list of token ids.

        Returns:
            ``(cache, num_cached_tokens)``; ``(None, 0)`` when nothing usable is stored.
        """
        restored = self._restore(_token_list(input_ids))
        return restored.cache, restored.num_cached_tokens

    def _restore(self, tokens: list[int]) -> _Restored:
        max_blocks = (len(tokens) - 1) // self.block_size
        if max_blocks <= 0:
            return _Restored(None, 0, ())
        if self.windowed is not None:
            return self._restore_windowed(tokens)
        keys = block_keys(self.namespace, tokens[: max_blocks * self.block_size])
        try:
            found = self.store.restore_prefix(
                self.namespace.id, keys, fingerprint=self.namespace.fingerprint
            )
        except Exception as exc:  # noqa: BLE001 - a failing store is a miss, never a failed generate
            self.stats.store_errors += 1
            log.warning("cachetier restore failed, computing the whole prompt: %r", exc)
            return _Restored(None, 0, ())
        blocks = self._usable(found.blocks, keys)
        if blocks:
            admitted = self.record_guard.admit(
                self.namespace.id, blocks, found.sources[: len(blocks)], tokens, 0
            )
            blocks = blocks[: admitted.count]
        if not blocks:
            return _Restored(None, 0, ())
        cache = self._new_cache()
        # Each layer's K and V as DynamicLayer holds them, [1, num_kv_heads, tokens, head_dim],
        # filled block by block straight from the tiers' bytes
        # (``cachetier.kernels.paged_layouts``).
        layout = self.namespace.layout
        shape = (1, layout.num_kv_heads, len(blocks) * self.block_size, layout.head_dim)
        dtype, device = torch_dtype(layout.dtype), self.model.device
        layers = [
            (
                torch.empty(shape, dtype=dtype, device=device),
                torch.empty(shape, dtype=dtype, device=device),
            )
            for _ in range(layout.num_layers)
        ]
        _staging(layers, self.block_size).load(range(len(blocks)), [b.data for b in blocks])
        # Through each layer's own update, as a prefill of the prefix would: a sliding-window
        # layer counts every token and keeps its last window - 1 (``hf_layers``).
        for index, (k, v) in enumerate(layers):
            cache.update(k, v, index)
        return self._counted(cache, tuple(found.sources[: len(blocks)]))

    def _restore_windowed(self, tokens: list[int]) -> _Restored:
        assert self.windowed is not None
        try:
            hit = self.windowed.restore(tokens)
        except Exception as exc:  # noqa: BLE001 - a failing store is a miss, never a failed generate
            self.stats.store_errors += 1
            log.warning("cachetier restore failed, computing the whole prompt: %r", exc)
            return _Restored(None, 0, ())
        self.stats.rejected_blocks = self.windowed.rejected
        if hit is None:
            return _Restored(None, 0, ())
        cache = self._new_cache()
        for index, (k, v) in enumerate(hit.layers):
            cache.update(k, v, index)  # a sliding-window layer keeps its last window - 1
        return self._counted(cache, tuple(hit.sources))

    def _counted(self, cache: DynamicCache, sources: tuple[str, ...]) -> _Restored:
        """The restore of one block from each of ``sources``, counted in ``stats``."""
        self.stats.restored_blocks += len(sources)
        for name in sources:
            self.stats.restored_by_tier[name] = self.stats.restored_by_tier.get(name, 0) + 1
        return _Restored(cache, len(sources) * self.block_size, sources)

    def _usable(self, blocks: Sequence[KVBlock], keys: Sequence[BlockHash]) -> list[KVBlock]:
        # The store already checked key and namespace fingerprint; check what the payload claims.
        layout = self.namespace.layout
        good: list[KVBlock] = []
        for block, key in zip(blocks, keys, strict=False):  # blocks may be fewer
            if (
                block.key != key
                or block.fingerprint != self.namespace.fingerprint
                or block.dtype != layout.dtype
                or tuple(block.shape) != self.block_shape
                or block.num_tokens != layout.block_size
                or memoryview(block.data).nbytes != layout.block_bytes
            ):
                self.stats.rejected_blocks += 1
                log.warning("restored block %s does not match the model's layout", key.hex()[:12])
                break
            good.append(block)
        return good

    def save(self, input_ids: Any, cache: DynamicCache) -> int:
        """Store the full blocks of ``input_ids`` whose KV ``cache`` holds and the store lacks.

        Args:
            input_ids: the tokens from position 0 whose KV is in ``cache`` (a 1-D or
                ``[1, T]`` tensor or a list); tokens past the cache's length are ignored.
            cache: a ``DynamicCache`` of this model, batch row 0 holding those tokens.

        Returns:
            Blocks handed to the store (0 on a store error, which is logged and counted). A
            sliding-window layer keeps only its window, so a cache not filled by this
            connector's ``generate`` (which keeps the whole history while it runs) saves
            nothing once a layer has dropped a token of the first block the store lacks.

        Raises:
            ValueError: ``cache`` is not of this model (layer count, dtype or head shape).
        """
        tokens = _token_list(input_ids)
        num_tokens = min(len(tokens), cache.get_seq_length())
        num_blocks = num_tokens // self.block_size
        if num_blocks == 0:
            return 0
        if self.windowed is not None:
            return self._save_windowed(tokens[:num_tokens], cache)
        keys = block_keys(self.namespace, tokens[: num_blocks * self.block_size])
        try:
            start = self.store.lookup(self.namespace.id, keys).num_blocks
        except Exception as exc:  # noqa: BLE001 - a lost save costs a recompute later, nothing more
            self.stats.store_errors += 1
            log.warning("cachetier lookup before save failed: %r", exc)
            return 0
        if start == num_blocks:
            return 0
        first = max((held_from(layer) for layer in cache.layers), default=0)
        if first > start * self.block_size:
            # A layer dropped tokens of the first missing block: a later block alone would
            # never be restored (restores take a prefix), and its tokens' KV is gone.
            log.debug("cache holds tokens from %d only; nothing to save", first)
            return 0
        records = self._records(cache, keys, start)
        try:
            self.store.put_many(self.namespace.id, records)
        except Exception as exc:  # noqa: BLE001 - as above
            self.stats.store_errors += 1
            log.warning("cachetier save failed: %r", exc)
            return 0
        self.stats.saved_blocks += len(records)
        return len(records)

    def _save_windowed(self, tokens: list[int], cache: DynamicCache) -> int:
        assert self.windowed is not None
        num_layers = self.namespace.layout.num_layers
        if len(cache.layers) != num_layers:
            raise ValueError(f"cache has {len(cache.layers)} layers, the model {num_layers}")
        try:
            saved = self.windowed.save(tokens, cache)
        except ValueError:
            raise
        except Exception as exc:  # noqa: BLE001 - a lost save costs a recompute later, nothing more
            self.stats.store_errors += 1
            log.warning("cachetier save failed: %r", exc)
            return 0
        self.stats.saved_blocks += saved
        return saved

    def _records(self, cache: DynamicCache, keys: Sequence[BlockHash], start: int) -> list[KVBlock]:
        layout = self.namespace.layout
        bs = layout.block_size
        begin, end = start * bs, len(keys) * bs
        if len(cache.layers) != layout.num_layers:
            raise ValueError(f"cache has {len(cache.layers)} layers, the model {layout.num_layers}")
        layers = []
        for index, layer in enumerate(cache.layers):
            k, v = layer.keys, layer.values  # [batch, num_kv_heads, seq, head_dim]
            expected = (layout.num_kv_heads, layout.head_dim)
            if k.dtype != torch_dtype(layout.dtype) or (k.shape[1], k.shape[3]) != expected:
                raise ValueError(
                    f"cache layer {index} holds {k.dtype} {tuple(k.shape)}, the layout needs "
                    f"{layout.dtype} [*, {layout.num_kv_heads}, *, {layout.head_dim}]"
                )
            # A sliding-window layer's first held token is not token 0.
            first = held_from(layer)
            layers.append(
                (k[:1, :, begin - first : end - first], v[:1, :, begin - first : end - first])
            )
        staging = _staging(layers, bs)
        staging.save(range(len(keys) - start), None)
        payloads = [p for saved in staging.drain() for p in saved.payloads]
        fp = self.namespace.fingerprint
        return [
            KVBlock(key, fp, layout.dtype, self.block_shape, bs, payload_view(payload))
            for key, payload in zip(keys[start:], payloads, strict=True)
        ]

    def generate(self, input_ids: Any, **generate_kwargs: Any) -> tuple[Any, HFGenerateInfo]:
        """``model.generate`` with the prompt's stored prefix restored and its new blocks saved.

        Args:
            input_ids: one prompt, a ``[1, T]`` or 1-D tensor or a list of token ids.
            generate_kwargs: passed to ``model.generate`` (``max_new_tokens``,
                ``do_sample``...); an ``attention_mask`` must be all ones (no padding).

        Returns:
            ``(output, info)``: what ``model.generate`` returned (token ids ``[1, T + new]``,
            or its output object with ``return_dict_in_generate=True``) and an
            ``HFGenerateInfo``.

        Raises:
            ValueError: a batch of more than one prompt, an empty prompt, padding, caching
                turned off, or a kwarg that would replace the connector's cache.
        """
        tokens = _token_list(input_ids)
        if not tokens:
            raise ValueError("the prompt is empty")
        for name in _RESERVED_KWARGS:
            if name in generate_kwargs:
                raise ValueError(f"do not pass {name!r}: the connector supplies the prompt cache")
        if generate_kwargs.get("use_cache") is False:
            raise ValueError("use_cache=False leaves nothing to restore into; drop it")
        mask = generate_kwargs.pop("attention_mask", None)
        if mask is not None and (tuple(mask.shape)[-1] != len(tokens) or not bool(mask.all())):
            raise ValueError("attention_mask must be all ones over the prompt (no padding)")
        device = self.model.device
        prompt = torch.tensor([tokens], dtype=torch.long, device=device)
        restored = self._restore(tokens)
        cache = restored.cache if restored.cache is not None else self._new_cache()
        keep_whole_history(cache)  # so the blocks past a sliding window can be saved below
        output = self.model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            past_key_values=cache,
            **generate_kwargs,
        )
        sequences = output if isinstance(output, torch.Tensor) else output.sequences
        # The cache holds every token but the last generated one. Its row 0 holds this prompt;
        # with beams or several return sequences its rows need not match the output's, so only
        # the prompt is stored then.
        keep = len(tokens)
        if self.save_generated_tokens and sequences.shape[0] == 1 and cache.get_seq_length():
            keep = sequences.shape[-1] if cache.layers[0].keys.shape[0] == 1 else keep
        try:
            num_saved = self.save(sequences[0, :keep], cache)
        finally:
            trim_history(cache)  # the cache returned to the caller is as plain generate leaves it
        by_source: dict[str, int] = {}
        for name in restored.sources:
            by_source[name] = by_source.get(name, 0) + self.block_size
        info = HFGenerateInfo(
            num_prompt_tokens=len(tokens),
            num_cached_tokens=restored.num_cached_tokens,
            num_computed_prompt_tokens=len(tokens) - restored.num_cached_tokens,
            cached_tokens_by_source=by_source,
            num_saved_blocks=num_saved,
        )
        return output, info


def _token_list(input_ids: Any) -> list[int]:
    """Token ids of one prompt given as a list, a 1-D tensor or a ``[1, T]`` tensor."""
    if isinstance(input_ids, torch.Tensor):
        if input_ids.ndim == 2:
            if input_ids.shape[0] != 1:
                raise ValueError(
                    f"input_ids has a batch of {input_ids.shape[0]}; the connector takes one "
                    "prompt at a time"
                )
            input_ids = input_ids[0]
        if input_ids.ndim != 1:
            raise ValueError(f"input_ids must be [T] or [1, T], got shape {tuple(input_ids.shape)}")
        return [int(t) for t in input_ids.tolist()]
    if isinstance(input_ids, str):
        raise TypeError("input_ids must be token ids; tokenize the text first")
    return [int(t) for t in input_ids]


def _staging(layers: Sequence[tuple[torch.Tensor, torch.Tensor]], block_size: int) -> HostStaging:
    """Block copies between per-layer ``[1, heads, tokens, dim]`` K/V tensors (block ``i`` is
    tokens ``i * block_size ...``) and canonical payloads."""
    axes = ("head", "slot", "dim")
    parts = [
        [axes_view(k[0], axes, block_size=block_size), axes_view(v[0], axes, block_size=block_size)]
        for k, v in layers
    ]
    return HostStaging(PagedBlocks(parts))
