"""Blocks of SmolLM2-135M's KV shape with random values, for the benchmarks that time tiers."""

from __future__ import annotations

import numpy as np

from cachetier.primitives.keys import KVLayout, Namespace, block_keys
from cachetier.record import KVBlock

# SmolLM2-135M: 30 layers x K/V x 3 KV heads x 64 dims per token
SMOLLM2 = dict(num_layers=30, num_kv_heads=3, head_dim=64)


def make_blocks(
    block_size: int, total_bytes: int, seed: int = 0
) -> tuple[Namespace, list[KVBlock]]:
    """Random-normal fp16 blocks of SmolLM2's KV shape adding up to about ``total_bytes``.

    Args:
        block_size: tokens per block.
        total_bytes: about how many payload bytes in all (at least 4 blocks).
        seed: the random values' seed.

    Returns:
        Their namespace and the blocks, keyed by chained block keys of random tokens.
    """
    layout = KVLayout("float16", block_size=block_size, **SMOLLM2)
    ns = Namespace("bench-smollm2", layout)
    num_blocks = max(4, total_bytes // layout.block_bytes)
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 49_152, num_blocks * block_size)
    shape = (layout.num_layers, 2, block_size, layout.num_kv_heads, layout.head_dim)
    blocks = [
        KVBlock(
            key,
            ns.fingerprint,
            "float16",
            shape,
            block_size,
            rng.standard_normal(shape, dtype=np.float32).astype(np.float16).tobytes(),
        )
        for key in block_keys(ns, tokens)
    ]
    return ns, blocks
