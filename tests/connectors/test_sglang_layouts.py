"""SGLang's host pool layouts read as canonical blocks, against pools filled by hand the way
SGLang's ``MHATokenToKVPoolHost`` and ``MLATokenToKVPoolHost`` index them (K/V, layer, token
slot; pages of ``page_size`` slots), and against buffers SGLang's own ``init_kv_buffer`` makes."""

from __future__ import annotations

import pytest
import torch

from cachetier.connectors.sglang.layouts import (
    HOST_POOL_AXES,
    MLA_HOST_POOL_AXES,
    host_pool_parts,
    page_shape,
)
from cachetier.kernels.paged_layouts import PagedBlocks
from tests.connectors.sglang_pool import make_mha_pool, make_mla_pool

L, PAGES, PAGE, H, D = 3, 5, 4, 2, 8


def _pool(layout: str) -> torch.Tensor:
    if layout == "layer_first":
        return torch.zeros(2, L, PAGES * PAGE, H, D)
    if layout == "page_first":
        return torch.zeros(2, PAGES * PAGE, L, H, D)
    if layout == "page_head":
        return torch.zeros(2, PAGES, H, PAGE, L, D)
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
                elif layout == "page_head":
                    pool[kv, page, :, t, layer] = block[layer, kv, t]
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
        host_pool_parts(_pool("layer_first"), "page_unified", PAGE)
    with pytest.raises(ValueError, match="MLA host layout"):
        host_pool_parts(torch.zeros(PAGES, L, PAGE, H, D), "page_head", PAGE, mla=True)
    with pytest.raises(ValueError, match="does not split"):
        host_pool_parts(_pool("layer_first"), "layer_first", 3)


@pytest.mark.parametrize("layout", sorted(MLA_HOST_POOL_AXES))
def test_mla_pool_pages_are_one_latent(layout: str) -> None:
    pool = make_mla_pool(layout, page_size=PAGE, num_pages=PAGES, num_layers=L, kv_cache_dim=D)
    latents = torch.randn(L, PAGE, D, generator=torch.Generator().manual_seed(5))
    flat = latents.unsqueeze(2)  # [layers, tokens, 1, latent]: SGLang's layer_first page
    pool.set_from_flat_data_page(2 * PAGE, _mla_page_in(layout, flat).to(pool.dtype).flatten())
    paged = PagedBlocks(host_pool_parts(pool.kv_buffer, layout, PAGE, mla=True))
    out = torch.empty(1, *paged.geometry.payload_shape, dtype=pool.dtype)
    paged.gather(torch.tensor([2]), out)
    assert out.shape[1:] == (L, 1, PAGE, 1, D)
    assert torch.equal(out[0, :, 0, :, 0], latents.to(pool.dtype))


def _mla_page_in(layout: str, page: torch.Tensor) -> torch.Tensor:
    """A ``[layers, tokens, 1, latent]`` page in ``layout``'s page order."""
    if layout == "page_first":
        return page.transpose(0, 1).contiguous()
    if layout == "page_first_direct":
        return page.unsqueeze(0)
    return page


@pytest.mark.parametrize("layout", sorted(HOST_POOL_AXES))
def test_page_shapes_are_sglangs_own(layout: str) -> None:
    pool = make_mha_pool(
        layout, page_size=PAGE, num_pages=PAGES, num_layers=L, num_heads=H, head_dim=D
    )
    page = pool.get_data_page(PAGE, flat=False)
    shape = page_shape(layout, mla=False, page_size=PAGE, num_layers=L, num_heads=H, head_dim=D)
    assert tuple(page.shape) == shape
    assert tuple(pool.kv_buffer.shape) == tuple(_pool(layout).shape)
