"""The CPU path of decode attention: one sequence at a time, with shared-prefix (cascade) reuse.

``paged_attention_decode_ref`` gathers every sequence's blocks into one padded batch; on CPU
that copies the K/V several times over (gather, K/V split, float cast, mask) and pads short
sequences to the longest. Here each sequence copies its K and V once each (``index_select``
of whole blocks) and runs two small matmuls on them.

Cascade: when the sequences of a batch start with the same pool blocks (a shared system
prompt held once by the prefix cache), the shared part is read once for all of their queries,
and each sequence's own suffix separately; the two partial softmaxes are merged exactly with
their log-sum-exps. The launcher trusts its inputs: ``cachetier.kernels.paged_attention`` checks
them.
"""

from __future__ import annotations

import torch

from cachetier.kernels.pool_shape import DecodeInputs

# torch's CPU flash-attention kernel, which also returns each query's log-sum-exp (None where
# this torch has no such op): softmax and weighting fused, at about sgemm's speed here.
CPU_FLASH_WITH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def window_start(context_len: int, window: int | None) -> int:
    """The first key a query at position ``context_len - 1`` sees under ``window``.

    A window of W lets a query see W keys, itself included: keys ``p - W + 1 .. p`` for a query
    at position p (transformers' sliding_window_overlay, vLLM's window_size ``(W - 1, 0)``; see
    ``cachetier.engine.model_spec``). ``None`` is full attention: key 0.
    """
    return 0 if window is None else max(0, context_len - window)


def window_mask(
    num_new: int, context_len: int, first_key: int, window: int | None, device: torch.device
) -> torch.Tensor:
    """``[num_new, context_len - first_key]`` bool, True where a query may see a key.

    The queries are the last ``num_new`` positions of the context; the keys are positions
    ``first_key .. context_len - 1``. Causal, and under ``window`` no key at or before
    ``position - window``.
    """
    rows = torch.arange(num_new, device=device)[:, None] + (context_len - num_new)
    cols = torch.arange(first_key, context_len, device=device)[None, :]
    mask = cols <= rows
    return mask if window is None else mask & (cols > rows - window)


def gather_layer_kv(
    kv_cache: torch.Tensor, layer: int, block_ids: torch.Tensor, length: int, start: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens ``start .. length - 1``'s K and V of one layer, read through ``block_ids`` in order.

    Args:
        kv_cache: the pool, ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``.
        layer: which layer.
        block_ids: the blocks holding the tokens from token 0 on, at least
            ``ceil(length / block_size)``.
        length: the end (exclusive) of the tokens to return.
        start: the first token to return (a window's first key); blocks before it are not read.

    Returns:
        K and V, ``[length - start, num_kv_heads, head_dim]`` each: one copy each out of the
        pool's blocks, straight into the layout attention reads (a gather of whole blocks then a
        transpose would copy everything twice).
    """
    block_size = kv_cache.shape[3]
    first = start // block_size
    ids = block_ids[first : -(-length // block_size)]
    # Token offsets inside the gathered blocks, which begin at token first * block_size.
    lo, hi = start - first * block_size, length - first * block_size
    k = kv_cache[:, layer, 0].index_select(0, ids).flatten(0, 1)[lo:hi]
    v = kv_cache[:, layer, 1].index_select(0, ids).flatten(0, 1)[lo:hi]
    return k, v


def attend_unmasked(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of grouped queries over one context, every query seeing every key.

    Args:
        query: ``[num_kv_heads, m, head_dim]`` (``m`` queries read each KV head: with no mask,
            the query heads that share a KV head are simply more rows).
        key: ``[T, num_kv_heads, head_dim]``, any strides.
        value: the same.
        scale: softmax scale.

    Returns:
        float32 ``[num_kv_heads, m, head_dim]`` outputs and ``[num_kv_heads, m]`` log-sum-exps.
        On CPU with matching dtypes this is one flash call (measured: 32 decodes over a shared
        2,048-token prefix, 30 layers, several times faster than the matmuls, log-sum-exp and
        exp passes of the fallback over [m, T] scores).
    """
    if (
        CPU_FLASH_WITH_LSE is not None
        and query.device.type == "cpu"
        and query.dtype == key.dtype == value.dtype
    ):
        out, lse = CPU_FLASH_WITH_LSE(
            query.unsqueeze(0),
            key.transpose(0, 1).unsqueeze(0),
            value.transpose(0, 1).unsqueeze(0),
            0.0,
            False,
            scale=scale,
        )[:2]
        return out[0].float(), lse[0]
    return _attend(query.float(), key, value, scale)


def _attend(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of grouped queries over one context, in float32.

    Args:
        query: ``[num_kv_heads, m, head_dim]`` (``m`` queries read each KV head).
        key: ``[T, num_kv_heads, head_dim]``.
        value: ``[T, num_kv_heads, head_dim]``.
        scale: softmax scale.

    Returns:
        ``[num_kv_heads, m, head_dim]`` outputs and ``[num_kv_heads, m]`` log-sum-exps.
    """
    scores = torch.matmul(query, key.float().permute(1, 2, 0)) * scale  # [hk, m, T]
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None])
    return torch.matmul(probs, value.float().transpose(0, 1)), lse


def merge_attention(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> torch.Tensor:
    """Two softmax attentions of the same queries over disjoint key sets, combined exactly as
    one over their union.

    Args:
        out_a: ``[..., head_dim]`` outputs over the first key set.
        lse_a: ``[...]`` their log-sum-exps.
        out_b: the same over the second key set.
        lse_b: and theirs.
    """
    top = torch.maximum(lse_a, lse_b)
    w_a, w_b = torch.exp(lse_a - top), torch.exp(lse_b - top)
    return (out_a * w_a[..., None] + out_b * w_b[..., None]) / (w_a + w_b)[..., None]


def paged_attention_decode_torch(
    inputs: DecodeInputs, num_shared_blocks: int = 0, window: int | None = None
) -> torch.Tensor:
    """``paged_attention_decode`` on CPU (see there); the definition of its ``window``.

    Args:
        inputs: the step's inputs, already checked.
        num_shared_blocks: leading block-table columns every row has in common, each inside
            every row's context; their K/V are read once for the whole batch. Not used with a
            window: each row reads its own window's blocks alone.
        window: each row's query (the last of its context) sees only the keys from
            ``window_start(context_len, window)`` on; None for all of them.
    """
    query, kv_cache, layer, block_tables, context_lens, scale = inputs.unpack()
    batch, num_heads, head_dim = query.shape
    block_size, num_kv_heads = kv_cache.shape[3], kv_cache.shape[4]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    if batch == 0:
        return out
    # Query head h = kv_head * group + g: a view groups the heads that share a KV head.
    q = query.float().view(batch, num_kv_heads, group, head_dim)
    lens = context_lens.tolist()
    tables = block_tables.long()

    if window is not None:
        num_shared_blocks = 0
    shared_out = shared_lse = None
    shared_len = num_shared_blocks * block_size
    if num_shared_blocks:
        shared_out, shared_lse = shared_prefix_attention(inputs, num_shared_blocks)

    for row, context_len in enumerate(lens):
        own_len = context_len - shared_len
        if own_len == 0:
            result = shared_out[row]  # type: ignore[index]
        else:
            ids = tables[row, num_shared_blocks:]
            k, v = gather_layer_kv(kv_cache, layer, ids, own_len, window_start(own_len, window))
            result, lse = _attend(q[row], k, v, scale)
            if shared_out is not None:
                result = merge_attention(shared_out[row], shared_lse[row], result, lse)  # type: ignore[index]
        out[row] = result.reshape(num_heads, head_dim).to(query.dtype)
    return out


def shared_prefix_attention(
    inputs: DecodeInputs, num_shared_blocks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's queries over the leading blocks all rows share, read once for the batch.

    Args:
        inputs: the step's inputs, already checked.
        num_shared_blocks: the shared leading block-table columns (``common_prefix_blocks``),
            at least 1.

    Returns:
        float32 outputs ``[batch, num_kv_heads, group, head_dim]`` and their log-sum-exps
        ``[batch, num_kv_heads, group]``, to merge with each row's own part.
    """
    query, kv_cache, layer, block_tables, _, scale = inputs.unpack()
    batch, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[4]
    group = num_heads // num_kv_heads
    block_size = kv_cache.shape[3]
    k, v = gather_layer_kv(kv_cache, layer, block_tables[0].long(), num_shared_blocks * block_size)
    # [hk, batch * group, d]: every query that reads a KV head, as one matrix.
    all_q = query.view(batch, num_kv_heads, group, head_dim).transpose(0, 1)
    o, lse = attend_unmasked(all_q.reshape(num_kv_heads, batch * group, head_dim), k, v, scale)
    out = o.view(num_kv_heads, batch, group, head_dim).transpose(0, 1)
    return out, lse.view(num_kv_heads, batch, group).transpose(0, 1)


def common_prefix_blocks(
    block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int
) -> int:
    """Leading block-table columns shared by every row and inside every row's context.

    Args:
        block_tables: ``[batch, max_blocks]`` pool block ids.
        context_lens: ``[batch]`` tokens per row.
        block_size: tokens per block.

    Returns:
        The number of such columns (0 for fewer than two rows: nothing to share).
    """
    if block_tables.shape[0] < 2:
        return 0
    limit = min(int(context_lens.min()) // block_size, block_tables.shape[1])
    same = (block_tables[:, :limit] == block_tables[:1, :limit]).all(dim=0)
    differs = (~same).nonzero()
    return int(differs[0]) if differs.numel() else limit
