"""store_kvcache, gather_blocks and scatter_blocks: Triton against the torch reference."""

import pytest
import torch

from cachetier.kernels import gather_blocks, scatter_blocks, store_kvcache

DTYPES = [torch.float32, torch.float16]


def _slot_mapping(num_tokens: int, num_slots: int, gen: torch.Generator) -> torch.Tensor:
    """Distinct random slots with every third token marked as padding (-1)."""
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    slots[::3] = -1
    return slots


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(("num_kv_heads", "head_dim"), [(2, 64), (3, 48)])
def test_store_kvcache_triton_matches_ref(
    make_pool, gen, dtype, block_size, num_kv_heads, head_dim
):
    pool = make_pool(
        block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype
    )
    num_tokens, layer = 11, 1
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    slots = _slot_mapping(num_tokens, pool.shape[0] * block_size, gen)

    expected = pool.clone()
    store_kvcache(key, value, expected, layer, slots, backend="torch")
    actual = pool.clone()
    store_kvcache(key, value, actual, layer, slots, backend="triton")

    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("layer", [0, 2])
def test_store_kvcache_writes_only_live_slots(make_pool, gen, backend: str, layer: int):
    pool = make_pool(block_size=16, num_layers=3)
    before = pool.clone()
    key = torch.randn(4, 2, 64, generator=gen)
    value = torch.randn(4, 2, 64, generator=gen)
    # Token 1 is padding; token 3 lands at block 5, offset 15 (the last slot of a block).
    slots = torch.tensor([0, -1, 16 * 2 + 7, 16 * 5 + 15])
    store_kvcache(key, value, pool, layer, slots, backend=backend)

    for token, (block_id, offset) in {0: (0, 0), 2: (2, 7), 3: (5, 15)}.items():
        torch.testing.assert_close(pool[block_id, layer, 0, offset], key[token], rtol=0, atol=0)
        torch.testing.assert_close(pool[block_id, layer, 1, offset], value[token], rtol=0, atol=0)
        before[block_id, layer, :, offset] = pool[block_id, layer, :, offset]
    # Nothing else moved: not another layer, not the padding token, not the neighbouring slots.
    torch.testing.assert_close(pool, before, rtol=0, atol=0)


def test_store_kvcache_accepts_strided_views_of_fused_qkv(make_pool, gen):
    pool = make_pool(num_kv_heads=2, head_dim=64)
    # [num_tokens, q + k + v heads, head_dim]: K and V are views with a wide token stride.
    qkv = torch.randn(5, 4 + 2 + 2, 64, generator=gen)
    key, value = qkv[:, 4:6], qkv[:, 6:8]
    slots = torch.tensor([3, 40, -1, 41, 100])
    expected = pool.clone()
    store_kvcache(key.contiguous(), value.contiguous(), expected, 1, slots, backend="torch")
    store_kvcache(key, value, pool, 1, slots, backend="triton")
    torch.testing.assert_close(pool, expected, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gather_blocks_copies_whole_blocks(make_pool, dtype, index_dtype, backend):
    # block_numel = 3 * 2 * 16 * 3 * 48 = 13824, not a multiple of the kernel's tile.
    pool = make_pool(num_blocks=9, num_layers=3, num_kv_heads=3, head_dim=48, dtype=dtype)
    block_ids = torch.tensor([7, 0, 3, 7, 8], dtype=index_dtype)  # repeats are allowed

    staged = gather_blocks(pool, block_ids, backend=backend)

    assert staged.shape == (5, *pool.shape[1:]) and staged.is_contiguous()
    torch.testing.assert_close(staged, pool[block_ids.long()], rtol=0, atol=0)


def test_gather_blocks_into_given_buffer(make_pool):
    pool = make_pool()
    out = torch.full((2, *pool.shape[1:]), float("nan"))
    returned = gather_blocks(pool, torch.tensor([4, 1]), out=out, backend="triton")
    assert returned is out
    torch.testing.assert_close(out, pool[[4, 1]], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
def test_scatter_blocks_triton_matches_ref(make_pool, gen, dtype, block_size):
    pool = make_pool(num_blocks=6, block_size=block_size, num_kv_heads=3, head_dim=48, dtype=dtype)
    block_ids = torch.tensor([5, 0, 2])
    staging = torch.randn(3, *pool.shape[1:], generator=gen).to(dtype)

    expected = pool.clone()
    scatter_blocks(staging, expected, block_ids, backend="torch")
    actual = pool.clone()
    scatter_blocks(staging, actual, block_ids, backend="triton")

    torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    torch.testing.assert_close(actual[block_ids], staging, rtol=0, atol=0)
    untouched = [1, 3, 4]
    torch.testing.assert_close(actual[untouched], pool[untouched], rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gather_then_scatter_round_trips(make_pool, backend):
    # Offload blocks from one pool and restore them at other ids in a fresh pool.
    src = make_pool(num_blocks=6)
    dst = torch.zeros_like(src)
    staged = gather_blocks(src, torch.tensor([1, 4]), backend=backend)
    scatter_blocks(staged, dst, torch.tensor([3, 0]), backend=backend)
    torch.testing.assert_close(dst[[3, 0]], src[[1, 4]], rtol=0, atol=0)
    assert dst[[1, 2, 4, 5]].eq(0).all()


def test_empty_inputs_are_no_ops(make_pool):
    pool = make_pool()
    before = pool.clone()
    empty_kv = torch.empty(0, 2, 64)
    store_kvcache(empty_kv, empty_kv, pool, 0, torch.empty(0, dtype=torch.int64), backend="triton")
    staged = gather_blocks(pool, torch.empty(0, dtype=torch.int64), backend="triton")
    scatter_blocks(staged, pool, torch.empty(0, dtype=torch.int64), backend="triton")
    assert staged.shape == (0, *pool.shape[1:])
    torch.testing.assert_close(pool, before, rtol=0, atol=0)


def _store_call(pool, **overrides):
    args = {
        "key": torch.zeros(3, 2, 64),
        "value": torch.zeros(3, 2, 64),
        "kv_cache": pool,
        "layer": 0,
        "slot_mapping": torch.tensor([0, 1, -1]),
    }
    args.update(overrides)
    return lambda: store_kvcache(**args)


STORE_BAD_INPUTS = {
    "slot past the pool": {"slot_mapping": torch.tensor([0, 1, 8 * 16])},
    "slot below -1": {"slot_mapping": torch.tensor([0, -2, 1])},
    "slot float": {"slot_mapping": torch.tensor([0.0, 1.0, 2.0])},
    "slot count": {"slot_mapping": torch.tensor([0, 1])},
    "key ndim": {"key": torch.zeros(3, 128)},
    "key dtype": {"key": torch.zeros(3, 2, 64, dtype=torch.float16)},
    "value heads": {"value": torch.zeros(3, 1, 64)},
    "layer": {"layer": 2},
    "pool ndim": {"kv_cache": torch.zeros(8, 2, 2, 16, 128)},
    "pool K/V dim": {"kv_cache": torch.zeros(8, 2, 3, 16, 2, 64)},
    "pool not contiguous": {"kv_cache": torch.zeros(8, 2, 2, 16, 64, 2).transpose(4, 5)},
    "pool int dtype": {"kv_cache": torch.zeros(8, 2, 2, 16, 2, 64, dtype=torch.int32)},
    "backend name": {"backend": "cuda"},
}


@pytest.mark.parametrize("overrides", STORE_BAD_INPUTS.values(), ids=STORE_BAD_INPUTS.keys())
def test_store_kvcache_rejects_bad_input(make_pool, overrides):
    with pytest.raises(ValueError):
        _store_call(make_pool(), **overrides)()


def test_non_tensor_and_non_int_arguments_raise_type_error(make_pool):
    with pytest.raises(TypeError, match="key must be a torch.Tensor"):
        _store_call(make_pool(), key=[[0.0]])()
    with pytest.raises(TypeError, match="layer must be an int"):
        _store_call(make_pool(), layer=0.0)()


BLOCK_BAD_INPUTS = {
    "id past the pool": lambda pool: gather_blocks(pool, torch.tensor([0, 8])),
    "negative id": lambda pool: gather_blocks(pool, torch.tensor([-1])),
    "ids 2-D": lambda pool: gather_blocks(pool, torch.tensor([[0, 1]])),
    "out shape": lambda pool: gather_blocks(
        pool, torch.tensor([0]), out=torch.empty(2, *pool.shape[1:])
    ),
    "out dtype": lambda pool: gather_blocks(
        pool, torch.tensor([0]), out=torch.empty(1, *pool.shape[1:], dtype=torch.float16)
    ),
    "out not contiguous": lambda pool: gather_blocks(
        pool, torch.tensor([0, 1]), out=torch.empty(*pool.shape[1:], 2).movedim(-1, 0)
    ),
    "staging shape": lambda pool: scatter_blocks(pool[:2], pool, torch.tensor([0])),
    "staging dtype": lambda pool: scatter_blocks(pool[:1].half(), pool, torch.tensor([0])),
    "repeated scatter ids": lambda pool: scatter_blocks(
        pool[:2].clone(), pool, torch.tensor([3, 3])
    ),
}


@pytest.mark.parametrize("call", BLOCK_BAD_INPUTS.values(), ids=BLOCK_BAD_INPUTS.keys())
def test_block_copies_reject_bad_input(make_pool, call):
    with pytest.raises(ValueError):
        call(make_pool())
