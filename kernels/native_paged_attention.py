"""Decode attention on CPU through a small C++ extension that reads the paged pool in place.

The torch path (``kernels.torch_paged_attention``) copies every sequence's blocks out of the
pool and runs two matmuls per sequence and layer from Python; with 64 sequences and 30 layers
that is ~2,000 Python-level calls per decode step. ``csrc/paged_attention_cpu.cpp`` runs one
task per (sequence, KV head) over torch's intra-op threads instead, folding each block into an
online softmax where it lies.

The extension is compiled on first use with ``torch.utils.cpp_extension`` (g++ and ninja; torch
caches the build under ``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``, and
rebuilds when the source changes). Where it cannot be built (no compiler, a read-only cache)
``native_decode_kernel`` returns ``None`` once and for all, with one warning, and callers take
the torch path: the results are the same, only slower.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from types import ModuleType

import torch

from kernels.pool_shape import DecodeInputs
from kernels.torch_paged_attention import merge_attention, shared_prefix_attention

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_attention_cpu.cpp"
# Setting it to 0 keeps every call on the torch path (to compare the two, or where compiling
# at run time is not wanted).
DISABLE_ENV = "CACHETIER_NATIVE_KERNELS"


@functools.cache
def native_decode_kernel() -> ModuleType | None:
    """The compiled extension, built on the first call; ``None`` where it cannot be.

    Returns:
        The loaded module (its ``paged_attention_decode``), or ``None`` when disabled by
        ``CACHETIER_NATIVE_KERNELS=0`` or when the build fails (logged once).
    """
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load

        return load(
            name="cachetier_paged_attention_cpu",
            sources=[str(_SOURCE)],
            # -fopenmp: at::parallel_for is OpenMP in headers, so without it the tasks run on
            # one thread. The extension then links libgomp.so.1 by soname, and the loader hands
            # it the copy torch already loaded: one thread pool, torch's. -march=native: the
            # build is cached per machine, and the inner loops want its widest vectors.
            extra_cflags=["-O3", "-fopenmp", "-march=native"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # a missing compiler raises anything from OSError to RuntimeError
        log.warning("native CPU decode attention unavailable, using the torch path: %s", exc)
        return None


def paged_attention_decode_native(
    inputs: DecodeInputs, num_shared_blocks: int = 0
) -> torch.Tensor | None:
    """``paged_attention_decode`` on CPU tensors through the extension.

    Args:
        inputs: the step's inputs, already checked by ``kernels.paged_attention``.
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
