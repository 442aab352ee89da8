"""vLLM's paged KV buffers as cachetier sees them: one record is one vLLM block, all layers.

A record's payload is the canonical block of ``cachetier.primitives.kv_format`` (``[num_layers, 2,
block_size, num_kv_heads, head_size]``, or one MLA latent plane), whatever vLLM backend and
device hold it: ``cachetier.connectors.vllm.layouts`` reads each backend's cells as views, and
``cachetier.kernels.staging`` moves blocks between those views and host memory (pinned and on a side
stream on CUDA; straight into per-block host tensors on CPU). So a block saved by vLLM restores
into our engine or HF, and back.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import torch

from cachetier.connectors.vllm.layouts import VllmArrangement
from cachetier.kernels.paged_layouts import PagedBlocks
from cachetier.kernels.staging import HostStaging, PendingSave
from cachetier.record import Buffer


class PagedKV:
    """The worker's KV buffers, one tensor per layer in model order, copied block by block.

    Args:
        kv_caches: vLLM's per-layer KV tensors by layer name (any device).
        layer_names: the layer names in model order (the order of layers in a record).
        arrangement: how this run's cells map onto canonical blocks; every tensor must match.
        staging_bytes: pinned host memory for CUDA copies.
    """

    def __init__(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        layer_names: Sequence[str],
        arrangement: VllmArrangement,
        *,
        staging_bytes: int = 256 << 20,
    ) -> None:
        missing = [name for name in layer_names if name not in kv_caches]
        if missing:
            raise ValueError(f"vLLM registered no KV cache for layers {missing}")
        self.layout = arrangement.layout
        self.shape = self.layout.payload_shape
        views = []
        for name in layer_names:
            try:
                views.append(arrangement.parts(kv_caches[name]))
            except ValueError as exc:
                raise ValueError(f"layer {name}: {exc}") from None
        self._blocks = PagedBlocks(views)
        self._staging = HostStaging(self._blocks, max_bytes=staging_bytes)
        self.device = self._blocks.device
        self.num_blocks = self._blocks.num_blocks
        self.block_bytes = self.layout.block_bytes

    def save(self, block_ids: Sequence[int], tag: object) -> None:
        """Start copying blocks out (``poll`` returns them, with ``tag``, once on the host)."""
        self._check_ids(block_ids)
        self._staging.save(block_ids, tag)

    def poll(self) -> list[PendingSave]:
        """Saves whose copies have finished (at once on CPU), oldest first; never waits."""
        return self._staging.poll()

    def fence(self) -> None:
        """Order the next forward after copies still reading pages (GPU-side only)."""
        self._staging.fence()

    def drain(self) -> list[PendingSave]:
        """Wait for every save in flight and return them."""
        return self._staging.drain()

    def gather(self, block_ids: Sequence[int]) -> list[torch.Tensor]:
        """Copy blocks out and wait: one host payload per block (each its own allocation, so a
        tier that keeps some of them frees the rest)."""
        self.save(block_ids, None)
        return [payload for pending in self.drain() for payload in pending.payloads]

    def write(self, block_ids: Sequence[int], payloads: Sequence[Buffer]) -> float:
        """Overwrite whole blocks of every layer with record payloads, and wait for it.

        Args:
            block_ids: vLLM block ids.
            payloads: one canonical payload per block, checked with ``check_record``; they are
                only read.

        Returns:
            Seconds the copy took, to its end. On a GPU that is the device's time from the
            copy's start to its end (host staging included), not a wait for saves still
            copying out before it (``fence``): the cost model weighs what a block costs to
            copy in, and the forward would wait for the copy anyway.
        """
        self._check_ids(block_ids)
        if self.device.type != "cuda":
            start = time.perf_counter()
            self._staging.load(block_ids, payloads)
            return time.perf_counter() - start
        began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        began.record()
        self._staging.load(block_ids, payloads)
        ended.record()
        ended.synchronize()
        return began.elapsed_time(ended) / 1e3

    def _check_ids(self, block_ids: Sequence[int]) -> None:
        bad = [b for b in block_ids if not 0 <= b < self.num_blocks]
        if bad:
            raise ValueError(f"block ids must be in [0, {self.num_blocks}), got {bad}")
