"""Triton kernel that copies one part (a layer's consecutive planes) of blocks between an
engine's strided paged view and canonical payloads: the CUDA path of
``kernels.paged_layouts.PagedBlocks``.

Imported lazily (``@triton.jit`` decides at import time whether to compile or interpret). The
launcher trusts its inputs: ``PagedBlocks`` checks them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def layer_blocks_kernel(
    view_ptr,  # one part, [num_blocks, planes_in_part, block_size, heads, dim], any strides
    payload_ptr,  # [n, num_layers, planes, block_size, heads, dim], contiguous
    block_ids_ptr,  # [n]
    s_block,
    s_plane,
    s_token,
    s_head,
    s_dim,
    payload_stride,  # elements per payload (all layers)
    part_offset,  # where this part's first plane starts inside a payload
    block_size,
    heads,
    DIM: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
    GATHER: tl.constexpr,
):
    # One program copies one (payload, plane, token, head) row of DIM elements.
    i = tl.program_id(0).to(tl.int64)
    row = tl.program_id(1).to(tl.int64)
    plane = row // (block_size * heads)
    token = (row // heads) % block_size
    head = row % heads
    dims = tl.arange(0, BLOCK_DIM)
    mask = dims < DIM
    block = tl.load(block_ids_ptr + i).to(tl.int64)
    src = view_ptr + block * s_block + plane * s_plane + token * s_token + head * s_head
    src += dims * s_dim
    dst = payload_ptr + i * payload_stride + part_offset + row * DIM + dims
    if GATHER:
        tl.store(dst, tl.load(src, mask=mask), mask=mask)
    else:
        tl.store(src, tl.load(dst, mask=mask), mask=mask)


def copy_part_blocks(
    part: torch.Tensor,
    payloads: torch.Tensor,
    block_ids: torch.Tensor,
    layer: int,
    plane: int,
    *,
    gather: bool,
) -> None:
    """Copy one part of each block between ``part`` and ``payloads`` (one launch).

    Args:
        part: ``[num_blocks, planes_in_part, block_size, heads, dim]``, any strides.
        payloads: ``[n, num_layers, planes, block_size, heads, dim]``, contiguous.
        block_ids: ``[n]`` int64 on the same device.
        layer: which layer of the payloads ``part`` belongs to.
        plane: the payload plane its first plane is.
        gather: ``True`` copies part -> payloads, ``False`` the reverse.
    """
    num = block_ids.shape[0]
    if num == 0:
        return
    _, planes, block_size, heads, dim = part.shape
    layer_numel = payloads[0, 0].numel()
    plane_numel = payloads[0, 0, 0].numel()
    layer_blocks_kernel[(num, planes * block_size * heads)](
        part,
        payloads,
        block_ids.contiguous(),
        *part.stride(),
        payloads.stride(0),
        layer * layer_numel + plane * plane_numel,
        block_size,
        heads,
        DIM=dim,
        BLOCK_DIM=triton.next_power_of_2(dim),
        GATHER=gather,
    )
