"""vLLM's paged KV tensors as canonical-block views (``cachetier.kernels.paged_layouts``), per
backend.

vLLM hands the connector one tensor per attention layer, the logical page ``[num_blocks,
num_kv_heads, block_size, C]`` of ``vllm.v1.kv_cache_interface.create_kv_cache_views``, whose
physical strides follow the run's ``KVCacheLayout`` (``LBHNC``, ``BLNHC``, ...). Taking strides
from the tensor, not from a table, is what keeps every physical layout right. What a cell's C
elements hold is the backend's business, and is read here the way the backend reads it:

- CUDA attention (FlashAttention, FlashInfer, Triton): ``kv.transpose(1, 2).split(head_size,
  dim=-1)``, K's ``head_size`` elements then V's, per token and head.
- MLA (DeepSeek): one latent vector per token (``C`` = ``kv_lora_rank + rope dim``), one head.
- CPU (``cpu_attn``): a block is read as ``[heads, 2 * block_size, head_size]``, K rows then V
  rows (``kv.view(B, H, 2 * N, D).chunk(2, dim=2)``), and the C++ kernels of the ``"vec"`` ISA
  keep K transposed inside it (``[head_size, block_size]`` per head, token innermost) and V as
  is. Other CPU ISAs (``"amx"``, ``"neon"``, ...) pack K in ways this module does not know, so
  their blocks are stored whole under a ``native:`` arrangement: restorable by vLLM on the same
  ISA only, never mistaken for canonical blocks.

``tests/connectors/test_vllm_layouts.py`` builds pages with vLLM's own allocator for every
``KVCacheLayout`` and checks the reads above against vLLM's backend source, so a change in vLLM
fails there; the CPU reading is checked end to end against HF's KV (``test_cross_engine.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from cachetier.kernels.paged_layouts import axes_view
from cachetier.primitives.keys import KVLayout, dtype_name
from cachetier.primitives.kv_format import (
    CANONICAL_ARRANGEMENT,
    MLA_ARRANGEMENT,
    NATIVE_PREFIX,
    SCALE_DTYPE,
    planes,
)

CUDA_KV = "cuda-kv"
MLA = "mla"
CPU_VEC = "cpu-vec"
KNOWN_CPU_ISAS = ("vec",)


@dataclass(frozen=True, slots=True)
class VllmArrangement:
    """How one vLLM run's KV cells map onto canonical blocks.

    Args:
        kind: ``CUDA_KV``, ``MLA``, ``CPU_VEC``, or ``native:<what>`` for a layout stored whole.
        layout: the namespace layout of its records (canonical unless ``kind`` is native).
    """

    kind: str
    layout: KVLayout

    def parts(self, kv: torch.Tensor) -> list[torch.Tensor]:
        """One layer as ``cachetier.kernels.paged_layouts`` parts sharing ``kv``'s memory: K and V
        in one part, or (vLLM-CPU, K and V laid out differently) one part each.

        Args:
            kv: vLLM's tensor for the layer, ``[num_blocks, heads, block_size, C]`` (MLA:
                ``heads`` 1, or no heads axis).
        """
        layout = self.layout
        heads, bs, dim = layout.num_kv_heads, layout.block_size, layout.head_dim
        if self.kind == MLA:
            cells = kv if kv.ndim == 3 else kv.squeeze(1)  # [B, N, C]
            self._check(cells, (bs, dim))
            return [axes_view(cells, ("block", "token", "dim"), block_size=bs)]
        if self.kind.startswith(NATIVE_PREFIX):
            # The block's cells as they are: one plane of [tokens, heads, C] (head_dim is C).
            self._check(kv, (heads, bs, dim))
            return [axes_view(kv, ("block", "head", "token", "dim"), block_size=bs)]
        self._check(kv, (heads, bs, 2 * dim))
        if self.kind == CUDA_KV:
            return [axes_view(kv, ("block", "head", "token", "kv_dim"), block_size=bs)]
        if self.kind == CPU_VEC:
            # view, not reshape: a page whose block is not one run must fail, not be copied.
            rows = kv.view(kv.shape[0], heads, 2, bs * dim)
            key = rows[:, :, 0].unflatten(2, (dim, bs))  # [B, H, D, N]: token innermost
            value = rows[:, :, 1].unflatten(2, (bs, dim))  # [B, H, N, D]
            return [
                axes_view(key, ("block", "head", "dim", "token"), block_size=bs),
                axes_view(value, ("block", "head", "token", "dim"), block_size=bs),
            ]
        raise ValueError(f"unknown vLLM KV arrangement {self.kind!r}")

    def _check(self, kv: torch.Tensor, cell: tuple[int, ...]) -> None:
        if tuple(kv.shape[1:]) != cell or dtype_name(kv.dtype) != self.layout.dtype:
            raise ValueError(
                f"vLLM KV tensor is {tuple(kv.shape)} {kv.dtype}; expected [num_blocks, "
                f"{', '.join(map(str, cell))}] {self.layout.dtype} for the {self.kind} layout"
            )


def resolve(
    *,
    device_type: str,
    is_mla: bool,
    dtype: torch.dtype,
    block_size: int,
    num_layers: int,
    num_kv_heads: int,
    head_size: int,
    kv_cache_dtype: str = "auto",
) -> VllmArrangement:
    """The arrangement of a vLLM run's KV, from its platform and attention spec.

    Args:
        device_type: ``current_platform.device_type`` (``"cpu"``, ``"cuda"``, ...).
        is_mla: the KV spec is an ``MLAAttentionSpec``.
        dtype: the KV cache's torch dtype.
        block_size: tokens per vLLM block.
        num_layers: attention layers.
        num_kv_heads: KV heads per layer (1 for MLA).
        head_size: elements per head (the latent size for MLA).
        kv_cache_dtype: vLLM's ``cache_dtype`` string (``"auto"``, ``"fp8_e4m3"``, ...).

    Returns:
        The arrangement.

    Raises:
        ValueError: a platform or spec no reading is known for (never a guessed one).
    """
    name = dtype_name(dtype)

    def layout(arrangement: str, heads: int, dim: int) -> KVLayout:
        return KVLayout(name, block_size, num_layers, heads, dim, arrangement=arrangement)

    if is_mla:
        if device_type != "cuda":
            raise ValueError(f"MLA KV on {device_type} is not supported by CacheTierConnector")
        return VllmArrangement(MLA, layout(MLA_ARRANGEMENT, 1, head_size))
    if device_type == "cuda":
        return VllmArrangement(CUDA_KV, layout(CANONICAL_ARRANGEMENT, num_kv_heads, head_size))
    if device_type != "cpu":
        raise ValueError(f"CacheTierConnector does not know vLLM's {device_type} KV layout")
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(dtype, block_size, head_size, kv_cache_dtype)
    if isa in KNOWN_CPU_ISAS:
        return VllmArrangement(CPU_VEC, layout(CANONICAL_ARRANGEMENT, num_kv_heads, head_size))
    native = f"{NATIVE_PREFIX}vllm-cpu-{isa}"
    return VllmArrangement(native, layout(native, num_kv_heads, 2 * head_size))


def fp8_scales(vllm_config: Any, layer_names: Sequence[str], layout: KVLayout) -> bytes:
    """Every record's ``aux`` for this run: the layers' fp8 scales, ``b""`` for unscaled KV.

    vLLM keeps one K and one V scale per layer (``_k_scale_float``, ``_v_scale_float``); a
    canonical fp8 block carries its scales (``cachetier.primitives.kv_format``), so this run writes
    them into every record and refuses records with others (they would decode to other values).

    Args:
        vllm_config: the engine's config (its forward context holds the attention layers).
        layer_names: attention layers in model order.
        layout: the records' layout.

    Returns:
        ``[num_layers, planes]`` little-endian float32 bytes, or ``b""``.
    """
    if not layout.dtype.startswith("float8"):
        return b""
    context = vllm_config.compilation_config.static_forward_context
    rows = []
    for name in layer_names:
        layer = context[name]
        row = [float(layer._k_scale_float), float(layer._v_scale_float)]
        rows.append(row[: planes(layout.arrangement)])
    return np.asarray(rows, dtype=SCALE_DTYPE).tobytes()
