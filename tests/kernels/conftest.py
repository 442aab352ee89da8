"""Shared setup for the kernel tests.

Triton decides at ``@triton.jit`` time whether to compile for a GPU or run its interpreter, so
the interpreter is switched on here, before any test imports a Triton kernel module. This
machine has no GPU; the interpreter runs the same kernel code on CPU tensors.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from collections.abc import Callable  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture
def gen() -> torch.Generator:
    """A seeded generator, so a failing case reproduces."""
    return torch.Generator().manual_seed(0)


@pytest.fixture
def make_pool(gen: torch.Generator) -> Callable[..., torch.Tensor]:
    """Builds random pools ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``."""

    def make(
        *,
        num_blocks: int = 8,
        num_layers: int = 2,
        block_size: int = 16,
        num_kv_heads: int = 2,
        head_dim: int = 64,
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        shape = (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)
        return torch.randn(shape, generator=gen).to(dtype)

    return make
