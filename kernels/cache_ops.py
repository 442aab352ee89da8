"""Writing tokens into the paged KV pool, and copying whole blocks out of it and back.

Each operation has a plain-torch ``*_ref`` (the CPU path and the tests' oracle) and a Triton
kernel in ``cachetier.kernels.triton_cache_ops``; the public function checks its inputs and
dispatches.
"""

from __future__ import annotations

import torch

from cachetier.kernels.backend import resolve_backend
from cachetier.kernels.pool_shape import (
    INDEX_DTYPES,
    KV_DTYPES,
    PoolShape,
    check_index_range,
    check_same_dtype,
    check_tensor,
)


def store_kvcache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    slot_mapping: torch.Tensor,
    *,
    backend: str = "auto",
) -> None:
    """Writes one layer's K and V of each token into its slot of the pool, in place.

    Args:
        key: ``[num_tokens, num_kv_heads, head_dim]``, the pool's dtype.
        value: same shape and dtype as ``key``.
        kv_cache: the pool, ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``.
        layer: which layer's K/V to write.
        slot_mapping: ``[num_tokens]`` int64 (or int32); slot = ``block_id * block_size +
            offset``, and ``-1`` skips the token (padding). Slots must be distinct.
        backend: ``"auto"``, ``"torch"`` or ``"triton"`` (see ``cachetier.kernels.backend``).

    Raises:
        ValueError: shapes, dtypes or devices that do not match, or a slot out of range.
    """
    pool = PoolShape.from_cache(kv_cache)
    pool.check_layer(layer)
    for name, t in (("key", key), ("value", value)):
        check_tensor(name, t, ndim=3, dtypes=KV_DTYPES)
        check_same_dtype(name, t, kv_cache)
    expected = (key.shape[0], pool.num_kv_heads, pool.head_dim)
    if tuple(key.shape) != expected or tuple(value.shape) != expected:
        raise ValueError(
            f"key and value must both be [num_tokens, num_kv_heads, head_dim] = {expected}, "
            f"got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=INDEX_DTYPES)
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(
            f"slot_mapping has {slot_mapping.shape[0]} entries for {key.shape[0]} tokens"
        )
    check_index_range("slot_mapping", slot_mapping, -1, pool.num_slots)

    if resolve_backend(backend, key, value, kv_cache, slot_mapping) == "triton":
        from cachetier.kernels.triton_cache_ops import store_kvcache_triton

        store_kvcache_triton(key, value, kv_cache, layer, slot_mapping, pool)
    else:
        store_kvcache_ref(key, value, kv_cache, layer, slot_mapping)


def store_kvcache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    slot_mapping: torch.Tensor,
) -> None:
    """Plain-torch ``store_kvcache`` (no input checks)."""
    block_size, num_layers = kv_cache.shape[3], kv_cache.shape[1]
    slots = slot_mapping.long()
    written = slots >= 0
    if not bool(written.all()):  # padding is rare: the common step masks nothing
        slots, key, value = slots[written], key[written], value[written]
    if kv_cache.is_contiguous():
        # The pool as rows of [num_kv_heads, head_dim]: a token's K row is
        # ((block * num_layers + layer) * 2) * block_size + offset, its V row block_size
        # further. Two index_copy_ calls replace advanced-indexing writes, which were measured
        # at twice their time for a long prefill.
        rows = (slots // block_size * num_layers + layer) * (2 * block_size) + slots % block_size
        flat = kv_cache.view(-1, *kv_cache.shape[4:])
        flat.index_copy_(0, rows, key)
        flat.index_copy_(0, rows + block_size, value)
        return
    block_ids, offsets = slots // block_size, slots % block_size
    # Indexing [block, layer, kv, offset] leaves [n, num_kv_heads, head_dim] per side.
    kv_cache[block_ids, layer, 0, offsets] = key
    kv_cache[block_ids, layer, 1, offsets] = value


def gather_blocks(
    kv_cache: torch.Tensor,
    block_ids: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Copies whole blocks (all layers, K and V) out of the pool into a staging buffer.

    Args:
        kv_cache: the pool, ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``.
        block_ids: ``[n]`` int32/int64 pool block ids; repeats are allowed.
        out: optional contiguous buffer ``[n, num_layers, 2, block_size, num_kv_heads,
            head_dim]`` of the pool's dtype and device to write into.
        backend: ``"auto"``, ``"torch"`` or ``"triton"`` (see ``cachetier.kernels.backend``).

    Returns:
        ``out`` (or a new contiguous tensor of that shape) with ``out[i] = kv_cache[block_ids[i]]``.

    Raises:
        ValueError: a bad shape, dtype or device, or a block id out of range.
    """
    pool = _check_block_ids(kv_cache, block_ids)
    shape = (block_ids.shape[0], *kv_cache.shape[1:])
    if out is None:
        out = torch.empty(shape, dtype=kv_cache.dtype, device=kv_cache.device)
    else:
        _check_staging("out", out, shape, kv_cache, contiguous=True)

    if resolve_backend(backend, kv_cache, block_ids, out) == "triton":
        from cachetier.kernels.triton_cache_ops import copy_blocks_triton

        copy_blocks_triton(kv_cache, out, block_ids, pool, gather=True)
    else:
        gather_blocks_ref(kv_cache, block_ids, out)
    return out


def gather_blocks_ref(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """Plain-torch ``gather_blocks`` into ``out`` (no input checks)."""
    return torch.index_select(kv_cache, 0, block_ids, out=out)


def scatter_blocks(
    staging: torch.Tensor,
    kv_cache: torch.Tensor,
    block_ids: torch.Tensor,
    *,
    backend: str = "auto",
) -> None:
    """Copies whole blocks from a staging buffer into the pool, in place (inverse of gather).

    Args:
        staging: ``[n, num_layers, 2, block_size, num_kv_heads, head_dim]``, the pool's dtype.
        kv_cache: the pool, ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``.
        block_ids: ``[n]`` int32/int64 distinct pool block ids; ``kv_cache[block_ids[i]] =
            staging[i]``.
        backend: ``"auto"``, ``"torch"`` or ``"triton"`` (see ``cachetier.kernels.backend``).

    Raises:
        ValueError: a bad shape, dtype or device, a block id out of range, or a repeated id
            (two writes to one block would race).
    """
    pool = _check_block_ids(kv_cache, block_ids)
    shape = (block_ids.shape[0], *kv_cache.shape[1:])
    _check_staging("staging", staging, shape, kv_cache, contiguous=False)
    if torch.unique(block_ids).numel() != block_ids.numel():
        raise ValueError("block_ids passed to scatter_blocks must be distinct")

    if resolve_backend(backend, staging, kv_cache, block_ids) == "triton":
        from cachetier.kernels.triton_cache_ops import copy_blocks_triton

        # The kernel reads each staged block as one flat row.
        copy_blocks_triton(staging.contiguous(), kv_cache, block_ids, pool, gather=False)
    else:
        scatter_blocks_ref(staging, kv_cache, block_ids)


def scatter_blocks_ref(
    staging: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor
) -> None:
    """Plain-torch ``scatter_blocks`` (no input checks)."""
    kv_cache.index_copy_(0, block_ids.long(), staging)


def _check_block_ids(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> PoolShape:
    pool = PoolShape.from_cache(kv_cache)
    check_tensor("block_ids", block_ids, ndim=1, dtypes=INDEX_DTYPES)
    check_index_range("block_ids", block_ids, 0, pool.num_blocks)
    return pool


def _check_staging(
    name: str,
    staging: torch.Tensor,
    shape: tuple[int, ...],
    kv_cache: torch.Tensor,
    *,
    contiguous: bool,
) -> None:
    check_tensor(name, staging, ndim=6, dtypes=KV_DTYPES)
    check_same_dtype(name, staging, kv_cache)
    if tuple(staging.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(staging.shape)}")
    if contiguous and not staging.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
