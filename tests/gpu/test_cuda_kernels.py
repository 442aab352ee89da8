"""The Triton kernels compiled for a real GPU (not the interpreter the CPU tests use), each against
its plain-torch reference on the same CUDA tensors: the pool's block copies, the KV store of a
step, and paged decode attention with and without a shared prefix.

Marked ``cuda``: skipped, and reported as skipped, where no CUDA device exists.
"""

from __future__ import annotations

import pytest
import torch

from cachetier.kernels import (
    DecodeInputs,
    gather_blocks,
    gather_blocks_ref,
    paged_attention_decode,
    paged_attention_decode_ref,
    scatter_blocks,
    scatter_blocks_ref,
    store_kvcache,
    store_kvcache_ref,
)
from tests.kernels.attention_cases import TOLERANCES, decode_batch, shared_prefix_batch

pytestmark = pytest.mark.cuda

NB, L, BS, H, D = 24, 3, 16, 2, 64


def _pool(dtype: torch.dtype = torch.float32, seed: int = 0, **shape: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    dims = (
        shape.get("num_blocks", NB),
        L,
        2,
        shape.get("block_size", BS),
        H,
        shape.get("head_dim", D),
    )
    return torch.randn(dims, generator=gen).to(dtype).cuda()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_block_copies_equal_torch_on_cuda(dtype: torch.dtype) -> None:
    pool = _pool(dtype)
    ids = torch.tensor([7, 0, 23, 7, 11], device="cuda")
    got = gather_blocks(pool, ids, backend="triton")
    want = gather_blocks_ref(pool, ids, torch.empty_like(got))
    assert got.is_cuda and torch.equal(got, want)

    target, reference = _pool(dtype, seed=1), _pool(dtype, seed=1)
    dest = torch.tensor([3, 19, 5, 1, 22], device="cuda", dtype=torch.int32)
    scatter_blocks(got, target, dest, backend="triton")
    scatter_blocks_ref(got, reference, dest)
    assert torch.equal(target, reference)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_store_kvcache_equals_torch_on_cuda(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    key = torch.randn(37, H, D, generator=gen).to(dtype).cuda()
    value = torch.randn(37, H, D, generator=gen).to(dtype).cuda()
    slots = torch.randperm(NB * BS, generator=gen)[:37]
    slots[[4, 30]] = -1  # padding tokens write nothing
    slots = slots.cuda()
    got, want = _pool(dtype, seed=3), _pool(dtype, seed=3)
    store_kvcache(key, value, got, 1, slots, backend="triton")
    store_kvcache_ref(key, value, want, 1, slots)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("head_dim", [64, 128, 48])
def test_triton_decode_attention_matches_reference_on_cuda(
    dtype: torch.dtype, group: int, head_dim: int
) -> None:
    gen = torch.Generator().manual_seed(4)
    pool = _pool(dtype, seed=5, head_dim=head_dim, num_blocks=40)
    tables, lens = decode_batch(gen, [1, 16, 17, 45, 300], num_blocks=40, block_size=BS)
    query = torch.randn(5, H * group, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    want = paged_attention_decode_ref(DecodeInputs(query, pool.cpu(), 2, tables, lens, scale))
    got = paged_attention_decode(
        query.cuda(), pool, 2, tables.cuda(), lens.cuda(), scale, backend="triton"
    )
    assert got.is_cuda and got.dtype == dtype
    torch.testing.assert_close(got.cpu(), want, **TOLERANCES[dtype])


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_shared_prefix_decode_on_cuda_matches_reference(backend: str) -> None:
    gen = torch.Generator().manual_seed(6)
    tables, lens, num_blocks = shared_prefix_batch(gen, 3, [0, 1, 17, 40])
    pool = _pool(num_blocks=num_blocks, seed=7)
    query = torch.randn(4, 2 * H, D, generator=gen)
    want = paged_attention_decode_ref(DecodeInputs(query, pool.cpu(), 0, tables, lens, 0.125))
    got = paged_attention_decode(
        query.cuda(),
        pool,
        0,
        tables.cuda(),
        lens.cuda(),
        0.125,
        num_shared_blocks=3,
        backend=backend,
    )
    assert got.is_cuda
    torch.testing.assert_close(got.cpu(), want, **TOLERANCES[torch.float32])


def test_auto_backend_picks_triton_for_cuda_tensors() -> None:
    from cachetier.kernels.backend import resolve_backend

    pool = _pool()
    assert resolve_backend("auto", pool) == "triton"
