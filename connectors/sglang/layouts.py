"""SGLang's host (HiCache) KV pool layouts as ``kernels.paged_layouts`` parts.

SGLang's ``MHATokenToKVPoolHost`` keeps K and V of every layer in one buffer indexed by token
slot, in one of three layouts (``mem_cache/memory_pool_host.py``, ``init_kv_buffer``):

    layer_first        [2, layers, slots, heads, head_dim]
    page_first         [2, slots, layers, heads, head_dim]
    page_first_direct  [2, pages, layers, page_size, heads, head_dim]

A cachetier block is one SGLang page (``page_size`` tokens, the block size): page ``p`` holds
slots ``p * page_size ...``. SGLang is not installed here, so these axes are written from its
source, not read from it; ``tests/connectors/test_sglang_layouts.py`` checks them against
pools built the way that code builds them.
"""

from __future__ import annotations

import torch

from kernels.paged_layouts import axes_view

HOST_POOL_AXES: dict[str, tuple[str, ...]] = {
    "layer_first": ("kv", "layer", "slot", "head", "dim"),
    "page_first": ("kv", "slot", "layer", "head", "dim"),
    "page_first_direct": ("kv", "block", "layer", "token", "head", "dim"),
}


def host_pool_parts(buffer: torch.Tensor, layout: str, page_size: int) -> list[list[torch.Tensor]]:
    """One part per layer (K and V together) of an SGLang host pool buffer.

    Args:
        buffer: the pool's ``kv_buffer``.
        layout: one of ``HOST_POOL_AXES``.
        page_size: SGLang's page size, the block size of the records.

    Returns:
        Per layer, ``[[part]]`` for ``kernels.paged_layouts.PagedBlocks``.
    """
    if layout not in HOST_POOL_AXES:
        raise ValueError(f"SGLang host layout {layout!r} is not one of {sorted(HOST_POOL_AXES)}")
    axes = HOST_POOL_AXES[layout]
    num_layers = buffer.shape[axes.index("layer")]
    return [
        [axes_view(buffer, axes, block_size=page_size, layer=layer)] for layer in range(num_layers)
    ]
