"""Cutting an engine block's canonical payload into records, and joining records into one.

A record holds ``record_tokens`` tokens (``cachetier.primitives.kv_format``), an engine block ``n``
times as many. In the canonical order ``[num_layers, planes, block_size, num_kv_heads, head_dim]``
the tokens are the third dimension, so a record is a strided slice of its block: one copy
each way, into a batch whose records are each contiguous (what a tier stores and a record's
bytes are). With ``n == 1`` nothing is copied.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_TOKEN_DIM = 2  # of a canonical payload: [num_layers, planes, tokens, num_kv_heads, head_dim]


def split_block(payload: torch.Tensor, num_records: int) -> list[torch.Tensor]:
    """The records of one block, in token order.

    Args:
        payload: one canonical block ``[num_layers, planes, block_size, num_kv_heads,
            head_dim]`` on the host.
        num_records: records per block; ``block_size`` must be a multiple of it.

    Returns:
        ``num_records`` contiguous payloads ``[num_layers, planes, block_size / num_records,
        num_kv_heads, head_dim]``; with one record, ``payload`` itself.
    """
    if payload.dim() != 5:
        raise ValueError(f"a canonical payload has 5 dimensions, got shape {tuple(payload.shape)}")
    if num_records <= 0 or payload.shape[_TOKEN_DIM] % num_records:
        raise ValueError(
            f"cannot cut a block of {payload.shape[_TOKEN_DIM]} tokens into {num_records} records"
        )
    if num_records == 1:
        return [payload]
    layers, planes, tokens, heads, dim = payload.shape
    step = tokens // num_records
    # [records, layers, planes, step, heads, dim], one allocation: each record is one
    # contiguous slab of it, so a tier keeps a view without a second copy.
    batch = (
        payload.reshape(layers, planes, num_records, step, heads, dim)
        .permute(2, 0, 1, 3, 4, 5)
        .contiguous()
    )
    return list(batch.unbind(0))


def join_records(records: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """One block from its records, in token order.

    Args:
        records: ``n`` payloads ``[num_layers, planes, record_tokens, num_kv_heads, head_dim]``
            of one dtype.
        out: where to write the block ``[num_layers, planes, n * record_tokens, num_kv_heads,
            head_dim]``; a new tensor if ``None``.

    Returns:
        The block; with one record and no ``out``, that record itself.
    """
    if not records:
        raise ValueError("a block needs at least one record")
    first = records[0]
    if first.dim() != 5 or any(r.shape != first.shape or r.dtype != first.dtype for r in records):
        raise ValueError("records of one block must be 5-D payloads of one shape and dtype")
    if len(records) == 1 and out is None:
        return first
    layers, planes, step, heads, dim = first.shape
    shape = (layers, planes, step * len(records), heads, dim)
    if out is None:
        out = torch.empty(shape, dtype=first.dtype, device=first.device)
    elif tuple(out.shape) != shape or out.dtype != first.dtype:
        raise ValueError(f"out must be {shape} {first.dtype}, got {tuple(out.shape)} {out.dtype}")
    torch.stack(
        tuple(records), dim=_TOKEN_DIM, out=out.view(layers, planes, len(records), step, heads, dim)
    )
    return out
