"""A model's forward over the paged pool, driven by hand: a prompt fed in chunks over shuffled
pool blocks, then greedy decode steps. A support module for the engine's logits tests."""

from __future__ import annotations

import torch

from cachetier.engine.kv_cache import KVPool
from cachetier.engine.model import ForwardBatch, LlamaModel, SeqSlice

BLOCK = 16


def pool_logits(
    model: LlamaModel,
    tokens: list[int],
    chunks: list[int],
    pool_dtype: str = "float32",
    *,
    num_decode: int = 0,
    pool_bytes: int = 1 << 24,
) -> tuple[torch.Tensor, list[int]]:
    """Every position's logits, ``tokens`` fed in ``chunks`` (1-token chunks are decodes),
    then ``num_decode`` greedy steps (each feeds the argmax of the row before).

    Returns:
        The logits, a row per token fed, and the tokens fed (``tokens`` and the decoded ones).
    """
    pool = KVPool(model.spec, BLOCK, pool_bytes, pool_dtype)
    tokens = list(tokens)
    # Non-contiguous, shuffled block ids: the pool indirection must not matter.
    num_blocks = -(-(len(tokens) + num_decode) // BLOCK)
    table = torch.randperm(pool.num_blocks, generator=torch.Generator().manual_seed(0))[:num_blocks]
    rows: list[torch.Tensor] = []
    start = 0
    for n in [*chunks, *[1] * num_decode]:
        if start == len(tokens):
            tokens.append(int(rows[-1][-1].argmax()))
        pos = torch.arange(start, start + n)
        ctx = start + n
        batch = ForwardBatch(
            torch.tensor(tokens[start:ctx]),
            pos,
            table[pos // BLOCK] * BLOCK + pos % BLOCK,
            (SeqSlice(0, n, ctx, table[: -(-ctx // BLOCK)]),),
            torch.tensor([n - 1]),
        )
        rows.append(model.forward(batch, pool.cache, all_logits=True, kv_scales=pool.scales))
        start = ctx
    return torch.cat(rows), tokens
