"""Decode batches and the dense-SDPA oracle shared by the paged-attention tests."""

import torch
import torch.nn.functional as F

TOLERANCES = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    # Both paths compute in fp32 and round once at the end: allow about one fp16 ulp near 1.
    torch.float16: {"rtol": 2e-3, "atol": 2e-3},
    torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-2},
}

NUM_KV_HEADS = 2


def decode_batch(
    gen: torch.Generator,
    context_lens: list[int],
    *,
    num_blocks: int,
    block_size: int,
    index_dtype: torch.dtype = torch.int64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block tables for ragged sequences on shuffled, distinct blocks, padded with 0.

    Returns:
        ``block_tables`` ``[batch, max_blocks_per_seq]`` (one spare padding column) and
        ``context_lens`` ``[batch]``.
    """
    blocks_per_seq = [-(-n // block_size) for n in context_lens]
    width = max(blocks_per_seq) + 1
    free = torch.randperm(num_blocks, generator=gen).tolist()
    assert sum(blocks_per_seq) <= num_blocks, "test pool too small for its sequences"
    tables = torch.zeros(len(context_lens), width, dtype=index_dtype)
    for seq, num_used in enumerate(blocks_per_seq):
        tables[seq, :num_used] = torch.tensor([free.pop() for _ in range(num_used)])
    return tables, torch.tensor(context_lens, dtype=index_dtype)


def dense_sdpa(query, kv_cache, layer, block_tables, context_lens, scale) -> torch.Tensor:
    """Per sequence: gather K/V into contiguous tensors and run PyTorch's SDPA on them."""
    block_size = kv_cache.shape[3]
    num_heads, num_kv_heads = query.shape[1], kv_cache.shape[4]
    outs = []
    for seq, context_len in enumerate(context_lens.tolist()):
        num_used = -(-context_len // block_size)
        kv = kv_cache[block_tables[seq, :num_used].long(), layer].float()
        k = kv[:, 0].flatten(0, 1)[:context_len]  # [context_len, num_kv_heads, head_dim]
        v = kv[:, 1].flatten(0, 1)[:context_len]
        group = num_heads // num_kv_heads
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [num_heads, context_len, head_dim]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        q = query[seq].float()[:, None, :]  # [num_heads, 1, head_dim]
        outs.append(F.scaled_dot_product_attention(q, k, v, scale=scale)[:, 0])
    return torch.stack(outs).to(query.dtype)


def shared_prefix_batch(gen, num_shared: int, own_lens: list[int], block_size: int = 16):
    """Rows that start with the same ``num_shared`` blocks, then blocks of their own."""
    own_blocks = [-(-n // block_size) for n in own_lens]
    free = torch.randperm(num_shared + sum(own_blocks), generator=gen).tolist()
    shared = [free.pop() for _ in range(num_shared)]
    width = num_shared + max(own_blocks) + 1
    tables = torch.zeros(len(own_lens), width, dtype=torch.long)
    for row, n in enumerate(own_blocks):
        tables[row, : num_shared + n] = torch.tensor(shared + [free.pop() for _ in range(n)])
    lens = torch.tensor([num_shared * block_size + n for n in own_lens])
    return tables, lens, num_shared + sum(own_blocks)
