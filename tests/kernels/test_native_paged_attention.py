"""The compiled CPU decode attention (cachetier.kernels.native_paged_attention) against the
reference,
on every shape it is built for, and the fallback where it is not."""

import os
import subprocess
import sys

import pytest
import torch

from cachetier.kernels import DecodeInputs, paged_attention_decode, paged_attention_decode_ref
from cachetier.kernels.native_paged_attention import (
    native_decode_kernel,
    paged_attention_decode_native,
)
from tests.kernels.attention_cases import (
    TOLERANCES,
    decode_batch,
    dense_sdpa,
    shared_prefix_batch,
)

RAGGED = [1, 31, 32, 33, 200]  # one token, a block less one, a block, one more, many blocks


def test_the_kernel_builds_here():
    # The README asks for a C++ compiler; a machine that has one must not fall back silently.
    assert native_decode_kernel() is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_native_matchesdense_sdpa(make_pool, gen, dtype, group, block_size, head_dim, index_dtype):
    num_blocks = 24
    pool = make_pool(num_blocks=num_blocks, block_size=block_size, head_dim=head_dim, dtype=dtype)
    lens = [n for n in RAGGED if -(-n // block_size) <= 13]
    tables, context_lens = decode_batch(
        gen, lens, num_blocks=num_blocks, block_size=block_size, index_dtype=index_dtype
    )
    query = torch.randn(len(lens), 2 * group, head_dim, generator=gen).to(dtype)
    inputs = DecodeInputs(query, pool, 1, tables, context_lens, head_dim**-0.5)

    actual = paged_attention_decode_native(inputs)

    assert actual is not None and actual.dtype == dtype and actual.shape == query.shape
    expected = dense_sdpa(query, pool, 1, tables, context_lens, head_dim**-0.5)
    torch.testing.assert_close(actual, expected, **TOLERANCES[dtype])


def test_auto_on_cpu_runs_the_native_kernel(make_pool, gen):
    pool = make_pool(num_blocks=12, block_size=16)
    tables, lens = decode_batch(gen, [5, 40, 17], num_blocks=12, block_size=16)
    query = torch.randn(3, 6, 64, generator=gen)

    auto = paged_attention_decode(query, pool, 0, tables, lens, 0.125)
    native = paged_attention_decode_native(DecodeInputs(query, pool, 0, tables, lens, 0.125))

    assert native is not None and torch.equal(auto, native)


@pytest.mark.parametrize(
    "shape",
    [
        {"head_dim": 48, "num_kv_heads": 2, "num_heads": 6, "block_size": 16},  # head_dim
        {"head_dim": 64, "num_kv_heads": 1, "num_heads": 9, "block_size": 16},  # group of 9
        {"head_dim": 64, "num_kv_heads": 2, "num_heads": 4, "block_size": 272},  # block_size
    ],
    ids=["head_dim 48", "group 9", "block_size 272"],
)
def test_shapes_it_is_not_built_for_fall_back_to_torch(make_pool, gen, shape):
    pool = make_pool(
        num_blocks=4,
        block_size=shape["block_size"],
        num_kv_heads=shape["num_kv_heads"],
        head_dim=shape["head_dim"],
    )
    tables, lens = decode_batch(gen, [3, 20], num_blocks=4, block_size=shape["block_size"])
    query = torch.randn(2, shape["num_heads"], shape["head_dim"], generator=gen)
    inputs = DecodeInputs(query, pool, 0, tables, lens, 0.2)

    assert paged_attention_decode_native(inputs) is None
    torch.testing.assert_close(
        paged_attention_decode(query, pool, 0, tables, lens, 0.2),
        paged_attention_decode_ref(inputs),
        **TOLERANCES[torch.float32],
    )


def test_slots_past_each_context_and_padding_blocks_are_not_read(make_pool, gen):
    pool = make_pool(num_blocks=8, block_size=16)
    tables, lens = decode_batch(gen, [20, 3], num_blocks=8, block_size=16)
    query = torch.randn(2, 2, 64, generator=gen)
    expected = paged_attention_decode_ref(DecodeInputs(query, pool, 0, tables, lens, 0.125))
    used = {int(b) for seq, n in enumerate(lens.tolist()) for b in tables[seq, : -(-n // 16)]}
    for block_id in set(range(8)) - used:
        pool[block_id] = float("nan")
    pool[tables[0, 1], :, :, 20 - 16 :] = float("nan")
    pool[tables[1, 0], :, :, 3:] = float("nan")

    actual = paged_attention_decode_native(DecodeInputs(query, pool, 0, tables, lens, 0.125))

    assert actual is not None
    torch.testing.assert_close(actual, expected, **TOLERANCES[torch.float32])


def test_large_scores_stay_finite(make_pool, gen):
    # Scores in the thousands overflow a naive exp; the online softmax must not.
    pool = make_pool(num_blocks=8, block_size=16)
    tables, lens = decode_batch(gen, [40, 7], num_blocks=8, block_size=16)
    query = 300.0 * torch.randn(2, 6, 64, generator=gen)
    inputs = DecodeInputs(query, pool, 0, tables, lens, 1.0)

    actual = paged_attention_decode_native(inputs)

    assert actual is not None and torch.isfinite(actual).all()
    torch.testing.assert_close(actual, paged_attention_decode_ref(inputs), rtol=1e-4, atol=1e-4)


def test_the_environment_switch_keeps_every_call_on_torch():
    code = (
        "from cachetier.kernels.native_paged_attention import native_decode_kernel\n"
        "assert native_decode_kernel() is None\n"
    )
    env = {**os.environ, "CACHETIER_NATIVE_KERNELS": "0"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


# A row whose context ends where the shared blocks end has nothing of its own: its own part
# is empty (log-sum-exp -inf) and the merge must give the shared part alone.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("own_lens", [[0, 1, 17, 40], [5, 33, 0]])
def test_shared_blocks_read_once_and_merged_match_the_reference(make_pool, gen, dtype, own_lens):
    tables, lens, num_blocks = shared_prefix_batch(gen, 3, own_lens)
    pool = make_pool(num_blocks=num_blocks, dtype=dtype)
    query = torch.randn(len(own_lens), 6, 64, generator=gen).to(dtype)
    inputs = DecodeInputs(query, pool, 1, tables, lens, 0.125)
    expected = paged_attention_decode_ref(inputs)

    for num_shared in range(4):
        actual = paged_attention_decode_native(inputs, num_shared)
        assert actual is not None and actual.dtype == dtype
        torch.testing.assert_close(actual, expected, **TOLERANCES[dtype])
