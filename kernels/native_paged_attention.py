"""Decode attention on CPU through a small C++ extension that reads the paged pool in place.

The torch path (``cachetier.kernels.torch_paged_attention``) copies every sequence's blocks out of
the pool and runs two matmuls per sequence and layer from Python; with 64 sequences and 30 layers
that is ~2,000 Python-level calls per decode step. ``csrc/paged_attention_cpu.cpp`` runs one
task per (sequence, KV head) over torch's intra-op threads instead, folding each block into an
online softmax where it lies.

The extension is built on first use by ``cachetier.kernels.native_build``; where it cannot be,
callers take the torch path.
"""

from __future__ import annotations

from types import ModuleType

import torch

from cachetier.kernels.native_build import load_cpu_extension
from cachetier.kernels.pool_shape import DecodeInputs
from cachetier.kernels.torch_paged_attention import merge_attention, shared_prefix_attention


def native_decode_kernel() -> ModuleType | None:
    """The compiled extension (its ``paged_attention_decode``), or ``None`` where it is off or
    cannot be built (see ``cachetier.kernels.native_build``)."""
    return load_cpu_extension("cachetier_paged_attention_cpu", "paged_attention_cpu.cpp")


def paged_attention_decode_native(
    inputs: DecodeInputs, num_shared_blocks: int = 0, window: int | None = None
) -> torch.Tensor | None:
    """``paged_attention_decode`` on CPU tensors through the extension.

    Args:
        inputs: the step's inputs, already checked by ``cachetier.kernels.paged_attention``.
        num_shared_blocks: leading block-table columns every row shares (see there). Those
            are read once for the batch as one matmul (``shared_prefix_attention``), each row's
            own blocks by the extension, and the two parts merged by log-sum-exp: without
            it every row would read the shared prefix again.
        window: a sliding window (see ``paged_attention_decode``). The extension has no
            window; it reads each row's whole blocks after the window's first one in place, and
            the keys of that first block are attended here (``_windowed_decode``).

    Returns:
        ``[batch, num_heads, head_dim]`` in the query's dtype, or ``None`` where the extension
        is unavailable, is not built for these shapes, or the tensors are not on the CPU (the
        caller takes the torch path).
    """
    query, kv_cache, layer, block_tables, context_lens, scale = inputs.unpack()
    if query.device.type != "cpu" or not kv_cache.is_contiguous() or query.shape[0] == 0:
        return None
    kernel = native_decode_kernel()
    if kernel is None:
        return None
    query = query.contiguous()
    tables, lens = block_tables.long(), context_lens.long()
    if window is not None:
        return _windowed_decode(
            kernel, DecodeInputs(query, kv_cache, layer, tables, lens, scale), window
        )
    if not num_shared_blocks:
        return kernel.paged_attention_decode(query, kv_cache, layer, tables, lens, float(scale))
    part = kernel.paged_attention_decode_part(
        query, kv_cache, layer, tables, lens, float(scale), num_shared_blocks
    )
    if not part:
        return None
    own_out, own_lse = part  # [batch, num_heads, head_dim], [batch, num_heads]
    shared_out, shared_lse = shared_prefix_attention(inputs, num_shared_blocks)
    merged = merge_attention(
        shared_out.reshape(own_out.shape), shared_lse.reshape(own_lse.shape), own_out, own_lse
    )
    return merged.to(query.dtype)


def _windowed_decode(kernel: ModuleType, inputs: DecodeInputs, window: int) -> torch.Tensor | None:
    # Each row sees keys window_start(len, window) .. len - 1. Its window's whole blocks after
    # the first go to the extension in place (a table shifted per row, lengths counted from
    # there); the first block, where the window starts part-way, is attended here for all
    # rows at once, and the two parts merged by log-sum-exp.
    query, kv_cache, layer, tables, lens, scale = inputs.unpack()
    batch, num_heads, head_dim = query.shape
    block_size, num_kv_heads = kv_cache.shape[3], kv_cache.shape[4]
    start = (lens - window).clamp(min=0)  # [B] each row's first key
    head = start // block_size  # [B] the table column holding it
    columns = head[:, None] + 1 + torch.arange(tables.shape[1])[None, :]
    rest = tables.gather(1, columns.clamp(max=tables.shape[1] - 1))  # padding past the end
    rest_lens = (lens - (head + 1) * block_size).clamp(min=0)  # 0: the window is one block
    part = kernel.paged_attention_decode_part(
        query, kv_cache, layer, rest, rest_lens, float(scale), 0
    )
    if not part:
        return None
    rest_out, rest_lse = part  # [B, hq, d], [B, hq]; an empty rest gives 0 and -inf
    ids = tables.gather(1, head[:, None])[:, 0]
    k = kv_cache[ids, layer, 0].float()  # [B, block_size, hk, d]
    v = kv_cache[ids, layer, 1].float()
    positions = head[:, None] * block_size + torch.arange(block_size)[None, :]
    seen = (positions >= start[:, None]) & (positions < lens[:, None])  # [B, block_size]
    q = query.float().view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.einsum("bhgd,bthd->bhgt", q, k) * scale
    scores = scores.masked_fill(~seen[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # finite: every row sees its first key
    # Slots outside the window may hold anything, NaN included: zero them, not just weight 0.
    v = v.masked_fill(~seen[:, :, None, None], 0.0)
    out = torch.einsum("bhgt,bthd->bhgd", torch.exp(scores - lse[..., None]), v)
    merged = merge_attention(
        out.reshape(rest_out.shape), lse.reshape(rest_lse.shape), rest_out, rest_lse
    )
    return merged.to(query.dtype)
