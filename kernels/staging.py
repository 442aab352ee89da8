"""Moving canonical payloads between an engine's paged KV (any device) and host memory.

On CPU a save gathers each block straight into its own host tensor and a load scatters tier
bytes straight into the pages: no staging at all. On CUDA:

- a save gathers blocks on the device into one contiguous batch (the Triton kernel), then
  copies it into a pinned host buffer on a side stream that first waits for an event recorded
  on the compute stream. Nothing on the host waits: ``poll`` hands back the saves whose copy
  event has fired, and ``fence`` makes the compute stream wait (on the GPU, not the host) for
  every copy still reading pages, so a page freed and reused later is never overwritten under
  a copy.
- a load copies tier bytes into a pinned buffer, then ``non_blocking`` to the device on the
  compute stream and scatters there, so the forward that reads the pages runs after them.

Pinned memory is a bounded pool of buffers (``max_bytes``), reused; a batch larger than one
buffer is split. A buffer returns to the pool once its copy event has fired.
"""

from __future__ import annotations

import warnings
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cachetier.kernels.paged_layouts import PagedBlocks


@dataclass(slots=True)
class PendingSave:
    """A save whose device-to-host copy may still be running.

    Args:
        tag: the caller's handle (e.g. its request and keys), returned by ``poll``.
        payloads: one host tensor per block, valid once ``done``.
    """

    tag: object
    payloads: list[torch.Tensor]
    event: object | None = None
    buffer: torch.Tensor | None = None

    def done(self) -> bool:
        return self.event is None or bool(self.event.query())  # type: ignore[attr-defined]


class HostStaging:
    """Saves and loads of canonical blocks for one ``PagedBlocks`` (see the module docstring).

    Args:
        paged: the engine's KV views.
        max_bytes: pinned host memory this may hold (CUDA only); at least one block.
    """

    def __init__(self, paged: PagedBlocks, *, max_bytes: int = 256 << 20) -> None:
        self.paged = paged
        shape = paged.geometry.payload_shape
        self.payload_shape = shape
        self.block_bytes = paged.dtype.itemsize * int(torch.Size(shape).numel())
        self.cuda = paged.device.type == "cuda"
        self._pending: deque[PendingSave] = deque()
        self._ready: list[PendingSave] = []  # finished saves taken while waiting for a buffer
        self._loads: deque[tuple[torch.cuda.Event, torch.Tensor]] = deque()
        self._free: list[torch.Tensor] = []
        if self.cuda:
            if max_bytes < self.block_bytes:
                raise ValueError(f"max_bytes {max_bytes} is less than one block")
            self._blocks_per_buffer = max(1, min(64, max_bytes // self.block_bytes // 4))
            self._num_buffers = max(1, max_bytes // (self._blocks_per_buffer * self.block_bytes))
            self._allocated = 0
            self._stream = torch.cuda.Stream(device=paged.device)

    def save(self, block_ids: Sequence[int], tag: object) -> None:
        """Start copying blocks to the host; ``poll`` returns them when they are there."""
        if not self.cuda:
            # One allocation per block: a tier that keeps some of them frees the rest.
            payloads = [torch.empty(self.payload_shape, dtype=self.paged.dtype) for _ in block_ids]
            self.paged.gather_each(block_ids, payloads)
            self._pending.append(PendingSave(tag, payloads))
            return
        ids = torch.tensor(list(block_ids), dtype=torch.long)
        for chunk in ids.split(self._blocks_per_buffer):
            self._save_chunk(chunk, tag)

    def poll(self) -> list[PendingSave]:
        """Saves whose copies have finished, oldest first (never waits)."""
        done, self._ready = self._ready, []
        while self._pending and self._pending[0].done():
            pending = self._pending.popleft()
            if pending.buffer is not None:
                # Host tensors of their own: the pinned buffer goes back to the pool.
                pending.payloads = [p.clone() for p in pending.payloads]
                self._free.append(pending.buffer)
                pending.buffer = None
            done.append(pending)
        return done

    def fence(self) -> None:
        """Make the compute stream wait for copies still reading pages (GPU-side, no host
        wait): call before a forward that may write pages a save is reading."""
        if self.cuda and self._pending:
            torch.cuda.current_stream(self.paged.device).wait_event(self._pending[-1].event)

    def drain(self) -> list[PendingSave]:
        """Wait for every save in flight and return them (shutdown, tests)."""
        for pending in self._pending:
            if pending.event is not None:
                pending.event.synchronize()  # type: ignore[attr-defined]
        return self.poll()

    def load(self, block_ids: Sequence[int], payloads: Sequence[object]) -> None:
        """Copy tier payloads (bytes-like, canonical, one per block) into the pages."""
        if len(payloads) != len(block_ids):
            raise ValueError(f"{len(payloads)} payloads for {len(block_ids)} blocks")
        sources = [payload_tensor(p, self.paged.dtype, self.payload_shape) for p in payloads]
        if not self.cuda:
            # Straight from the tier's bytes into the pages.
            self.paged.scatter_each(block_ids, sources)
            return
        ids = torch.tensor(list(block_ids), dtype=torch.long)
        for start in range(0, len(sources), self._blocks_per_buffer):
            chunk = sources[start : start + self._blocks_per_buffer]
            buffer = self._buffer_for()
            for row, source in zip(buffer, chunk):
                row.copy_(source)
            device = buffer[: len(chunk)].to(self.paged.device, non_blocking=True)
            chunk_ids = ids[start : start + len(chunk)].to(self.paged.device, non_blocking=True)
            self.paged.scatter(chunk_ids, device)
            event = torch.cuda.Event()
            event.record()
            # The pinned buffer is reusable once the host-to-device copy has read it.
            self._loads.append((event, buffer))

    def _save_chunk(self, ids: torch.Tensor, tag: object) -> None:
        device = self.paged.device
        staged = torch.empty(len(ids), *self.payload_shape, dtype=self.paged.dtype, device=device)
        device_ids = ids.to(device, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()  # after the forward that wrote the pages
        buffer = self._buffer_for()
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(ready)
            self.paged.gather(device_ids, staged)
            buffer[: len(ids)].copy_(staged, non_blocking=True)
            staged.record_stream(self._stream)
            device_ids.record_stream(self._stream)
            done = torch.cuda.Event()
            done.record(self._stream)
        self._pending.append(PendingSave(tag, list(buffer[: len(ids)].unbind(0)), done, buffer))

    def _buffer_for(self) -> torch.Tensor:
        """A free pinned buffer of ``_blocks_per_buffer`` blocks, waiting for one if the pool
        is spent (bounded memory over an unbounded queue)."""
        while True:
            while self._loads and bool(self._loads[0][0].query()):
                self._free.append(self._loads.popleft()[1])
            if self._free:
                return self._free.pop()
            if self._allocated < self._num_buffers:
                self._allocated += 1
                return torch.empty(
                    self._blocks_per_buffer,
                    *self.payload_shape,
                    dtype=self.paged.dtype,
                    pin_memory=True,
                )
            if self._loads:
                self._loads[0][0].synchronize()
            else:
                self._pending[0].event.synchronize()  # type: ignore[union-attr]
                # poll() hands back (and empties) _ready with what it finished: assign, not
                # `self._ready.extend(self.poll())`, which extends the list poll just swapped
                # out and so dropped every save finished while waiting for a buffer.
                self._ready = self.poll()


def payload_view(payload: torch.Tensor) -> memoryview:
    """A read-only byte view of one saved host payload (no copy), for a record.

    The view keeps the tensor alive; nothing writes to it afterwards, which is what lets a CPU
    tier keep the view without copying it.

    Args:
        payload: one block of every layer, contiguous, on the host.

    Returns:
        Its bytes.
    """
    return memoryview(payload.view(torch.uint8).reshape(-1).numpy()).toreadonly()


def payload_tensor(payload: object, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tier's payload bytes (or a tensor) as a host tensor of ``shape``, without a copy.

    Args:
        payload: a tensor, or a bytes-like record payload (read-only views are fine: the
            tensor is only read).
        dtype: the element type.
        shape: the payload's shape.

    Returns:
        A tensor over the same memory.

    Raises:
        ValueError: the payload's size is not that of ``shape``.
    """
    if isinstance(payload, torch.Tensor):
        return payload.reshape(shape)
    view = memoryview(payload)  # type: ignore[arg-type]
    expected = dtype.itemsize * int(torch.Size(shape).numel())
    if view.nbytes != expected:
        raise ValueError(f"a payload of {view.nbytes} bytes, not {expected}")
    with warnings.catch_warnings():
        # torch warns that a read-only buffer (a tier's bytes) is not writable; it is only read.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(view, dtype=dtype).view(shape)
