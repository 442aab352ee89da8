"""Decode attention over the paged KV pool: one new query token per sequence.

``paged_attention_decode_ref`` is the plain-torch oracle of the tests. On CPU, ``"auto"`` runs
the compiled kernel of ``cachetier.kernels.native_paged_attention`` (reads the pool in place) where
it builds, and ``cachetier.kernels.torch_paged_attention`` (per sequence, with shared-prefix reuse)
otherwise or when ``backend="torch"`` is asked for; the Triton kernel lives in
``cachetier.kernels.triton_paged_attention``.
"""

from __future__ import annotations

import dataclasses

import torch

from cachetier.kernels.backend import resolve_backend
from cachetier.kernels.native_paged_attention import paged_attention_decode_native
from cachetier.kernels.pool_shape import (
    INDEX_DTYPES,
    KV_DTYPES,
    DecodeInputs,
    PoolShape,
    check_index_range,
    check_same_dtype,
    check_tensor,
)
from cachetier.kernels.torch_paged_attention import (
    common_prefix_blocks,
    paged_attention_decode_torch,
)


def paged_attention_decode(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    num_shared_blocks: int = 0,
    window: int | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Attends each sequence's query token to its cached K/V in the pool.

    The query is the sequence's last token, so it sees all ``context_lens[b]`` cached tokens
    (its own K/V must already be stored). Scores, softmax and the weighted sum run in float32.

    Args:
        query: ``[batch, num_heads, head_dim]``, the pool's dtype; ``num_heads`` is a multiple
            of ``num_kv_heads`` and query head ``h`` reads KV head ``h // (num_heads //
            num_kv_heads)``.
        kv_cache: the pool, ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``.
        layer: which layer's K/V to read.
        block_tables: ``[batch, max_blocks_per_seq]`` int32/int64 pool block ids; entries past
            a sequence's used blocks are padding (0) and are not read.
        context_lens: ``[batch]`` int32/int64, each in ``[1, max_blocks_per_seq * block_size]``.
        scale: softmax scale, usually ``head_dim ** -0.5``.
        num_shared_blocks: leading block-table columns that every row has in common and that
            lie inside every row's context (``common_prefix_blocks``); the CPU paths read
            them once for the whole batch. It never changes the result, only the work.
        window: sliding-window attention: each query sees only its last ``window`` keys
            (itself included; ``window_start``); None for all of them. The compiled CPU kernel
            has no window, so a windowed call takes the torch path there.
        backend: ``"auto"``, ``"torch"`` or ``"triton"`` (see ``cachetier.kernels.backend``). On CPU
            tensors ``"auto"`` takes the compiled kernel where it is available and ``"torch"``
            always the plain-torch code.

    Returns:
        ``[batch, num_heads, head_dim]`` in the query's dtype.

    Raises:
        ValueError: shapes, dtypes or devices that do not match, a block id out of range, or a
            context length that is 0 or longer than the block table.
    """
    inputs = DecodeInputs(query, kv_cache, layer, block_tables, context_lens, scale)
    pool = _check_decode_inputs(inputs, num_shared_blocks)  # scale is a number from here on
    if window is not None and (
        isinstance(window, bool) or not isinstance(window, int) or window < 1
    ):
        raise ValueError(f"window must be None or a positive int, got {window!r}")
    inputs = dataclasses.replace(inputs, scale=float(scale))
    resolved = resolve_backend(backend, query, kv_cache, block_tables, context_lens)
    if resolved == "triton":
        from cachetier.kernels.triton_paged_attention import paged_attention_decode_triton

        return paged_attention_decode_triton(inputs, pool, window)
    if backend == "auto":
        out = paged_attention_decode_native(inputs, num_shared_blocks, window)
        if out is not None:
            return out
    return paged_attention_decode_torch(inputs, num_shared_blocks, window)


def _check_decode_inputs(inputs: DecodeInputs, num_shared_blocks: int) -> PoolShape:
    """``paged_attention_decode``'s checks (its Raises); returns the pool's sizes."""
    query, kv_cache, layer, block_tables, context_lens, scale = inputs.unpack()
    pool = PoolShape.from_cache(kv_cache)
    pool.check_layer(layer)
    check_tensor("query", query, ndim=3, dtypes=KV_DTYPES)
    check_same_dtype("query", query, kv_cache)
    batch, num_heads, head_dim = query.shape
    if head_dim != pool.head_dim:
        raise ValueError(f"query head_dim {head_dim} does not match kv_cache {pool.head_dim}")
    if num_heads == 0 or num_heads % pool.num_kv_heads != 0:
        raise ValueError(
            f"query num_heads {num_heads} must be a positive multiple of kv_cache "
            f"num_kv_heads {pool.num_kv_heads}"
        )
    check_tensor("block_tables", block_tables, ndim=2, dtypes=INDEX_DTYPES)
    check_tensor("context_lens", context_lens, ndim=1, dtypes=INDEX_DTYPES)
    if block_tables.shape[0] != batch or context_lens.shape[0] != batch:
        raise ValueError(
            f"block_tables {tuple(block_tables.shape)} and context_lens "
            f"{tuple(context_lens.shape)} must both have batch {batch} rows"
        )
    check_index_range("block_tables", block_tables, 0, pool.num_blocks)
    max_context_len = block_tables.shape[1] * pool.block_size
    check_index_range("context_lens", context_lens, 1, max_context_len + 1)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float, got {type(scale).__name__}")
    if num_shared_blocks and num_shared_blocks > common_prefix_blocks(
        block_tables, context_lens, pool.block_size
    ):
        raise ValueError(
            f"num_shared_blocks {num_shared_blocks} is more than the leading blocks every row "
            "shares inside its context (see common_prefix_blocks)"
        )
    if num_shared_blocks < 0:
        raise ValueError(f"num_shared_blocks must be >= 0, got {num_shared_blocks}")
    return pool


def paged_attention_decode_ref(inputs: DecodeInputs, window: int | None = None) -> torch.Tensor:
    """Plain-torch ``paged_attention_decode`` (no input checks), batched with a length mask.

    Args:
        inputs: the step's inputs (``paged_attention_decode``'s first six arguments).
        window: keys before ``context_len - window`` are masked too (None: none are).

    Returns:
        ``[batch, num_heads, head_dim]`` in the query's dtype.
    """
    query, kv_cache, layer, block_tables, context_lens, scale = inputs.unpack()
    batch, num_heads, head_dim = query.shape
    block_size, num_kv_heads = kv_cache.shape[3], kv_cache.shape[4]
    if batch == 0:
        return torch.empty_like(query)
    # Only gather the table columns some sequence uses; the rest is padding.
    num_used_blocks = -(-int(context_lens.max()) // block_size)
    tables = block_tables[:, :num_used_blocks].long()
    kv = kv_cache[tables, layer]  # [batch, num_used_blocks, 2, block_size, num_kv_heads, head_dim]
    num_tokens = num_used_blocks * block_size
    k = kv[:, :, 0].reshape(batch, num_tokens, num_kv_heads, head_dim).float()
    v = kv[:, :, 1].reshape(batch, num_tokens, num_kv_heads, head_dim).float()
    # Query head h = kv_head * group + g, so a view groups the heads that share a KV head.
    q = query.float().reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)

    scores = torch.einsum("bhgd,bthd->bhgt", q, k) * scale  # [batch, num_kv_heads, group, T]
    positions = torch.arange(num_tokens, device=query.device)
    masked = positions[None, :] >= context_lens[:, None]  # [batch, T]
    if window is not None:
        masked |= positions[None, :] < context_lens[:, None] - window
    scores = scores.masked_fill(masked[:, None, None, :], float("-inf"))
    # Slots past the end may hold anything (torch.empty, stale blocks), NaN included, and
    # 0 * NaN is NaN: zero them rather than rely on their zero weight.
    v = v.masked_fill(masked[:, :, None, None], 0.0)
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhgt,bthd->bhgd", probs, v)  # [batch, num_kv_heads, group, head_dim]
    return out.reshape(batch, num_heads, head_dim).to(query.dtype)
