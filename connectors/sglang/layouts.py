"""SGLang's host (HiCache) KV pool layouts as ``cachetier.kernels.paged_layouts`` parts.

SGLang's host pools keep every layer's KV in one buffer indexed by token slot, in one of these
layouts (``mem_cache/pool_host/mha.py`` and ``mla.py``, ``init_kv_buffer``; SGLang 0.5.23):

    MHA  layer_first        [2, layers, slots, heads, head_dim]
         page_first         [2, slots, layers, heads, head_dim]
         page_first_direct  [2, pages, layers, page_size, heads, head_dim]
         page_head          [2, pages, heads, page_size, layers, head_dim]
    MLA  layer_first        [layers, slots, 1, kv_cache_dim]
         page_first         [slots, layers, 1, kv_cache_dim]
         page_first_direct  [pages, layers, page_size, 1, kv_cache_dim]

A cachetier block is one SGLang page (``page_size`` tokens, the block size): page ``p`` holds
slots ``p * page_size ...``. One page taken out of a pool (``get_data_page``, flattened) has the
pool's own layout with one page in it, so ``page_shape`` and the same axes read it too.
"""

from __future__ import annotations

import torch

from cachetier.kernels.paged_layouts import axes_view

HOST_POOL_AXES: dict[str, tuple[str, ...]] = {
    "layer_first": ("kv", "layer", "slot", "head", "dim"),
    "page_first": ("kv", "slot", "layer", "head", "dim"),
    "page_first_direct": ("kv", "block", "layer", "token", "head", "dim"),
    "page_head": ("kv", "block", "head", "token", "layer", "dim"),
}
MLA_HOST_POOL_AXES: dict[str, tuple[str, ...]] = {
    "layer_first": ("layer", "slot", "head", "dim"),
    "page_first": ("slot", "layer", "head", "dim"),
    "page_first_direct": ("block", "layer", "token", "head", "dim"),
}


def pool_axes(layout: str, *, mla: bool) -> tuple[str, ...]:
    """The axes of an SGLang host pool buffer.

    Args:
        layout: SGLang's ``--hicache-mem-layout`` name.
        mla: whether the pool is an MLA pool (one latent per token).

    Returns:
        One ``cachetier.kernels.paged_layouts.AXES`` name per buffer dimension.

    Raises:
        ValueError: a layout cachetier does not read (e.g. ``page_unified``).
    """
    table = MLA_HOST_POOL_AXES if mla else HOST_POOL_AXES
    if layout not in table:
        kind = "MLA" if mla else "MHA"
        raise ValueError(f"SGLang {kind} host layout {layout!r} is not one of {sorted(table)}")
    return table[layout]


def host_pool_parts(
    buffer: torch.Tensor, layout: str, page_size: int, *, mla: bool = False
) -> list[list[torch.Tensor]]:
    """One part per layer (K and V together, or the MLA latent) of an SGLang host pool buffer.

    Args:
        buffer: the pool's ``kv_buffer``.
        layout: one of ``HOST_POOL_AXES`` (``MLA_HOST_POOL_AXES`` for ``mla``).
        page_size: SGLang's page size, the block size of the records.
        mla: whether the pool is an MLA pool.

    Returns:
        Per layer, ``[[part]]`` for ``cachetier.kernels.paged_layouts.PagedBlocks``.
    """
    axes = pool_axes(layout, mla=mla)
    num_layers = buffer.shape[axes.index("layer")]
    return [
        [axes_view(buffer, axes, block_size=page_size, layer=layer)] for layer in range(num_layers)
    ]


def page_shape(
    layout: str, *, mla: bool, page_size: int, num_layers: int, num_heads: int, head_dim: int
) -> tuple[int, ...]:
    """Shape of one page as SGLang's ``get_data_page`` cuts it (a pool of that one page).

    Args:
        layout: the pool's layout.
        mla: whether the pool is an MLA pool (``num_heads`` is then 1, ``head_dim`` the latent).
        page_size: tokens per page.
        num_layers: layers the pool holds.
        num_heads: KV heads per layer.
        head_dim: elements per head.

    Returns:
        The page's shape; its flat form is what SGLang's key-based storage calls pass.
    """
    sizes = {
        "kv": 2,
        "block": 1,
        "slot": page_size,
        "token": page_size,
        "layer": num_layers,
        "head": num_heads,
        "dim": head_dim,
    }
    return tuple(sizes[axis] for axis in pool_axes(layout, mla=mla))
