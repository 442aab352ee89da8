"""Triton decode attention over the paged KV pool.

Imported lazily by ``cachetier.kernels.paged_attention`` (``@triton.jit`` decides at import time
whether to compile or interpret). The launcher trusts its inputs:
``cachetier.kernels.paged_attention`` checks them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cachetier.kernels.pool_shape import DecodeInputs, PoolShape

LOG2E = 1.4426950408889634


@triton.jit
def paged_attention_decode_kernel(
    out_ptr,  # [batch, num_heads, head_dim], last dim contiguous
    query_ptr,  # [batch, num_heads, head_dim], last dim contiguous
    kv_cache_ptr,  # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim], contiguous
    block_tables_ptr,  # [batch, max_blocks_per_seq]
    context_lens_ptr,  # [batch], each >= 1
    window,  # keys seen per query, itself included (the whole table's tokens for no window)
    scale_log2,  # softmax scale * log2(e): scores go through exp2 instead of exp
    query_stride_batch,
    query_stride_head,
    out_stride_batch,
    out_stride_head,
    block_tables_stride_batch,
    cache_stride_block,
    cache_stride_kv,
    cache_stride_token,
    cache_stride_head,
    layer_offset,  # layer * cache_stride_layer, in elements
    block_size,
    head_dim,
    num_queries_per_kv,  # num_heads // num_kv_heads
    GROUP_PAD: tl.constexpr,  # num_queries_per_kv rounded up to a power of two
    BLOCK_SIZE_PAD: tl.constexpr,  # block_size rounded up to a power of two
    HEAD_DIM_PAD: tl.constexpr,  # head_dim rounded up to a power of two
):
    # One program per (sequence, KV head): the query heads that share this KV head are handled
    # together, so each K/V block is read from memory once per group rather than once per head.
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    g = tl.arange(0, GROUP_PAD)  # [G] query head within the group
    t = tl.arange(0, BLOCK_SIZE_PAD)  # [T] token within a block
    d = tl.arange(0, HEAD_DIM_PAD)  # [D]
    g_mask = g < num_queries_per_kv
    d_mask = d < head_dim
    q_mask = g_mask[:, None] & d_mask[None, :]  # [G, D]
    heads = kv_head * num_queries_per_kv + g  # [G] query head ids

    q_ptrs = query_ptr + seq * query_stride_batch + heads[:, None] * query_stride_head + d[None, :]
    q = tl.load(q_ptrs, mask=q_mask, other=0.0).to(tl.float32)  # [G, D]
    q = q * scale_log2
    # In bounds without a mask: the grid has exactly one program row per sequence.
    context_len = tl.load(context_lens_ptr + seq)

    # Online softmax state per query head: running max, running sum of exp2, weighted V sum.
    row_max = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)

    kv_base = kv_cache_ptr + layer_offset + kv_head * cache_stride_head
    num_context_blocks = tl.cdiv(context_len, block_size)
    # A window starts the walk at the block of its first key (the query is the last token).
    first_key = tl.maximum(context_len - window, 0)
    for i in range(first_key // block_size, num_context_blocks):
        # In bounds: the wrapper checked context_len <= max_blocks_per_seq * block_size.
        block_id = tl.load(block_tables_ptr + seq * block_tables_stride_batch + i).to(tl.int64)
        pos = i * block_size + t
        t_mask = (t < block_size) & (pos < context_len) & (pos >= first_key)  # [T]
        kv_mask = t_mask[:, None] & d_mask[None, :]  # [T, D]
        kv_offs = block_id * cache_stride_block + t[:, None] * cache_stride_token + d[None, :]
        k = tl.load(kv_base + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)  # [T, D]
        v = tl.load(kv_base + cache_stride_kv + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)

        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [G, T], log2 units
        s = tl.where(t_mask[None, :], s, float("-inf"))
        # Every block in the loop holds at least one live token, so new_max is finite and the
        # first rescale is exp2(-inf) = 0 rather than NaN.
        new_max = tl.maximum(row_max, tl.max(s, axis=1))  # [G]
        alpha = tl.exp2(row_max - new_max)  # [G] rescales what was summed under the old max
        p = tl.exp2(s - new_max[:, None])  # [G, T]
        row_sum = row_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)  # [G, D]
        row_max = new_max

    out = acc / row_sum[:, None]
    out_ptrs = out_ptr + seq * out_stride_batch + heads[:, None] * out_stride_head + d[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_attention_decode_triton(
    inputs: DecodeInputs, pool: PoolShape, window: int | None = None
) -> torch.Tensor:
    """Launches ``paged_attention_decode_kernel``; see ``paged_attention_decode``."""
    query, kv_cache, layer, block_tables, context_lens, scale = inputs.unpack()
    batch, num_heads, head_dim = query.shape
    out = torch.empty((batch, num_heads, head_dim), dtype=query.dtype, device=query.device)
    if batch == 0:
        return out
    query = query if query.stride(2) == 1 else query.contiguous()
    # The kernel walks a table row and the lengths with unit stride.
    block_tables = block_tables.contiguous()
    context_lens = context_lens.contiguous()
    num_queries_per_kv = num_heads // pool.num_kv_heads
    grid = (batch, pool.num_kv_heads)
    paged_attention_decode_kernel[grid](
        out,
        query,
        kv_cache,
        block_tables,
        context_lens,
        block_tables.shape[1] * pool.block_size if window is None else window,
        scale * LOG2E,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        kv_cache.stride(0),
        kv_cache.stride(2),
        kv_cache.stride(3),
        kv_cache.stride(4),
        layer * kv_cache.stride(1),
        pool.block_size,
        head_dim,
        num_queries_per_kv,
        GROUP_PAD=triton.next_power_of_2(num_queries_per_kv),
        BLOCK_SIZE_PAD=triton.next_power_of_2(pool.block_size),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
    )
    return out
