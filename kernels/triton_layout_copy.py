"""Triton kernel that copies blocks between an engine's strided paged views and canonical
payloads: the CUDA path of ``cachetier.kernels.paged_layouts.PagedBlocks``.

One launch moves a group of parts that share their per-block shape and strides, wherever each
lies: usually every layer's parts at once (one tensor per layer, all alike), or two groups where
K and V are laid out apart (vLLM-CPU's transposed K). A launch costs the host tens of
microseconds, and one per layer made a gather of many small blocks take about twice the copy of
the same bytes to the host.

Imported lazily (``@triton.jit`` decides at import time whether to compile or interpret). The
launcher trusts its inputs: ``PagedBlocks`` checks them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def parts_kernel(
    base_ptr,  # the group's first part; the others lie part_offsets elements from it
    part_offsets_ptr,  # [num_parts] int64, elements from base_ptr to each part's start
    payload_offsets_ptr,  # [num_parts] int64, where each part's planes start in a payload
    payload_ptr,  # [n, num_layers, planes, block_size, heads, dim], contiguous
    block_ids_ptr,  # [n]
    s_block,
    s_plane,
    s_token,
    s_head,
    s_dim,
    payload_stride,  # elements per payload (all layers)
    rows_per_part,  # planes_in_part * block_size * heads
    block_size,
    heads,
    DIM: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
    ROWS: tl.constexpr,
    GATHER: tl.constexpr,
):
    # One program copies ROWS (plane, token, head) rows of DIM elements of one part of one
    # payload: grid (payload, part, row tile).
    i = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    rows = tl.program_id(2).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    dims = tl.arange(0, BLOCK_DIM)
    mask = (rows < rows_per_part)[:, None] & (dims < DIM)[None, :]
    plane = rows // (block_size * heads)
    token = (rows // heads) % block_size
    head = rows % heads
    block = tl.load(block_ids_ptr + i).to(tl.int64)
    part_base = base_ptr + tl.load(part_offsets_ptr + part) + block * s_block
    src = part_base + plane * s_plane + token * s_token + head * s_head
    src = src[:, None] + dims[None, :] * s_dim
    dst = payload_ptr + i * payload_stride + tl.load(payload_offsets_ptr + part)
    dst = dst + rows[:, None] * DIM + dims[None, :]
    if GATHER:
        tl.store(dst, tl.load(src, mask=mask), mask=mask)
    else:
        tl.store(src, tl.load(dst, mask=mask), mask=mask)


def part_offsets(parts: list[torch.Tensor]) -> torch.Tensor:
    """Each part's start, in elements from the first part's: tensors of one dtype start on a
    multiple of its size, so the differences are whole elements (negative ones too)."""
    size = parts[0].element_size()
    first = parts[0].data_ptr()
    offsets = [(p.data_ptr() - first) // size for p in parts]
    return torch.tensor(offsets, dtype=torch.int64, device=parts[0].device)


def copy_parts(
    parts: list[torch.Tensor],
    offsets: torch.Tensor,
    payload_offsets: torch.Tensor,
    payloads: torch.Tensor,
    block_ids: torch.Tensor,
    *,
    gather: bool,
) -> None:
    """Copy a group of parts of each block between them and ``payloads``, in one launch.

    Args:
        parts: ``[num_blocks, planes_in_part, block_size, heads, dim]`` each, alike but for
            ``num_blocks`` (one per-block shape, one set of strides).
        offsets: ``part_offsets(parts)``, on the parts' device.
        payload_offsets: per part, where its first plane starts inside a payload, in elements.
        payloads: ``[n, num_layers, planes, block_size, heads, dim]``, contiguous.
        block_ids: ``[n]`` int64 on the same device, each below every part's ``num_blocks``.
        gather: ``True`` copies parts -> payloads, ``False`` the reverse.
    """
    num = block_ids.shape[0]
    if num == 0:
        return
    first = parts[0]
    _, planes, block_size, heads, dim = first.shape
    rows = planes * block_size * heads
    block_dim = triton.next_power_of_2(dim)
    # About 8 K elements a program: enough to hide a load's latency, few enough to fill the GPU.
    tile_rows = max(1, min(triton.next_power_of_2(rows), 8192 // block_dim))
    grid = (num, len(parts), triton.cdiv(rows, tile_rows))
    parts_kernel[grid](
        first,
        offsets,
        payload_offsets,
        payloads,
        block_ids.contiguous(),
        *first.stride(),
        payloads.stride(0),
        rows,
        block_size,
        heads,
        DIM=dim,
        BLOCK_DIM=block_dim,
        ROWS=tile_rows,
        GATHER=gather,
    )
