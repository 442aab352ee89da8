"""Every engine's paged KV memory as views of canonical blocks, and the copies between them.

An engine keeps KV in its own arrangement (``cachetier.primitives.kv_format`` has the one a record
holds). ``PagedBlocks`` sees any of them as strided views, per layer one or more *parts*, each
covering
consecutive planes (K then V, or the one MLA latent) of every block:

    part: [num_blocks, planes_in_part, block_size, num_kv_heads, head_dim]

made without copying from the engine's tensors, by naming their axes (``axes_view``: one part
with both planes) or, where K and V are not laid out alike (vLLM's CPU backend keeps K
transposed), by one part per plane. Gathering blocks into canonical payloads, or scattering
payloads back, is one strided copy per block and part, straight between the engine's memory and
the payload: no intermediate buffer. On CPU the copies run through numpy (a strided copy costs
a microsecond to start there, against ten for a torch op, and blocks are small); on CUDA as one
Triton launch per group of alike parts, usually one for all layers
(``cachetier.kernels.triton_layout_copy``); elsewhere as torch ``index_select`` / ``index_copy_``.

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

from cachetier.kernels.backend import resolve_backend
from cachetier.kernels.pool_shape import check_index_range, check_tensor

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


@dataclass(frozen=True, slots=True)
class _PartGroup:
    """Parts copied by one Triton launch: where each lies from the first, in elements, and
    where its planes start in a payload (both on the parts' device)."""

    parts: list[torch.Tensor]
    offsets: torch.Tensor
    starts: torch.Tensor


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
        self._groups: list[_HostGroup] | None = None
        # The Triton copy's groups of alike parts, made on its first call.
        self._launch: list[_PartGroup] | None = None

    def gather(
        self, block_ids: torch.Tensor, out: torch.Tensor, *, backend: str = "auto"
    ) -> torch.Tensor:
        """Copy blocks into canonical payloads: ``out[i] = block block_ids[i]``, all layers.

        Args:
            block_ids: ``[n]`` int32/int64 block ids (repeats allowed).
            out: ``[n, *payload_shape]`` contiguous, this dtype and device.
            backend: ``"auto"``, ``"torch"`` or ``"triton"`` (``cachetier.kernels.backend``).

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
            self._copy_triton(ids, payloads, gather=gather)
        elif self.device.type == "cpu":
            self._copy_host(ids.tolist(), list(payloads.unbind(0)), gather=gather)
        else:
            for layer, parts in enumerate(self.layers):
                for start, part in zip(self._starts, parts):
                    dst = payloads[:, layer, start : start + part.shape[1]]
                    if gather:
                        torch.index_select(part, 0, ids, out=dst)
                    else:
                        part.index_copy_(0, ids, dst)

    def _copy_triton(self, ids: torch.Tensor, payloads: torch.Tensor, *, gather: bool) -> None:
        from cachetier.kernels.triton_layout_copy import copy_parts

        for group in self._triton_groups():
            copy_parts(group.parts, group.offsets, group.starts, payloads, ids, gather=gather)

    def _triton_groups(self) -> list[_PartGroup]:
        """The parts by per-block shape and strides, one Triton launch each, with where each
        part lies and where its planes go in a payload (pages never move: made once)."""
        if self._launch is None:
            from cachetier.kernels.triton_layout_copy import part_offsets

            g = self.geometry
            plane_numel = g.block_size * g.num_kv_heads * g.head_dim
            alike: dict[tuple, list[tuple[torch.Tensor, int]]] = {}
            for layer, parts in enumerate(self.layers):
                for start, part in zip(self._starts, parts):
                    key = (tuple(part.shape[1:]), part.stride())
                    at = (layer * g.planes + start) * plane_numel
                    alike.setdefault(key, []).append((part, at))
            self._launch = [
                _PartGroup(
                    [part for part, _ in members],
                    part_offsets([part for part, _ in members]),
                    torch.tensor([at for _, at in members], dtype=torch.int64, device=self.device),
                )
                for members in alike.values()
            ]
        return self._launch

    def gather_each(self, block_ids: Sequence[int], outs: Sequence[torch.Tensor]) -> None:
        """``gather`` into separate payload tensors, one per block (CPU pages only).

        Args:
            block_ids: block ids, one per payload.
            outs: contiguous ``payload_shape`` host tensors of this dtype, written.
        """
        self._copy_each(block_ids, outs, gather=True)

    def scatter_each(self, block_ids: Sequence[int], payloads: Sequence[torch.Tensor]) -> None:
        """``scatter`` from separate payload tensors (e.g. views of tier buffers; CPU pages).

        Args:
            block_ids: distinct block ids, one per payload.
            payloads: contiguous ``payload_shape`` host tensors of this dtype, only read.
        """
        if len(set(block_ids)) != len(block_ids):
            raise ValueError("block ids to scatter into must be distinct")
        self._copy_each(block_ids, payloads, gather=False)

    def _copy_each(
        self, block_ids: Sequence[int], payloads: Sequence[torch.Tensor], *, gather: bool
    ) -> None:
        if self.device.type != "cpu":
            raise ValueError(f"per-block payloads are for CPU pages; these are on {self.device}")
        if len(payloads) != len(block_ids):
            raise ValueError(f"{len(payloads)} payloads for {len(block_ids)} blocks")
        ids = [int(b) for b in block_ids]
        if any(not 0 <= b < self.num_blocks for b in ids):
            raise ValueError(f"block ids must be in [0, {self.num_blocks}), got {ids}")
        shape = self.geometry.payload_shape
        for payload in payloads:
            if (
                payload.dtype != self.dtype
                or tuple(payload.shape) != shape
                or not payload.is_contiguous()
                or payload.device.type != "cpu"
            ):
                raise ValueError(
                    f"a payload is {payload.dtype} {tuple(payload.shape)} on "
                    f"{payload.device}; expected contiguous {self.dtype} {shape} on the host"
                )
        self._copy_host(ids, payloads, gather=gather)

    def _copy_host(self, ids: list[int], payloads: Sequence[torch.Tensor], *, gather: bool) -> None:
        """Copies on the host, one per block and group: numpy's for small blocks (a strided
        copy starts several times sooner there than in torch), torch's for large ones (its kernels
        move a 1.4 MiB SGLang page, a transposition of 384-byte runs, at memcpy speed on two
        threads; numpy's at half of it: measured)."""
        flat: list[np.ndarray] | None = None
        for group in self._host_groups():
            pages, order, layers, start, stop = group.numpy
            if group.block_bytes >= _TORCH_COPY_BYTES:
                for payload, block in zip(payloads, ids):
                    page, plane = group.tensor[block], payload[layers, start:stop]
                    (plane if gather else page).copy_(page if gather else plane)
                continue
            if flat is None:
                bits = _BITS[self.dtype.itemsize]
                flat = [p.view(bits).numpy() for p in payloads]
            # One thread: spreading layers over cores was measured slower (each copy is
            # short, and the Python between them holds the GIL).
            for payload, block in zip(flat, ids):
                page = pages[block].transpose(order)
                plane = payload[layers, start:stop].transpose(order)
                if gather:
                    np.copyto(plane, page)
                else:
                    np.copyto(page, plane)

    def _host_groups(self) -> list[_HostGroup]:
        """The parts as ``[blocks, layers, planes, tokens, heads, dim]`` views, each with the
        layers and planes of a payload it covers. Built once.

        Where every layer's part is one buffer at a fixed distance from the last (SGLang's
        host pools, our engine's pool), the layers become one more axis of a single view, so a
        block is one copy instead of one per layer.
        """
        if self._groups is None:
            # Built in a local list and published whole: copies on other threads may look at
            # ``_groups`` meanwhile, and must never see a partial list.
            bits = _BITS[self.dtype.itemsize]
            groups: list[_HostGroup] = []
            for index, start in enumerate(self._starts):
                parts = [layer_parts[index] for layer_parts in self.layers]
                stop = start + parts[0].shape[1]
                step = _uniform_layer_step(parts)
                if step is not None:
                    first = parts[0]
                    tensor = first.as_strided(
                        (first.shape[0], len(parts), *first.shape[1:]),
                        (first.stride(0), step, *first.stride()[1:]),
                    )
                    groups.append(_HostGroup(tensor, bits, slice(None), start, stop))
                    continue
                for layer, part in enumerate(parts):
                    group = _HostGroup(part[:, None], bits, slice(layer, layer + 1), start, stop)
                    groups.append(group)
            self._groups = groups
        return self._groups

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


# Bytes of one block of one group from which torch's copy beats numpy's (measured between a
# 49 KiB vLLM layer block, numpy's, and a 1.4 MiB SGLang page, torch's).
_TORCH_COPY_BYTES = 256 << 10


class _HostGroup:
    """One group of host pages: ``tensor`` ``[blocks, layers, planes, tokens, heads, dim]``,
    its numpy view of the bits with the order to walk a block in (the page's memory order:
    page side sequential, payload side strided, measured faster than the payload's), and the
    payload's layers and planes it covers."""

    def __init__(
        self, tensor: torch.Tensor, bits: torch.dtype, layers: slice, start: int, stop: int
    ) -> None:
        self.tensor = tensor
        pages = tensor.view(bits).numpy()
        strides = [-abs(x) for x in pages.strides[1:]]
        order = tuple(int(i) for i in np.argsort(strides, kind="stable"))
        self.numpy = (pages, order, layers, start, stop)
        self.block_bytes = tensor[0].numel() * tensor.element_size()


def _uniform_layer_step(parts: Sequence[torch.Tensor]) -> int | None:
    """Elements from one layer's part to the next when all are the same view of one buffer
    at a fixed distance (so one strided view holds them all), else ``None``."""
    if len(parts) < 2:
        return None
    first = parts[0]
    storage = first.untyped_storage().data_ptr()
    for part in parts[1:]:
        if (
            part.untyped_storage().data_ptr() != storage
            or part.shape != first.shape
            or part.stride() != first.stride()
        ):
            return None
    step = parts[1].storage_offset() - first.storage_offset()
    offsets = [part.storage_offset() for part in parts]
    if step == 0 or any(b - a != step for a, b in zip(offsets, offsets[1:])):
        return None
    return step
