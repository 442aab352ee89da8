"""The requests that ``benchmarks.engine`` and ``benchmarks.vllm_overhead`` run: prompts of
128-1,024 random ordinary-word tokens, each after an optional shared prefix, 64 tokens out."""

from __future__ import annotations

import numpy as np

OUTPUT_TOKENS = 64  # greedy tokens per request, EOS ignored


def make_requests(num: int, vocab: int, shared: int, seed: int = 0) -> list[list[int]]:
    """``num`` prompts as token ids, each ``shared`` tokens of one system prompt, then its own.

    Args:
        num: how many requests.
        vocab: the model's vocabulary size.
        shared: tokens of the system prompt in front of every request (0: none).
        seed: the random tokens' and lengths' seed.

    Returns:
        The prompts; the same arguments give the same prompts.
    """
    rng = np.random.default_rng(seed)
    # Token ids from the ordinary-word range of the vocabulary (not special tokens).
    system = rng.integers(1000, vocab - 1000, shared).tolist()
    lengths = rng.integers(128, 1025, num)
    return [system + rng.integers(1000, vocab - 1000, int(n)).tolist() for n in lengths]
