"""``linear`` for the engine's projections: oneDNN's matmul on CPU, ``F.linear`` elsewhere.

``F.linear`` on CPU tensors goes to the BLAS torch was built with (MKL in the x86 wheels). On
the AMD EPYC machines we measure on, MKL's sgemm runs at about 40% of what oneDNN (which torch
also ships, as ``mkldnn``) reaches on the same shapes: SmolLM2's 120 projections of one decode
step of 32 sequences took 71 ms through ``F.linear`` and 32 ms through oneDNN, and a 512-token
prefill chunk 580 ms against 245 ms. vLLM-CPU calls oneDNN for the same reason. Both are fp32
(or bf16) throughout; they differ only in the order of the sums, by a float32 rounding or two.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

# bf16 needs AVX512-BF16 or AMX for speed but is correct everywhere oneDNN runs; fp16 is left to
# F.linear (oneDNN's CPU fp16 paths need AVX512-FP16).
_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def _onednn_linear() -> object | None:
    """``torch.ops.mkldnn._linear_pointwise`` where this torch has a working oneDNN."""
    if not torch.backends.mkldnn.is_available():
        return None
    return getattr(torch.ops.mkldnn, "_linear_pointwise", None)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``, as ``F.linear``.

    Args:
        x: ``[..., in_features]``.
        weight: ``[out_features, in_features]``.
        bias: ``[out_features]`` or ``None``.

    Returns:
        ``[..., out_features]`` in ``x``'s dtype.
    """
    op = _onednn_linear()
    if (
        op is None
        or x.device.type != "cpu"
        or x.dtype not in _ONEDNN_DTYPES
        or weight.dtype != x.dtype
        or x.numel() == 0
    ):
        return F.linear(x, weight, bias)
    return op(x, weight, bias, "none", [], "")  # type: ignore[operator]
