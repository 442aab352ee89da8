"""Which transformers cache layers ``HFCacheConnector`` can restore, and where a layer's KV starts.

A record holds every layer's K and V of its tokens, so the connector serves a model only when
each layer's whole cache is per-token attention KV:

- ``full_attention`` (``DynamicLayer``) keeps every token.
- ``sliding_attention`` (``DynamicSlidingWindowLayer``) keeps only its last ``window - 1``
  tokens after an update, but counts them all (``cumulative_length``). A restore feeds the
  whole prefix through that same ``update``, so the layer then holds exactly what a prefill of
  the prefix leaves, and the next forward masks it as it would after that prefill.

A recurrent layer (Mamba, gated delta net, linear attention, a conv state) holds a state that
sums its whole past; no record holds it, so such models are refused when the connector is
made. So are layer kinds not yet checked here (chunked, indexed, compressed attention).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import DynamicCache

# Layer types (transformers' ``config.layer_types`` names) the connector restores.
_SUPPORTED = ("full_attention", "sliding_attention")
# Layer types whose cache holds a recurrent or convolution state, not only per-token KV
# (transformers ``ALLOWED_ATTN_LAYER_TYPES``; "mamba" is the legacy name of linear_attention).
_RECURRENT = ("conv", "linear_attention", "hybrid", "hybrid_sliding", "mamba")


def check_layer_types(config: Any, num_layers: int) -> None:
    """Refuse a model whose cache the connector cannot restore exactly.

    Args:
        config: the model's ``PretrainedConfig``.
        num_layers: the layer count of the connector's record layout.

    Raises:
        ValueError: a recurrent layer, a layer kind other than full or sliding-window
            attention, or a cache whose layer count is not ``num_layers``; the message names
            the model type and its layer types.
    """
    from transformers import DynamicCache
    from transformers.cache_utils import (
        DynamicLayer,
        DynamicSlidingWindowLayer,
        LinearAttentionCacheLayerMixin,
        get_layer_types_and_kwargs,
    )

    text = config.get_text_config(decoder=True)
    layer_types, _ = get_layer_types_and_kwargs(text)
    kinds = set(layer_types)
    named = f"{text.model_type}: layer types {sorted(kinds)}"
    recurrent = ValueError(
        f"{named}: cachetier's HF connector restores attention KV only; a recurrent layer's "
        "state is not stored. Run this model without the connector."
    )
    if kinds & set(_RECURRENT):
        raise recurrent
    if not kinds <= set(_SUPPORTED):
        raise _unsupported(named, sorted(kinds - set(_SUPPORTED)))
    layers = DynamicCache(config=config).layers
    if any(isinstance(x, LinearAttentionCacheLayerMixin) for x in layers):
        raise recurrent
    # Exact classes: a subclass of DynamicLayer (quantized, indexed) holds its KV otherwise.
    classes = {type(x) for x in layers} - {DynamicLayer, DynamicSlidingWindowLayer}
    if classes:
        raise _unsupported(named, sorted(c.__name__ for c in classes))
    if len(layers) != num_layers:
        raise ValueError(
            f"{named}: the model's cache has {len(layers)} layers, its config says {num_layers}"
        )


def _unsupported(named: str, kinds: list[str]) -> ValueError:
    return ValueError(
        f"{named}: cachetier's HF connector restores full and sliding-window attention KV "
        f"only, not {', '.join(kinds)}. Run this model without the connector."
    )


def held_from(layer: Any) -> int:
    """Position of the first token whose KV ``layer`` holds: 0 for a full-attention layer, and
    for a sliding-window one the tokens it counts less the ones it kept."""
    if not layer.is_initialized or layer.keys is None:
        return 0
    return layer.get_seq_length() - layer.keys.shape[-2]


def keep_whole_history(cache: DynamicCache) -> None:
    """Make the sliding-window layers of ``cache`` keep every token until ``trim_history``, so
    the blocks a generate computes can be saved; attention still sees only the window
    (``DynamicSlidingWindowLayer.update`` returns the window's states while recording)."""
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False):
            layer.activate_past_recording()


def trim_history(cache: DynamicCache) -> None:
    """Undo ``keep_whole_history``: each sliding-window layer keeps its last ``window - 1``
    tokens again, as after a generate without the connector."""
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False) and layer.record_past:
            if layer.is_initialized:
                layer.crop(0)  # with recording on: keep the window's tokens, drop none counted
            layer.record_past = False
