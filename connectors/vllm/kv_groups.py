"""Which of vLLM's KV cache configs cachetier can store, checked as the connector starts.

cachetier stores the blocks of each KV cache group in records of that group's layers, keyed
by the tokens before them. The connector takes vLLM's hybrid KV cache manager
(``SupportsHMA``), so vLLM splits a model's layers into groups of one kind each
(``storable_groups``):

- a ``FullAttentionSpec`` (or MLA) group keeps every token's KV: every full block is stored,
  and a hit needs every block of its prefix;
- a ``SlidingWindowSpec`` group keeps the blocks of the window only (vLLM frees the others):
  a hit ending at token ``P`` needs the blocks holding tokens ``[P - W + 1, P)``, and the
  scheduler stores only the blocks some hit it can offer would need.

Where the manager is off (``disable_hybrid_kv_cache_manager``), a model with both kinds
(Gemma-3) gets one ``FullAttentionSpec`` group with ``sliding_window`` set, whose blocks are
kept for every token (``vllm.v1.core.kv_cache_utils._promote_local_kv_cache_specs``); chunked
local attention next to full attention is promoted the same way.

Anything else is refused before a request runs, with what is unsupported in the message:
recurrent state (Mamba and other linear-attention layers), chunked local attention in a group
of its own, groups of several block sizes, encoder or cross attention, non-causal layers, sink
tokens. A restored block must never meet a model that needs state the block does not hold.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
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

from cachetier.primitives.layer_sets import first_needed_block

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

_SERVE_WITHOUT = "serve this model without the cachetier connector"

# Why a spec class cannot be stored, checked in this order (subclasses before their bases).
_REFUSED: tuple[tuple[type[KVCacheSpec], str], ...] = (
    (MambaSpec, "recurrent state; cachetier does not store recurrent state"),
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
# Exactly these types hold every token's KV (or a window's) in one shape; their subclasses
# (sink tokens, R-SWA, hidden-state caches, sliding MLA) keep other things, and are refused.
_STORED = (FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec)
_LAYER_INDEX = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


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
    if isinstance(spec, SlidingWindowSpec):
        if spec.extra_retained_tokens:  # blocks kept for spec decoding, not attended
            return f"{name} layers retaining {spec.extra_retained_tokens} tokens past the window"
        return _shape_refusal(spec, name)
    assert isinstance(spec, FullAttentionSpec), "the other classes of _STORED are full attention"
    if spec.non_causal:
        return f"non-causal {name} layers (a block's KV depends on the tokens after it)"
    return _shape_refusal(spec, name)


def _shape_refusal(spec: FullAttentionSpec | SlidingWindowSpec, name: str) -> str | None:
    """Why a group's cells do not fit a canonical block, else ``None``."""
    # MLA stores one latent per token (``head_size_v`` 0), which its arrangement reads whole.
    if not isinstance(spec, MLAAttentionSpec) and spec.head_size_v != spec.head_size:
        return f"{name} layers with a value size {spec.head_size_v} != key size {spec.head_size}"
    # Unquantized or fp8 with one scale per layer; other modes keep per-token scales or packed
    # formats the canonical block does not hold.
    if int(spec.kv_quant_mode) not in (0, 1):
        return f"{name} layers with KV quantization {spec.kv_quant_mode!r}"
    return None


@dataclass(frozen=True, slots=True)
class StoredGroup:
    """One KV cache group as cachetier stores it.

    Args:
        index: the group's index in vLLM's ``kv_cache_groups`` (its block ids' place).
        spec: the group's spec.
        layer_names: its attention layers in model order (the layers of its records).
        window: tokens a query attends to, itself included, where vLLM keeps only the window's
            blocks (``SlidingWindowSpec``); ``None`` where it keeps every block.
        layers: the model layer indices the group's records hold (``Namespace.layers``), ``""``
            where one group holds every layer.
    """

    index: int
    spec: FullAttentionSpec | SlidingWindowSpec
    layer_names: tuple[str, ...]
    window: int | None
    layers: str

    def first_needed_block(self, num_tokens: int) -> int:
        """The first block a hit of ``num_tokens`` tokens needs in this group: 0 for full
        attention; for a window ``W``, the block of token ``num_tokens - W + 1`` (the first the
        next token attends to), as vLLM's ``SlidingWindowManager.get_num_skipped_tokens``."""
        return first_needed_block(self.window, num_tokens, self.spec.block_size)


def storable_groups(kv_cache_config: KVCacheConfig, model: str) -> list[StoredGroup]:
    """Every KV cache group, as cachetier stores it (module docstring).

    Args:
        kv_cache_config: vLLM's KV cache config, as the connector receives it.
        model: the model's name or folder, for the message.

    Returns:
        The groups in vLLM's order; a single group stands for every layer (``layers`` "").

    Raises:
        ValueError: a group cachetier cannot store, or groups of several block sizes; the
            message names it.
    """
    groups = kv_cache_config.kv_cache_groups
    if not groups:
        raise ValueError(f"{model} has no KV cache (attention-free): {_SERVE_WITHOUT}")
    out: list[StoredGroup] = []
    for index, group in enumerate(groups):
        spec = group.kv_cache_spec
        refusal = refusal_of(spec)
        if refusal is not None:
            raise ValueError(
                f"{refusal} of {model} ({', '.join(group.layer_names[:2])}, ...): {_SERVE_WITHOUT}"
            )
        assert isinstance(spec, (FullAttentionSpec, SlidingWindowSpec)), "refusal_of passed it"
        window = spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
        layers = "" if len(groups) == 1 else ",".join(_layer_indices(group.layer_names, model))
        out.append(StoredGroup(index, spec, tuple(group.layer_names), window, layers))
    sizes = sorted({group.spec.block_size for group in out})
    if len(sizes) > 1:
        raise ValueError(
            f"KV cache groups of {model} with block sizes {sizes}: cachetier keys one block size "
            f"for all groups; {_SERVE_WITHOUT}"
        )
    return out


def _layer_indices(layer_names: tuple[str, ...] | list[str], model: str) -> list[str]:
    """Each layer's index in the model, from its name (``model.layers.3.self_attn.attn``)."""
    out = []
    for name in layer_names:
        found = _LAYER_INDEX.findall(name)
        if len(found) != 1:
            raise ValueError(
                f"layer {name!r} of {model} does not name one layer index; cachetier names a "
                f"group's records by its layers: {_SERVE_WITHOUT}"
            )
        out.append(found[0])
    return out
