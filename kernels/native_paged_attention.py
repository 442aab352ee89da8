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
    inputs: DecodeInputs, num_shared_blocks: int = 0
) -> torch.Tensor | None:
    """``paged_attention_decode`` on CPU tensors through the extension.

    Args:
        inputs: the step's inputs, already checked by ``cachetier.kernels.paged_attention``.
        num_shared_blocks: leading block-table columns every row shares (see there). Those
            are read once for the batch as one matmul (``shared_prefix_attention``), each row's
            own blocks by the extension, and the two parts merged by log-sum-exp: without
            it every row would read the shared prefix again.

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
