"""The paged KV pool: one tensor sized from a byte budget, and whole-block copies in and out.

Layout ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``: block-major, so one
block (all layers, K and V) is contiguous and offload / restore are plain block copies.

An fp8 pool also keeps one float32 scale per block, layer and K/V (``scales``); an element
stands for ``fp8 * scale``. A block's scales travel with it to the tiers as its record's
``aux``. The kernels stay same-dtype: fp8 writes and reads are the plain-torch functions below.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np
import torch

from cachetier.engine.config import FP8_KV_DTYPES, POOL_DTYPES
from cachetier.engine.model_spec import ModelSpec
from cachetier.kernels import gather_blocks, scatter_blocks
from cachetier.primitives.keys import KVLayout, torch_dtype

log = logging.getLogger(__name__)

_SCALE_DTYPE = np.dtype("<f4")  # scales as stored in a record's aux: little-endian float32

# Pinned host memory a CUDA pool restores through, in two buffers that take turns: tier bytes
# are copied into one while the other's host-to-device copy runs. The pageable path this
# replaced (a bytearray per block, a stack, a synchronous ``.to``) spent longer copying a long
# prompt's blocks than the cold prefill they save.
RESTORE_STAGING_BYTES = 32 << 20


class KVPool:
    """The pool tensor and its geometry.

    Args:
        spec: the model (layers, KV heads, head dim).
        block_size: tokens per block.
        budget_bytes: memory for the pool; the number of blocks follows from it.
        dtype: element type name of the pool (``cachetier.engine.config.POOL_DTYPES``).
        kernel_backend: backend for the gather kernel.
        device: where the pool lives: the CPU, or a CUDA device (there the block copies run
            as the Triton kernels, saves reach the host in one copy per batch, and restores
            stage through pinned memory).
        staging_bytes: pinned memory for restores on CUDA (two buffers of half each, at least
            one block per buffer); unused on the CPU.
    """

    def __init__(
        self,
        spec: ModelSpec,
        block_size: int,
        budget_bytes: int,
        dtype: str,
        kernel_backend: str = "auto",
        device: str | torch.device = "cpu",
        staging_bytes: int = RESTORE_STAGING_BYTES,
    ) -> None:
        if dtype not in POOL_DTYPES:
            raise ValueError(f"KV dtype {dtype!r} is not one of {sorted(POOL_DTYPES)}")
        if torch.device(device).type not in ("cpu", "cuda"):
            raise ValueError(f"a KV pool lives on the CPU or a CUDA device, not {device!r}")
        self.layout = KVLayout(dtype, block_size, spec.num_layers, spec.num_kv_heads, spec.head_dim)
        self.block_shape = (spec.num_layers, 2, block_size, spec.num_kv_heads, spec.head_dim)
        self.block_bytes = self.layout.block_bytes
        # Scale bytes of a block: num_layers x K/V float32 for fp8, none otherwise.
        fp8 = dtype in FP8_KV_DTYPES.values()
        self.aux_bytes = spec.num_layers * 2 * _SCALE_DTYPE.itemsize if fp8 else 0
        num_blocks = budget_bytes // (self.block_bytes + self.aux_bytes)
        if num_blocks < 2:
            raise ValueError(
                f"a KV budget of {budget_bytes} bytes holds {num_blocks} blocks of "
                f"{self.block_bytes + self.aux_bytes} bytes; give at least "
                f"{2 * (self.block_bytes + self.aux_bytes)}"
            )
        self.kernel_backend = kernel_backend
        self.cache = torch.zeros(
            (num_blocks, *self.block_shape), dtype=torch_dtype(dtype), device=device
        )
        # [num_blocks, num_layers, 2] float32 for fp8 pools (None otherwise); a block's scales
        # are 0 until something is written to it.
        self.scales: torch.Tensor | None = None
        if fp8:
            self.scales = torch.zeros(
                (num_blocks, spec.num_layers, 2), dtype=torch.float32, device=device
            )
        # A byte view of each block row: restores copy tier buffers straight into the pool.
        self._rows = self.cache.view(num_blocks, -1).view(torch.uint8)
        # CUDA restores: blocks per pinned buffer, and the buffers with the event of the last
        # copy out of each (made on first use: a pool that never restores pins nothing).
        self._staging_blocks = max(1, staging_bytes // 2 // self.block_bytes)
        self._staging: list[tuple[torch.Tensor, torch.cuda.Event | None]] = []
        log.info(
            "KV pool: %d blocks of %d tokens (%d tokens, %.1f MiB, %s)",
            num_blocks,
            block_size,
            num_blocks * block_size,
            num_blocks * self.block_bytes / 2**20,
            dtype,
        )

    @property
    def num_blocks(self) -> int:
        return self.cache.shape[0]

    @property
    def dtype_name(self) -> str:
        return self.layout.dtype

    def read_blocks(self, block_ids: Sequence[int]) -> list[memoryview]:
        """Copies of whole blocks, as read-only byte views the caller owns."""
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.cache.device)
        if self.scales is not None:
            # The kernels take float pools only: copy fp8 blocks as bytes.
            staged = torch.index_select(self._rows, 0, ids)
        else:
            staging = gather_blocks(self.cache, ids, backend=self.kernel_backend)
            staged = staging.view(len(block_ids), -1).view(torch.uint8)
        rows = staged.cpu().numpy()  # a no-op on CPU; one device-to-host copy elsewhere
        return [memoryview(row).toreadonly() for row in rows]

    def write_blocks(self, block_ids: Sequence[int], buffers: Sequence[object]) -> None:
        """Copy whole blocks (bytes-like, ``block_bytes`` each) into the pool.

        Raises:
            ValueError: a count or a buffer size that does not match.
        """
        if len(buffers) != len(block_ids):
            raise ValueError(f"{len(buffers)} buffers for {len(block_ids)} blocks")
        sources = [np.frombuffer(b, dtype=np.uint8) for b in buffers]  # type: ignore[call-overload]
        for source in sources:
            if source.nbytes != self.block_bytes:
                raise ValueError(f"a block of {source.nbytes} bytes, not {self.block_bytes}")
        if self.cache.device.type == "cpu":
            # One copy from the tier's buffer into the pool row; no staging tensor on CPU.
            rows = self._rows.numpy()
            for block_id, source in zip(block_ids, sources):
                rows[block_id] = source
            return
        ids = torch.tensor(block_ids, dtype=torch.long)
        per = self._staging_blocks
        for start in range(0, len(sources), per):
            chunk = sources[start : start + per]
            buffer = self._free_staging(start // per % 2)
            host = buffer.numpy()
            for row, source in zip(host, chunk):
                row[:] = source
            # Asynchronous from pinned memory; the scatter after it runs on the same stream,
            # and so does the forward that reads the blocks.
            rows = buffer[: len(chunk)].to(self.cache.device, non_blocking=True)
            chunk_ids = ids[start : start + len(chunk)].to(self.cache.device, non_blocking=True)
            if self.scales is not None:
                self._rows.index_copy_(0, chunk_ids, rows)
            else:
                blocks = rows.view(self.cache.dtype).view(len(chunk), *self.block_shape)
                scatter_blocks(blocks, self.cache, chunk_ids, backend=self.kernel_backend)
            copied = torch.cuda.Event()
            copied.record()
            self._staging[start // per % 2] = (buffer, copied)

    def synchronize(self) -> None:
        """Wait for copies into the pool still running on the device (none on the CPU)."""
        if self.cache.device.type == "cuda":
            torch.cuda.synchronize(self.cache.device)

    def time_restore_copy(self) -> tuple[int, float] | None:
        """Time a restore's copy into this pool where restores copy (``block_views`` is
        ``None``): staging-buffers' worth of zero blocks written to the first free blocks, once
        to set the buffers up (the first restore no longer pays for that) and once timed.

        Returns:
            ``(bytes, seconds)`` of the timed write, or ``None`` where restores land in place.
            Call it before the pool holds anything: it overwrites blocks from 0 on.
        """
        if self.block_views([0]) is not None:
            return None
        n = min(self.num_blocks, 2 * self._staging_blocks)
        zeros = [bytes(self.block_bytes)] * n
        self.write_blocks(range(n), zeros)
        self.synchronize()
        start = time.perf_counter()
        self.write_blocks(range(n), zeros)
        self.synchronize()
        return n * self.block_bytes, time.perf_counter() - start

    def _free_staging(self, index: int) -> torch.Tensor:
        """Pinned buffer ``index`` (0 or 1), once the last copy out of it has finished."""
        while len(self._staging) <= index:
            pinned = torch.empty((self._staging_blocks, self.block_bytes), dtype=torch.uint8)
            self._staging.append((pinned.pin_memory(), None))
        buffer, copied = self._staging[index]
        if copied is not None:
            copied.synchronize()
        return buffer

    def block_views(self, block_ids: Sequence[int]) -> list[memoryview] | None:
        """Writable byte views of pool blocks, for tiers to read payloads into (CPU pools only;
        ``None`` elsewhere, where restores stage through ``write_blocks``)."""
        if self.cache.device.type != "cpu":
            return None
        rows = self._rows.numpy()
        return [memoryview(rows[b]) for b in block_ids]

    def holds(self, block_id: int, data: object) -> bool:
        """Whether ``data`` is a view of pool block ``block_id`` (already in place)."""
        view = memoryview(data)  # type: ignore[arg-type]
        if not isinstance(view.obj, np.ndarray):
            return False
        row = self._rows[block_id]
        return view.obj.ctypes.data == row.data_ptr() and view.nbytes == self.block_bytes

    def read_aux(self, block_ids: Sequence[int]) -> list[bytes]:
        """Each block's side data for its record: its scales (``num_layers x 2`` little-endian
        float32) in an fp8 pool, ``b""`` in others."""
        if self.scales is None:
            return [b""] * len(block_ids)
        rows = self.scales[torch.tensor(block_ids, dtype=torch.long)].cpu().numpy()
        return [row.astype(_SCALE_DTYPE).tobytes() for row in rows]

    def write_aux(self, block_ids: Sequence[int], auxes: Sequence[object]) -> None:
        """Set blocks' side data from their records (``read_aux``'s form; checked by
        ``payload_matches``). Does nothing in a pool without scales."""
        if self.scales is None or not block_ids:
            return
        rows = np.stack([np.frombuffer(a, dtype=_SCALE_DTYPE) for a in auxes])  # type: ignore[call-overload]
        rows = rows.reshape(len(block_ids), *self.scales.shape[1:])
        ids = torch.tensor(block_ids, dtype=torch.long)
        self.scales[ids] = torch.from_numpy(rows.astype(np.float32)).to(self.scales.device)

    def reset_scales(self, block_ids: Sequence[int]) -> None:
        """Mark blocks empty (scale 0) when they get a new owner, so a block's scale follows
        only its own tokens, not whatever it held before."""
        if self.scales is not None and block_ids:
            self.scales[torch.tensor(block_ids, dtype=torch.long)] = 0.0

    def payload_matches(
        self, dtype: str, shape: Sequence[int], nbytes: int, aux_nbytes: int
    ) -> bool:
        """Whether a restored block has exactly this pool's block layout (and scale count)."""
        return (
            dtype == self.dtype_name
            and tuple(shape) == self.block_shape
            and nbytes == self.block_bytes
            and aux_nbytes == self.aux_bytes
        )


def _to_fp8(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # Casts to fp8 do not saturate (out of range -> nan / inf): clamp first.
    fp8_max = torch.finfo(dtype).max
    return x.clamp(-fp8_max, fp8_max).to(dtype)


def store_kv_fp8(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_scales: torch.Tensor,
    layer: int,
    slot_mapping: torch.Tensor,
) -> None:
    """``kernels.store_kvcache`` for an fp8 pool: quantise one layer's K and V into their slots.

    A block's scale (per layer and K/V) is the largest ``|x| / fp8_max`` it holds and only
    grows: tokens larger than a block's current scale allows first re-quantise what the block
    already holds to the larger scale, so nothing saturates.

    Args:
        key: ``[num_tokens, num_kv_heads, head_dim]`` in the compute dtype.
        value: same shape as ``key``.
        kv_cache: the fp8 pool ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``.
        kv_scales: its scales ``[num_blocks, num_layers, 2]`` float32, updated in place.
        layer: which layer's K/V to write.
        slot_mapping: ``[num_tokens]`` distinct slots (``block_id * block_size + offset``);
            ``-1`` skips a token.
    """
    written = slot_mapping >= 0
    slots = slot_mapping[written].long()
    if slots.numel() == 0:
        return
    block_size = kv_cache.shape[3]
    block_ids, offsets = slots // block_size, slots % block_size
    new = torch.stack((key[written], value[written]), dim=1).float()  # [n, 2, hk, d]
    ids, inverse = torch.unique(block_ids, return_inverse=True)  # [u], [n]
    # Largest |x| this step brings to each (block, K/V): [u, 2].
    step_amax = torch.zeros(ids.shape[0], 2, device=new.device).scatter_reduce_(
        0, inverse[:, None].expand(-1, 2), new.abs().amax(dim=(2, 3)), "amax"
    )
    old = kv_scales[ids, layer]  # [u, 2]
    scale = torch.maximum(old, step_amax / torch.finfo(kv_cache.dtype).max)
    grown = (scale > old) & (old > 0)
    if bool(grown.any()):
        u, kv = grown.nonzero(as_tuple=True)
        held = kv_cache[ids[u], layer, kv].float()  # [g, block_size, hk, d]
        ratio = (old[u, kv] / scale[u, kv])[:, None, None, None]
        kv_cache[ids[u], layer, kv] = _to_fp8(held * ratio, kv_cache.dtype)
    kv_scales[ids, layer] = scale
    # A block that only ever held zeros keeps scale 0; divide by 1 there.
    divisor = scale.masked_fill(scale == 0, 1.0)[inverse][:, :, None, None]  # [n, 2, 1, 1]
    quantized = _to_fp8(new / divisor, kv_cache.dtype)
    kv_cache[block_ids, layer, 0, offsets] = quantized[:, 0]
    kv_cache[block_ids, layer, 1, offsets] = quantized[:, 1]


def dequantize_blocks(
    kv_cache: torch.Tensor,
    kv_scales: torch.Tensor,
    block_ids: torch.Tensor,
    layer: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """One layer of some fp8 blocks as ``fp8 * scale`` in ``dtype``.

    Args:
        kv_cache: the fp8 pool.
        kv_scales: its scales ``[num_blocks, num_layers, 2]``.
        block_ids: ``[n]`` int64 block ids (repeats allowed).
        layer: the layer to read.
        dtype: the compute dtype to return.

    Returns:
        ``[n, 2, block_size, num_kv_heads, head_dim]`` in ``dtype``.
    """
    scale = kv_scales[block_ids, layer][:, :, None, None, None]  # [n, 2, 1, 1, 1]
    return (kv_cache[block_ids, layer].float() * scale).to(dtype)
