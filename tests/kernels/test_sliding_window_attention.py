"""Sliding-window attention in the kernels: every path against a naive masked softmax.

The naive oracle here writes the window out by position: a query at position p sees keys
``p - window + 1 .. p`` (transformers' sliding_window_overlay; see cachetier.engine.model_spec).
"""

import pytest
import torch

from cachetier.kernels import DecodeInputs, paged_attention_decode, paged_attention_decode_ref
from cachetier.kernels.native_paged_attention import (
    native_decode_kernel,
    paged_attention_decode_native,
)
from cachetier.kernels.native_prefill_attention import (
    PrefillChunk,
    paged_prefill_attention,
    paged_prefill_attention_ref,
    plan_prefill,
)
from cachetier.kernels.torch_paged_attention import gather_layer_kv, window_mask, window_start
from tests.kernels.attention_cases import (
    NUM_KV_HEADS,
    TOLERANCES,
    decode_batch,
    shared_prefix_batch,
)

LENS = [1, 16, 17, 45, 70]  # shorter than, equal to and past the windows below


def naive_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: list[int],
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """``query [n, hq, d]`` at ``positions`` over ``keys``/``values [ctx, hk, d]`` (key j at
    position j), one query and one head at a time, in float64."""
    group = query.shape[1] // keys.shape[1]
    out = torch.zeros(query.shape, dtype=torch.float64)
    for i, p in enumerate(positions):
        for h in range(query.shape[1]):
            seen = [j for j in range(p + 1) if window is None or j > p - window]
            k = keys[seen, h // group].double()
            v = values[seen, h // group].double()
            weights = torch.softmax(k @ query[i, h].double() * scale, dim=0)
            out[i, h] = weights @ v
    return out


def _context(pool: torch.Tensor, layer: int, table: torch.Tensor, length: int):
    blocks = pool[table[: -(-length // pool.shape[3])].long(), layer]
    return blocks[:, 0].flatten(0, 1)[:length], blocks[:, 1].flatten(0, 1)[:length]


def naive_decode(query, pool, layer, tables, lens, scale, window) -> torch.Tensor:
    rows = []
    for row, length in enumerate(lens.tolist()):
        k, v = _context(pool, layer, tables[row], length)
        rows.append(naive_attention(query[row : row + 1], k, v, [length - 1], window, scale)[0])
    return torch.stack(rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [1, 5, 16, 24, 200])
@pytest.mark.parametrize("path", ["reference", "torch", "auto", "triton"])
def test_windowed_decode_matches_naive_masked_softmax(make_pool, gen, dtype, window, path):
    pool = make_pool(num_blocks=16, block_size=16, dtype=dtype)
    tables, lens = decode_batch(gen, LENS, num_blocks=16, block_size=16)
    query = torch.randn(len(LENS), NUM_KV_HEADS * 2, 64, generator=gen).to(dtype)
    scale = 64**-0.5
    if path == "reference":
        inputs = DecodeInputs(query, pool, 1, tables, lens, scale)
        actual = paged_attention_decode_ref(inputs, window=window)
    else:
        actual = paged_attention_decode(
            query, pool, 1, tables, lens, scale, window=window, backend=path
        )
    expected = naive_decode(query, pool, 1, tables, lens, scale, window)
    torch.testing.assert_close(actual, expected.to(dtype), **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("window", [1, 5, 16, 17, 33, 200])
def test_native_windowed_decode_matches_naive_masked_softmax(make_pool, gen, dtype, group, window):
    # The extension reads the window's whole blocks after its first; the first block, entered
    # part-way, is attended beside it. A window on a block edge (16, 17, 33) and inside one.
    assert native_decode_kernel() is not None, "the native decode extension did not build"
    pool = make_pool(num_blocks=24, block_size=16, dtype=dtype)
    lens_list = [1, 15, 16, 17, 33, 64, 70, 100]
    tables, lens = decode_batch(gen, lens_list, num_blocks=24, block_size=16)
    query = torch.randn(len(lens_list), NUM_KV_HEADS * group, 64, generator=gen).to(dtype)
    inputs = DecodeInputs(query, pool, 1, tables, lens, 0.125)
    actual = paged_attention_decode_native(inputs, window=window)
    assert actual is not None and actual.dtype == dtype
    expected = naive_decode(query, pool, 1, tables, lens, 0.125, window)
    torch.testing.assert_close(actual, expected.to(dtype), **TOLERANCES[dtype])


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_a_window_overrides_shared_prefix_reuse(make_pool, gen, backend):
    # Rows behind 3 shared blocks: a window of 20 reaches none of them for the longer rows, so
    # reading the shared blocks once for all rows (cascade) would be wrong there.
    tables, lens, num_blocks = shared_prefix_batch(gen, 3, [2, 20, 33])
    pool = make_pool(num_blocks=num_blocks, block_size=16)
    query = torch.randn(3, NUM_KV_HEADS, 64, generator=gen)
    actual = paged_attention_decode(
        query, pool, 0, tables, lens, 0.125, num_shared_blocks=3, window=20, backend=backend
    )
    expected = naive_decode(query, pool, 0, tables, lens, 0.125, 20)
    torch.testing.assert_close(actual, expected.float(), **TOLERANCES[torch.float32])
    unwindowed = paged_attention_decode(query, pool, 0, tables, lens, 0.125, backend=backend)
    assert (unwindowed - actual).abs().max() > 1e-2  # the window changed what the rows see


def test_the_window_changes_a_decode_past_it_and_nothing_within_it(make_pool, gen):
    pool = make_pool(num_blocks=16, block_size=16)
    tables, lens = decode_batch(gen, [10, 70], num_blocks=16, block_size=16)
    query = torch.randn(2, NUM_KV_HEADS, 64, generator=gen)
    full = paged_attention_decode(query, pool, 0, tables, lens, 0.125, backend="torch")
    windowed = paged_attention_decode(query, pool, 0, tables, lens, 0.125, window=24)
    torch.testing.assert_close(windowed[0], full[0])  # 10 tokens: all inside the window
    assert (windowed[1] - full[1]).abs().max() > 1e-2


@pytest.mark.parametrize("window", [0, -3, True, 2.5])
def test_a_window_that_is_not_a_positive_int_is_refused(make_pool, gen, window):
    pool = make_pool()
    tables, lens = decode_batch(gen, [5], num_blocks=8, block_size=16)
    with pytest.raises(ValueError, match="window must be None or a positive int"):
        paged_attention_decode(torch.zeros(1, 2, 64), pool, 0, tables, lens, 0.1, window=window)


def test_windowed_prefill_reference_matches_naive_masked_softmax(make_pool, gen):
    pool = make_pool(num_blocks=16, block_size=16)
    chunks, order = [], torch.randperm(16, generator=gen)
    # A whole prompt, and a chunk of 9 after 40 cached tokens, on blocks of their own.
    for start, num_new, context_len, blocks in ((0, 50, 50, order[:4]), (50, 9, 49, order[4:8])):
        chunks.append(PrefillChunk(start, num_new, context_len, blocks))
    query = torch.randn(59, NUM_KV_HEADS * 2, 64, generator=gen)
    actual = paged_prefill_attention_ref(query, pool, 1, chunks, 0.125, window=24)
    for c in chunks:
        k, v = _context(pool, 1, c.block_table, c.context_len)
        positions = list(range(c.context_len - c.num_new, c.context_len))
        rows = query[c.start : c.start + c.num_new]
        expected = naive_attention(rows, k, v, positions, 24, 0.125)
        torch.testing.assert_close(actual[c.start : c.start + c.num_new], expected)
    # The native kernel has no window: it declines, and the caller takes the torch path.
    plan = plan_prefill(chunks, 16, 16)
    out = torch.zeros_like(query)
    assert not paged_prefill_attention(query, pool, 1, plan, 0.125, out, window=24)
    assert not out.any()


def test_window_helpers_agree_with_the_position_rule(make_pool, gen):
    assert [window_start(n, 24) for n in (1, 24, 25, 100)] == [0, 0, 1, 76]
    assert window_start(100, None) == 0
    # 3 new queries at positions 7, 8, 9 over keys 4 .. 9 under a window of 4.
    mask = window_mask(3, 10, 4, 4, torch.device("cpu"))
    expected = [[j > p - 4 and j <= p for j in range(4, 10)] for p in (7, 8, 9)]
    assert mask.tolist() == expected
    pool = make_pool(num_blocks=8, block_size=16)
    table = torch.tensor([5, 2, 7, 0])
    k_all, v_all = gather_layer_kv(pool, 1, table, 60)
    k, v = gather_layer_kv(pool, 1, table, 60, start=21)
    torch.testing.assert_close(k, k_all[21:]) and torch.testing.assert_close(v, v_all[21:])
    assert k.shape[0] == 39
