"""``linear`` for the engine's projections: oneDNN's matmul on CPU, ``F.linear`` elsewhere.

``F.linear`` on CPU tensors goes to the BLAS torch was built with (MKL in the x86 wheels). On
AMD CPUs MKL's sgemm reaches well under half of what oneDNN (which torch also ships, as
``mkldnn``) reaches on the same shapes, for decode steps and prefill chunks alike. vLLM-CPU calls
oneDNN for the same reason. Both are fp32 (or bf16) throughout; they differ only in the order of the
sums, by a float32 rounding or two.

``prepack`` reorders a weight once into oneDNN's blocked layout, as vLLM-CPU and torch's
inductor do: oneDNN otherwise reorders a plain weight on every call, which for a decode step's
few rows costs as much as the matmul itself (the weight is read twice).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

# fp16 is left to F.linear (oneDNN's CPU fp16 paths need AVX512-FP16); bf16 goes to oneDNN only
# on CPUs it has bf16 kernels for (``_onednn_dtypes``).
_FP32_ONLY = (torch.float32,)
_FP32_AND_BF16 = (torch.float32, torch.bfloat16)
# The row count oneDNN chooses a packed layout for; any row count works with it.
PACK_BATCH_HINT = 256


@functools.cache
def _onednn_linear() -> object | None:
    """``torch.ops.mkldnn._linear_pointwise`` where this torch has a working oneDNN."""
    if not torch.backends.mkldnn.is_available():
        return None
    return getattr(torch.ops.mkldnn, "_linear_pointwise", None)


@functools.cache
def _onednn_dtypes() -> tuple[torch.dtype, ...]:
    """The dtypes ``linear`` hands to oneDNN on this CPU.

    oneDNN refuses bf16 where the CPU has neither AVX512-BF16/AVX512 nor AMX: on an AVX2-only
    AMD EPYC its inner product raises "could not create a primitive descriptor" and its weight
    reorder "bf16 path needs the cpu support avx512bw, avx512vl and avx512dq". bf16 then takes
    ``F.linear``, which runs it everywhere.
    """
    supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    try:
        bf16 = bool(supported()) if supported is not None else False
    except RuntimeError:
        bf16 = False
    return _FP32_AND_BF16 if bf16 else _FP32_ONLY


def prepack(weight: torch.Tensor, batch_hint: int = PACK_BATCH_HINT) -> torch.Tensor:
    """``weight`` reordered once for oneDNN where ``linear`` would hand it to oneDNN.

    Args:
        weight: ``[out_features, in_features]``.
        batch_hint: the row count to choose the layout for.

    Returns:
        An opaque oneDNN tensor of the same shape and dtype that only ``linear`` reads (CPU,
        fp32, or bf16 where the CPU has oneDNN's bf16 kernels), or ``weight`` itself where it
        would take ``F.linear``.
    """
    reorder = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
    if (
        _onednn_linear() is None
        or reorder is None
        or weight.device.type != "cpu"
        or weight.dtype not in _onednn_dtypes()
        or weight.dim() != 2
    ):
        return weight
    try:
        return reorder(weight.contiguous(), batch_hint)
    except RuntimeError:  # a oneDNN build that cannot pack this shape: the plain path works
        return weight


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``, as ``F.linear``.

    Args:
        x: ``[..., in_features]``.
        weight: ``[out_features, in_features]``, plain or from ``prepack``.
        bias: ``[out_features]`` or ``None``.

    Returns:
        ``[..., out_features]`` in ``x``'s dtype.

    Raises:
        ValueError: a prepacked weight with ``x`` not on the CPU or of another dtype.
    """
    op = _onednn_linear()
    if weight.is_mkldnn:
        if op is None or x.device.type != "cpu" or x.dtype != weight.dtype:
            raise ValueError(
                f"a prepacked {weight.dtype} weight takes {weight.dtype} CPU inputs, got "
                f"{x.dtype} on {x.device}"
            )
        return op(x, weight, bias, "none", [], "")  # type: ignore[operator]
    if (
        op is None
        or x.device.type != "cpu"
        or x.dtype not in _onednn_dtypes()
        or weight.dtype != x.dtype
        or x.numel() == 0
    ):
        return F.linear(x, weight, bias)
    return op(x, weight, bias, "none", [], "")  # type: ignore[operator]
