"""Pages of an SGLang host KV pool as canonical cachetier payloads (no SGLang import).

``HostPoolPages`` reads what it needs of a registered host pool (its ``kv_buffer``, layout,
page size and geometry) and copies pages to and from canonical payloads with
``cachetier.kernels.paged_layouts``: by host slot index for SGLang's zero-copy calls
(``batch_get_v1``/``batch_set_v1``), or one flat page at a time for its key-based calls, whose
pages (``get_data_page``) are in the pool's own layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cachetier.connectors.sglang.layouts import host_pool_parts, page_shape, pool_axes
from cachetier.kernels.paged_layouts import PagedBlocks
from cachetier.primitives.keys import KVLayout, dtype_name
from cachetier.primitives.kv_format import CANONICAL_ARRANGEMENT, MLA_ARRANGEMENT


@dataclass(frozen=True)
class HostPoolPages:
    """One SGLang host pool, page by page.

    Args:
        layout: the pool's layout (``cachetier.connectors.sglang.layouts``).
        mla: whether it is an MLA pool.
        page_size: tokens per page: the records' block size.
        kv_layout: the records' KV layout.
        paged: views of the pool's ``kv_buffer`` as canonical blocks, one per page.
    """

    layout: str
    mla: bool
    page_size: int
    kv_layout: KVLayout
    paged: PagedBlocks

    @classmethod
    def from_pool(cls, pool: Any, *, mla: bool) -> HostPoolPages:
        """Read a registered SGLang host pool (``MHATokenToKVPoolHost``/``MLATokenToKVPoolHost``).

        Args:
            pool: the pool SGLang passes to ``register_mem_pool_host``.
            mla: ``HiCacheStorageConfig.is_mla_model``.

        Returns:
            Its pages.

        Raises:
            ValueError: a pool cachetier cannot store portably (a layout of its own, a page
                format SGLang tags, K and V of different widths, a buffer not on the host).
        """
        layout = str(getattr(pool, "layout", ""))
        pool_axes(layout, mla=mla)  # raises for layouts not read here (page_unified, ...)
        tag = getattr(pool, "storage_format_tag", None)
        if tag is not None:
            raise ValueError(f"SGLang host pools with their own page format ({tag!r}) are not read")
        buffer = getattr(pool, "kv_buffer", None)
        if not isinstance(buffer, torch.Tensor) or buffer.device.type != "cpu":
            raise ValueError("the SGLang host pool has no kv_buffer in host memory")
        if mla:
            heads, head_dim, arrangement = 1, int(pool.kv_cache_dim), MLA_ARRANGEMENT
        else:
            heads, head_dim, arrangement = int(pool.head_num), int(pool.head_dim), None
            if int(getattr(pool, "v_head_dim", head_dim)) != head_dim:
                raise ValueError("SGLang pools whose V heads are narrower than K are not read")
        page_size = int(pool.page_size)
        paged = PagedBlocks(host_pool_parts(buffer, layout, page_size, mla=mla))
        kv_layout = KVLayout(
            dtype=dtype_name(buffer.dtype),
            block_size=page_size,
            num_layers=paged.geometry.num_layers,
            num_kv_heads=heads,
            head_dim=head_dim,
            arrangement=arrangement or CANONICAL_ARRANGEMENT,
        )
        return cls(layout, mla, page_size, kv_layout, paged)

    @property
    def payload_shape(self) -> tuple[int, ...]:
        return self.kv_layout.payload_shape

    def page_ids(self, host_indices: torch.Tensor, num_pages: int) -> list[int]:
        """The pages SGLang's ``host_indices`` (token slots, ``page_size`` per page) cover.

        Args:
            host_indices: ``[num_pages * page_size]`` slot indices, each page's slots whole.
            num_pages: how many keys the call names.

        Returns:
            One page id per key.

        Raises:
            ValueError: indices that do not cover ``num_pages`` whole pages of this pool.
        """
        size = self.page_size
        if host_indices.ndim != 1 or host_indices.numel() != num_pages * size:
            raise ValueError(
                f"host_indices must be {num_pages} pages of {size} slots, got shape "
                f"{tuple(host_indices.shape)}"
            )
        slots = host_indices.to(device="cpu", dtype=torch.long).view(num_pages, size)
        firsts = slots[:, 0]
        whole = torch.equal(slots - firsts[:, None], torch.arange(size).expand(num_pages, size))
        if not whole or bool((firsts % size).any()):
            raise ValueError("host_indices must cover whole pages, each starting on a page")
        pages = (firsts // size).tolist()
        if any(not 0 <= p < self.paged.num_blocks for p in pages):
            raise ValueError(f"host_indices reach past the pool's {self.paged.num_blocks} pages")
        return pages

    def save(self, page_ids: Sequence[int]) -> list[torch.Tensor]:
        """Canonical payloads of these pages, one new host tensor each."""
        payloads = [torch.empty(self.payload_shape, dtype=self.paged.dtype) for _ in page_ids]
        self.paged.gather_each(page_ids, payloads)
        return payloads

    def load(self, page_ids: Sequence[int], payloads: Sequence[torch.Tensor]) -> None:
        """Copy canonical payloads into these (distinct) pages."""
        self.paged.scatter_each(page_ids, payloads)

    def page_tensor(self, flat: torch.Tensor) -> torch.Tensor:
        """One flat page in the pool's layout (``get_data_page``) as a canonical payload view
        ``[layers, planes, tokens, heads, head_dim]`` of its memory (no copy).

        Raises:
            ValueError: a tensor that is not one contiguous host page of this pool.
        """
        geometry = self.paged.geometry
        shape = page_shape(
            self.layout,
            mla=self.mla,
            page_size=self.page_size,
            num_layers=geometry.num_layers,
            num_heads=geometry.num_kv_heads,
            head_dim=geometry.head_dim,
        )
        if (
            flat.dtype != self.paged.dtype
            or flat.numel() != torch.Size(shape).numel()
            or not flat.is_contiguous()
            or flat.device.type != "cpu"
        ):
            raise ValueError(
                f"a page is {flat.numel()} {flat.dtype} elements on {flat.device}; this pool's "
                f"pages are {torch.Size(shape).numel()} contiguous {self.paged.dtype} on the host"
            )
        # One page is the pool's layout with one page in it: a slot axis is the page's tokens.
        axes = ["token" if a == "slot" else a for a in pool_axes(self.layout, mla=self.mla)]
        view = flat.view(shape)
        if "block" in axes:
            view = view.squeeze(axes.index("block"))
            axes.remove("block")
        if "kv" not in axes:  # MLA: one plane
            view = view.unsqueeze(0)
            axes.insert(0, "kv")
        return view.permute(*(axes.index(a) for a in ("layer", "kv", "token", "head", "dim")))
