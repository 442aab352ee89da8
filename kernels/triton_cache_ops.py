"""Triton kernels that write tokens into the paged KV pool and copy whole blocks in and out.

Imported lazily by ``cachetier.kernels.cache_ops`` (``@triton.jit`` decides at import time whether
to compile or interpret). The launchers here trust their inputs: ``cachetier.kernels.cache_ops``
checks them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cachetier.kernels.pool_shape import PoolShape

# Elements per program when copying a flat row; a block is tiled by this many.
COPY_BLOCK = 1024


@triton.jit
def store_kvcache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim], last dim contiguous
    value_ptr,  # [num_tokens, num_kv_heads, head_dim], last dim contiguous
    kv_cache_ptr,  # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim], contiguous
    slot_mapping_ptr,  # [num_tokens]; -1 marks a padding token that is not written
    key_stride_token,
    key_stride_head,
    value_stride_token,
    value_stride_head,
    cache_stride_block,
    cache_stride_kv,
    cache_stride_token,
    layer_offset,  # layer * cache_stride_layer, in elements
    block_size,
    HEAD_DIM: tl.constexpr,
    ROW_NUMEL: tl.constexpr,  # num_kv_heads * head_dim: one token's K (or V) in the pool
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] into the token's row
    # In bounds without a mask: the grid has exactly one program row per token.
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        # A padding token: nothing to write. (Returning early rather than folding slot >= 0
        # into the mask also sidesteps a Triton 3.9 interpreter bug with scalar & tensor masks.)
        return
    mask = offs < ROW_NUMEL
    head = offs // HEAD_DIM
    dim = offs % HEAD_DIM

    block_id = slot // block_size
    block_offset = slot % block_size
    # The pool's [num_kv_heads, head_dim] row of one token is contiguous, so offs indexes it.
    dst = kv_cache_ptr + block_id * cache_stride_block + layer_offset
    dst += block_offset * cache_stride_token + offs

    k = tl.load(key_ptr + token * key_stride_token + head * key_stride_head + dim, mask=mask)
    tl.store(dst, k, mask=mask)
    v = tl.load(value_ptr + token * value_stride_token + head * value_stride_head + dim, mask=mask)
    tl.store(dst + cache_stride_kv, v, mask=mask)


@triton.jit
def copy_blocks_kernel(
    src_ptr,  # gather: the pool; scatter: the staging buffer
    dst_ptr,  # gather: the staging buffer; scatter: the pool
    block_ids_ptr,  # [n] pool block ids
    block_numel,  # elements per block (all layers, K and V)
    GATHER: tl.constexpr,  # True: pool[block_ids[i]] -> staging[i]; False: the reverse
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] into a block
    mask = offs < block_numel
    # In bounds without a mask: the grid has exactly one program row per block id.
    block_id = tl.load(block_ids_ptr + i).to(tl.int64)
    if GATHER:
        src_row = block_id
        dst_row = i
    else:
        src_row = i
        dst_row = block_id
    x = tl.load(src_ptr + src_row * block_numel + offs, mask=mask)
    tl.store(dst_ptr + dst_row * block_numel + offs, x, mask=mask)


def store_kvcache_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    slot_mapping: torch.Tensor,
    pool: PoolShape,
) -> None:
    """Launches ``store_kvcache_kernel``; see ``cachetier.kernels.cache_ops.store_kvcache``."""
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    # The kernel indexes head_dim with unit stride; views from a fused QKV split keep it.
    key = key if key.stride(2) == 1 else key.contiguous()
    value = value if value.stride(2) == 1 else value.contiguous()
    slot_mapping = slot_mapping.contiguous()
    row_numel = pool.num_kv_heads * pool.head_dim
    block = min(COPY_BLOCK, triton.next_power_of_2(row_numel))
    grid = (num_tokens, triton.cdiv(row_numel, block))
    store_kvcache_kernel[grid](
        key,
        value,
        kv_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(2),
        kv_cache.stride(3),
        layer * kv_cache.stride(1),
        pool.block_size,
        HEAD_DIM=pool.head_dim,
        ROW_NUMEL=row_numel,
        BLOCK=block,
    )


def copy_blocks_triton(
    src: torch.Tensor,
    dst: torch.Tensor,
    block_ids: torch.Tensor,
    pool: PoolShape,
    *,
    gather: bool,
) -> None:
    """Launches ``copy_blocks_kernel``; see ``gather_blocks`` and ``scatter_blocks``."""
    num_ids = block_ids.shape[0]
    if num_ids == 0:
        return
    block_ids = block_ids.contiguous()
    grid = (num_ids, triton.cdiv(pool.block_numel, COPY_BLOCK))
    copy_blocks_kernel[grid](
        src,
        dst,
        block_ids,
        pool.block_numel,
        GATHER=gather,
        BLOCK=COPY_BLOCK,
    )
