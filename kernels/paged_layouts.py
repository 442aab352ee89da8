"""Every engine's paged KV memory as views of canonical blocks, and the copies between them.

An engine keeps KV in its own arrangement (``cachetier.kv_format`` has the one a record holds).
``PagedBlocks`` sees any of them as strided views, per layer one or more *parts*, each covering
consecutive planes (K then V, or the one MLA latent) of every block:

    part: [num_blocks, planes_in_part, block_size, num_kv_heads, head_dim]

made without copying from the engine's tensors, by naming their axes (``axes_view``: one part
with both planes) or, where K and V are not laid out alike (vLLM's CPU backend keeps K
transposed), by one part per plane. Gathering blocks into canonical payloads, or scattering
payloads back, is one strided copy per block and part, straight between the engine's memory and
the payload: no intermediate buffer. On CPU the copies run through numpy (a strided copy costs
a microsecond to start there, against ten for a torch op, and blocks are small); on CUDA as one
Triton kernel per part (``kernels.triton_layout_copy``); elsewhere as torch ``index_select`` /
``index_copy_``.

Axis names: ``block``, ``token``, ``slot`` (``block * block_size + token``, for pools indexed
by token), ``layer``, ``kv`` (K then V), ``head``, ``dim``, and ``kv_dim`` (K's ``dim``
elements then V's, fused into one axis). An arrangement without ``kv`` is MLA (one plane);
without ``head``, one head.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kernels.backend import resolve_backend
from kernels.pool_shape import check_index_range, check_tensor

AXES = ("block", "token", "slot", "layer", "kv", "head", "dim", "kv_dim")
_PART_AXES = ("block", "kv", "token", "head", "dim")
# numpy has no bfloat16 or fp8: the CPU copies move their bits as integers of the same width.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True, slots=True)
class BlockGeometry:
    """The sizes of one canonical block: ``[num_layers, planes, block_size, heads, head_dim]``."""

    num_layers: int
    planes: int
    block_size: int
    num_kv_heads: int
    head_dim: int

    @property
    def payload_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, self.planes, self.block_size, self.num_kv_heads, self.head_dim)


def axes_view(
    tensor: torch.Tensor, axes: Sequence[str], *, block_size: int, layer: int | None = None
) -> torch.Tensor:
    """One layer of ``tensor`` as one part: ``[num_blocks, planes, block_size, heads, dim]``.

    Args:
        tensor: the engine's KV tensor (any device, any strides).
        axes: one name of ``AXES`` per dimension of ``tensor``, in order.
        block_size: tokens per block (splits a ``slot`` axis; checks a ``token`` axis).
        layer: which layer to take when ``axes`` has ``layer``; ``None`` otherwise.

    Returns:
        A view sharing ``tensor``'s memory.

    Raises:
        ValueError: axes that do not name ``tensor``'s dimensions, a repeated or unknown name,
            no ``block`` axis, a layer out of range, or sizes that do not split.
    """
    axes = list(axes)
    unknown = [a for a in axes if a not in AXES]
    if unknown or len(set(axes)) != len(axes) or len(axes) != tensor.ndim:
        raise ValueError(
            f"axes {axes} must name each of the {tensor.ndim} dims of a tensor of shape "
            f"{tuple(tensor.shape)} once, from {AXES}"
        )
    view = tensor
    if "layer" in axes:
        at = axes.index("layer")
        if layer is None or not 0 <= layer < view.shape[at]:
            raise ValueError(f"layer must be in [0, {view.shape[at]}), got {layer}")
        view = view.select(at, layer)
        axes.pop(at)
    elif layer is not None:
        raise ValueError(f"axes {axes} have no layer axis; pass one tensor per layer")
    for fused, (outer, inner) in (("slot", ("block", "token")), ("kv_dim", ("kv", "dim"))):
        if fused in axes:
            at = axes.index(fused)
            size = view.shape[at]
            split = block_size if fused == "slot" else 2
            if size % split:
                raise ValueError(f"a {fused} axis of {size} does not split by {split}")
            sizes = (size // block_size, block_size) if fused == "slot" else (2, size // 2)
            view = view.unflatten(at, sizes)
            axes[at : at + 1] = [outer, inner]
    for missing in ("kv", "head"):
        if missing not in axes:
            view = view.unsqueeze(-1)
            axes.append(missing)
    if set(axes) != set(_PART_AXES):
        raise ValueError(f"axes {axes} lack one of {_PART_AXES}")
    view = view.permute(*(axes.index(a) for a in _PART_AXES))
    if view.shape[2] != block_size:
        raise ValueError(f"blocks hold {view.shape[2]} tokens, not {block_size}")
    if view.shape[1] > 2:
        raise ValueError(f"a kv axis holds K and V (or one MLA latent), not {view.shape[1]}")
    return view


class PagedBlocks:
    """An engine's paged KV, per layer its parts, copied block by block to canonical payloads.

    Args:
        layers: per layer in model order, its parts in plane order (``axes_view``'s one part,
            or one ``[num_blocks, 1, block_size, heads, dim]`` part per plane); every layer
            with the same planes, and all of one dtype, device and geometry.
    """

    def __init__(self, layers: Sequence[Sequence[torch.Tensor]]) -> None:
        if not layers or not layers[0]:
            raise ValueError("a paged KV needs at least one layer and one part")
        first = layers[0][0]
        plane_counts = [part.shape[1] for part in layers[0]]
        for index, parts in enumerate(layers):
            if [part.shape[1] for part in parts] != plane_counts:
                raise ValueError(f"layer {index} has other planes than layer 0")
            for part in parts:
                check_tensor(f"layer {index}", part, ndim=5, dtypes=(first.dtype,))
                if part.shape[2:] != first.shape[2:] or part.device != first.device:
                    raise ValueError(
                        f"layer {index} is {tuple(part.shape)} on {part.device}, layer 0 "
                        f"{tuple(first.shape)} on {first.device}"
                    )
        self.layers = [list(parts) for parts in layers]
        self.dtype = first.dtype
        self.device = first.device
        self.num_blocks = min(part.shape[0] for parts in layers for part in parts)
        block_size, heads, dim = first.shape[2:]
        planes = sum(plane_counts)
        self.geometry = BlockGeometry(len(layers), planes, block_size, heads, dim)
        # Where each part's planes start inside a layer of the payload.
        self._starts = [sum(plane_counts[:i]) for i in range(len(plane_counts))]

    def gather(
        self, block_ids: torch.Tensor, out: torch.Tensor, *, backend: str = "auto"
    ) -> torch.Tensor:
        """Copy blocks into canonical payloads: ``out[i] = block block_ids[i]``, all layers.

        Args:
            block_ids: ``[n]`` int32/int64 block ids (repeats allowed).
            out: ``[n, *payload_shape]`` contiguous, this dtype and device.
            backend: ``"auto"``, ``"torch"`` or ``"triton"`` (``kernels.backend``).

        Returns:
            ``out``.
        """
        self._copy(block_ids, out, "out", backend, gather=True)
        return out

    def scatter(
        self, block_ids: torch.Tensor, payloads: torch.Tensor, *, backend: str = "auto"
    ) -> None:
        """Copy canonical payloads into blocks: block ``block_ids[i]`` = ``payloads[i]``.

        Args:
            block_ids: ``[n]`` distinct int32/int64 block ids.
            payloads: ``[n, *payload_shape]``, contiguous, this dtype and device.
            backend: ``"auto"``, ``"torch"`` or ``"triton"``.
        """
        if torch.unique(block_ids).numel() != block_ids.numel():
            raise ValueError("block ids to scatter into must be distinct")
        self._copy(block_ids, payloads, "payloads", backend, gather=False)

    def _copy(
        self,
        block_ids: torch.Tensor,
        payloads: torch.Tensor,
        name: str,
        backend: str,
        *,
        gather: bool,
    ) -> None:
        ids = self._check(block_ids, payloads, name)
        how = resolve_backend(backend, payloads, ids)
        if how == "triton":
            from kernels.triton_layout_copy import copy_part_blocks

            for layer, parts in enumerate(self.layers):
                for start, part in zip(self._starts, parts):
                    copy_part_blocks(part, payloads, ids, layer, start, gather=gather)
        elif self.device.type == "cpu":
            self._copy_numpy(ids.tolist(), payloads, gather=gather)
        else:
            for layer, parts in enumerate(self.layers):
                for start, part in zip(self._starts, parts):
                    dst = payloads[:, layer, start : start + part.shape[1]]
                    if gather:
                        torch.index_select(part, 0, ids, out=dst)
                    else:
                        part.index_copy_(0, ids, dst)

    def _copy_numpy(self, ids: list[int], payloads: torch.Tensor, *, gather: bool) -> None:
        bits = _BITS[self.dtype.itemsize]
        flat = payloads.view(bits).numpy()
        for layer, parts in enumerate(self.layers):
            for start, part in zip(self._starts, parts):
                pages = part.view(bits).numpy()
                # Walk each block in the page's memory order (reads or writes of the page
                # sequential, the payload side strided): measured faster than payload order.
                order = tuple(np.argsort([-abs(x) for x in pages.strides[1:]], kind="stable"))
                stop = start + part.shape[1]
                for i, block in enumerate(ids):
                    page = pages[block].transpose(order)
                    payload = flat[i, layer, start:stop].transpose(order)
                    if gather:
                        np.copyto(payload, page)
                    else:
                        np.copyto(page, payload)

    def _check(self, block_ids: torch.Tensor, payloads: torch.Tensor, name: str) -> torch.Tensor:
        check_tensor("block_ids", block_ids, ndim=1, dtypes=(torch.int32, torch.int64))
        check_index_range("block_ids", block_ids, 0, self.num_blocks)
        check_tensor(name, payloads, ndim=6, dtypes=(self.dtype,))
        expected = (block_ids.shape[0], *self.geometry.payload_shape)
        if tuple(payloads.shape) != expected:
            raise ValueError(f"{name} must have shape {expected}, got {tuple(payloads.shape)}")
        if payloads.device != self.device:
            raise ValueError(f"{name} is on {payloads.device}, the pages on {self.device}")
        if not payloads.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        return block_ids.to(device=self.device, dtype=torch.long)
