"""Prefill attention on CPU for all of a step's chunks in one call, reading the paged pool.

Each chunk's new tokens attend causally over its context: the cached tokens before the chunk
and the chunk's own tokens up to themselves, whose K/V the layer has already written into the
pool. ``csrc/prefill_attention_cpu.cpp`` packs every 16-token unit of the pool that the step's
wide chunks read once (a prefix shared by several chunks once for all of them), then runs
register-tiled flash attention per (chunk, KV head, tile of query rows) over torch's intra-op
threads. A narrow chunk (a few new tokens, such as the suffix after a restored prefix) splits
its context's keys between tasks that pack each unit from the pool as they reach it (nothing
packed up front), merged by log-sum-exp.

A step's plan (which units, which chunk reads which) is the same for every layer, so it is
built once per forward by ``plan_prefill`` and passed to each layer's call.

The extension is built on first use by ``cachetier.kernels.native_build``; where it cannot be, or
for shapes it does not cover, ``paged_prefill_attention`` returns ``False`` and the caller takes
the torch path. ``paged_prefill_attention_ref`` is the plain torch reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import torch

from cachetier.kernels.native_build import load_cpu_extension

UNIT = 16  # tokens per packed unit: the kernel's block sizes are multiples of it


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    """One sequence's new tokens in a step.

    Args:
        start: row of its first new token in the step's flattened queries.
        num_new: new tokens (>= 1).
        context_len: tokens it attends to, cached and new (>= num_new).
        block_table: ``[>= ceil(context_len / block_size)]`` int64 pool block ids.
    """

    start: int
    num_new: int
    context_len: int
    block_table: torch.Tensor


@dataclass(frozen=True, slots=True)
class PrefillPlan:
    """What the kernel reads, shared by every layer of one step.

    Attributes:
        pool_blocks: the pool's block count the plan was checked against.
        num_rows: rows of the step's queries the chunks cover (``max(start + num_new)``).
        unit_ids: ``[U]`` int64, ``block * (block_size // 16) + sub``: each unit once.
        unit_valid: ``[U]`` int64 tokens of the unit inside some chunk's context; the rest are
            read as zeros (a pool slot past every context holds stale data).
        seq_units: ``[S, max_units]`` int64 indices into ``unit_ids``, each chunk's context in
            order.
        seq_info: ``[S, 3]`` int64 ``(start, num_new, context_len)``.
    """

    pool_blocks: int
    num_rows: int
    unit_ids: torch.Tensor
    unit_valid: torch.Tensor
    seq_units: torch.Tensor
    seq_info: torch.Tensor


def native_prefill_kernel() -> ModuleType | None:
    """The compiled extension, or ``None`` where it is off or cannot be built."""
    return load_cpu_extension("cachetier_prefill_attention_cpu", "prefill_attention_cpu.cpp")


def plan_prefill(
    chunks: Sequence[PrefillChunk], block_size: int, num_blocks: int
) -> PrefillPlan | None:
    """The units each chunk reads, deduplicated across chunks.

    Args:
        chunks: the step's chunks.
        block_size: the pool's tokens per block.
        num_blocks: the pool's blocks; every block id read must be below it.

    Returns:
        The plan, or ``None`` where ``block_size`` is not a multiple of 16 (the kernel's unit)
        or there is no chunk.

    Raises:
        ValueError: a chunk with no new tokens, more new tokens than its context, a block table
            too short for its context, or a block id outside the pool. The kernel reads the
            pool through these ids without checking them again.
    """
    if not chunks or block_size % UNIT:
        return None
    per_block = block_size // UNIT
    units, valid = [], []
    for c in chunks:
        if c.start < 0 or not 1 <= c.num_new <= c.context_len:
            raise ValueError(
                f"a chunk needs start >= 0 and 1 <= num_new <= context_len, got start {c.start}, "
                f"num_new {c.num_new}, context_len {c.context_len}"
            )
        needed = -(-c.context_len // block_size)
        if c.block_table.numel() < needed:
            raise ValueError(
                f"block_table holds {c.block_table.numel()} blocks, context_len "
                f"{c.context_len} needs {needed}"
            )
        j = torch.arange(-(-c.context_len // UNIT))
        table = c.block_table[:needed].long()
        units.append(table[j // per_block] * per_block + j % per_block)
        valid.append((c.context_len - j * UNIT).clamp(max=UNIT))
    unit_ids, inverse = torch.unique(torch.cat(units), return_inverse=True)
    if int(unit_ids[0]) < 0 or int(unit_ids[-1]) >= num_blocks * per_block:  # sorted
        raise ValueError(f"a block id is outside the pool's {num_blocks} blocks")
    unit_valid = torch.zeros_like(unit_ids).scatter_reduce(
        0, inverse, torch.cat(valid), reduce="amax"
    )
    seq_units = torch.zeros(len(chunks), max(len(u) for u in units), dtype=torch.long)
    offset = 0
    for i, u in enumerate(units):
        seq_units[i, : len(u)] = inverse[offset : offset + len(u)]
        offset += len(u)
    seq_info = torch.tensor([(c.start, c.num_new, c.context_len) for c in chunks])
    num_rows = max(c.start + c.num_new for c in chunks)
    return PrefillPlan(num_blocks, num_rows, unit_ids, unit_valid, seq_units, seq_info)


def paged_prefill_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    plan: PrefillPlan,
    scale: float,
    out: torch.Tensor,
    window: int | None = None,
) -> bool:
    """Write every planned chunk's attention output into ``out``.

    Args:
        query: ``[T, num_heads, head_dim]`` float32, any row and head strides (a view of the
            fused QKV projection).
        kv_cache: the pool ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``,
            contiguous float32, with every chunk's new K/V already stored.
        layer: which layer.
        plan: from ``plan_prefill`` for this step.
        scale: softmax scale.
        out: ``[T, num_heads, head_dim]`` float32; the planned chunks' rows are written.
        window: a sliding window (``paged_prefill_attention_ref``). The kernel has none, so a
            window returns ``False`` and the caller takes the torch path.

    Returns:
        ``False`` (``out`` untouched) where the kernel is unavailable or does not cover these
        tensors: a window, not CPU float32, head_dim not 64 or 128, no AVX2 and FMA. The caller then
        takes the torch path.

    Raises:
        ValueError: tensors whose shapes do not fit the pool or each other, a layer outside the
            pool, or a plan made for another pool or for more query rows than ``query`` has.
    """
    _check(query, kv_cache, layer, plan, out)
    if (
        window is not None
        or query.device.type != "cpu"
        or query.dtype != torch.float32
        or kv_cache.dtype != torch.float32
        or not kv_cache.is_contiguous()
        or query.stride(-1) != 1
        or out.stride(-1) != 1
    ):
        return False
    kernel = native_prefill_kernel()
    if kernel is None:
        return False
    return bool(
        kernel.paged_prefill_attention(
            query,
            kv_cache,
            layer,
            plan.unit_ids,
            plan.unit_valid,
            plan.seq_units,
            plan.seq_info,
            float(scale),
            out,
        )
    )


def _check(
    query: torch.Tensor, kv_cache: torch.Tensor, layer: int, plan: PrefillPlan, out: torch.Tensor
) -> None:
    if kv_cache.dim() != 6 or query.dim() != 3:
        raise ValueError(
            f"kv_cache must be [blocks, layers, 2, block_size, kv_heads, head_dim] and query "
            f"[tokens, heads, head_dim], got {tuple(kv_cache.shape)} and {tuple(query.shape)}"
        )
    num_kv_heads, head_dim = kv_cache.shape[4], kv_cache.shape[5]
    if query.shape[2] != head_dim or query.shape[1] % num_kv_heads:
        raise ValueError(
            f"query {tuple(query.shape)} does not fit a pool of {num_kv_heads} KV heads of "
            f"head_dim {head_dim}"
        )
    if out.shape != query.shape:
        raise ValueError(f"out {tuple(out.shape)} must match query {tuple(query.shape)}")
    if not 0 <= layer < kv_cache.shape[1]:
        raise ValueError(f"layer must be in [0, {kv_cache.shape[1]}), got {layer}")
    if plan.pool_blocks != kv_cache.shape[0] or plan.num_rows > query.shape[0]:
        raise ValueError(
            f"the plan was made for a pool of {plan.pool_blocks} blocks and {plan.num_rows} "
            f"query rows; got {kv_cache.shape[0]} blocks and {query.shape[0]} rows"
        )


def paged_prefill_attention_ref(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    chunks: Sequence[PrefillChunk],
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """The same in plain torch, float64 inside: ``[T, num_heads, head_dim]``, zeros in rows no
    chunk covers. Under ``window`` a query at position p sees keys p - window + 1 .. p only."""
    num_heads, head_dim = query.shape[1:]
    block_size, num_kv_heads = kv_cache.shape[3], kv_cache.shape[4]
    group = num_heads // num_kv_heads
    out = torch.zeros(query.shape, dtype=torch.float64)
    for c in chunks:
        blocks = c.block_table[: -(-c.context_len // block_size)].long()
        kv = kv_cache[blocks, layer].double()  # [n, 2, bs, hk, d]
        k = kv[:, 0].reshape(-1, num_kv_heads, head_dim)[: c.context_len]
        v = kv[:, 1].reshape(-1, num_kv_heads, head_dim)[: c.context_len]
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [hq, ctx, d]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        q = query[c.start : c.start + c.num_new].double().transpose(0, 1)  # [hq, n, d]
        scores = q @ k.transpose(1, 2) * scale
        cached = c.context_len - c.num_new
        rows = torch.arange(c.num_new)[:, None] + cached
        cols = torch.arange(c.context_len)[None, :]
        hidden = cols > rows
        if window is not None:
            hidden |= cols <= rows - window
        scores = scores.masked_fill(hidden, float("-inf"))
        out[c.start : c.start + c.num_new] = (scores.softmax(-1) @ v).transpose(0, 1)
    return out
