"""LMCache's chunk memory formats as canonical cachetier payloads (LMCache is imported only by
``chunk_format``, for its ``MemoryFormat`` names).

LMCache hands its storage backends ``MemoryObj``s whose tensor is, for a full chunk of
``chunk_size`` tokens (``lmcache.v1.memory_management.MemoryFormat``):

    KV_2LTD     [2, layers, tokens, heads * head_dim]   (MHA)
    KV_MLA_FMT  [1, layers, tokens, latent]             (MLA)

A canonical payload is ``[layers, 2, tokens, heads, head_dim]`` (MLA: ``[layers, 1, tokens,
1, latent]``); both conversions only swap the first two axes, so a chunk is the same whole
``tokens * heads * head_dim`` runs in another order: a put copies them into canonical order, a
get reads each run of a record straight to its place in LMCache's object (``Runs``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from cachetier.primitives.keys import KVLayout, dtype_name
from cachetier.primitives.kv_format import CANONICAL_ARRANGEMENT, MLA_ARRANGEMENT
from cachetier.util.landing import Runs


@dataclass(frozen=True)
class ChunkFormat:
    """How one full LMCache chunk of a model is laid out, in LMCache and in a record.

    Args:
        layout: the records' layout (block size = LMCache's chunk size).
        memory_format: LMCache's ``MemoryFormat`` of the chunk objects.
        obj_shape: the shape of a full chunk's ``MemoryObj`` tensor.
        dtype: its element type.
    """

    layout: KVLayout
    memory_format: Any
    obj_shape: torch.Size
    dtype: torch.dtype

    def to_canonical(self, obj: Any) -> torch.Tensor | None:
        """A new canonical payload of a full chunk's object, or ``None`` for an object this
        format does not describe (a partial chunk, another format or dtype)."""
        tensor = getattr(obj, "tensor", None)
        if (
            tensor is None
            or obj.metadata.fmt != self.memory_format
            or tensor.shape != self.obj_shape
            or tensor.dtype != self.dtype
        ):
            return None
        payload = torch.empty(self.layout.payload_shape, dtype=self.dtype)
        payload.copy_(self._canonical_view(tensor))
        return payload

    def runs(self, obj: Any) -> Runs:
        """Where each run of a canonical payload goes in a full chunk's object of LMCache's
        allocator, for a tier to read it there directly (``cachetier.util.landing``).

        Canonical run ``layer * planes + plane`` (``tokens x heads x dim`` elements) is the
        object's ``[plane, layer]`` row.
        """
        buffer = memoryview(obj.tensor.view(torch.uint8).reshape(-1).numpy())
        run_bytes, offsets = self._run_offsets
        return Runs(buffer, run_bytes, offsets)

    @cached_property
    def _run_offsets(self) -> tuple[int, tuple[int, ...]]:
        # The same for every object of the format: computed once, not per chunk of each get.
        planes, layers = self.obj_shape[:2]
        run_bytes = self.layout.block_bytes // (planes * layers)
        offsets = tuple(
            (plane * layers + layer) * run_bytes
            for layer in range(layers)
            for plane in range(planes)
        )
        return run_bytes, offsets

    def _canonical_view(self, tensor: torch.Tensor) -> torch.Tensor:
        # [planes, layers, tokens, heads * dim] -> [layers, planes, tokens, heads, dim]
        planes, layers, tokens = self.obj_shape[:3]
        heads, dim = self.layout.num_kv_heads, self.layout.head_dim
        return tensor.view(planes, layers, tokens, heads, dim).transpose(0, 1)


def chunk_format(metadata: Any) -> ChunkFormat:
    """The chunk format of a model, from LMCache's ``LMCacheMetadata``.

    Args:
        metadata: ``kv_shape`` ``(layers, 2 or 1, chunk_size, heads, head_dim)``, ``kv_dtype``,
            ``use_mla``, ``chunk_size``.

    Returns:
        The format.

    Raises:
        ValueError: a shape or dtype cachetier does not store.
    """
    from lmcache.v1.memory_management import MemoryFormat  # only where LMCache runs

    layers, planes, _, heads, head_dim = (int(x) for x in metadata.kv_shape)
    chunk_size = int(metadata.chunk_size)
    dtype = metadata.kv_dtype
    if metadata.use_mla:
        latent = heads * head_dim
        layout = KVLayout(dtype_name(dtype), chunk_size, layers, 1, latent, MLA_ARRANGEMENT)
        shape = torch.Size([1, layers, chunk_size, latent])
        return ChunkFormat(layout, MemoryFormat.KV_MLA_FMT, shape, dtype)
    if planes != 2:
        raise ValueError(f"an MHA kv_shape has K and V (2 planes), got {metadata.kv_shape}")
    layout = KVLayout(dtype_name(dtype), chunk_size, layers, heads, head_dim, CANONICAL_ARRANGEMENT)
    shape = torch.Size([2, layers, chunk_size, heads * head_dim])
    return ChunkFormat(layout, MemoryFormat.KV_2LTD, shape, dtype)
