"""Cutting a canonical block into records and joining them back, against plain slicing."""

from __future__ import annotations

import pytest
import torch

from cachetier.kernels.records import join_records, split_block


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("num_records", [1, 2, 4])
def test_split_gives_each_record_its_tokens_and_join_undoes_it(
    dtype: torch.dtype, num_records: int
) -> None:
    # [num_layers, planes, block_size, num_kv_heads, head_dim]
    block = torch.randn(3, 2, 64, 2, 8).to(dtype)
    records = split_block(block, num_records)
    step = 64 // num_records
    assert len(records) == num_records
    for i, record in enumerate(records):
        assert record.is_contiguous() and record.shape == (3, 2, step, 2, 8)
        want = block[:, :, i * step : (i + 1) * step]
        torch.testing.assert_close(record.float(), want.float(), rtol=0, atol=0)
    joined = join_records(records)
    torch.testing.assert_close(joined.float(), block.float(), rtol=0, atol=0)
    out = torch.empty_like(block)
    assert join_records(records, out) is out
    torch.testing.assert_close(out.float(), block.float(), rtol=0, atol=0)


def test_split_of_a_block_the_records_do_not_divide_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot cut a block of 48 tokens into 5"):
        split_block(torch.zeros(1, 2, 48, 1, 4), 5)
    with pytest.raises(ValueError, match="5 dimensions"):
        split_block(torch.zeros(2, 48, 1, 4), 2)


def test_join_refuses_records_of_different_shapes_or_a_wrong_out() -> None:
    a, b = torch.zeros(1, 2, 16, 1, 4), torch.zeros(1, 2, 8, 1, 4)
    with pytest.raises(ValueError, match="one shape and dtype"):
        join_records([a, b])
    with pytest.raises(ValueError, match="out must be"):
        join_records([a, a], torch.zeros(1, 2, 16, 1, 4))
    with pytest.raises(ValueError, match="at least one record"):
        join_records([])
