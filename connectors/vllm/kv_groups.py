"""Which of vLLM's KV cache configs cachetier can store, checked as the connector starts.

cachetier stores and restores every full block of one KV cache group, the same bytes for every
layer, keyed by the tokens before it. That is right where vLLM keeps the KV of every token of
that group: a ``FullAttentionSpec`` (or MLA) group. The connector does not take vLLM's hybrid
KV cache manager (``SupportsHMA``), so vLLM turns that manager off, and then a model with both
sliding-window and full-attention layers (Gemma-3) gets one ``FullAttentionSpec``
group with ``sliding_window`` set: blocks are kept for every token, and the attention applies
the window on its own (``vllm.v1.core.kv_cache_utils._promote_local_kv_cache_specs``). Chunked
local attention next to full attention is promoted the same way (``attention_chunk_size`` set).

Anything else is refused before a request runs, with what is unsupported in the message:
recurrent state (Mamba and other linear-attention layers), a group of sliding-window layers
only (vLLM frees its blocks outside the window, so there is no whole prefix to store), several
groups, encoder or cross attention, non-causal layers, sink tokens. A restored block must never
meet a model that needs state the block does not hold.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

_SERVE_WITHOUT = "serve this model without the cachetier connector"

# Why a spec class cannot be stored, checked in this order (subclasses before their bases).
_REFUSED: tuple[tuple[type[KVCacheSpec], str], ...] = (
    (MambaSpec, "recurrent state; cachetier does not store recurrent state"),
    (
        SlidingWindowSpec,
        "a sliding window on every attention layer; vLLM frees their blocks outside the window, "
        "so cachetier has no whole prefix to store",
    ),
    (
        ChunkedLocalAttentionSpec,
        "chunked local attention on every attention layer; vLLM frees their blocks of earlier "
        "chunks, so cachetier has no whole prefix to store",
    ),
    (CrossAttentionSpec, "cross-attention to an encoder's output, which is not a prompt prefix"),
    (EncoderOnlyAttentionSpec, "encoder-only attention, which keeps no KV between steps"),
    (
        UniformTypeKVCacheSpecs,
        "layers of different KV shapes in one group; cachetier stores one shape per block",
    ),
)
# Exactly these types hold every token's KV in one shape; their subclasses (sink tokens,
# R-SWA, hidden-state caches) keep other things or free blocks, and are refused.
_STORED = (FullAttentionSpec, MLAAttentionSpec)


def refusal_of(spec: KVCacheSpec) -> str | None:
    """Why cachetier cannot store the blocks of a KV cache group of this spec, else ``None``.

    Args:
        spec: one group's ``kv_cache_spec``.

    Returns:
        A phrase naming the spec class and what it holds that cachetier does not store.
    """
    name = type(spec).__name__
    for cls, why in _REFUSED:
        if isinstance(spec, cls):
            return f"{name} layers ({why})"
    if type(spec) not in _STORED:
        return f"{name} layers (a kind of attention cachetier does not store)"
    assert isinstance(spec, FullAttentionSpec), "every class of _STORED is a FullAttentionSpec"
    if spec.non_causal:
        return f"non-causal {name} layers (a block's KV depends on the tokens after it)"
    # MLA stores one latent per token (``head_size_v`` 0), which its arrangement reads whole.
    if not isinstance(spec, MLAAttentionSpec) and spec.head_size_v != spec.head_size:
        return f"{name} layers with a value size {spec.head_size_v} != key size {spec.head_size}"
    # Unquantized or fp8 with one scale per layer; other modes keep per-token scales or packed
    # formats the canonical block does not hold.
    if int(spec.kv_quant_mode) not in (0, 1):
        return f"{name} layers with KV quantization {spec.kv_quant_mode!r}"
    return None


def storable_spec(kv_cache_config: KVCacheConfig, model: str) -> FullAttentionSpec:
    """The spec of the one KV cache group whose every full block cachetier stores.

    Args:
        kv_cache_config: vLLM's KV cache config, as the connector receives it.
        model: the model's name or folder, for the message.

    Returns:
        The group's spec: a ``FullAttentionSpec`` (or MLA), ``sliding_window`` or
        ``attention_chunk_size`` possibly set (every token's KV kept all the same).

    Raises:
        ValueError: the config holds anything else; the message names it.
    """
    groups = kv_cache_config.kv_cache_groups
    if not groups:
        raise ValueError(f"{model} has no KV cache (attention-free): {_SERVE_WITHOUT}")
    for group in groups:
        refusal = refusal_of(group.kv_cache_spec)
        if refusal is not None:
            raise ValueError(
                f"{refusal} of {model} ({', '.join(group.layer_names[:2])}, ...): {_SERVE_WITHOUT}"
            )
    if len(groups) != 1:
        kinds = ", ".join(type(group.kv_cache_spec).__name__ for group in groups)
        raise ValueError(
            f"{len(groups)} KV cache groups ({kinds}) of {model}: cachetier stores the blocks "
            f"of one group; {_SERVE_WITHOUT}"
        )
    spec = groups[0].kv_cache_spec
    assert isinstance(spec, FullAttentionSpec), "refusal_of passes FullAttentionSpecs only"
    return spec
