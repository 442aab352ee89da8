"""The paged KV pool: one tensor sized from a byte budget, and whole-block copies in and out.

Layout ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``: block-major, so one
block (all layers, K and V) is contiguous and offload / restore are plain block copies.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from cachetier.keys import KVLayout
from engine.loader import ModelSpec
from kernels import gather_blocks, scatter_blocks

log = logging.getLogger(__name__)

TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


class KVPool:
    """The pool tensor and its geometry.

    Args:
        spec: the model (layers, KV heads, head dim).
        block_size: tokens per block.
        budget_bytes: memory for the pool; the number of blocks follows from it.
        dtype: element type name of the pool (``TORCH_DTYPES``).
        kernel_backend: backend for the gather kernel.
    """

    def __init__(
        self,
        spec: ModelSpec,
        block_size: int,
        budget_bytes: int,
        dtype: str,
        kernel_backend: str = "auto",
    ) -> None:
        if dtype not in TORCH_DTYPES:
            raise ValueError(f"KV dtype {dtype!r} is not one of {sorted(TORCH_DTYPES)}")
        self.layout = KVLayout(dtype, block_size, spec.num_layers, spec.num_kv_heads, spec.head_dim)
        self.block_shape = (spec.num_layers, 2, block_size, spec.num_kv_heads, spec.head_dim)
        self.block_bytes = self.layout.block_bytes
        num_blocks = budget_bytes // self.block_bytes
        if num_blocks < 2:
            raise ValueError(
                f"a KV budget of {budget_bytes} bytes holds {num_blocks} blocks of "
                f"{self.block_bytes} bytes; give at least {2 * self.block_bytes}"
            )
        self.kernel_backend = kernel_backend
        self.cache = torch.zeros((num_blocks, *self.block_shape), dtype=TORCH_DTYPES[dtype])
        # A byte view of each block row: restores copy tier buffers straight into the pool.
        self._rows = self.cache.view(num_blocks, -1).view(torch.uint8)
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
        ids = torch.tensor(block_ids, dtype=torch.long)
        staging = gather_blocks(self.cache, ids, backend=self.kernel_backend)
        rows = staging.view(len(block_ids), -1).view(torch.uint8).numpy()
        return [memoryview(row).toreadonly() for row in rows]

    def write_blocks(self, block_ids: Sequence[int], buffers: Sequence[object]) -> None:
        """Copy whole blocks (bytes-like, ``block_bytes`` each) into the pool."""
        if self.cache.device.type == "cpu":
            # One copy from the tier's buffer into the pool row; no staging tensor on CPU.
            rows = self._rows.numpy()
            for block_id, buf in zip(block_ids, buffers):
                rows[block_id] = np.frombuffer(buf, dtype=np.uint8)  # type: ignore[call-overload]
            return
        staging = torch.stack([torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in buffers])
        staging = staging.view(self.cache.dtype).view(len(buffers), *self.block_shape)
        ids = torch.tensor(block_ids, dtype=torch.long)
        scatter_blocks(staging.to(self.cache.device), self.cache, ids, backend=self.kernel_backend)

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

    def payload_matches(self, dtype: str, shape: Sequence[int], nbytes: int) -> bool:
        """Whether a restored block has exactly this pool's block layout."""
        return (
            dtype == self.dtype_name
            and tuple(shape) == self.block_shape
            and nbytes == self.block_bytes
        )
