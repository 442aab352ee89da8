"""SGLang's host pool layouts read as canonical blocks, against pools filled the way SGLang's
``MHATokenToKVPoolHost`` indexes them (K/V, layer, token slot; pages of ``page_size`` slots)."""

from __future__ import annotations

import pytest
import torch

from connectors.sglang.layouts import HOST_POOL_AXES, host_pool_parts
from kernels.paged_layouts import PagedBlocks

L, PAGES, PAGE, H, D = 3, 5, 4, 2, 8


def _pool(layout: str) -> torch.Tensor:
    if layout == "layer_first":
        return torch.zeros(2, L, PAGES * PAGE, H, D)
    if layout == "page_first":
        return torch.zeros(2, PAGES * PAGE, L, H, D)
    return torch.zeros(2, PAGES, L, PAGE, H, D)


def _put(pool: torch.Tensor, layout: str, page: int, block: torch.Tensor) -> None:
    for layer in range(L):
        for kv in range(2):
            for t in range(PAGE):
                slot = page * PAGE + t
                if layout == "layer_first":
                    pool[kv, layer, slot] = block[layer, kv, t]
                elif layout == "page_first":
                    pool[kv, slot, layer] = block[layer, kv, t]
                else:
                    pool[kv, page, layer, t] = block[layer, kv, t]


@pytest.mark.parametrize("layout", sorted(HOST_POOL_AXES))
def test_host_pool_pages_are_canonical_blocks(layout: str) -> None:
    pool = _pool(layout)
    blocks = torch.randn(PAGES, L, 2, PAGE, H, D, generator=torch.Generator().manual_seed(4))
    for page in range(PAGES):
        _put(pool, layout, page, blocks[page])
    paged = PagedBlocks(host_pool_parts(pool, layout, PAGE))
    out = torch.empty(2, *paged.geometry.payload_shape)
    paged.gather(torch.tensor([3, 1]), out)
    assert torch.equal(out, blocks[[3, 1]])
    paged.scatter(torch.tensor([0]), out[:1])
    check = torch.empty(1, *paged.geometry.payload_shape)
    paged.gather(torch.tensor([0]), check)
    assert torch.equal(check[0], blocks[3])


def test_unknown_layouts_and_page_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="not one of"):
        host_pool_parts(_pool("layer_first"), "page_head", PAGE)
    with pytest.raises(ValueError, match="does not split"):
        host_pool_parts(_pool("layer_first"), "layer_first", 3)
