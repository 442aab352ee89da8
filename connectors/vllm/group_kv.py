"""One KV cache group's blocks as the worker copies them: its layers' paged buffers, and the
records cut from (or joined into) its blocks.

A model of one group has one of these for every layer; vLLM's hybrid KV cache manager gives a
model of several kinds of layers one per group (``cachetier.connectors.vllm.kv_groups``), and
each group's records hold its layers only, under a namespace that names them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from cachetier.connectors.vllm.layouts import VllmArrangement
from cachetier.connectors.vllm.metadata import BlockTransfer
from cachetier.connectors.vllm.paged import PagedKV
from cachetier.kernels.records import join_records, split_block
from cachetier.kernels.staging import payload_tensor, payload_view
from cachetier.primitives.keys import KVLayout, record_layout, torch_dtype
from cachetier.record import Buffer, KVBlock


class GroupKV:
    """One group's layers, their canonical layout and, once vLLM registers them, their buffers.

    Args:
        arrangement: how this run's KV cells of the group map onto canonical blocks.
        layer_names: the group's attention layers in model order (the order in a record).
        record_tokens: tokens per record.
        starts_with_first_layer: whether the group's first layer is the model's first, the
            one the per-record check recomputes (``cachetier.guard.record_check``).
    """

    def __init__(
        self,
        arrangement: VllmArrangement,
        layer_names: Sequence[str],
        record_tokens: int,
        starts_with_first_layer: bool = True,
    ) -> None:
        self.starts_with_first_layer = starts_with_first_layer
        self.arrangement = arrangement
        self.layout: KVLayout = arrangement.layout
        self.record_layout = record_layout(self.layout, record_tokens)
        self.layer_names = list(layer_names)
        self.aux = b""
        self._paged: PagedKV | None = None

    def register(self, kv_caches: Mapping[str, torch.Tensor], aux: bytes) -> PagedKV:
        """Take vLLM's tensors of this group's layers (checked against the layout)."""
        self.aux = aux
        self._paged = PagedKV(kv_caches, self.layer_names, self.arrangement)
        return self._paged

    @property
    def registered(self) -> PagedKV | None:
        """The buffers, ``None`` before vLLM registers them."""
        return self._paged

    @property
    def paged(self) -> PagedKV:
        if self._paged is None:
            raise RuntimeError("vLLM has not registered its KV caches with the connector yet")
        return self._paged

    def block_payloads(
        self, records: Sequence[KVBlock], per_block: int, num_blocks: int
    ) -> list[Buffer]:
        """One canonical payload per vLLM block: a record's bytes as they are, or its records
        joined (one copy) where a block holds several."""
        if per_block == 1:
            return [record.data for record in records[:num_blocks]]
        dtype = torch_dtype(self.record_layout.dtype)
        shape = self.record_layout.payload_shape
        return [
            join_records(
                [
                    payload_tensor(record.data, dtype, shape)
                    for record in records[b * per_block : (b + 1) * per_block]
                ]
            )
            for b in range(num_blocks)
        ]

    def records(self, transfer: BlockTransfer, payloads: Sequence[torch.Tensor]) -> list[KVBlock]:
        """The records of saved vLLM blocks: each block's payload, cut into ``per_block``
        records where it holds several."""
        layout = self.record_layout
        per_block = transfer.per_block
        if len(payloads) * per_block != len(transfer.keys):
            raise ValueError(f"{len(payloads)} payloads for {len(transfer.keys)} records")
        pieces: list[torch.Tensor] = []
        for payload in payloads:
            if per_block == 1:
                pieces.append(payload)
            else:
                block = payload.reshape(self.layout.payload_shape)
                pieces.extend(split_block(block, per_block))
        return [
            KVBlock(
                key,
                transfer.fingerprint,
                layout.dtype,
                layout.payload_shape,
                layout.block_size,
                payload_view(piece),
                self.aux,
            )
            for key, piece in zip(transfer.keys, pieces, strict=True)
        ]
