"""HostStaging on CPU: saves come back per block, in order, with their tags; loads write the
pages from read-only tier bytes; bad payloads are refused before anything is written.

The CUDA half (pinned buffers, side stream, events) runs in ``tests/gpu``.
"""

from __future__ import annotations

import pytest
import torch

from cachetier.kernels.paged_layouts import PagedBlocks, axes_view
from cachetier.kernels.staging import HostStaging

NB, L, BS, H, D = 8, 2, 4, 2, 8
AXES = ("block", "layer", "kv", "token", "head", "dim")


def _staging(seed: int = 0) -> tuple[HostStaging, torch.Tensor]:
    pool = torch.randn(NB, L, 2, BS, H, D, generator=torch.Generator().manual_seed(seed))
    parts = [[axes_view(pool, AXES, block_size=BS, layer=i)] for i in range(L)]
    return HostStaging(PagedBlocks(parts)), pool


def test_saves_come_back_per_block_with_their_tags() -> None:
    staging, pool = _staging()
    staging.save([3, 1], "first")
    staging.save([6], "second")
    staging.fence()  # nothing to order on CPU
    done = staging.poll()
    assert [p.tag for p in done] == ["first", "second"]
    blocks = [b for p in done for b in p.payloads]
    for got, block in zip(blocks, (3, 1, 6)):
        assert torch.equal(got, pool[block])
    # Each block has its own memory: a tier that keeps one frees the others.
    pointers = {b.untyped_storage().data_ptr() for b in blocks}
    assert len(pointers) == 3
    pool.zero_()
    assert torch.equal(blocks[0], _staging()[1][3])  # a copy, not a view of the pages
    assert staging.poll() == [] and staging.drain() == []


def test_loads_write_pages_from_read_only_bytes() -> None:
    staging, pool = _staging()
    source, _ = _staging(seed=1)
    source.save([2, 5], None)
    payloads = [memoryview(b.numpy().tobytes()) for b in source.drain()[0].payloads]
    assert all(p.readonly for p in payloads)
    staging.load([0, 7], payloads)
    other = _staging(seed=1)[1]
    assert torch.equal(pool[0], other[2]) and torch.equal(pool[7], other[5])


def test_bad_payloads_are_refused_before_any_write() -> None:
    staging, pool = _staging()
    before = pool.clone()
    good = pool[1].numpy().tobytes()
    with pytest.raises(ValueError, match="2 payloads for 1 blocks"):
        staging.load([0], [good, good])
    with pytest.raises(ValueError, match="bytes"):
        staging.load([0, 1], [good, good[:-4]])
    assert torch.equal(pool, before)
