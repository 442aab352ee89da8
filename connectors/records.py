"""The records connectors write, and what every connector checks of a restored record before
its bytes enter an engine's memory."""

from __future__ import annotations

import torch

from cachetier.kernels.staging import payload_view
from cachetier.primitives.keys import KVLayout
from cachetier.record import KVBlock


def payload_block(
    key: bytes, fingerprint: bytes, layout: KVLayout, payload: torch.Tensor
) -> KVBlock:
    """The block of one full canonical payload of ``layout``, without a copy.

    Args:
        key: the block's key.
        fingerprint: its namespace's fingerprint.
        layout: the layout the payload has (dtype, shape, tokens).
        payload: the payload, contiguous, on the host; nothing may write to it afterwards (a
            CPU tier keeps a view of it).

    Returns:
        The block.
    """
    return KVBlock(
        key=key,
        fingerprint=fingerprint,
        dtype=layout.dtype,
        shape=layout.payload_shape,
        num_tokens=layout.block_size,
        data=payload_view(payload),
    )


def check_record(
    record: KVBlock, key: bytes, fingerprint: bytes, layout: KVLayout, aux: bytes = b""
) -> str | None:
    """Why a restored record must not be copied into an engine's block, or ``None`` if it may.

    The tiers already checked its checksum and key; this checks what it claims to hold.

    Args:
        record: the restored record.
        key: the key it was asked for.
        fingerprint: the namespace fingerprint it must carry.
        layout: the layout of the engine's blocks it would be copied into.
        aux: the side data it must carry: the engine's per-layer fp8 scales (``kv_format``),
            which engines cannot change per block, or ``b""`` for unscaled KV.

    Returns:
        A short reason for the log, or ``None`` when the record fits.
    """
    if record.key != key:
        return "another key"
    if record.fingerprint != fingerprint:
        return "another namespace"
    if record.dtype != layout.dtype or tuple(record.shape) != layout.payload_shape:
        return (
            f"{record.dtype} {tuple(record.shape)} instead of {layout.dtype} {layout.payload_shape}"
        )
    if record.num_tokens != layout.block_size:
        return f"{record.num_tokens} tokens instead of {layout.block_size}"
    if memoryview(record.data).nbytes != layout.block_bytes:
        return f"{memoryview(record.data).nbytes} bytes instead of {layout.block_bytes}"
    if bytes(record.aux) != aux:
        return "other fp8 scales than this run's" if aux else "fp8 scales this run cannot apply"
    return None
