"""paged_attention_decode: the reference and the CPU path against dense SDPA, the shared-prefix
(cascade) path and Triton against the reference."""

import pytest
import torch

from cachetier.kernels import (
    DecodeInputs,
    common_prefix_blocks,
    paged_attention_decode,
    paged_attention_decode_ref,
)
from tests.kernels.attention_cases import (
    NUM_KV_HEADS,
    TOLERANCES,
    decode_batch,
    dense_sdpa,
    shared_prefix_batch,
)

RAGGED = [1, 16, 17, 45]  # one token, exactly a block, a block and one, several blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 48])
@pytest.mark.parametrize("path", ["reference", "torch"])
def test_torch_paths_matchdense_sdpa(make_pool, gen, dtype, group, block_size, head_dim, path):
    pool = make_pool(num_blocks=12, block_size=block_size, head_dim=head_dim, dtype=dtype)
    tables, lens = decode_batch(gen, RAGGED, num_blocks=12, block_size=block_size)
    query = torch.randn(len(RAGGED), NUM_KV_HEADS * group, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5

    if path == "reference":
        actual = paged_attention_decode_ref(DecodeInputs(query, pool, 1, tables, lens, scale))
    else:
        actual = paged_attention_decode(query, pool, 1, tables, lens, scale, backend="torch")
    expected = dense_sdpa(query, pool, 1, tables, lens, scale)

    torch.testing.assert_close(actual, expected, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 48])
def test_triton_matches_reference(make_pool, gen, dtype, group, block_size, head_dim):
    pool = make_pool(num_blocks=12, block_size=block_size, head_dim=head_dim, dtype=dtype)
    tables, lens = decode_batch(gen, RAGGED, num_blocks=12, block_size=block_size)
    query = torch.randn(len(RAGGED), NUM_KV_HEADS * group, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5

    expected = paged_attention_decode(query, pool, 0, tables, lens, scale, backend="torch")
    actual = paged_attention_decode(query, pool, 0, tables, lens, scale, backend="triton")

    assert actual.dtype == dtype and actual.shape == query.shape
    torch.testing.assert_close(actual, expected, **TOLERANCES[dtype])


def test_triton_int32_tables_and_odd_block_size(make_pool, gen):
    # block_size 12 and head_dim 40 are not powers of two; the kernel pads its tiles with masks.
    pool = make_pool(num_blocks=10, block_size=12, head_dim=40)
    tables, lens = decode_batch(
        gen, [5, 24, 30], num_blocks=10, block_size=12, index_dtype=torch.int32
    )
    query = torch.randn(3, 4, 40, generator=gen)
    expected = dense_sdpa(query, pool, 1, tables, lens, 0.2)
    actual = paged_attention_decode(query, pool, 1, tables, lens, 0.2, backend="triton")
    torch.testing.assert_close(actual, expected, **TOLERANCES[torch.float32])


def test_triton_is_stable_for_large_scores(make_pool, gen):
    # Scores in the thousands overflow a naive exp; the online softmax must stay finite.
    pool = make_pool(num_blocks=8, block_size=16)
    tables, lens = decode_batch(gen, [40, 7], num_blocks=8, block_size=16)
    query = 300.0 * torch.randn(2, 6, 64, generator=gen)
    expected = paged_attention_decode(query, pool, 0, tables, lens, 1.0, backend="torch")
    actual = paged_attention_decode(query, pool, 0, tables, lens, 1.0, backend="triton")
    assert torch.isfinite(actual).all()
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)


def test_padding_entries_of_the_block_table_are_not_read(make_pool, gen):
    pool = make_pool(num_blocks=8, block_size=16)
    tables, lens = decode_batch(gen, [20, 3], num_blocks=8, block_size=16)
    query = torch.randn(2, 2, 64, generator=gen)
    before = paged_attention_decode(query, pool, 0, tables, lens, 0.125, backend="triton")
    # Poison block 0 past every sequence's end and the slots past each context length.
    used = {int(b) for seq, n in enumerate(lens.tolist()) for b in tables[seq, : -(-n // 16)]}
    for block_id in set(range(8)) - used:
        pool[block_id] = float("nan")
    pool[tables[0, 1], :, :, 20 - 16 :] = float("nan")
    pool[tables[1, 0], :, :, 3:] = float("nan")
    for backend in ("torch", "triton"):
        after = paged_attention_decode(query, pool, 0, tables, lens, 0.125, backend=backend)
        torch.testing.assert_close(after, before, **TOLERANCES[torch.float32])


# A row whose context ends exactly where the shared blocks end has no blocks of its own.
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("own_lens", [[0, 1, 17, 40], [5, 33]])
def test_shared_prefix_path_matches_reference(make_pool, gen, dtype, own_lens):
    tables, lens, num_blocks = shared_prefix_batch(gen, 3, own_lens)
    pool = make_pool(num_blocks=num_blocks, dtype=dtype)
    query = torch.randn(len(own_lens), 6, 64, generator=gen).to(dtype)
    assert common_prefix_blocks(tables, lens, 16) == 3
    expected = paged_attention_decode_ref(DecodeInputs(query, pool, 1, tables, lens, 0.125))
    for num_shared in range(4):
        actual = paged_attention_decode(
            query, pool, 1, tables, lens, 0.125, num_shared_blocks=num_shared, backend="torch"
        )
        torch.testing.assert_close(actual, expected, **TOLERANCES[dtype])


def test_shared_prefix_path_is_stable_for_large_scores(make_pool, gen):
    tables, lens, num_blocks = shared_prefix_batch(gen, 2, [9, 30])
    pool = make_pool(num_blocks=num_blocks)
    query = 300.0 * torch.randn(2, 6, 64, generator=gen)
    expected = paged_attention_decode_ref(DecodeInputs(query, pool, 0, tables, lens, 1.0))
    actual = paged_attention_decode(query, pool, 0, tables, lens, 1.0, num_shared_blocks=2)
    assert torch.isfinite(actual).all()
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)


def test_common_prefix_blocks_counts_full_shared_blocks_inside_every_context():
    tables = torch.tensor([[4, 5, 6, 7], [4, 5, 6, 9], [4, 5, 6, 7]])
    assert common_prefix_blocks(tables, torch.tensor([64, 64, 64]), 16) == 3
    # Row 1 ends inside block 6: only 2 of the shared blocks are full in its context.
    assert common_prefix_blocks(tables, torch.tensor([64, 47, 64]), 16) == 2
    assert common_prefix_blocks(tables[:1], torch.tensor([64]), 16) == 0  # nothing to share
    assert common_prefix_blocks(torch.tensor([[1, 2], [3, 2]]), torch.tensor([32, 32]), 16) == 0


def _attention_call(pool, **overrides):
    args = {
        "query": torch.zeros(2, 4, 64),
        "kv_cache": pool,
        "layer": 0,
        "block_tables": torch.tensor([[0, 1], [2, 0]]),
        "context_lens": torch.tensor([20, 5]),
        "scale": 0.125,
    }
    args.update(overrides)
    return lambda: paged_attention_decode(**args)


ATTENTION_BAD_INPUTS = {
    "zero context": {"context_lens": torch.tensor([20, 0])},
    "context past the table": {"context_lens": torch.tensor([33, 5])},
    "block id past the pool": {"block_tables": torch.tensor([[0, 8], [2, 0]])},
    "negative block id": {"block_tables": torch.tensor([[0, -1], [2, 0]])},
    "tables batch": {"block_tables": torch.tensor([[0, 1]])},
    "lens batch": {"context_lens": torch.tensor([20])},
    "tables float": {"block_tables": torch.tensor([[0.0, 1.0], [2.0, 0.0]])},
    "heads not a multiple": {"query": torch.zeros(2, 3, 64)},
    "head_dim": {"query": torch.zeros(2, 4, 48)},
    "query ndim": {"query": torch.zeros(2, 256)},
    "query dtype": {"query": torch.zeros(2, 4, 64, dtype=torch.float16)},
    "layer": {"layer": -1},
    "shared blocks the rows do not share": {"num_shared_blocks": 1},
    "negative shared blocks": {"num_shared_blocks": -1},
}


@pytest.mark.parametrize(
    "overrides", ATTENTION_BAD_INPUTS.values(), ids=ATTENTION_BAD_INPUTS.keys()
)
def test_paged_attention_rejects_bad_input(make_pool, overrides):
    with pytest.raises(ValueError):
        _attention_call(make_pool(), **overrides)()
